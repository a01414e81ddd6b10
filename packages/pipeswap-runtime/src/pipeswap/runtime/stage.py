"""A pipeline stage: one slice of the model, its place in the pipeline, and its process group."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeswap.runtime.errors import PipelineSetupError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist


class PipelineStage:
    """Stage ``stage_index`` of ``num_stages``: ``module`` maps one tensor to one tensor.

    The first stage takes the microbatch input; the last stage's output goes to the loss
    function. ``group`` is the pipeline's process group (None: the default group).
    """

    def __init__(
        self,
        module: torch.nn.Module,
        stage_index: int,
        num_stages: int,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        if not 0 <= stage_index < num_stages:
            raise PipelineSetupError(
                f"stage_index must be in [0, {num_stages}), got {stage_index}")
        self.module = module
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.group = group

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch

        out: Any = self.module(x)
        if not isinstance(out, torch.Tensor):
            raise PipelineSetupError(
                f"stage {self.stage_index}'s module returned {type(out).__name__}; a pipeline "
                "stage passes one tensor to the next (pack several into one, or split the "
                "model at another layer)")
        return out

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.num_stages})"
