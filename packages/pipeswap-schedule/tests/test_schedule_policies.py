"""Cost-aware swap policies: copies that hide, and a memory budget."""

from __future__ import annotations

import pytest

from pipeswap.schedule import (
    ScheduleKind,
    ScheduleSpec,
    build_schedule,
    swapped_chunks,
)
from pipeswap.schedule.costs import CostModel, Link
from pipeswap.schedule.policies import CostModelPolicy, MemoryBudgetPolicy
from pipeswap.schedule.simulate import simulate

ONE_F_ONE_B = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8, swap=True)
UNIT = CostModel(forward=1.0, backward=2.0, activation_bytes=100)


def test_the_budget_is_met_where_it_can_be_and_the_shortfall_said_where_not() -> None:
    # Without swap, 1F1B P=4 holds 4, 3, 2, 1 chunks at its peak on ranks 0..3. Rank 1 peaks
    # at the end of warm-up (chunks 0, 1, 2), when no chunk can be off the device yet.
    policy = MemoryBudgetPolicy(UNIT, budget={0: 300, 1: 250, 2: 200, 3: 100})
    schedule = build_schedule(ONE_F_ONE_B, policy)
    result = simulate(schedule, UNIT)
    outcomes = policy.outcomes
    assert [outcomes[r].peak_no_swap for r in range(4)] == [400, 300, 200, 100]
    assert outcomes[0].met and outcomes[0].peak == 300
    assert not outcomes[1].met and outcomes[1].shortfall == 50
    assert outcomes[2].met and outcomes[3].met
    assert swapped_chunks(schedule)[2] == swapped_chunks(schedule)[3] == ()  # nothing needed
    for rank in result.ranks:  # the policy's own count agrees with the full simulation
        assert rank.peak_activation_bytes == outcomes[rank.rank].peak
    assert len(swapped_chunks(schedule)[0]) < 8  # fewer than the gap rule takes


def test_a_generous_budget_swaps_nothing() -> None:
    policy = MemoryBudgetPolicy(UNIT, budget=10_000)
    schedule = build_schedule(ONE_F_ONE_B, policy)
    assert all(chunks == () for chunks in swapped_chunks(schedule))
    assert all(outcome.met and outcome.exposed_copy == 0 for outcome in policy.outcomes.values())


def test_the_budget_takes_the_chunks_that_stall_least() -> None:
    # Forwards take 1 s, backwards 4 s, copies 2 s: a copy hides in the slot before a
    # backward but not in the one after a forward. To bring rank 0 from 4 chunks to 3 the
    # policy takes the chunks that stall least, so the same peak costs less exposed copy
    # time than with the gap rule, and its estimate is what the full simulation finds.
    costs = CostModel(forward=1.0, backward=4.0, activation_bytes=100, link=Link(50.0, 50.0))
    policy = MemoryBudgetPolicy(costs, budget=300)
    chosen = simulate(build_schedule(ONE_F_ONE_B, policy), costs).ranks[0]
    gap_rule = simulate(build_schedule(ONE_F_ONE_B), costs).ranks[0]
    outcome = policy.outcomes[0]
    assert outcome.met and chosen.peak_activation_bytes == gap_rule.peak_activation_bytes == 300
    assert outcome.exposed_copy == chosen.exposed_copy < gap_rule.exposed_copy


def test_the_cost_policy_takes_only_chunks_whose_copies_hide() -> None:
    gap_rule = build_schedule(ONE_F_ONE_B)
    fast = CostModel(forward=1.0, backward=2.0, activation_bytes=100, link=Link(1e6, 1e6))
    assert swapped_chunks(build_schedule(ONE_F_ONE_B, CostModelPolicy(fast))) == \
        swapped_chunks(gap_rule)  # everything hides on a fast link
    crawl = CostModel(forward=1.0, backward=2.0, activation_bytes=100, link=Link(1.0, 1.0))
    assert all(c == () for c in swapped_chunks(build_schedule(ONE_F_ONE_B,
                                                              CostModelPolicy(crawl))))
    # Copies of 1.5 s do not hide in a 1 s forward slot (warm-up) but do in a 2 s backward
    # slot (steady state): the gap rule stalls compute, the cost policy does not.
    medium = CostModel(forward=1.0, backward=2.0, activation_bytes=150, link=Link(100.0, 100.0))
    stalled = simulate(gap_rule, medium)
    assert stalled.ranks[0].exposed_copy > 0
    schedule = build_schedule(ONE_F_ONE_B, CostModelPolicy(medium))
    chosen = swapped_chunks(schedule)
    assert 0 < len(chosen[0]) < len(swapped_chunks(gap_rule)[0])
    hidden = simulate(schedule, medium)
    for rank in hidden.ranks:
        assert rank.exposed_copy == 0.0 and all(c.hidden for c in rank.swapped)
    assert hidden.step_time < stalled.step_time


def test_a_budget_per_rank_must_cover_every_rank() -> None:
    from pipeswap.schedule import ScheduleError

    with pytest.raises(ScheduleError, match="no figure for rank 2"):
        build_schedule(ONE_F_ONE_B, MemoryBudgetPolicy(UNIT, budget={0: 1, 1: 1}))
