"""Splitting a batch into equal microbatches along dimension 0."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeswap.runtime.errors import PipelineSetupError

if TYPE_CHECKING:
    import torch


def split_microbatches(batch: torch.Tensor, microbatches: int, what: str) -> list[torch.Tensor]:
    """``microbatches`` equal views of ``batch`` along dimension 0."""
    size = batch.shape[0] if batch.dim() else 0
    if size == 0 or size % microbatches:
        raise PipelineSetupError(
            f"{what} has batch size {size} (dimension 0 of shape {tuple(batch.shape)}), which "
            f"does not split into {microbatches} equal microbatches; use a batch size that is "
            f"a multiple of {microbatches}")
    return list(batch.chunk(microbatches))
