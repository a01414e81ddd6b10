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
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import TYPE_CHECKING

from pipeswap.platform import AllocationPeak, Platform, get_platform
from pipeswap.runtime.distributed.failure_board import UnclonableStore
from pipeswap.runtime.distributed.peer_watch import GroupStopper, PeerWatch
from pipeswap.runtime.distributed.process_groups import (
    control_groups,
    data_parallel_group,
    free_groups,
    group_timeout,
    only_gloo,
    operation_timeout,
    with_cpu_backend,
)
from pipeswap.runtime.distributed.transport import BoundaryMeta, PyTree, Transport
from pipeswap.runtime.errors import PipelineError, PipelineSetupError
from pipeswap.runtime.executor import setup as _setup
from pipeswap.runtime.executor.failure import FailureProtocol
from pipeswap.runtime.executor.host_reserve import SavedRecorder, host_reservation
from pipeswap.runtime.executor.interpreter import (
    Interpreter,
    LossFn,
    StepState,
    finish_order,
    take_batch,
)
from pipeswap.runtime.executor.measurements import TIMED, StepTimes
from pipeswap.runtime.executor.options import (
    DataParallel,
    FailureHandling,
    Measure,
    Microbatches,
    Numerics,
    SwapOptions,
)
from pipeswap.runtime.executor.replay import Replay
from pipeswap.runtime.executor.sharded_stage import ShardedStage
from pipeswap.runtime.executor.stage import PipelineStage
from pipeswap.runtime.executor.step_report import (
    LayerMarks,
    MemoryAccount,
    StepReport,
    kept_on_device,
)
from pipeswap.runtime.executor.swap_session import SwapSession
from pipeswap.schedule import (
    COMPUTE,
    RankPlan,
    Schedule,
    ScheduleSpec,
    Step,
    StepType,
    Order,
    TransportModel,
    forward_order,
    swapped_chunks,
)
from pipeswap.swap import PoolExhaustedError, SwapManager, layer_hooks, recompute_hooks

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["LossFn", "PipelineExecutor", "StepReport"]

log = logging.getLogger(__name__)


