"""Which swap plan a run uses: the policy ``--policy`` names, and the peak policy under a
byte budget planned on what this rank measured without swap, recomputing layers where
swapping alone would cost more (``--recompute auto``).

The runtime knows no chunk's bytes or compute times before it runs, so a plan rests on a
uniform cost model (layers alike, a backward twice a forward) unless a run without swap
measured them first.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from pipeswap.runtime.executor.measurements import measured_chunks
from pipeswap.runtime.train.config import TrainConfig
from pipeswap.runtime.train.metrics import ModeResult
from pipeswap.schedule import CostModel, PeakPolicy, SwapPolicy


def swap_policy(name: str, layer_counts: Mapping[int, int] | None = None,
                granularity: str = "auto") -> SwapPolicy | None:
    """The swap policy of ``--policy``: ``gap`` (MindSpore hyper-parallel's rule), ``cost``
    (every chunk whose copies hide) or ``peak``, which needs each stage's layer count
    (``layer_counts``; None leaves the executor's default, which asks the stages)."""
    from pipeswap.schedule import CostModelPolicy, MinGapPolicy, default_swap_policy

    if name == "gap":
        return MinGapPolicy()
    if name == "cost":
        return CostModelPolicy(CostModel())
    return None if layer_counts is None else default_swap_policy(layer_counts, granularity)


def budget_policy(config: TrainConfig, plain: ModeResult, layer_counts: Mapping[int, int],
                  costs: CostModel | None = None,
                  everyone: Callable[[CostModel], CostModel] | None = None) -> PeakPolicy:
    """The peak policy under ``config.swap.budget``, on the chunk sizes this rank measured
    without swap (``plain``: each chunk's bytes held and movable, and per layer what it
    added and was called with: what recomputing it keeps) and, where measured, the compute
    and link ``costs`` (else layers alike, a backward twice a forward, a link of no limit).
    Each rank plans only its own swap; ``everyone`` adds the other ranks' stages and chunks
    to the model (gathered from them), so that it weighs its plans in the whole pipeline
    (:meth:`PeakPolicy.prepare`) rather than on its own timeline."""
    from pipeswap.schedule import uniform_layers

    assert config.swap.budget is not None
    chunks = measured_chunks(plain.chunk_bytes, plain.layer_held, plain.layer_inputs)
    model = (CostModel(chunks=chunks, stages=uniform_layers(layer_counts)) if costs is None
             else replace(costs, chunks=chunks))
    if everyone is not None:
        model = everyone(model)
    return PeakPolicy(model, config.swap.budget, granularity=config.swap.granularity,
                      recompute=config.swap.recompute)
