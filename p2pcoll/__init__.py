"""p2pcoll: asyncio peer-to-peer collective communication over ZeroMQ.

    async with p2pcoll.join("tcp://10.0.0.1:29500", world_size=4) as g:
        grads = await g.allreduce(grads, op="avg")
"""

from .errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    GroupBroken,
    P2PCollError,
    PeerLost,
    PluginValidationError,
    ProtocolError,
    RendezvousError,
    ReplicaDivergence,
    StrategyError,
    UnknownStrategy,
)
from . import training
from .group import Group, join
from .registry import available_strategies, register_strategy
from .types import Membership, ReduceOp

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatch",
    "CollectiveTimeout",
    "Group",
    "GroupBroken",
    "Membership",
    "P2PCollError",
    "PeerLost",
    "PluginValidationError",
    "ProtocolError",
    "ReduceOp",
    "RendezvousError",
    "ReplicaDivergence",
    "StrategyError",
    "UnknownStrategy",
    "available_strategies",
    "join",
    "register_strategy",
    "training",
]
