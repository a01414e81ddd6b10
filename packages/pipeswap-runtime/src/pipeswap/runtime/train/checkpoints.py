"""When and how a `pipeswap-train` run saves its checkpoints: after every ``--checkpoint-every``
steps and at each mode's end, written at once or (``--checkpoint-async``) in the background,
one save in flight at a time."""

from __future__ import annotations

import datetime
import os
from typing import TYPE_CHECKING

from pipeswap.runtime.checkpoint.background import PendingSave, save_in_background
from pipeswap.runtime.checkpoint.save_load import save_checkpoint
from pipeswap.runtime.train.config import Mode, TrainConfig
from pipeswap.runtime.train.preflight import saved_model, saved_training

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from pipeswap.runtime.executor.stage import PipelineStage


class RunCheckpoints:
    """This rank's side of the run's checkpoints. ``background``: saves are written while
    training goes on, over a gloo group of their own that every rank makes here."""

    def __init__(self, config: TrainConfig, *, background: bool) -> None:
        import torch.distributed as dist

        self.config = config
        self.group: dist.ProcessGroup | None = None
        if background:
            self.group = dist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=config.job.timeout_s))
        self.pending: PendingSave | None = None

    def due(self, number: int) -> bool:
        """Whether step ``number`` ends with a checkpoint."""
        every = self.config.checkpoint.every
        return self.config.checkpoint.save_dir is not None and (
            number == self.config.training.steps or (every is not None and number % every == 0))

    def save(self, mode: Mode, number: int, stages: list[PipelineStage],
             optimizer: torch.optim.Optimizer) -> None:
        """Step ``number``'s checkpoint of ``mode``, written now or in the background (once
        the save in flight is done)."""
        config = self.config
        assert config.checkpoint.save_dir is not None
        where = os.path.join(config.checkpoint.save_dir, mode)
        job = {"model": saved_model(config), "training": saved_training(config)}
        if self.group is None:
            save_checkpoint(where, step=number, stages=stages, optimizer=optimizer,
                            data_position=number, job=job)
            return
        self.wait()
        self.pending = save_in_background(where, step=number, stages=stages,
                                          optimizer=optimizer, data_position=number,
                                          group=self.group, job=job)

    def wait(self) -> None:
        """Wait for the save in flight, if one is; its error is raised here."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()
