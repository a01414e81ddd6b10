"""``pipeswap-train``: train a small GPT or Llama across pipeline ranks, with and without
swap, and compare peak activation memory (as the swap manager counts it and as the allocator
saw it), step time and losses.

Shaped like torchtitan's trainer: a frozen :class:`TrainConfig` (``config``), the command line
and its checks (``cli``), the parts a rank trains (``components``), the per-rank loop
(``trainer``), per-step figures (``metrics``) and the summary and table (``summary``); the swap
plan's policy comes from :mod:`pipeswap.runtime.executor.planning`. With ``--dp N --fsdp`` it
runs N pipeline replicas on a 2-D (pp, dp) device mesh, each stage sharded with FSDP2. Run as
is, it spawns the ranks itself; under torchrun it joins the process group torchrun set up.
"""

from pipeswap.runtime.train.cli import main, parse_args
from pipeswap.runtime.train.components import build_stages, stage_layer_counts
from pipeswap.runtime.train.config import (
    CheckpointConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    SwapConfig,
    TrainConfig,
    TrainingConfig,
)
from pipeswap.runtime.train.metrics import ModeResult
from pipeswap.runtime.train.summary import render, summarize
from pipeswap.runtime.train.trainer import Trainer, run_rank

__all__ = [
    "CheckpointConfig",
    "JobConfig",
    "ModeResult",
    "ModelConfig",
    "ParallelConfig",
    "SwapConfig",
    "TrainConfig",
    "Trainer",
    "TrainingConfig",
    "build_stages",
    "main",
    "parse_args",
    "render",
    "run_rank",
    "stage_layer_counts",
    "summarize",
]
