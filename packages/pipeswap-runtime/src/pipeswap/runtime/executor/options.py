"""The executor's options, grouped by what they are about, as frozen values.

:class:`~pipeswap.runtime.executor.pipeline_executor.PipelineExecutor` takes the stages, the
schedule, the microbatch count and the loss, then one object per concern: how it swaps
(:class:`SwapOptions`), where data parallelism comes from (:class:`DataParallel`), how it
finds and reports failures (:class:`FailureHandling`) and how it computes the loss
(:class:`Numerics`). What one step measures or keeps is :class:`Measure`, an argument of
``step``, so nothing about a step is set on the executor between steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeswap.schedule import CostModel, Granularity, SwapPolicy

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from pipeswap.swap import SwapManager

__all__ = ["DataParallel", "FailureHandling", "Measure", "Microbatches", "Numerics",
           "SwapOptions"]


@dataclass(frozen=True)
class SwapOptions:
    """How the executor swaps: with ``policy`` (by default the peak policy, told each stage's
    layer count, planning this rank's swap steps only: no other rank waits on them).

    ``granularity``: for the default policy, ``"auto"`` (stream a chunk layer by layer
    wherever that lowers the peak more than swapping it whole), ``"chunk"`` or ``"layer"``;
    a streamed chunk's layers are its stage's :attr:`PipelineStage.layers`. ``costs``: what
    this rank's compute and host link cost (e.g. the compute times and chunk bytes a step
    without swap measured, and :func:`~pipeswap.runtime.executor.measurements.probe_link`'s
    bandwidths), for the default policy to weigh copies against compute: it then swaps only
    what its copies can hide, where without them it takes the link to be infinitely fast.
    Refused, naming the figure, if a bandwidth or compute time of this rank's is not finite
    and above zero. ``manager``: the swap manager to use (by default one of the executor's
    own on its platform)."""

    policy: SwapPolicy | None = None
    granularity: Granularity = "auto"
    costs: CostModel | None = None
    manager: SwapManager | None = None


@dataclass(frozen=True)
class DataParallel:
    """Where this rank's data-parallel replicas are: ``mesh``, a 2-D DeviceMesh with
    dimensions named ``"pp"`` and ``"dp"`` (the stages' group must be
    ``mesh.get_group("pp")``), or ``group``, the data-parallel group of this rank. Each
    replica passes its own batch. Stages sharded with ``fully_shard`` over that group
    (:func:`pipeswap.runtime.shard_stage`) make a schedule built by the executor get FSDP
    steps; a schedule with FSDP steps needs every stage of the rank sharded."""

    mesh: DeviceMesh | None = None
    group: dist.ProcessGroup | None = None


@dataclass(frozen=True)
class FailureHandling:
    """How the executor finds failures and makes every rank see them.

    ``timeout_s``: how long a rank this one exchanges data with may show no sign of life
    before the step fails naming it (:mod:`pipeswap.runtime.distributed.peer_watch`). A
    watch runs wherever the group is not gloo alone (NCCL: operations there do not fail when
    a peer does), by default with the group's timeout, or wherever this is given. The
    executor's own group then gets a long per-operation timeout on every backend, so that a
    slow rank (one long step, one long compute) never fails the job: it still beats, and
    only a silent one is failed. Without it, on gloo, a transfer fails after the group's
    timeout.

    ``setup_check``: called first in the set-up every rank agrees on, so that a
    :class:`~pipeswap.runtime.PipelineSetupError` it raises (a wrapper's check of its own
    arguments) fails the set-up on every rank, not on this one alone while the others
    wait. ``agreed``: what a wrapper was given that every rank must have been given alike
    (its options, as text), agreed on with the schedule: where ranks differ, the set-up
    fails on every rank, each naming its own."""

    timeout_s: float | None = None
    setup_check: Callable[[], None] | None = None
    agreed: str = ""


@dataclass(frozen=True)
class Numerics:
    """How losses and forwards compute. ``mean_loss``: gradients of the mean of the
    microbatch losses (each scaled by 1/M before its backward; with equal microbatches and
    a loss that averages over its batch, the whole batch's gradient on one device), or,
    False, of their sum (each loss backpropagated as it is, as PyTorch's schedules do).
    ``autocast_dtype`` (e.g. ``torch.bfloat16``): every forward and its loss run under
    ``torch.autocast`` to that dtype, the parameters staying in theirs (fp32 master
    weights); tensors between stages then cross in the dtype the stages output."""

    mean_loss: bool = True
    autocast_dtype: torch.dtype | None = None


@dataclass(frozen=True)
class Microbatches:
    """A step's inputs or targets already split, one part per microbatch (as PyTorch's
    ``_step_microbatches`` takes them), which the executor uses as they are instead of
    splitting the whole batch along dimension 0."""

    parts: tuple[object, ...]


@dataclass(frozen=True)
class Measure:
    """What one step measures and keeps (``PipelineExecutor.step(measure=...)``).

    ``allocator``: the peak of the device allocator above what it held when the step began
    (:attr:`StepReport.peak_allocated_bytes`), a check of the swap manager's count that does
    not rely on it: the caching allocator's statistics on accelerators; on CPU torch's
    profiler with memory recording, which slows the step (about twofold in pipeswap-train).
    ``compute``: time each compute and its waits for copies (:attr:`StepReport.compute_seconds`,
    :attr:`StepReport.copy_wait_seconds`), the device synchronized around each, so slower:
    what :func:`~pipeswap.runtime.executor.measurements.measured_costs` makes a cost model
    of. ``layers`` (with activations accounted): every chunk held whole measured layer by
    layer (:attr:`StepReport.layer_held`, ``layer_inputs``), what a budget plans recompute
    on; a chunk with recomputed layers is always measured. ``outputs``: keep the last
    stage's output of each microbatch (detached) in :attr:`StepReport.outputs`."""

    allocator: bool = False
    compute: bool = False
    layers: bool = False
    outputs: bool = False
