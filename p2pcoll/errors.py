"""Every error p2pcoll raises on purpose.

```
P2PCollError
├── SettingsError                an argument or environment variable has a bad value
├── RendezvousError              join() could not form the group
├── ProtocolError                a message broke the wire format
├── PeerLost                     a peer closed or vanished while it was needed
├── CollectiveTimeout            a collective missed its deadline
├── CollectiveMismatch           ranks called the collective differently
├── GroupBroken                  the group failed earlier and cannot be used
├── ReplicaDivergence            replicas that must be identical are not (training)
├── ServiceStopped               a peer service was told to stop while its job ran
├── NonFiniteInput               a codec's agreed scale is NaN or Inf (FloatingPointError)
├── UnknownCodec                 no codec of that name is installed (ValueError)
└── StrategyError
    ├── UnknownStrategy          no strategy of that name for that collective
    └── PluginValidationError    an installed strategy plugin is malformed
```

Bad arguments at the API boundary raise ``ValueError`` / ``TypeError`` as usual (a bad
setting is a SettingsError, which is a ValueError too). Every error takes its message first
and any details as keywords.
"""

from __future__ import annotations

from collections.abc import Iterable


class P2PCollError(Exception):
    """Base class of every p2pcoll error.

    Attributes:
        origin: the rank whose failure this is, when another rank reported it (its abort,
            or the cause its goodbye carried) and this rank raises it in its turn; None
            when the failure happened here. A rank tells its peers of a failure only when
            ``origin`` is None: a reported one has been told already.
    """

    origin: int | None = None


class SettingsError(P2PCollError, ValueError):
    """A setting (an argument of join() or a ``P2PCOLL_*`` / launcher variable) is bad.

    Attributes:
        name: the variable (``$P2PCOLL_TIMEOUT``) or argument (``collective_timeout=``).
        value: the value that was given.
        allowed: what would have been accepted.
    """

    def __init__(
        self, message: str, *, name: str = "", value: object = None, allowed: str = ""
    ) -> None:
        super().__init__(message)
        self.name = name
        self.value = value
        self.allowed = allowed


def bad_value(name: str, value: object, allowed: str) -> SettingsError:
    """The error for a bad ``value`` of variable or argument ``name`` (``$P2PCOLL_TIMEOUT``,
    ``timeout=``): ``$P2PCOLL_TIMEOUT='abc' is not allowed: expected ALLOWED``."""
    shown = f"{name}{value!r}" if name.endswith("=") else f"{name}={value!r}"
    return SettingsError(f"{shown} is not allowed: expected {allowed}", name=name, value=value,
                         allowed=allowed)


class RendezvousError(P2PCollError):
    """The group could not be formed (timeout, duplicate rank, size disagreement, ...).

    ``permanent`` says that trying again cannot help: the rendezvous rejected this peer
    (duplicate rank, rank out of range, size disagreement), or what answers at the address
    is not this job's rendezvous (another job key, another protocol). A timeout, a peer
    lost while the group formed or a host that went away are not permanent. ``answered``
    is False when no rendezvous host ever answered this peer.
    """

    def __init__(self, message: str, *, permanent: bool = False, answered: bool = True
                 ) -> None:
        super().__init__(message)
        self.permanent = permanent
        self.answered = answered


class ProtocolError(P2PCollError):
    """A message does not follow the wire format (or comes from outside the group).

    ``reason`` is a short code saying which rule it broke (``stranger``, ``oversize``,
    ``malformed``, ...): dropped messages are counted by it in ``Group.stats()``.
    """

    def __init__(self, message: str, *, reason: str = "malformed") -> None:
        super().__init__(message)
        self.reason = reason