class PipelineExecutor:
    """Runs ``schedule`` over this rank's ``stages``.

    ``schedule``: a :class:`Schedule` (used as given), a :class:`ScheduleSpec`, or a schedule
    name (a :class:`~pipeswap.schedule.ScheduleKind` value: ``"gpipe"``, ``"1f1b"``, ...)
    built for this group's size, the stage count and ``microbatches``. ``swap``: inject swap
    steps and run them, as :class:`SwapOptions` says (``True``: the default options). :attr:`plan`
    is what the swap pass decided for this rank (:class:`~pipeswap.schedule.RankPlan`: the chunks
    swapped or streamed, the layers recomputed, and what the policy expects: its peak and exposed
    copy), None where the executor planned no swap.

    ``count_activations``: collect every chunk's saved tensors through the swap manager, so
    that :class:`StepReport` gives the peak of saved activations and each chunk's bytes
    (default: only with swap; a run without swap then costs nothing over plain autograd).
    ``check_transport``: the transport model the schedule must run under before anything
    runs: ``"nccl"`` (the default on every device, so a CPU run proves what NCCL needs:
    sends and receives paired in order, and each message posted alike on its two ends),
    ``"ordered"`` (in order only) or ``"tagged"`` (gloo only, for schedules built with the
    deferred lowering). ``data_parallel``, ``failure`` and ``numerics``: see
    :class:`DataParallel`, :class:`FailureHandling` and :class:`Numerics`.

    ``replay``: run one rank of the pipeline alone, in this process, without
    torch.distributed (:mod:`pipeswap.runtime.executor.replay`): ``stages`` are that rank's,
    what it would receive is made here and what it would send is dropped; everything else
    runs as in the full pipeline. Not with data parallel or FSDP.
    """

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        schedule: Schedule | ScheduleSpec | str,
        microbatches: int,
        loss_fn: LossFn | None,
        *,
        swap: bool | SwapOptions = False,
        count_activations: bool | None = None,
        check_transport: TransportModel = "nccl",
        data_parallel: DataParallel | None = None,
        failure: FailureHandling | None = None,
        numerics: Numerics | None = None,
        platform: Platform | None = None,
        replay: Replay | None = None,
    ) -> None:
        import torch.distributed as dist

        swapping = SwapOptions() if swap is True else swap or None
        parallel, failure = data_parallel or DataParallel(), failure or FailureHandling()
        numerics = numerics or Numerics()
        _check_distributed(stages, parallel, replay)
        self.replay = replay
        self.stages = sorted(stages, key=lambda s: s.stage_index)
        self.group: dist.ProcessGroup | None = self.stages[0].group
        self.rank = replay.rank if replay else dist.get_rank(self.group)
        self.world = replay.ranks if replay else dist.get_world_size(self.group)
        self.num_stages = self.stages[0].num_stages
        self.microbatches = microbatches
        self.platform = platform or get_platform()
        self.account = swapping is not None if count_activations is None else count_activations
        self.dp_group = data_parallel_group(parallel.mesh, parallel.group, self.group)
        self.dp_size = 1 if self.dp_group is None else dist.get_world_size(self.dp_group)
        self._spans_world = replay is not None or self.world == dist.get_world_size()
        # the groups of the control traffic (CPU tensors): the caller's or gloo ones
        self._control, self._dp_control = control_groups(
            self.group, self.dp_group, self.dp_size, spans_world=self._spans_world,
            replayed=replay is not None)
        self._sharded: dict[int, ShardedStage] = {}
        self.schedule, self.plan = self._agreed_schedule(
            schedule, swapping, check_transport, failure, loss_fn)
        self.manager = (swapping.manager if swapping is not None and swapping.manager
                        else None) or SwapManager(self.platform)
        for stage in self.stages:
            self.manager.protect_module(stage.module)
        # what a failure stops on this rank: the transport's group, the data-parallel ones
        self._stopper = GroupStopper([None, *dict.fromkeys(
            [self._dp_control, self.dp_group] if self.dp_size > 1 else [])])
        self._watch, self._operation_timeout = _start_watch(self, failure.timeout_s)
        self.transport: Transport = self._new_transport(None)
        self._failure = FailureProtocol(self.rank, self._dp_control, self.dp_size,
                                        replayed=replay is not None,
                                        spans_world=self._spans_world,
                                        stopper=self._stopper)
        self._input_meta: BoundaryMeta | None = None
        self._shapes_known = False
        self._runs = 0
        order = self.schedule.orders[self.rank]
        self.swapped = set(swapped_chunks(self.schedule)[self.rank])
        # the chunks that stream, with their layer lag
        self.streamed = {step.key: step.lag for step in order
                         if step is not None and step.type is StepType.SWAP_STREAM_OFFLOAD}
        # the chunks with recomputed layers, and which (RC steps, before their forwards)
        self.recomputed = {step.key: frozenset(step.layers or ()) for step in order
                           if step is not None and step.type is StepType.RECOMPUTE}
        self._interpreter = Interpreter(
            {stage.stage_index: stage for stage in self.stages}, rank=self.rank,
            microbatches=microbatches, loss_fn=loss_fn, mean_loss=numerics.mean_loss,
            manager=self.manager, device=self.platform.device,
            autocast_dtype=numerics.autocast_dtype, swapped=self.swapped,
            recomputed=self.recomputed, sharded=self._sharded)
        self._hooks_finalizer = weakref.finalize(self, _remove_all, _layer_hooks(self))
        self._closed = False

    def _agreed_schedule(self, schedule: Schedule | ScheduleSpec | str,
                         swap: SwapOptions | None, transport: TransportModel,
                         failure: FailureHandling, loss_fn: LossFn | None
                         ) -> tuple[Schedule, RankPlan | None]:
        """The schedule this rank runs, checked here and agreed on by every rank (a problem
        one rank finds raises on all), with this rank's swap plan."""
        built: Schedule | None = None
        plan: RankPlan | None = None
        problem: PipelineSetupError | None = None
        try:
            if failure.setup_check is not None:
                failure.setup_check()
            _setup.check_stages_run_here(self.stages, self.platform.device, loss_fn)
            layer_counts = _setup.own_layer_counts(self.stages, self.replay)
            _setup.check_transport(transport, self.group, self.replay)
            self._sharded = _setup.find_sharded(self.stages, self.dp_group, self.dp_size,
                                                self.replay)
            built, plan = _setup.resolve_schedule(
                schedule, swap=swap, transport=transport, layer_counts=layer_counts,
                stages=self.stages, rank=self.rank, world=self.world,
                microbatches=self.microbatches, sharded=self._sharded)
        except PipelineSetupError as exc:
            problem = exc
        _setup.agree_on_schedule(built, problem, microbatches=self.microbatches,
                                 group=self._control, dp_group=self._dp_control,
                                 dp_size=self.dp_size, replay=self.replay,
                                 agreed=failure.agreed)
        assert built is not None
        return built, plan

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
            free_groups(made, spans_world=self._spans_world)
        self._closed = True

    @property
    def gathered_bytes(self) -> dict[int, int]:
        """Per stage of this rank sharded with FSDP: the bytes its UNSHARD gathers (its
        parameters at full size), as the simulator's parameter bytes take them."""
        return {index: sharded.gathered_bytes for index, sharded in self._sharded.items()}

    def _new_transport(self, boundary: dict[int, BoundaryMeta] | None) -> Transport:
        transport = _setup.new_transport(
            self.schedule, microbatches=self.microbatches, device=self.platform.device,
            group=self.group, dp_group=self._dp_control, dp_size=self.dp_size,
            spans_world=self._spans_world, replay=self.replay, boundary=boundary,
            timeout=self._operation_timeout, stopper=self._stopper)
        self._stopper.renew(transport.group)
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

    def step(self, inputs: PyTree | Microbatches | None = None,
             targets: PyTree | Microbatches | None = None, *,
             measure: Measure = Measure(), loss_kwargs: Mapping[str, object] | None = None,
             stage_kwargs: Sequence[Mapping[str, object]] = ()) -> StepReport:
        """Run every microbatch of one batch forward and backward, measuring what
        ``measure`` asks; ``loss_kwargs`` go to the loss function with each microbatch's
        output and target, ``stage_kwargs`` (one mapping per microbatch, any values) to
        every stage of this rank with that microbatch.

        ``inputs`` is needed on the rank of the first stage, ``targets`` on the rank of the
        last (other ranks may pass them too; they are ignored): whole, split here along
        dimension 0, or already split (:class:`Microbatches`). The report holds the losses
        (and, with ``Measure(outputs=True)``, the last stage's outputs) on the last stage's
        rank.
        """
        return self._run(inputs, targets, measure, loss_kwargs, stage_kwargs,
                         forward_only=False)

    def evaluate(self, inputs: PyTree | Microbatches | None = None,
                 targets: PyTree | Microbatches | None = None, *,
                 measure: Measure = Measure(outputs=True),
                 loss_kwargs: Mapping[str, object] | None = None,
                 stage_kwargs: Sequence[Mapping[str, object]] = ()) -> StepReport:
        """Every microbatch of one batch forward only, without autograd, swap or recompute:
        the step's forwards in its order, so outputs and losses are a step's bit for bit.
        ``targets`` are optional: without them no loss. Every rank calls it, as ``step``."""
        return self._run(inputs, targets, measure, loss_kwargs, stage_kwargs,
                         forward_only=True)

    def _run(self, inputs: PyTree | Microbatches | None,
             targets: PyTree | Microbatches | None, measure: Measure,
             loss_kwargs: Mapping[str, object] | None,
             stage_kwargs: Sequence[Mapping[str, object]], *, forward_only: bool
             ) -> StepReport:
        """A step or an evaluation, and its report."""
        if self._closed:
            raise PipelineError(f"rank {self.rank}: this executor was closed; build a new one")
        self._failure.check_ready()
        start = time.perf_counter()
        measuring: AbstractContextManager[AllocationPeak | None] = (
            self.platform.measure_allocations() if measure.allocator else nullcontext())
        skipped = self.manager.stats().skipped if self._runs == 0 and self.swapped else None
        with measuring as allocated:
            state = self._step(inputs, targets, measure, loss_kwargs, stage_kwargs,
                               forward_only)
        if skipped is not None:  # said once a run: the same every step
            line = kept_on_device(self.rank, skipped, self.manager.stats().skipped)
            if line is not None:
                log.info(line)
        return _report(state, time.perf_counter() - start, allocated,
                       0 if forward_only else len(self.swapped))

    def _step(self, inputs: PyTree | Microbatches | None,
              targets: PyTree | Microbatches | None, measure: Measure,
              loss_kwargs: Mapping[str, object] | None,
              stage_kwargs: Sequence[Mapping[str, object]], forward_only: bool) -> StepState:
        """The step up to closing its swap session (the part Measure.allocator measures)."""
        self._runs += 1
        session = SwapSession(self.manager, f"x{id(self):x}.run{self._runs}")
        loss_fn = self._interpreter.loss_fn
        state = StepState(self._runs, self.transport, session,
                          MemoryAccount.begin(self.manager, self.account and not forward_only),
                          loss_fn=partial(loss_fn, **loss_kwargs) if loss_kwargs and loss_fn
                          else loss_fn,
                          keep_outputs=measure.outputs,
                          measure_layers=measure.layers and not forward_only,
                          micro_kwargs=stage_kwargs, forward_only=forward_only)
        state.at = "its batch check"
        if self._watch is not None:
            assert self.transport.board is not None
            self._watch.arm(self.transport.board)
        try:
            # No collective first: a rank refusing its batch fails the step like any other
            # failure, and its peers stop at their first transfer with it.
            if measure.layers and not self.account:
                raise PipelineSetupError(
                    "Measure(layers=True) measures the chunks' saved activations layer by "
                    "layer: build the executor with count_activations=True (or with swap)")
            take_batch(self._interpreter.stages, self.rank, self.microbatches, state, inputs,
                       targets, self._input_meta)
            if not self._shapes_known:
                state.at = "the exchange of stage boundary shapes"
                self._input_meta = _exchange_shapes(self, state)
                self._shapes_known = True
            order = self.schedule.orders[self.rank]
            _run_order(self, state, forward_order(order) if forward_only else order,
                       StepTimes() if measure.compute else None)
            state.at = None
            _end_step(self, state)
        except BaseException as exc:
            if self._watch is not None:
                self._watch.disarm()
            where = f"{state.at if state.at is not None else 'the end'} of step {self._runs}"
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


