"""One rank's own timeline in compute slots, which the cost-aware policies plan on.

Compute slots run back to back, with no waits for other ranks: waits only add room for
copies, so what hides here hides in the full simulation too. The swap pass places a whole
chunk's steps so that, with one slot for each copy, the chunk is off the device from the
second slot after its forward to the second slot before its backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.steps import COMPUTE, OVERLAPS, ChunkKey, Order, StepType
from pipeswap.schedule.swap_plan import SwapCandidate

#: Fewest compute slots from forward to backward for a chunk swapped with one slot per copy
#: to leave the device.
SAVING_GAP = 4
#: The most compute slots a :class:`SwapPlacement` gives one copy, at layer resolution and in
#: the chunk-level plan alike.
MAX_COPY_SLOTS = 3


@dataclass(frozen=True)
class Timeline:
    """One rank's compute slots back to back: slot i runs from ``starts[i]`` to ``ends[i]``."""

    starts: tuple[float, ...]
    ends: tuple[float, ...]
    last_slot: dict[ChunkKey, int]  # the slot whose end frees the chunk (its B or W)

    @staticmethod
    def of(order: Order, costs: CostModel, rank: int) -> Timeline:
        starts: list[float] = []
        ends: list[float] = []
        last: dict[ChunkKey, int] = {}
        times: dict[tuple[StepType, int], float] = {}  # a stage's costs, asked once
        now = 0.0
        for step in order:
            if step is None or not (step.type in COMPUTE or step.type in OVERLAPS):
                continue
            starts.append(now)
            for leaf in step.sub_steps or (step,):
                kind, stage = leaf.type, leaf.stage
                assert stage is not None  # a compute leaf
                took = times.get((kind, stage))
                if took is None:
                    took = times[kind, stage] = costs.compute_time(kind, stage, rank)
                now += took
                if kind is not StepType.FWD:
                    last[stage, leaf.micro] = len(starts) - 1  # type: ignore[index]
            ends.append(now)
        return Timeline(tuple(starts), tuple(ends), last)

    def held(self, candidates: Sequence[SwapCandidate], costs: CostModel) -> list[int]:
        """Bytes of saved activations the rank holds in each slot without swap: a chunk from
        its forward's slot through the slot that frees it."""
        held = [0] * (len(self.ends) + 1)  # a difference array over slots, then prefix sums
        per_stage: dict[int, int] = {}
        for c in candidates:
            key = c.key
            total = per_stage.get(key[0]) if key not in costs.chunks else None
            if total is None:
                total = costs.chunk_bytes(key).total
                if key not in costs.chunks:
                    per_stage[key[0]] = total
            held[c.forward_slot] += total
            held[self.last_slot.get(key, c.backward_slot) + 1] -= total
        return list(accumulate(held[:-1]))


def copy_times(costs: CostModel, rank: int, key: ChunkKey) -> tuple[float, float]:
    """How long the chunk's offload and its reload take on the rank's host link."""
    link = costs.rank_link(rank)
    movable = costs.chunk_bytes(key).movable
    return movable / link.d2h_bandwidth, movable / link.h2d_bandwidth
