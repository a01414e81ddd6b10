"""The runtime's errors: each says what went wrong, on which rank and step, and what to do."""

from __future__ import annotations


class PipelineError(RuntimeError):
    """Base class of every error raised by ``pipeswap.runtime``."""


class PipelineSetupError(PipelineError):
    """Stages, schedule, inputs or process group do not fit together; raised before any
    step runs (on every rank alike where the check is collective)."""


class PipelineCommError(PipelineError):
    """A transfer with a peer rank failed or timed out: the peer died, raised, or runs a
    different schedule. Call ``PipelineExecutor.recover()`` on every rank to go on."""


class PeerFailedError(PipelineCommError):
    """Another rank's step failed first (``failed_rank``); this rank stopped its own step.
    Call ``PipelineExecutor.recover()`` on every rank to go on."""

    def __init__(self, message: str, failed_rank: int) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank


class CheckpointError(PipelineError):
    """A checkpoint could not be saved, is missing, does not verify, or does not fit this job;
    raised on every rank alike."""


class CheckpointIOError(CheckpointError):
    """Reading or writing a checkpoint failed on disk (full, unwritable, gone): a failure of
    the run, not of the job's input."""
