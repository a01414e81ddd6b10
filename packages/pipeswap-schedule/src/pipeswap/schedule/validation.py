"""Validation: per-rank well-formedness and a cross-rank P2P simulation.

:func:`validate` raises the first problem as a typed :class:`ValidationError` whose message
names the rank, the step and what to change. The cross-rank simulation treats every send and
receive as a rendezvous (the strictest transport: a send completes only when its receive is
posted), matches them first-in first-out per ordered rank pair, and reports a deadlock as the
cycle of ranks waiting on each other. A ``BATCH_P2P`` step posts all its leaves at once and
completes when all are matched, which is what one ``torch.distributed.batch_isend_irecv`` call
over all of them does; an executor must issue a batch that way (not one batch per peer, one
after the other) for a schedule this module accepts to be deadlock-free.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from dataclasses import dataclass, field
from itertools import chain

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule._numbering import SHOWN, gaps
from pipeswap.schedule.errors import (
    ChunkOrderError,
    DeadlockError,
    FSDPOrderError,
    P2PError,
    SwapLifecycleError,
    ValidationError,
)
from pipeswap.schedule.lockstep import Visibility, lockstep
from pipeswap.schedule.schedule import Message, Schedule
from pipeswap.schedule.steps import (
    COMM,
    COMPUTE,
    P2P,
    SENDS,
    ChunkKey,
    Order,
    Step,
    StepType,
    peer_stage,
)

_SWAP_SEQUENCE = (
    StepType.SWAP_LAUNCH_OFFLOAD,
    StepType.SWAP_WAIT_OFFLOAD,
    StepType.SWAP_LAUNCH_LOAD,
    StepType.SWAP_WAIT_LOAD,
)
#: A streaming swap's steps, the launch of its offload before the forward it streams.
_STREAM_SEQUENCE = (
    StepType.SWAP_STREAM_OFFLOAD,
    StepType.SWAP_WAIT_OFFLOAD,
    StepType.SWAP_STREAM_LOAD,
    StepType.SWAP_WAIT_LOAD,
)


#: How sends and receives meet. ``ordered``: a send waits for its receive and the messages
#: between two ranks pair first in, first out (NCCL, HCCL; MindSpore hyper-parallel's model).
#: ``tagged``: a send never waits and a message meets the receive with its tag (gloo, as the
#: pipeswap runtime tags every message); only a compute waits, for the data it receives.
TRANSPORTS = ("ordered", "tagged")


@gc_paused
def validate(
    schedule: Schedule, *, transport: str = "ordered", microbatches: int | None = None
) -> None:
    """Check every rank's order, that every stage computes every microbatch (``microbatches``
    of them, when given), then run all ranks' P2P together under ``transport``."""
    if transport not in TRANSPORTS:
        raise ValidationError(f"unknown transport {transport!r}; use one of {TRANSPORTS}")
    if microbatches is not None and (
        isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1
    ):
        raise ValidationError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    if schedule.num_stages == 0:
        raise ValidationError("the schedule has no steps: every rank's order is empty or idle")
    forwards = [_check_rank(schedule, rank)[StepType.FWD] for rank in range(schedule.num_ranks)]
    _check_complete(schedule, forwards, microbatches)
    if transport == "tagged":
        simulate_tagged(schedule)
        return
    try:
        simulate_p2p(schedule)
    except (DeadlockError, P2PError) as exc:
        try:
            simulate_tagged(schedule)
        except ValidationError:
            raise exc from None
        hint = (" (with tagged transfers, as gloo has, it runs: validate with "
                "transport='tagged', --transport tagged on the command line; on NCCL it would "
                "hang: lower compute orders with the early lowering for NCCL)")
        if isinstance(exc, DeadlockError):
            raise DeadlockError(str(exc) + hint, exc.cycle) from None
        raise P2PError(str(exc) + hint, rank=exc.rank) from None


