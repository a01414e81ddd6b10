"""Rank functions for the end-to-end tests that need more than the training job's run_rank:
each runs in a spawned process with the process group initialized."""

from __future__ import annotations

import os

import torch

from pipeswap.runtime import PipelineExecutor, PipelineStage
from pipeswap.runtime.model import lm_loss


class Boom(torch.nn.Module):
    """A stage that fails on the given call: ``raise`` or ``die`` (exit without a word)."""

    def __init__(self, how: str, at_call: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)
        self.how, self.at_call, self.calls = how, at_call, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at_call:
            if self.how == "die":
                os._exit(3)
            raise ValueError("boom: a stage failed on purpose")
        out: torch.Tensor = self.linear(x)
        return out


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out, target)


def fail_mid_step(rank: int, world_size: int, how: str) -> str:
    """Rank 0's stage fails in its second forward (the shape dry run is the first call)."""
    torch.manual_seed(0)
    module = Boom(how, at_call=3) if rank == 0 else torch.nn.Linear(8, 8)
    stage = PipelineStage(module, rank, world_size)
    executor = PipelineExecutor([stage], "gpipe", 4, _mse, swap=True)
    executor.step(torch.randn(8, 8), torch.randn(8, 8))
    return "finished"


def mismatched(rank: int, world_size: int, what: str) -> str:
    """Rank 1 disagrees with rank 0: another microbatch count, or the wrong stage."""
    module = torch.nn.Linear(8, 8)
    if what == "schedule":
        stage = PipelineStage(module, rank, world_size)
        PipelineExecutor([stage], "gpipe", 4 if rank == 0 else 8, _mse)
    else:
        stage = PipelineStage(module, 0, world_size)  # both ranks claim stage 0
        PipelineExecutor([stage], "gpipe", 4, lm_loss)
    return "built"


def bad_batch_then_recover(rank: int, world_size: int) -> tuple[list[str], int, int]:
    """Rank 0 gets a batch that does not split; then both ranks run a good step."""
    from pipeswap.runtime import PipelineSetupError

    torch.manual_seed(0)
    stage = PipelineStage(torch.nn.Linear(8, 8), rank, world_size)
    executor = PipelineExecutor([stage], "gpipe", 4, _mse, swap=True)
    generator = torch.Generator().manual_seed(1)
    inputs, targets = torch.randn(8, 8, generator=generator), torch.randn(8, 8, generator=generator)
    errors = []
    try:
        executor.step(inputs[:6] if rank == 0 else inputs, targets)
    except PipelineSetupError as exc:
        errors.append(str(exc))
    report = executor.step(inputs, targets)
    return errors, len(report.losses), executor.manager.active_group_count()