def _end_step(executor: PipelineExecutor, state: StepState) -> None:
    """After the order: sends done, receives consumed, every rank agreeing that the step ran
    (the pipeline's, then the data-parallel group's), and the step's device work done."""
    finish_order(state, executor.rank)
    state.memory.flush()
    _check_watch(executor, "the end of the step")
    failure, transport = executor._failure, executor.transport
    failure.agree(transport, "the end-of-step agreement", transport.group)
    if executor.dp_size > 1:
        failure.agree(transport, "the end-of-step agreement of the data-parallel group",
                      executor._dp_control)
    # The step's device work included, the watch still armed: the agreement runs on the
    # host, and a neighbour lost after it may leave a receive's kernel waiting, which only
    # the watch's abort releases.
    state.at = "the step's last device work"
    executor.platform.current_stream().synchronize()
    _check_watch(executor, "the step's last device work")
    state.at = None


def _check_watch(executor: PipelineExecutor, where: str) -> None:
    """Fail the step where the watch found a failure (and stopped the groups)."""
    watch = executor._watch
    if watch is not None and watch.reason is not None:
        raise executor.transport.failure(where, RuntimeError("stopped"))


def _report(state: StepState, seconds: float, allocated: AllocationPeak | None,
            swapped: int) -> StepReport:
    """What a step did on this rank: its losses (read in one host sync), counts, measures,
    and the outputs it kept."""
    import torch

    tensors = tuple(state.losses[m] for m in sorted(state.losses))
    losses: list[float] = torch.stack(tensors).tolist() if tensors else []
    report = dataclasses.replace(
        state.memory.report(losses=tuple(losses), seconds=seconds, swapped_chunks=swapped,
                            peak_allocated_bytes=None if allocated is None
                            else allocated.peak_bytes),
        loss_tensors=tensors, outputs=tuple(state.outputs[m] for m in sorted(state.outputs)))
    if state.times is None:
        return report
    return dataclasses.replace(report, compute_seconds=state.times.means(),
                               copy_wait_seconds=state.times.copy_wait)