@gc_paused
def simulate_tagged(schedule: Schedule) -> None:
    """Run all ranks with tagged, non-blocking transfers; raise if a message has no
    counterpart or the ranks wait for each other's data in a cycle."""
    orders = schedule.orders
    sends: dict[tuple[bool, int, int], int] = {}  # (activation?, sending stage, micro) -> rank
    receives: dict[tuple[bool, int, int], int] = {}
    for rank, order in enumerate(orders):
        for step in order:
            for leaf in (step.p2p_leaves if step is not None else ()):
                key = _payload(leaf)
                if key in (sends if leaf.type in SENDS else receives):
                    raise P2PError(f"rank {rank}: {leaf} appears twice", rank=rank)
                (sends if leaf.type in SENDS else receives)[key] = rank
    for key in sends.keys() ^ receives.keys():
        activation, stage, micro = key
        what = f"the {'activation' if activation else 'gradient'} of stage {stage} micro {micro}"
        if key in sends:
            raise P2PError(f"rank {sends[key]} sends {what}, which no rank receives",
                           rank=sends[key])
        raise P2PError(f"rank {receives[key]} receives {what}, which no rank sends",
                       rank=receives[key])
    # Leaves one by one (with the step that holds them): a send never waits, a compute
    # waits for the data it receives.
    leaves = [[(step, leaf) for step in order if step is not None
               for leaf in step.sub_steps or (step,)] for order in orders]

    def needs(item: tuple[Step, Step]) -> list[Message]:
        leaf = item[1]
        need = schedule.remote_input(leaf) if leaf.type in COMPUTE else None
        return [] if need is None else [need]

    def take(_rank: int, item: tuple[Step, Step]) -> list[Message]:
        leaf = item[1]
        return [Message(*_payload(leaf))] if leaf.type in SENDS else []

    waiting = lockstep(leaves, needs, take, visibility=Visibility.AT_ONCE, run_on=True)
    if waiting:
        _report_tagged_deadlock({w.rank: (w.item[0], w.missing) for w in waiting}, sends)


def _report_tagged_deadlock(waits: dict[int, tuple[Step, Message]],
                            sends: dict[tuple[bool, int, int], int]) -> None:
    rank = next(iter(waits))
    path: list[int] = []
    while rank not in path and rank in waits:
        path.append(rank)
        rank = sends[waits[rank][1]]
    start = path.index(rank) if rank in path else 0
    cycle = tuple((r, str(waits[r][0]), sends[waits[r][1]]) for r in path[start:])
    links = "; ".join(f"rank {r} waits at {s} for data from rank {p}" for r, s, p in cycle)
    raise DeadlockError(f"deadlock: {links}. Each rank waits for data the other sends later: "
                        "reorder the computes", cycle)


def _check_complete(schedule: Schedule, forwards: list[dict[ChunkKey, int]],
                    microbatches: int | None) -> None:
    """Every stage forwards every micro of ``0..M-1``, M being ``microbatches`` or else the
    highest micro + 1: a schedule that skips one would train on part of the batch.

    ``forwards`` holds each rank's forward positions by chunk, from :func:`_check_rank`,
    which also pairs each forward with one backward (B, or I then W) and refuses duplicates;
    so counting forwards per stage suffices, and costs one look at each chunk.
    """
    counts = [0] * schedule.num_stages
    highest = -1
    for positions in forwards:
        for stage, micro in positions:
            counts[stage] += 1
            if micro > highest:
                highest = micro
    found = highest + 1
    if found == 0:
        raise ChunkOrderError("the schedule computes nothing: add each stage's forwards and "
                              "backwards")
    if microbatches is not None and found != microbatches:
        fix = (f"add the steps of micro {found}..{microbatches - 1} to every stage"
               if found < microbatches else f"drop the steps of micro {microbatches} and above")
        raise ChunkOrderError(
            f"the schedule runs {found} microbatches (micro 0..{found - 1}), not the "
            f"{microbatches} expected: {fix}, or give {found} as the microbatch count")
    short = [stage for stage, count in enumerate(counts) if count != found]
    if short:
        _report_missing(schedule, forwards, short, found)


