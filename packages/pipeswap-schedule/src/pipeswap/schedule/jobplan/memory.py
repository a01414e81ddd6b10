"""What each rank of a configuration holds on its device, part by part, and the job that
decides it: the weights, their gradients and the optimizer's state (sharded by data
parallel with FSDP, else replicated), the saved activations (the simulator's peak, after
swap and recompute), and buffers (the stage boundary messages in flight, the last stage's
logits and their gradient in fp32, and with FSDP one stage's parameters gathered)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.jobplan.activations import layer_bytes
from pipeswap.schedule.jobplan.models import ModelShape

Optimizer = Literal["adam", "sgd"]
OPTIMIZERS: tuple[Optimizer, ...] = ("adam", "sgd")
GIB = 1 << 30


@dataclass(frozen=True)
class Job:
    """What is trained: on ``gpus`` GPUs, a global batch of ``global_batch`` sequences of
    ``seq_len`` tokens, weights and activations of ``dtype_bytes`` (2: bf16), an optimizer
    (Adam, or SGD with momentum). ``fsdp``: data-parallel replicas shard the weights,
    gradients and optimizer state (else each holds all of its stages'). ``reserve_bytes``: kept
    free on each GPU (the CUDA context, kernels' workspaces, the allocator's slack)."""

    gpus: int
    global_batch: int
    seq_len: int
    dtype_bytes: int = 2
    optimizer: Optimizer = "adam"
    fsdp: bool = True
    reserve_bytes: int = 2 * GIB

    def __post_init__(self) -> None:
        if min(self.gpus, self.global_batch, self.seq_len) < 1:
            raise ScheduleError("--gpus, --global-batch and --seq-len must be >= 1")
        if self.dtype_bytes not in (2, 4):
            raise ScheduleError(f"dtype of {self.dtype_bytes} bytes: use bf16/fp16 (2) or "
                                "fp32 (4)")
        if self.optimizer not in OPTIMIZERS:
            raise ScheduleError(f"unknown optimizer {self.optimizer!r}: choose one of "
                                f"{', '.join(OPTIMIZERS)}")

    def optimizer_bytes_per_param(self) -> int:
        """Adam's two moments in fp32, and an fp32 master copy of 16-bit weights; SGD's one
        momentum and the same master copy."""
        moments = 8 if self.optimizer == "adam" else 4
        return moments + (4 if self.dtype_bytes == 2 else 0)


@dataclass(frozen=True)
class MemoryParts:
    """One rank's device memory, in bytes, part by part."""

    parameters: int
    gradients: int
    optimizer: int
    activations: int
    buffers: int

    @property
    def total(self) -> int:
        return (self.parameters + self.gradients + self.optimizer + self.activations
                + self.buffers)

    @property
    def static(self) -> int:
        """All but the activations: what no swap or recompute lowers."""
        return self.total - self.activations


def stage_layers(layers: int, stages: int) -> tuple[int, ...]:
    """How many blocks each of ``stages`` stages holds: as even as can be, the earlier stages
    taking the extra ones, as pipeswap's stage split does."""
    if layers < stages:
        raise ScheduleError(f"{layers} layers cannot fill {stages} stages")
    base, extra = divmod(layers, stages)
    return tuple(base + (stage < extra) for stage in range(stages))


def stage_params(model: ModelShape, stage: int, layers: tuple[int, ...]) -> int:
    """The parameters stage ``stage`` holds: its blocks, the embedding on the first, the
    head on the last (a tied head's weights counted once, on the first)."""
    count = layers[stage] * model.layer_params()
    if stage == 0:
        count += model.embedding_params()
    if stage == len(layers) - 1:
        count += model.head_params()
    return count


def static_parts(model: ModelShape, job: Job, stages: tuple[int, ...], layers: tuple[int, ...],
                 dp: int, micro_batch: int) -> MemoryParts:
    """A rank holding ``stages`` (of ``len(layers)``), before activations."""
    params = sum(stage_params(model, stage, layers) for stage in stages)
    share = math.ceil(params / dp) if job.fsdp else params
    boundary = model.boundary_bytes(micro_batch, job.seq_len, job.dtype_bytes)
    # an activation and a gradient in flight, and a layer's backward's working set: a
    # GPT block's (explicit attention) makes gradients as large as what it saved, a Llama
    # block's fused attention hardly any (as the allocator shows for pipeswap's models)
    working = 0 if model.gated_mlp else layer_bytes(model, micro_batch, job.seq_len,
                                                     job.dtype_bytes)
    buffers = 2 * boundary + working
    if len(layers) - 1 in stages:  # the logits and their gradient, fp32
        buffers += 2 * micro_batch * job.seq_len * model.vocab * 4
    if job.fsdp and dp > 1:  # one stage's weights gathered at a time
        buffers += max(stage_params(model, stage, layers) for stage in stages) * job.dtype_bytes
    return MemoryParts(parameters=share * job.dtype_bytes, gradients=share * job.dtype_bytes,
                       optimizer=share * job.optimizer_bytes_per_param(), activations=0,
                       buffers=buffers)
