"""Keep, offload or recompute: the peak policy plans swap around recomputed layers, and
chooses them itself under a budget (``recompute="auto"``, the command line's default)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from pipeswap.schedule import (
    MinGapPolicy,
    Schedule,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    StepType,
    SwapPolicy,
    apply_swap,
    build_planned,
    build_schedule,
    inject_swap,
    parse_order,
    plan_swap,
)
from pipeswap.schedule.cli import simulate_command as simulate_cli
from pipeswap.schedule.costs import CostModel, Link, StageCosts, TransformerShape, from_preset
from pipeswap.schedule.policies import (
    CostModelPolicy,
    MemoryBudgetPolicy,
    PeakPolicy,
    RecomputePolicy,
)
from pipeswap.schedule.policies import _pipeline
from pipeswap.schedule.policies import peak as peak_policy
from pipeswap.schedule.recompute_pass import inject_recompute, recomputed_in
from pipeswap.schedule.simulate import SimulationResult, simulate, simulate_alone
from pipeswap.schedule.swap_order import inject_swap_order, swap_candidates

Cli = Callable[..., tuple[int, str, str]]  # the `cli` fixture of conftest.py
#: Four layers of 100 bytes a chunk; a recomputed layer keeps its 10-byte input.
SMALL = CostModel(forward=1.0, backward=2.0, activation_bytes=400, boundary_bytes=10, layers=4,
                  link=Link(100.0, 100.0))
#: A small transformer on a PCIe Gen4 link: copies of a chunk take longer than its compute.
GEN4 = replace(from_preset("h100-pcie5", TransformerShape(hidden=4096, seq_len=4096, layers=4)),
               link=Link(25e9, 25e9))
SPEC = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8, swap=True)
ONE_RANK = "0F0 0F1 0F2 0F3 0F4 0F5 0B0 0B1 0B2 0B3 0B4 0B5"


def _swapped(result: SimulationResult) -> int:
    return sum(len(rank.swapped) for rank in result.ranks)


def test_the_peak_policy_plans_swap_around_given_rc_steps() -> None:
    plain = Schedule.from_orders([parse_order(ONE_RANK)])
    every = inject_recompute(plain, {(0, m): (0, 1, 2, 3) for m in range(6)})
    kept = simulate(every, SMALL).ranks[0].peak_activation_bytes  # kept inputs, one remade
    budget = kept - 20  # below it only by swapping the kept inputs
    for granularity in ("chunk", "auto"):
        planned = inject_swap(every, PeakPolicy(SMALL, budget, granularity=granularity))
        result = simulate(planned, SMALL)
        assert recomputed_in(planned.orders[0]) == recomputed_in(every.orders[0])
        assert _swapped(result) and result.ranks[0].peak_activation_bytes <= budget
    whole = simulate(inject_swap(every, PeakPolicy(SMALL, budget, granularity="chunk")), SMALL)
    for chunk in whole.ranks[0].swapped:  # each moved its kept bytes: 4 x 10 at 100 B/s
        assert chunk.layer_lag == 0
        assert chunk.offload[1] - chunk.offload[0] == pytest.approx(0.4)


@pytest.mark.parametrize("policy", [CostModelPolicy(SMALL), MemoryBudgetPolicy(SMALL, 100)])
def test_policies_that_plan_whole_chunks_refuse_an_order_that_recomputes(
        policy: CostModelPolicy | MemoryBudgetPolicy) -> None:
    order = Schedule.from_orders([parse_order("0RC0:0 " + ONE_RANK)])
    with pytest.raises(ScheduleError, match=r"the order recomputes layers \(0RC0:0\), but the "
                       r"(cost|budget) policy plans on whole chunks' bytes: use the peak policy"):
        inject_swap(order, policy)
    gap = inject_swap(order, MinGapPolicy(4))  # the gap rule weighs no bytes: it swaps
    assert [str(s) for s in gap.orders[0][:3]] == ["0RC0:0", "0F0", "0LO0"]


def test_a_rank_run_alone_is_simulated_as_in_its_pipeline() -> None:
    """A one-rank schedule waits for nobody: run alone, it gives simulate's figures."""
    order = parse_order("0RC0:0-1 0SO0:1 0F0 0F1 0LO1 0F2 0WO0 0F3 0WO1 0SL0 0WL0 0B0 0LL1 "
                        "0B2 0WL1 0B1 0B3")
    whole = simulate(Schedule.from_orders([order]), SMALL).ranks[0]
    alone = simulate_alone(order, 0, SMALL)
    assert (alone.peak_activation_bytes, alone.exposed_copy, alone.recompute_s,
            alone.step_time) == (whole.peak_activation_bytes, whole.exposed_copy,
                                 whole.recompute_s, whole.step_time)
    assert alone.recomputed_layers == 2 and alone.exposed_copy > 0