def _report_missing(schedule: Schedule, forwards: list[dict[ChunkKey, int]],
                    stages: list[int], micros: int) -> None:
    """Name the first chunks absent from ``stages`` (each forwards fewer than ``micros``)."""
    forwarded: dict[int, set[int]] = {stage: set() for stage in stages}
    for rank in {schedule.stage_ranks[stage] for stage in stages}:
        for stage, micro in forwards[rank]:
            if stage in forwarded:
                forwarded[stage].add(micro)
    chunks = [(stage, micro) for stage in stages for micro in gaps(forwarded[stage], micros)]
    total = sum(micros - len(forwarded[stage]) for stage in stages)
    named = ", ".join(f"(stage {s}, micro {m})" for s, m in chunks[:SHOWN])
    more = f" and {total - SHOWN} more" if total > SHOWN else ""
    stage, micro = chunks[0]
    rank = schedule.stage_ranks[stage]
    raise ChunkOrderError(
        f"the schedule runs micro 0..{micros - 1} but never computes chunk(s) {named}{more}; "
        f"every stage forwards and backwards each microbatch once: add {stage}F{micro} and "
        f"{stage}B{micro} (or {stage}I{micro} then {stage}W{micro}) to rank {rank}'s order",
        rank=rank)


_NO_SWAP = [None, None, None, None]
Where = dict[StepType, dict[ChunkKey, int]]  # type -> (stage, micro) -> position in the order


@gc_paused
def validate_rank(schedule: Schedule, rank: int) -> None:
    """Check one rank's order on its own.

    Every step's stage lives on this rank; each forwarded chunk has exactly one backward
    after it (B, or I followed by W); swapped chunks run ``F < LO < WO < LL < WL <
    backward``, or streamed ``SO < F < WO < SL < WL < backward``; P2P steps go to a remote neighbour, receives precede the compute that needs
    them and sends follow the compute that produces them; an input made on this rank (by a
    neighbouring stage placed here) is made before it is used; FSDP steps keep each stage
    they manage gathered while it computes. (Swap steps inside a composite cannot be built
    at all: :class:`Step` refuses them.)
    """
    _check_rank(schedule, rank)


def _check_rank(schedule: Schedule, rank: int) -> Where:
    """:func:`validate_rank`, returning where each chunk's steps are, for the checks across
    ranks."""
    if not 0 <= rank < schedule.num_ranks:
        raise ValidationError(f"rank {rank} is not in this {schedule.num_ranks}-rank schedule")
    order = schedule.orders[rank]
    local = frozenset(schedule.stages_of(rank))
    remote_p2p = _remote_p2p(schedule, rank)
    where: Where = {kind: {} for kind in StepType}
    fsdp: list[int] = []  # positions of FSDP steps
    for index, step in enumerate(order):
        if step is None:
            continue
        for leaf in step.sub_steps or (step,):
            kind, stage, micro = leaf.type, leaf.stage, leaf.micro
            if stage not in local:
                _misplaced(schedule, rank, leaf, step)
            if micro is None:  # FSDP control, checked as a whole below
                fsdp.append(index)
                continue
            if kind in P2P and (kind, stage) not in remote_p2p:
                _needless_p2p(schedule, rank, leaf)
            positions, key = where[kind], (stage, micro)
            if key in positions:
                raise ChunkOrderError(
                    f"rank {rank}: {leaf} appears twice (positions {positions[key]} and "
                    f"{index}); each step of a chunk runs once", rank=rank)
            positions[key] = index  # type: ignore[index]
    neighbours = {  # stage -> (previous stage remote?, next stage remote?)
        stage: (stage > 0 and schedule.stage_ranks[stage - 1] != rank,
                 stage + 1 < schedule.num_stages and schedule.stage_ranks[stage + 1] != rank)
        for stage in local
    }
    fwds, fulls, dxs, dws = (where[k] for k in (StepType.FWD, StepType.BWD,
                                                  StepType.BWD_INPUT, StepType.BWD_WEIGHT))
    swaps = [where[k] for k in _SWAP_SEQUENCE]
    streams = (where[StepType.SWAP_STREAM_OFFLOAD], where[StepType.SWAP_STREAM_LOAD])
    recv_f, send_f, recv_b, send_b = (where[k] for k in (
        StepType.FWD_RECV, StepType.FWD_SEND, StepType.BWD_RECV, StepType.BWD_SEND))
    for key in dict.fromkeys(chain.from_iterable(where.values())):
        fwd, full = fwds.get(key), fulls.get(key)
        consumer = full if full is not None else dxs.get(key)
        if fwd is not None and consumer is not None and fwd < consumer:
            # The common, valid case, checked with a few comparisons; anything else is
            # explained by the checks below.
            dx, dw = dxs.get(key), dws.get(key)
            swap = [positions.get(key) for positions in swaps]
            prev_remote, next_remote = neighbours[key[0]]
            fr, fs, br, bs = (recv_f.get(key), send_f.get(key), recv_b.get(key),
                              send_b.get(key))
            if (
                ((dx is None and dw is None) if full is not None
                 else (dw is not None and dw > consumer))
                and (swap == _NO_SWAP or (None not in swap and fwd < swap[0] < swap[1]  # type: ignore[operator]
                                          < swap[2] < swap[3] < consumer))
                and key not in streams[0] and key not in streams[1]
                and ((fr is not None and fr < fwd and bs is not None and bs > consumer)
                     if prev_remote else (fr is None and bs is None))
                and ((fs is not None and fs > fwd and br is not None and br < consumer)
                     if next_remote else (fs is None and br is None))
            ):
                continue
        _check_compute(rank, order, key, fwd, full, where)
        _check_swap(rank, order, key, fwd, consumer, where)
        _check_p2p(rank, order, key, fwd, consumer, neighbours[key[0]], where)
    if any(stage + 1 in local for stage in local):
        _check_handoffs(rank, order, local, where)
    if fsdp:
        _check_fsdp(rank, order, fsdp, where)
    return where


