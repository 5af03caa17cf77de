"""The session layer: one membership epoch of a group (``session``), how it forms
(``forming``), what incoming control messages do (``control``), the record of departed
peers (``peers``) and the failure model and group state (``failure``)."""

from .failure import FailureModel, GroupState
from .session import Session

__all__ = ["FailureModel", "GroupState", "Session"]
