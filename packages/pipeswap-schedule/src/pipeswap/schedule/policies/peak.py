"""The default swap policy: swap only what lowers a rank's peak of saved activations.

It plans on the rank's own timeline, at slot resolution for whole chunks
(:mod:`pipeswap.schedule.policies._chunk_plan`) or, where chunks have layers to stream, layer
by layer (:mod:`pipeswap.schedule.policies._layer_plan`): a streamed chunk leaves the device
while its forward still runs and comes back while its backward runs, so it saves memory even
with a short gap.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.policies._chunk_plan import ChunkPlan
from pipeswap.schedule.policies._fit import fit
from pipeswap.schedule.policies._layer_plan import LayerPlan, Way
from pipeswap.schedule.policies._mixed import Trial, alike, layer_counts, levels_for, search
from pipeswap.schedule.policies._parallel import plan_ranks
from pipeswap.schedule.policies._pipeline import choose, order_of, placed, run_with
from pipeswap.schedule.policies._points import Points, Redo
from pipeswap.schedule.policies._slots import Timeline
from pipeswap.schedule.policies.base import SwapCandidate, SwapPlacement
from pipeswap.schedule.policies.recompute import fewest_first_layers
from pipeswap.schedule.recompute import recomputed_in
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.simulate import simulate, simulate_alone
from pipeswap.schedule.steps import ChunkKey, Order, StepType
from pipeswap.schedule.swap_order import swap_candidates


@dataclass(frozen=True)
class PeakOutcome:
    """What the peak policy achieved on one rank (on that rank's own timeline)."""

    rank: int
    peak: int
    peak_no_swap: int
    exposed_copy: float  # compute time the chosen copies stall (0 unless a budget needed it)
    budget: int | None = None
    recomputed_layers: int = 0  # layer forwards the rank's backwards run again
    recompute_s: float = 0.0  # the compute seconds they take

    @property
    def met(self) -> bool:
        return self.budget is None or self.peak <= self.budget

    @property
    def shortfall(self) -> int:
        """Bytes by which the peak stays over the budget (0 when met or without one)."""
        return 0 if self.budget is None else max(0, self.peak - self.budget)


#: How the peak policy may swap a chunk. chunk: whole (LO/LL); layer: streamed layer by
#: layer (SO/SL); auto: whichever lowers the peak more, chunk by chunk.
GRANULARITIES = ("auto", "chunk", "layer")
#: Whether the peak policy may recompute layers under a budget. auto: where that is faster
#: than a stalled copy; never: swap only.
RECOMPUTE_MODES = ("auto", "never")


@dataclass
class PeakPolicy:
    """Swap only what lowers the rank's peak of saved activations, with copies hidden.

    Greedy on the rank's own timeline: while some chunk can lower the highest point, take the
    one that covers most of the slots at that height with copies that still hide behind
    compute (each copy may take 1 to 3 compute slots, queued on its stream behind the
    copies already taken), giving it the tightest placement that hides. With a ``budget``
    (bytes, or per rank) still exceeded, chunks whose copies stall compute are taken next,
    least added stall first (a copy may then take zero slots: compute waits for it), until
    the budget is met. Last, every chunk whose removal would not raise the peak is dropped:
    nothing is swapped for nothing.
    :attr:`outcomes` reports per rank the peak reached and the stall accepted.

    ``granularity`` says how a chunk may be swapped: ``"chunk"`` whole, as above;
    ``"layer"`` streamed, layer by layer (each chunk gets the smallest layer lag its copies
    hide with); ``"auto"`` (the default) either, chunk by chunk, whichever lowers the peak
    more. Streaming frees a chunk's first layers while its forward still runs and loads its
    layers one ahead of its backward, which whole-chunk swap cannot; a chunk of one layer
    gains nothing from it, and where every chunk of the rank has one layer ``"auto"`` plans
    exactly as ``"chunk"``. Layers come from the cost model (``CostModel.layers``,
    ``StageCosts.layers``, ``ChunkBytes.layers``); with streaming the plan follows each
    rank's memory layer by layer (:mod:`pipeswap.schedule.policies._layer_plan`).

    An order that recomputes layers (RC steps) is planned around them: a recomputed layer
    holds (and a swap of it moves) only what its forward kept, and its backward runs its
    forward again. With ``recompute="auto"`` and a budget, the policy also chooses what to
    recompute, rank by rank (:mod:`pipeswap.schedule.policies._mixed`): the fastest of swap
    alone, recompute alone, mixes of the two and plans alike on every chunk, weighed in the
    whole pipeline where the cost model times every stage
    (:mod:`pipeswap.schedule.policies._pipeline`), and
    :func:`~pipeswap.schedule.swap.inject_swap` adds the RC steps (:meth:`recomputed`).
    ``jobs`` worker processes make the ranks' plans there (:meth:`prepare`), each rank's
    depending on its own order alone: any number gives the same plans.
    """

    costs: CostModel
    budget: int | Mapping[int, int] | None = None
    outcomes: dict[int, PeakOutcome] = field(default_factory=dict)
    granularity: str = "auto"
    recompute: str = "never"
    chosen_recompute: dict[int, dict[ChunkKey, tuple[int, ...]]] = field(default_factory=dict)
    # told (rank, ranks planned so far, ranks to plan) as each rank's plans under a budget
    # are made: a search that takes minutes at 64 stages can say how far it is
    progress: Callable[[int, int, int], None] | None = field(default=None, repr=False)
    # told (choices made, choices to make) as the ranks choose their plans in the whole
    # pipeline (each rank once from each start; see prepare)
    choosing: Callable[[int, int], None] | None = field(default=None, repr=False)
    # processes that make the ranks' plans under a budget in prepare (1: this one; each
    # rank's plans depend on its own order alone, so any number gives the same plans)
    jobs: int = 1
    _given: Schedule | None = field(default=None, init=False, repr=False)  # the schedule
    # prepared on; each rank's order and its plan, chosen in the whole pipeline by prepare
    _decided: dict[int, tuple[Order, Trial[PeakOutcome]]] = field(
        default_factory=dict, init=False, repr=False)
    _ranks: int = field(default=0, init=False, repr=False)  # ranks the pass plans
    _done: int = field(default=0, init=False, repr=False)  # ranks select has planned

    def __post_init__(self) -> None:
        if self.granularity not in GRANULARITIES:
            raise ScheduleError(
                f"unknown swap granularity {self.granularity!r}; use one of "
                f"{', '.join(GRANULARITIES)} (chunk: whole chunks, layer: streamed layer by "
                "layer, auto: whichever lowers the peak more)")
        if self.recompute not in RECOMPUTE_MODES:
            raise ScheduleError(
                f"unknown recompute mode {self.recompute!r}; use auto (recompute layers "
                "where that meets the budget faster than swapping) or never")
        if self.jobs < 1:
            raise ScheduleError(f"jobs must be 1 or more processes, not {self.jobs}")

    def budget_for(self, rank: int) -> int | None:
        if self.budget is None or isinstance(self.budget, int):
            return self.budget
        if rank not in self.budget:
            raise ScheduleError(f"the memory budget gives no figure for rank {rank}")
        return self.budget[rank]

    def prepare(self, schedule: Schedule, ranks: Collection[int] | None = None) -> None:
        """Before the swap pass plans any rank (of ``ranks``, default all): where the policy
        chooses what to recompute and the cost model times every stage, find each rank's
        plans that meet its budget and choose among them in the whole pipeline
        (:mod:`pipeswap.schedule.policies._pipeline`): a copy's stall where another rank's
        slack absorbs it costs nothing there, a recompute on the critical path costs in
        full. The ranks choose in turn from two starts: the other ranks as given, and each
        rank over its budget planned alike on every chunk (:meth:`_alike_start`; not where
        one rank chooses, whose own order the start cannot change). A cost
        model that times some stages only (a rank's own measurements) would leave the
        others at placeholder times and make every stall look absorbed: there each rank
        weighs its plans on its own timeline, in :meth:`select`."""
        stages = self.costs.stages
        timed = not stages or all(stage in stages for stage in range(schedule.num_stages))
        self._given = (schedule if timed and self.recompute == "auto"
                       and self.budget is not None else None)
        self._decided = {}
        planning = list(range(len(schedule.orders))) if ranks is None else sorted(ranks)
        self._ranks, self._done = len(planning), 0
        if self._given is None:
            return
        def done(rank: int, count: int) -> None:
            if self.progress is not None:
                self.progress(rank, count, len(planning))

        if self.jobs > 1 and len(planning) > 1:
            made = plan_ranks(replace(self, progress=None, choosing=None), schedule,
                              planning, self.jobs, done)
        else:
            made = {}
            for count, rank in enumerate(planning, 1):
                made[rank] = self.options_for(schedule, rank)
                done(rank, count)
        options = {rank: made[rank] for rank in planning if made[rank] is not None}
        # one rank choosing (each rank of pipeswap-train plans itself) replaces its own
        # order whatever the start: the start planned alike would only cost its search
        starts = [{}] if len(options) < 2 else [{}, self._alike_start(schedule, options)]
        chosen = choose(schedule, self.costs, options, starts,
                        lambda trial: trial.outcome.recompute_s, self.choosing)
        self._decided = {rank: (schedule.orders[rank], trial) for rank, trial in chosen.items()}

    def options_for(self, schedule: Schedule, rank: int) -> list[Trial[PeakOutcome]] | None:
        """``rank``'s plans that meet its budget (or its one best) for the pipeline to
        choose from; None where it has no budget, nothing to swap, or recomputes already."""
        order, budget = schedule.orders[rank], self.budget_for(rank)
        candidates = swap_candidates(order, rank)
        if budget is None or not candidates or recomputed_in(order):
            return None
        return self._mixed(candidates, order, rank, budget, every=True)

    @property
    def weighs_pipeline(self) -> bool:
        """Whether the last :meth:`prepare` chose the plans in the whole pipeline."""
        return self._given is not None

    def _alike_start(self, schedule: Schedule, ranks: Collection[int]) -> dict[int, Order]:
        """The orders of those of ``ranks`` over their budget without swap, each planned
        alike on every chunk (:func:`~pipeswap.schedule.policies._mixed.alike`, the same
        choice on each), the choice giving the shortest step among those that keep every
        one of them within its budget; none where no choice does."""
        plain = simulate(schedule, self.costs, timeline=False)
        over = [rank for rank in sorted(ranks) if plain.ranks[rank].peak_activation_bytes
                > (self.budget_for(rank) or 0)]
        layers_of = layer_counts(self.costs)
        plans = {rank: alike(swap_candidates(schedule.orders[rank], rank), layers_of,
                             self.granularity) for rank in over}
        best: tuple[float, dict[int, Order]] = (math.inf, {})
        for choice in sorted({choice for found in plans.values() for choice in found}):
            orders: dict[int, Order] = {}
            for rank in over:  # a rank with fewer layers a chunk: its nearest choice
                found = plans[rank]
                recomputed, placements = found[min(found, key=lambda mine: tuple(
                    abs(m - c) for m, c in zip(mine, choice)))]
                orders[rank] = placed(schedule.orders[rank], rank, recomputed, placements)
            run = run_with(schedule, self.costs, orders)
            if run.step_time < best[0] and all(
                    run.ranks[rank].peak_activation_bytes <= (self.budget_for(rank) or 0)
                    for rank in over):
                best = (run.step_time, orders)
        return best[1]

    def recomputed(self, rank: int) -> dict[ChunkKey, tuple[int, ...]]:
        """The layers :meth:`select` chose to recompute on ``rank``, per chunk."""
        return self.chosen_recompute.get(rank, {})

    def select(self, candidates: Sequence[SwapCandidate], order: Order
               ) -> dict[ChunkKey, SwapPlacement]:
        rank = candidates[0].rank if candidates else 0
        budget = self.budget_for(rank)
        given = recomputed_in(order)
        self.chosen_recompute.pop(rank, None)
        prepared = self._decided.get(rank)  # for this order and budget only
        decided = (prepared[1] if prepared is not None and prepared[0] == order
                   and prepared[1].outcome.budget == budget else None)
        fresh = decided is None  # planned here, not in prepare
        if fresh and self.recompute == "auto" and budget is not None and not given \
                and candidates:
            (decided,) = self._mixed(candidates, order, rank, budget)
        if decided is None:
            placements, self.outcomes[rank] = self.plan(candidates, order, rank, budget, given)
        else:
            if decided.recomputed:
                self.chosen_recompute[rank] = dict(decided.recomputed)
            self.outcomes[rank] = decided.outcome
            placements = decided.placements
        if self.progress is not None and budget is not None and fresh:
            self._done += 1
            self.progress(rank, self._done, max(self._ranks, self._done))
        return placements

    def plan(self, candidates: Sequence[SwapCandidate], order: Order, rank: int,
             budget: int | None, recomputed: Mapping[ChunkKey, tuple[int, ...]],
             stall: bool = True, seeded: bool = False
             ) -> tuple[dict[ChunkKey, SwapPlacement], PeakOutcome]:
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
            return dict(plan.chosen), PeakOutcome(rank, plan.peak, peak_no_swap,
                                                  plan.stall(plan.copies()), budget)
        costs = self.costs.with_recomputed(recomputed)
        redo = self._redo(recomputed)
        layer_plan = self._select_layers(candidates, order, rank, budget, costs, redo, stall,
                                         seeded)
        forward = {stage: self.costs.compute_time(StepType.FWD, stage, rank)
                   / self.costs.stage_layers(stage) for stage in {key[0] for key in redo}}
        return layer_plan.placements(), PeakOutcome(
            rank, layer_plan.peak, layer_plan.initial_peak, layer_plan.stall, budget,
            sum(r.layers for r in redo.values()),
            sum(forward[key[0]] * r.layers for key, r in redo.items()))

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

    def _mixed(self, candidates: Sequence[SwapCandidate], order: Order, rank: int,
               budget: int, every: bool = False) -> list[Trial[PeakOutcome]]:
        """Keep, offload or recompute (see :mod:`pipeswap.schedule.policies._mixed`): the
        rank's best plan on its own timeline, or (``every``) each of its plans that meets
        the budget, where more than one does, for the pipeline to choose from."""
        keys = [c.key for c in candidates]
        forward = {stage: self.costs.compute_time(StepType.FWD, stage, rank)
                   / self.costs.stage_layers(stage) for stage in {key[0] for key in keys}}

        def exactly(trial: Trial[PeakOutcome]) -> Trial[PeakOutcome]:
            """``trial`` with the peak and stall of its order run alone (the plans'
            own figures are estimates), as the simulator runs it."""
            run = simulate_alone(order_of(order, rank, trial), rank, self.costs)
            return replace(trial, outcome=replace(
                trial.outcome, peak=run.peak_activation_bytes, exposed_copy=run.exposed_copy,
                recompute_s=run.recompute_s))

        def evaluate(recomputed: Mapping[ChunkKey, tuple[int, ...]], stall: bool
                     ) -> Trial[PeakOutcome]:
            placements, outcome = self.plan(candidates, order, rank, budget, recomputed, stall,
                                            seeded=True)
            return exactly(Trial(recomputed, placements, outcome))

        alone = fewest_first_layers(order, self.costs, budget)
        alone_trial = Trial(alone.layers, {}, PeakOutcome(
            rank, alone.peak, alone.plain, 0.0, budget,
            sum(len(layers) for layers in alone.layers.values()),
            sum(forward[key[0]] * len(layers) for key, layers in alone.layers.items())))
        alone_trial = exactly(alone_trial)

        layers_of = layer_counts(self.costs)

        def alike_trials() -> list[Trial[PeakOutcome]]:
            out = []
            for recomputed, placements in alike(candidates, layers_of,
                                                self.granularity).values():
                trial = exactly(Trial(recomputed, placements, PeakOutcome(
                    rank, 0, alone.plain, 0.0, budget,
                    sum(len(layers) for layers in recomputed.values()))))
                if trial.outcome.shortfall:  # over at a few points, perhaps: fit it
                    fitted = fit(placements, partial(placed, order, rank, recomputed), rank,
                                 self.costs, budget)
                    if fitted is not None:
                        trial = exactly(replace(trial, placements=fitted))
                out.append(trial)
            return out

        meeting: list[Trial[PeakOutcome]] = []

        def keep(trials: list[Trial[PeakOutcome]]) -> Trial[PeakOutcome]:
            meeting.extend(trials)
            return trials[0]

        best = search(evaluate, _groups(candidates), layers_of,
                      levels_for([layers_of(key) for key in keys]), alone_trial,
                      keep if every else None, alike_trials)
        # the peak without swap is the one without recompute either
        return [replace(trial, outcome=replace(trial.outcome, peak_no_swap=alone.plain))
                for trial in meeting or [best]]

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
        reference case faster (``benchmarks/keep_offload_recompute.py``)."""
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
        if stall and not _at_floor(plan, floor):
            plan = _perturb(plan, budget, stall)
        if not only:
            plan.unstream()  # auto streams only where streaming lowers the peak
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
            plan.fill()
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
        plan.take({key: Way(False, p.load_slots, None, p.offload_slots if stalls else None)
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


#: How many chunks the layer-resolution plan tries to drop in a round, and how many rounds
#: it goes on while one does better (a bound on its time).
_DROPS_PER_ROUND, _ROUNDS = 12, 8


def _descend(plan: LayerPlan, budget: int | None, stall: bool = True) -> LayerPlan:
    """Lower the peak with copies hidden, then (with ``stall``) with stalls where a budget
    needs them, and drop what lowers nothing."""
    plan.lower(budget, allow_stall=False)
    if stall and budget is not None and plan.peak > budget:
        plan.lower(budget, allow_stall=True)
    plan.prune()
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
        better = next((trial for trial in (_descend(plan.without(key), budget, stall)
                                           for key in before[:_DROPS_PER_ROUND])
                       if _merit(trial, budget) < _merit(plan, budget)), None)
        if better is None:
            return plan
        plan = better
    return plan