def _check_handoffs(rank: int, order: Order, local: frozenset[int], where: Where) -> None:
    """Where neighbouring stages share this rank, nothing is sent between them: stage s's
    forward of micro m must come after stage s-1's, and its backward (B or I) after stage
    s+1's, earlier in this very order."""
    fwds = where[StepType.FWD]
    for (stage, micro), index in fwds.items():
        if stage - 1 in local:
            _check_input(rank, order, index, fwds.get((stage - 1, micro)),
                         f"stage {stage - 1}'s output", f"{stage - 1}F{micro}")
    consumers = {**where[StepType.BWD_INPUT], **where[StepType.BWD]}
    for (stage, micro), index in consumers.items():
        if stage + 1 in local:
            _check_input(rank, order, index, consumers.get((stage + 1, micro)),
                         f"stage {stage + 1}'s input gradient",
                         f"{stage + 1}B{micro} (or {stage + 1}I{micro})")


def _check_input(rank: int, order: Order, index: int, source: int | None, what: str,
                 maker: str) -> None:
    if source is not None and source < index:
        return
    when = "never" if source is None else f"only later, at {_fmt(order, source)}"
    raise ChunkOrderError(
        f"rank {rank}: {_fmt(order, index)} takes {what}, which this rank makes {when}; "
        f"run {maker} before it", rank=rank)


_PARAM_GRADS = frozenset({StepType.BWD, StepType.BWD_WEIGHT})


