"""Schedule generators: GPipe, 1F1B and Interleaved 1F1B, exactly as MindSpore hyper-parallel
orders them.

GPipe and 1F1B come with their P2P steps placed (hyper-parallel places them while generating,
with a send-first / recv-first pattern that keeps blocking P2P deadlock-free). Interleaved 1F1B is
generated as aligned compute columns (``None`` = idle slot) and gets its P2P from
:func:`pipeswap.schedule.p2p.insert_send_recv`.
"""

from __future__ import annotations

from bisect import bisect_right

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.schedule import Schedule, StageMapping, stage_to_rank
from pipeswap.schedule.steps import Step, StepType, chunk_leaf

F, B = StepType.FWD, StepType.BWD
FS, FR, BS, BR = StepType.FWD_SEND, StepType.FWD_RECV, StepType.BWD_SEND, StepType.BWD_RECV


def check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScheduleError(f"{name} must be an integer >= 1, got {value!r}")


@gc_paused
def gpipe(ranks: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards; every send right after its compute."""
    check_positive("ranks", ranks)
    check_positive("microbatches", microbatches)
    orders = []
    for r in range(ranks):
        order: list[Step | None] = []
        for m in range(microbatches):
            if r > 0:
                order.append(chunk_leaf(FR, r, m))
            order.append(chunk_leaf(F, r, m))
            if r < ranks - 1:
                order.append(chunk_leaf(FS, r, m))
        for m in range(microbatches):
            if r < ranks - 1:
                order.append(chunk_leaf(BR, r, m))
            order.append(chunk_leaf(B, r, m))
            if r > 0:
                order.append(chunk_leaf(BS, r, m))
        orders.append(tuple(order))
    return Schedule(tuple(orders), stage_to_rank(ranks, ranks, StageMapping.LOOP))


@gc_paused
def one_f_one_b(ranks: int, microbatches: int) -> Schedule:
    """1F1B: rank r runs ``min(P - r, M)`` warm-up forwards, then alternates B and F.

    Even ranks send a forward's output at once, odd ranks one step later (after the next
    receive), so neighbours never both block on a send.
    """
    check_positive("ranks", ranks)
    check_positive("microbatches", microbatches)
    orders = tuple(_one_f_one_b_rank(r, ranks, microbatches) for r in range(ranks))
    return Schedule(orders, stage_to_rank(ranks, ranks, StageMapping.LOOP))


def _one_f_one_b_rank(r: int, ranks: int, micros: int) -> tuple[Step | None, ...]:
    warmup = min(ranks - r, micros)
    has_next, has_prev = r < ranks - 1, r > 0
    order: list[Step | None] = []
    f = b = 0
    for _ in range(warmup):
        if has_prev:
            order.append(chunk_leaf(FR, r, f))
        if r % 2 == 0:
            order.append(chunk_leaf(F, r, f))
            if f != warmup - 1:
                order.append(chunk_leaf(FS, r, f))
        else:
            if f > 0:
                order.append(chunk_leaf(FS, r, f - 1))
            order.append(chunk_leaf(F, r, f))
        f += 1
    if ranks - r > micros:
        # Every forward was a warm-up one: flush the held-back send before the first backward.
        order.append(chunk_leaf(FS, r, f - 1))
        f += 1
    for _ in range(micros - warmup):
        if has_next:
            order += [chunk_leaf(BR, r, b), chunk_leaf(FS, r, f - 1)]
        order.append(chunk_leaf(B, r, b))
        if has_prev:
            order += [chunk_leaf(BS, r, b), chunk_leaf(FR, r, f)]
        order.append(chunk_leaf(F, r, f))
        f += 1
        b += 1
    for _ in range(warmup):
        if has_next:
            order.append(chunk_leaf(BR, r, b))
            if b == micros - warmup and f <= micros:
                order.append(chunk_leaf(FS, r, f - 1))
        order.append(chunk_leaf(B, r, b))
        if has_prev:
            order.append(chunk_leaf(BS, r, b))
        b += 1
    return tuple(order)


@gc_paused
def interleaved_1f1b_compute(
    ranks: int,
    microbatches: int,
    stages_per_rank: int,
    *,
    overlap_b_f: bool = False,
    less_memory: bool = False,
) -> Schedule:
    """Interleaved 1F1B compute columns, aligned across ranks (``None`` = idle slot).

    Rank r owns stages r, r+P, ..., r+(V-1)P. Microbatches are dealt out in rounds of about P;
    within a round a rank runs its chunks in order for forwards and in reverse for backwards.
    ``overlap_b_f`` pairs each steady-state backward with the next forward in an
    ``OVERLAP_B_F`` composite; ``less_memory`` halves the warm-up depth.
    """
    check_positive("ranks", ranks)
    check_positive("microbatches", microbatches)
    check_positive("stages_per_rank", stages_per_rank)
    layout = _RoundLayout(ranks, microbatches, stages_per_rank)
    orders = tuple(
        layout.rank_order(r, overlap_b_f=overlap_b_f, less_memory=less_memory)
        for r in range(ranks)
    )
    return Schedule(orders, stage_to_rank(ranks, ranks * stages_per_rank, StageMapping.LOOP))


class _RoundLayout:
    """MindSpore hyper-parallel's round layout: which stage each of a rank's V*M forward/backward ops hits."""

    def __init__(self, ranks: int, micros: int, chunks: int) -> None:
        self.ranks, self.micros, self.chunks = ranks, micros, chunks
        if micros < ranks:
            sizes = [micros]
        else:
            rounds = micros // ranks
            extra = micros % ranks
            sizes = [
                ranks + extra // rounds + (1 if i < extra % rounds else 0) for i in range(rounds)
            ]
        self.sizes = sizes
        self.starts = [0]
        for size in sizes:
            self.starts.append(self.starts[-1] + size * chunks)

    def _local_chunk(self, op: int) -> int:
        round_ = bisect_right(self.starts, op) - 1
        return (op - self.starts[round_]) // self.sizes[round_]

    def _ops(self, r: int, kind: StepType) -> list[Step]:
        counters = [0] * self.chunks
        steps = []
        for op in range(self.chunks * self.micros):
            local = self._local_chunk(op)
            chunk = local if kind is F else self.chunks - 1 - local
            steps.append(chunk_leaf(kind, chunk * self.ranks + r, counters[chunk]))
            counters[chunk] += 1
        return steps

    def rank_order(self, r: int, *, overlap_b_f: bool, less_memory: bool) -> tuple[Step | None, ...]:
        ranks, micros, total = self.ranks, self.micros, self.chunks * self.micros
        short = micros < ranks
        last_rank = r == ranks - 1
        depth = (ranks - 1 - r) if less_memory else 2 * (ranks - 1 - r)
        warmup = min((self.chunks - 1) * self.sizes[0] + depth, total)
        steady = total - warmup
        fwds, bwds = self._ops(r, F), self._ops(r, B)
        order: list[Step | None] = [None] * r
        for k in range(warmup):
            order.append(fwds[k])
            if short and fwds[k].micro == micros - 1 and not (k == warmup - 1 and not last_rank):
                order += [None] * (ranks - micros)
        order += [None] * (max(0, depth - micros) + ranks - 1 - r)

        def pad_after_backward(step: Step, pad: bool) -> None:
            if pad and short and step.micro == micros - 1:
                order.extend([None] * (2 * (ranks - micros)))

        steady_f, steady_b = fwds[warmup:], bwds[:steady]
        if overlap_b_f and steady:
            order.append(steady_f[0])
            for i in range(steady - 1):
                order.append(Step(StepType.OVERLAP_B_F, sub_steps=(steady_b[i], steady_f[i + 1])))
                pad_after_backward(steady_b[i], last_rank)
            order.append(steady_b[-1])
            pad_after_backward(steady_b[-1], last_rank)
        else:
            for fwd, bwd in zip(steady_f, steady_b):
                order += [fwd, bwd]
                pad_after_backward(bwd, last_rank)
        for bwd in bwds[steady:]:
            order += [None, bwd]
            pad_after_backward(bwd, True)
        return tuple(order)
