"""Point-to-point transfers between stages on different ranks, over torch.distributed.

What crosses a stage boundary is a pytree of tensors (one tensor, or tuples, lists and dicts
of them): each send or receive of the schedule moves all its tensors (for a gradient, those
that carry one) in one batched transfer. Every message carries a tag naming its run,
direction, sending stage, microbatch and tensor. With gloo a message can then only land in the
receive posted for it (and a receive left over from a failed run can never take a later run's
data); NCCL ignores tags and matches in order, which the validated schedule keeps consistent.

Every point-to-point operation, the set-up's included, goes through ``batch_isend_irecv``, a
step's alone or a batch step's together. NCCL posts an operation inside a batch on the
group's communicator and one posted alone on a communicator of the two ranks, so a message
whose two ends were posted differently would never match; posted all alike, both ends of
every message meet on one communicator, in the order the ``ordered`` model checks. (PyTorch's
pipelining posts the same way.) On accelerators the group's communicator is created eagerly
(``device_id``), so a first batch need not involve every rank of the group.

The structure, shapes and dtypes at each boundary are exchanged once, before the first step,
by a chain over the stages in order, as CPU tensors over the transport's group, which has a
CPU backend (gloo) whatever the caller's group has (see :func:`with_cpu_backend`).
"""

from __future__ import annotations

import functools
from contextlib import suppress
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias, Union

from pipeswap.runtime.distributed.collectives import AGREE_TAG
from pipeswap.runtime.distributed.failure_board import BREAK_TAG, FailureBoard
from pipeswap.runtime.errors import PeerFailedError, PipelineCommError, PipelineSetupError
from pipeswap.schedule import Step, StepType

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from pipeswap.runtime.distributed.peer_watch import GroupStopper
    from torch.utils._pytree import TreeSpec

#: What crosses a stage boundary, and a batch's inputs and targets: a tensor, or tuples,
#: lists and dicts of tensors (:func:`flatten` refuses anything else).
PyTree: TypeAlias = Union["torch.Tensor", Sequence["PyTree"], Mapping[str, "PyTree"]]

_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8", "bool")
_MAX_DIMS = 8
_RUNS_IN_TAGS = 512
_MAX_TAG = min(AGREE_TAG, BREAK_TAG) - 1  # the tags the collectives and the board keep
#: The most tensors one stage boundary may hold: each has a message tag of its own.
MAX_BOUNDARY_TENSORS = 16


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver needs to allocate a boundary tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def encode(self) -> torch.Tensor:
        import torch

        name = str(self.dtype).removeprefix("torch.")
        if name not in _DTYPES or len(self.shape) > _MAX_DIMS:
            raise PipelineSetupError(
                f"a stage boundary tensor of dtype {self.dtype} and {len(self.shape)} "
                f"dimensions cannot cross ranks; supported: dtypes {', '.join(_DTYPES)}, at "
                f"most {_MAX_DIMS} dimensions")
        dims = list(self.shape) + [0] * (_MAX_DIMS - len(self.shape))
        return torch.tensor([len(self.shape), _DTYPES.index(name), *dims], dtype=torch.int64)

    @staticmethod
    def decode(data: torch.Tensor) -> TensorMeta:
        import torch

        ndim, code, *dims = (int(v) for v in data.tolist())
        return TensorMeta(tuple(dims[:ndim]), getattr(torch, _DTYPES[code]))