class PeerLost(P2PCollError):
    """A peer left or disappeared while a collective needed it.

    Attributes:
        rank: the peer, if known.
        how: how it went, if known: one of :data:`DEPARTURES` (``"closed"``: it closed
            the group normally; ``"crashed"``: it closed the group because of an error;
            ``"killed"``: its process went away without closing, as a kill or a crash of
            the process does; ``"unresponsive"``: its connection stayed silent past the
            heartbeat timeout, a frozen or overloaded process or a cut network), or ``""``
            when this rank cannot tell: the message then says what it knows (a loss seen
            by the transport: "killed or crashed, or stopped answering"; a crash a peer
            reported in its goodbye or abort: "rank 1 crashed (ValueError: ...)").
    """

    def __init__(self, message: str, rank: int | None = None, *, how: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.how = how


# How a peer goes (PeerLost.how), as the peers that see it can tell.
CLOSED, CRASHED, KILLED, UNRESPONSIVE = "closed", "crashed", "killed", "unresponsive"
DEPARTURES = (CLOSED, CRASHED, KILLED, UNRESPONSIVE)


class CollectiveTimeout(P2PCollError):
    """A collective did not finish before its deadline.

    Attributes:
        collective: its name (``"allreduce"``, ``"send"``, ...).
        seq: its sequence number (a transfer's count on its channel).
        waiting_on: the ranks blamed: those that did not come.
        blame: how they were found (see :mod:`p2pcoll.session.blame`): ``"silent"``, they
            did not answer when asked; ``"absent"``, they had not started the collective;
            ``"own"``, they are only whom the rank that timed out waited for.
    """

    def __init__(
        self, message: str, *, collective: str = "", seq: int = -1,
        waiting_on: Iterable[int] = (), blame: str = "own",
    ) -> None:
        super().__init__(message)
        self.collective = collective
        self.seq = seq
        self.waiting_on = sorted(set(waiting_on))
        self.blame = blame


class CollectiveMismatch(P2PCollError):
    """Ranks called the same collective with different arguments (shape, dtype, op, ...)."""


class GroupBroken(P2PCollError):
    """An earlier collective failed part-way, so the peers' states are unknown.

    Every call on the group raises this until the group is closed; the original error is
    the ``__cause__``.
    """


class ReplicaDivergence(P2PCollError):
    """Model replicas that must hold the same bits differ (see p2pcoll.training)."""

    def __init__(self, message: str, ranks: Iterable[int] = (), tensor: str | None = None) -> None:
        super().__init__(message)
        self.ranks = sorted(set(ranks))
        self.tensor = tensor


class ServiceStopped(P2PCollError):
    """A peer service (:class:`p2pcoll.service.Peer`) was told to stop (a signal, or
    ``Peer.stop()``) while it joined or ran its job.

    Attributes:
        reason: what stopped it (``"SIGTERM"``, or the reason given to ``stop()``).
    """

    def __init__(self, message: str, *, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason


class StrategyError(P2PCollError):
    """Base class of strategy lookup and plugin errors."""


class UnknownStrategy(StrategyError, ValueError):
    """No strategy of the requested name is installed for the collective."""


class PluginValidationError(StrategyError):
    """An installed strategy plugin does not satisfy the strategy API."""



class NonFiniteInput(P2PCollError, FloatingPointError):
    """A codec that scales by a maximum agreed by every rank found NaN or Inf in the data
    of some rank (the agreed maximum is not finite). Every rank raises it, before the data
    moves; the group stays usable.

    Attributes:
        codec: the codec's name.
        blocks: ``(array index, first element, end element)`` of every block whose agreed
            maximum is NaN or Inf, for the arrays of the call, in order.
    """

    def __init__(self, message: str, *, codec: str,
                 blocks: Iterable[tuple[int, int, int]]) -> None:
        super().__init__(message)
        self.codec = codec
        self.blocks = list(blocks)


class UnknownCodec(P2PCollError, ValueError):
    """No codec of the name given is installed; the message lists the ones that are."""


# Errors that may be reported by a peer in an abort message and re-raised here, by name.
REMOTE_ERRORS: dict[str, type[P2PCollError]] = {
    cls.__name__: cls
    for cls in (
        P2PCollError, RendezvousError, ProtocolError, PeerLost, CollectiveTimeout,
        CollectiveMismatch, GroupBroken, ReplicaDivergence, StrategyError, UnknownStrategy,
        PluginValidationError,
    )
}
