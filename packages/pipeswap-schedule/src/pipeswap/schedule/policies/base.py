"""What a swap policy is: the chunks the swap pass offers it and what it may decide, the
options the planning policies share, and the plain gap rule."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol, get_args, runtime_checkable

from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.steps import ChunkKey, Order, StepType
from pipeswap.schedule.swap_plan import RankPlan, SwapCandidate, SwapPlacement

if TYPE_CHECKING:
    from pipeswap.schedule.schedule import Schedule

#: The fewest compute slots between a forward and its backward that leave room for
#: WO (after the first slot in between) to come before LL (before the last one).
MIN_FEASIBLE_GAP = 3

#: How the peak policy may swap a chunk. chunk: whole (LO/LL); layer: streamed layer by
#: layer (SO/SL); auto: whichever lowers the peak more, chunk by chunk.
Granularity = Literal["auto", "chunk", "layer"]
GRANULARITIES: tuple[Granularity, ...] = get_args(Granularity)
#: Whether the peak policy may recompute layers under a budget. auto: where that is faster
#: than a stalled copy; never: swap only.
RecomputeMode = Literal["auto", "never"]
RECOMPUTE_MODES: tuple[RecomputeMode, ...] = get_args(RecomputeMode)
#: How the peak policy chooses the ranks' plans in the whole pipeline. turns: rank by rank,
#: each among its own plans (a search that grows as ranks squared x microbatches); alike:
#: one plan alike on every chunk of every rank, fitted to each rank's budget (grows about
#: as ranks x microbatches); auto: turns for a small pipeline, alike for a large one.
PipelineChoice = Literal["auto", "turns", "alike"]
PIPELINE_CHOICES: tuple[PipelineChoice, ...] = get_args(PipelineChoice)

#: What a policy decides for one rank: the chunks to swap (each placed as
#: :data:`~pipeswap.schedule.swap_plan.DEFAULT_PLACEMENT`), a placement for each, or the
#: rank's whole plan (recomputed layers and what the policy expects of it included).
Selection = Collection[ChunkKey] | Mapping[ChunkKey, SwapPlacement] | RankPlan


class SwapPolicy(Protocol):
    """Chooses which candidate chunks of ``rank`` get swapped; ``order`` is that rank's order
    before swap injection (for policies that weigh costs or memory)."""

    def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
               ) -> Selection:
        ...


@runtime_checkable
class PreparingPolicy(SwapPolicy, Protocol):
    """A swap policy that looks at the whole schedule before it plans any rank: the swap
    pass calls :meth:`prepare` once, with the schedule it is given and the ranks it plans
    (None: every rank), and asks the planner returned (which holds what one pass learns)
    for each rank's plan instead of the policy."""

    def prepare(self, schedule: Schedule, ranks: Collection[int] | None) -> SwapPolicy:
        ...


@dataclass(frozen=True)
class MinGapPolicy:
    """Swap every chunk whose backward is at least ``min_gap`` compute slots after its forward.

    ``min_gap=4`` is MindSpore hyper-parallel's rule: three computes in between leave one to
    hide the offload, one to hide the reload and one to spare.
    """

    min_gap: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.min_gap, bool) or not isinstance(self.min_gap, int) or (
            self.min_gap < MIN_FEASIBLE_GAP
        ):
            raise ScheduleError(
                f"min_gap must be an integer >= {MIN_FEASIBLE_GAP} (the offload wait needs a "
                f"compute before the reload launch), got {self.min_gap!r}"
            )

    def select(self, rank: int, candidates: Sequence[SwapCandidate], order: Order
               ) -> Collection[ChunkKey]:
        return {c.key for c in candidates if c.gap >= self.min_gap}


def refuse_recompute(order: Order, policy: str) -> None:
    """A policy that plans on whole chunks' bytes cannot plan an order that recomputes."""
    step = next((step for step in order
                 if step is not None and step.type is StepType.RECOMPUTE), None)
    if step is not None:
        raise ScheduleError(f"the order recomputes layers ({step}), but the {policy} policy "
                            "plans on whole chunks' bytes: use the peak policy, which plans "
                            "around recompute")
