"""Checkpoints of a pipeline run: saved and loaded with torch.distributed.checkpoint, each
file hashed as it is written, and a manifest that verifies the newest complete one."""

from pipeswap.runtime.checkpoint.save_load import (
    LATEST,
    MANIFEST,
    CheckpointError,
    ResumePoint,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

__all__ = ["LATEST", "MANIFEST", "CheckpointError", "ResumePoint", "checkpoint_path",
           "latest_checkpoint", "load_checkpoint", "save_checkpoint"]
