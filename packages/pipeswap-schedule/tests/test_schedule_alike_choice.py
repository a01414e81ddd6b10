"""One plan alike on every rank, fitted to each rank's budget: the whole-pipeline choice that
grows about as ranks x microbatches. It must be the choice running every name would keep,
meet every budget, and be what the policy takes beyond the size where choosing rank by rank
gets slow."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import pytest

from pipeswap.schedule import (
    Schedule,
    ScheduleKind,
    ScheduleSpec,
    apply_swap,
    build_schedule,
    inject_swap,
    plan_swap,
)
from pipeswap.schedule.costs import CostModel, Link, StageCosts, TransformerShape, from_preset
from pipeswap.schedule.policies import Granularity, PeakPolicy, PipelineChoice
from pipeswap.schedule.policies._alike_choice import _RankPlans, _Search, _step, alike_choice
from pipeswap.schedule.policies._fit import fit
from pipeswap.schedule.policies._mixed import alike, layer_counts
from pipeswap.schedule.policies._pipeline import placed, run_with
from pipeswap.schedule.policies import peak as peak_policy
from pipeswap.schedule.policies.peak import TURNS_UP_TO
from pipeswap.schedule.simulate import simulate, simulate_alone
from pipeswap.schedule.swap_order import swap_candidates
from pipeswap.schedule.swap_plan import SwapPlacement

Cli = Callable[..., tuple[int, str, str]]  # the `cli` fixture of conftest.py

#: A small transformer on a PCIe Gen4 link: copies of a chunk take longer than its compute.
GEN4 = replace(from_preset("h100-pcie5", TransformerShape(hidden=4096, seq_len=4096, layers=4)),
               link=Link(25e9, 25e9))


def _setup(kind: ScheduleKind, share: float, bandwidth: float, microbatches: int = 8,
           stages_per_rank: int = 1, layers: tuple[int, ...] = (), w_heavy: bool = False
           ) -> tuple[Schedule, CostModel, dict[int, int]]:
    """The plain schedule, its costs and every rank's budget: ``share`` of the largest peak.
    ``layers``: each stage's layers (cycled), times and bytes in proportion; ``w_heavy``:
    a 0.02 s forward, a 0.3 s input gradient and a 3 s weight gradient a chunk (default
    bytes), where recomputing a layer (which moves its share of W to I) shortens the
    step."""
    given = build_schedule(ScheduleSpec(kind, ranks=4, microbatches=microbatches,
                                        stages_per_rank=stages_per_rank))
    costs = replace(GEN4, link=Link(bandwidth, bandwidth))
    if w_heavy:
        costs = CostModel(forward=0.02, backward=3.3, layers=4, link=Link(bandwidth, bandwidth),
                          stages={stage: StageCosts(0.02, 3.3, 0.3, 3.0)
                                  for stage in range(given.num_stages)})
    elif layers:
        costs = replace(costs, stages={stage: StageCosts(
            costs.forward * count / 4, costs.backward * count / 4, layers=count,
            activation_bytes=costs.activation_bytes * count // 4)
            for stage in range(given.num_stages)
            for count in (layers[stage % len(layers)],)})
    plain = simulate(given, costs, timeline=False)
    budget = int(max(r.peak_activation_bytes for r in plain.ranks) * share)
    return given, costs, dict.fromkeys(range(len(given.orders)), budget)


def _every_choice(given: Schedule, costs: CostModel, budgets: dict[int, int],
                  granularity: Granularity = "auto"
                  ) -> tuple[float, tuple[int, int, int, int]] | None:
    """Every name run in the whole schedule (a rank with fewer layers taking its nearest
    name), each rank over its budget fitted where its plan goes over (no bound, no
    shortcut): the shortest step of those within every budget, the first of equals, and
    its name."""
    steps = _every_step(given, costs, budgets, granularity)
    best = min(((step, index) for index, (_, step) in enumerate(steps) if step is not None),
               default=None)
    return None if best is None else (best[0], steps[best[1]][0])


def _every_step(given: Schedule, costs: CostModel, budgets: dict[int, int],
                granularity: Granularity = "auto"
                ) -> list[tuple[tuple[int, int, int, int], float | None]]:
    """Each name and its step with every rank within its budget (None: not so)."""
    plain = simulate(given, costs, timeline=False)
    over = [r for r in budgets if plain.ranks[r].peak_activation_bytes > budgets[r]]
    found = {r: alike(swap_candidates(given.orders[r], r), layer_counts(costs), granularity)
             for r in over}
    out: list[tuple[tuple[int, int, int, int], float | None]] = []
    for name in sorted(set().union(*found.values())):
        orders = {}
        for r in over:
            mine = min(sorted(found[r]), key=lambda n: tuple(abs(a - b) for a, b in zip(n, name)))
            recomputed, placements = found[r][mine]
            order_of = partial(placed, given.orders[r], r, recomputed)
            if simulate_alone(order_of(placements), r, costs).peak_activation_bytes > budgets[r]:
                fitted = fit(placements, order_of, r, costs, budgets[r])
                if fitted is None:
                    out.append((name, None))
                    break
                placements = fitted.placements
            orders[r] = order_of(placements)
        else:
            run = run_with(given, costs, orders)
            out.append((name, run.step_time if all(
                run.ranks[r].peak_activation_bytes <= budgets[r] for r in over) else None))
    return out


CASES = [
    pytest.param(ScheduleKind.ONE_F_ONE_B, 0.4, 55e9, 1, id="1f1b"),  # a fit wins
    pytest.param(ScheduleKind.ZBV, 0.5, 25e9, 1, id="zbv"),
    pytest.param(ScheduleKind.INTERLEAVED_1F1B, 0.4, 55e9, 2, id="interleaved"),
]
#: Cases off the beaten path: stages of different layer counts (a rank takes its nearest
#: name), whole chunks only, and a weight gradient so long that recomputing shortens the step.
ODD = [
    pytest.param(ScheduleKind.ONE_F_ONE_B, 0.35, 25e9, 1, (4, 2, 8, 3), False, "auto",
                 id="1f1b-mixed-layers"),
    pytest.param(ScheduleKind.INTERLEAVED_1F1B, 0.6, 55e9, 2, (), False, "chunk",
                 id="interleaved-whole-chunks"),
    pytest.param(ScheduleKind.ZBV, 0.9, 1e10, 1, (), True, "auto", id="zbv-long-w"),
    pytest.param(ScheduleKind.ZBV, 0.5, 1e12, 1, (), True, "auto", id="zbv-long-w-fast-link"),
]


@pytest.mark.parametrize(("kind", "share", "bandwidth", "stages_per_rank"), CASES)
def test_the_choice_is_the_one_running_every_name_keeps(
        kind: ScheduleKind, share: float, bandwidth: float, stages_per_rank: int
        ) -> None:
    given, costs, budgets = _setup(kind, share, bandwidth, stages_per_rank=stages_per_rank)
    plain = simulate(given, costs, timeline=False)
    told: list[tuple[int, int]] = []
    found = alike_choice(given, costs, plain, budgets, "auto",
                         lambda done, total: told.append((done, total)))
    every = _every_choice(given, costs, budgets)
    assert found is not None and every is not None
    assert (found.step, found.name) == every
    assert found.runs <= found.names // 3  # the bounds spared most runs
    assert [done for done, _ in told] == sorted(set(done for done, _ in told))
    assert told[-1] == (found.names, found.names) and {total for _, total in told} == {
        found.names}


@pytest.mark.parametrize(("kind", "share", "bandwidth", "stages_per_rank"), CASES)
def test_every_rank_over_its_budget_takes_the_name_fitted_and_meets_its_budget(
        kind: ScheduleKind, share: float, bandwidth: float, stages_per_rank: int
        ) -> None:
    given, costs, budgets = _setup(kind, share, bandwidth, stages_per_rank=stages_per_rank)
    plain = simulate(given, costs, timeline=False)
    found = alike_choice(given, costs, plain, budgets, "auto")
    assert found is not None and found.name is not None
    for rank, trial in found.plans.items():
        named = alike(swap_candidates(given.orders[rank], rank), layer_counts(costs),
                      "auto")[found.name]
        assert trial.recomputed == named[0]
        assert trial.placements.keys() == named[1].keys()
        assert all(_no_deeper(p, named[1][key]) for key, p in trial.placements.items())
        assert trial.outcome.peak <= budgets[rank]
        assert trial.outcome.step_time == found.step
    # the policy's schedule is the choice's: same step, every rank within its budget
    policy = PeakPolicy(costs, budgets[0], recompute="auto", pipeline_choice="alike")
    plan = plan_swap(given, policy)
    run = simulate(apply_swap(given, plan), costs, timeline=False)
    assert run.step_time == found.step
    assert all(r.peak_activation_bytes <= budgets[r.rank] for r in run.ranks)
    assert all(plan.ranks[rank].chosen_in_pipeline for rank in found.plans)


@pytest.mark.parametrize(("kind", "share", "bandwidth", "stages_per_rank", "layers", "w_heavy",
                          "granularity"), ODD)
def test_the_choice_is_the_one_running_every_name_keeps_off_the_beaten_path(
        kind: ScheduleKind, share: float, bandwidth: float, stages_per_rank: int,
        layers: tuple[int, ...], w_heavy: bool, granularity: Granularity) -> None:
    given, costs, budgets = _setup(kind, share, bandwidth, stages_per_rank=stages_per_rank,
                                   layers=layers, w_heavy=w_heavy)
    plain = simulate(given, costs, timeline=False)
    found = alike_choice(given, costs, plain, budgets, granularity)
    every = _every_choice(given, costs, budgets, granularity)
    assert every is not None and found is not None
    assert (found.step, found.name) == every
    if w_heavy:  # recompute made the step shorter than the given schedule's
        assert found.step < plain.step_time and found.name is not None and found.name[0] > 0


@pytest.mark.parametrize(("kind", "share", "bandwidth", "stages_per_rank", "layers", "w_heavy",
                          "granularity"), [*ODD[:1], *ODD[2:]])
def test_every_bound_is_at_most_the_step_it_bounds(
        kind: ScheduleKind, share: float, bandwidth: float, stages_per_rank: int,
        layers: tuple[int, ...], w_heavy: bool, granularity: Granularity) -> None:
    """Each bound the search may prune with (before anything runs, the recompute alone,
    each rank's plan against its messages) is at most the step of the name it bounds."""
    given, costs, budgets = _setup(kind, share, bandwidth, stages_per_rank=stages_per_rank,
                                   layers=layers, w_heavy=w_heavy)
    plain = simulate(given, costs, timeline=False)
    over = sorted(r for r in budgets if plain.ranks[r].peak_activation_bytes > budgets[r])
    found = {r: _RankPlans(swap_candidates(given.orders[r], r), [
        layer_counts(costs)(c.key) for c in swap_candidates(given.orders[r], r)], granularity)
        for r in over}
    search = _Search(given, costs, budgets, over, found, plain.step_time)
    checked = 0
    for name, step in _every_step(given, costs, budgets, granularity):
        if step is None:
            continue
        ceiling = step * (1 + 1e-9)
        assert search.ways.floor(over, name) <= ceiling
        assert _step(search.ways.logged(over, name)) <= ceiling
        assert search.ways.known(over, name)[0] <= ceiling
        for rank in over:
            bounded = search._bounded(rank, name)
            assert bounded is not None and bounded[0] <= ceiling, (name, rank)
        checked += 1
    assert checked >= 3


def _no_deeper(fitted: SwapPlacement, named: SwapPlacement) -> bool:
    """A fit lowers lags and load depths only."""
    return (fitted[:2] == named[:2] and fitted.layer_lag <= named.layer_lag
            and fitted.load_depth <= named.load_depth)


def test_auto_takes_turns_for_a_small_pipeline_and_alike_beyond(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to TURNS_UP_TO ranks x microbatches the plans are chosen rank by rank, beyond it
    alike; one rank planning itself (as each rank of pipeswap-train does) takes turns at
    any size. (The size lowered here: a pipeline past the real one takes a minute to plan
    rank by rank.)"""
    assert 256 <= TURNS_UP_TO <= 4096
    monkeypatch.setattr(peak_policy, "TURNS_UP_TO", 32)

    def orders(microbatches: int, choice: PipelineChoice, ranks: set[int] | None = None
               ) -> tuple[object, ...]:
        given, costs, budgets = _setup(ScheduleKind.ONE_F_ONE_B, 0.35, 25e9, microbatches)
        policy = PeakPolicy(costs, budgets[0], recompute="auto", pipeline_choice=choice)
        return inject_swap(given, policy, ranks=ranks).orders

    small, large = 8, 9  # 4 ranks
    assert orders(small, "auto") == orders(small, "turns") != orders(small, "alike")
    assert orders(large, "auto") == orders(large, "alike") != orders(large, "turns")
    assert orders(large, "auto", {0}) == orders(large, "turns", {0})


def test_where_no_choice_fits_each_rank_plans_on_its_own_timeline() -> None:
    given, costs, budgets = _setup(ScheduleKind.ONE_F_ONE_B, 0.02, 25e9)
    plain = simulate(given, costs, timeline=False)
    assert alike_choice(given, costs, plain, budgets, "auto") is None
    alone = PeakPolicy(costs, budgets[0], recompute="auto", whole_pipeline=False)
    chosen = PeakPolicy(costs, budgets[0], recompute="auto", pipeline_choice="alike")
    assert inject_swap(given, chosen).orders == inject_swap(given, alone).orders


def test_a_pipeline_within_every_budget_keeps_its_orders() -> None:
    given, costs, budgets = _setup(ScheduleKind.ONE_F_ONE_B, 1.0, 25e9)
    plain = simulate(given, costs, timeline=False)
    found = alike_choice(given, costs, plain, budgets, "auto")
    assert found is not None and (found.name, found.plans) == (None, {})
    policy = PeakPolicy(costs, budgets[0], recompute="auto", pipeline_choice="alike")
    assert inject_swap(given, policy).orders == given.orders


def test_per_rank_budgets_plan_the_ranks_over_them_and_keep_the_rest() -> None:
    given, costs, budgets = _setup(ScheduleKind.ONE_F_ONE_B, 0.4, 55e9)
    plain = simulate(given, costs, timeline=False)
    budgets[3] = plain.ranks[3].peak_activation_bytes  # within it already
    plan = plan_swap(given, PeakPolicy(costs, budgets, recompute="auto",
                                       pipeline_choice="alike"))
    run = simulate(apply_swap(given, plan), costs, timeline=False)
    assert all(r.peak_activation_bytes <= budgets[r.rank] for r in run.ranks)
    assert all(plan.ranks[rank].chosen_in_pipeline for rank in range(4))
    assert plan.ranks[3].placements == {} and plan.ranks[3].recomputed == {}
    assert all(plan.ranks[rank].placements for rank in range(3))
    with pytest.raises(Exception, match="the memory budget gives no figure for rank 3"):
        plan_swap(given, PeakPolicy(costs, {r: budgets[r] for r in range(3)},
                                    recompute="auto", pipeline_choice="alike"))


SMALL = ["--schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "--preset", "h100-pcie5",
         "--hidden", "4096", "--seq-len", "4096", "--layers-per-stage", "4",
         "--d2h-bandwidth", "25e9", "--h2d-bandwidth", "25e9", "--format", "json"]


def test_the_command_line_chooses_as_asked(cli: Cli) -> None:
    said = {choice: cli("simulate", *SMALL, "--budget", "3GiB", "--pipeline-choice", choice)
            for choice in ("turns", "alike")}
    assert said["turns"][0] == said["alike"][0] == 0
    assert cli("simulate", *SMALL, "--budget", "3GiB") == said["turns"]  # 4 x 8: turns
    given = build_schedule(ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8))
    costs = replace(GEN4, link=Link(25e9, 25e9))
    for choice in ("turns", "alike"):
        policy = PeakPolicy(costs, 3 * 2**30, recompute="auto", pipeline_choice=choice)
        step = simulate(inject_swap(given, policy), costs, timeline=False).step_time
        assert json.loads(said[choice][1])["step_time_s"] == step, choice


@pytest.mark.parametrize(("extra", "message"), [
    (["--pipeline-choice", "alike"], "--pipeline-choice alike says how the peak policy"),
    (["--pipeline-choice", "turns", "--budget", "3GiB", "--recompute", "never"],
     "--pipeline-choice turns says how the peak policy chooses"),
    (["--pipeline-choice", "alike", "--budget", "3GiB", "--policy", "budget"],
     "or drop --pipeline-choice"),
    (["--pipeline-choice", "alike", "--budget", "3GiB", "--jobs", "2"],
     "--pipeline-choice alike makes none: drop --jobs"),
    (["--pipeline-choice", "sometimes", "--budget", "3GiB"], "invalid choice: 'sometimes'"),
])
def test_a_pipeline_choice_that_cannot_apply_is_refused(cli: Cli, extra: list[str],
                                                        message: str) -> None:
    code, out, err = cli("simulate", *SMALL, *extra)
    assert code == 2 and out == "" and message in err, err


def test_an_unknown_pipeline_choice_is_refused_by_the_policy() -> None:
    with pytest.raises(Exception, match="unknown pipeline choice 'often'; use one of auto, "
                                        "turns, alike"):
        PeakPolicy(GEN4, 1, pipeline_choice="often")  # type: ignore[arg-type]