def _check_fsdp(rank: int, order: Order, fsdp: list[int], where: Where) -> None:
    """For each stage with FSDP steps (at positions ``fsdp``): UNSHARD and RESHARD
    alternate, starting with UNSHARD and ending resharded; each of the stage's computes
    (inside overlaps too) runs while it is gathered; REDUCE_GRAD comes once, after its last
    B or W. The computes are looked up by chunk in ``where``, not by walking the order."""
    gathered: dict[int, int] = {}  # stage -> position of the UNSHARD that gathered it
    spans: dict[int, tuple[list[int], list[int]]] = {}  # stage -> (UNSHARDs, RESHARDs)
    reduced: dict[int, int] = {}  # stage -> position of its REDUCE_GRAD
    for index in fsdp:
        kind, stage = order[index].type, order[index].stage  # type: ignore[union-attr]
        assert stage is not None  # Step requires it
        starts, ends = spans.setdefault(stage, ([], []))
        if kind is StepType.FSDP_UNSHARD:
            if stage in gathered:
                raise FSDPOrderError(
                    f"rank {rank}: {_fmt(order, index)} gathers stage {stage}, which "
                    f"{_fmt(order, gathered[stage])} gathered already; free it with "
                    f"{stage}RESHARD in between, or drop one of them", rank=rank)
            gathered[stage] = index
            starts.append(index)
        elif kind is StepType.FSDP_RESHARD:
            if gathered.pop(stage, None) is None:
                raise FSDPOrderError(
                    f"rank {rank}: {_fmt(order, index)} frees stage {stage}, which is not "
                    f"gathered there; put {stage}UNSHARD before it (and before the stage's "
                    "computes), or drop it", rank=rank)
            ends.append(index)
        elif stage in reduced:
            raise FSDPOrderError(
                f"rank {rank}: {stage}REDUCE_GRAD appears twice (positions {reduced[stage]} "
                f"and {index}); reduce a stage's gradients once, after its last B or W",
                rank=rank)
        else:
            reduced[stage] = index
    ungathered: tuple[int, int] | None = None  # the first compute outside every span
    last_grad: dict[int, int] = {}  # stage -> position of its last B or W
    for kind in COMPUTE:
        for (stage, _), index in where[kind].items():
            if stage not in spans:
                continue
            starts, ends = spans[stage]  # a last UNSHARD without RESHARD spans to the end
            span = bisect_right(starts, index) - 1
            outside = span < 0 or (span < len(ends) and ends[span] < index)
            if outside and (ungathered is None or index < ungathered[0]):
                ungathered = (index, stage)
            if kind in _PARAM_GRADS and index > last_grad.get(stage, -1):
                last_grad[stage] = index
    if ungathered is not None:
        index, stage = ungathered
        raise FSDPOrderError(
            f"rank {rank}: {_fmt(order, index)} computes stage {stage} while its parameters "
            f"are not gathered; stage {stage} has FSDP steps, so put {stage}UNSHARD before "
            f"this compute (and {stage}RESHARD after it)", rank=rank)
    if gathered:
        stage, index = next(iter(gathered.items()))
        raise FSDPOrderError(
            f"rank {rank}: stage {stage} stays gathered: {_fmt(order, index)} has no "
            f"{stage}RESHARD after it; add one after the stage's last compute", rank=rank)
    for stage in sorted(spans):
        grad = last_grad.get(stage)
        after = ("after its last B or W" if grad is None
                 else f"after its last gradient computation {_fmt(order, grad)}")
        if stage not in reduced:
            raise FSDPOrderError(
                f"rank {rank}: stage {stage} has FSDP steps but no {stage}REDUCE_GRAD; add "
                f"one {after}", rank=rank)
        if grad is not None and grad > reduced[stage]:
            raise FSDPOrderError(
                f"rank {rank}: {_fmt(order, reduced[stage])} reduces stage {stage}'s "
                f"gradients too early: move it {after}", rank=rank)


def _remote_p2p(schedule: Schedule, rank: int) -> frozenset[tuple[StepType, int]]:
    """The P2P steps this rank's stages may issue: only towards neighbours on other ranks."""
    ranks = schedule.stage_ranks
    return frozenset(
        (kind, stage)
        for stage in schedule.stages_of(rank)
        for kind in P2P
        if 0 <= peer_stage(kind, stage) < len(ranks) and ranks[peer_stage(kind, stage)] != rank
    )


def _misplaced(schedule: Schedule, rank: int, leaf: Step, container: Step) -> None:
    stage = leaf.stage
    assert stage is not None
    where = (f"runs on rank {schedule.stage_ranks[stage]}" if stage < schedule.num_stages
             else f"does not exist (stages 0..{schedule.num_stages - 1})")
    raise ChunkOrderError(
        f"rank {rank}: {container} names stage {stage}, which {where}; each rank's "
        "order holds only its own stages' steps", rank=rank)


