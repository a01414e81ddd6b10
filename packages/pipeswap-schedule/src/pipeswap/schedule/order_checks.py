"""The checks of one rank's order on its own: each chunk's compute, swap and P2P steps in
their sequence, hand-overs between stages on the rank, FSDP spans.

:func:`validate_rank` runs them alone; :func:`pipeswap.schedule.validation.validate` runs
them on every rank before the checks across ranks, using where each chunk's steps are
(:func:`check_rank`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from itertools import chain
from typing import NoReturn

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule.errors import (
    ChunkOrderError,
    FSDPOrderError,
    P2PError,
    SwapLifecycleError,
    ValidationError,
)
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import COMPUTE, P2P, ChunkKey, Order, Step, StepType, peer_stage

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

_NO_SWAP = [None, None, None, None]
Where = dict[StepType, dict[ChunkKey, int]]  # type -> (stage, micro) -> position in the order


@gc_paused
def validate_rank(schedule: Schedule, rank: int) -> None:
    """Check one rank's order on its own.

    Every step's stage lives on this rank; each forwarded chunk has exactly one backward
    after it (B, or I followed by W); swapped chunks run ``F < LO < WO < LL < WL <
    backward``, or streamed ``SO < F < WO < SL < WL < backward``; a chunk's RC (its
    recomputed layers) comes before its forward; P2P steps go to a remote
    neighbour, receives precede the compute that needs them and sends follow the compute
    that produces them; an input made on this rank (by a neighbouring stage placed here) is
    made before it is used; FSDP steps keep each stage they manage gathered while it
    computes. (Swap steps inside a composite cannot be built at all: :class:`Step` refuses
    them.)
    """
    check_rank(schedule, rank)


def check_rank(schedule: Schedule, rank: int) -> Where:
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
                needless_p2p(schedule, rank, leaf)
            positions, key = where[kind], (stage, micro)
            if key in positions:
                raise ChunkOrderError(
                    f"rank {rank}: {leaf} appears twice (positions {positions[key]} and "
                    f"{index}); each step of a chunk runs once", rank=rank)
            positions[key] = index
    neighbours = {  # stage -> (previous stage remote?, next stage remote?)
        stage: (stage > 0 and schedule.stage_ranks[stage - 1] != rank,
                 stage + 1 < schedule.num_stages and schedule.stage_ranks[stage + 1] != rank)
        for stage in local
    }
    fwds, fulls, dxs, dws = (where[k] for k in (StepType.FWD, StepType.BWD,
                                                  StepType.BWD_INPUT, StepType.BWD_WEIGHT))
    swaps = [where[k] for k in _SWAP_SEQUENCE]
    streams = (where[StepType.SWAP_STREAM_OFFLOAD], where[StepType.SWAP_STREAM_LOAD])
    recomputes = where[StepType.RECOMPUTE]
    recv_f, send_f, recv_b, send_b = (where[k] for k in (
        StepType.FWD_RECV, StepType.FWD_SEND, StepType.BWD_RECV, StepType.BWD_SEND))
    for key in dict.fromkeys(chain.from_iterable(where.values())):
        fwd, full = fwds.get(key), fulls.get(key)
        consumer = full if full is not None else dxs.get(key)
        if fwd is not None and consumer is not None and fwd < consumer:
            # The common, valid case, checked with a few comparisons; anything else is
            # explained by the checks below.
            dx, dw, rc = dxs.get(key), dws.get(key), recomputes.get(key)
            lo, wo, ll, wl = (positions.get(key) for positions in swaps)
            prev_remote, next_remote = neighbours[key[0]]
            fr, fs, br, bs = (recv_f.get(key), send_f.get(key), recv_b.get(key),
                              send_b.get(key))
            if (
                ((dx is None and dw is None) if full is not None
                 else (dw is not None and dw > consumer))
                and ((lo is None and wo is None and ll is None and wl is None)
                     or (lo is not None and wo is not None and ll is not None and wl is not None
                         and fwd < lo < wo < ll < wl < consumer))
                and key not in streams[0] and key not in streams[1]
                and (rc is None or rc < fwd)
                and ((fr is not None and fr < fwd and bs is not None and bs > consumer)
                     if prev_remote else (fr is None and bs is None))
                and ((fs is not None and fs > fwd and br is not None and br < consumer)
                     if next_remote else (fs is None and br is None))
            ):
                continue
        _check_compute(rank, order, key, fwd, full, where)
        _check_swap(rank, order, key, fwd, consumer, where)
        _check_recompute(rank, order, key, fwd, recomputes)
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
        step = order[index]
        assert step is not None and step.stage is not None  # an FSDP step, with its stage
        kind, stage = step.type, step.stage
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


def _misplaced(schedule: Schedule, rank: int, leaf: Step, container: Step) -> NoReturn:
    stage = leaf.stage
    assert stage is not None
    where = (f"runs on rank {schedule.stage_ranks[stage]}" if stage < schedule.num_stages
             else f"does not exist (stages 0..{schedule.num_stages - 1})")
    raise ChunkOrderError(
        f"rank {rank}: {container} names stage {stage}, which {where}; each rank's "
        "order holds only its own stages' steps", rank=rank)


def needless_p2p(schedule: Schedule, rank: int, leaf: Step) -> NoReturn:
    """Refuse a P2P leaf whose peer stage is on the same rank or does not exist."""
    assert leaf.stage is not None
    peer = peer_stage(leaf.type, leaf.stage)
    why = ("does not exist" if not 0 <= peer < schedule.num_stages
           else "is on the same rank; local neighbours exchange tensors without P2P")
    raise P2PError(f"rank {rank}: {leaf} talks to stage {peer}, which {why}; drop it", rank=rank)


def _fmt(order: Order, index: int) -> str:
    return f"{order[index]} (position {index})"


def _ascending(positions: Sequence[int | None]) -> bool:
    """Whether every position is there, each after the one before."""
    last = -1
    for position in positions:
        if position is None or position <= last:
            return False
        last = position
    return True


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
    if _ascending(positions):
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


def _check_recompute(rank: int, order: Order, key: ChunkKey, fwd: int | None,
                     recomputes: dict[ChunkKey, int]) -> None:
    """A chunk's RC says how its forward saves (only the recomputed layers' inputs), so it
    comes before that forward, on the rank that runs it."""
    at = recomputes.get(key)
    if at is None or (fwd is not None and at < fwd):
        return
    stage, micro = key
    if fwd is None:
        raise ChunkOrderError(f"rank {rank}: {_fmt(order, at)} recomputes layers of (stage "
                              f"{stage}, micro {micro}), which this rank never forwards",
                              rank=rank)
    raise ChunkOrderError(
        f"rank {rank}: {_fmt(order, at)} comes after the forward it changes, "
        f"{_fmt(order, fwd)}; put {stage}RC{micro} before {stage}F{micro}", rank=rank)


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
