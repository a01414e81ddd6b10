"""What a swap policy is: the chunks the swap pass offers it, the placement it may return,
and the plain gap rule.

A leaf module: the swap pass (:mod:`pipeswap.schedule.swap`) and every planner import it, and
it imports neither, so the pass and the policies never import each other.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.steps import ChunkKey, Order, StepType

if TYPE_CHECKING:
    from pipeswap.schedule.schedule import Schedule

#: The fewest compute slots between a forward and its backward that leave room for
#: WO (after the first slot in between) to come before LL (before the last one).
MIN_FEASIBLE_GAP = 3


class SwapCandidate(NamedTuple):
    """A chunk whose forward and activation-consuming backward both run on ``rank``.

    Slots are compute-slot indices in the rank's order; ``gap`` is how many slots the
    backward comes after the forward. (An immutable record; a NamedTuple because a big
    schedule has one per chunk and these build several times faster than a dataclass.)
    """

    rank: int
    stage: int
    micro: int
    forward_slot: int
    backward_slot: int

    @property
    def key(self) -> ChunkKey:
        return (self.stage, self.micro)

    @property
    def gap(self) -> int:
        return self.backward_slot - self.forward_slot


class SwapPlacement(NamedTuple):
    """Where a swapped chunk's waits go, in compute slots: the offload copy runs during the
    ``offload_slots`` computes after the forward (``WO`` follows the last of them), the
    reload during the ``load_slots`` computes before the backward (``LL`` precedes the
    first). More slots hide a longer copy and keep the chunk on the device longer; zero
    slots frees (or loads) the chunk right at its compute, and compute waits for the whole
    copy. ``layer_lag`` 0 swaps the chunk whole; from 1 it streams the chunk layer by layer
    (see :mod:`pipeswap.schedule.swap`), and the slots then bound what the forward's last
    layers and the backward's last layer have to hide their copies behind. A streamed
    chunk's ``load_depth`` says how many layers ahead of its backward its loads run (SL's
    lag): each load hides behind that many layers' backward, at the cost of one more layer
    resident for each beyond the first; a chunk swapped whole ignores it."""

    offload_slots: int = 1
    load_slots: int = 1
    layer_lag: int = 0
    load_depth: int = 1

    @property
    def streaming(self) -> bool:
        return self.layer_lag > 0


#: MindSpore hyper-parallel's placement: one compute to hide each copy.
DEFAULT_PLACEMENT = SwapPlacement()


class SwapPolicy(Protocol):
    """Chooses which candidate chunks of one rank get swapped; ``order`` is that rank's order
    before swap injection (for policies that weigh costs or memory). A policy returns the
    chunks (placed as :data:`DEFAULT_PLACEMENT`) or a placement for each."""

    def select(self, candidates: Sequence[SwapCandidate], order: Order
               ) -> Collection[ChunkKey] | Mapping[ChunkKey, SwapPlacement]:
        ...


@runtime_checkable
class RecomputingPolicy(SwapPolicy, Protocol):
    """A swap policy that may also choose layers to recompute: after :meth:`select` on a
    rank, :meth:`recomputed` gives them per chunk, and the swap pass adds their RC steps."""

    def recomputed(self, rank: int) -> Mapping[ChunkKey, tuple[int, ...]]:
        ...


@runtime_checkable
class PreparingPolicy(SwapPolicy, Protocol):
    """A swap policy that looks at the whole schedule before it plans any rank: the swap
    pass calls :meth:`prepare` once, with the schedule it is given and, where it plans only
    some ranks, ``ranks=`` those (a ``prepare(schedule)`` of one argument serves a pass over
    every rank)."""

    def prepare(self, schedule: Schedule, ranks: Collection[int] | None = None) -> None:
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

    def select(self, candidates: Sequence[SwapCandidate], order: Order) -> Collection[ChunkKey]:
        return {c.key for c in candidates if c.gap >= self.min_gap}


def refuse_recompute(order: Order, policy: str) -> None:
    """A policy that plans on whole chunks' bytes cannot plan an order that recomputes."""
    step = next((step for step in order
                 if step is not None and step.type is StepType.RECOMPUTE), None)
    if step is not None:
        raise ScheduleError(f"the order recomputes layers ({step}), but the {policy} policy "
                            "plans on whole chunks' bytes: use the peak policy, which plans "
                            "around recompute")
