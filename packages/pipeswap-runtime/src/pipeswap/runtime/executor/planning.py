"""Where the runtime makes the policy its swap plan comes from: the one place.

The executor's default (the peak policy on this rank's stages' layer counts, or on a cost
model given), the policy ``pipeswap-train --policy`` names, and the peak policy under a byte
budget planned on what a step without swap measured (each chunk's bytes, per layer: what
recomputing a layer keeps). ``pipeswap-train`` and the drop-in schedule classes measure the
same way (:data:`MEASURE_TO_PLAN`, with activations counted) and plan here on the same
:class:`Measured`.

The runtime knows no chunk's bytes or compute times before it runs, so a plan rests on a
uniform cost model (layers alike, a backward twice a forward) unless a step measured them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, TypeVar

from pipeswap.runtime.errors import PipelineSetupError
from pipeswap.runtime.executor.measurements import check_costs, measured_chunks, with_layer_counts
from pipeswap.runtime.executor.options import Measure, SwapOptions
from pipeswap.schedule import (
    ChunkKey,
    CostModel,
    CostModelPolicy,
    Granularity,
    MinGapPolicy,
    PeakPolicy,
    RecomputeMode,
    ScheduleError,
    SwapPolicy,
    default_swap_policy,
    uniform_layers,
)

if TYPE_CHECKING:
    from pipeswap.runtime.executor.step_report import StepReport

__all__ = ["MEASURE_TO_PLAN", "Measured", "TrainPolicy", "VaryingChunks", "budget_policy",
           "executor_policy", "named_policy", "named_swap"]

#: The policies ``pipeswap-train --policy`` names: MindSpore hyper-parallel's gap rule,
#: every chunk whose copies hide, or the peak policy.
TrainPolicy = Literal["gap", "cost", "peak"]

#: What a step measures for a plan under a budget to rest on: each chunk held whole, layer
#: by layer (with the executor counting activations).
MEASURE_TO_PLAN = Measure(layers=True)


@dataclass(frozen=True)
class Measured:
    """What a step without swap measured of this rank's chunks: each one's bytes (held,
    movable), and per layer what it added and was called with."""

    chunk_bytes: Mapping[ChunkKey, tuple[int, int]]
    layer_held: Mapping[ChunkKey, tuple[int, ...]]
    layer_inputs: Mapping[ChunkKey, tuple[int, ...]]

    @classmethod
    def of(cls, report: StepReport) -> Measured:
        return cls({key: (found.held, found.movable)
                    for key, found in report.chunk_bytes.items()},
                   dict(report.layer_held), dict(report.layer_inputs))

    def at_largest(self) -> tuple[Measured, tuple[VaryingChunks, ...]]:
        """The chunks sized for a plan, and the stages whose chunks differed by microbatch.

        A chunk's activations can depend on the data: mixture-of-experts routing sends each
        microbatch's tokens to the experts in other numbers, and each expert saves what it
        got, so one step's sizes say little of the next step's. Where a stage's chunks'
        movable bytes differ so, each chunk is sized as the stage's largest (its bytes, per
        layer too), so that the plan holds the budget wherever later routing stays within
        what the measured step saw. Pinned bytes alone may differ between a model's
        microbatches (a storage they share counts in whichever chunk held it first): that
        changes nothing."""
        like: dict[ChunkKey, ChunkKey] = {}
        varying: list[VaryingChunks] = []
        for stage in sorted({key[0] for key in self.chunk_bytes}):
            movable = {key: found[1] for key, found in self.chunk_bytes.items()
                       if key[0] == stage}
            if len(set(movable.values())) == 1:
                continue
            top = max(sorted(movable), key=movable.__getitem__)
            varying.append(VaryingChunks(stage, min(movable.values()), movable[top]))
            like.update({key: top for key, size in movable.items() if size < movable[top]})
        return (Measured(_sized(self.chunk_bytes, like), _sized(self.layer_held, like),
                         _sized(self.layer_inputs, like)), tuple(varying))


Found = TypeVar("Found")


def _sized(found: Mapping[ChunkKey, Found], like: Mapping[ChunkKey, ChunkKey]
           ) -> dict[ChunkKey, Found]:
    """``found`` with each chunk given the figures of the chunk ``like`` sizes it as."""
    return {key: found[like.get(key, key)] for key in found if like.get(key, key) in found}


@dataclass(frozen=True)
class VaryingChunks:
    """A stage whose chunks measured different bytes in different microbatches: the
    smallest and the largest (which a budget's plan sizes them all as)."""

    stage: int
    smallest: int  # movable bytes of a chunk
    largest: int

    def describe(self, rank: int) -> str:
        return (f"rank {rank}: stage {self.stage}'s chunks measured {self.smallest:,} to "
                f"{self.largest:,} bytes by microbatch (mixture-of-experts routing, or "
                "microbatches of unequal sizes): the budget's plan sizes every microbatch of "
                "the stage as the largest, so a later step peaks above the plan only where "
                "its data asks for more than the measured step's")


def executor_policy(swap: SwapOptions, layer_counts: Mapping[int, int], rank: int
                    ) -> SwapPolicy:
    """The policy the executor plans this rank's swap with: the one ``swap`` gives, or the
    default, the peak policy on ``swap.costs`` (checked first) or on the stages' layer
    counts alone."""
    if swap.policy is not None:
        if swap.granularity != "auto" or swap.costs is not None:
            raise PipelineSetupError(
                f"{'granularity' if swap.costs is None else 'costs'} in SwapOptions applies "
                "to the default policy; a policy of your own chooses each chunk's granularity "
                "and weighs its own costs")
        return swap.policy
    try:
        if swap.costs is None:
            default = default_swap_policy(layer_counts, swap.granularity)
        else:
            check_costs(swap.costs, layer_counts, rank)
            default = PeakPolicy(with_layer_counts(swap.costs, layer_counts),
                                 granularity=swap.granularity)
    except ScheduleError as exc:
        raise PipelineSetupError(str(exc)) from exc
    return default


def named_policy(name: TrainPolicy, layer_counts: Mapping[int, int] | None = None,
                 granularity: Granularity = "auto"
                 ) -> SwapPolicy | None:
    """The swap policy ``name`` says: ``gap`` (MindSpore hyper-parallel's rule), ``cost``
    (every chunk whose copies hide) or ``peak``, which needs each stage's layer count
    (``layer_counts``; None leaves the executor's default, which asks the stages)."""
    if name == "gap":
        return MinGapPolicy()
    if name == "cost":
        return CostModelPolicy(CostModel())
    return None if layer_counts is None else default_swap_policy(layer_counts, granularity)


def named_swap(name: TrainPolicy, layer_counts: Mapping[int, int] | None = None,
               granularity: Granularity = "auto", costs: CostModel | None = None
               ) -> SwapOptions:
    """How a run swaps with the policy ``name``: as :func:`named_policy` says, except the
    peak policy on measured ``costs``, which is the executor's default on them."""
    if name == "peak" and costs is not None:
        return SwapOptions(granularity=granularity, costs=costs)
    return SwapOptions(named_policy(name, layer_counts, granularity),
                       granularity="auto" if name != "peak" or layer_counts else granularity)


def budget_policy(measured: Measured, layer_counts: Mapping[int, int], budget: int, *,
                  granularity: Granularity = "auto",
                  recompute: RecomputeMode = "auto", costs: CostModel | None = None,
                  everyone: Callable[[CostModel], CostModel] | None = None) -> PeakPolicy:
    """The peak policy under ``budget`` on the chunks ``measured`` and, where measured, the
    compute and link ``costs`` (else layers alike, a backward twice a forward, a link of no
    limit). Each rank plans only its own swap; ``everyone`` adds the other ranks' stages and
    chunks to the model (gathered from them), so that it weighs its plans in the whole
    pipeline rather than on its own timeline."""
    chunks = measured_chunks(measured.chunk_bytes, measured.layer_held, measured.layer_inputs)
    model = (CostModel(chunks=chunks, stages=uniform_layers(layer_counts)) if costs is None
             else replace(costs, chunks=chunks))
    if everyone is not None:
        model = everyone(model)
    return PeakPolicy(model, budget, granularity=granularity, recompute=recompute)
