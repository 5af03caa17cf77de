"""p2pcoll: asyncio peer-to-peer collective communication over ZeroMQ.

    async with p2pcoll.join("tcp://10.0.0.1:29500", world_size=4) as g:
        grads = await g.allreduce(grads, op="avg")
"""

from typing import TYPE_CHECKING

from .lazy import lazy_names
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

if TYPE_CHECKING:
    from . import blocking, training
    from .api.group import Group
    from .api.join import form_group, join
    from .registry import available_strategies, register_strategy
    from .session.failure import GroupState
    from .settings import Settings
    from .types import CustomOp, Membership, ReduceOp

__version__ = "0.23.0"

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


# Where each name that is not imported eagerly lives: everything but the errors is imported
# on first use, so that `import p2pcoll.departures` (or p2pcoll.errors) loads no ZeroMQ and
# no event loop, and `import p2pcoll` stays light (and starts no exit hook).
_LAZY = {
    "Group": ".api", "form_group": ".api", "join": ".api",
    "available_strategies": ".registry", "register_strategy": ".registry",
    "GroupState": ".session.failure",
    "Settings": ".settings",
    "CustomOp": ".types", "Membership": ".types", "ReduceOp": ".types",
}
__getattr__, __dir__ = lazy_names(__name__, globals(), _LAZY, modules=("training", "blocking"))
