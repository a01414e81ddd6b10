"""The peak policy at slot resolution: which whole chunks to swap, and with how many compute
slots for each copy.

A plan holds the chunks taken on one rank and what the rank holds in each compute slot with
them; it takes, one at a time, the chunk that best lowers the highest slot with copies that
hide (or, for a budget, that stall least), then drops what lowers nothing. The layer
resolution plan (:mod:`pipeswap.schedule.policies._layer_plan`) refines the same loop.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.policies._slots import MAX_COPY_SLOTS, Timeline, copy_times
from pipeswap.schedule.policies.base import SwapCandidate, SwapPlacement
from pipeswap.schedule.steps import ChunkKey

#: Placements to try, tightest first; zero slots (compute waits for the whole copy) only
#: where a budget allows exposed copies.
_PLACEMENTS = tuple(SwapPlacement(off, load) for off, load in sorted(
    ((off, load) for off in range(MAX_COPY_SLOTS + 1) for load in range(MAX_COPY_SLOTS + 1)),
    key=lambda p: (sum(p), p)))


class ChunkPlan:
    """The chunks a :class:`PeakPolicy` has taken on one rank, and what the rank holds in
    each compute slot with them."""

    def __init__(self, costs: CostModel, rank: int, line: Timeline,
                 candidates: Sequence[SwapCandidate]) -> None:
        self.costs, self.rank, self.line = costs, rank, line
        self.duplex = costs.rank_link(rank).duplex
        self.candidates = [c for c in candidates if c.gap >= 2]  # off the device a slot
        self.chosen: dict[ChunkKey, SwapPlacement] = {}
        self.by_key = {c.key: c for c in self.candidates}
        self.held = line.held(candidates, costs)

    def off_slots(self, c: SwapCandidate, placement: SwapPlacement) -> range:
        """The slots during which ``c`` is off the device when placed so."""
        return range(c.forward_slot + placement.offload_slots + 1,
                     c.backward_slot - placement.load_slots)

    def _shift(self, key: ChunkKey, placement: SwapPlacement, sign: int) -> None:
        movable = self.costs.chunk_bytes(key).movable
        for slot in self.off_slots(self.by_key[key], placement):
            self.held[slot] -= sign * movable

    def copies(self, extra: tuple[ChunkKey, SwapPlacement] | None = None
               ) -> list[tuple[float, float, float, str]]:
        """(earliest start, duration, deadline, stream) of every chosen copy."""
        chosen = dict(self.chosen)
        if extra is not None:
            chosen[extra[0]] = extra[1]
        line, out = self.line, []
        for key, (off, load, _) in chosen.items():
            c = self.by_key[key]
            d2h, h2d = copy_times(self.costs, self.rank, key)
            out.append((line.ends[c.forward_slot], d2h, line.ends[c.forward_slot + off],
                        "d2h" if self.duplex else "copy"))
            out.append((line.starts[c.backward_slot - load], h2d,
                        line.starts[c.backward_slot], "h2d" if self.duplex else "copy"))
        return out

    @staticmethod
    def stall(copies: list[tuple[float, float, float, str]]) -> float:
        """Compute time the copies hold up: each stream runs its copies in order of start,
        and a copy ending after its deadline stalls compute by the difference."""
        free: dict[str, float] = {}
        total = 0.0
        for start, duration, deadline, stream in sorted(copies):
            end = max(start, free.get(stream, 0.0)) + duration
            total += max(0.0, end - deadline)
            free[stream] = end
        return total

    def lower(self, budget: int | None, *, allow_stall: bool) -> None:
        """Take chunks (or, with ``allow_stall``, widen a taken chunk's time off the device)
        while the peak can be lowered: without stalls as far as it goes, with them until it
        is within ``budget``."""
        while self.held:
            peak = max(self.held)
            if allow_stall and budget is not None and peak <= budget:
                return
            top = [slot for slot, value in enumerate(self.held) if value == peak]
            best: tuple[tuple[float, int, int, int], ChunkKey, SwapPlacement] | None = None
            base = self.stall(self.copies())
            for c in self.candidates:
                if not c.forward_slot < top[0] < c.backward_slot:
                    continue
                now = self.chosen.get(c.key)
                if now is not None and (not allow_stall or top[0] in self.off_slots(c, now)):
                    continue
                for placement in _PLACEMENTS:
                    if not allow_stall and min(placement.offload_slots, placement.load_slots) == 0:
                        continue
                    span = self.off_slots(c, placement)
                    if top[0] not in span or (now is not None and not (
                            set(self.off_slots(c, now)) <= set(span))):
                        continue
                    added = self.stall(self.copies((c.key, placement))) - base
                    if added > 0 and not allow_stall:
                        continue
                    covered = sum(slot in span for slot in top)
                    order = (added, -covered, -self.costs.chunk_bytes(c.key).movable,
                             sum(placement))
                    if best is None or order < best[0]:
                        best = (order, c.key, placement)
                    if not allow_stall:
                        break  # the tightest placement of this chunk that hides
            if best is None:
                return
            _, key, placement = best
            if key in self.chosen:
                self._shift(key, self.chosen[key], -1)
            self.chosen[key] = placement
            self._shift(key, placement, +1)

    def prune(self) -> None:
        """Drop, latest taken first, each chunk whose removal leaves the peak as it is."""
        for key in reversed(list(self.chosen)):
            peak = max(self.held)
            placement = self.chosen.pop(key)
            self._shift(key, placement, -1)
            if max(self.held) > peak:  # it was lowering the peak: keep it
                self.chosen[key] = placement
                self._shift(key, placement, +1)
