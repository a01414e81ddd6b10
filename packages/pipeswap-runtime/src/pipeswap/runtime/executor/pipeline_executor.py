"""The executor: walks this rank's order of a pipeswap schedule, swap steps included.

Gradients are those of the **mean** of the microbatch losses: each microbatch's loss is
scaled by 1/M before its backward, so with equal microbatches and a loss that averages over
its batch, ``.grad`` equals that of the whole batch's loss on one device (``mean_loss=False``:
of their sum, each loss backpropagated as it is). Gradients accumulate in ``.grad``; zero
them between steps as usual.

With a data-parallel dimension (a 2-D device mesh, or a data-parallel group), each pipeline
replica runs the same schedule on its own data, and stages sharded with FSDP2's
``fully_shard`` over the data-parallel group are gathered, freed and reduced by the schedule's
UNSHARD, RESHARD and REDUCE_GRAD steps (:mod:`pipeswap.runtime.executor.sharded_stage`).

A step succeeds on every rank or fails on every rank: the rank that fails first (a refused
batch included) posts what failed and closes its connections, so its peers stop at once with
a :class:`~pipeswap.runtime.errors.PeerFailedError` naming it, and the step ends with an
agreement of all ranks (of the pipeline, then of the data-parallel group). After a failure,
:meth:`PipelineExecutor.recover` on every rank gives the executor a fresh communication
group; the next step then runs as if nothing had failed. A failure also closes the
data-parallel group (FSDP's collectives would wait on it forever otherwise), so with more than
one replica a failed step ends the run: restart it.

This module wires the parts together: :mod:`~pipeswap.runtime.executor.setup` (the schedule, checked
and agreed on by every rank; the transport; the boundary shapes),
:mod:`~pipeswap.runtime.executor.interpreter` (one step's order, a handler per step type),
:mod:`~pipeswap.runtime.executor.failure` (a failed step, and recover) and
:mod:`~pipeswap.runtime.executor.step_report` (:class:`StepReport` and the memory accounting).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import TYPE_CHECKING

from pipeswap.platform import AllocationPeak, Platform, get_platform
from pipeswap.runtime.executor import setup as _setup
from pipeswap.runtime.executor.failure import FailureProtocol
from pipeswap.runtime.executor.interpreter import Interpreter, LossFn, StepState
from pipeswap.runtime.distributed.transport import BoundaryMeta, PyTree, Transport
from pipeswap.runtime.executor.measurements import TIMED, StepTimes
from pipeswap.runtime.errors import PipelineError, PipelineSetupError
from pipeswap.runtime.executor.sharded_stage import ShardedStage
from pipeswap.runtime.distributed.process_groups import group_timeout, only_gloo, operation_timeout, with_cpu_backend
from pipeswap.runtime.executor.host_reserve import SavedRecorder, host_reservation
from pipeswap.runtime.executor.replay import Replay
from pipeswap.runtime.executor.step_report import LayerMarks, MemoryAccount, StepReport, kept_on_device
from pipeswap.runtime.executor.swap_session import SwapSession
from pipeswap.runtime.executor.stage import PipelineStage
from pipeswap.runtime.distributed.peer_watch import PeerWatch, stop_groups
from pipeswap.schedule import (
    CostModel,
    PeakOutcome,
    Schedule,
    ScheduleSpec,
    Step,
    StepType,
    SwapPolicy,
    swapped_chunks,
)
from pipeswap.swap import PoolExhaustedError, SwapManager
from pipeswap.swap.layers import layer_hooks
from pipeswap.swap.recompute import recompute_hooks

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["LossFn", "PipelineExecutor", "StepReport"]

log = logging.getLogger(__name__)


class PipelineExecutor:
    """Runs ``schedule`` over this rank's ``stages``.

    ``schedule``: a :class:`Schedule` (used as given), a :class:`ScheduleSpec`, or a schedule
    name (``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``) built for this group's size, the
    stage count and ``microbatches``. ``swap``: inject swap steps (with ``swap_policy``; by
    default the peak policy, told each stage's layer count) and run them.
    ``swap_granularity``: for the default policy, ``"auto"`` (stream a chunk layer by layer
    wherever that lowers the peak more than swapping it whole), ``"chunk"`` or ``"layer"``.
    A streamed chunk's layers are its stage's :attr:`PipelineStage.layers`. Each rank plans
    its own swap steps only (no other rank waits on them).

    ``cost_model``: what this rank's compute and host link cost
    (:class:`~pipeswap.schedule.CostModel`; e.g. the compute times and chunk bytes a step
    without swap measured, and :func:`pipeswap.runtime.executor.measurements.probe_link`'s bandwidths), for
    the default policy to weigh copies against compute: it then swaps only what its copies
    can hide (unless a budget is set), where without one it takes the link to be infinitely
    fast. Refused, naming the figure, if a bandwidth or a compute time of this rank's is not
    finite and above zero. :attr:`predicted` holds what the plan expects (its peak and
    exposed copy on this rank's own timeline).

    ``account_activations``: collect every chunk's saved tensors through the swap manager, so
    that :class:`StepReport` gives the peak of saved activations and each chunk's bytes
    (default: only with ``swap``; a run without swap then costs nothing over plain autograd,
    and only swapped chunks go through the manager's hooks). ``check_transport``: the
    transport model the schedule must run under before anything runs: ``"nccl"`` (the
    default on every device, so a CPU run proves what NCCL needs: sends and receives paired
    in order, and each message posted alike on its two ends, in a batch on both or alone on
    both), ``"ordered"`` (in order only; the executor itself posts every operation through
    ``batch_isend_irecv``, so it runs such a schedule on NCCL too, but another runtime
    might not) or ``"tagged"`` (gloo only, for schedules built with the deferred lowering).

    ``measure_allocator``: also measure, in each step, the peak of the device allocator above
    what it held when the step began (:attr:`StepReport.peak_allocated_bytes`), a check of
    the swap manager's count that does not rely on it. On accelerators it reads the caching
    allocator's peak statistics (and resets them each step); on CPU it runs torch's profiler
    with memory recording through the step, which slows it (about twofold in pipeswap-train,
    more for smaller operations), so it is off by default. The attribute of that name may be
    changed between steps. ``measure_compute`` (an attribute, off by default): time each
    compute of a step and its waits for copies (:attr:`StepReport.compute_seconds`,
    :attr:`StepReport.copy_wait_seconds`), the device synchronized around each, so slower;
    what :func:`pipeswap.runtime.executor.measurements.measured_costs` makes a cost model of.
    ``measure_layers`` (an attribute, off by default; with ``account_activations``): measure
    every chunk held whole layer by layer (:attr:`StepReport.layer_held`, ``layer_inputs``),
    what a budget plans recompute on; a chunk with recomputed layers is always measured.
    ``keep_outputs`` (an attribute, off by default): keep the last stage's output of each
    microbatch (detached), in :attr:`outputs` after the step, as :attr:`losses` keeps each
    microbatch's loss (unscaled, detached) always.

    Data parallel: ``mesh``, a 2-D DeviceMesh with dimensions named ``"pp"`` and ``"dp"``
    (the stages' group must be ``mesh.get_group("pp")``), or ``dp_group``, the data-parallel
    group of this rank. Each replica passes its own batch. Stages sharded with
    ``fully_shard`` over that group (:func:`pipeswap.runtime.executor.sharded_stage.shard_stage`) make a
    schedule built here get FSDP steps; a schedule with FSDP steps needs every stage of
    this rank sharded.

    ``autocast_dtype`` (e.g. ``torch.bfloat16``): run every forward and its loss under
    ``torch.autocast`` to that dtype, the parameters staying in theirs (fp32 master
    weights); tensors between stages then cross in the dtype the stages output.

    ``replay``: run one rank of the pipeline alone, in this process, without
    torch.distributed (:mod:`pipeswap.runtime.executor.replay`): ``stages`` are that rank's, what it
    would receive is made here and what it would send is dropped; everything else runs as
    in the full pipeline. Not with data parallel or FSDP.

    ``setup_check``: called first in the set-up every rank agrees on, so that a
    :class:`PipelineSetupError` it raises (a wrapper's check of its own arguments) fails the
    set-up on every rank, not on this one alone while the others wait.

    ``failure_timeout_s``: how long a rank this one exchanges data with may show no sign of
    life before the step fails naming it (:mod:`pipeswap.runtime.distributed.peer_watch`). A watch runs
    wherever the group is not gloo alone (NCCL: operations there do not fail when a peer
    does), by default with the group's timeout, or wherever this is given. On NCCL the
    executor's own group then gets a long per-operation timeout, so that a long step is
    never killed for being long; on gloo, whose blocked waits only its own timeout ends,
    half again ``failure_timeout_s``, the error then naming the rank that went silent.
    Without it, on gloo, a transfer fails after the group's timeout.
    """

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        schedule: Schedule | ScheduleSpec | str,
        microbatches: int,
        loss_fn: LossFn | None,
        *,
        swap: bool = False,
        swap_policy: SwapPolicy | None = None,
        platform: Platform | None = None,
        manager: SwapManager | None = None,
        account_activations: bool | None = None,
        check_transport: str = "nccl",
        measure_allocator: bool = False,
        mesh: DeviceMesh | None = None,
        dp_group: dist.ProcessGroup | None = None,
        autocast_dtype: torch.dtype | None = None,
        swap_granularity: str = "auto",
        replay: Replay | None = None,
        failure_timeout_s: float | None = None,
        cost_model: CostModel | None = None,
        mean_loss: bool = True,
        setup_check: Callable[[], None] | None = None,
    ) -> None:
        import torch.distributed as dist

        if not stages:
            raise PipelineSetupError("no stages: give this rank's PipelineStage objects")
        self.replay = replay
        if replay is not None:
            if mesh is not None or dp_group is not None:
                raise PipelineSetupError("a replay runs one pipeline rank alone: no mesh or "
                                         "dp_group (replay one replica's rank without FSDP)")
        elif not dist.is_initialized():
            raise PipelineSetupError(
                "torch.distributed is not initialized: launch with torchrun, or use "
                "pipeswap.runtime.distributed.launch.spawn, or call init_process_group first")
        self.stages = sorted(stages, key=lambda s: s.stage_index)
        self.group: dist.ProcessGroup | None = self.stages[0].group
        self.rank = replay.rank if replay else dist.get_rank(self.group)
        self.world = replay.ranks if replay else dist.get_world_size(self.group)
        self.num_stages = self.stages[0].num_stages
        self.microbatches = microbatches
        self.platform = platform or get_platform()
        self.account = swap if account_activations is None else account_activations
        self.measure_allocator = measure_allocator
        self.measure_compute = False
        self.measure_layers = False
        self.keep_outputs = False
        # the last step's per-microbatch losses (unscaled, detached) and, with keep_outputs,
        # the last stage's outputs (detached): on the rank of the last stage
        self.losses: list[torch.Tensor] = []
        self.outputs: list[PyTree] = []
        self.dp_group = _setup.data_parallel_group(mesh, dp_group, self.group)
        self.dp_size = 1 if self.dp_group is None else dist.get_world_size(self.dp_group)
        self._spans_world = replay is not None or self.world == dist.get_world_size()
        # the groups of the control traffic (CPU tensors): the caller's or gloo ones
        self._control, self._dp_control = _setup.control_groups(
            self.group, self.dp_group, self.dp_size, spans_world=self._spans_world,
            replay=replay)
        self._sharded: dict[int, ShardedStage] = {}
        built: Schedule | None = None
        # what the default policy expects of this rank's plan: its peak and exposed copy
        self.predicted: PeakOutcome | None = None
        problem: PipelineSetupError | None = None
        try:
            if setup_check is not None:
                setup_check()
            _setup.check_stages_run_here(self.stages, self.platform.device, loss_fn)
            layer_counts = _setup.own_layer_counts(self.stages, replay)
            _setup.check_transport(check_transport, self.group, replay)
            self._sharded = _setup.find_sharded(self.stages, self.dp_group, self.dp_size, replay)
            built, self.predicted = _setup.resolve_schedule(
                schedule, swap=swap, swap_policy=swap_policy, swap_granularity=swap_granularity,
                transport=check_transport, layer_counts=layer_counts, stages=self.stages,
                rank=self.rank, world=self.world, microbatches=microbatches,
                sharded=self._sharded, costs=cost_model)
        except PipelineSetupError as exc:
            problem = exc
        _setup.agree(built, problem, microbatches=microbatches, group=self._control,
                     dp_group=self._dp_control, dp_size=self.dp_size, replay=replay)
        assert built is not None
        self.schedule = built
        self.manager = manager or SwapManager(self.platform)
        for stage in self.stages:
            self.manager.protect_module(stage.module)
        self._watch: PeerWatch | None = None
        self._operation_timeout: datetime.timedelta | None = None
        # what a failure stops on this rank: the transport's group, the data-parallel ones
        self._stopped: list[dist.ProcessGroup | None] = [None]
        if self.dp_size > 1:
            self._stopped += list(dict.fromkeys([self._dp_control, self.dp_group]))
        gloo = replay is None and only_gloo(with_cpu_backend(self.group))
        if replay is None and (failure_timeout_s is not None or not gloo):
            detection = (group_timeout(self.group) if failure_timeout_s is None
                         else datetime.timedelta(seconds=failure_timeout_s))
            self._operation_timeout = operation_timeout(detection, gloo=gloo)
            self._watch = PeerWatch(
                dist.get_rank(), _setup.neighbours(built, self.rank, self.group,
                                                   self.dp_group),
                detection.total_seconds(), partial(stop_groups, self._stopped))
            weakref.finalize(self, self._watch.close)
        self.transport: Transport = self._new_transport(None)
        self._failure = FailureProtocol(self.rank, self._dp_control, self.dp_size,
                                        replayed=replay is not None,
                                        spans_world=self._spans_world,
                                        stopped=self._stopped)
        self._input_meta: BoundaryMeta | None = None
        self._shapes_known = False
        self._runs = 0
        self.swapped = set(swapped_chunks(self.schedule)[self.rank])
        # the chunks that stream, with their layer lag
        self.streamed = {step.key: step.lag for step in self.schedule.orders[self.rank]
                         if step is not None and step.type is StepType.SWAP_STREAM_OFFLOAD}
        # the chunks with recomputed layers, and which (RC steps, before their forwards)
        self.recomputed = {step.key: frozenset(step.layers or ())
                           for step in self.schedule.orders[self.rank]
                           if step is not None and step.type is StepType.RECOMPUTE}
        self._interpreter = Interpreter(
            {stage.stage_index: stage for stage in self.stages}, rank=self.rank,
            microbatches=microbatches, loss_fn=loss_fn, mean_loss=mean_loss,
            manager=self.manager,
            device=self.platform.device, autocast_dtype=autocast_dtype, swapped=self.swapped,
            recomputed=self.recomputed, sharded=self._sharded)
        # the hooks hold these, never the executor
        active, recomputing = self._interpreter.active, self._interpreter.recomputing
        self._hooks = [layer_hooks(stage.layers, partial(active.get, stage.stage_index))
                       for stage in self.stages
                       if any(key[0] == stage.stage_index for key in self.streamed)]
        marks = self._interpreter.layer_marks  # chunks measured per layer (measure_layers)
        self._hooks += [recompute_hooks(
            self.manager, stage.layers, partial(recomputing.get, stage.stage_index),
            partial(_layer_started, self.manager, marks, stage.stage_index))
            for stage in self.stages
            if self.account or any(key[0] == stage.stage_index for key in self.recomputed)]
        self._hooks_finalizer = weakref.finalize(self, _remove_all, self._hooks)
        self._closed = False

    def close(self) -> None:
        """Remove the layer hooks this executor put on its stages (the stages may then serve
        another executor), stop its watch and free the communication groups it made (on
        NCCL each holds a communicator's device memory); the executor cannot step after
        this. Close it on every rank after the same last step."""
        self._hooks_finalizer()
        if self._watch is not None:
            self._watch.close()
        if not self._closed and self.replay is None:
            made = [self.transport.group, *(mine for mine, theirs in (
                (self._control, self.group), (self._dp_control, self.dp_group))
                if mine is not theirs)]
            _setup.free_groups(made, spans_world=self._spans_world)
        self._closed = True

    @property
    def gathered_bytes(self) -> dict[int, int]:
        """Per stage of this rank sharded with FSDP: the bytes its UNSHARD gathers (its
        parameters at full size), as the simulator's parameter bytes take them."""
        return {index: sharded.gathered_bytes for index, sharded in self._sharded.items()}

    @property
    def loss_fn(self) -> LossFn | None:
        """The loss function of the last stage's output and the targets."""
        return self._interpreter.loss_fn

    @loss_fn.setter
    def loss_fn(self, loss_fn: LossFn | None) -> None:
        self._interpreter.loss_fn = loss_fn

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype forwards autocast to; None: no autocast."""
        return self._interpreter.autocast_dtype

    @autocast_dtype.setter
    def autocast_dtype(self, dtype: torch.dtype | None) -> None:
        self._interpreter.autocast_dtype = dtype

    def _new_transport(self, boundary: dict[int, BoundaryMeta] | None) -> Transport:
        transport = _setup.new_transport(
            self.schedule, microbatches=self.microbatches, device=self.platform.device,
            group=self.group, dp_group=self._dp_control, dp_size=self.dp_size,
            spans_world=self._spans_world, replay=self.replay, boundary=boundary,
            timeout=self._operation_timeout)
        self._stopped[0] = transport.group
        return transport

    def recover(self) -> None:
        """After a failed step, on every rank: replace the broken communication group with a
        fresh one. The failed step left no swap group, transfer or host buffer behind, and
        sharded stages are reset (FSDP drops what the step left in flight), so the next step
        (gradients zeroed as usual) gives what it would have without the failure. Collective
        over the pipeline's ranks. Not possible with more than one data-parallel replica:
        the failure closed the data-parallel group, which FSDP needs."""
        self.transport = self._failure.recover(
            self.transport, self._sharded.values(),
            partial(self._new_transport, self.transport.boundary))

    # -- one step --------------------------------------------------------------------------

    def step(self, inputs: PyTree | None = None, targets: PyTree | None = None) -> StepReport:
        """Run every microbatch of one batch forward and backward.

        ``inputs`` is needed on the rank of the first stage, ``targets`` on the rank of the
        last (other ranks may pass them too; they are ignored).
        """
        if self._closed:
            raise PipelineError(f"rank {self.rank}: this executor was closed; build a new one")
        self._failure.check_ready()
        start = time.perf_counter()
        measuring: AbstractContextManager[AllocationPeak | None] = (
            self.platform.measure_allocations() if self.measure_allocator else nullcontext())
        skipped = self.manager.stats().skipped if self._runs == 0 and self.swapped else None
        with measuring as allocated:
            state = self._step(inputs, targets)
        if skipped is not None:  # said once a run: the same every step
            line = kept_on_device(self.rank, skipped, self.manager.stats().skipped)
            if line is not None:
                log.info(line)
        # The step's device work included (nothing else waits for it on a rank without the
        # last stage, whose end-of-step agreement runs on the host).
        self.platform.current_stream().synchronize()
        self.losses = [state.losses[m] for m in sorted(state.losses)]
        self.outputs = [state.outputs[m] for m in sorted(state.outputs)]
        losses: list[float] = []
        if state.losses:  # one host sync for all of them
            import torch

            losses = torch.stack([state.losses[m] for m in sorted(state.losses)]).tolist()
        report = state.memory.report(
            losses=tuple(losses), seconds=time.perf_counter() - start,
            swapped_chunks=len(self.swapped),
            peak_allocated_bytes=None if allocated is None else allocated.peak_bytes)
        if state.times is None:
            return report
        return dataclasses.replace(report, compute_seconds=state.times.means(),
                                   copy_wait_seconds=state.times.copy_wait)

    def _step(self, inputs: PyTree | None, targets: PyTree | None) -> StepState:
        """The step up to closing its swap session (the part measure_allocator measures)."""
        self._runs += 1
        session = SwapSession(self.manager, f"x{id(self):x}.run{self._runs}")
        state = StepState(self._runs, self.transport, session,
                          MemoryAccount.begin(self.manager, self.account))
        at: Step | str | None = "its batch check"
        if self._watch is not None:
            assert self.transport.board is not None
            self._watch.arm(self.transport.board)
        try:
            # No collective first: a rank refusing its batch fails the step like any other
            # failure, and its peers stop at their first transfer with it.
            self._interpreter.take_batch(state, inputs, targets, self._input_meta)
            if not self._shapes_known:
                at = "the exchange of stage boundary shapes"
                # what the swapped stages' forwards save, to reserve the host buffers for
                recorder = (SavedRecorder(self.manager, {key[0] for key in self.swapped})
                            if self.swapped else None)
                _setup.exchange_shapes(
                    state.micro_inputs[0] if state.micro_inputs else None, self.transport,
                    schedule=self.schedule, rank=self.rank, stages=self._interpreter.stages,
                    sharded=self._sharded, device=self.platform.device,
                    autocast=self._interpreter.autocast, recorder=recorder,
                    target=state.micro_targets[0] if state.micro_targets else None,
                    loss_fn=self._interpreter.loss_fn)
                if recorder is not None:
                    at = "the reservation of host buffers"
                    self._reserve(host_reservation(self.schedule, self.rank, recorder.sizes))
                self._shapes_known = True
                if state.micro_inputs:
                    self._input_meta = BoundaryMeta.of(state.micro_inputs[0], "the inputs")[0]
            times = StepTimes() if self.measure_compute else None
            self._interpreter.measure_layers = self.measure_layers and self.account
            self._interpreter.keep_outputs = self.keep_outputs
            for at in self.schedule.orders[self.rank]:
                if at is None:
                    continue
                if times is None or at.type not in TIMED:
                    self._interpreter.run(state, at)
                    continue
                compute = self.platform.current_stream()
                compute.synchronize()  # the device's time, not the launch's
                begun = time.perf_counter()
                self._interpreter.run(state, at)
                compute.synchronize()
                times.record(at, time.perf_counter() - begun)
            state.times = times
            at = None
            self._interpreter.finish(state)
            state.memory.flush()
            if self._watch is not None and self._watch.reason is not None:
                raise self.transport.failure("the end of the step", RuntimeError("stopped"))
            self._failure.agree(self.transport, "the end-of-step agreement",
                                self.transport.group)
            if self.dp_size > 1:
                self._failure.agree(
                    self.transport, "the end-of-step agreement of the data-parallel group",
                    self._dp_control)
        except BaseException as exc:
            if self._watch is not None:
                self._watch.disarm()
            where = f"{at if at is not None else 'the end'} of step {self._runs}"
            self._failure.fail(exc, where, self.transport)
            try:
                state.session.close()
            except Exception as close_exc:  # noqa: BLE001 - the step's error is the one to see
                warnings.warn(f"closing the swap session after a failed step also failed: "
                              f"{close_exc}", stacklevel=2)
            raise
        if self._watch is not None:
            self._watch.disarm()
            if self._watch.reason is not None:  # found as the step ended: groups stopped
                self._failure.reason = f"after step {self._runs}: {self._watch.reason}"
        state.session.close()
        return state

    def _reserve(self, sizes: list[int]) -> None:
        """Pin the host buffers the plan needs before the first step of the order runs. A
        bound (each microbatch saves what the dry run saved; streamed chunks counted whole):
        where the pool's cap cannot hold it, the step pins as it goes instead, as it would
        without a reservation."""
        try:
            self.manager.reserve_host(sizes)
        except PoolExhaustedError as exc:
            warnings.warn(f"rank {self.rank}: the host buffers of the swap plan were not "
                          f"reserved before the first step ({exc}); they are pinned as the "
                          "steps need them", stacklevel=3)


def _layer_started(manager: SwapManager, marks: dict[int, LayerMarks], stage: int,
                   index: int, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
    """A layer of a chunk held whole and measured began: note what its group holds, and the
    bytes of the storages the layer is called with."""
    import torch
    from torch.utils._pytree import tree_leaves

    found = marks.get(stage)
    if found is not None:
        found.held.append(manager.group_bytes(found.group).held)
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                    for t in tree_leaves((args, kwargs))
                    if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)}
        found.inputs.append(sum(storages.values()))


def _remove_all(removers: list[Callable[[], None]]) -> None:
    for remove in removers:
        remove()