def _needless_p2p(schedule: Schedule, rank: int, leaf: Step) -> None:
    assert leaf.stage is not None
    peer = peer_stage(leaf.type, leaf.stage)
    why = ("does not exist" if not 0 <= peer < schedule.num_stages
           else "is on the same rank; local neighbours exchange tensors without P2P")
    raise P2PError(f"rank {rank}: {leaf} talks to stage {peer}, which {why}; drop it", rank=rank)


def _fmt(order: Order, index: int) -> str:
    return f"{order[index]} (position {index})"


def _check_compute(
    rank: int, order: Order, key: ChunkKey, fwd: int | None, full: int | None, where: Where
) -> None:
    stage, micro = key
    name = f"rank {rank}: chunk (stage {stage}, micro {micro})"
    dx = where[StepType.BWD_INPUT].get(key)
    dw = where[StepType.BWD_WEIGHT].get(key)
    if full is not None and (dx is not None or dw is not None):
        raise ChunkOrderError(
            f"{name} has a full backward B and a split one (I/W); use B alone, or I then W",
            rank=rank)
    consumer = full if full is not None else dx
    if fwd is None:
        if consumer is not None or dw is not None:
            raise ChunkOrderError(f"{name} has a backward but no forward on this rank",
                                  rank=rank)
        return
    if consumer is None:
        raise ChunkOrderError(
            f"{name} is forwarded at {_fmt(order, fwd)} but never backwarded: add "
            f"{stage}B{micro} (or {stage}I{micro} then {stage}W{micro})", rank=rank)
    if consumer <= fwd:
        raise ChunkOrderError(
            f"{name}: backward {_fmt(order, consumer)} must come after forward "
            f"{_fmt(order, fwd)}", rank=rank)
    if dx is not None:
        if dw is None:
            raise ChunkOrderError(
                f"{name} computes dx ({stage}I{micro}) but never dw: add {stage}W{micro} after it",
                rank=rank)
        if dw <= dx:
            raise ChunkOrderError(
                f"{name}: dw {_fmt(order, dw)} must come after dx {_fmt(order, dx)}", rank=rank)
    elif dw is not None:
        raise ChunkOrderError(f"{name} has dw ({stage}W{micro}) without dx ({stage}I{micro})",
                              rank=rank)


def _check_swap(
    rank: int, order: Order, key: ChunkKey, fwd: int | None, consumer: int | None, where: Where
) -> None:
    stage, micro = key
    name = f"rank {rank}: swapped chunk (stage {stage}, micro {micro})"
    streamed = [where[kind].get(key) for kind in (StepType.SWAP_STREAM_OFFLOAD,
                                                   StepType.SWAP_STREAM_LOAD)]
    whole = [where[kind].get(key) for kind in (StepType.SWAP_LAUNCH_OFFLOAD,
                                                StepType.SWAP_LAUNCH_LOAD)]
    if streamed != [None, None] and whole != [None, None]:
        raise SwapLifecycleError(
            f"{name} mixes whole-chunk and streaming swap steps; a chunk is swapped either "
            f"with {stage}LO{micro} and {stage}LL{micro} or with {stage}SO{micro} and "
            f"{stage}SL{micro}", rank=rank)
    sequence = _SWAP_SEQUENCE if streamed == [None, None] else _STREAM_SEQUENCE
    swaps = [where[kind].get(key) for kind in sequence]
    if swaps == _NO_SWAP:
        return
    if sequence is _SWAP_SEQUENCE:
        positions = [fwd, *swaps, consumer]
        codes = " < ".join(f"{stage}{t.value}{micro}" for t in sequence)
        expected = f"{stage}F{micro} < {codes} < its backward"
    else:
        positions = [swaps[0], fwd, *swaps[1:], consumer]
        codes = " < ".join(f"{stage}{t.value}{micro}" for t in sequence[1:])
        expected = f"{stage}SO{micro} < {stage}F{micro} < {codes} < its backward"
    if None not in positions and all(a < b for a, b in zip(positions, positions[1:])):  # type: ignore[operator]
        return
    missing = [f"{stage}{k.value}{micro}" for k, p in zip(sequence, swaps) if p is None]
    if missing:
        raise SwapLifecycleError(
            f"{name} lacks {', '.join(missing)}; a swapped chunk needs exactly one of each: "
            f"{expected}", rank=rank)
    if fwd is None or consumer is None:
        raise SwapLifecycleError(
            f"{name} needs its forward and backward on this rank: {expected}", rank=rank)
    for earlier, later in zip(positions, positions[1:]):
        assert earlier is not None and later is not None
        if later <= earlier:
            raise SwapLifecycleError(
                f"{name}: {_fmt(order, later)} comes before {_fmt(order, earlier)}; "
                f"the order must be {expected}", rank=rank)


