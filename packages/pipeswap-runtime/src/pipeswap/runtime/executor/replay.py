"""Replay one pipeline rank alone, in one process: will rank R of a P-rank pipeline fit?

A replay runs rank R's order of the schedule with everything real but the other ranks:
what R would receive is made here, with the shapes and dtypes the stage boundaries have, and
what R would send is dropped. Compute, swap steps, copies and their waits run as in the full
pipeline, so rank R's saved activations, its swap groups and the allocator's peak are what
they would be there; its step time leaves out every wait for a peer.

The pieces: :class:`Replay` (handed to :class:`~pipeswap.runtime.executor.PipelineExecutor`
as ``replay=``), :func:`input_boundaries` (what crosses into the replayed rank's stages,
found by dry runs of the stages before them, built one at a time), and :func:`materialize`
(a stage built on the meta device, given memory on the device alone, so that only the
replayed rank's stages ever take device memory).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeswap.runtime.distributed.transport import BoundaryMeta, PyTree, Transfer, Transport
from pipeswap.runtime.errors import PipelineCommError, PipelineSetupError
from pipeswap.runtime.executor.stage import PipelineStage, output_meta
from pipeswap.schedule import SENDS, Step

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Replay:
    """Which rank to replay, and what the absent ranks would have told it.

    ``rank`` of ``ranks`` pipeline ranks; ``layer_counts``: every stage's layer count
    (those of ``rank``'s stages must be theirs); ``boundaries``: per stage ``s`` whose
    output crosses into a stage of ``rank`` from another rank, the meta of that output (see
    :func:`input_boundaries`); ``seed``: of the values made for received tensors.
    """

    rank: int
    ranks: int
    layer_counts: Mapping[int, int]
    boundaries: Mapping[int, BoundaryMeta]
    seed: int = 0


class ReplayTransport(Transport):
    """The transport of a replayed rank: a receive yields tensors made here (normal values
    for floating tensors, zeros for integer and boolean ones, from a generator of their own so
    that a run with swap gets the same values as one without), a send is dropped."""

    def __init__(self, replay: Replay, stage_ranks: tuple[int, ...], microbatches: int,
                 device: torch.device) -> None:
        import torch

        super().__init__(None, stage_ranks, microbatches, device, None, global_rank=replay.rank)
        self.replay = replay
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(replay.seed)

    def post(self, run: int, steps: list[tuple[Step, list[torch.Tensor]]], batched: bool
             ) -> list[Transfer]:
        transfers = []
        for step, tensors in steps:
            if step.type not in SENDS:
                for tensor in tensors:
                    if tensor.is_floating_point():
                        tensor.normal_(generator=self.generator)
                    else:
                        tensor.zero_()
            transfers.append(Transfer(step, [], tensors, self.peer(step)))
        return transfers

    def wait(self, transfer: Transfer) -> list[torch.Tensor]:
        return transfer.tensors

    def recv_meta(self, stage: int) -> BoundaryMeta:
        meta = self.replay.boundaries.get(stage - 1)
        if meta is None:
            raise PipelineSetupError(
                f"replaying rank {self.replay.rank}: no boundary meta of stage {stage - 1}'s "
                f"output, which stage {stage} receives; give Replay.boundaries for it (see "
                "pipeswap.runtime.executor.replay.input_boundaries)")
        return meta

    def send_meta(self, stage: int, meta: BoundaryMeta) -> None:
        """Nobody to tell."""

    def failure(self, where: str, exc: BaseException) -> PipelineCommError:
        return PipelineCommError(f"replayed rank {self.replay.rank}: {where} failed: {exc}")


def input_boundaries(stage_ranks: Sequence[int], rank: int, example: PyTree,
                     build: Callable[[int], PipelineStage], device: torch.device,
                     autocast: Callable[[], AbstractContextManager[object]]
                     ) -> dict[int, BoundaryMeta]:
    """The meta of every stage output that crosses into a stage of ``rank`` from another
    rank, found by dry runs (:func:`~pipeswap.runtime.executor.stage.output_meta`) of every stage
    before ``rank``'s last, in order, from ``example``, one microbatch of the inputs.
    ``build(index)`` makes stage ``index`` on ``device``; each is dropped after its dry run,
    so at most one of them holds device memory at a time."""
    mine = [index for index, owner in enumerate(stage_ranks) if owner == rank]
    if not mine:
        raise PipelineSetupError(f"rank {rank} runs no stage of this schedule")
    meta, _ = BoundaryMeta.of(example, "the inputs")
    meta = meta.with_grads([False] * len(meta.leaves))
    needed: dict[int, BoundaryMeta] = {}
    for index in range(max(mine)):
        meta = output_meta(build(index), meta, device, autocast)
        if index + 1 in mine and index not in mine:
            needed[index] = meta
    return needed


def materialize(module: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """``module``, built on the meta device, given memory on ``device`` and initialised there
    by each submodule's ``reset_parameters()`` (PyTorch's convention for deferred
    initialisation): fresh weights, not a particular run's; parameters shared between
    submodules stay shared. Refuses a module with parameters or buffers of its own and no
    ``reset_parameters``, which would be left uninitialised."""
    missing = sorted({type(m).__name__ for m in module.modules()
                      if (any(p is not None for p in m._parameters.values())
                          or any(b is not None for b in m._buffers.values()))
                      and not callable(getattr(m, "reset_parameters", None))})
    if missing:
        raise PipelineSetupError(
            f"{', '.join(missing)} hold parameters or buffers but have no reset_parameters(), "
            "so a stage built on the meta device cannot be initialised on the device: give "
            "each such module a reset_parameters() that fills its own parameters and buffers")
    import torch

    # to_empty gives each module a parameter of its own: tie again what was shared (a tied
    # embedding), as the model built directly has it
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    for sub in module.modules():
        for name, parameter in sub._parameters.items():
            if parameter is not None:
                holders.setdefault(id(parameter), []).append((sub, name))
    module.to_empty(device=device)
    for (first, first_name), *others in holders.values():
        for sub, name in others:
            sub._parameters[name] = first._parameters[first_name]
    with torch.no_grad():
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            if callable(reset):
                reset()
    return module