def _run_order(executor: PipelineExecutor, state: StepState, order: Order,
               times: StepTimes | None) -> None:
    """Run ``order`` (``state.at``: the step running); with ``times``, each compute
    timed, the device synchronized around it."""
    for step in order:
        if step is None:
            continue
        state.at = step
        if times is None or step.type not in TIMED:
            executor._interpreter.run(state, step)
            continue
        _inputs_ready(executor, state, step)  # the waits are other ranks' time, not ours
        compute = executor.platform.current_stream()
        compute.synchronize()  # the device's time, not the launch's
        begun = time.perf_counter()
        executor._interpreter.run(state, step)
        compute.synchronize()
        times.record(step, time.perf_counter() - begun)
    state.times = times


def _inputs_ready(executor: PipelineExecutor, state: StepState, step: Step) -> None:
    """Wait for what a timed compute receives (its activation, or its gradient) and for its
    stage's parameter gather before its clock starts, so that a slow neighbour or replica
    does not pass for a slow compute."""
    if step.type in COMPUTE and executor._sharded:
        executor._interpreter.parameters_ready(state, step)
    kind = {StepType.FWD: StepType.FWD_RECV, StepType.BWD: StepType.BWD_RECV,
            StepType.BWD_INPUT: StepType.BWD_RECV}.get(step.type)
    if kind is None:
        return
    transfer = state.receives.get((kind, step.key))
    if transfer is not None:  # waited once (a gloo receive cannot be waited for twice)
        state.receives[kind, step.key] = dataclasses.replace(
            transfer, works=[], tensors=state.transport.wait(transfer))


