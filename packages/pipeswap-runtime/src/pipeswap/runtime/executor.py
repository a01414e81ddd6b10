"""The executor: walks this rank's order of a pipeswap schedule, swap steps included.

Gradients are those of the **mean** of the microbatch losses: each microbatch's loss is
scaled by 1/M before its backward, so with equal microbatches and a loss that averages over
its batch, ``.grad`` equals that of the whole batch's loss on one device. Gradients
accumulate in ``.grad``; zero them between steps as usual.

With a data-parallel dimension (a 2-D device mesh, or a data-parallel group), each pipeline
replica runs the same schedule on its own data, and stages sharded with FSDP2's
``fully_shard`` over the data-parallel group are gathered, freed and reduced by the schedule's
UNSHARD, RESHARD and REDUCE_GRAD steps (:mod:`pipeswap.runtime.fsdp`).

A step succeeds on every rank or fails on every rank: the rank that fails first (a refused
batch included) posts what failed and closes its connections, so its peers stop at once with
a :class:`~pipeswap.runtime.errors.PeerFailedError` naming it, and the step ends with an
agreement of all ranks (of the pipeline, then of the data-parallel group). After a failure,
:meth:`PipelineExecutor.recover` on every rank gives the executor a fresh communication
group; the next step then runs as if nothing had failed. A failure also closes the
data-parallel group (FSDP's collectives would wait on it forever otherwise), so with more than
one replica a failed step ends the run: restart it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from pipeswap.platform import AllocationPeak, Platform, get_platform
from pipeswap.runtime.backward import ChunkAutograd, forward_chunk
from pipeswap.runtime.comm import (
    BoundaryMeta,
    FailureBoard,
    Transfer,
    Transport,
    all_gather_ints,
    break_links,
    flatten,
    group_timeout,
)
from pipeswap.runtime.errors import (
    PeerFailedError,
    PipelineCommError,
    PipelineError,
    PipelineSetupError,
)
from pipeswap.runtime.fsdp import ShardedStage, fsdp_modules
from pipeswap.runtime.microbatch import split_tree
from pipeswap.runtime.replay import Replay
from pipeswap.runtime.session import SwapSession
from pipeswap.runtime.stage import PipelineStage, output_meta
from pipeswap.schedule import (
    ChunkKey,
    Schedule,
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    Step,
    StepType,
    SwapPolicy,
    build_schedule,
    dumps_lines,
    swapped_chunks,
    validate,
)
from pipeswap.schedule.steps import COMPUTE, FSDP, OVERLAPS, P2P, SENDS
from pipeswap.schedule.validation import TRANSPORTS
from pipeswap.swap import GroupBytes, SwapManager
from pipeswap.swap.layers import LayerChain, layer_hooks

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from pipeswap.schedule.costs import StageCosts

LossFn = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]
_T = TypeVar("_T")


@dataclass(frozen=True)
class StepReport:
    """What one :meth:`PipelineExecutor.step` did on this rank."""

    losses: tuple[float, ...]  # per microbatch, on the rank of the last stage; else empty
    seconds: float
    # most device bytes held by saved activations at once; None unless the executor
    # accounts every chunk (account_activations)
    peak_activation_bytes: int | None
    bytes_offloaded: int
    swapped_chunks: int
    # per chunk of this rank, at the end of its forward: device bytes its saved activations
    # hold, and the part an offload moves (the rest is shared with protected tensors)
    chunk_bytes: Mapping[ChunkKey, GroupBytes]
    # the most bytes the device allocator held at once during the step, above what it held
    # when the step began: everything the step allocated, not only saved activations (see
    # Platform.measure_allocations for what each platform counts); None unless the step ran
    # with measure_allocator
    peak_allocated_bytes: int | None = None
    # per chunk whose backward is split, right after its I: the device bytes its saved
    # activations still hold for W (I frees the rest)
    chunk_bytes_after_input: Mapping[ChunkKey, int] = field(default_factory=dict)
    # most device bytes held at once by saved activations and gathered FSDP parameters (each
    # sharded stage's full parameter bytes from its UNSHARD to its RESHARD): what the
    # simulator's peak_memory_bytes predicts; equal to peak_activation_bytes without FSDP;
    # None unless the executor accounts every chunk
    peak_memory_bytes: int | None = None
    # per chunk that streams, per layer when the layer closed: what its group held and
    # could move (chunk_bytes holds their sums)
    layer_bytes: Mapping[ChunkKey, tuple[GroupBytes, ...]] = field(default_factory=dict)
    # per chunk that streams and splits its backward, per layer right after its I
    layer_bytes_after_input: Mapping[ChunkKey, tuple[int, ...]] = field(default_factory=dict)


@dataclass
class _Run:
    """The state of one step: what each chunk holds until its backward is done."""

    session: SwapSession
    chunks: dict[ChunkKey, ChunkAutograd] = field(default_factory=dict)  # forward to last B/W
    # per chunk: its input's gradients, for the tensors that carry one
    grads_in: dict[ChunkKey, list[torch.Tensor | None]] = field(default_factory=dict)
    receives: dict[tuple[StepType, ChunkKey], Transfer] = field(default_factory=dict)
    sends: list[Transfer] = field(default_factory=list)
    micro_inputs: list[Any] = field(default_factory=list)  # pytrees of tensors
    micro_targets: list[Any] = field(default_factory=list)
    losses: dict[int, torch.Tensor] = field(default_factory=dict)  # read once, at the end
    accounted: set[ChunkKey] = field(default_factory=set)  # chunks with a swap group
    chunk_bytes: dict[ChunkKey, GroupBytes] = field(default_factory=dict)
    chunk_bytes_after_input: dict[ChunkKey, int] = field(default_factory=dict)
    layer_bytes: dict[ChunkKey, tuple[GroupBytes, ...]] = field(default_factory=dict)
    layer_bytes_after_input: dict[ChunkKey, tuple[int, ...]] = field(default_factory=dict)
    offloaded_before: int = 0  # the manager's bytes_offloaded when the step began
    gathered: int = 0  # bytes of FSDP parameters gathered now
    peak_activations: int = 0  # the step's peaks so far (see PipelineExecutor._flush)
    peak_memory: int = 0


class PipelineExecutor:
    """Runs ``schedule`` over this rank's ``stages``.

    ``schedule``: a :class:`Schedule` (used as given), a :class:`ScheduleSpec`, or a schedule
    name (``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``) built for this group's size, the
    stage count and ``microbatches``. ``swap``: inject swap steps (with ``swap_policy``; by
    default the peak policy, told each stage's layer count) and run them.
    ``swap_granularity``: for the default policy, ``"auto"`` (stream a chunk layer by layer
    wherever that lowers the peak more than swapping it whole), ``"chunk"`` or ``"layer"``.
    A streamed chunk's layers are its stage's :attr:`PipelineStage.layers`.

    ``account_activations``: collect every chunk's saved tensors through the swap manager, so
    that :class:`StepReport` gives the peak of saved activations and each chunk's bytes
    (default: only with ``swap``; a run without swap then costs nothing over plain autograd,
    and only swapped chunks go through the manager's hooks). ``check_transport``: the
    transport model the schedule must run under before anything runs: ``"ordered"`` (NCCL's,
    the default on every device, so a CPU run proves what NCCL needs) or ``"tagged"`` (gloo
    only, for schedules built with the deferred lowering).

    ``measure_allocator``: also measure, in each step, the peak of the device allocator above
    what it held when the step began (:attr:`StepReport.peak_allocated_bytes`), a check of
    the swap manager's count that does not rely on it. On accelerators it reads the caching
    allocator's peak statistics (and resets them each step); on CPU it runs torch's profiler
    with memory recording through the step, which slows it (about twofold in pipeswap-train,
    more for smaller operations), so it is off by default. The attribute of that name may be
    changed between steps.

    Data parallel: ``mesh``, a 2-D DeviceMesh with dimensions named ``"pp"`` and ``"dp"``
    (the stages' group must be ``mesh.get_group("pp")``), or ``dp_group``, the data-parallel
    group of this rank. Each replica passes its own batch. Stages sharded with
    ``fully_shard`` over that group (:func:`pipeswap.runtime.fsdp.shard_stage`) make a
    schedule built here get FSDP steps; a schedule with FSDP steps needs every stage of
    this rank sharded.

    ``autocast_dtype`` (e.g. ``torch.bfloat16``): run every forward and its loss under
    ``torch.autocast`` to that dtype, the parameters staying in theirs (fp32 master
    weights); tensors between stages then cross in the dtype the stages output.

    ``replay``: run one rank of the pipeline alone, in this process, without
    torch.distributed (:mod:`pipeswap.runtime.replay`): ``stages`` are that rank's, what it
    would receive is made here and what it would send is dropped; everything else runs as
    in the full pipeline. Not with data parallel or FSDP.
    """

    def __init__(
        self,
        stages: Sequence[PipelineStage],
        schedule: Schedule | ScheduleSpec | str,
        microbatches: int,
        loss_fn: LossFn,
        *,
        swap: bool = False,
        swap_policy: SwapPolicy | None = None,
        platform: Platform | None = None,
        manager: SwapManager | None = None,
        account_activations: bool | None = None,
        check_transport: str = "ordered",
        measure_allocator: bool = False,
        mesh: DeviceMesh | None = None,
        dp_group: dist.ProcessGroup | None = None,
        autocast_dtype: torch.dtype | None = None,
        swap_granularity: str = "auto",
        replay: Replay | None = None,
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
                "pipeswap.runtime.launch.spawn, or call init_process_group first")
        self.stages = sorted(stages, key=lambda s: s.stage_index)
        self.group: dist.ProcessGroup | None = self.stages[0].group
        self.rank = replay.rank if replay else dist.get_rank(self.group)
        self.world = replay.ranks if replay else dist.get_world_size(self.group)
        self.num_stages = self.stages[0].num_stages
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        self.platform = platform or get_platform()
        self._by_index = {stage.stage_index: stage for stage in self.stages}
        self.account = swap if account_activations is None else account_activations
        self.measure_allocator = measure_allocator
        self.autocast_dtype = autocast_dtype
        self.dp_group = self._data_parallel_group(mesh, dp_group)
        self.dp_size = 1 if self.dp_group is None else dist.get_world_size(self.dp_group)
        self._spans_world = replay is not None or self.world == dist.get_world_size()
        self._sharded: dict[int, ShardedStage] = {}
        built: Schedule | None = None
        problem: PipelineSetupError | None = None
        layer_counts = self._gather_layer_counts()
        try:
            self._check_transport(check_transport)
            self._sharded = self._find_sharded()
            builds_swap = not isinstance(schedule, Schedule) and (
                swap or (isinstance(schedule, ScheduleSpec) and schedule.swap))
            if swap_policy is None and builds_swap:
                swap_policy = self._default_policy(layer_counts, swap_granularity)
            elif swap_policy is not None and swap_granularity != "auto":
                raise PipelineSetupError(
                    "swap_granularity applies to the default policy; a swap_policy of your "
                    "own chooses each chunk's granularity itself")
            built = self._build(schedule, swap, swap_policy, check_transport)
            self._check_stages(built)
        except PipelineSetupError as exc:
            problem = exc
        self._check_everywhere(built, problem)
        assert built is not None
        self.schedule = built
        self.manager = manager or SwapManager(self.platform)
        for stage in self.stages:
            self.manager.protect_module(stage.module)
        self.transport: Transport = self._new_transport()
        self._failed: str | None = None  # why the last step failed, until recover()
        self._input_meta: BoundaryMeta | None = None
        self._shapes_known = False
        self._runs = 0
        self.swapped = set(swapped_chunks(self.schedule)[self.rank])
        # chunks that stream, and the chain of the one whose forward runs, per stage
        self.streamed = {step.key: step.lag for step in self.schedule.orders[self.rank]
                         if step is not None and step.type is StepType.SWAP_STREAM_OFFLOAD}
        self._active: dict[int, LayerChain] = {}
        self._hooks = [self._hook_layers(stage) for stage in self.stages
                       if any(key[0] == stage.stage_index for key in self.streamed)]
        self._hooks_finalizer = weakref.finalize(self, _remove_all, self._hooks)
        self._closed = False

    def close(self) -> None:
        """Remove the layer hooks this executor put on its stages (the stages may then serve
        another executor); the executor cannot step after this."""
        self._hooks_finalizer()
        self._closed = True

    @property
    def gathered_bytes(self) -> dict[int, int]:
        """Per stage of this rank sharded with FSDP: the bytes its UNSHARD gathers (its
        parameters at full size), as the simulator's parameter bytes take them."""
        return {index: sharded.gathered_bytes for index, sharded in self._sharded.items()}

    # -- set-up ----------------------------------------------------------------------------

    def _gather_layer_counts(self) -> dict[int, int]:
        """Every stage's layer count, from the rank that runs it: each rank builds every
        rank's order, so the default policy needs them all."""
        import torch.distributed as dist

        mine = {stage.stage_index: len(stage.layers) for stage in self.stages}
        if self.replay is not None:
            given = {index: self.replay.layer_counts.get(index) for index in mine}
            if given != mine:
                raise PipelineSetupError(
                    f"Replay.layer_counts gives this rank's stages {given} layers, but they "
                    f"have {mine}: count every stage's layers as its PipelineStage does")
            return dict(self.replay.layer_counts)
        everyone: list[dict[int, int] | None] = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        return {index: count for counts in everyone if counts for index, count in counts.items()}

    @staticmethod
    def _default_policy(layer_counts: Mapping[int, int], granularity: str) -> SwapPolicy:
        try:
            return default_swap_policy(layer_counts, granularity)
        except ScheduleError as exc:
            raise PipelineSetupError(str(exc)) from exc

    def _hook_layers(self, stage: PipelineStage) -> Callable[[], None]:
        """Forward hooks on the stage's layers that tell the streamed chunk running there
        (if any) where each layer ends."""
        me = weakref.ref(self)
        index = stage.stage_index

        def active() -> LayerChain | None:
            executor = me()
            return None if executor is None else executor._active.get(index)

        return layer_hooks(stage.layers, active)

    def _data_parallel_group(self, mesh: DeviceMesh | None,
                             dp_group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
        """The data-parallel group, from ``mesh`` or as given; the stages' group must be the
        mesh's pipeline group."""
        import torch.distributed as dist

        if mesh is None:
            return dp_group
        if dp_group is not None:
            raise PipelineSetupError("give mesh or dp_group, not both (the mesh holds the "
                                     "data-parallel group)")
        names = mesh.mesh_dim_names or ()
        if mesh.ndim != 2 or set(names) != {"pp", "dp"}:
            raise PipelineSetupError(
                f"mesh has dimensions {names or mesh.ndim}; the executor needs a 2-D mesh "
                "named ('pp', 'dp'), e.g. init_device_mesh(device, (ranks, dp), "
                "mesh_dim_names=('pp', 'dp'))")
        pipeline = dist.get_process_group_ranks(mesh.get_group("pp"))
        ours = (list(range(dist.get_world_size())) if self.group is None
                else dist.get_process_group_ranks(self.group))
        if ours != pipeline:
            raise PipelineSetupError(
                f"the stages' group has ranks {ours} but the mesh's pipeline group is "
                f"{pipeline}: build each PipelineStage with group=mesh.get_group('pp')")
        return mesh.get_group("dp")

    def _find_sharded(self) -> dict[int, ShardedStage]:
        """This rank's stages sharded with fully_shard: all of them or none (and all with
        more than one replica, whose gradients FSDP averages)."""
        sharded = {stage.stage_index: ShardedStage(stage.stage_index, stage.module,
                                                   self.dp_group)
                   for stage in self.stages if fsdp_modules(stage.module)}
        if sharded and self.replay is not None:
            raise PipelineSetupError(
                f"stages {sorted(sharded)} are sharded with fully_shard, whose collectives "
                "need the other ranks: replay a rank of unsharded stages")
        if self.dp_size > 1 and not sharded:
            raise PipelineSetupError(
                f"{self.dp_size} data-parallel replicas but no stage is sharded with "
                "fully_shard: nothing would average the replicas' gradients; shard each stage "
                "over the data-parallel group (pipeswap.runtime.fsdp.shard_stage)")
        if sharded and len(sharded) != len(self.stages):
            plain = sorted(s.stage_index for s in self.stages if s.stage_index not in sharded)
            raise PipelineSetupError(
                f"stages {sorted(sharded)} are sharded with fully_shard but stages {plain} "
                "are not: shard every stage of the rank, or none")
        return sharded

    def _new_transport(self) -> Transport:
        """A transport over a communication group of its own, so that a failed step can
        break it (see :meth:`recover`) without touching the caller's process group."""
        import torch.distributed as dist

        if self.replay is not None:
            from pipeswap.runtime.replay import ReplayTransport

            return ReplayTransport(self.replay, self.schedule.stage_ranks, self.microbatches,
                                   self.platform.device)
        ranks = [r if self.group is None else dist.get_global_rank(self.group, r)
                 for r in range(self.world)]
        # A pipeline that spans the world: every rank creates the group, and torch names it
        # from a count all ranks share. Otherwise (one replica of several) only the
        # pipeline's ranks do, and torch names it from its ranks and the number of groups
        # this rank has, which the pipeline's ranks share (same executors, same recoveries)
        # but which a destroyed group would lower and so repeat a live group's name: such a
        # pipeline keeps its broken groups (see recover).
        comm = dist.new_group(ranks, timeout=group_timeout(self.group),
                              use_local_synchronization=not self._spans_world)
        groups = [comm] if self.dp_size == 1 else [comm, self.dp_group]
        transport = Transport(comm, self.schedule.stage_ranks, self.microbatches,
                              self.platform.device, FailureBoard(*groups))
        if hasattr(self, "transport"):
            transport.boundary = self.transport.boundary
        return transport

    def recover(self) -> None:
        """After a failed step, on every rank: replace the broken communication group with a
        fresh one. The failed step left no swap group, transfer or host buffer behind, and
        sharded stages are reset (FSDP drops what the step left in flight), so the next step
        (gradients zeroed as usual) gives what it would have without the failure. Collective
        over the pipeline's ranks. Not possible with more than one data-parallel replica:
        the failure closed the data-parallel group, which FSDP needs."""
        import torch.distributed as dist

        if self.dp_size > 1:
            raise PipelineError(
                f"rank {self.rank}: a failed step closed the data-parallel group to stop the "
                "other pipeline replicas, and a closed group cannot be reopened: end the run "
                "and restart it (from a checkpoint)")
        for sharded in self._sharded.values():
            sharded.reset()
        if self.replay is not None:  # no connection to replace
            self._failed = None
            return
        old = self.transport.group
        self.transport = self._new_transport()
        self._failed = None
        if old is not None and self._spans_world:
            with suppress(Exception):  # already broken on purpose; only its memory is left
                dist.destroy_process_group(old)

    def _check_transport(self, transport: str) -> None:
        import torch.distributed as dist

        if transport not in TRANSPORTS:
            raise PipelineSetupError(
                f"check_transport={transport!r}: use 'ordered' (NCCL's model, the default) or "
                "'tagged' (gloo's)")
        if transport == "tagged" and self.replay is None and (
                dist.get_backend(self.group) != "gloo"):
            raise PipelineSetupError(
                f"check_transport='tagged' matches gloo's tagged messages, but this group "
                f"runs {dist.get_backend(self.group)}, which pairs sends and receives in "
                "order: keep 'ordered' and build the schedule with the early lowering")

    def _build(self, schedule: Schedule | ScheduleSpec | str, swap: bool,
               policy: SwapPolicy | None, transport: str) -> Schedule:
        try:
            if isinstance(schedule, Schedule):
                if swap or policy is not None:
                    raise PipelineSetupError(
                        "swap=True or a swap_policy applies to a schedule the executor builds; "
                        "an explicit Schedule runs as given (inject swap steps into it first)")
                built = schedule
            else:
                if isinstance(schedule, str):
                    schedule = ScheduleSpec(
                        _kind(schedule), ranks=self.world, microbatches=self.microbatches,
                        stages_per_rank=len(self.stages), swap=swap,
                        fsdp=bool(self._sharded))
                elif swap and not schedule.swap:
                    schedule = dataclasses.replace(schedule, swap=True)
                built = build_schedule(schedule, policy)
            # Ordered unless asked: NCCL pairs sends and receives in order, and a schedule
            # that passes on CPU then passes there. (Every micro below the count: see
            # _check_stages.)
            validate(built, transport=transport)
        except ScheduleError as exc:
            raise PipelineSetupError(f"the schedule cannot run: {exc}") from exc
        mine = built.orders[self.rank] if self.rank < built.num_ranks else ()
        named = {step.stage for step in mine
                 if step is not None and step.type in FSDP and step.stage is not None}
        if named - self._sharded.keys():
            raise PipelineSetupError(
                f"the schedule has FSDP steps for stage(s) {sorted(named - self._sharded.keys())}"
                f" of rank {self.rank}, which are not sharded with fully_shard: shard them "
                "(pipeswap.runtime.fsdp.shard_stage) or build the schedule with fsdp=False")
        if self._sharded and not named:
            raise PipelineSetupError(
                "the stages are sharded with fully_shard but the schedule has no FSDP steps "
                "to gather and free their parameters: build it with fsdp=True")
        return built

    def _check_stages(self, schedule: Schedule) -> None:
        """This rank's stages and microbatch count fit ``schedule``."""
        if schedule.num_ranks != self.world:
            raise PipelineSetupError(
                f"the schedule is for {schedule.num_ranks} ranks but the process group has "
                f"{self.world}")
        if schedule.num_stages != self.num_stages:
            raise PipelineSetupError(
                f"the schedule has {schedule.num_stages} stages but the stages say "
                f"num_stages={self.num_stages}")
        micros = schedule.num_microbatches
        if micros != self.microbatches:
            raise PipelineSetupError(
                f"the schedule runs {micros} microbatches but microbatches={self.microbatches}; "
                "give the executor the microbatch count the schedule was built for")
        mine = sorted(s for s, r in enumerate(schedule.stage_ranks) if r == self.rank)
        given = [stage.stage_index for stage in self.stages]
        if mine != given:
            raise PipelineSetupError(
                f"rank {self.rank} runs stages {mine} in this schedule but was given stages "
                f"{given}; build each rank's PipelineStage objects for the stages the schedule "
                "places on it")
        if any(stage.num_stages != self.num_stages or stage.group is not self.group
               for stage in self.stages):
            raise PipelineSetupError(
                "all stages of an executor need the same num_stages and process group")

    def _check_everywhere(self, schedule: Schedule | None,
                          problem: PipelineSetupError | None) -> None:
        """One collective before any step (two with data parallel: over the pipeline, then
        over the data-parallel group): every rank has a schedule its stages fit, and all run
        the same one. Any problem raises on every rank of every replica, so none waits
        forever. A replayed rank has nobody to agree with."""
        if self.replay is not None:
            if problem is not None:
                raise problem
            return
        fingerprint = 0
        if schedule is not None:
            text = f"{dumps_lines(schedule)}|{schedule.stage_ranks}|{self.microbatches}"
            fingerprint = int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")
        everyone = all_gather_ints(fingerprint * 2 + (problem is not None), self.group)
        bad = [rank for rank, value in enumerate(everyone) if value % 2]
        replicas = [everyone[0]]
        if self.dp_size > 1:  # this replica's verdict, to every replica
            ours = fingerprint * 2 + bool(bad or len({v // 2 for v in everyone}) != 1)
            replicas = all_gather_ints(ours, self.dp_group)
        if problem is not None:
            raise problem
        if bad:
            raise PipelineSetupError(
                f"rank(s) {bad} could not set up (see their errors): a schedule, stages or "
                "microbatch count that do not fit; nothing ran")
        if any(value % 2 for value in replicas):
            raise PipelineSetupError(
                "another pipeline replica could not set up (see its ranks' errors); nothing "
                "ran")
        if len({value // 2 for value in replicas}) != 1:
            raise PipelineSetupError(
                "the pipeline replicas were given different schedules: build the executor "
                "with the same schedule, options and microbatch count in every replica")
        if len({value // 2 for value in everyone}) != 1:
            prints = [f"{value // 2:014x}" for value in everyone]
            raise PipelineSetupError(
                f"the ranks were given different schedules (fingerprints by rank: {prints}); "
                "build the executor with the same schedule, options and microbatch count on "
                "every rank")

    def _exchange_shapes(self, example: Any) -> None:
        """Run each stage once on zeros, in stage order, passing what its output holds (the
        structure, shapes, dtypes, and which tensors carry a gradient) down the chain (see
        :func:`pipeswap.runtime.stage.output_meta`)."""
        ranks = self.schedule.stage_ranks
        for index in range(self.num_stages):
            if ranks[index] != self.rank:
                continue
            if index == 0:
                assert example is not None
                meta, _ = BoundaryMeta.of(example, "the inputs")
                meta = meta.with_grads([False] * len(meta.leaves))
            elif ranks[index - 1] == self.rank:
                meta = self.transport.boundary[index - 1]
            else:
                meta = self.transport.boundary[index - 1] = self.transport.recv_meta(index)
            stage = self._by_index[index]
            if stage.is_last:
                break
            sharded = self._sharded.get(index)
            if sharded is not None:  # gathered for the dry run alone, and freed again
                sharded.unshard()
                sharded.ready("the exchange of stage boundary shapes")
            try:
                boundary = output_meta(stage, meta, self.platform.device, self._autocast)
            finally:
                if sharded is not None:
                    sharded.reshard()
            self.transport.boundary[index] = boundary
            if ranks[index + 1] != self.rank:
                self.transport.send_meta(index, boundary)

    # -- one step --------------------------------------------------------------------------

    def step(self, inputs: Any = None, targets: Any = None) -> StepReport:
        """Run every microbatch of one batch forward and backward.

        ``inputs`` is needed on the rank of the first stage, ``targets`` on the rank of the
        last (other ranks may pass them too; they are ignored).
        """
        if self._closed:
            raise PipelineError(f"rank {self.rank}: this executor was closed; build a new one")
        if self._failed is not None:
            raise PipelineError(
                f"rank {self.rank}: a previous step failed ({self._failed}); call recover() on "
                "every rank before the next step")
        start = time.perf_counter()
        measuring: AbstractContextManager[AllocationPeak | None] = (
            self.platform.measure_allocations() if self.measure_allocator else nullcontext())
        with measuring as allocated:
            run = self._step(inputs, targets)
        # The step's device work included (nothing else waits for it on a rank without the
        # last stage, whose end-of-step agreement runs on the host).
        self.platform.current_stream().synchronize()
        losses: list[float] = []
        if run.losses:  # one host sync for all of them
            import torch

            losses = torch.stack([run.losses[m] for m in sorted(run.losses)]).tolist()
        return StepReport(
            losses=tuple(losses),
            seconds=time.perf_counter() - start,
            peak_activation_bytes=run.peak_activations if self.account else None,
            peak_memory_bytes=run.peak_memory if self.account else None,
            bytes_offloaded=self.manager.stats().bytes_offloaded - run.offloaded_before,
            swapped_chunks=len(self.swapped),
            chunk_bytes=run.chunk_bytes,
            chunk_bytes_after_input=run.chunk_bytes_after_input,
            layer_bytes=run.layer_bytes,
            layer_bytes_after_input=run.layer_bytes_after_input,
            peak_allocated_bytes=None if allocated is None else allocated.peak_bytes,
        )

    def _step(self, inputs: Any, targets: Any) -> _Run:
        """The step up to closing its swap session (the part measure_allocator measures)."""
        self._runs += 1
        run = _Run(SwapSession(self.manager, f"x{id(self):x}.run{self._runs}"))
        self.manager.reset_peak()
        run.offloaded_before = self.manager.stats().bytes_offloaded
        at: Step | str | None = "its batch check"
        try:
            # No collective first: a rank refusing its batch fails the step like any other
            # failure, and its peers stop at their first transfer with it.
            self._take_batch(run, inputs, targets)
            if not self._shapes_known:
                at = "the exchange of stage boundary shapes"
                self._exchange_shapes(run.micro_inputs[0] if run.micro_inputs else None)
                self._shapes_known = True
                if run.micro_inputs:
                    self._input_meta = BoundaryMeta.of(run.micro_inputs[0], "the inputs")[0]
            for at in self.schedule.orders[self.rank]:
                if at is not None:
                    self._run(run, at)
            at = None
            for transfer in run.sends:
                self.transport.wait(transfer)
            if run.receives:
                raise PipelineError(
                    f"rank {self.rank}: the schedule posted receives no step consumed: "
                    f"{', '.join(str(t.step) for t in run.receives.values())}")
            self._flush(run)
            self._all_gather(0, "the end-of-step agreement", self.transport.group)
            if self.dp_size > 1:
                self._all_gather(0, "the end-of-step agreement of the data-parallel group",
                                 self.dp_group)
        except BaseException as exc:
            self._fail(exc, at)
            try:
                run.session.close()
            except Exception as close_exc:  # noqa: BLE001 - the step's error is the one to see
                warnings.warn(f"closing the swap session after a failed step also failed: "
                              f"{close_exc}", stacklevel=2)
            raise
        run.session.close()
        return run

    def _all_gather(self, value: int, what: str, group: dist.ProcessGroup | None
                    ) -> list[int]:
        """A collective of the step; a peer that failed makes it raise at once, naming that
        peer. A replayed rank's is its own value."""
        if self.replay is not None:
            return [value]
        try:
            return all_gather_ints(value, group)
        except RuntimeError as exc:
            raise self.transport.failure(what, exc) from exc

    def _collective(self, what: Step | str, call: Callable[[], _T]) -> _T:
        """Run FSDP's gathers, waits or reductions over the data-parallel group: where they
        fail because a peer failed and said so, raise the error that names it."""
        try:
            return call()
        except RuntimeError as exc:
            if self.transport.board is not None and self.transport.board.read() is not None:
                raise self.transport.failure(f"{what} (FSDP, data-parallel group)", exc) from exc
            raise

    def _fail(self, exc: BaseException, at: Step | str | None) -> None:
        """Tell the peers this step failed here: post the reason (this rank's failure, or
        the failure that stopped it) to the pipeline and the data-parallel group, and break
        the connections in both, so that no peer, in this replica or another, waits for this
        rank until its timeout."""
        import torch.distributed as dist

        where = f"{at if at is not None else 'the end'} of step {self._runs}"
        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        if self.replay is not None:  # no peers to tell
            self._failed = f"replayed rank {self.rank} failed at {where}: {first_line}"
            return
        who = f"rank {dist.get_rank()}"
        if self.dp_size > 1:
            who += f" (pipeline rank {self.rank}, data-parallel rank {dist.get_rank(self.dp_group)})"
        reason = f"{who} failed at {where}: {type(exc).__name__}: {first_line}"
        assert self.transport.board is not None
        if isinstance(exc, PeerFailedError):  # pass the first failure on to other groups
            first = self.transport.board.read()
            if first is not None:
                self.transport.board.post(first)
        elif not isinstance(exc, PipelineCommError):
            self.transport.board.post(reason)
        self._failed = reason
        assert self.transport.group is not None
        break_links(self.transport.group)
        if self.dp_size > 1:
            assert self.dp_group is not None
            break_links(self.dp_group)

    def _flush(self, run: _Run) -> None:
        """Fold the swap manager's peak since the last flush into the step's peaks (with the
        FSDP parameters gathered meanwhile), and start a new one from what it holds now.
        Called before every change of the gathered bytes and at the end of the step, so the
        peak of activations plus parameters is exact, as the simulator counts it."""
        stats = self.manager.stats()
        run.peak_activations = max(run.peak_activations, stats.peak_device_bytes_held)
        run.peak_memory = max(run.peak_memory, stats.peak_device_bytes_held + run.gathered)
        self.manager.reset_peak()

    def _fsdp(self, run: _Run, step: Step) -> None:
        """UNSHARD, RESHARD or REDUCE_GRAD of a sharded stage."""
        assert step.stage is not None
        sharded = self._sharded[step.stage]
        if step.type is StepType.FSDP_REDUCE_GRAD:
            self._collective(step, sharded.reduce_grad)
            return
        self._flush(run)
        if step.type is StepType.FSDP_UNSHARD:
            self._collective(step, sharded.unshard)
            run.gathered += sharded.gathered_bytes
        else:
            self._collective(step, sharded.reshard)
            run.gathered -= sharded.gathered_bytes
        run.peak_memory = max(run.peak_memory,
                              self.manager.stats().device_bytes_held + run.gathered)

    def _ready(self, step: Step) -> None:
        """Before a compute of a sharded stage: its parameters are gathered (and, just
        gathered, kept out of swap: they are parameters, not activations)."""
        assert step.stage is not None
        sharded = self._sharded.get(step.stage)
        if sharded is not None and self._collective(step, lambda: sharded.ready(step)):
            self.manager.protect_module(self._by_index[step.stage].module)

    def _take_batch(self, run: _Run, inputs: Any, targets: Any) -> None:
        """Split this rank's part of the batch into microbatches, checking it fits."""
        if 0 in self._by_index:
            if inputs is None:
                raise PipelineSetupError(f"rank {self.rank} runs the first stage: pass inputs")
            run.micro_inputs = split_tree(inputs, self.microbatches, "inputs")
            meta = BoundaryMeta.of(run.micro_inputs[0], "the inputs")[0]
            if self._input_meta is not None and meta != self._input_meta:
                def shapes(m: BoundaryMeta) -> list[tuple[int, ...]]:
                    return [leaf.shape for leaf in m.leaves]

                raise PipelineSetupError(
                    f"microbatch shapes changed from {shapes(self._input_meta)} to "
                    f"{shapes(meta)}; stage boundary shapes are fixed after the first step: "
                    "keep the batch shape constant (pad), or build a new executor")
        if self.num_stages - 1 in self._by_index:
            if targets is None:
                raise PipelineSetupError(f"rank {self.rank} runs the last stage: pass targets")
            run.micro_targets = split_tree(targets, self.microbatches, "targets")

    def _run(self, run: _Run, step: Step) -> None:
        kind = step.type
        if kind in COMPUTE and self._sharded:
            self._ready(step)
        if kind is StepType.FWD:
            self._forward(run, step.key)
        elif kind is StepType.BWD:
            self._backward(run, step.key, dx=True, dw=True)
        elif kind is StepType.BWD_INPUT:
            self._backward(run, step.key, dx=True, dw=False)
        elif kind is StepType.BWD_WEIGHT:
            self._backward(run, step.key, dx=False, dw=True)
        elif kind in OVERLAPS:
            for sub in step.sub_steps:
                self._run(run, sub)
        elif kind in P2P:
            self._post(run, [step], batched=False)
        elif kind is StepType.BATCH_SEND_RECV:
            self._post(run, list(step.sub_steps), batched=True)
        elif kind in FSDP:
            self._fsdp(run, step)
        elif kind is StepType.SWAP_STREAM_OFFLOAD:
            assert step.lag is not None
            stage = self._by_index[step.key[0]]
            run.session.stream(step.key, len(stage.layers), step.lag)
        else:
            chain = run.session.chain(step.key)
            if chain is not None:  # WO, SL and WL of a streamed chunk
                {StepType.SWAP_WAIT_OFFLOAD: chain.wait_offload,
                 StepType.SWAP_STREAM_LOAD: chain.launch_load,
                 StepType.SWAP_WAIT_LOAD: chain.wait_load}[kind]()
                return
            name = run.session.name(step.key)
            {StepType.SWAP_LAUNCH_OFFLOAD: self.manager.launch_offload,
             StepType.SWAP_WAIT_OFFLOAD: self.manager.wait_offload,
             StepType.SWAP_LAUNCH_LOAD: self.manager.launch_load,
             StepType.SWAP_WAIT_LOAD: self.manager.wait_load}[kind](name)

    def _post(self, run: _Run, steps: list[Step], batched: bool) -> None:
        pairs = []
        for step in steps:
            if step.type is StepType.FWD_SEND:
                leaves, _ = flatten(self._output(run, step.key), "a stage's output")
                pairs.append((step, [leaf.contiguous() for leaf in leaves]))
            elif step.type is StepType.BWD_SEND:
                grads = self._gradients(step.key[0] - 1, run.grads_in.pop(step.key, None), step)
                pairs.append((step, [grad.contiguous() for grad in grads]))
            else:
                pairs.append((step, self.transport.receive_buffers(step)))
        for transfer in self.transport.post(self._runs, pairs, batched):
            if transfer.step.type in SENDS:
                run.sends.append(transfer)
            else:
                run.receives[(transfer.step.type, transfer.step.key)] = transfer

    def _gradients(self, boundary: int, grads: list[torch.Tensor | None] | None,
                   at: object) -> list[torch.Tensor]:
        """The gradients of boundary ``boundary``'s tensors that carry one, a tensor each:
        zeros for one the next stage did not use; an error if it used none."""
        import torch

        if grads is None or all(grad is None for grad in grads):
            raise PipelineError(f"{at}: stage {boundary + 1}'s input got no gradient to "
                                "send: does the stage's output depend on its input?")
        metas = [leaf for leaf, grad in zip(self.transport.boundary[boundary].leaves,
                                            self.transport.boundary[boundary].grads) if grad]
        return [grad if grad is not None else torch.zeros(meta.shape, dtype=meta.dtype,
                                                          device=self.platform.device)
                for grad, meta in zip(grads, metas)]

    def _received(self, run: _Run, kind: StepType, key: ChunkKey
                  ) -> list[torch.Tensor] | None:
        transfer = run.receives.pop((kind, key), None)
        return None if transfer is None else self.transport.wait(transfer)

    def _output(self, run: _Run, key: ChunkKey) -> Any:
        """The chunk's forward output, its tensors detached, to send or hand over to the
        next stage."""
        import torch
        from torch.utils._pytree import tree_map_only

        chunk = run.chunks.get(key)
        if chunk is None or chunk.value is None:
            raise PipelineError(f"stage {key[0]} micro {key[1]}: its output is needed after "
                                "its backward began")
        return tree_map_only(torch.Tensor, lambda t: t.detach(), chunk.value)

    def _forward(self, run: _Run, key: ChunkKey) -> None:
        stage_index, micro = key
        stage = self._by_index[stage_index]
        inputs: list[torch.Tensor] = []
        if stage.is_first:
            x = run.micro_inputs[micro]
        else:
            meta = self.transport.boundary[stage_index - 1]
            received = self._received(run, StepType.FWD_RECV, key)
            if received is None:  # the previous stage runs here: hand over locally
                received, _ = flatten(self._output(run, (stage_index - 1, micro)), "")
            inputs = [leaf.requires_grad_(True)
                      for leaf, grad in zip(received, meta.grads) if grad]
            x = meta.unflatten(received)
        target = run.micro_targets[micro] if stage.is_last else None
        accounted = self.account or key in self.swapped
        chain = run.session.chain(key)
        if chain is not None:  # streamed: the layers' groups offload as the forward goes
            chain.protect([x, target])
            self._active[stage_index] = chain
        try:
            with self._autocast():
                chunk = forward_chunk(stage.forward, x, inputs=inputs,
                                      carries=self._carries(stage), target=target,
                                      loss_fn=self.loss_fn, scale=self.microbatches,
                                      saving=run.session.forward(key) if accounted else None)
        finally:
            self._active.pop(stage_index, None)
        if chunk.loss is not None:
            run.losses[micro] = chunk.loss
        if accounted:
            run.accounted.add(key)
            run.session.protect(key, [x, chunk.value, target])
            if chain is not None:
                chain.forward_done()
                run.layer_bytes[key] = chain.layer_bytes
                run.chunk_bytes[key] = GroupBytes(sum(b.held for b in chain.layer_bytes),
                                                  sum(b.movable for b in chain.layer_bytes))
            else:
                run.chunk_bytes[key] = self.manager.group_bytes(run.session.name(key))
        run.chunks[key] = chunk

    def _carries(self, stage: PipelineStage) -> Callable[[Any], list[torch.Tensor]] | None:
        """How to pick a stage output's tensors that carry a gradient back (as the shape
        exchange found them); None on the last stage, whose loss does."""
        if stage.is_last:
            return None
        meta = self.transport.boundary[stage.stage_index]

        def carried(out: Any) -> list[torch.Tensor]:
            leaves, _ = flatten(out, f"stage {stage.stage_index}'s output")
            picked = [leaf for leaf, grad in zip(leaves, meta.grads) if grad]
            if any(not leaf.requires_grad for leaf in picked):
                raise PipelineError(
                    f"stage {stage.stage_index}'s output changed which tensors need a "
                    "gradient since the first step; keep the stage's outputs alike")
            return picked

        return carried

    def _autocast(self) -> AbstractContextManager[object]:
        """Mixed precision for a forward (and its loss): autocast to ``autocast_dtype``;
        parameters and their gradients stay in their own dtype."""
        if self.autocast_dtype is None:
            return nullcontext()
        import torch

        return torch.autocast(self.platform.device.type, dtype=self.autocast_dtype)

    def _backward(self, run: _Run, key: ChunkKey, *, dx: bool, dw: bool) -> None:
        """B (dx and dw), I (dx) or W (dw) of one chunk; the autograd is in
        :mod:`pipeswap.runtime.backward`. The swap group ends after the chunk's last step."""
        stage_index, micro = key
        stage = self._by_index[stage_index]
        chunk = run.chunks[key]
        if dx:
            grads: list[torch.Tensor] | None = None
            if not stage.is_last:
                grads = self._received(run, StepType.BWD_RECV, key)
                if grads is None:  # the next stage runs here
                    grads = self._gradients(stage_index, run.grads_in.pop(
                        (stage_index + 1, micro), None), f"stage {stage_index} micro {micro}")
            grad_in = chunk.backward(grads) if dw else chunk.backward_input(grads)
            if not stage.is_first:
                run.grads_in[key] = grad_in
            if not dw:  # the chunk keeps what its W step needs, and only that
                if key in run.accounted:
                    chain = run.session.chain(key)
                    names = chain.names if chain is not None else (run.session.name(key),)
                    held = tuple(self.manager.group_bytes(name).held for name in names)
                    run.chunk_bytes_after_input[key] = sum(held)
                    if chain is not None:
                        run.layer_bytes_after_input[key] = held
                return
        else:
            chunk.backward_weight()
        if key in run.accounted:
            run.session.finish(key)
        del run.chunks[key]


def default_swap_policy(layer_counts: Mapping[int, int], granularity: str = "auto"
                        ) -> SwapPolicy:
    """The executor's default: the peak policy on uniform layers (each as long as the next,
    a backward twice a forward), ``layer_counts`` per stage, choosing each chunk's
    granularity as ``granularity`` says (``"auto"``, ``"chunk"`` or ``"layer"``)."""
    from pipeswap.schedule.costs import CostModel
    from pipeswap.schedule.policies import GRANULARITIES, PeakPolicy

    if granularity not in GRANULARITIES:
        raise ScheduleError(f"the swap granularity must be one of "
                            f"{', '.join(GRANULARITIES)}, got {granularity!r}")
    return PeakPolicy(CostModel(stages=uniform_layers(layer_counts)), granularity=granularity)


def uniform_layers(layer_counts: Mapping[int, int]) -> dict[int, StageCosts]:
    """Each stage's costs when only its layer count is known: layers alike, a backward
    twice a forward."""
    from pipeswap.schedule.costs import StageCosts

    return {index: StageCosts(float(count), 2.0 * count, layers=count)
            for index, count in layer_counts.items()}


def _remove_all(removers: list[Callable[[], None]]) -> None:
    for remove in removers:
        remove()


def _kind(name: str) -> ScheduleKind:
    try:
        return ScheduleKind(name)
    except ValueError:
        allowed = ", ".join(kind.value for kind in ScheduleKind)
        raise PipelineSetupError(f"unknown schedule {name!r}; allowed: {allowed}") from None
