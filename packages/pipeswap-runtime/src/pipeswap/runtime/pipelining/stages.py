"""The stages the drop-in schedule classes take: PyTorch's ``PipelineStage`` (or any object
with its attributes, :class:`TorchStageLike`) or pipeswap's, each made pipeswap's, and what
they are called with: ``step``'s keyword arguments split per microbatch, for every stage,
as PyTorch's schedules pass them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, Union

import torch
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks
from torch.utils._pytree import tree_flatten, tree_unflatten

from pipeswap.runtime.distributed.transport import PyTree
from pipeswap.runtime.errors import PipelineSetupError
from pipeswap.runtime.executor.stage import PipelineStage

__all__ = ["StageArgument", "TorchStageLike", "merged", "microbatch_kwargs", "pipeswap_stage"]


class TorchStageLike(Protocol):
    """What pipeswap reads of ``torch.distributed.pipelining.PipelineStage`` (its ``group``,
    where it has one, too)."""

    submod: torch.nn.Module
    stage_index: int
    num_stages: int
    device: torch.device


#: A stage as the classes take it: PyTorch's, or pipeswap's own.
StageArgument = Union[PipelineStage, TorchStageLike]


def pipeswap_stage(stage: StageArgument) -> PipelineStage:
    """pipeswap's stage for a PyTorch ``PipelineStage`` (its submodule, index, stage count,
    group and device), or the pipeswap stage itself."""
    if isinstance(stage, PipelineStage):
        return stage
    missing = [name for name in ("submod", "stage_index", "num_stages", "device")
               if not hasattr(stage, name)]
    if missing:
        raise PipelineSetupError(
            f"{stage!r} is neither torch.distributed.pipelining's PipelineStage nor "
            f"pipeswap's (it has no {', '.join(missing)})")
    return PipelineStage(stage.submod, stage.stage_index, stage.num_stages,
                         group=getattr(stage, "group", None), device=stage.device)


def merged(outputs: Sequence[PyTree]) -> PyTree | None:
    """The microbatches' outputs joined along dimension 0, as PyTorch's default merge; a
    tensor of no dimensions (a per-microbatch loss term) is stacked, one value a
    microbatch, where PyTorch's merge fails."""
    if not outputs:
        return None
    flat = [tree_flatten(output) for output in outputs]
    spec = flat[0][1]
    leaves = [_joined([leaves[k] for leaves, _ in flat])
              if isinstance(flat[0][0][k], torch.Tensor) else flat[0][0][k]
              for k in range(len(flat[0][0]))]
    whole: PyTree = tree_unflatten(leaves, spec)
    return whole


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(parts) if parts[0].dim() == 0 else torch.cat(parts)


def microbatch_kwargs(kwargs: dict[str, object], microbatches: int
                      ) -> list[dict[str, object]]:
    """``step``'s keyword arguments per microbatch, as PyTorch's schedules split them (its
    own function: tensors along dimension 0, other values copied to each); none for none."""
    if not kwargs:
        return []
    _, split = split_args_kwargs_into_chunks((), kwargs, microbatches)
    return [dict(each) for each in split]