def test_a_backward_right_after_its_forward_streams_under_a_budget() -> None:
    """Gap one: only streaming (each copy waited for) lowers what the chunk holds."""
    plain = Schedule.from_orders([parse_order("0F0 0B0")])
    policy = PeakPolicy(SMALL, 300)
    result = simulate(inject_swap(plain, policy), SMALL)
    assert result.ranks[0].peak_activation_bytes <= 300 < 400
    assert result.ranks[0].swapped[0].layer_lag >= 1 and result.ranks[0].exposed_copy > 0


@pytest.mark.parametrize("chunks", [2.0, 1.0, 0.5])
def test_the_mix_is_never_slower_than_swap_alone_or_recompute_alone(chunks: float) -> None:
    plain = simulate(build_schedule(replace(SPEC, swap=False)), GEN4)
    budget = int(max(r.peak_activation_bytes for r in plain.ranks) / 4 * chunks)
    mixed, plan = build_planned(SPEC, PeakPolicy(GEN4, budget, recompute="auto"))
    assert plan is not None
    results = {
        "mixed": simulate(mixed, GEN4),
        "swap": simulate(build_schedule(SPEC, PeakPolicy(GEN4, budget)), GEN4),
        "recompute": simulate(build_schedule(SPEC, RecomputePolicy(GEN4, budget)), GEN4),
    }
    met = {name: result.step_time for name, result in results.items()
           if all(rank.peak_activation_bytes <= budget for rank in result.ranks)}
    assert "mixed" in met and met["mixed"] <= min(met.values()) * (1 + 1e-9)
    assert met["mixed"] < results["swap"].step_time  # the link is slow: recompute pays
    # each rank reports what it recomputes, as the simulator counts it
    for rank in results["mixed"].ranks:
        outcome = plan.outcome(rank.rank)
        assert (outcome is not None and outcome.met
                and outcome.recomputed_layers == rank.recomputed_layers)
        assert outcome.recompute_s == pytest.approx(rank.recompute_s)
        # chosen in the whole pipeline: the step it predicts is the whole schedule's
        assert plan.ranks[rank.rank].chosen_in_pipeline
        assert outcome.step_time == results["mixed"].step_time
    assert sum(rank.recomputed_layers for rank in results["mixed"].ranks) > 0


@pytest.mark.parametrize("bandwidth", [55e9, 80e9])
def test_where_a_stalled_swap_costs_less_than_recompute_the_mix_swaps_alone(
        bandwidth: float) -> None:
    """A faster link, two chunks' budget: swap alone meets it with a short stall, cheaper
    than any recompute, so the mix swaps only. At 80 GB/s rank 0's 18 ms stall costs more on
    its own timeline than two recomputed layers, but falls where the pipeline waits anyway
    and the recompute does not: weighed in the whole schedule, the mix is as fast as no swap
    (without that it was 1.5% slower). At 55 GB/s the plan alike on every chunk (each
    streamed, one slot a copy) stalls where the pipeline absorbs much of it: 2.4% over no
    swap, where the greedy swap alone is 9% over."""
    fast = replace(GEN4, link=Link(bandwidth, bandwidth))
    plain = simulate(build_schedule(replace(SPEC, swap=False)), fast)
    budget = int(max(r.peak_activation_bytes for r in plain.ranks) / 2)
    mixed, plan = build_planned(SPEC, PeakPolicy(fast, budget, recompute="auto"))
    result = simulate(mixed, fast)
    alone = simulate(build_schedule(SPEC, PeakPolicy(fast, budget)), fast)
    outcome = None if plan is None else plan.outcome(0)
    assert outcome is not None and outcome.exposed_copy > 0 and outcome.met
    assert all(rank.peak_activation_bytes <= budget for rank in result.ranks)
    assert all(rank.recomputed_layers == 0 for rank in result.ranks)
    if bandwidth == 80e9:
        # as fast as no swap, to a rounding (plans of equal steps sum their times apart)
        assert result.step_time == pytest.approx(plain.step_time)
        assert alone.step_time == pytest.approx(plain.step_time)
    else:
        assert result.step_time < alone.step_time * 0.95


