"""The peak policy's search on one rank: its plan at slot or layer resolution for the layers
it recomputes, and (keep, offload or recompute) its best plans under a budget.

:mod:`pipeswap.schedule.policies.peak` holds the options; this is what it runs per rank, in
this process or in a worker (:mod:`pipeswap.schedule.policies._parallel`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.policies._chunk_plan import ChunkPlan
from pipeswap.schedule.policies._fit import fit
from pipeswap.schedule.policies._layer_greedy import fill, lower, prune, take, unstream, without
from pipeswap.schedule.policies._layer_plan import LayerPlan, Way
from pipeswap.schedule.policies._mixed import Trial, alike, layer_counts, levels_for, search
from pipeswap.schedule.policies._pipeline import order_of, placed
from pipeswap.schedule.policies._points import Points, Redo
from pipeswap.schedule.policies._slots import Timeline
from pipeswap.schedule.policies.base import Granularity
from pipeswap.schedule.policies.recompute_only import fewest_first_layers, recompute_seconds
from pipeswap.schedule.simulate import simulate_alone
from pipeswap.schedule.steps import ChunkKey, Order
from pipeswap.schedule.swap_plan import PlanOutcome, SwapCandidate, SwapPlacement


@dataclass(frozen=True)
class RankSearch:
    """What the peak policy plans one rank with: the cost model and the granularity."""

    costs: CostModel
    granularity: Granularity

    def plan(self, candidates: Sequence[SwapCandidate], order: Order, rank: int,
             budget: int | None, recomputed: Mapping[ChunkKey, tuple[int, ...]],
             stall: bool = True, seeded: bool = False
             ) -> tuple[dict[ChunkKey, SwapPlacement], PlanOutcome]:
        """The swap plan of one rank whose chunks recompute ``recomputed``, and its outcome;
        without ``stall`` it takes no copy that stalls compute, budget or not; with
        ``seeded``, a plan at layer resolution under a budget starts only from the
        chunk-level plan (see :meth:`_select_layers`)."""
        if not recomputed and not self._by_layer(candidates):
            plan = ChunkPlan(self.costs, rank, Timeline.of(order, self.costs, rank), candidates)
            peak_no_swap = plan.peak
            plan.lower(budget, allow_stall=False)
            if stall and budget is not None and plan.peak > budget:
                plan.lower(budget, allow_stall=True)
            plan.prune()
            return dict(plan.chosen), PlanOutcome(rank, plan.peak, peak_no_swap,
                                                  plan.stall(plan.copies()), budget)
        costs = self.costs.with_recomputed(recomputed)
        redo = self._redo(recomputed)
        layer_plan = self._select_layers(candidates, order, rank, budget, costs, redo, stall,
                                         seeded)
        return layer_plan.placements(), PlanOutcome(
            rank, layer_plan.peak, layer_plan.initial_peak, layer_plan.stall, budget,
            sum(r.layers for r in redo.values()),
            recompute_seconds(self.costs, rank, {key: r.layers for key, r in redo.items()}))

    def _redo(self, recomputed: Mapping[ChunkKey, tuple[int, ...]]) -> dict[ChunkKey, Redo]:
        """Each recomputed chunk's :class:`Redo`, worked out once per stage and layers."""
        shared: dict[tuple[int, tuple[int, ...]], Redo] = {}
        out: dict[ChunkKey, Redo] = {}
        for key, layers in recomputed.items():
            own = key in self.costs.chunks
            found = None if own else shared.get((key[0], layers))
            if found is None:
                found = Redo(len(layers), self.costs.recomputed_layers(key, layers)[1])
                if not own:
                    shared[key[0], layers] = found
            out[key] = found
        return out

    def mixed(self, candidates: Sequence[SwapCandidate], order: Order, rank: int,
              budget: int, every: bool = False) -> list[Trial[PlanOutcome]]:
        """Keep, offload or recompute (see :mod:`pipeswap.schedule.policies._mixed`): the
        rank's best plan on its own timeline, or (``every``) each of its plans that meets
        the budget, where more than one does, for the pipeline to choose from."""
        keys = [c.key for c in candidates]

        def exactly(trial: Trial[PlanOutcome]) -> Trial[PlanOutcome]:
            """``trial`` with the peak and stall of its order run alone (the plans'
            own figures are estimates), as the simulator runs it."""
            run = simulate_alone(order_of(order, rank, trial), rank, self.costs)
            return replace(trial, outcome=replace(
                trial.outcome, peak=run.peak_activation_bytes, exposed_copy=run.exposed_copy,
                recompute_s=run.recompute_s, step_time=run.step_time))

        def evaluate(recomputed: Mapping[ChunkKey, tuple[int, ...]], stall: bool
                     ) -> Trial[PlanOutcome]:
            placements, outcome = self.plan(candidates, order, rank, budget, recomputed, stall,
                                            seeded=True)
            return exactly(Trial(recomputed, placements, outcome))

        alone = fewest_first_layers(order, self.costs, budget)
        alone_trial = Trial(alone.layers, {}, PlanOutcome(
            rank, alone.peak, alone.plain, 0.0, budget,
            sum(len(layers) for layers in alone.layers.values()),
            recompute_seconds(self.costs, rank,
                              {key: len(layers) for key, layers in alone.layers.items()})))
        alone_trial = exactly(alone_trial)

        layers_of = layer_counts(self.costs)
        meeting: list[Trial[PlanOutcome]] = []

        def keep(trials: list[Trial[PlanOutcome]]) -> Trial[PlanOutcome]:
            meeting.extend(trials)
            return trials[0]

        best = search(evaluate, _groups(candidates), layers_of,
                      levels_for([layers_of(key) for key in keys]), alone_trial,
                      keep if every else None, partial(
                          self._alike_trials, candidates, order, rank, budget, alone.plain,
                          exactly, layers_of))
        # the peak without swap is the one without recompute either
        return [replace(trial, outcome=replace(trial.outcome, peak_no_swap=alone.plain))
                for trial in meeting or [best]]

    def _alike_trials(self, candidates: Sequence[SwapCandidate], order: Order, rank: int,
                      budget: int, plain: int,
                      exactly: Callable[[Trial[PlanOutcome]], Trial[PlanOutcome]],
                      layers_of: Callable[[ChunkKey], int], beat: float
                      ) -> list[Trial[PlanOutcome]]:
        """For :meth:`mixed` (``exactly`` runs a trial's order alone; ``plain``: the peak
        with neither swap nor recompute): the plans alike on every chunk, each over the
        budget at a few points fitted (:func:`fit`), in order; made cheapest recompute
        first, and only while their recompute alone adds less than ``beat`` or the best of
        them that meets the budget (the copies only add to it). A plan holds no less than the same plan
        with lag and depth 1 everywhere (made first of its kind), and a fit only lowers
        lags and load depths, which hide no more of the copies: a plan is not fitted
        where that one is over the budget too, or where its copies already add more
        than the best, nor made at all where that one is over and another plan meets
        the budget."""
        found = alike(candidates, layers_of, self.granularity)
        names, plans = list(found), list(found.values())
        seconds = [recompute_seconds(self.costs, rank, {
            key: len(layers) for key, layers in recomputed.items()})
            for recomputed, _ in plans]
        out: dict[int, Trial[PlanOutcome]] = {}

        def made(k: int) -> Trial[PlanOutcome]:
            if k not in out:
                recomputed, placements = plans[k]
                out[k] = exactly(Trial(recomputed, placements, PlanOutcome(
                    rank, 0, plain, 0.0, budget,
                    sum(len(layers) for layers in recomputed.values()))))
            return out[k]

        where = {name: k for k, name in enumerate(names)}
        tried: list[int] = []
        for k in sorted(range(len(plans)), key=seconds.__getitem__):
            if seconds[k] >= beat * (1 + _ROUNDING):
                break
            count, _, _, shape = names[k]
            frugal = where.get((count, 1, 1, shape))  # made first of its kind
            if (beat < math.inf and frugal is not None and frugal != k
                    and made(frugal).outcome.shortfall):
                continue  # it cannot meet the budget, and one does already
            tried.append(k)
            trial = made(k)
            if (trial.outcome.shortfall and frugal is not None
                    and trial.merit[1] < beat * (1 + _ROUNDING)
                    and not made(frugal).outcome.shortfall):
                recomputed, placements = plans[k]
                fitted = fit(placements, partial(placed, order, rank, recomputed), rank,
                             self.costs, budget)
                if fitted is not None:
                    trial = out[k] = exactly(replace(trial, placements=fitted.placements))
            if not trial.outcome.shortfall:
                beat = min(beat, trial.merit[1])
        return [out[k] for k in sorted(tried)]

    def _by_layer(self, candidates: Sequence[SwapCandidate]) -> bool:
        """Whether to plan at layer resolution: streaming asked for, or allowed and some
        chunk has layers to stream."""
        if self.granularity != "auto":
            return self.granularity == "layer"
        chunks = self.costs.chunks
        return any(self.costs.stage_layers(stage) > 1
                   for stage in {c.stage for c in candidates}) or any(
            len(chunks[c.key].layers) > 1 for c in candidates if c.key in chunks)

    def _select_layers(self, candidates: Sequence[SwapCandidate], order: Order, rank: int,
                       budget: int | None, costs: CostModel, redo: dict[ChunkKey, Redo],
                       stall: bool, seeded: bool = False) -> LayerPlan:
        """The plan at layer resolution: the best of descents from nothing taken and from
        everything taken (for auto: also from everything streamed, and from the chunk-level
        plan, so that it never does worse than either), then improved by dropping a chunk
        and descending again (a stream runs its copies in order, so a chunk left out can
        let the chunks after it stream with shorter lags). The chunk granularity comes here
        only for an order that recomputes: then nothing streams. With ``seeded`` (the mix
        of keep, offload and recompute) a plan under a budget descends from the chunk-level
        plan alone: the other starts took 95% of a rank's planning time at 64 stages, and
        with the plans alike on every chunk beside them they made no budget and link of the
        reference case faster (``benchmarks/keep_offload_recompute.py``). For the same
        reason it is not improved by dropping chunks (:func:`_perturb`): that made no plan
        of the reference case faster either, and took most of the time of a rank holding
        many layers."""
        points = Points(order, costs, rank, redo)
        only = self.granularity == "layer"
        whole = self.granularity == "chunk"
        starts: list[tuple[bool, Callable[[], LayerPlan]]] = []  # (everything taken, make)
        for streamed_only in (True,) if only else (False,) if whole else (False, True):
            for full in (False, True):
                starts.append((full, partial(self._start, candidates, points, rank, costs,
                                             streamed_only, full)))
        if not only:
            starts.append((False, partial(self._seeded, candidates, order, rank, budget,
                                          points, costs, stall)))
        # Without a budget, a plan at the lowest peak hidden copies can reach, no stall,
        # is as good as any: the cheap starts (everything taken) go first, and where one
        # gets there the others are not run, nor the drops after.
        floor = None if budget is not None else self._plan_of(
            costs, rank, points, candidates, only).floor()
        if seeded and budget is not None and not only:
            starts = starts[-1:]
        plans: dict[int, LayerPlan] = {}
        for index in sorted(range(len(starts)), key=lambda k: not starts[k][0]):
            plans[index] = _descend(starts[index][1](), budget, stall)
            if _at_floor(plans[index], floor):
                break
        plan = min((plans[k] for k in sorted(plans)), key=lambda p: _merit(p, budget))
        plan.streamed_only = only  # auto may go on with whole chunks from any start
        if stall and not seeded and not _at_floor(plan, floor):
            plan = _perturb(plan, budget, stall)
        if not only:
            unstream(plan)  # auto streams only where streaming lowers the peak
        return plan

    def _plan_of(self, costs: CostModel, rank: int, points: Points,
                 candidates: Sequence[SwapCandidate], streamed_only: bool) -> LayerPlan:
        plan = LayerPlan(costs, rank, points, candidates, streamed_only)
        plan.whole_only = self.granularity == "chunk"
        return plan

    def _start(self, candidates: Sequence[SwapCandidate], points: Points, rank: int,
               costs: CostModel, streamed_only: bool, full: bool) -> LayerPlan:
        """A plan with nothing taken, or (``full``) every chunk taken that hides."""
        plan = self._plan_of(costs, rank, points, candidates, streamed_only)
        if full:
            fill(plan)
        return plan

    def _seeded(self, candidates: Sequence[SwapCandidate], order: Order, rank: int,
                budget: int | None, points: Points, costs: CostModel, stall: bool
                ) -> LayerPlan:
        """A layer-resolution plan holding the chunks the chunk-level plan swaps."""
        chunk_level = ChunkPlan(costs, rank, Timeline.of(order, costs, rank), candidates)
        chunk_level.lower(budget, allow_stall=False)
        stalls = stall and budget is not None and chunk_level.peak > budget
        if stalls:
            chunk_level.lower(budget, allow_stall=True)
        chunk_level.prune()
        plan = self._plan_of(costs, rank, points, candidates, streamed_only=False)
        take(plan, {key: Way(False, p.load_slots, None, p.offload_slots if stalls else None)
                    for key, p in chunk_level.chosen.items()}, allow_stall=stalls)
        return plan


