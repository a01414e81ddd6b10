"""Streamed loads more than one layer ahead, as the peak policy plans them under a budget.

A load slower than a layer's backward stalls every layer of a backward that loads one layer
ahead; two ahead hides it behind two layers, for one more layer on the device. The policy's
plans alike on every chunk try both, and a plan over the budget at a few points only is
fitted chunk by chunk (:mod:`pipeswap.schedule.policies._fit`) rather than dropped.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest

from pipeswap.schedule import ScheduleError, ScheduleKind, ScheduleSpec, build_schedule
from pipeswap.schedule.costs import Link, TransformerShape, from_preset
from pipeswap.schedule.policies import PeakPolicy, _mixed, _rank_search
from pipeswap.schedule.policies._fit import fit
from pipeswap.schedule.policies._mixed import alike, layer_counts, spread
from pipeswap.schedule.policies._pipeline import placed
from pipeswap.schedule.simulate import simulate, simulate_alone
from pipeswap.schedule.swap_order import inject_swap_order, swap_candidates
from pipeswap.schedule.swap_plan import RankPlan, SwapPlacement

#: hidden 8192 on a PCIe Gen4 link: a layer's load (46 ms) outlasts its backward (36 ms).
GEN4 = replace(from_preset("h100-pcie5", TransformerShape(hidden=8192, seq_len=4096, layers=4)),
               link=Link(25e9, 25e9))
SPEC = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8)


def _budget(share: float) -> int:
    plain = simulate(build_schedule(SPEC), GEN4)
    return int(max(rank.peak_activation_bytes for rank in plain.ranks) * share)


@pytest.mark.source_only  # it replaces the fit the rank search calls
def test_loads_two_layers_ahead_where_the_budget_allows(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Under half the peak: loads one layer ahead leave the step 9% over no swap; two ahead,
    fitted to the budget, 2%. Without the fit, the plans that load two ahead and meet the
    budget as they are recompute layers: 5%."""
    budget = _budget(0.5)
    swapped = replace(SPEC, swap=True)

    def planned() -> tuple[float, set[int]]:
        result = simulate(build_schedule(swapped, PeakPolicy(GEN4, budget, recompute="auto")),
                          GEN4)
        assert all(rank.peak_activation_bytes <= budget for rank in result.ranks)
        return result.step_time, {c.load_depth for r in result.ranks for c in r.swapped}

    both, depths = planned()
    assert 2 in depths
    with monkeypatch.context() as patch:
        patch.setattr(_mixed, "DEEPEST_LOAD", 1)
        one_ahead, depths = planned()
    assert depths <= {0, 1} and both < one_ahead * 0.95
    monkeypatch.setattr(_rank_search, "fit", lambda *args: None)
    unfitted, depths = planned()
    assert both * 1.02 < unfitted < one_ahead


