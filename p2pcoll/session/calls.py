"""The one path every call of the group API takes: choose -> prepare -> failure rules ->
execute -> record.

Each public method of :class:`~p2pcoll.Group` checks its arguments and turns them into one
:class:`Call`; :meth:`Session.run` runs it, on every rank alike, collectives and
point-to-point transfers, roots and the others. A call is described by a small key
(collective, strategy asked for, op, root, the leaves' dtypes and shapes, the pytree); the
first call with a key builds its :class:`Prepared` program (the chosen strategy, the
signature, the chunks, the segments, the layout a root sends) and later calls with the
same key only look it up: no choice, no Layout, no Signature per call. A new session (a
new epoch) starts with no programs; the cache is bounded.

Small collectives among peers of one host go on the board
(:mod:`p2pcoll.engine.board_path`) when no strategy was asked for (an alltoall of any
size, its lengths agreed as it runs). Every call is entered in the group's flight record
(:mod:`p2pcoll.session.flight`) here.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import msgpack
import numpy as np

from ..engine.costs import CostModel
from ..engine.layout import Extent, Layout
from ..engine.p2p import RECV, SEND
from ..engine.plan import chunking, plan
from ..engine.program import Program, compile_program
from ..errors import CollectiveMismatch, GroupBroken, P2PCollError, ProtocolError
from ..registry import registry
from ..settings import check_seconds
from ..strategy import Context, Strategy, chunk_indices, host_numbers
from ..types import OpKey, ReduceOp, fold_of
from ..wire import Header, Signature
from ..wire.validation import check_layout

from .call import Call, Learned, describe_data, describe_specs
from .flight import Entry, describe
from .turns import Turns

if TYPE_CHECKING:
    from ..engine.board_alltoall import BoardAlltoall  # imported at the first alltoall
    from ..engine.board_path import BoardPath
    from ..engine.costs import Constants
    from ..engine.executor import Executor
    from ..engine.matching import Matcher
    from ..settings import Settings
    from ..types import Membership
    from .activity import Activity
    from .failure import FailureModel
    from .flight import Recorder

MAX_LAYOUTS = 64  # a broadcast root's layouts kept per session, parsed and checked
MAX_PROGRAMS = 256  # prepared programs kept per session (least recently used go)
BOARD = "shm"  # how stats() and the metrics name a collective run on the board
_AVG = ReduceOp.AVG  # a module's name: an enum member read off its class is a Python call
HISTORY = 64  # the signatures of this many recent collectives are kept, for mismatch messages


@dataclass(slots=True)
class Prepared:
    """A call's program, built once per key (see the module docstring)."""

    strategy: Strategy
    ctx: Context
    chunks: Sequence[Sequence[tuple[int, int, int]]]  # once compiled: the shared Cuts'
    nseg: int
    sig: Signature
    meta: dict[str, Any] | None
    digest: int  # the signature's digest as the board's int64
    # This rank's part as messages, compiled when first run: after the sequence number
    # is taken, so that the peers hear of a plugin's bad schedule (it aborts the collective).
    program: Program | None = None
    # What the flight record says of a call of it: collective, strategy, bytes, dtypes,
    # shapes.
    flight: Entry = ("", "", 0, "", ())
    # On the board: a reduction's plan (where its data lies), True for a barrier, or a
    # broadcast root's packed layout (its data fits) or b"" (it goes as messages, and
    # the board only says so). None: not on the board.
    board: Any = None
    # An alltoall's blocks of other ranks that this rank's schedule holds on their way.
    forwarded: tuple[int, ...] = ()
    # A reduction's op as the board compares it, and a built-in op's ufunc (None: a
    # CustomOp's fold is the call's own, never one cached here: two CustomOps of one name
    # share a program but not their functions).
    op: str = ""
    ufunc: np.ufunc | None = None