@dataclass(frozen=True)
class BoundaryMeta:
    """What crosses one stage boundary: the pytree's structure (``torch.utils._pytree``'s
    serialized form), each tensor's shape and dtype in flattening order, and which of them
    carry a gradient back (those the sending stage's output computes with grad)."""

    spec: str
    leaves: tuple[TensorMeta, ...]
    grads: tuple[bool, ...]

    @staticmethod
    def of(value: object, what: str) -> tuple[BoundaryMeta, list[torch.Tensor]]:
        """The meta of ``value`` and its tensors; a clear error for anything that is not a
        pytree of tensors."""
        leaves, spec = flatten(value, what)
        return BoundaryMeta(_dumps(spec), tuple(TensorMeta(tuple(t.shape), t.dtype)
                                                for t in leaves),
                            tuple(t.requires_grad for t in leaves)), leaves

    def unflatten(self, leaves: Sequence[torch.Tensor]) -> PyTree:
        from torch.utils._pytree import tree_unflatten

        tree: PyTree = tree_unflatten(list(leaves), _loads(self.spec))
        return tree

    def with_grads(self, grads: Sequence[bool]) -> BoundaryMeta:
        return BoundaryMeta(self.spec, self.leaves, tuple(grads))

    def encode(self) -> torch.Tensor:
        import torch

        spec = self.spec.encode()
        head = [len(self.leaves), len(spec)]
        codes = [int(v) for meta in self.leaves for v in meta.encode().tolist()]
        return torch.tensor([*head, *codes, *map(int, self.grads), *spec], dtype=torch.int64)

    @staticmethod
    def decode(data: torch.Tensor) -> BoundaryMeta:
        values = [int(v) for v in data.tolist()]
        count, size = values[0], values[1]
        width = 2 + _MAX_DIMS
        codes = values[2:2 + count * width]
        leaves = tuple(TensorMeta.decode(_int64(codes[i * width:(i + 1) * width]))
                       for i in range(count))
        grads = tuple(bool(v) for v in values[2 + count * width:2 + count * (width + 1)])
        spec = bytes(values[2 + count * (width + 1):][:size]).decode()
        return BoundaryMeta(spec, leaves, grads)


def flatten(value: object, what: str) -> tuple[list[torch.Tensor], TreeSpec]:
    """The tensors of a pytree and its structure; refuses anything but tensors as leaves."""
    import torch
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten(value)
    bad = [type(leaf).__name__ for leaf in leaves if not isinstance(leaf, torch.Tensor)]
    if bad or not leaves:
        raise PipelineSetupError(
            f"{what} is {type(value).__name__}"
            f"{' holding ' + ', '.join(sorted(set(bad))) if bad else ' with no tensor'}: "
            "what crosses a stage boundary (and a batch's inputs and targets) is a tensor, or "
            "tuples, lists and dicts of tensors; pass other values to the stage's module "
            "another way")
    return leaves, spec


@functools.lru_cache(maxsize=256)
def _loads(text: str) -> TreeSpec:
    """A boundary's structure from its text, parsed once: every receive rebuilds its tree."""
    from torch.utils._pytree import treespec_loads

    return treespec_loads(text)


def _dumps(spec: TreeSpec) -> str:
    from torch.utils._pytree import treespec_dumps

    text: str = treespec_dumps(spec)
    return text


def _int64(values: list[int]) -> torch.Tensor:
    import torch

    return torch.tensor(values, dtype=torch.int64)


@dataclass
class Transfer:
    """One posted send or receive: its step, its requests, and the tensors it moves."""

    step: Step
    works: list[dist.Work]  # one per tensor (or one for a whole batch, repeated, on NCCL)
    tensors: list[torch.Tensor]
    peer: int


