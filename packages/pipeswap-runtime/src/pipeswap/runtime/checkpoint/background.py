"""Checkpoints written while training goes on (DCP's ``async_save``), checksummed and
committed exactly as :func:`~pipeswap.runtime.checkpoint.save_load.save_checkpoint` commits
them.

The state is copied to host memory before :func:`save_in_background` returns (DCP's
staging), so the next optimizer step cannot change what is being written; the files are
written, their sums gathered and the checkpoint committed by rank 0 in a thread, over a
process group of the save's own (its collectives must not interleave with the training's).
At most one save is in flight: the caller waits for it (:meth:`PendingSave.result`) before
it starts the next, and before the run ends. A process killed while a save is in flight
leaves its ``step-N.tmp`` directory, which is never loaded: a resumed run goes on from the
checkpoint before it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from pipeswap.runtime.checkpoint.save_load import begin_save, finish_save, state_of

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from pipeswap.runtime.executor.stage import PipelineStage


class PendingSave:
    """A checkpoint being written in the background."""

    def __init__(self, step: int) -> None:
        self.step = step
        self._done = threading.Event()
        self._path: Path | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def result(self) -> Path:
        """Wait for the save; its path, or the error that ended it (raised here)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._path is not None
        return self._path

    def _settle(self, path: Path | None, error: BaseException | None) -> None:
        self._path, self._error = path, error
        self._done.set()


def save_in_background(directory: str | os.PathLike[str], *, step: int,
                       stages: Sequence[PipelineStage], optimizer: torch.optim.Optimizer,
                       data_position: int, group: dist.ProcessGroup, keep: int = 2,
                       job: Mapping[str, object] | None = None) -> PendingSave:
    """Start saving what :func:`save_checkpoint` would save; every rank calls it, after the
    same step, with ``group``: a gloo group over every rank made for the saves alone (every
    rank calls ``new_group`` for it once, before the first save)."""
    from torch.distributed.checkpoint.state_dict_saver import async_save

    from pipeswap.runtime.checkpoint.hashing_writer import digesting_writer

    begun = begin_save(directory, step=step, stages=stages, optimizer=optimizer,
                       data_position=data_position, keep=keep, job=job)
    writer, sums, refused = digesting_writer(begun.staging)
    writing = async_save(state_of(stages, optimizer), storage_writer=writer,
                         process_group=group)
    pending = PendingSave(step)

    def finish() -> None:
        failed: str | None = None
        try:
            writing.result()  # type: ignore[union-attr]
        except BaseException as exc:  # noqa: BLE001 - DCP's CheckpointException too
            failed = refused[0] if refused else f"{type(exc).__name__}: {exc}"
        try:
            pending._settle(finish_save(begun, sums, failed, group), None)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's result()
            pending._settle(None, exc)

    threading.Thread(target=finish, name=f"pipeswap-save-{step}", daemon=True).start()
    return pending
