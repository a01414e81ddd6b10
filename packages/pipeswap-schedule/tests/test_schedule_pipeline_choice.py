"""Each rank's plan chosen in the whole pipeline with few whole simulations: a run with the
rank as given bounds every plan's step from below, and the plans are simulated in the order
of their bounds only until a bound passes the shortest step found."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest

from pipeswap.schedule import Schedule, ScheduleKind, ScheduleSpec, StepType, build_schedule
from pipeswap.schedule.costs import CostModel, Link, TransformerShape, from_preset
from pipeswap.schedule.policies import PeakPolicy
from pipeswap.schedule.policies import _pipeline
from pipeswap.schedule.policies import peak as peak_policy
from pipeswap.schedule.recompute_pass import inject_recompute
from pipeswap.schedule.simulate import simulate, simulate_against, simulate_logged
from pipeswap.schedule.steps import Order

#: Forward 1 s, backward 2 s, and 0.25 s a message between ranks.
TIMED = CostModel(forward=1.0, backward=2.0, activation_bytes=400, boundary_bytes=10,
                  p2p_latency=0.25, layers=4, link=Link(100.0, 100.0))
#: A small transformer on a PCIe Gen4 link: copies of a chunk take longer than its compute.
GEN4 = replace(from_preset("h100-pcie5", TransformerShape(hidden=4096, seq_len=4096, layers=4)),
               link=Link(25e9, 25e9))
Turn = tuple[Schedule, CostModel, dict[int, Order], int, list[Order], list[float]]


def test_a_messages_tail_is_the_longest_compute_after_it() -> None:
    """1F1B on two ranks, two micros (rank 0: F0 F1 B0 B1; rank 1: F0 B0 F1 B1): worked by
    hand, F(0,0) reaches rank 1's F0, after which F0, B0 (its gradient to rank 0, 0.25 s),
    rank 0's B0 and B1 waiting for rank 1's F1 and B1 make 1 + 2 + 1 + 2 + 0.25 + 2."""
    plain = build_schedule(ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=2, microbatches=2))
    logged = simulate_logged(plain, TIMED, changing=0)
    assert logged.tails == pytest.approx({("F", 0, 0): 8.25, ("F", 0, 1): 5.25,
                                          ("B", 1, 0): 4.0, ("B", 1, 1): 2.0})
    # on the critical path the first message's arrival plus its tail is the step
    assert logged.arrivals[("F", 0, 0)] + logged.tails[("F", 0, 0)] == pytest.approx(
        max(logged.finishes)) == simulate(plain, TIMED).step_time == 9.5


def test_a_rank_run_against_its_own_run_sends_as_it_did() -> None:
    schedule = build_schedule(ScheduleSpec(ScheduleKind.ZBV, ranks=2, microbatches=4))
    logged = simulate_logged(schedule, TIMED, changing=1)
    finish, sent = simulate_against(logged, schedule, 1, schedule.orders[1], TIMED)
    assert finish == logged.finishes[1]
    assert sent and all(at == logged.arrivals[message] for message, at in sent.items())


def _turns(kind: ScheduleKind, share: float, bandwidth: float,
           monkeypatch: pytest.MonkeyPatch) -> list[Turn]:
    """Every rank's turn as the pipeline chose from the first start, under ``share`` of
    the peak: (given, costs, the other ranks' orders, rank, its plans' orders, recompute)."""
    turns: list[Turn] = []

    def record(given: Schedule, costs: CostModel, options: Mapping[int, Sequence[Any]],
               starts: Sequence[Mapping[int, Order]], recompute_s: Callable[[Any], float],
               progress: Any) -> Any:
        current = dict(starts[0])
        for rank in sorted(options):
            orders = [_pipeline.order_of(given.orders[rank], rank, t) for t in options[rank]]
            seconds = [recompute_s(t) for t in options[rank]]
            if len(orders) > 1:  # a rank with one plan has no choice to make
                turns.append((given, costs, dict(current), rank, orders, seconds))
                current[rank] = orders[_pipeline.fastest(given, costs, current, rank,
                                                         orders, seconds).choice]
            else:
                current[rank] = orders[0]
        return _pipeline.choose(given, costs, options, starts, recompute_s, progress)

    monkeypatch.setattr(peak_policy, "choose", record)
    costs = replace(GEN4, link=Link(bandwidth, bandwidth))
    spec = ScheduleSpec(kind, ranks=4, microbatches=8)
    plain = simulate(build_schedule(spec), costs)
    budget = int(max(r.peak_activation_bytes for r in plain.ranks) * share)
    build_schedule(replace(spec, swap=True), PeakPolicy(costs, budget, recompute="auto"))
    return turns


@pytest.mark.parametrize(("kind", "share", "bandwidth"), [
    (ScheduleKind.ONE_F_ONE_B, 0.3, 25e9),
    (ScheduleKind.ZBV, 0.3, 25e9),  # a V, and a split backward whose W a recompute shortens
    (ScheduleKind.INTERLEAVED_ZB, 0.25, 20e9),
])
def test_the_bound_never_passes_a_plans_step_and_the_choice_is_the_one_simulating_all(
        kind: ScheduleKind, share: float, bandwidth: float,
        monkeypatch: pytest.MonkeyPatch) -> None:
    turns = _turns(kind, share, bandwidth, monkeypatch)
    assert len(turns) >= 2
    for given, costs, current, rank, orders, seconds in turns:
        logged = simulate_logged(replace(given, orders=tuple(
            order if other == rank else current.get(other, order)
            for other, order in enumerate(given.orders))), costs, rank)
        steps = [_pipeline.step_time(given, costs, {**current, rank: order})
                 for order in orders]
        bounds = [_pipeline.least_step(logged, given, rank, order, costs) for order in orders]
        assert all(bound <= step * (1 + 1e-9) for bound, step in zip(bounds, steps))
        assert max(bound / step for bound, step in zip(bounds, steps)) > 0.99  # not vacuous
        every = min(range(len(orders)), key=lambda k: (steps[k], seconds[k], k))
        assert _pipeline.fastest(given, costs, current, rank, orders, seconds).choice == every


def test_a_turn_simulates_the_whole_schedule_for_few_of_its_plans(
        monkeypatch: pytest.MonkeyPatch) -> None:
    turns = _turns(ScheduleKind.ONE_F_ONE_B, 0.3, 25e9, monkeypatch)
    simulated: list[int] = []
    step_time = _pipeline.step_time

    def counted(*args: Any) -> float:
        simulated.append(1)
        return step_time(*args)

    monkeypatch.setattr(_pipeline, "step_time", counted)
    for given, costs, current, rank, orders, seconds in turns:
        simulated.clear()
        _pipeline.fastest(given, costs, current, rank, orders, seconds)
        assert 1 <= len(simulated) <= 3 < len(orders) // 4


def test_an_order_that_sends_earlier_than_the_run_is_not_bounded() -> None:
    """The bound holds for orders that only add steps to the rank's order in the run; one
    that runs a message earlier (here: the run recomputed a layer, the order does not) is
    simulated whatever its bound would say."""
    plain = build_schedule(ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=2, microbatches=2))
    slower = inject_recompute(plain, {(1, 0): (0, 1, 2, 3)})
    logged = simulate_logged(slower, TIMED, changing=1)
    assert _pipeline.least_step(logged, plain, 1, plain.orders[1], TIMED) == float("-inf")
    assert _pipeline.least_step(logged, plain, 1, slower.orders[1], TIMED) == pytest.approx(
        simulate(slower, TIMED).step_time)


def test_the_bound_allows_for_a_recompute_shortening_a_weight_gradient() -> None:
    """A recomputed layer's share of W moves into the I before it, so a W of the rank
    whose plans are bounded can end sooner than in the run (ZBV, rank 3 recomputing
    chunk (3, 4): a bound counting that W in full says 53 s for a 52 s step)."""
    plain = build_schedule(ScheduleSpec(ScheduleKind.ZBV, ranks=4, microbatches=8))
    costs = replace(TIMED, p2p_latency=0.0)
    for rank in range(4):
        logged = simulate_logged(plain, costs, changing=rank)
        weights = {s.key for s in plain.orders[rank] if s and s.type is StepType.BWD_WEIGHT}
        for key in sorted(weights):
            for layers in ((0, 1, 2, 3), (3,)):
                changed = inject_recompute(plain, {key: layers})
                bound = _pipeline.least_step(logged, plain, rank, changed.orders[rank], costs)
                assert bound <= simulate(changed, costs).step_time * (1 + 1e-9), (rank, key)


@pytest.mark.parametrize(("bandwidth", "share", "most"), [
    (20e9, 0.2, 1.2),  # only much recompute fits: every choice that recomputes less is run
    (55e9, 0.45, 0.6),
])
def test_the_alike_start_is_the_first_fastest_choice_and_runs_few_of_them(
        bandwidth: float, share: float, most: float, monkeypatch: pytest.MonkeyPatch) -> None:
    """The start planned alike on every chunk is the choice that running every one of
    them would keep (the shortest step among those within every budget, the first of
    equals), though choices whose recompute alone is already slower are not run: the
    runs, those of the recompute alone included, are at most ``most`` of the choices."""
    costs = replace(GEN4, link=Link(bandwidth, bandwidth))
    given = build_schedule(ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8))
    plain = simulate(given, costs)
    budget = int(max(r.peak_activation_bytes for r in plain.ranks) * share)
    seen: list[Sequence[Mapping[int, _pipeline.Plan]]] = []
    runs: list[int] = []
    first_fastest, run_with = _pipeline.first_fastest, _pipeline.run_with

    def spying(given: Schedule, costs: CostModel, choices: Sequence[Mapping[int, Any]],
               plain_step: float, accepted: Callable[[Any], bool]) -> dict[int, Order]:
        seen.append(choices)
        return first_fastest(given, costs, choices, plain_step, accepted)

    def counted(*args: Any) -> Any:
        runs.append(1)
        return run_with(*args)

    monkeypatch.setattr(peak_policy, "first_fastest", spying)
    monkeypatch.setattr(_pipeline, "run_with", counted)
    start = PeakPolicy(costs, budget, recompute="auto")._alike_start(given, range(4))
    (choices,) = seen
    every = []
    for index, choice in enumerate(choices):
        orders = {rank: _pipeline.placed(given.orders[rank], rank, *plan)
                  for rank, plan in choice.items()}
        run = run_with(given, costs, orders)
        if all(run.ranks[rank].peak_activation_bytes <= budget for rank in choice):
            every.append((run.step_time, index, orders))
    assert every and start == min(every, key=lambda found: found[:2])[2]
    assert 0 < len(runs) <= most * len(choices)


def test_choose_passes_on_only_true_runs_and_chooses_as_turns_made_afresh(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """From both starts, with a last rank whose one plan (its slowest) lengthens the
    step: every run ``choose`` hands from a turn to the next equals a fresh run of
    that rank's turn, and its choices and step are those of turns each made afresh."""
    costs = replace(GEN4, link=Link(25e9, 25e9))
    given = build_schedule(ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8))
    plain = simulate(given, costs)
    policy = PeakPolicy(costs, int(max(r.peak_activation_bytes for r in plain.ranks) * 0.3),
                        recompute="auto")
    last = 2  # rank 3 keeps its order: it has nothing to swap
    options = {rank: policy.options_for(given, rank) or [] for rank in range(last + 1)}
    options[last] = [max(options[last], key=lambda t: _pipeline.step_time(given, costs, {
        last: _pipeline.order_of(given.orders[last], last, t)}))]
    starts = [{}, policy._alike_start(given, options)]
    assert sum(len(options[rank]) > 1 for rank in starts[1]) >= 2  # turns a start changes

    def recompute_s(trial: Any) -> float:
        return float(trial.outcome.recompute_s)

    fastest = _pipeline.fastest
    handed: list[int] = []

    def checked(given: Schedule, costs: CostModel, current: Mapping[int, Order], rank: int,
                orders: Sequence[Order], seconds: Sequence[float], logged: Any = None,
                then: int | None = None) -> _pipeline.Turn:
        if logged is not None:
            handed.append(rank)
            assert logged == simulate_logged(replace(given, orders=tuple(
                order if other == rank else current.get(other, order)
                for other, order in enumerate(given.orders))), costs, rank)
        return fastest(given, costs, current, rank, orders, seconds, logged, then)

    monkeypatch.setattr(_pipeline, "fastest", checked)
    chosen, step = _pipeline.choose(given, costs, options, starts, recompute_s)
    assert handed
    afresh: list[tuple[float, dict[int, Any]]] = []
    for start in starts:
        current, picked = dict(start), {}
        for rank in sorted(options):
            orders = [_pipeline.order_of(given.orders[rank], rank, t) for t in options[rank]]
            k = 0 if len(orders) == 1 else fastest(given, costs, current, rank, orders, [
                recompute_s(t) for t in options[rank]]).choice
            picked[rank], current[rank] = options[rank][k], orders[k]
        afresh.append((_pipeline.step_time(given, costs, current), picked))
        assert afresh[-1][0] != _pipeline.step_time(given, costs, {  # the last plan counts
            rank: order for rank, order in current.items() if rank != last})
    best = min(afresh, key=lambda found: found[0])
    assert (step, chosen) == best
