"""PyTorch's pipeline schedules as compute orders: LoopedBFS, Interleaved zero bubble (ZB1P),
ZBV zero bubble and DualPipeV.

For the same arguments each generator gives, rank by rank, the compute order that
``torch.distributed.pipelining`` builds (idle slots included), so that a PyTorch user can keep
the schedule they run and add swap to it. The orders hold no P2P: the send/recv pass adds it,
following each schedule's stage placement (loop, or V for ZBV and DualPipeV, where the two
stages at the turn of the V share a rank and hand over locally).
"""

from __future__ import annotations

from collections import defaultdict

from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.generators import check_positive
from pipeswap.schedule.lockstep import Visibility, lockstep
from pipeswap.schedule.schedule import Message, Schedule, StageMapping, stage_to_rank
from pipeswap.schedule.steps import Step, StepType, chunk_leaf

F, B, I, W = StepType.FWD, StepType.BWD, StepType.BWD_INPUT, StepType.BWD_WEIGHT
Slots = list["Step | None"]


def _schedule(orders: list[Slots], ranks: int, num_stages: int,
              mapping: StageMapping) -> Schedule:
    return Schedule(tuple(tuple(order) for order in orders),
                    stage_to_rank(ranks, num_stages, mapping))


def looped_bfs(ranks: int, microbatches: int, stages_per_rank: int) -> Schedule:
    """Breadth first: each rank runs all microbatches of its first stage, then of the next;
    backwards the other way round, after waiting two slots per hop to the last rank."""
    for name, value in (("ranks", ranks), ("microbatches", microbatches),
                        ("stages_per_rank", stages_per_rank)):
        check_positive(name, value)
    orders = []
    for rank in range(ranks):
        stages = range(rank, ranks * stages_per_rank, ranks)
        order: Slots = [None] * rank
        for stage in stages:
            order += [chunk_leaf(F, stage, micro) for micro in range(microbatches)]
        order += [None] * (2 * (ranks - 1 - rank))
        for stage in reversed(stages):
            order += [chunk_leaf(B, stage, micro) for micro in reversed(range(microbatches))]
        orders.append(order)
    return _schedule(orders, ranks, ranks * stages_per_rank, StageMapping.LOOP)


