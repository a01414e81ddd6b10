"""One rank's own timeline at layer resolution: points, and what a chunk holds at each.

A streamed chunk's memory changes inside its forward and backward, so the layer-resolution
plan follows the rank (compute back to back, as the slot timeline does) point by point: each
forward and backward is cut at its layers' boundaries, where the simulator takes its peaks.
What a chunk holds at each point follows from its choice (:class:`Choice`): whole or
streamed, its layer lag and its slots. A chunk with recomputed layers (:class:`Redo`) holds
what its forward kept, its backward runs each recomputed layer's forward share again, and
what that makes counts at the layer's own point, as the simulator counts it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from pipeswap.schedule.costs import ChunkBytes, CostModel
from pipeswap.schedule.steps import COMPUTE, OVERLAPS, ChunkKey, Order, StepType
from pipeswap.schedule.swap_plan import SwapCandidate, SwapPlacement


class Choice(NamedTuple):
    """How a taken chunk is swapped: streamed (lag >= 1) or whole (lag 0), and its slots."""

    lag: int
    offload_slots: int
    load_slots: int

    @property
    def placement(self) -> SwapPlacement:
        return SwapPlacement(self.offload_slots, self.load_slots, self.lag)


class Redo(NamedTuple):
    """A chunk's recomputed layers as a plan sees them: how many, and per layer what its
    recompute makes again (0 for a layer not recomputed)."""

    layers: int
    remade: tuple[int, ...]


@dataclass(frozen=True)
class LayerChunk:
    """A candidate chunk on the point timeline."""

    key: ChunkKey
    forward_slot: int
    backward_slot: int
    layers: tuple[ChunkBytes, ...]
    forward_points: int  # the first of its forward's points, one per layer
    backward_points: int  # the first of its B's (or I's) points, one per layer, last layer first
    weight_point: int | None  # its W's point, when its backward is split
    end: int  # one past its last point
    total: int
    pinned: int
    after_input: int
    remade: tuple[int, ...]  # per layer, held during its backward part (recompute)

    @property
    def gap(self) -> int:
        return self.backward_slot - self.forward_slot


class Points:
    """One rank's compute slots back to back, each cut into points: a forward's at the end
    of each layer, a backward's at the start of each layer (the last first), a W's one.
    ``costs`` gives recomputed chunks' kept bytes (:meth:`CostModel.with_recomputed`),
    ``redo`` their recomputes."""

    def __init__(self, order: Order, costs: CostModel, rank: int,
                 redo: Mapping[ChunkKey, Redo] | None = None) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.first: list[int] = []  # slot -> its first point
        self.slot_of: list[int] = []  # point -> its slot
        self.times: list[float] = []  # point -> its time
        self.forward: dict[ChunkKey, int] = {}  # key -> first point of its forward
        self.backward: dict[ChunkKey, int] = {}  # key -> first point of its B or I
        self.weight: dict[ChunkKey, int] = {}  # key -> its W's point
        self.layers: dict[ChunkKey, tuple[ChunkBytes, ...]] = {}
        self.redo = redo or {}
        split = {step.key for step in order if step is not None
                 and step.type is StepType.BWD_WEIGHT} if redo else set()
        now = 0.0
        for step in order:
            if step is None or not (step.type in COMPUTE or step.type in OVERLAPS):
                continue
            slot = len(self.starts)
            self.starts.append(now)
            self.first.append(len(self.times))
            for leaf in step.compute_leaves:
                duration = costs.compute_time(leaf.type, leaf.key[0], rank)
                again = self.redo.get(leaf.key)
                if again is not None and leaf.type is not StepType.FWD:
                    duration = _with_recompute(costs, leaf.type, leaf.key, rank, again,
                                               leaf.key in split, duration)
                self._leaf(leaf.type, leaf.key, slot, now, duration, costs)
                now += duration
            self.ends.append(now)
        self.first.append(len(self.times))

    def _leaf(self, kind: StepType, key: ChunkKey, slot: int, start: float, duration: float,
              costs: CostModel) -> None:
        if kind is StepType.BWD_WEIGHT:
            self.weight[key] = len(self.times)
            self._add(slot, start)
            return
        layers = self.layers.get(key)
        if layers is None:
            layers = self.layers[key] = costs.layer_bytes(key)
        part = duration / len(layers)
        forward = kind is StepType.FWD
        (self.forward if forward else self.backward)[key] = len(self.times)
        for k in range(len(layers)):  # a forward's layer ends; a backward's layer starts
            self._add(slot, start + part * (k + 1 if forward else k))

    def _add(self, slot: int, time: float) -> None:
        self.slot_of.append(slot)
        self.times.append(time)

    def chunk(self, c: SwapCandidate) -> LayerChunk:
        key = c.key
        layers, backward = self.layers[key], self.backward[key]
        weight = self.weight.get(key)  # a W comes after its I
        last = backward + len(layers) - 1 if weight is None else weight
        redo = self.redo.get(key)
        return LayerChunk(key, c.forward_slot, c.backward_slot, layers, self.forward[key],
                          backward, weight, last + 1, sum(x.total for x in layers),
                          sum(x.pinned for x in layers),
                          sum(x.held_after_input for x in layers),
                          redo.remade if redo is not None else (0,) * len(layers))


def _with_recompute(costs: CostModel, kind: StepType, key: ChunkKey, rank: int, redo: Redo,
                    split: bool, duration: float) -> float:
    """A backward leaf's time with ``redo``'s layers recomputed, as the simulator counts it:
    B or I runs each one's forward share again (a split I also its W share), W is shorter
    by those W shares."""
    layers = len(redo.remade)
    w_share = costs.compute_time(StepType.BWD_WEIGHT, key[0], rank) / layers
    if kind is StepType.BWD_WEIGHT:
        return max(0.0, duration - w_share * redo.layers)
    forward = costs.compute_time(StepType.FWD, key[0], rank) / layers
    return duration + (forward + (w_share if split else 0.0)) * redo.layers


#: What a chunk holds over its points, as runs: (offset from its first point, bytes held
#: from there to the next run's offset, or to its last point).
Runs = list[tuple[int, int]]


def runs(points: Points, c: LayerChunk, choice: Choice | None) -> Runs:
    """What ``c`` holds at each of its points, from its forward's first to its last, when
    swapped as ``choice`` says (None: not swapped), counted as the simulator counts."""
    layers, base = c.layers, c.forward_points
    out = list(enumerate(_forward_values(layers, choice)))
    start, stop = base + len(layers), c.backward_points
    if choice is None:
        out.append((start - base, c.total))
    else:  # held until WO (after slot f + offload slots), pinned until the load starts
        first = points.first
        held = min(max(first[c.forward_slot + choice.offload_slots + 1], start), stop)
        loading = min(max(first[c.backward_slot - choice.load_slots], held), stop)
        lag = choice.lag
        tail = c.total if not lag else c.pinned + sum(x.movable for x in layers[-lag:])
        loaded = c.total if not lag else c.pinned + layers[-1].movable
        out += [(start - base, tail), (held - base, c.pinned), (loading - base, loaded)]
    out += [(stop - base + k, value) for k, value in enumerate(_backward_values(c, choice))]
    if c.weight_point is not None:
        out.append((stop - base + len(layers), c.after_input))
    # runs of no points (a span the placement leaves empty) go
    return [run for run, after in zip(out, [*out[1:], (c.end - base, 0)])
            if after[0] > run[0]]


def changes(old: Runs, new: Runs, length: int) -> list[tuple[int, int, int]]:
    """Where ``new`` holds other than ``old`` (both runs of one chunk, over ``length``
    points): (start, stop, change) offsets."""
    bounds = sorted({offset for offset, _ in old} | {offset for offset, _ in new})
    out: list[tuple[int, int, int]] = []
    i = j = before = after = 0
    for at, offset in enumerate(bounds):
        while i < len(old) and old[i][0] <= offset:
            before = old[i][1]
            i += 1
        while j < len(new) and new[j][0] <= offset:
            after = new[j][1]
            j += 1
        if after != before:
            stop = bounds[at + 1] if at + 1 < len(bounds) else length
            if out and out[-1][1] == offset and out[-1][2] == after - before:
                out[-1] = (out[-1][0], stop, after - before)
            else:
                out.append((offset, stop, after - before))
    return out


def lowest(options: list[Runs]) -> Runs:
    """At every point the least of what ``options`` (runs of one chunk) hold there."""
    bounds = sorted({offset for runs in options for offset, _ in runs})
    at = [0] * len(options)
    values = [0] * len(options)
    out: Runs = []
    for offset in bounds:
        for k, runs in enumerate(options):
            while at[k] < len(runs) and runs[at[k]][0] <= offset:
                values[k] = runs[at[k]][1]
                at[k] += 1
        out.append((offset, min(values)))
    return out


def _forward_values(layers: tuple[ChunkBytes, ...], choice: Choice | None) -> list[int]:
    """At the end of each layer of the forward (a whole chunk counts at its end)."""
    if choice is None or not choice.lag:
        return [0] * (len(layers) - 1) + [sum(layer.total for layer in layers)]
    held, out = 0, []
    for k, layer in enumerate(layers):
        held += layer.total
        out.append(held)  # the peak, before the layer a lag back leaves
        if k >= choice.lag:
            held -= layers[k - choice.lag].movable
    return out


def _backward_values(c: LayerChunk, choice: Choice | None) -> list[int]:
    """At the start of each layer of the backward, the last layer first."""
    layers, remade = c.layers, c.remade
    keeps = c.weight_point is not None
    if choice is None or not choice.lag:
        return [c.total + remade[k] for k in reversed(range(len(layers)))]
    out = []
    for k in reversed(range(len(layers))):
        # B frees each layer as it goes; a split I keeps them all until it ends
        held = sum((layer.total if keeps else 0) for layer in layers[k + 1:])
        held += sum(layer.pinned for layer in layers[:k + 1]) + layers[k].movable
        out.append(held + (layers[k - 1].movable if k >= 1 else 0) + remade[k])
    return out
