"""Which swap plan a run uses: the policy ``--policy`` names, and the peak policy under a
byte budget planned on what every rank measured without swap.

The runtime knows no chunk's bytes before it runs, so the plans here rest on a uniform cost
model (layers alike, a backward twice a forward) unless measured sizes are shared first.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeswap.runtime.train.config import TrainConfig
from pipeswap.schedule import SwapPolicy


def swap_policy(name: str, layer_counts: Mapping[int, int] | None = None,
                granularity: str = "auto") -> SwapPolicy | None:
    """The swap policy of ``--policy``: ``gap`` (MindSpore hyper-parallel's rule), ``cost``
    (every chunk whose copies hide) or ``peak``, which needs each stage's layer count
    (``layer_counts``; None leaves the executor's default, which asks the stages)."""
    from pipeswap.schedule import CostModel, CostModelPolicy, MinGapPolicy, default_swap_policy

    if name == "gap":
        return MinGapPolicy()
    if name == "cost":
        return CostModelPolicy(CostModel())
    return None if layer_counts is None else default_swap_policy(layer_counts, granularity)


def budget_policy(config: TrainConfig, mine: Mapping[tuple[int, int], tuple[int, int]],
                  layer_counts: Mapping[int, int]) -> SwapPolicy:
    """The peak policy under ``config.swap.budget``, on the chunk sizes every rank measured
    without swap (``mine``: this rank's, as (held, movable) per chunk), shared by an
    all-reduce so that every rank builds the same schedule."""
    import torch
    import torch.distributed as dist

    from pipeswap.schedule import ChunkBytes, CostModel, PeakPolicy, uniform_layers

    assert config.swap.budget is not None
    stages, micros = config.num_stages, config.parallel.microbatches
    sizes = torch.full((stages, micros, 2), -1, dtype=torch.int64)
    for (stage, micro), (held, movable) in mine.items():
        sizes[stage, micro] = torch.tensor([held, movable])
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX)  # each chunk is measured on one rank
    chunks = {(stage, micro): ChunkBytes(int(held), pinned=int(held - movable))
              for stage in range(stages) for micro in range(micros)
              for held, movable in [sizes[stage, micro].tolist()] if held >= 0}
    return PeakPolicy(CostModel(chunks=chunks, stages=uniform_layers(layer_counts)),
                      config.swap.budget, granularity=config.swap.granularity)