def _check_p2p(
    rank: int,
    order: Order,
    key: ChunkKey,
    fwd: int | None,
    consumer: int | None,
    remote: tuple[bool, bool],
    where: Where,
) -> None:
    stage, micro = key
    remote_prev, remote_next = remote
    expectations = (
        (StepType.FWD_RECV, remote_prev, fwd, "before", "forward"),
        (StepType.FWD_SEND, remote_next, fwd, "after", "forward"),
        (StepType.BWD_RECV, remote_next, consumer, "before", "backward"),
        (StepType.BWD_SEND, remote_prev, consumer, "after", "backward"),
    )
    for kind, needed, compute, side, what in expectations:
        found = where[kind].get(key)
        if compute is None:
            if found is not None:
                raise P2PError(f"rank {rank}: {order[found]} has no {what} of (stage {stage}, "
                               f"micro {micro}) on this rank", rank=rank)
            continue
        if found is None:
            if needed:
                raise P2PError(
                    f"rank {rank}: the {what} {_fmt(order, compute)} needs "
                    f"{stage}{kind.value}{micro} {side} it", rank=rank)
        elif found > compute if side == "before" else found < compute:
            raise P2PError(
                f"rank {rank}: {_fmt(order, found)} must come {side} the {what} "
                f"{_fmt(order, compute)}", rank=rank)


# A posted P2P leaf whose counterpart is not posted yet: (leaf, peer rank, the peer's posted
# leaves on this channel, this leaf's place on the channel).
_Pending = tuple[Step, int, list[Step], int]


@dataclass
class _RankState:
    pc: int = 0
    posted: bool = False  # the step at pc has posted its P2P leaves
    pending: list[_Pending] = field(default_factory=list)


_RECEIVER = {StepType.FWD_SEND: StepType.FWD_RECV, StepType.BWD_SEND: StepType.BWD_RECV}
_STEP = {StepType.FWD_SEND: 1, StepType.BWD_SEND: -1}  # receiving stage - sending stage


def _payload(step: Step) -> tuple[bool, int, int]:
    """What a P2P leaf carries: (activation?, sending stage, micro)."""
    stage, micro, kind = step.stage, step.micro, step.type
    assert stage is not None and micro is not None
    if kind is StepType.FWD_SEND:
        return (True, stage, micro)
    if kind is StepType.FWD_RECV:
        return (True, stage - 1, micro)
    if kind is StepType.BWD_SEND:
        return (False, stage, micro)
    return (False, stage + 1, micro)