def _exchange_shapes(executor: PipelineExecutor, state: StepState) -> BoundaryMeta | None:
    """Before the first step's order: every stage boundary's shapes, exchanged, and the
    host buffers the swap plan needs, reserved; returns what the first stage's inputs
    hold (None on other ranks), which later batches must keep."""
    import torch

    # what the swapped stages' forwards save, to reserve the host buffers for
    recorder = (SavedRecorder(executor.manager, {key[0] for key in executor.swapped})
                if executor.swapped else None)
    with torch.enable_grad():  # which tensors carry a gradient, even from an evaluation
        _setup.exchange_shapes(
            state.micro_inputs[0] if state.micro_inputs else None, executor.transport,
            schedule=executor.schedule, rank=executor.rank,
            stages=executor._interpreter.stages, sharded=executor._sharded,
            device=executor.platform.device, autocast=executor._interpreter.autocast,
            recorder=recorder, target=state.micro_targets[0] if state.micro_targets else None,
            loss_fn=state.loss_fn, kwargs=state.micro_kwargs[0] if state.micro_kwargs else None)
    if recorder is not None:
        state.at = "the reservation of host buffers"
        _reserve(executor.manager, executor.rank,
                 host_reservation(executor.schedule, executor.rank, recorder.sizes))
    if not state.micro_inputs:
        return None
    return BoundaryMeta.of(state.micro_inputs[0], "the inputs")[0]


