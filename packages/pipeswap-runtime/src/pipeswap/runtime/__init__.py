"""The pipeline executor: runs pipeswap schedules, swap steps included, over torch.distributed.

torch is imported lazily where it can be: importing this package is cheap.
"""

from pipeswap.runtime.__about__ import __version__
from pipeswap.runtime.errors import (
    PeerFailedError,
    PipelineCommError,
    PipelineError,
    PipelineSetupError,
)
from pipeswap.runtime.executor import PipelineExecutor, StepReport
from pipeswap.runtime.launch import RankFailedError, spawn
from pipeswap.runtime.session import SwapSession
from pipeswap.runtime.stage import PipelineStage

__all__ = [
    "PeerFailedError",
    "PipelineCommError",
    "PipelineError",
    "PipelineExecutor",
    "PipelineSetupError",
    "PipelineStage",
    "RankFailedError",
    "StepReport",
    "SwapSession",
    "__version__",
    "spawn",
]