class Transport:
    """Sends and receives of one executor over one process group."""

    def __init__(self, group: dist.ProcessGroup | None, stage_ranks: tuple[int, ...],
                 microbatches: int, device: torch.device, board: FailureBoard | None = None,
                 global_rank: int | None = None, stopper: GroupStopper | None = None) -> None:
        self.board = board
        self.stopper = stopper  # asked before posting: nothing goes into a stopped group
        self.group = group
        if global_rank is None:
            import torch.distributed as dist

            global_rank = dist.get_rank()
        self.global_rank = global_rank  # what messages name: unique across replicas
        self.stage_ranks = stage_ranks
        self.microbatches = microbatches
        self.device = device
        self.boundary: dict[int, BoundaryMeta] = {}  # stage s -> its output's (s -> s+1)
        self._globals: dict[int, int] = {}
        highest = _RUNS_IN_TAGS * 2 * len(stage_ranks) * microbatches * MAX_BOUNDARY_TENSORS
        if highest > _MAX_TAG:
            raise PipelineSetupError(
                f"{len(stage_ranks)} stages x {microbatches} microbatches leave no room for "
                "the message tags that keep transfers apart: use fewer microbatches or stages")

    def _global(self, group_rank: int) -> int:
        """The global rank of ``group_rank``, looked up once (torch walks the group's
        ranks on every call, and a step posts many operations)."""
        found = self._globals.get(group_rank)
        if found is None:
            import torch.distributed as dist

            found = (group_rank if self.group is None
                     else dist.get_global_rank(self.group, group_rank))
            self._globals[group_rank] = found
        return found

    def tag(self, run: int, step: Step) -> int:
        """Unique per (run, direction, sending stage, micro) among the runs in flight."""
        assert step.stage is not None and step.micro is not None
        grad = step.type in (StepType.BWD_SEND, StepType.BWD_RECV)
        sender = step.stage if step.type in (StepType.FWD_SEND, StepType.BWD_SEND) else (
            step.stage - 1 if step.type is StepType.FWD_RECV else step.stage + 1)
        slot = (run % _RUNS_IN_TAGS) * 2 + grad
        return (slot * len(self.stage_ranks) + sender) * self.microbatches + step.micro

    def peer(self, step: Step) -> int:
        assert step.stage is not None
        forward_peer = step.type in (StepType.FWD_SEND, StepType.BWD_RECV)
        return self.stage_ranks[step.stage + 1 if forward_peer else step.stage - 1]

    def carried(self, step: Step) -> list[TensorMeta]:
        """The tensors a send or receive of ``step`` moves: all of the boundary's forward,
        those that carry a gradient backward."""
        assert step.stage is not None
        forward = step.type in (StepType.FWD_SEND, StepType.FWD_RECV)
        boundary = step.stage - (step.type is StepType.FWD_RECV) - (
            step.type is StepType.BWD_SEND)
        meta = self.boundary[boundary]
        return [leaf for leaf, grad in zip(meta.leaves, meta.grads) if forward or grad]

    def receive_buffers(self, step: Step) -> list[torch.Tensor]:
        import torch

        return [torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
                for meta in self.carried(step)]

    def post(self, run: int, steps: list[tuple[Step, list[torch.Tensor]]], batched: bool
             ) -> list[Transfer]:
        """Post the sends and receives of ``steps`` (each with the tensors it sends or
        fills): each step's tensors in one ``batch_isend_irecv``, or with ``batched`` all of
        them in one; never an operation alone (see the module's docstring)."""
        import torch.distributed as dist

        per_step = []
        for step, tensors in steps:
            send = step.type in (StepType.FWD_SEND, StepType.BWD_SEND)
            base = self.tag(run, step) * MAX_BOUNDARY_TENSORS
            per_step.append([dist.P2POp(dist.isend if send else dist.irecv, tensor,
                                        self._global(self.peer(step)), self.group, base + i)
                             for i, tensor in enumerate(tensors)])
        if self.stopper is not None and self.stopper.stopped:
            raise self._error(steps[0][0], RuntimeError("the group was stopped after a failure"))
        try:
            groups = [[op for ops in per_step for op in ops]] if batched else per_step
            works: list[dist.Work] = []
            for ops in groups:
                batch = batch_isend_irecv(ops)
                works += batch if len(batch) == len(ops) else [batch[0]] * len(ops)
        except RuntimeError as exc:
            raise self._error(steps[0][0], exc) from exc
        transfers, first = [], 0
        for step, tensors in steps:  # NCCL: one request for a whole batch, repeated
            transfers.append(Transfer(step, works[first:first + len(tensors)], tensors,
                                      self.peer(step)))
            first += len(tensors)
        return transfers

    def wait(self, transfer: Transfer) -> list[torch.Tensor]:
        try:
            for work in transfer.works:
                work.wait()
        except RuntimeError as exc:
            raise self._error(transfer.step, exc) from exc
        return transfer.tensors

    def _error(self, step: Step, exc: BaseException) -> PipelineCommError:
        verb = "sending to" if step.type in (StepType.FWD_SEND, StepType.BWD_SEND) else (
            "receiving from")
        return self.failure(f"{step} ({verb} rank {self._global(self.peer(step))})", exc)

    def failure(self, where: str, exc: BaseException) -> PipelineCommError:
        """The error for a transfer or collective at ``where`` that failed with ``exc``: a
        :class:`PeerFailedError` naming the rank that failed first when one said so."""
        posted = self.board.read() if self.board is not None else None
        if posted is not None:
            failed_rank = int(posted.split(" ", 2)[1])
            return PeerFailedError(
                f"rank {self.global_rank} stopped at {where}: {posted}. Call recover() on the "
                "executor of every rank before the next step (or exit)", failed_rank)
        return PipelineCommError(
            f"rank {self.global_rank}: {where} failed: {exc}. A peer rank died, was stopped or runs "
            "another schedule (see its output); call recover() on the executor of every rank "
            "before the next step (or exit)")

    # -- shapes, once ---------------------------------------------------------------------

    def recv_meta(self, stage: int) -> BoundaryMeta:
        """The meta of stage ``stage - 1``'s output, from the rank that runs it (blocking):
        its length, then itself (tags below those of the first run's transfers; the
        exchange is over before any transfer is posted)."""
        import torch
        import torch.distributed as dist

        peer = self._global(self.stage_ranks[stage - 1])
        try:
            size = torch.zeros(1, dtype=torch.int64)
            self._blocking(dist.irecv, size, peer, stage)
            data = torch.zeros(int(size.item()), dtype=torch.int64)
            self._blocking(dist.irecv, data, peer, len(self.stage_ranks) + stage)
        except RuntimeError as exc:
            raise self.failure(f"receiving the shape of stage {stage - 1}'s output from rank "
                               f"{peer}", exc) from exc
        return BoundaryMeta.decode(data)

    def send_meta(self, stage: int, meta: BoundaryMeta) -> None:
        import torch
        import torch.distributed as dist

        peer = self._global(self.stage_ranks[stage + 1])
        data = meta.encode()
        try:
            self._blocking(dist.isend, torch.tensor([data.numel()], dtype=torch.int64), peer,
                           stage + 1)
            self._blocking(dist.isend, data, peer, len(self.stage_ranks) + stage + 1)
        except RuntimeError as exc:
            raise self.failure(f"sending the shape of stage {stage}'s output to rank "
                               f"{peer}", exc) from exc

    def _blocking(self, op: Callable[..., object], tensor: torch.Tensor, peer: int,
                  tag: int) -> None:
        """One send or receive, posted as every other one is (a batch), and waited for."""
        import torch.distributed as dist

        for work in batch_isend_irecv([dist.P2POp(op, tensor, peer, self.group, tag)]):
            work.wait()


def batch_isend_irecv(ops: list[dist.P2POp]) -> list[dist.Work]:
    """torch's ``batch_isend_irecv``, and on a backend that coalesces (NCCL) the group call
    it opened closed again where an operation raises. torch opens the call
    (``ncclGroupStart``, a count per thread) before the operations and closes it after them
    with no ``finally``: a raise (a group aborted after a failure) leaves the count up, and
    a communicator made next, as ``recover()`` makes one, would then never launch its
    operations."""
    import torch.distributed as dist

    try:
        return dist.batch_isend_irecv(ops)
    except BaseException:
        _close_coalescing(ops[0].group, ops[0].tensor.device)
        raise


def _close_coalescing(group: dist.ProcessGroup | None, device: torch.device) -> None:
    """End the coalescing a raising ``batch_isend_irecv`` left open on ``group``."""
    import torch.distributed as dist

    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        if not pg._get_backend(device).supports_coalescing:
            return
    except RuntimeError:
        return
    dist.distributed_c10d._world.pg_coalesce_state.pop(pg, None)
    with suppress(Exception):  # an aborted communicator: the call is closed all the same
        pg._end_coalescing(device)