def _start_watch(executor: PipelineExecutor, timeout_s: float | None
                 ) -> tuple[PeerWatch | None, datetime.timedelta | None]:
    """The peer watch where operations do not fail by themselves (anything but gloo
    alone) or where a failure timeout is asked for, and the operation timeout of the
    executor's own group that goes with it."""
    import torch.distributed as dist

    gloo = executor.replay is None and only_gloo(with_cpu_backend(executor.group))
    if executor.replay is not None or (timeout_s is None and gloo):
        return None, None
    peers = _setup.neighbours(executor.schedule, executor.rank, executor.group,
                              executor.dp_group)
    if set(peers) <= {dist.get_rank()}:  # a rank alone: nobody to watch
        return None, None
    detection = (group_timeout(executor.group) if timeout_s is None
                 else datetime.timedelta(seconds=timeout_s))
    try:
        watch = PeerWatch(dist.get_rank(), peers, detection.total_seconds(),
                          executor._stopper.stop)
    except UnclonableStore as exc:  # the same store on every rank: each degrades alike
        warnings.warn(
            f"rank {executor.rank}: no peer watch runs, as the rendezvous store cannot give "
            f"the watch connections of its own ({exc}); a failed peer then stops this rank "
            "only when its group's own timeout ends a transfer", stacklevel=4)
        return None, None
    weakref.finalize(executor, watch.close)
    return watch, operation_timeout(detection)


def _layer_hooks(executor: PipelineExecutor) -> list[Callable[[], None]]:
    """The hooks on the stages' layers: streaming where a chunk of the stage streams,
    recompute (and per-layer measurement) where it recomputes or activations are
    counted. The hooks hold the interpreter's tables, never the executor."""
    active, recomputing = executor._interpreter.active, executor._interpreter.recomputing
    marks = executor._interpreter.layer_marks  # chunks measured per layer
    hooks = [layer_hooks(stage.layers, partial(active.get, stage.stage_index))
             for stage in executor.stages
             if any(key[0] == stage.stage_index for key in executor.streamed)]
    hooks += [recompute_hooks(
        executor.manager, stage.layers, partial(recomputing.get, stage.stage_index),
        partial(_layer_started, executor.manager, marks, stage.stage_index))
        for stage in executor.stages
        if executor.account or any(key[0] == stage.stage_index for key in executor.recomputed)]
    return hooks


def _reserve(manager: SwapManager, rank: int, sizes: list[int]) -> None:
    """Pin the host buffers the plan needs before the first step of the order runs. A
    bound (each microbatch saves what the dry run saved; streamed chunks counted whole):
    where the pool's cap cannot hold it, the step pins as it goes instead, as it would
    without a reservation."""
    try:
        manager.reserve_host(sizes)
    except PoolExhaustedError as exc:
        warnings.warn(f"rank {rank}: the host buffers of the swap plan were not "
                      f"reserved before the first step ({exc}); they are pinned as the "
                      "steps need them", stacklevel=4)


def _check_distributed(stages: Sequence[PipelineStage], parallel: DataParallel,
                       replay: Replay | None) -> None:
    """Stages given, and torch.distributed ready unless the rank is replayed alone."""
    import torch.distributed as dist

    if not stages:
        raise PipelineSetupError("no stages: give this rank's PipelineStage objects")
    if replay is not None:
        if parallel.mesh is not None or parallel.group is not None:
            raise PipelineSetupError("a replay runs one pipeline rank alone: no data "
                                     "parallel (replay one replica's rank without FSDP)")
    elif not dist.is_initialized():
        raise PipelineSetupError(
            "torch.distributed is not initialized: launch with torchrun, or use "
            "pipeswap.runtime.spawn, or call init_process_group first")
    elif (dist.get_backend(stages[0].group) == "fake"
          and dist.get_world_size(stages[0].group) > 1):
        raise PipelineSetupError(
            "the process group is torch's 'fake' backend, whose collectives move no data: "
            "the executor's set-up needs the ranks to agree, so run on gloo (CPU) or nccl, "
            "or replay one rank alone (pipeswap.runtime.Replay)")


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
