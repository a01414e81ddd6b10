"""What the swap pass decides, as values: the chunks a rank may swap, where a swapped chunk's
copies go, and the plan of every rank with what its policy expected of it.

A leaf module: the policies make these values and the pass places them
(:mod:`pipeswap.schedule.swap_order`), and neither is imported here, so the two never import
each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from pipeswap.schedule.steps import ChunkKey


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
    (see :mod:`pipeswap.schedule.swap_order`), and the slots then bound what the forward's
    last layers and the backward's last layer have to hide their copies behind. A streamed
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


@dataclass(frozen=True)
class PlanOutcome:
    """What a policy expected of one rank's plan, on that rank's own timeline; its step too
    where the policy simulated the plan (under a budget): the rank's own timeline's, or the
    whole pipeline's where the plan was chosen there."""

    rank: int
    peak: int  # bytes of saved activations at the rank's highest point, with the plan
    peak_no_swap: int  # the same with neither swap nor recompute
    exposed_copy: float  # compute time the chosen copies stall (0 unless a budget needed it)
    budget: int | None = None
    recomputed_layers: int = 0  # layer forwards the rank's backwards run again
    recompute_s: float = 0.0  # the compute seconds they take
    step_time: float | None = None  # seconds of the step the policy simulated, if it did

    @property
    def met(self) -> bool:
        return self.budget is None or self.peak <= self.budget

    @property
    def shortfall(self) -> int:
        """Bytes by which the peak stays over the budget (0 when met or without one)."""
        return 0 if self.budget is None else max(0, self.peak - self.budget)


@dataclass(frozen=True)
class RankPlan:
    """One rank's plan: the chunks it swaps (``placements``; whole where the layer lag is 0,
    else streamed), the layers it recomputes per chunk, and what its policy expected
    (``outcome``; None where the policy says nothing of it). ``chosen_in_pipeline``: the
    plan was chosen among the rank's plans by the whole pipeline's step, not on the rank's
    own timeline. ``gather_reloads``: the policy chose chunks without placing them, so a
    reload on an FSDP stage goes with the stage's last parameter gather
    (:mod:`pipeswap.schedule.swap_order`)."""

    rank: int
    placements: Mapping[ChunkKey, SwapPlacement] = field(default_factory=dict)
    recomputed: Mapping[ChunkKey, tuple[int, ...]] = field(default_factory=dict)
    outcome: PlanOutcome | None = None
    chosen_in_pipeline: bool = False
    gather_reloads: bool = False

    @property
    def whole(self) -> dict[ChunkKey, SwapPlacement]:
        """The chunks swapped whole."""
        return {key: p for key, p in self.placements.items() if not p.streaming}

    @property
    def streamed(self) -> dict[ChunkKey, SwapPlacement]:
        """The chunks streamed layer by layer."""
        return {key: p for key, p in self.placements.items() if p.streaming}


@dataclass(frozen=True)
class SwapPlan:
    """What the swap pass decided: the plan of each rank it planned (the others keep their
    orders)."""

    ranks: Mapping[int, RankPlan]

    def outcome(self, rank: int) -> PlanOutcome | None:
        """What the policy expected of ``rank`` (None where it was not planned, or its
        policy says nothing)."""
        found = self.ranks.get(rank)
        return None if found is None else found.outcome
