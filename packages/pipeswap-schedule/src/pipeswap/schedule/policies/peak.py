"""The default swap policy: swap only what lowers a rank's peak of saved activations.

It plans on the rank's own timeline, at slot resolution for whole chunks
(:mod:`pipeswap.schedule.policies._chunk_plan`) or, where chunks have layers to stream, layer
by layer (:mod:`pipeswap.schedule.policies._layer_plan`): a streamed chunk leaves the device
while its forward still runs and comes back while its backward runs, so it saves memory even
with a short gap. The policy is configuration only: what one swap pass learns (the plans
chosen in the whole pipeline, the progress told) lives in the :class:`PeakPlanner` that
:meth:`PeakPolicy.prepare` makes for that pass, and every rank's plan is the value
:meth:`PeakPlanner.select` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.policies._alike_choice import alike_choice
from pipeswap.schedule.policies._mixed import Trial, alike, layer_counts
from pipeswap.schedule.policies._parallel import plan_ranks
from pipeswap.schedule.policies._pipeline import choose, first_fastest
from pipeswap.schedule.policies._rank_search import RankSearch
from pipeswap.schedule.policies.base import (
    GRANULARITIES,
    PIPELINE_CHOICES,
    RECOMPUTE_MODES,
    Granularity,
    PipelineChoice,
    RecomputeMode,
)
from pipeswap.schedule.recompute_pass import recomputed_in
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.simulate import simulate
from pipeswap.schedule.steps import Order
from pipeswap.schedule.swap_order import swap_candidates
from pipeswap.schedule.swap_plan import PlanOutcome, RankPlan, SwapCandidate

#: The largest pipeline (ranks x microbatches) whose plans the ``"auto"`` pipeline choice
#: makes rank by rank: about 8 s on one core for 16 ranks and 64 microbatches, where the
#: search grows as ranks squared x microbatches (minutes at 64 ranks); beyond it, one plan
#: alike on every rank (``benchmarks/keep_offload_recompute.py`` compares the two).
TURNS_UP_TO = 1024


@dataclass(frozen=True)
class PeakPolicy:
    """Swap only what lowers the rank's peak of saved activations, with copies hidden.

    Greedy on the rank's own timeline: while some chunk can lower the highest point, take the
    one that covers most of the slots at that height with copies that still hide behind
    compute (each copy may take 1 to 3 compute slots, queued on its stream behind the
    copies already taken), giving it the tightest placement that hides. With a ``budget``
    (bytes, or per rank) still exceeded, chunks whose copies stall compute are taken next,
    least added stall first (a copy may then take zero slots: compute waits for it), until
    the budget is met. Last, every chunk whose removal would not raise the peak is dropped:
    nothing is swapped for nothing. Each rank's plan
    (:class:`~pipeswap.schedule.swap_plan.RankPlan`) says the peak reached and the stall
    accepted.

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
    (:mod:`pipeswap.schedule.policies._pipeline`; for a pipeline larger than
    :data:`TURNS_UP_TO` where more than one rank plans, or with
    ``pipeline_choice="alike"``, one plan alike on every rank:
    :mod:`pipeswap.schedule.policies._alike_choice`); the rank's plan holds the layers, and
    the swap pass adds their RC steps. ``jobs`` worker processes make the ranks' plans there
    (:meth:`prepare`), each rank's depending on its own order alone: any number gives the
    same plans.
    """

    costs: CostModel
    budget: int | Mapping[int, int] | None = None
    granularity: Granularity = "auto"
    recompute: RecomputeMode = "never"
    # told (rank, ranks planned so far, ranks to plan) as each rank's plans under a budget
    # are made: a search that takes minutes at 64 stages can say how far it is
    progress: Callable[[int, int, int], None] | None = field(
        default=None, repr=False, compare=False)
    # told (choices made, choices to make) as the plans are chosen in the whole pipeline
    # (rank by rank: each rank once from each start; alike: each name settled; see prepare)
    choosing: Callable[[int, int], None] | None = field(default=None, repr=False,
                                                        compare=False)
    # processes that make the ranks' plans under a budget in prepare (1: this one; each
    # rank's plans depend on its own order alone, so any number gives the same plans)
    jobs: int = 1
    # choose among the ranks' plans in the whole pipeline where it can (see prepare); False:
    # each rank on its own timeline, much faster at scale (a search judging many schedules)
    whole_pipeline: bool = True
    # how the whole pipeline chooses (see prepare): turns, alike, or auto (by its size)
    pipeline_choice: PipelineChoice = "auto"

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
        if self.pipeline_choice not in PIPELINE_CHOICES:
            raise ScheduleError(
                f"unknown pipeline choice {self.pipeline_choice!r}; use one of "
                f"{', '.join(PIPELINE_CHOICES)} (turns: rank by rank among each rank's "
                "plans, alike: one plan alike on every rank, auto: turns up to "
                f"{TURNS_UP_TO} ranks x microbatches, alike beyond)")
        if self.jobs < 1:
            raise ScheduleError(f"jobs must be 1 or more processes, not {self.jobs}")

    @property
    def search(self) -> RankSearch:
        return RankSearch(self.costs, self.granularity)

    def budget_for(self, rank: int) -> int | None:
        if self.budget is None or isinstance(self.budget, int):
            return self.budget
        if rank not in self.budget:
            raise ScheduleError(f"the memory budget gives no figure for rank {rank}")
        return self.budget[rank]

    def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
               ) -> RankPlan:
        """``rank``'s plan on its own timeline (the swap pass asks the planner
        :meth:`prepare` returns instead, which may weigh it in the whole pipeline)."""
        return PeakPlanner(self).select(rank, candidates, order)

    def prepare(self, schedule: Schedule, ranks: Collection[int] | None) -> PeakPlanner:
        """The planner of one swap pass over ``ranks`` (None: all). Where the policy chooses
        what to recompute and the cost model times every stage, it finds each rank's plans
        that meet its budget and chooses among them in the whole pipeline
        (:mod:`pipeswap.schedule.policies._pipeline`): a copy's stall where another rank's
        slack absorbs it costs nothing there, a recompute on the critical path costs in
        full. The ranks choose in turn from two starts: the other ranks as given, and each
        rank over its budget planned alike on every chunk (:meth:`_alike_start`; not where
        one rank chooses, whose own order the start cannot change). That grows as ranks
        squared x microbatches; for a larger pipeline than :data:`TURNS_UP_TO` where more
        than one rank plans (or with ``pipeline_choice="alike"``) the whole pipeline instead
        takes one plan alike on every rank, fitted to each rank's budget
        (:mod:`pipeswap.schedule.policies._alike_choice`), which grows about as ranks x
        microbatches (:meth:`_alike_planner`). A cost model that times
        some stages only (a rank's own measurements) would leave the others at placeholder
        times and make every stall look absorbed: there each rank weighs its plans on its
        own timeline, in :meth:`PeakPlanner.select`."""
        stages = self.costs.stages
        timed = not stages or all(stage in stages for stage in range(schedule.num_stages))
        planning = list(range(len(schedule.orders))) if ranks is None else sorted(ranks)
        if not (timed and self.whole_pipeline and self.recompute == "auto"
                and self.budget is not None):
            return PeakPlanner(self, ranks=len(planning))
        if self.pipeline_choice == "alike" or (
                self.pipeline_choice == "auto" and len(planning) > 1
                and len(schedule.orders) * schedule.num_microbatches > TURNS_UP_TO):
            return self._alike_planner(schedule, planning)

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
        options = {rank: found for rank in planning if (found := made[rank]) is not None}
        # one rank choosing (each rank of pipeswap-train plans itself) replaces its own
        # order whatever the start: the start planned alike would only cost its search
        starts = [{}] if len(options) < 2 else [{}, self._alike_start(schedule, options)]
        chosen, step = choose(schedule, self.costs, options, starts,
                              lambda trial: trial.outcome.recompute_s, self.choosing)
        return PeakPlanner(self, {
            rank: (schedule.orders[rank],
                   replace(trial, outcome=replace(trial.outcome, step_time=step)))
            for rank, trial in chosen.items()}, len(planning))

    def _alike_planner(self, schedule: Schedule, planning: Sequence[int]) -> PeakPlanner:
        """The planner holding the fastest choice alike on every rank over its budget (each
        rank within it keeps its order as given); where no such choice keeps every rank
        within its budget, each rank plans on its own timeline instead."""
        budgets = {rank: budget for rank in planning
                   if (budget := self.budget_for(rank)) is not None
                   and not recomputed_in(schedule.orders[rank])
                   and swap_candidates(schedule.orders[rank], rank)}
        plain = simulate(schedule, self.costs, timeline=False)
        found = alike_choice(schedule, self.costs, plain, budgets, self.granularity,
                             self.choosing)
        if found is None:
            return PeakPlanner(self, ranks=len(planning))
        kept = {rank: Trial({}, {}, PlanOutcome(
            rank, peak, peak, 0.0, budgets[rank], step_time=found.step))
            for rank in budgets if (peak := plain.ranks[rank].peak_activation_bytes)
            <= budgets[rank]}
        return PeakPlanner(self, {rank: (schedule.orders[rank], trial)
                                  for rank, trial in {**kept, **found.plans}.items()},
                           len(planning))

    def options_for(self, schedule: Schedule, rank: int) -> list[Trial[PlanOutcome]] | None:
        """``rank``'s plans that meet its budget (or its one best) for the pipeline to
        choose from; None where it has no budget, nothing to swap, or recomputes already."""
        order, budget = schedule.orders[rank], self.budget_for(rank)
        candidates = swap_candidates(order, rank)
        if budget is None or not candidates or recomputed_in(order):
            return None
        return self.search.mixed(candidates, order, rank, budget, every=True)

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
        choices = [{rank: found[min(found, key=lambda mine: tuple(  # of fewer layers: nearest
            abs(m - c) for m, c in zip(mine, choice)))] for rank, found in plans.items()}
            for choice in sorted({choice for found in plans.values() for choice in found})]
        return first_fastest(schedule, self.costs, choices, plain.step_time, lambda run: all(
            run.ranks[rank].peak_activation_bytes <= (self.budget_for(rank) or 0)
            for rank in over))


@dataclass
class PeakPlanner:
    """One swap pass's planning with ``policy``: the plans :meth:`PeakPolicy.prepare` chose
    in the whole pipeline (each for the order it saw), and the ranks planned here so far,
    for the progress told. Made per pass, never shared, so the policy stays configuration."""

    policy: PeakPolicy
    decided: Mapping[int, tuple[Order, Trial[PlanOutcome]]] = field(default_factory=dict)
    ranks: int = 0  # ranks the pass plans
    done: int = 0  # ranks select has planned

    def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
               ) -> RankPlan:
        policy = self.policy
        budget = policy.budget_for(rank)
        prepared = self.decided.get(rank)  # for this order only
        if prepared is not None and prepared[0] == order:
            trial = prepared[1]
            return RankPlan(rank, trial.placements, trial.recomputed, trial.outcome,
                            chosen_in_pipeline=True)
        given = recomputed_in(order)
        if policy.recompute == "auto" and budget is not None and not given and candidates:
            (trial,) = policy.search.mixed(candidates, order, rank, budget)
            plan = RankPlan(rank, trial.placements, trial.recomputed, trial.outcome)
        else:
            placements, outcome = policy.search.plan(candidates, order, rank, budget, given)
            plan = RankPlan(rank, placements, {}, outcome)
        if policy.progress is not None and budget is not None:
            self.done += 1
            policy.progress(rank, self.done, max(self.ranks, self.done))
        return plan
