"""The pipeline executor: runs pipeswap schedules, swap steps included, over torch.distributed.

torch is imported lazily where it can be: importing this package is cheap.
"""

from pipeswap.runtime.__about__ import __version__
from pipeswap.runtime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from pipeswap.runtime.errors import (
    PeerFailedError,
    PipelineCommError,
    PipelineError,
    PipelineSetupError,
)
from pipeswap.runtime.executor import PipelineExecutor
from pipeswap.runtime.fsdp import shard_stage
from pipeswap.runtime.launch import RankFailedError, mark_step, pipeline_mesh, spawn
from pipeswap.runtime.replay import Replay
from pipeswap.runtime.report import StepReport
from pipeswap.runtime.stage import PipelineStage

__all__ = [
    "CheckpointError",
    "PeerFailedError",
    "PipelineCommError",
    "PipelineError",
    "PipelineExecutor",
    "PipelineSetupError",
    "PipelineStage",
    "RankFailedError",
    "Replay",
    "StepReport",
    "__version__",
    "load_checkpoint",
    "mark_step",
    "pipeline_mesh",
    "save_checkpoint",
    "shard_stage",
    "spawn",
]