def _groups(candidates: Sequence[SwapCandidate]) -> list[list[ChunkKey]]:
    """The rank's chunks forwarded before its first backward, those whose backward follows
    its last forward, and the rest (see :mod:`pipeswap.schedule.policies._mixed`), each in
    forward order; empty groups left out."""
    first = min(c.backward_slot for c in candidates)
    last = max(c.forward_slot for c in candidates)
    groups: list[list[ChunkKey]] = [[], [], []]
    for c in candidates:
        groups[0 if c.forward_slot < first else 2 if c.backward_slot > last else 1].append(
            c.key)
    return [group for group in groups if group]


#: How far a plan's recompute seconds, worked out, may exceed what the simulator counts of
#: them (the same sum, added in another order).
_ROUNDING = 1e-9

#: How many chunks the layer-resolution plan tries to drop in a round, and how many rounds
#: it goes on while one does better (a bound on its time).
_DROPS_PER_ROUND, _ROUNDS = 12, 8


def _descend(plan: LayerPlan, budget: int | None, stall: bool = True) -> LayerPlan:
    """Lower the peak with copies hidden, then (with ``stall``) with stalls where a budget
    needs them, and drop what lowers nothing."""
    lower(plan, budget, allow_stall=False)
    if stall and budget is not None and plan.peak > budget:
        lower(plan, budget, allow_stall=True)
    prune(plan)
    return plan


