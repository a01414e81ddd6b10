"""Cost-aware swap policies: copies that hide, and a memory budget."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest

from pipeswap.schedule import (
    CostModel,
    CostModelPolicy,
    MemoryBudgetPolicy,
    MinGapPolicy,
    PeakPolicy,
    PlanOutcome,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    StageCosts,
    SwapCandidate,
    SwapPlacement,
    SwapPlan,
    build_planned,
    build_schedule,
    default_swap_policy,
    inject_swap,
    simulate,
    swap_candidates,
    swapped_chunks,
    uniform_layers,
)
from pipeswap.schedule.costs import Link
from pipeswap.schedule.steps import Order

def _outcomes(plan: SwapPlan | None) -> dict[int, PlanOutcome]:
    """Each planned rank's outcome."""
    assert plan is not None
    found = {rank: plan.outcome(rank) for rank in plan.ranks}
    return {rank: outcome for rank, outcome in found.items() if outcome is not None}


ONE_F_ONE_B = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8, swap=True)
UNIT = CostModel(forward=1.0, backward=2.0, activation_bytes=100)


def test_the_budget_is_met_where_it_can_be_and_the_shortfall_said_where_not() -> None:
    # Without swap, 1F1B P=4 holds 4, 3, 2, 1 chunks at its peak on ranks 0..3. Rank 1 peaks
    # at the end of warm-up (chunks 0, 1, 2), when no chunk can be off the device yet.
    policy = MemoryBudgetPolicy(UNIT, budget={0: 300, 1: 250, 2: 200, 3: 100})
    schedule, plan = build_planned(ONE_F_ONE_B, policy)
    result = simulate(schedule, UNIT)
    outcomes = _outcomes(plan)
    assert [outcomes[r].peak_no_swap for r in range(4)] == [400, 300, 200, 100]
    assert outcomes[0].met and outcomes[0].peak == 300
    assert not outcomes[1].met and outcomes[1].shortfall == 50
    assert outcomes[2].met and outcomes[3].met
    assert swapped_chunks(schedule)[2] == swapped_chunks(schedule)[3] == ()  # nothing needed
    for rank in result.ranks:  # the policy's own count agrees with the full simulation
        assert rank.peak_activation_bytes == outcomes[rank.rank].peak
    assert len(swapped_chunks(schedule)[0]) < 8  # fewer than the gap rule takes


def test_a_generous_budget_swaps_nothing() -> None:
    schedule, plan = build_planned(ONE_F_ONE_B, MemoryBudgetPolicy(UNIT, budget=10_000))
    assert all(chunks == () for chunks in swapped_chunks(schedule))
    assert all(outcome.met and outcome.exposed_copy == 0
               for outcome in _outcomes(plan).values())


def test_the_budget_takes_the_chunks_that_stall_least() -> None:
    # Forwards take 1 s, backwards 4 s, copies 2 s: a copy hides in the slot before a
    # backward but not in the one after a forward. To bring rank 0 from 4 chunks to 3 the
    # policy takes the chunks that stall least, so the same peak costs less exposed copy
    # time than with the gap rule, and its estimate is what the full simulation finds.
    costs = CostModel(forward=1.0, backward=4.0, activation_bytes=100, link=Link(50.0, 50.0))
    schedule, plan = build_planned(ONE_F_ONE_B, MemoryBudgetPolicy(costs, budget=300))
    chosen = simulate(schedule, costs).ranks[0]
    gap_rule = simulate(build_schedule(ONE_F_ONE_B, MinGapPolicy()), costs).ranks[0]
    outcome = _outcomes(plan)[0]
    assert outcome.met and chosen.peak_activation_bytes == gap_rule.peak_activation_bytes == 300
    assert outcome.exposed_copy == chosen.exposed_copy < gap_rule.exposed_copy


def test_the_cost_policy_takes_only_chunks_whose_copies_hide() -> None:
    gap_rule = build_schedule(ONE_F_ONE_B, MinGapPolicy())
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
    with pytest.raises(ScheduleError, match="no figure for rank 2"):
        build_schedule(ONE_F_ONE_B, MemoryBudgetPolicy(UNIT, budget={0: 1, 1: 1}))


# -- the peak policy (the default) ------------------------------------------------------------

H100_1F1B = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=8, microbatches=16, swap=True)


def _h100() -> CostModel:
    """hidden 8192, seq 4096, 4 layers a stage on h100-pcie5: a copy of a chunk (4.25 GiB,
    83 ms at 55 GB/s) takes longer than its forward (71 ms), shorter than its backward."""
    from pipeswap.schedule.costs import TransformerShape, from_preset

    return from_preset("h100-pcie5", TransformerShape(8192, 4096, 4, 1, 2))