@pytest.mark.parametrize(("bandwidth", "share"), [(20e9, 0.2), (55e9, 0.45)])
def test_the_pipeline_keeps_the_faster_of_its_two_starts(
        bandwidth: float, share: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks choose their plans in the whole pipeline twice: from the other ranks as
    given, and from every rank over its budget planned alike on every chunk. Neither start
    is always the better (under a fifth of the peak on a 20 GB/s link the first is, under
    45% of it on a 55 GB/s link the second), and the plan kept is that of the faster."""
    finished: list[float] = []

    def each_start(given: Schedule, costs: CostModel, options: Any, starts: Any,
                   recompute_s: Any, progress: Any) -> Any:
        for start in starts:
            chosen, _ = _pipeline.choose(given, costs, options, [start], recompute_s)
            finished.append(_pipeline.step_time(given, costs, {
                rank: _pipeline.order_of(given.orders[rank], rank, trial)
                for rank, trial in chosen.items()}))
        return _pipeline.choose(given, costs, options, starts, recompute_s)

    monkeypatch.setattr(peak_policy, "choose", each_start)
    costs = replace(GEN4, link=Link(bandwidth, bandwidth))
    plain = simulate(build_schedule(replace(SPEC, swap=False)), costs)
    budget = int(max(r.peak_activation_bytes for r in plain.ranks) * share)
    result = simulate(build_schedule(SPEC, PeakPolicy(costs, budget, recompute="auto")), costs)
    assert len(finished) == 2 and finished[0] != finished[1]
    assert result.step_time == min(finished)
    assert (finished[0] < finished[1]) == (share == 0.2)
    assert all(rank.peak_activation_bytes <= budget for rank in result.ranks)


def test_a_plan_chosen_in_the_pipeline_serves_only_its_order_and_budget() -> None:
    """What prepare chose for rank 0 under one budget is handed out for the order it saw
    only (for another the planner plans the rank again), and a policy with another budget
    plans its own."""
    fast = replace(GEN4, link=Link(55e9, 55e9))
    given = build_schedule(replace(SPEC, swap=False))
    peak = max(r.peak_activation_bytes for r in simulate(given, fast).ranks)
    loose, tight = int(peak * 0.5), int(peak * 0.2)
    policy = PeakPolicy(fast, loose, recompute="auto")
    planner = policy.prepare(given, None)  # every rank's plan for the loose budget
    order = given.orders[0]
    assert planner.select(0, swap_candidates(order, 0), order).chosen_in_pipeline
    other = build_schedule(replace(SPEC, swap=False, microbatches=6)).orders[0]
    again = planner.select(0, swap_candidates(other, 0), other)
    assert not again.chosen_in_pipeline and again.outcome is not None
    assert simulate_alone(tuple(inject_swap_order(other, again)), 0,
                          fast).peak_activation_bytes <= loose
    plan = plan_swap(given, replace(policy, budget=tight)).ranks[0]
    assert plan.outcome is not None and plan.outcome.budget == tight
    order = tuple(inject_swap_order(given.orders[0], plan))
    assert simulate_alone(order, 0, fast).peak_activation_bytes <= tight


def test_the_alike_start_pairs_ranks_of_other_layer_counts_by_what_they_do() -> None:
    """Stages of four layers a chunk and stages of two: the start planned alike on every
    chunk gives every rank over its budget a plan, the nearest choice where a rank's chunks
    have fewer layers, and every such rank meets its budget there."""
    layers = {0: 4, 1: 4, 2: 2, 3: 2}
    costs = replace(GEN4, link=Link(55e9, 55e9), stages={
        stage: StageCosts(GEN4.forward * count / 4, GEN4.backward * count / 4,
                          activation_bytes=GEN4.activation_bytes * count // 4, layers=count)
        for stage, count in layers.items()})
    given = build_schedule(replace(SPEC, swap=False))
    plain = simulate(given, costs)
    budget = int(max(r.peak_activation_bytes for r in plain.ranks) * 0.2)
    over = [r.rank for r in plain.ranks if r.peak_activation_bytes > budget]
    policy = PeakPolicy(costs, budget, recompute="auto")
    start = policy._alike_start(given, range(4))
    assert sorted(start) == over and len(over) >= 3
    orders = tuple(start.get(rank, order) for rank, order in enumerate(given.orders))
    run = simulate(replace(given, orders=orders), costs)
    assert all(run.ranks[rank].peak_activation_bytes <= budget for rank in over)


def test_a_preparing_policy_is_prepared_once_and_its_planner_plans_every_rank() -> None:
    """A policy that prepares is told the schedule and the ranks the pass plans (None:
    every rank) once, and the planner it returns plans each of them."""
    seen: list[tuple[int, object]] = []

    class Counting(MinGapPolicy):
        def prepare(self, schedule: Schedule, ranks: object) -> SwapPolicy:
            seen.append((schedule.num_ranks, ranks))
            return MinGapPolicy(self.min_gap)

    planned = inject_swap(build_schedule(replace(SPEC, swap=False)), Counting())
    assert seen == [(4, None)] and _swapped(simulate(planned, SMALL)) > 0


def test_a_mixed_plan_on_one_rank_predicts_its_peak_exactly() -> None:
    plain = Schedule.from_orders([parse_order(ONE_RANK)])
    gen4 = replace(SMALL, link=Link(40.0, 40.0))
    plan = plan_swap(plain, PeakPolicy(gen4, 260, recompute="auto"))
    result = simulate(apply_swap(plain, plan), gen4).ranks[0]
    outcome = plan.outcome(0)
    assert (outcome is not None and outcome.met
            and outcome.peak == result.peak_activation_bytes <= 260)
    assert outcome.exposed_copy == result.exposed_copy
    assert outcome.peak_no_swap == 6 * 400 == result.peak_activation_bytes_no_swap
    assert outcome.recomputed_layers == result.recomputed_layers > 0
    assert outcome.step_time == result.step_time  # the rank's own step, as run alone


def test_without_a_budget_auto_recomputes_nothing() -> None:
    policy = PeakPolicy(GEN4, None, recompute="auto")
    planned = build_schedule(SPEC, policy)
    assert not any(step is not None and step.type is StepType.RECOMPUTE
                   for order in planned.orders for step in order)
    with pytest.raises(ScheduleError, match="unknown recompute mode 'always'; use auto"):
        PeakPolicy(GEN4, None, recompute="always")  # type: ignore[arg-type]


SMALL_ARGS = ["--schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "--preset",
              "h100-pcie5", "--hidden", "4096", "--seq-len", "4096", "--layers-per-stage", "4",
              "--d2h-bandwidth", "25e9", "--h2d-bandwidth", "25e9", "--budget", "4GiB"]


def test_the_command_line_recomputes_under_a_budget_unless_told_never(cli: Cli) -> None:
    code, out, _ = cli("simulate", *SMALL_ARGS, "--format", "json")
    assert code == 0
    auto = json.loads(out)
    code, out, _ = cli("simulate", *SMALL_ARGS, "--recompute", "never", "--format", "json")
    assert code == 0
    never = json.loads(out)
    assert sum(r["recomputed_layers"] for r in auto["per_rank"]) > 0
    assert sum(r["recomputed_layers"] for r in never["per_rank"]) == 0
    assert all(r["budget"]["met"] for r in auto["per_rank"])
    assert auto["step_time_s"] < never["step_time_s"]
    code, grid, _ = cli("orders", *SMALL_ARGS)
    assert code == 0 and "RC" in grid


@pytest.mark.parametrize("recompute", ["auto", "never"])
def test_a_plan_under_a_budget_says_how_far_it_is(
        cli: Cli, monkeypatch: pytest.MonkeyPatch, recompute: str) -> None:
    """Planning under a budget reports each rank as it is planned (in the whole pipeline
    with auto, rank by rank with never), and with auto then each rank's choice of plan in
    the whole pipeline from each start, on stderr once it has taken a while (here at once),
    never on stdout; without the wait it stays quiet."""
    monkeypatch.setattr(simulate_cli, "PROGRESS_AFTER_S", 0.0)
    code, out, err = cli("simulate", *SMALL_ARGS, "--recompute", recompute, "--format", "json")
    assert code == 0 and json.loads(out)["per_rank"]
    ranks = json.loads(out)["per_rank"][-1]["rank"] + 1
    planned = [line for line in err.splitlines() if line.startswith("planning")]
    assert [line.split(", ")[1] for line in planned] == [
        f"{done} of {ranks} ranks" for done in range(1, ranks + 1)]
    chosen = err.splitlines()[ranks:]
    if recompute == "never":
        assert chosen == []
    else:  # the ranks over their budget choose, once from each of the two starts
        total = len(chosen)
        assert total > 0 and total % 2 == 0 and [line.split(": ")[1].split(",")[0] for line
                                                 in chosen] == [
            f"{done} of {total} choices" for done in range(1, total + 1)]
        assert all(line.startswith("choosing the plans in the whole pipeline: ")
                   for line in chosen)
    monkeypatch.setattr(simulate_cli, "PROGRESS_AFTER_S", 3600.0)
    assert cli("simulate", *SMALL_ARGS, "--recompute", recompute)[2] == ""


@pytest.mark.parametrize(("extra", "message"), [
    (["--recompute", "auto"], "--recompute auto says how to meet --budget, and there is none"),
    (["--policy", "recompute", "--budget", "4GiB", "--recompute", "never"],
     "--policy recompute recomputes: drop --recompute never"),
    (["--policy", "budget", "--budget", "4GiB", "--recompute", "auto"],
     "--recompute auto applies to the peak policy; the budget policy plans on whole chunks"),
])
def test_recompute_modes_that_cannot_apply_are_refused(cli: Cli, extra: list[str],
                                                       message: str) -> None:
    code, _, err = cli("simulate", *SMALL_ARGS[:-2], *extra)
    assert code == 2 and message in err and err.count("\n") == 1
