"""The pipeline executor: runs pipeswap schedules, swap steps included, over torch.distributed.

Laid out by job: ``executor`` (the executor, its options, its set-up and the one place the
runtime plans swap), ``distributed`` (transport, process groups, peer watch, launching),
``checkpoint``, ``models`` (GPT, Llama, Hugging Face, the corpus), ``pipelining`` (PyTorch's
schedule classes over the executor) and ``train`` (``pipeswap-train``). torch is imported
lazily where it can be: importing this package is cheap.
"""

from pipeswap.runtime.__about__ import __version__
from pipeswap.runtime.checkpoint.save_load import CheckpointError, load_checkpoint, save_checkpoint
from pipeswap.runtime.errors import (
    PeerFailedError,
    PipelineCommError,
    PipelineError,
    PipelineSetupError,
)
from pipeswap.runtime.executor.options import (
    DataParallel,
    FailureHandling,
    Measure,
    Microbatches,
    Numerics,
    SwapOptions,
)
from pipeswap.runtime.executor.pipeline_executor import PipelineExecutor
from pipeswap.runtime.executor.sharded_stage import shard_stage
from pipeswap.runtime.distributed.launch import RankFailedError, mark_step, pipeline_mesh, spawn
from pipeswap.runtime.executor.replay import Replay
from pipeswap.runtime.executor.step_report import StepReport
from pipeswap.runtime.executor.stage import PipelineStage

__all__ = [
    "CheckpointError",
    "DataParallel",
    "FailureHandling",
    "Measure",
    "Microbatches",
    "Numerics",
    "PeerFailedError",
    "PipelineCommError",
    "PipelineError",
    "PipelineExecutor",
    "PipelineSetupError",
    "PipelineStage",
    "RankFailedError",
    "Replay",
    "StepReport",
    "SwapOptions",
    "__version__",
    "load_checkpoint",
    "mark_step",
    "pipeline_mesh",
    "save_checkpoint",
    "shard_stage",
    "spawn",
]
