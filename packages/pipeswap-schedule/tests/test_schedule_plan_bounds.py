"""The bounds that let the peak policy skip work without changing a plan: a copy's least
lateness never exceeds what queueing it adds, the stalling choice worked out best first is
the one working out every choice gives, and a plan alike on every chunk holds no less than
the same plan with lag and depth 1 (why a plan whose lag-1, depth-1 sibling is over the
budget is neither fitted nor, where another plan meets the budget, made)."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from pipeswap.schedule import ScheduleKind, ScheduleSpec, build_schedule
from pipeswap.schedule.costs import CostModel, Link, TransformerShape, from_preset
from pipeswap.schedule.policies._chunk_plan import ChunkPlan
from pipeswap.schedule.policies._mixed import alike, layer_counts
from pipeswap.schedule.policies._pipeline import placed
from pipeswap.schedule.policies._slots import Timeline
from pipeswap.schedule.policies._streams import AFTER, Copy, CopyStream
from pipeswap.schedule.simulate import simulate_alone
from pipeswap.schedule.swap_order import swap_candidates

#: A small transformer whose copies outlast its compute on these links.
SHAPE = TransformerShape(hidden=4096, seq_len=4096, layers=4)


def _costs(bandwidth: float, duplex: bool = True) -> CostModel:
    return replace(from_preset("h100-pcie5", SHAPE),
                   link=Link(bandwidth, bandwidth, duplex=duplex))


def _copy(slot: int, release: float, duration: float, owner: int, deadline: float) -> Copy:
    return Copy((slot, AFTER, release, owner), release, duration, (0, owner), 0, True,
                deadline)


def _lateness(queued: list[tuple[Copy, float]]) -> float:
    return sum(max(0.0, end - copy.deadline) for copy, end in queued)


def _queue(rng: random.Random, count: int) -> CopyStream:
    stream = CopyStream()
    for owner in range(count):
        release = rng.uniform(0.0, 20.0)
        stream.replace((0, owner), [_copy(int(release), release, rng.uniform(0.1, 3.0), owner,
                                          release + rng.uniform(0.0, 4.0))])
    return stream


@pytest.mark.parametrize("seed", range(30))
def test_a_copys_least_lateness_is_never_more_than_queueing_it_adds(seed: int) -> None:
    rng = random.Random(seed)
    stream = _queue(rng, rng.randint(0, 12))
    before = _lateness(stream.with_replaced((0, -1), []))
    for trial in range(15):
        release = rng.uniform(0.0, 22.0)
        new = _copy(int(release), release, rng.uniform(0.1, 3.0), 100 + trial,
                    release + rng.uniform(0.0, 3.0))
        added = _lateness(stream.with_replaced(new.owner, [new])) - before
        assert stream.least_lateness(new) <= added + 1e-9


def test_behind_copies_that_all_wait_and_run_late_the_bound_is_exact() -> None:
    stream = CopyStream()
    for owner in range(3):  # back to back from 1.0, each due before it can end
        stream.replace((0, owner), [_copy(1 + owner, 1.0, 1.0, owner, 1.5)])
    new = _copy(0, 0.0, 2.0, 9, 1.0)  # ends at 2.0, 1.0 late; pushes each of them 1.0 later
    before = _lateness(stream.with_replaced((0, -1), []))
    assert _lateness(stream.with_replaced(new.owner, [new])) - before == 4.0
    assert stream.least_lateness(new) == 4.0


def _stalling_by_every_choice(plan: ChunkPlan, first: int, peak: int) -> object:
    """What the chunk plan's stalling choice was before it worked out choices best first:
    every choice's stall, the least (then fewest slots at the peak, ...; the first of
    equals)."""
    best = None
    for _, *rest, index, placement in plan._stalling_options(first, peak):
        order = (plan._added(index, placement, strict=False), *rest)
        if best is None or order < best[0]:
            best = (order, index, placement)
    return None if best is None else best[1:]


@pytest.mark.parametrize(("kind", "bandwidth", "duplex"), [
    (ScheduleKind.ONE_F_ONE_B, 12e9, True),
    (ScheduleKind.LOOPED_BFS, 25e9, True),
    (ScheduleKind.GPIPE, 25e9, False),
])
def test_the_stalling_choice_worked_out_best_first_is_the_one_every_choice_gives(
        kind: ScheduleKind, bandwidth: float, duplex: bool) -> None:
    costs = _costs(bandwidth, duplex)
    schedule = build_schedule(ScheduleSpec(
        kind, ranks=2, microbatches=12,
        stages_per_rank=2 if kind is ScheduleKind.LOOPED_BFS else 1))
    order = schedule.orders[0]
    plan = ChunkPlan(costs, 0, Timeline.of(order, costs, 0), swap_candidates(order, 0))
    plan.lower(None, allow_stall=False)
    steps = 0
    while plan.peak > 0 and steps < 200:
        first = plan.profile.first(plan.peak)
        chosen = plan._stalling(first, plan.peak)
        assert chosen == _stalling_by_every_choice(plan, first, plan.peak)
        if chosen is None:
            break
        plan._place(*chosen)
        steps += 1
    assert steps > 5  # the link falls short: many choices stall


@pytest.mark.parametrize("bandwidth", [6e9, 25e9])
@pytest.mark.parametrize("rank", [0, 2])
def test_a_plan_alike_on_every_chunk_holds_no_less_than_with_lag_and_depth_one(
        bandwidth: float, rank: int) -> None:
    costs = _costs(bandwidth)
    order = build_schedule(ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4,
                                        microbatches=8)).orders[rank]
    plans = alike(swap_candidates(order, rank), layer_counts(costs), "auto")

    def peak(name: tuple[int, int, int, int]) -> int:
        recomputed, placements = plans[name]
        return simulate_alone(placed(order, rank, recomputed, placements), rank,
                              costs).peak_activation_bytes

    compared = 0
    for name in plans:
        count, lag, depth, shape = name
        if lag and (lag, depth) != (1, 1):
            assert peak(name) >= peak((count, 1, 1, shape)), name
            compared += 1
    assert compared > 10
