"""What one ``pipeswap-train`` job is: frozen sections (model, parallelism, swap, training,
checkpoints, the job itself) in one :class:`TrainConfig`, the same object on every rank.

Sections keep each component's knobs together, as torchtitan's job config does; the command
line (``cli.py``) is the only place that turns arguments into one.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar, get_args

from pipeswap.runtime.distributed.launch import DEFAULT_TIMEOUT_S
from pipeswap.runtime.distributed.process_groups import operation_timeout
from pipeswap.runtime.executor.planning import TrainPolicy
from pipeswap.schedule import Granularity, RecomputeMode

#: The runs a job compares, in order.
Mode = Literal["no-swap", "swap"]
#: The bundled model families.
ModelFamily = Literal["gpt", "llama"]
#: The parameters' and forwards' precision (bf16: autocast, fp32 master weights).
Dtype = Literal["fp32", "bf16"]
#: The levels of the pipeswap loggers.
LogLevel = Literal["debug", "info", "warning", "error"]
#: What the peak policy weighs: what the run without swap measured, or layer counts alone.
SwapCosts = Literal["measured", "layers"]

MODES: tuple[Mode, ...] = get_args(Mode)
MODELS: tuple[ModelFamily, ...] = get_args(ModelFamily)
DTYPES: tuple[Dtype, ...] = get_args(Dtype)
LOG_LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)
TRAIN_POLICIES: tuple[TrainPolicy, ...] = get_args(TrainPolicy)
SWAP_COSTS: tuple[SwapCosts, ...] = get_args(SwapCosts)


@dataclass(frozen=True)
class ModelConfig:
    """The model every rank builds whole (or, replayed, its own stages) from one seed."""

    # or llama: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU
    family: ModelFamily = "gpt"
    tie_embeddings: bool = False  # llama: one weight for the embedding and the output
    width: int = 64
    layers: int | None = None  # default: two blocks per stage
    heads: int = 4  # attention heads (llama: half as many key/value heads)
    kv_heads: int | None = None  # llama: key/value heads (default: half the heads)
    ffn: int | None = None  # llama: the SwiGLU hidden size (default: Llama's rule)
    seq_len: int = 64
    dtype: Dtype = "fp32"  # bf16: forwards under autocast to bfloat16, fp32 master weights


@dataclass(frozen=True)
class ParallelConfig:
    """The pipeline schedule and the (pp, dp) layout of the ranks."""

    schedule: str = "1f1b"
    ranks: int = 4  # pipeline ranks: the world has ranks x dp
    dp: int = 1  # pipeline replicas (data parallel)
    fsdp: bool = False  # shard each stage with FSDP2 over its data-parallel group
    stages_per_rank: int = 1
    microbatches: int = 8
    overlap_b_f: bool = False
    dxdw_split: bool = False
    batch_p2p: bool = False

    @property
    def num_stages(self) -> int:
        return self.ranks * self.stages_per_rank

    @property
    def world(self) -> int:
        return self.ranks * self.dp

    @property
    def meshed(self) -> bool:
        """Whether the run lays its ranks out on a 2-D (pp, dp) device mesh."""
        return self.dp > 1 or self.fsdp


@dataclass(frozen=True)
class SwapConfig:
    """Which chunks swap, how, and which modes the job runs to compare."""

    policy: TrainPolicy = "peak"  # see executor.planning.named_policy()
    granularity: Granularity = "auto"  # the peak policy's: auto, chunk or layer (streaming)
    # per-rank bytes of saved activations the peak policy keeps each rank under, planned on
    # the chunk sizes the run without swap measured (compare mode only)
    budget: int | None = None
    modes: tuple[Mode, ...] = MODES
    # what the peak policy weighs: "measured" (the run without swap's compute times and chunk
    # bytes, and the probed host link) or "layers" (layer counts alone: layers alike, a
    # backward twice a forward, a link of no limit; the same plan run after run)
    costs: SwapCosts = "measured"
    # under a budget, whether the peak policy may also recompute layers ("auto") or only
    # swaps ("never")
    recompute: RecomputeMode = "auto"
    # the pinned host buffers a rank may hold for swapped activations (None: the swap
    # manager's default, half the host's memory shared among its ranks)
    host_pool_bytes: int | None = None


@dataclass(frozen=True)
class TrainingConfig:
    """The optimisation loop: steps, batch, learning rate, seed and device."""

    steps: int = 10
    batch_size: int = 16
    lr: float = 3e-3
    seed: int = 0  # weights and data
    device: str = "cpu"


@dataclass(frozen=True)
class CheckpointConfig:
    """Save each mode's run into ``save_dir/<mode>`` after every ``every`` steps and at its
    end; resume each from ``resume/<mode>`` (steps counted from the run's start): from the
    checkpoint ``resume_from`` names for the mode (the launcher verified it), else from the
    newest there that verifies."""

    save_dir: str | None = None
    every: int | None = None
    asynchronous: bool = False  # written while the next steps train
    resume: str | None = None
    resume_anyway: bool = False  # go on from a checkpoint of other training options
    resume_from: tuple[tuple[str, str], ...] = ()  # (mode, checkpoint directory)
    fresh_modes: tuple[str, ...] = ()  # modes of a restarted job with no checkpoint yet

    def resume_path(self, mode: Mode) -> str:
        assert self.resume is not None
        return dict(self.resume_from).get(mode, os.path.join(self.resume, mode))


@dataclass(frozen=True)
class JobConfig:
    """How the job reports and guards itself."""

    verbose: bool = True  # log each step's progress (at info level)
    log_level: LogLevel = "info"  # of the pipeswap loggers in every rank
    keep_grads: bool = False  # return the first step's gradients (for tests)
    # measure the allocator's peak in the odd steps (1, 3, ...) and time only the even ones,
    # as measuring slows a step (the one step of a one-step run is measured and timed)
    measure_allocator: bool = True
    timeout_s: float = DEFAULT_TIMEOUT_S
    metrics: str | None = None  # a file rank 0 appends one JSON line to per step and mode
    # run this pipeline rank alone, in this process: receives made here, sends dropped
    replay_rank: int | None = None


_Section = TypeVar("_Section", ModelConfig, ParallelConfig, SwapConfig, TrainingConfig,
                   CheckpointConfig, JobConfig)
_SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "swap": SwapConfig,
             "training": TrainingConfig, "checkpoint": CheckpointConfig, "job": JobConfig}
# each section field's name is unique across sections, so a flat keyword names one field
_SECTION_OF = {f.name: section for section, kind in _SECTIONS.items()
               for f in dataclasses.fields(kind)}
assert len(_SECTION_OF) == sum(len(dataclasses.fields(kind)) for kind in _SECTIONS.values()), \
    "two config sections share a field name: TrainConfig.of/but could not tell them apart"


@dataclass(frozen=True)
class TrainConfig:
    """Everything a rank needs to run the job; the same object on every rank."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    swap: SwapConfig = field(default_factory=SwapConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    job: JobConfig = field(default_factory=JobConfig)

    @property
    def group_timeout_s(self) -> float:
        """The process groups' per-operation timeout. On CPU ``--timeout``: gloo fails a
        wait after it. On an accelerator much longer (NCCL's watchdog would kill a rank for
        a long step), the executor's watch finding a failed peer within ``--timeout``."""
        if self.training.device == "cpu":
            return self.job.timeout_s
        detection = datetime.timedelta(seconds=self.job.timeout_s)
        return operation_timeout(detection).total_seconds()

    @staticmethod
    def of(**fields: Any) -> TrainConfig:  # Any: fields of several sections, several types
        """The defaults with some fields set by their own names, whatever their section:
        ``TrainConfig.of(ranks=2, steps=3)``."""
        return TrainConfig().but(**fields)

    def but(self, **fields: Any) -> TrainConfig:  # Any: as in of, fields of any section
        """This config with some fields changed, named as in :meth:`of`."""
        unknown = sorted(set(fields) - set(_SECTION_OF))
        if unknown:
            raise TypeError(f"TrainConfig has no field {', '.join(unknown)}")

        def changed(name: str, section: _Section) -> _Section:
            mine = {key: value for key, value in fields.items() if _SECTION_OF[key] == name}
            return dataclasses.replace(section, **mine) if mine else section

        return TrainConfig(model=changed("model", self.model),
                           parallel=changed("parallel", self.parallel),
                           swap=changed("swap", self.swap),
                           training=changed("training", self.training),
                           checkpoint=changed("checkpoint", self.checkpoint),
                           job=changed("job", self.job))

    @property
    def num_stages(self) -> int:
        return self.parallel.num_stages

    @property
    def num_layers(self) -> int:
        return self.model.layers if self.model.layers is not None else 2 * self.num_stages
