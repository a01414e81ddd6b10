"""The host buffers a rank reserves before its first step: what its swapped chunks' forwards
save, from the dry runs set-up makes anyway, and the most of it the schedule holds off the
device at once.

Why: the swap manager copies each storage it offloads into a pooled host block, pinned on
accelerators, and pinning is slow (a page-locking call per block). Without a reservation the
pool pins its blocks inside the first step's forwards; with one
(:meth:`~pipeswap.swap.SwapManager.reserve_host`) they are pinned at set-up, and no step
allocates a block.

:class:`SavedRecorder` records, around a stage's dry run (its forward on zeros), the byte size
of every storage swap would copy, with the executor's manager's own rules: a throwaway
manager of the same platform and ``min_bytes`` collects the forward (parameters, buffers, the
stage's inputs and output, and for the last stage its targets kept on the device; each storage
counted once), per layer as a streamed chunk's groups would. :func:`host_reservation` walks a
rank's order with those sizes and returns the sizes to reserve.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeswap.runtime.errors import PipelineSetupError
from pipeswap.runtime.executor.stage import PipelineStage, output_meta
from pipeswap.schedule import ChunkKey, Schedule, Step, StepType
from pipeswap.swap import SwapManager
from pipeswap.swap import size_class

if TYPE_CHECKING:
    import torch

    from pipeswap.runtime.distributed.transport import BoundaryMeta, PyTree


@dataclass(frozen=True)
class SavedSizes:
    """What one forward of a stage saves that swap would copy, in bytes per storage.

    ``chunk``: each storage once, as an offload of the whole chunk (``LO``) copies them.
    ``layers``: per layer, in the order the layers ended (the last one when the forward
    did), what the layer's group copies as a streamed chunk (``SO``) launches it; a storage
    two layers save (a layer's output, saved again by the next layer's first op) is in both,
    as both launches copy it.
    """

    chunk: tuple[int, ...]
    layers: tuple[tuple[int, ...], ...]


class SavedRecorder:
    """Records :class:`SavedSizes` per stage index into :attr:`sizes`, from dry runs of the
    forwards of ``stages`` (default: every stage); ``manager``: the executor's, whose platform
    and ``min_bytes`` decide what is swapped."""

    def __init__(self, manager: SwapManager, stages: Collection[int] | None = None) -> None:
        self.manager = manager
        self.stages = stages
        self.sizes: dict[int, SavedSizes] = {}

    @contextmanager
    def stage(self, stage: PipelineStage, *, protect: object = None) -> Iterator[None]:
        """Record what ``stage``'s module's forward inside the block saves (e.g. around
        :func:`~pipeswap.runtime.executor.stage.output_meta`); ``protect``: tensors kept
        on the device besides the module's inputs and output (a last stage's targets).
        The graph stays alive until the block ends, which reads it. A stage not in
        :attr:`stages` is not recorded."""
        if self.stages is not None and stage.stage_index not in self.stages:
            yield
            return
        probe = SwapManager(self.manager.platform, min_bytes=self.manager.min_bytes)
        probe.protect_module(stage.module)
        names = [f"probe.s{stage.stage_index}.l{index}" for index in range(len(stage.layers))]
        for name in names:
            probe.ensure_group(name)
        probe.link_groups(names)
        launches: list[tuple[int, ...]] = []
        outputs: list[object] = []  # keeps the forward's graph alive until the block ends
        position = 0  # the layer the forward is in

        def protect_all(tensors: object) -> None:
            for name in names:
                probe.protect_alias_tensors(name, tensors)

        def entered(module: torch.nn.Module, args: tuple[object, ...],
                    kwargs: dict[str, object]) -> None:
            protect_all((args, kwargs))

        def left(module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object],
                 output: object) -> None:
            outputs.append(output)

        def layer_ended(index: int) -> None:
            # as LayerChain.layer_done: the group launches, the next layer's collects
            nonlocal position
            if index == position < len(names) - 1:
                launches.append(probe.movable_sizes(names[index]))
                position += 1
                probe.switch_group(names[index + 1])

        handles = [stage.module.register_forward_pre_hook(entered, with_kwargs=True),
                   stage.module.register_forward_hook(left, with_kwargs=True)]
        handles += [layer.register_forward_hook(
            lambda module, args, output, index=index: layer_ended(index))
            for index, layer in enumerate(stage.layers)]
        try:
            protect_all(protect)
            with probe.group_context(names[0]):
                yield
            protect_all(outputs)
            launches.append(probe.movable_sizes(names[position]))
            chunk = tuple(size for name in names for size in probe.movable_sizes(name))
            self.sizes[stage.stage_index] = SavedSizes(chunk, tuple(launches))
        finally:
            for handle in handles:
                handle.remove()
            for name in names:
                probe.abort_group(name)
            probe.close()

    def last_stage(self, stage: PipelineStage, meta: BoundaryMeta, target: PyTree,
                   loss_fn: Callable[..., torch.Tensor], device: torch.device,
                   autocast: Callable[[], AbstractContextManager[object]],
                   kwargs: Mapping[str, object] | None = None) -> None:
        """Record the last stage, whose chunks also keep what their loss saves: a dry run of
        its forward and ``loss_fn`` on ``target`` (one microbatch's), from zeros as ``meta``
        describes its input, by :func:`~pipeswap.runtime.executor.stage.output_meta` as the other
        stages' (buffers and random state restored after). A stage not in :attr:`stages`
        is not run."""
        import torch

        if self.stages is not None and stage.stage_index not in self.stages:
            return

        class WithLoss(torch.nn.Module):
            """The stage's module, then its loss: one forward, as the executor runs them."""

            def __init__(self) -> None:
                super().__init__()
                self.inner = stage.module

            def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
                return loss_fn(self.inner(*args, **kwargs), target)

        wrapped = PipelineStage(WithLoss(), stage.stage_index, stage.num_stages, stage.group,
                                stage.layers)
        with self.stage(wrapped, protect=target):
            output_meta(wrapped, meta, device, autocast, kwargs)


def host_reservation(schedule: Schedule, rank: int, saved: Mapping[int, SavedSizes]
                     ) -> list[int]:
    """The byte sizes to reserve host buffers for (:meth:`SwapManager.reserve_host
    <pipeswap.swap.SwapManager.reserve_host>`) so that rank ``rank``'s order of
    ``schedule`` allocates no host block: per size class of the pool, as many blocks as the
    order holds at once at the most, from ``saved`` (per stage index; every stage it swaps
    needed), largest first.

    The walk, step by step (the sub-steps of an overlap in their order): a chunk swapped whole
    takes a block per storage of :attr:`SavedSizes.chunk` at its ``LO`` and gives them back
    at its ``WL``, as the manager does. A streamed chunk (``SO``) takes every layer's blocks at
    its forward and gives them back after its backward (``B``, or ``W`` after ``I``): its
    layers launch their copies during the forward and their loads give the blocks back
    during the backward, where nothing is taken, so this is the most it holds; what it gives
    back earlier (a storage that moved to the next layer, one kept on the device) only lowers
    it. Blocks are counted per class because the pool hands out a block of the class asked
    for, and allocates one while under its cap rather than take a larger free block.

    Assumptions: every chunk of a stage saves what the recorded dry run saved (same shapes,
    no data-dependent control flow); a storage referenced outside autograd at a whole chunk's
    ``LO`` stays on the device, so it is counted but takes no block (the reservation is then
    larger than needed, never smaller); a block comes back to the pool free once compute has
    waited for its copy (the manager's rule), so ``WL`` frees it for the next ``LO``.
    """
    held: dict[ChunkKey, Counter[int]] = {}
    streamed: set[ChunkKey] = set()
    now: Counter[int] = Counter()
    most: Counter[int] = Counter()

    def sizes(step: Step) -> SavedSizes:
        assert step.stage is not None
        found = saved.get(step.stage)
        if found is None:
            raise PipelineSetupError(
                f"rank {rank} swaps chunks of stage {step.stage} ({step}) but no saved sizes "
                "were recorded for that stage: record its dry run with SavedRecorder.stage "
                "(a last stage's with SavedRecorder.last_stage)")
        return found

    def take(key: ChunkKey, nbytes: Collection[int]) -> None:
        blocks = held[key] = Counter(size_class(n) for n in nbytes)
        now.update(blocks)
        for size in blocks:
            most[size] = max(most[size], now[size])

    def give(key: ChunkKey) -> None:
        now.subtract(held.pop(key, Counter()))

    order = schedule.orders[rank] if rank < schedule.num_ranks else ()
    for step in _leaves(order):
        kind, key = step.type, step.key if step.micro is not None else None
        if key is None:
            continue
        if kind is StepType.SWAP_LAUNCH_OFFLOAD:
            take(key, sizes(step).chunk)
        elif kind is StepType.SWAP_STREAM_OFFLOAD:
            streamed.add(key)
        elif kind is StepType.FWD and key in streamed:
            take(key, [n for layer in sizes(step).layers for n in layer])
        elif kind is StepType.SWAP_WAIT_LOAD and key not in streamed:
            give(key)
        elif kind in (StepType.BWD, StepType.BWD_WEIGHT) and key in streamed:
            give(key)
            streamed.discard(key)
    return [size for size in sorted(most, reverse=True) for _ in range(most[size])]


def _leaves(order: tuple[Step | None, ...]) -> Iterator[Step]:
    """The order's steps, composites opened (an overlap's sub-steps in their order)."""
    for step in order:
        if step is None:
            continue
        if step.sub_steps:
            yield from step.sub_steps
        else:
            yield step