class RunnerSession(Protocol):
    """What a :class:`Runner` uses of its session (a :class:`~.session.Session`), named
    here so that this module does not import the session, which makes the runner."""

    membership: Membership
    settings: Settings
    failures: FailureModel
    matcher: Matcher
    executor: Executor
    activity: Activity
    constants: Mapping[str, Constants]
    flight: Recorder | None

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def board(self) -> BoardPath | None: ...

    def next_seq(self) -> OpKey: ...

    def next_transfer(self, src: int, dst: int, tag: int) -> OpKey: ...


class Runner:
    """Runs calls for one session: :meth:`Session.run` is :meth:`run`."""

    def __init__(self, session: RunnerSession) -> None:
        self.session = session
        self.rank, self.size = session.rank, session.world_size
        # The host of every rank as small ints (strategy.Context.hosts), from the roster;
        # empty when the roster names none. Part of every plan's Context, so of its cache key.
        roster = session.membership.hosts
        self.hosts = host_numbers(roster) if len(roster) == self.size else ()
        self.programs: OrderedDict[tuple[Any, ...], Prepared] = OrderedDict()
        self._costs: CostModel | None = None
        self._recent: dict[int, Signature] = {}  # seq -> what this rank ran (HISTORY of them)
        # The order calls start in while a coded reduction waits for its scales (.turns).
        self.turns = Turns()
        self._alltoall: BoardAlltoall | None = None  # made on the first on the board
        # Broadcast roots' layouts read on the board, checked (a loop reads the same bytes).
        self._layouts: dict[bytes, Learned] = {}

    def recent(self, seq: int) -> Signature | None:
        """What this rank ran as collective ``seq``, if it was one of the last few."""
        return self._recent.get(seq)

    # --- choose and prepare -------------------------------------------------------------

    def choose(self, collective: str, requested: str | None, nbytes: int) -> Strategy:
        """The strategy ``requested`` (or the group's default, or auto's pick)."""
        return registry.choose(collective, requested,
                               self.session.settings.strategies.get(collective), nbytes,
                               self.size, self.costs())

    def costs(self) -> CostModel:
        """auto's cost model (:meth:`CostModel.for_group`, the one simulate uses), made on
        first use."""
        if self._costs is None:
            session = self.session
            self._costs = CostModel.for_group(session.settings, session.membership.endpoints,
                                              self.rank, session.constants,
                                              hosts=session.membership.hosts)
        return self._costs

    def use_costs(self, model: CostModel) -> None:
        """Price with ``model`` from now on (the measured links: :mod:`p2pcoll.api.topology`);
        the programs prepared under the old one go, so auto chooses again."""
        self._costs = model
        self.programs.clear()

    def prepare(self, call: Call, strategy: Strategy | None = None) -> Prepared:
        """The program of ``call`` (built on the first call with its key); ``strategy``:
        the one a receiver learned from its origin, or the board's."""
        key = call.key()
        if strategy is not None:
            key += (strategy,)  # the instance: an engine's may differ by more than name
        program = self.programs.get(key)
        if program is not None:
            self.programs.move_to_end(key)
            return program
        program = self._build(call, strategy)
        self.programs[key] = program
        if len(self.programs) > MAX_PROGRAMS:
            self.programs.popitem(last=False)
        return program

    def _build(self, call: Call, strategy: Strategy | None) -> Prepared:
        name, p = call.collective, self.size
        flat = call.flat
        nbytes = sum(a.nbytes for a in flat)
        meta = None
        board = self.session.board if call.tag is None and call.learn is None else None
        on_board = board is not None and self._on_board(call, board.slot_bytes)
        if on_board and name != "broadcast":
            strategy = _BoardStrategy.of(name)
        if call.tag is not None:
            strat: Strategy = SEND if name == "send" else RECV
            layout = Layout.split(flat, 1)
            sig = Signature.of("p2p", "", "", -1, describe_data(call.leaves, call.treedef))
            if name == "send":
                meta = _layout_meta(SEND.name, call)
            ctx = Context(self.rank, p, call.root or 0)
        elif name == "alltoall" and on_board:  # the lengths are agreed on the board
            strat, layout = _BoardStrategy.of(name), Layout([], [[]])
            sig = Signature.of(name, BOARD, "", -1, "lengths agreed on the board")
            ctx = Context(self.rank, p, 0, self.hosts)
        elif name == "alltoall":
            item = call.leaves[0].itemsize
            strat = strategy or self.choose(name, call.strategy, sum(call.counts) * item // p)
            if not on_board:
                chunking(strat, p, 0, item)  # checked: p * p chunks
            layout = Layout.parts(cast(list[np.ndarray],
                                       [Extent(n, item) for n in call.counts]))
            digest = hashlib.blake2b(repr(call.counts).encode(), digest_size=8).hexdigest()
            sig = Signature.of(name, strat.name, "", -1, f"{call.leaves[0].dtype.str} "
                               f"blocks {digest}")
            ctx = Context(self.rank, p, 0, self.hosts)
        else:
            parts = name in ("allgather", "gather", "scatter")
            strat = strategy or self.choose(name, call.strategy, nbytes)
            nchunks, cuts = 1, None
            if not parts and name != "barrier":  # its chunks, checked (in engine.plan)
                nchunks, cuts = chunking(strat, p, sum(a.size for a in flat),
                                         flat[0].itemsize if flat else 1)
            if name in ("allreduce", "reduce"):
                layout = Layout.split(flat, nchunks) if cuts is None else Layout.cut(flat, cuts)
            elif name == "reduce_scatter":
                layout = Layout.split(flat, p, row_sizes=[call.rows])
            elif parts:
                layout = Layout.parts(flat)
            elif name == "barrier":
                layout = Layout([], [[]])
            else:  # broadcast
                layout = Layout.split(flat, nchunks)
            if name in ("broadcast", "scatter") and call.root == self.rank:
                meta = _layout_meta(strat.name, call)
            data = describe_data(call.leaves[:1] if name in ("allgather", "gather")
                                 else call.leaves, call.treedef)
            op = call.op.value if call.op is not None else ""
            root = -1 if call.root is None else call.root
            sig = Signature.of(name, strat.name, op, root, data)
            ctx = Context(self.rank, p, call.root or 0, self.hosts)
        settings = self.session.settings
        nseg = layout.segment(settings.segment_bytes, settings.max_message_bytes,
                              whole=strat.whole_messages)
        program = Prepared(strat, ctx, layout.chunks, nseg, sig, meta,
                           int.from_bytes(sig.digest, "little", signed=True),
                           flight=(name, strat.name, *describe(flat, call.leaves[:len(flat)])))
        if call.op is not None:
            program.op = call.op.value
            if type(call.op) is ReduceOp:
                program.ufunc = cast(np.ufunc, fold_of(call.op))
        if name == "alltoall" and p > 1 and not on_board:
            mine = {b for b in range(p * p) if b // p == self.rank or b % p == self.rank}
            program.forwarded = tuple(sorted(
                {i for ops in plan(strat, ctx, p * p) for op in ops
                 for i in chunk_indices(op.chunk, p * p)} - mine))
        if on_board:
            assert board is not None
            if name in ("allreduce", "reduce"):
                program.board = board.plan(flat)
            elif name in ("barrier", "alltoall"):
                program.board = True
            else:  # a broadcast root: its data on the board if it fits, else word of messages
                packed = cast(bytes, msgpack.packb(_layout_meta(BOARD, call), use_bin_type=True))
                fits = (sum((a.nbytes + 7) & ~7 for a in flat) <= board.slot_bytes
                        and len(packed) <= board.board.meta_bytes)
                program.board = packed if fits else b""
        return program

    # --- run ----------------------------------------------------------------------------

    async def run(self, call: Call) -> None:
        """Run ``call`` under the failure rules and record it, on every rank.

        Raises:
            CollectiveTimeout, CollectiveMismatch, PeerLost, GroupBroken, ProtocolError:
                see the group's methods.
        Cancellation: breaks the group.
        """
        session = self.session
        if self.turns.busy:  # a coded reduction waits for its scales: see .turns
            await self.turns.queue()
        limit = (session.settings.collective_timeout if call.timeout is None
                 else check_seconds(call.timeout, "timeout="))
        # Prepared before the sequence number is taken: an unknown strategy or a plugin's
        # bad schedule is this rank's own error, and the group stays usable.
        program = self.prepare(call, call.schedule) if call.learn is None else None
        if call.collective == "alltoall" and program is not None and program.board is None:
            call.flat = _blocks(call, program.forwarded, self.rank, self.size)
        flight = session.flight
        try:
            if call.tag is None:
                op = session.next_seq()
            elif call.collective == "send":
                op = session.next_transfer(self.rank, call.root or 0, call.tag)
            else:
                op = session.next_transfer(call.root or 0, self.rank, call.tag)
        except GroupBroken as exc:
            if flight is not None:
                flight.refused(exc)
            raise
        started, error = time.perf_counter(), None
        # What the flight record says the call is, known from its program (a receiver's
        # learns it: at its end); the failure model lists it with its start while it runs.
        what = (program.flight if program is not None else
                (call.collective, call.strategy or "auto", 0, "", ()))
        timeline = session.executor.timeline
        traced = timeline.now() if timeline is not None else 0.0
        try:
            if program is not None and call.tag is None:
                recent = self._recent  # what _remember does, on every call's path
                recent[op.number] = program.sig
                recent.pop(op.number - HISTORY, None)
            collective = session.failures.collective(op, call.collective, limit, what, started)
            collective.enter()  # `async with` without its two coroutines (on every call)
            try:
                await self._execute(op, call, program)
            except BaseException as exc:
                await collective.exit(exc)  # raises what the failure rules say in its place
                raise
            if not collective.leave(None):  # its deadline passed as it returned
                await collective.exit(None)
        except BaseException as exc:
            error = exc
            raise
        finally:
            ended = time.perf_counter()
            session.activity.record(
                call.collective, call.strategy_used or (call.strategy or "auto"),
                ended - started, error if isinstance(error, P2PCollError) else None)
            if timeline is not None and (call.strategy_used == BOARD or self.size == 1):
                # The executor traces what it runs; what it does not run is traced here.
                args: dict[str, Any] = {"strategy": BOARD, "seq": op.number,
                                        "bytes": sum(a.nbytes for a in call.flat)}
                if error is not None:
                    args["error"] = f"{type(error).__name__}: {error}"
                from ..engine.timeline import COLLECTIVE
                timeline.span(COLLECTIVE, f"{call.collective} #{op.number}", traced, args)
            if flight is not None:
                if program is None:  # what it received, learned as it ran
                    what = (what[0], what[1], *describe(call.flat, call.leaves))
                if error is None:  # Recorder.record inlined: its whole cost on this path
                    flight.calls.append((op.number, what, started, ended, call.strategy_used))
                else:
                    flight.record(op, what, started, ended, call.strategy_used, error)
        if call.op is _AVG and (call.root is None or call.root == self.rank):
            for a in call.flat[:len(call.leaves)]:  # not a scratch area after them
                np.divide(a, self.size, out=a)

    async def _execute(self, op: OpKey, call: Call, program: Prepared | None) -> None:
        session = self.session
        name = call.collective
        header = None
        if program is not None:
            on_board = program.board
            if on_board is not None:
                board = session.board
                assert board is not None
                if name == "allreduce" or name == "reduce":  # the usual call first
                    assert call.op is not None
                    call.strategy_used = BOARD
                    await board.reduction(op.number, name, call.flat,
                                          program.ufunc or fold_of(call.op), program.op,
                                          program.sig, call.root, on_board)
                    return
                if name == "broadcast":  # the root
                    if await board.broadcast_root(op.number, call.flat, on_board):
                        call.strategy_used = BOARD
                        return
                elif name == "barrier":
                    call.strategy_used = BOARD
                    await board.barrier(op.number, program.sig)
                    return
                elif name == "alltoall":  # the parts to send, then out= (if given)
                    call.strategy_used = BOARD
                    p = self.size
                    if self._alltoall is None or self._alltoall.path is not board:
                        from ..engine.board_alltoall import BoardAlltoall
                        self._alltoall = BoardAlltoall(board)
                    parts = await self._alltoall.run(op.number, call.leaves[:p],
                                                     call.leaves[p:] or None, program.sig)
                    if isinstance(parts, CollectiveMismatch):
                        call.refused = parts
                    else:
                        call.leaves[p:] = parts
                    return
        else:
            board = session.board if call.tag is None else None
            if board is not None and name == "broadcast" and self._on_board(call, 0):
                got = await board.broadcast_receive(op.number, call.root or 0)
                if got is not None:
                    self._learn_board(call, *got)
                    call.strategy_used = BOARD
                    return
            header = await session.matcher.first(op, call.root or 0)
            program = self.prepare(call, self._learn_message(op, call, header))
            if call.tag is None:
                self._remember(op.number, program.sig)
        call.strategy_used = program.strategy.name
        if self.size == 1:
            return  # a group of one: every collective leaves the data as it is
        compiled = program.program
        if compiled is None:
            compiled = program.program = compile_program(
                plan(program.strategy, program.ctx, len(program.chunks)), program.chunks,
                [a.itemsize for a in call.flat], program.nseg, session.executor.depth)
            # The process's one copy of this layout (every rank of a group in one process
            # cuts the same chunks): the rank's own goes, O(p) less memory a rank.
            program.chunks = compiled.cuts.chunks
        board = session.board
        if board is not None and board.owes_turn:
            await board.turn()  # see BoardPath.turn
        meta = program.meta
        if header is not None and call.tag is None:
            meta = header.meta  # forward the layout too: this rank may be someone's first sender
        ufunc = program.ufunc or (fold_of(call.op) if call.op is not None else None)
        await session.executor.run(op, compiled, call.flat, ufunc, program.sig, meta,
                                   program.strategy)  # (positional: every call)

    def _remember(self, seq: int, sig: Signature) -> None:
        recent = self._recent
        recent[seq] = sig
        recent.pop(seq - HISTORY, None)

    def alltoall_on_board(self, strategy: str | None) -> bool:
        """Whether an alltoall asking for ``strategy`` runs on the board, where its lengths
        are agreed as it runs (:mod:`p2pcoll.engine.board_alltoall`): no agreement first."""
        return self.session.board is not None and self._auto("alltoall", strategy)

    def _auto(self, name: str, strategy: str | None) -> bool:
        """No strategy asked for collective ``name``, by the call (``strategy``) or the group."""
        return strategy in (None, "auto") and \
            self.session.settings.strategies.get(name, "auto") == "auto"

    def _on_board(self, call: Call, slot: int) -> bool:
        """Whether ``call`` goes on the board: no strategy asked for (by the call or the
        group), and (reductions) its data fits a slot."""
        name = call.collective
        if name not in ("allreduce", "reduce", "broadcast", "barrier", "alltoall") \
                or call.schedule or not self._auto(name, call.strategy):
            return False
        if name in ("allreduce", "reduce"):
            return sum((a.nbytes + 7) & ~7 for a in call.flat) <= slot
        return True  # barrier, broadcast, alltoall: any size

    def _learn_message(self, op: OpKey, call: Call, header: Header) -> Strategy:
        """A receiver learns the layout from the first message of its origin."""
        meta = header.meta
        origin = call.root or 0
        what = (f"collective #{op.number} {call.collective}" if call.tag is None else
                f"recv #{op.number} from rank {origin} with tag {call.tag}")
        if meta is None:
            described = self.session.matcher.described(header)
            theirs = (header.collective or (str(described[0]) if described else "")
                      or "a collective without a layout")
            raise CollectiveMismatch(
                f"{what}: rank {header.src} sent {theirs}, rank {self.rank} called "
                f"{call.collective}" + (f" from root {origin}" if call.tag is None else ""))
        name = meta["strategy"]
        _learn(call, _learned(meta))
        if call.tag is not None:
            return RECV
        requested = call.strategy if call.strategy not in (None, "auto") else name
        return registry.get(call.collective, requested)

    def _learn_board(self, call: Call, raw: bytes, payload: np.ndarray) -> None:
        learned = self._layouts.get(raw)
        if learned is None:
            try:
                meta = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_ext_len=0)
                if not isinstance(meta, dict):
                    raise ProtocolError("the root's layout on the board is not a map")
                check_layout(meta)
            except ProtocolError:
                raise
            except Exception as exc:
                raise ProtocolError(f"the root's board layout is not valid: {exc}") from None
            learned = _learned(meta)
            if len(self._layouts) >= MAX_LAYOUTS:
                self._layouts.clear()
            self._layouts[raw] = learned
        _learn(call, learned)
        at = 0
        for a in call.flat:
            n = a.nbytes
            if at + n > len(payload):
                raise ProtocolError(f"the root's data on the board is {len(payload)} bytes, "
                                    f"its layout names more")
            a.view(np.uint8)[:] = payload[at:at + n]
            at += (n + 7) & ~7


class _BoardStrategy(Strategy):
    """Names the board path in signatures and programs (never scheduled)."""

    name = BOARD
    _made: dict[str, _BoardStrategy] = {}  # noqa: RUF012 - one per collective, made once

    @classmethod
    def of(cls, collective: str) -> _BoardStrategy:
        made = cls._made.get(collective)
        if made is None:
            made = cls._made[collective] = type(f"Board_{collective}", (cls,),
                                                {"collective": collective})()
        return made


def _blocks(call: Call, forwarded: Sequence[int], rank: int, p: int) -> list[np.ndarray]:
    """An alltoall's arrays, one per block (the strategy's chunks): this rank's parts to
    send (its row), the buffers it receives into (its column), a fresh buffer for each
    block it forwards, and an empty array for every block it never holds."""
    leaves, counts = call.leaves, call.counts
    none = leaves[0].reshape(-1)[:0]
    out = [none] * (p * p)
    for b in forwarded:
        out[b] = np.empty(counts[b], leaves[0].dtype)
    for j in range(p):  # views of the parts as given (C-contiguous: no copy)
        out[j * p + rank] = leaves[p + j].reshape(-1)
        out[rank * p + j] = leaves[j].reshape(-1)
    return out


def _layout_meta(strategy: str, call: Call) -> dict[str, Any]:
    meta: dict[str, Any] = {"strategy": strategy,
                            "leaves": [[a.dtype.str, list(a.shape)] for a in call.leaves]}
    if call.collective != "scatter":
        meta["tree"] = call.treedef
    return meta


def _learned(meta: dict[str, Any]) -> Learned:
    """What a receiver learns of a checked layout: tree, leaves' specs, strategy."""
    return (meta.get("tree"), [(np.dtype(d), tuple(s)) for d, s in meta["leaves"]],
            meta["strategy"])


def _learn(call: Call, learned: Learned) -> None:
    assert call.learn is not None
    call.learn(*learned)
    call.flat = [a.reshape(-1) for a in call.leaves]


__all__ = ["Call", "Prepared", "Runner", "describe_data", "describe_specs"]  # Call: .call