def _at_floor(plan: LayerPlan, floor: int | None) -> bool:
    """Whether ``plan`` reached ``floor`` (the lowest peak hidden copies can) without a
    stall."""
    return floor is not None and plan.stall == 0 and plan.peak <= floor


def _merit(plan: LayerPlan, budget: int | None) -> tuple[int, float, int, int]:
    """Smaller is better: the budget's shortfall, the stall, the peak, the chunks swapped."""
    short = 0 if budget is None else max(0, plan.peak - budget)
    return short, plan.stall, plan.peak, len(plan.chosen)


def _perturb(plan: LayerPlan, budget: int | None, stall: bool) -> LayerPlan:
    """Try dropping one taken chunk (those before the peak, the latest first) and
    descending again; keep the first that does better, and go on from it."""
    for _ in range(_ROUNDS):
        first = plan.profile.first(plan.peak) if plan.profile.raw else 0
        before = sorted((k for k in plan.chosen if plan.chunks[k].forward_points <= first),
                        key=lambda k: -plan.chunks[k].forward_points)
        better = next((trial for trial in (_descend(without(plan, key), budget, stall)
                                           for key in before[:_DROPS_PER_ROUND])
                       if _merit(trial, budget) < _merit(plan, budget)), None)
        if better is None:
            return plan
        plan = better
    return plan