def interleaved_zero_bubble(ranks: int, microbatches: int, stages_per_rank: int) -> Schedule:
    """ZB1P: interleaved 1F1B with backwards split into I and W, W deferred to fill the
    bubbles, then forward slots delayed until their input exists on any rank."""
    for name, value in (("ranks", ranks), ("microbatches", microbatches),
                        ("stages_per_rank", stages_per_rank)):
        check_positive(name, value)
    rounds = max(1, microbatches // ranks)
    if microbatches % rounds:
        raise ScheduleError(
            f"interleaved-zb needs the microbatch count to be a multiple of the number of "
            f"rounds ({rounds} = microbatches // ranks), got {microbatches}")
    per_round = microbatches // rounds
    orders = [_zero_bubble_rank(rank, ranks, microbatches, stages_per_rank, per_round)
              for rank in range(ranks)]
    return _schedule(_delay_forwards(orders), ranks, ranks * stages_per_rank, StageMapping.LOOP)


def _zero_bubble_rank(rank: int, ranks: int, microbatches: int, local: int,
                      per_round: int) -> Slots:
    warmup = min((local - 1) * per_round + (ranks - 1 - rank), microbatches * local)
    steady = microbatches * local - warmup

    def forward_stage(op: int) -> int:
        return (op // per_round) % local * ranks + rank

    def backward_stage(op: int) -> int:
        return (local - 1 - ((op - warmup) // per_round) % local) * ranks + rank

    counts: dict[tuple[StepType, int], int] = defaultdict(int)

    def take(kind: StepType, stage: int) -> Step:
        micro = counts[(kind, stage)]
        counts[(kind, stage)] += 1
        return chunk_leaf(kind, stage, micro)

    order: Slots = [None] * rank
    backwards: list[int] = []  # the op number of each backward, in order
    weights = 0

    def weight_if_due(op: int) -> None:
        nonlocal weights
        if op - warmup >= rank:  # rank r keeps r backwards' weights for later
            order.append(take(W, backward_stage(backwards[weights])))
            weights += 1

    for op in range(microbatches * local + warmup):
        if op < warmup:
            order.append(take(F, forward_stage(op)))
            if op == warmup - 1:
                order.extend([None] * (ranks - rank - 1))
            continue
        if op < warmup + steady:
            order.append(take(F, forward_stage(op)))
        order.append(take(I, backward_stage(op)))
        backwards.append(op)
        weight_if_due(op)
    while weights < len(backwards):
        order.append(take(W, backward_stage(backwards[weights])))
        weights += 1
    return order


def _delay_forwards(orders: list[Slots]) -> list[Slots]:
    """Run all ranks a slot at a time; a forward whose input no rank produced in an earlier
    slot waits one slot (an idle slot goes in front of it)."""
    result: list[Slots] = [[] for _ in orders]

    def needs(step: Step | None) -> list[Message]:
        if step is not None and step.type is F and step.stage:
            return [Message(True, step.stage - 1, step.micro or 0)]
        return []

    def take(rank: int, step: Step | None) -> list[Message]:
        result[rank].append(step)
        return [] if step is None or step.type is not F else [Message(True, *step.key)]

    waiting = lockstep(orders, needs, take, visibility=Visibility.NEXT_ROUND,
                       wait=lambda rank: result[rank].append(None))
    if waiting:  # the generators' orders always run; this guards against a broken one
        raise ScheduleError(f"forwards wait for inputs no rank makes: {waiting}")
    return result


def zbv(ranks: int, microbatches: int) -> Schedule:
    """ZBV zero bubble: two stages per rank on a V (rank r runs stages r and 2P-1-r), I and W
    split, weights filling the bubbles. Orders are built for max(M, 2P-1) microbatches and
    those past M become idle slots, as in PyTorch."""
    check_positive("ranks", ranks)
    check_positive("microbatches", microbatches)
    stages = 2 * ranks
    total = max(2 * ranks - 1, microbatches)
    orders = []
    for rank in range(ranks):
        order = _zbv_rank(rank, ranks, total)
        orders.append([s if s is not None and s.micro is not None and s.micro < microbatches
                       else None for s in order])
    return _schedule(orders, ranks, stages, StageMapping.V)


def _zbv_rank(rank: int, ranks: int, total: int) -> Slots:
    first, second = rank, 2 * ranks - 1 - rank
    counts: dict[tuple[StepType, int], int] = defaultdict(int)
    order: Slots = [None] * rank

    def add(kind: StepType, stage: int) -> None:
        order.append(chunk_leaf(kind, stage, counts[(kind, stage)]))
        counts[(kind, stage)] += 1

    for _ in range(2 * (ranks - rank) - 1):
        add(F, first)
    for _ in range(rank):
        add(F, second)
        add(F, first)
    for _ in range(ranks - rank):
        add(F, second)
        add(I, second)
        add(W, second)
    while counts[(F, second)] < counts[(F, first)] or counts[(F, first)] < total:
        if counts[(F, first)] < total:
            add(F, first)
        add(I, first)
        add(W, first)
        add(F, second)
        add(I, second)
        add(W, second)
    for _ in range(rank):
        add(I, first)
        add(I, second)
    for _ in range(ranks - rank):
        add(I, first)
        add(W, first)
    for stage in (second, first):
        while counts[(W, stage)] < counts[(I, stage)]:
            add(W, stage)
    return order


def dualpipev(ranks: int, microbatches: int) -> Schedule:
    """DualPipeV: two stages per rank on a V; in the steady state each slot overlaps one
    stage's forward with the other's full backward (OVERLAP_F_B); the last backwards split
    into I and W to fill the tail."""
    check_positive("ranks", ranks)
    check_positive("microbatches", microbatches)
    stages = 2 * ranks
    if microbatches < stages:
        raise ScheduleError(f"dualpipev needs at least as many microbatches as stages "
                            f"({stages} for {ranks} ranks), got {microbatches}")
    return _schedule([_dualpipev_rank(rank, ranks, microbatches) for rank in range(ranks)],
                     ranks, stages, StageMapping.V)


def _dualpipev_rank(rank: int, ranks: int, microbatches: int) -> Slots:
    first, second = rank, 2 * ranks - 1 - rank
    # Microbatch counters: a full backward advances both the I and the W counter of its stage.
    counts: dict[tuple[StepType, int], int] = defaultdict(int)
    pending_weights: list[tuple[int, int]] = []
    order: Slots = []

    def step(kind: StepType, stage: int) -> Step:
        made = chunk_leaf(kind, stage, counts[(I if kind is B else kind, stage)])
        if kind is B:
            counts[(I, stage)] += 1
            counts[(W, stage)] += 1
        else:
            if kind is I:
                pending_weights.append((stage, made.micro or 0))
            counts[(kind, stage)] += 1
        return made

    def add(kind: StepType, stage: int) -> None:
        order.append(step(kind, stage))

    def overlap(forward_stage: int, backward_stage: int) -> None:
        forward = step(F, forward_stage)
        backward = step(B, backward_stage)
        order.append(Step(StepType.OVERLAP_F_B, sub_steps=(forward, backward)))

    def weight_if_pending() -> None:
        if pending_weights:
            stage, micro = pending_weights.pop(0)
            order.append(chunk_leaf(W, stage, micro))
            counts[(W, stage)] += 1

    for _ in range((ranks - rank - 1) * 2):
        add(F, first)
    for _ in range(rank + 1):
        add(F, first)
        add(F, second)
    for _ in range(ranks - rank - 1):
        add(I, second)
        weight_if_pending()
        add(F, second)
    for index in range(microbatches - 2 * ranks + rank + 1):
        if index == 0 and rank == ranks - 1:
            add(F, first)
            add(B, second)
        else:
            overlap(first, second)
        overlap(second, first)
    for _ in range(ranks - rank - 1):
        add(B, second)
        overlap(second, first)
    split = False
    tail = rank + 1
    for index in range(tail):
        if index == tail // 2 and rank % 2 == 1:
            split = True
        add(I if split else B, second)
        if index == tail // 2 and rank % 2 == 0:
            split = True
        add(I if split else B, first)
    for _ in range(ranks - rank - 1):
        weight_if_pending()
        add(I if split else B, first)
    for _ in range(rank + 1):
        weight_if_pending()
    return order