def test_the_peak_policy_swaps_only_what_lowers_a_ranks_peak() -> None:
    costs = _h100()
    policy = PeakPolicy(costs, granularity="chunk")  # whole chunks (streaming: its own tests)
    result = simulate(build_schedule(H100_1F1B, policy), costs)
    for rank in result.ranks:
        if rank.swapped:
            assert rank.peak_activation_bytes < rank.peak_activation_bytes_no_swap, rank.rank
        assert rank.exposed_copy == 0, rank.rank  # every copy hides
    assert [bool(rank.swapped) for rank in result.ranks] == [True] * 4 + [False] * 4
    # Rank 0 holds 4 of its 8 chunks at most. (3 would need the warm-up's offloads, 83 ms
    # each, to keep up with 71 ms forwards: only a budget exposes copies for that.)
    zero = result.ranks[0]
    assert zero.peak_activation_bytes * 2 == zero.peak_activation_bytes_no_swap
    # Each chunk taken lowers the peak: without any one of them the rank holds more.
    order = build_schedule(dataclasses.replace(H100_1F1B, swap=False)).orders[0]
    chosen = policy.select(0, swap_candidates(order, 0), order).placements
    for key in chosen:
        fewer = {k: p for k, p in chosen.items() if k != key}
        held = simulate(inject_swap(build_schedule(dataclasses.replace(H100_1F1B, swap=False)),
                                    _Fixed({0: fewer})), costs).ranks[0]
        assert held.peak_activation_bytes > zero.peak_activation_bytes, key


def test_the_gap_rule_swaps_for_nothing_where_the_peak_policy_does_not() -> None:
    costs = _h100()
    gap = simulate(build_schedule(H100_1F1B, MinGapPolicy()), costs).ranks[5]
    peak = simulate(build_schedule(H100_1F1B, PeakPolicy(costs, granularity="chunk")),
                    costs).ranks[5]
    assert len(gap.swapped) == 14 and gap.peak_activation_bytes == gap.peak_activation_bytes_no_swap
    assert not peak.swapped


@pytest.mark.parametrize("chunks", [3, 2])
def test_a_budget_is_met_by_exposing_copies_and_says_how_much(chunks: int) -> None:
    costs = _h100()
    chunk = costs.chunk_bytes((0, 0)).total
    schedule, plan = build_planned(H100_1F1B, PeakPolicy(costs, budget=chunks * chunk,
                                                          granularity="chunk"))
    result = simulate(schedule, costs)
    zero, outcome = result.ranks[0], _outcomes(plan)[0]
    assert outcome.met and zero.peak_activation_bytes <= chunks * chunk
    assert zero.exposed_copy > 0 and outcome.exposed_copy > 0  # the price, reported
    alone = _outcomes(build_planned(H100_1F1B, PeakPolicy(costs, granularity="chunk"))[1])[0]
    assert alone.exposed_copy == 0 and not alone.budget
    if chunks == 3:  # the old budget policy meets it too, with more stall on rank 0
        old = simulate(build_schedule(H100_1F1B, MemoryBudgetPolicy(costs, 3 * chunk)), costs)
        assert zero.exposed_copy <= old.ranks[0].exposed_copy


# -- the default policy on layer counts alone -------------------------------------------------


def test_the_default_policy_plans_on_uniform_layers() -> None:
    assert uniform_layers({0: 2, 1: 3}) == {
        0: StageCosts(2.0, 4.0, layers=2), 1: StageCosts(3.0, 6.0, layers=3)}
    policy = default_swap_policy({0: 2, 1: 3}, "layer")
    assert isinstance(policy, PeakPolicy) and policy.granularity == "layer"
    assert policy.costs == CostModel(stages=uniform_layers({0: 2, 1: 3}))
    assert default_swap_policy({0: 1}).granularity == "auto"
    # one layer a stage: the default inject_swap uses, on the same uniform costs
    plain = build_schedule(dataclasses.replace(ONE_F_ONE_B, swap=False))
    assert inject_swap(plain) == inject_swap(plain, default_swap_policy(
        {stage: 1 for stage in range(plain.num_stages)}))


def test_the_default_policy_refuses_an_unknown_granularity() -> None:
    with pytest.raises(ScheduleError, match="unknown swap granularity 'layers'"):
        default_swap_policy({0: 2}, "layers")  # type: ignore[arg-type]


class _Fixed:
    """A policy that returns given placements per rank."""

    def __init__(self, chosen: dict[int, dict[tuple[int, int], SwapPlacement]]) -> None:
        self.chosen = chosen

    def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
               ) -> dict[tuple[int, int], SwapPlacement]:
        return self.chosen.get(rank, {})
