"""Splitting a batch (a tensor, or a pytree of tensors) into equal microbatches along
dimension 0."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeswap.runtime.errors import PipelineSetupError
from pipeswap.runtime.distributed.transport import flatten

if TYPE_CHECKING:
    import torch

    from pipeswap.runtime.distributed.transport import PyTree


def split_microbatches(batch: torch.Tensor, microbatches: int, what: str) -> list[torch.Tensor]:
    """``microbatches`` equal views of ``batch`` along dimension 0."""
    size = batch.shape[0] if batch.dim() else 0
    if size == 0 or size % microbatches:
        raise PipelineSetupError(
            f"{what} has batch size {size} (dimension 0 of shape {tuple(batch.shape)}), which "
            f"does not split into {microbatches} equal microbatches; use a batch size that is "
            f"a multiple of {microbatches}")
    return list(batch.chunk(microbatches))


def split_tree(batch: PyTree, microbatches: int, what: str) -> list[PyTree]:
    """``microbatches`` pytrees like ``batch`` (a tensor, or tuples, lists and dicts of
    tensors), each tensor split along dimension 0 as :func:`split_microbatches` does."""
    from torch.utils._pytree import tree_unflatten


    leaves, spec = flatten(batch, what)
    parts = [split_microbatches(leaf, microbatches, what if len(leaves) == 1
                                else f"{what}' tensor {index}")
             for index, leaf in enumerate(leaves)]
    return [tree_unflatten([part[m] for part in parts], spec) for m in range(microbatches)]
