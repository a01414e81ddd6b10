"""What this rank's steps cost, for the swap plan: a cost model checked before anything
plans on it, its stages' layer counts filled in from the stages, the host link's bandwidths
measured by a short copy probe, and a step's computes timed (:class:`StepTimes`), from which
:func:`measured_costs` makes the model a later plan weighs.

The default swap policy weighs copies against compute: over a link it takes to be infinitely
fast it streams every chunk it can, and on a real one some of those copies cannot hide. So a
plan is only as good as its costs, and costs that cannot be (a bandwidth of zero, a forward
that takes no time) are refused here, naming what was wrong, rather than planned on.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pipeswap.runtime.errors import PipelineSetupError
from pipeswap.schedule import (
    COMPUTE,
    OVERLAPS,
    ChunkBytes,
    ChunkKey,
    CostModel,
    Link,
    StageCosts,
    Step,
    StepType,
)

if TYPE_CHECKING:
    from pipeswap.platform import Platform

#: What the probe copies each way, and how often (the best time counts).
PROBE_BYTES, PROBE_REPEATS = 64 << 20, 3
#: The steps a measured step times: computes, and the waits for copies (WO, WL).
TIMED = COMPUTE | OVERLAPS | {StepType.SWAP_WAIT_OFFLOAD, StepType.SWAP_WAIT_LOAD}
#: How an overlap's time is shared between its two computes: as the default costs weigh them.
_SHARES = {StepType.FWD: 1.0, StepType.BWD: 2.0, StepType.BWD_INPUT: 1.0,
           StepType.BWD_WEIGHT: 1.0}


@dataclass
class StepTimes:
    """What a measured step's computes took, by kind and stage, and how long compute waited
    for copies."""

    compute: dict[tuple[StepType, int], list[float]] = field(default_factory=dict)
    copy_wait: float = 0.0

    def record(self, step: Step, seconds: float) -> None:
        if step.type in (StepType.SWAP_WAIT_OFFLOAD, StepType.SWAP_WAIT_LOAD):
            self.copy_wait += seconds
            return
        leaves = step.compute_leaves
        weight = sum(_SHARES[leaf.type] for leaf in leaves)
        for leaf in leaves:
            assert leaf.stage is not None
            self.compute.setdefault((leaf.type, leaf.stage), []).append(
                seconds * _SHARES[leaf.type] / weight)

    def means(self) -> dict[tuple[StepType, int], float]:
        return {key: sum(times) / len(times) for key, times in self.compute.items()}


def measured_costs(compute: Mapping[tuple[StepType, int], float],
                   chunk_bytes: Mapping[ChunkKey, tuple[int, int]], link: Link,
                   layer_counts: Mapping[int, int]) -> CostModel:
    """The cost model of what was measured: each stage's mean compute times (``compute``, by
    kind and stage, as :attr:`StepReport.compute_seconds` gives them), each chunk's saved
    bytes (held, movable), the link, and each stage's layer count. A stage of
    ``layer_counts`` whose forward or backward was not timed is refused."""
    stages = {}
    for stage, layers in layer_counts.items():
        forward = compute.get((StepType.FWD, stage))
        whole = compute.get((StepType.BWD, stage))
        parts = compute.get((StepType.BWD_INPUT, stage)), compute.get(
            (StepType.BWD_WEIGHT, stage))
        backward = whole if whole is not None else (
            None if None in parts else sum(p for p in parts if p is not None))
        if forward is None or backward is None:
            raise PipelineSetupError(
                f"no measured forward and backward of stage {stage}: measure a step that "
                "runs them (step(..., measure=Measure(compute=True))) before planning on its "
                "costs")
        stages[stage] = StageCosts(forward, backward, backward_input=parts[0],
                                   backward_weight=parts[1], layers=layers)
    chunks = {key: ChunkBytes(held, pinned=held - movable)
              for key, (held, movable) in chunk_bytes.items()}
    return CostModel(link=link, stages=stages, chunks=chunks)


def measured_chunks(chunk_bytes: Mapping[ChunkKey, tuple[int, int]],
                    layer_held: Mapping[ChunkKey, Sequence[int]],
                    layer_inputs: Mapping[ChunkKey, Sequence[int]]
                    ) -> dict[ChunkKey, ChunkBytes]:
    """Each chunk as a step without swap measured it (:class:`StepReport`'s ``chunk_bytes``
    as (held, movable), and per layer what it added and was called with, where measured:
    what recomputing a layer keeps); the pinned bytes are laid on the first layers that
    hold them, as where they sit is not measured."""
    return {key: _measured(held, movable, layer_held.get(key, ()), layer_inputs.get(key, ()))
            for key, (held, movable) in chunk_bytes.items()}


def _measured(held: int, movable: int, sizes: Sequence[int], inputs: Sequence[int]
              ) -> ChunkBytes:
    if not sizes:
        return ChunkBytes(held, pinned=held - movable)
    pinned, layers = held - movable, []
    for size, called in zip(sizes, inputs):
        pin = min(pinned, size)
        pinned -= pin
        layers.append(ChunkBytes(size, pinned=pin, kept=min(called, size)))
    return ChunkBytes(held, pinned=held - movable, layers=tuple(layers))


def check_costs(costs: CostModel, stages: Iterable[int], rank: int) -> None:
    """Refuse a cost model the plan of ``rank`` (running ``stages``) cannot use: each of its
    stages' compute times and the rank's link bandwidths must be finite and above zero."""
    link = costs.rank_link(rank)
    for name, value in (("d2h_bandwidth", link.d2h_bandwidth),
                        ("h2d_bandwidth", link.h2d_bandwidth)):
        if not 0 < value < math.inf:
            raise PipelineSetupError(
                f"cost_model: rank {rank}'s link {name} must be a finite number of bytes/s "
                f"above 0, got {value}: give the link's measured bandwidth (or "
                "pipeswap.runtime.executor.measurements.probe_link's)")
    for stage in stages:
        given = costs.stage(stage)
        times: tuple[tuple[str, float | None], ...] = (
            ("forward", given.forward), ("backward", given.backward),
            ("backward_input", given.backward_input),
            ("backward_weight", given.backward_weight))
        for kind, seconds in times:
            if seconds is not None and not 0 < seconds < math.inf:
                raise PipelineSetupError(
                    f"cost_model: stage {stage}'s {kind} time must be a finite number of "
                    f"seconds above 0, got {seconds}")


def with_layer_counts(costs: CostModel, layer_counts: Mapping[int, int]) -> CostModel:
    """``costs`` with each stage of ``layer_counts`` given its layer count where the model
    says none of its own (a streamed chunk moves one of its stage's layers at a time)."""
    stages = dict(costs.stages)
    for stage, count in layer_counts.items():
        given = costs.stages.get(stage)
        if given is None:
            stages[stage] = StageCosts(costs.forward, costs.backward, layers=count)
        elif given.layers is None:
            stages[stage] = replace(given, layers=count)
    return replace(costs, stages=stages)


def probe_link(platform: Platform, nbytes: int = PROBE_BYTES,
               repeats: int = PROBE_REPEATS) -> Link:
    """The host link of ``platform``'s device, measured: the best of ``repeats`` copies of
    ``nbytes`` each way on a copy stream, and whether the two ways run at once (duplex:
    both together take little longer than the slower alone). The copies wait for the work
    queued on the compute stream before the probe."""
    import torch

    device = torch.empty(nbytes, dtype=torch.uint8, device=platform.device)
    host = platform.host_buffer(nbytes)
    streams = platform.new_stream(), platform.new_stream()
    # The buffer was allocated on the compute stream, maybe in memory its queued kernels
    # still use: the copy streams start after them.
    allocated = platform.new_event()
    allocated.record(platform.current_stream())
    for stream in streams:
        allocated.wait(stream)

    def best(*copies: tuple[torch.Tensor, torch.Tensor]) -> float:
        fastest = math.inf
        for _ in range(repeats):
            for stream in streams:
                stream.synchronize()
            start = time.perf_counter()
            for (dst, src), stream in zip(copies, streams):
                with platform.stream(stream):
                    platform.copy_(dst, src)
            for stream in streams:
                stream.synchronize()
            fastest = min(fastest, time.perf_counter() - start)
        return max(fastest, 1e-9)

    spare = platform.host_buffer(nbytes)
    down, up = best((host, device)), best((device, host))
    both = best((spare, device), (device, host))
    return Link(nbytes / down, nbytes / up, duplex=both < 0.75 * (down + up))
