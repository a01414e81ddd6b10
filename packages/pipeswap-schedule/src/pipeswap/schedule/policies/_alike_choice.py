"""One choice alike on every rank: the whole-pipeline choice whose cost grows about as
ranks x microbatches.

Choosing rank by rank (:mod:`pipeswap.schedule.policies._pipeline`) needs each rank's plans
(a search on its own timeline that grows with the chunks it holds at once) and a few runs
of the whole schedule per rank: both grow as ranks squared x microbatches, minutes at 64
stages. Across a pipeline the plans that win are mostly the same plan alike on every chunk
(:func:`~pipeswap.schedule.policies._mixed.alike`: the same layers recomputed, the same
lag and load depth) on every rank: its stalls are absorbed where the pipeline waits anyway,
and a rank it takes over its budget at a few points (where the warm-up's last forwards meet
the first loads) is fitted there (:func:`~pipeswap.schedule.policies._fit.fit`). So here a
choice is one such name (``k``, lag, depth, shape), applied to every rank over its budget
(a rank with fewer layers takes its nearest plan), each fitted where it goes over; the
choice kept is the one whose whole-schedule run is shortest with every rank within its
budget, the first of equals.

Few names are run. A name's plans add only swap steps to its way of recomputing (its
orders with their RC steps alone), so no compute and no message comes earlier than in that
way's run, and lower bounds of a name's step hold, each dearer and closer than the one
before: the step of its way's run; then, for each rank, its plan (fitted) run against that
run's messages (:func:`~pipeswap.schedule.policies._pipeline.least_step`), the rank holding
most first. Where no backward splits, recompute only adds compute too, so the given
schedule's step bounds every name before anything runs, and a way recomputing at least the
layers of another is bounded by that one's step before it is run; where the backward
splits (I and W steps), a recomputed layer's share of W moves to its I, a recompute may
make the step shorter, and only a way's own run bounds it. The names are taken best bound
first, each bound worked out only when the name comes up, and the search stops once the
next bound passes the shortest step found: on the reference case at 64 ranks it makes 64
fits (62 of them the ranks of the name kept) and four runs of the whole schedule (the
given one and two ways of recomputing, logged, and the name kept).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import NamedTuple

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.policies._fit import fit
from pipeswap.schedule.policies._mixed import (
    AlikeName,
    Trial,
    alike_names,
    alike_placements,
    alike_recomputed,
    layer_counts,
)
from pipeswap.schedule.policies._pipeline import (
    Plan,
    beyond,
    least_step,
    placed,
    run_with,
    with_orders,
)
from pipeswap.schedule.policies.base import Granularity
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.simulate import (
    Logged,
    RankResult,
    SimulationResult,
    simulate_alone,
    simulate_logged,
)
from pipeswap.schedule.steps import ChunkKey, StepType
from pipeswap.schedule.swap_order import swap_candidates
from pipeswap.schedule.swap_plan import PlanOutcome, SwapCandidate, SwapPlacement

#: What a choice recomputes: per rank, its recomputed layers per chunk.
_Recompute = frozenset[tuple[int, frozenset[tuple[ChunkKey, tuple[int, ...]]]]]


class AlikeChoice(NamedTuple):
    """The choice kept: its name (None where no rank is over its budget), each rank's plan
    (the ranks over their budgets), the step the whole schedule makes with them, and how
    many choices were run in the whole schedule (of ``names`` in all)."""

    name: AlikeName | None
    plans: dict[int, Trial[PlanOutcome]]
    step: float
    runs: int
    names: int


def alike_choice(given: Schedule, costs: CostModel, plain: SimulationResult,
                 budgets: Mapping[int, int], granularity: Granularity,
                 progress: Callable[[int, int], None] | None = None) -> AlikeChoice | None:
    """The fastest choice alike on every rank of ``budgets`` over its budget (``plain``:
    the given schedule's run), see the module docstring; None where no choice keeps them
    all within their budgets. ``progress`` is told (choices looked at, choices) after
    each."""
    over = sorted((rank for rank, budget in budgets.items()
                   if plain.ranks[rank].peak_activation_bytes > budget),
                  key=lambda rank: -plain.ranks[rank].peak_activation_bytes)
    if not over:
        return AlikeChoice(None, {}, plain.step_time, 0, 0)
    layers_of = layer_counts(costs)
    found = {}
    for rank in over:
        candidates = swap_candidates(given.orders[rank], rank)
        found[rank] = _RankPlans(candidates, [layers_of(c.key) for c in candidates],
                                 granularity)
    names = sorted(set().union(*(plans.names for plans in found.values())))
    search = _Search(given, costs, budgets, over, found, plain.step_time)
    heap = [(search.ways.floor(over, name), index, 0) for index, name in enumerate(names)]
    heapq.heapify(heap)
    settled = 0
    while heap and not beyond(heap[0][0], search.best[0]):
        key, index, level = heapq.heappop(heap)
        then = search.refine(names[index], index, key, level)
        if then is None:
            settled += 1
            if progress is not None:
                progress(settled, len(names))
        else:
            heapq.heappush(heap, (then[0], index, then[1]))
    if progress is not None and settled < len(names):
        progress(len(names), len(names))  # the rest bounded beyond the step found
    step, index, chosen = search.best
    if not chosen:
        return None
    return AlikeChoice(names[index], {
        rank: _trial(rank, plan, alone, plain, budgets[rank], step)
        for rank, (plan, alone) in chosen.items()}, step, search.runs, len(names))


class _Search:
    """The search's state: each rank's plans made and fitted so far, the ways of
    recomputing run (logged), and the best name found."""

    def __init__(self, given: Schedule, costs: CostModel, budgets: Mapping[int, int],
                 over: Sequence[int], found: Mapping[int, _RankPlans], plain_step: float
                 ) -> None:
        self.given, self.costs, self.budgets, self.over = given, costs, budgets, over
        self.fitted = _Fitted(given, costs, budgets, found)
        self.ways = _Ways(given, costs, plain_step, found)
        self.best: tuple[float, int, dict[int, tuple[Plan, RankResult]]] = (math.inf, 0, {})
        self.runs = 0

    def refine(self, name: AlikeName, index: int, key: float, level: int
               ) -> tuple[float, int] | None:
        """The next bound of a name whose bound ``key`` is of ``level`` (0: of a way it
        recomputes more than, 1: of its own recompute, 2: of its hungriest rank too), and
        its level; None where the name is settled: run, or out (a rank it cannot keep
        within the budget, or a rank's bound beyond the best)."""
        if level == 0:
            known, own = self.ways.known(self.over, name)
            if own or known > key:
                return max(key, known), int(own)
            return max(key, _step(self.ways.logged(self.over, name))), 1
        if level == 1:
            head = self._bounded(self.over[0], name)
            return None if head is None else (max(key, head[0]), 2)
        plans = {}
        for rank in self.over:  # the rank holding most first: the likeliest not to fit
            found = self._bounded(rank, name)
            if found is None or beyond(found[0], self.best[0]):
                return None
            plans[rank] = found[1]
        self.runs += 1
        run = run_with(self.given, self.costs, {
            rank: placed(self.given.orders[rank], rank, *plan)
            for rank, (plan, _) in plans.items()})
        if (all(run.ranks[rank].peak_activation_bytes <= self.budgets[rank]
                for rank in self.over) and (run.step_time, index) < self.best[:2]):
            self.best = (run.step_time, index, plans)
        return None

    def _bounded(self, rank: int, name: AlikeName
                 ) -> tuple[float, tuple[Plan, RankResult]] | None:
        """The rank's plan of ``name`` within its budget (and its run alone), and the least
        step it gives with the others as ``name``'s recompute alone runs them; None where it
        has no such plan."""
        made = self.fitted.plan(rank, name)
        if made is None:
            return None
        return least_step(self.ways.logged(self.over, name), self.given, rank,
                          placed(self.given.orders[rank], rank, *made[0]), self.costs), made


class _RankPlans:
    """One rank's plans alike on every chunk, each part made when first asked for (what a
    plan recomputes depends on its count and shape alone, where it swaps on its lag and
    depth alone)."""

    def __init__(self, candidates: Sequence[SwapCandidate], counts: Sequence[int],
                 granularity: Granularity) -> None:
        self.candidates, self.counts = candidates, counts
        self.names = frozenset(alike_names(max(counts, default=1), granularity))
        self.recomputes: dict[tuple[int, int], dict[ChunkKey, tuple[int, ...]]] = {}
        self.swaps: dict[tuple[int, int], dict[ChunkKey, SwapPlacement]] = {}

    def nearest(self, name: AlikeName) -> AlikeName:
        """The rank's name nearest ``name``, field by field (a rank whose chunks hold fewer
        layers has no plan of more of them recomputed, nor of a longer lag)."""
        if name in self.names:
            return name
        return min(sorted(self.names),
                   key=lambda mine: tuple(abs(m - n) for m, n in zip(mine, name)))

    def recomputed(self, name: AlikeName) -> dict[ChunkKey, tuple[int, ...]]:
        """What the rank's plan nearest ``name`` recomputes."""
        k, _, _, shape = self.nearest(name)
        if (k, shape) not in self.recomputes:
            self.recomputes[k, shape] = alike_recomputed(self.candidates, self.counts, k,
                                                         shape)
        return self.recomputes[k, shape]

    def plan(self, name: AlikeName) -> Plan:
        """The rank's plan nearest ``name``."""
        _, lag, depth, _ = self.nearest(name)
        if (lag, depth) not in self.swaps:
            self.swaps[lag, depth] = alike_placements(self.candidates, self.counts, lag,
                                                      depth)
        return self.recomputed(name), self.swaps[lag, depth]


class _Fitted:
    """Each rank's plan of a name, fitted to the rank's budget where it goes over, made
    once: a rank's run on its own and (where over) its fit are most of a choice's cost. A
    plan holds no less than the same plan with lag and depth 1 everywhere, which a fit
    cannot lower: where that one is over the budget, the plan is not fitted."""

    def __init__(self, given: Schedule, costs: CostModel, budgets: Mapping[int, int],
                 found: Mapping[int, _RankPlans]) -> None:
        self.given, self.costs, self.budgets, self.found = given, costs, budgets, found
        self.made: dict[tuple[int, AlikeName], tuple[Plan, RankResult] | None] = {}
        self.runs: dict[tuple[int, AlikeName], RankResult] = {}

    def plan(self, rank: int, name: AlikeName) -> tuple[Plan, RankResult] | None:
        """``rank``'s plan of ``name`` within its budget (fitted where needed) and its run
        alone; None where even a fit cannot keep it there."""
        plans = self.found[rank]
        mine = plans.nearest(name)
        if (rank, mine) not in self.made:
            recomputed, placements = plans.plan(mine)
            budget = self.budgets[rank]
            run = self._alone(rank, mine)
            made: tuple[Plan, RankResult] | None = None
            if run.peak_activation_bytes <= budget:
                made = (recomputed, placements), run
            elif self._may_fit(rank, mine, placements):
                better = fit(placements, partial(placed, self.given.orders[rank], rank,
                                                 recomputed), rank, self.costs, budget)
                if better is not None:
                    made = (recomputed, better.placements), better.run
            self.made[rank, mine] = made
        return self.made[rank, mine]

    def _may_fit(self, rank: int, name: AlikeName, placements: Mapping[ChunkKey, SwapPlacement]
                 ) -> bool:
        """Whether a fit of ``rank``'s plan ``name`` could meet its budget: it streams, and
        the same plan with lag and depth 1 is within the budget."""
        k, _, _, shape = name
        frugal = (k, 1, 1, shape)
        return any(p.layer_lag for p in placements.values()) and (
            frugal not in self.found[rank].names
            or self._alone(rank, frugal).peak_activation_bytes <= self.budgets[rank])

    def _alone(self, rank: int, name: AlikeName) -> RankResult:
        """``rank``'s plan ``name`` run on its own, as named (not fitted)."""
        if (rank, name) not in self.runs:
            self.runs[rank, name] = simulate_alone(
                placed(self.given.orders[rank], rank, *self.found[rank].plan(name)), rank,
                self.costs)
        return self.runs[rank, name]


class _Ways:
    """Each way of recomputing a name's plans run once, logged (its recompute alone, the
    given schedule where it recomputes nothing): its step bounds the name's, and each
    rank's plan (which only adds swap steps to it) is bounded against its messages. Where
    no backward splits, recompute only adds compute, so the given schedule's step bounds
    every way's, and a way recomputing at least the layers of another is bounded by that
    one's before it is run; where the backward splits (I and W steps), a recomputed layer's
    share of W moves to its I, so a recompute may make the step shorter, and neither
    holds."""

    def __init__(self, given: Schedule, costs: CostModel, plain_step: float,
                 found: Mapping[int, _RankPlans]) -> None:
        self.given, self.costs, self.plain_step, self.found = given, costs, plain_step, found
        self.adds_only = not _splits_backward(given)
        self.logs: dict[_Recompute, Logged] = {}

    def _of(self, over: Sequence[int], name: AlikeName
            ) -> tuple[_Recompute, dict[int, dict[ChunkKey, tuple[int, ...]]]]:
        layers = {rank: self.found[rank].recomputed(name) for rank in over}
        return frozenset((rank, frozenset(recomputed.items()))
                         for rank, recomputed in layers.items() if recomputed), layers

    def floor(self, over: Sequence[int], name: AlikeName) -> float:
        """A bound of ``name``'s step known before anything is run."""
        key, _ = self._of(over, name)
        return self.plain_step if self.adds_only or not key else -math.inf

    def known(self, over: Sequence[int], name: AlikeName) -> tuple[float, bool]:
        """The best bound of ``name``'s step known without a run, and whether it is its
        own way's step."""
        key, layers = self._of(over, name)
        if key in self.logs:
            return _step(self.logs[key]), True
        if not key:
            return self.plain_step, True
        if not self.adds_only:
            return -math.inf, False
        return max([self.plain_step] + [_step(log) for known, log in self.logs.items()
                                        if _within(known, layers)]), False

    def logged(self, over: Sequence[int], name: AlikeName) -> Logged:
        """``name``'s way of recomputing run, logged for any rank's plan on top of it."""
        key, layers = self._of(over, name)
        if key not in self.logs:
            self.logs[key] = simulate_logged(with_orders(self.given, {
                rank: placed(self.given.orders[rank], rank, recomputed, {})
                for rank, recomputed in layers.items() if recomputed}), self.costs, None)
        return self.logs[key]


def _step(log: Logged) -> float:
    return max(log.finishes, default=0.0)


def _splits_backward(schedule: Schedule) -> bool:
    """Whether any rank's order runs a weight gradient (W) apart from its backward."""
    return any(leaf.type is StepType.BWD_WEIGHT for order in schedule.orders
               for step in order if step is not None for leaf in step.sub_steps or (step,))


def _within(known: _Recompute, layers: Mapping[int, Mapping[ChunkKey, tuple[int, ...]]]
            ) -> bool:
    """Whether every layer ``known`` recomputes ``layers`` recomputes too."""
    return all(set(chunk) <= set(layers.get(rank, {}).get(key, ()))
               for rank, chunks in known for key, chunk in chunks)


def _trial(rank: int, plan: Plan, alone: RankResult, plain: SimulationResult, budget: int,
           step: float) -> Trial[PlanOutcome]:
    """``plan`` as the rank's chosen trial, with the figures of its order run alone
    (``alone``, as the plans chosen rank by rank carry them) and the pipeline's step."""
    recomputed, placements = plan
    return Trial(recomputed, dict(placements), PlanOutcome(
        rank, alone.peak_activation_bytes, plain.ranks[rank].peak_activation_bytes,
        alone.exposed_copy, budget, sum(len(layers) for layers in recomputed.values()),
        alone.recompute_s, step))