@gc_paused
def simulate_p2p(schedule: Schedule) -> None:
    """Run all ranks' P2P as rendezvous and raise on a mismatch, a dangling op or a deadlock.

    Each rank advances until a P2P step has a leaf whose counterpart the peer has not posted;
    posting a counterpart wakes the waiting rank. Work is linear in the number of steps.
    """
    orders = schedule.orders
    routes = _routes(schedule)
    states = [_RankState() for _ in orders]
    queue = deque(range(len(orders)))
    while queue:
        rank = queue.popleft()
        state, order = states[rank], orders[rank]
        pc, end, pending = state.pc, len(order), state.pending
        while pc < end:
            step = order[pc]
            if step is None or step.type not in COMM:
                pc += 1
                continue
            if not state.posted:
                state.posted = True
                for leaf in step.sub_steps or (step,):
                    route = routes.get((leaf.type, leaf.stage))  # type: ignore[arg-type]
                    if route is None:
                        _needless_p2p(schedule, rank, leaf)
                    posted, counterparts, peer, is_send = route  # type: ignore[misc]
                    posted.append(leaf)
                    index = len(posted) - 1
                    if index < len(counterparts):
                        other = counterparts[index]
                        send, recv = (leaf, other) if is_send else (other, leaf)
                        if send.micro != recv.micro or recv.type is not _RECEIVER[send.type] or (
                            recv.stage != send.stage + _STEP[send.type]  # type: ignore[operator]
                        ):
                            _mismatch(leaf, other, rank, peer, index, is_send)
                        queue.append(peer)
                    else:
                        pending.append((leaf, peer, counterparts, index))
            if pending:
                pending = [p for p in pending if len(p[2]) <= p[3]]
                if pending:
                    break
            state.posted = False
            pc += 1
        state.pc, state.pending = pc, pending
    blocked = [r for r, s in enumerate(states) if s.pc < len(orders[r])]
    if blocked:
        _report_stuck(schedule, states, blocked[0])


_Route = tuple[list[Step], list[Step], int, bool]


def _routes(schedule: Schedule) -> dict[tuple[StepType, int], _Route]:
    """For each P2P leaf kind and stage: (the list its kind is posted to on its channel, the
    list of counterparts posted on that channel, the peer rank, is it a send).

    A channel is an ordered rank pair (sender, receiver); both ends match first in, first out.
    """
    ranks = schedule.stage_ranks
    sent: dict[tuple[int, int], list[Step]] = {}
    received: dict[tuple[int, int], list[Step]] = {}
    routes: dict[tuple[StepType, int], _Route] = {}
    for stage, rank in enumerate(ranks):
        for kind in P2P:
            other = peer_stage(kind, stage)
            if not 0 <= other < len(ranks) or ranks[other] == rank:
                continue  # no P2P here: such a leaf is reported as needless
            peer = ranks[other]
            is_send = kind in SENDS
            channel = (rank, peer) if is_send else (peer, rank)
            mine, theirs = (sent, received) if is_send else (received, sent)
            routes[kind, stage] = (mine.setdefault(channel, []), theirs.setdefault(channel, []),
                                   peer, is_send)
    return routes


def _describe(step: Step) -> str:
    activation, stage, micro = _payload(step)
    return f"{'activation' if activation else 'gradient'} of stage {stage} micro {micro}"


def _mismatch(leaf: Step, other: Step, rank: int, peer: int, index: int, is_send: bool) -> None:
    send, recv = (leaf, other) if is_send else (other, leaf)
    src, dst = (rank, peer) if is_send else (peer, rank)
    nth = _ordinal(index + 1)
    raise P2PError(
        f"rank {src}'s {nth} send to rank {dst} is {send} (the {_describe(send)}) but rank "
        f"{dst}'s {nth} receive from rank {src} is {recv} (expecting the {_describe(recv)}); "
        "sends and receives between two ranks must come in the same order", rank=dst)


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _report_stuck(schedule: Schedule, states: list[_RankState], start: int) -> None:
    def waiting(rank: int) -> tuple[str, int]:
        state = states[rank]
        return str(schedule.orders[rank][state.pc]), state.pending[0][1]

    path: list[int] = []
    seen: dict[int, int] = {}
    rank = start
    while rank not in seen:
        seen[rank] = len(path)
        path.append(rank)
        step, peer = waiting(rank)
        if states[peer].pc >= len(schedule.orders[peer]):
            leaf = states[rank].pending[0][0]
            missing = "receive" if leaf.type in SENDS else "send"
            raise P2PError(
                f"rank {rank} waits at {step} for rank {peer}, whose order ends without the "
                f"matching {missing} of {leaf}; add it to rank {peer} or drop {leaf}", rank=rank)
        rank = peer
    cycle = tuple((r, *waiting(r)) for r in path[seen[rank]:])
    links = "; ".join(f"rank {r} waits at {s} for rank {p}" for r, s, p in cycle)
    raise DeadlockError(
        f"deadlock: {links}. Reorder these steps so that one side of each pair posts its "
        "send or receive first", cycle)