def test_a_fit_lowers_lags_and_depths_only_where_the_plan_goes_over() -> None:
    """Rank 0's plans alike on every chunk that go over half its peak: each fitted plan
    meets the budget by lowering some chunks' lags or load depths (never raising one, never
    dropping a chunk), and one over at a single point changes in one chunk. A budget no
    lowering reaches gets no plan."""
    budget = _budget(0.5)
    given = build_schedule(SPEC).orders[0]
    candidates = swap_candidates(given, 0)
    plans = alike(candidates, layer_counts(GEN4), "auto")
    changes = []
    for recomputed, placements in plans.values():
        order_of = partial(placed, given, 0, recomputed)
        if simulate_alone(order_of(placements), 0, GEN4).peak_activation_bytes <= budget:
            continue
        fitted = fit(placements, order_of, 0, GEN4, budget)
        if fitted is None:
            continue
        found = fitted.placements
        assert found.keys() == placements.keys()
        changed = [key for key in found if found[key] != placements[key]]
        assert changed and all(
            found[key].layer_lag <= placements[key].layer_lag
            and found[key].load_depth <= placements[key].load_depth
            and found[key][:2] == placements[key][:2] for key in changed)
        run = simulate_alone(order_of(found), 0, GEN4)
        assert run.peak_activation_bytes <= budget
        assert (run.step_time, run.peak_activation_bytes, run.exposed_copy) == (
            fitted.run.step_time, fitted.run.peak_activation_bytes, fitted.run.exposed_copy)
        changes.append(len(changed))
    assert len(changes) >= 3 and min(changes) == 1
    recomputed, deep = plans[0, 4, 2, 0]
    assert fit(deep, partial(placed, given, 0, recomputed), 0, GEN4, budget // 8) is None


@pytest.mark.parametrize(("count", "k", "layers"), [
    (4, 1, (3,)), (4, 2, (1, 3)), (4, 3, (1, 2, 3)), (8, 2, (3, 7)), (8, 4, (1, 3, 5, 7)),
    (3, 2, (1, 2))])
def test_layers_spread_end_with_the_last(count: int, k: int, layers: tuple[int, ...]) -> None:
    assert spread(count, k) == layers


def test_recomputing_layers_spread_hides_the_loads_of_those_between(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a quarter of the peak: with the first layers of each chunk recomputed the plan
    is 20% over no swap; with layers 1 and 3 recomputed each streamed layer's load hides
    behind the recompute and backward of the layer after it, and fewer layers need
    recomputing: 14%."""
    budget = _budget(0.25)
    swapped = replace(SPEC, swap=True)

    def planned() -> tuple[float, int]:
        result = simulate(build_schedule(swapped, PeakPolicy(GEN4, budget, recompute="auto")),
                          GEN4)
        assert all(rank.peak_activation_bytes <= budget for rank in result.ranks)
        return result.step_time, sum(rank.recomputed_layers for rank in result.ranks)

    spread_out, recomputed = planned()
    monkeypatch.setattr(_mixed, "spread", lambda count, k: tuple(range(k)))
    first_only, more = planned()
    assert spread_out < first_only * 0.96 and recomputed < more


def test_long_chunks_get_a_bounded_number_of_plans_alike() -> None:
    """Every recompute count and lag for four layers a chunk; for 32, counts below 8 and
    every fourth, lags up to 4 and a quarter, half, three quarters and all of the chunk:
    the plans grow with the layers' logarithm, not their square."""
    given = build_schedule(SPEC).orders[0]
    candidates = swap_candidates(given, 0)

    def choices(layers: int) -> tuple[set[int], set[int]]:
        plans = alike(candidates, lambda key: layers, "auto")
        return {k for k, _, _, _ in plans}, {lag for _, lag, _, _ in plans}

    assert choices(4) == ({0, 1, 2, 3}, {1, 2, 3, 4})
    counts, lags = choices(32)
    assert counts == set(range(8)) | {8, 12, 16, 20, 24, 28}
    assert lags == {1, 2, 3, 4, 8, 16, 24, 32}
    assert len(alike(candidates, lambda key: 32, "auto")) <= 14 * 8 * 2 * 2


def test_placements_of_three_numbers_and_whole_chunks_of_no_depth_place() -> None:
    """A policy's plain (offload, load, lag) tuple still places (load depth 1), a whole
    chunk ignores its load depth, and a streamed chunk's depth below 1 is refused."""
    given = build_schedule(SPEC).orders[0]
    key = swap_candidates(given, 0)[0].key

    def steps_of(placement: object) -> list[str]:
        order = inject_swap_order(given, RankPlan(0, {key: placement}))  # type: ignore[dict-item]
        return [str(step) for step in order if step is not None and step.key == key
                and step.type.name.startswith("SWAP")]

    assert steps_of((1, 1, 2)) == steps_of(SwapPlacement(1, 1, 2, 1)) == [
        "0SO0:2", "0WO0", "0SL0", "0WL0"]
    assert steps_of(SwapPlacement(1, 1, 0, 0)) == ["0LO0", "0WO0", "0LL0", "0WL0"]
    with pytest.raises(ScheduleError, match="with a load depth of 0; a streamed load runs"):
        steps_of(SwapPlacement(1, 1, 2, 0))
