"""p2pcoll: asyncio peer-to-peer collective communication over ZeroMQ.

    async with p2pcoll.join("tcp://10.0.0.1:29500", world_size=4) as g:
        grads = await g.allreduce(grads, op="avg")
"""

from .api import Group, form_group, join
from .errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    GroupBroken,
    NonFiniteInput,
    P2PCollError,
    PeerLost,
    PluginValidationError,
    ProtocolError,
    RendezvousError,
    ReplicaDivergence,
    SettingsError,
    StrategyError,
    UnknownCodec,
    UnknownStrategy,
)
from .registry import available_strategies, register_strategy
from .session.failure import GroupState
from .settings import Settings
from .types import CustomOp, Membership, ReduceOp

__version__ = "0.11.0"

__all__ = [
    "CollectiveMismatch",
    "CollectiveTimeout",
    "CustomOp",
    "Group",
    "GroupBroken",
    "GroupState",
    "Membership",
    "NonFiniteInput",
    "P2PCollError",
    "PeerLost",
    "PluginValidationError",
    "ProtocolError",
    "ReduceOp",
    "RendezvousError",
    "ReplicaDivergence",
    "Settings",
    "SettingsError",
    "StrategyError",
    "UnknownCodec",
    "UnknownStrategy",
    "available_strategies",
    "blocking",
    "form_group",
    "join",
    "register_strategy",
    "training",
]


def __getattr__(name: str) -> object:
    # p2pcoll.training and p2pcoll.blocking are imported on first use, so `import p2pcoll`
    # stays light (and starts no exit hook).
    if name in ("training", "blocking"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
