"""Point-to-point transfers between stages on different ranks, over torch.distributed.

Every message carries a tag naming its run, direction, sending stage and microbatch. With
gloo a message can then only land in the receive posted for it (and a receive left over from a
failed run can never take a later run's data); NCCL ignores tags and matches in order, which
the validated schedule keeps consistent. Shapes and dtypes of the boundary tensors are
exchanged once, before the first step, by a chain over the stages in order (CPU tensors: on
CUDA the process group needs a CPU backend too, as ``backend_for`` sets up).
"""

from __future__ import annotations

import datetime
from contextlib import suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pipeswap.runtime.errors import PeerFailedError, PipelineCommError, PipelineSetupError
from pipeswap.schedule import Step, StepType

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

_DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8", "bool")
_MAX_DIMS = 8
_RUNS_IN_TAGS = 512
_BREAK_TAG = 2**30  # never a transfer's tag: see break_links


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

    @staticmethod
    def blank() -> torch.Tensor:
        import torch

        return torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)


@dataclass
class Transfer:
    """One posted send or receive: its step, its request, and the tensor it moves."""

    step: Step
    work: Any  # torch.distributed Work
    tensor: torch.Tensor
    peer: int


class FailureBoard:
    """Where the first rank to fail posts what failed, so that its peers, which only see a
    broken connection, can name the rank and step: one key of the rendezvous store per
    communication group. A board spans several groups (a pipeline's and its data-parallel
    one): a failure is posted in each, so it reaches every rank of every group."""

    def __init__(self, *groups: dist.ProcessGroup) -> None:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        self._stores = [dist.PrefixStore(  # type: ignore[attr-defined]
            f"pipeswap/{group.group_name}/", store) for group in groups]

    def post(self, text: str) -> None:
        """Record ``text`` in each group unless another rank's failure came first there."""
        for store in self._stores:
            with suppress(Exception):  # the store may be gone with its rank; peers still fail
                store.compare_set("failed", "", text)

    def read(self) -> str | None:
        """The first failure posted, if any (the first group's first)."""
        for store in self._stores:
            try:
                if store.check(["failed"]):
                    return bytes(store.get("failed")).decode("utf-8", "replace")
            except Exception:  # noqa: BLE001 - no store, no story: the caller says what it saw
                continue
        return None


def break_links(group: dist.ProcessGroup) -> None:
    """Close this rank's connections in ``group`` so that every peer blocked on it fails at
    once instead of at its timeout (gloo closes a connection whose receive timed out)."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank(group)
    for peer in range(dist.get_world_size(group)):
        if peer != me:
            with suppress(Exception):
                work = dist.irecv(torch.zeros(1), dist.get_global_rank(group, peer),
                                  group=group, tag=_BREAK_TAG)
                if work is not None:
                    work.wait(datetime.timedelta(milliseconds=1))


def group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta:
    """The timeout ``group`` was created with (torch's default where it does not say)."""
    import torch
    import torch.distributed as dist

    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        timeout: datetime.timedelta = pg._get_backend(torch.device("cpu")).options._timeout
        return timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


class Transport:
    """Sends and receives of one executor over one process group."""

    def __init__(self, group: dist.ProcessGroup | None, stage_ranks: tuple[int, ...],
                 microbatches: int, device: torch.device, board: FailureBoard | None = None
                 ) -> None:
        import torch.distributed as dist

        self.board = board
        self.group = group
        self.rank = dist.get_rank(group)
        self.global_rank = dist.get_rank()  # what messages name: unique across replicas
        self.stage_ranks = stage_ranks
        self.microbatches = microbatches
        self.device = device
        self.boundary: dict[int, TensorMeta] = {}  # stage s -> meta of its output (s -> s+1)

    def _global(self, group_rank: int) -> int:
        import torch.distributed as dist

        return group_rank if self.group is None else dist.get_global_rank(self.group, group_rank)

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

    def receive_buffer(self, step: Step) -> torch.Tensor:
        import torch

        assert step.stage is not None
        boundary = step.stage - 1 if step.type is StepType.FWD_RECV else step.stage
        meta = self.boundary[boundary]
        return torch.empty(meta.shape, dtype=meta.dtype, device=self.device)

    def post(self, run: int, steps: list[tuple[Step, torch.Tensor]], batched: bool
             ) -> list[Transfer]:
        """Post the sends and receives of ``steps`` (each with the tensor it sends or fills);
        ``batched`` issues them as one ``batch_isend_irecv``."""
        import torch.distributed as dist

        ops = []
        for step, tensor in steps:
            send = step.type in (StepType.FWD_SEND, StepType.BWD_SEND)
            ops.append(dist.P2POp(dist.isend if send else dist.irecv, tensor,
                                  self._global(self.peer(step)), self.group,
                                  self.tag(run, step)))
        try:
            if batched:
                works = dist.batch_isend_irecv(ops)
                if len(works) != len(ops):  # NCCL: one request for the whole batch
                    works = [works[0]] * len(ops)
            else:
                works = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
        except RuntimeError as exc:
            raise self._error(steps[0][0], exc) from exc
        return [Transfer(step, work, tensor, self.peer(step))
                for (step, tensor), work in zip(steps, works)]

    def wait(self, transfer: Transfer) -> torch.Tensor:
        try:
            transfer.work.wait()
        except RuntimeError as exc:
            raise self._error(transfer.step, exc) from exc
        return transfer.tensor

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

    def recv_meta(self, stage: int) -> TensorMeta:
        """The meta of stage ``stage - 1``'s output, from the rank that runs it (blocking)."""
        import torch.distributed as dist

        data = TensorMeta.blank()
        try:
            dist.recv(data, self._global(self.stage_ranks[stage - 1]), self.group, tag=stage)
        except RuntimeError as exc:
            raise self.failure(f"receiving the shape of stage {stage - 1}'s output from rank "
                               f"{self._global(self.stage_ranks[stage - 1])}", exc) from exc
        return TensorMeta.decode(data)

    def send_meta(self, stage: int, meta: TensorMeta) -> None:
        import torch.distributed as dist

        try:
            dist.send(meta.encode(), self._global(self.stage_ranks[stage + 1]), self.group,
                      tag=stage + 1)
        except RuntimeError as exc:
            raise self.failure(f"sending the shape of stage {stage}'s output to rank "
                               f"{self._global(self.stage_ranks[stage + 1])}", exc) from exc


def all_gather_ints(value: int, group: dist.ProcessGroup | None) -> list[int]:
    """Every rank's ``value`` (below 2**63), in rank order; a collective without pickling.

    An all-reduce (sum) of one slot per rank, each rank filling its own: exact for int64, and
    gloo's all-reduce of a few integers is faster than its all-gather (4 ranks on 2 cores:
    about 0.6 ms against 4 ms when all arrive together, 2.8 against 3.8 ms after the last
    one arrives); the executor runs one at the end of every step.
    """
    import torch
    import torch.distributed as dist

    slots = torch.zeros(dist.get_world_size(group), dtype=torch.int64)
    slots[dist.get_rank(group)] = value
    dist.all_reduce(slots, group=group)
    values: list[int] = slots.tolist()
    return values


def gather_object(value: object, group: dist.ProcessGroup | None = None) -> list[object] | None:
    """Every rank's picklable ``value`` on rank 0 (None elsewhere); needs no numpy."""
    import pickle

    import torch
    import torch.distributed as dist

    payload = torch.frombuffer(bytearray(pickle.dumps(value)), dtype=torch.uint8)
    sizes = all_gather_ints(payload.numel(), group)
    padded = torch.zeros(max(sizes), dtype=torch.uint8)
    padded[:payload.numel()] = payload
    rank = dist.get_rank(group)
    chunks = [torch.zeros_like(padded) for _ in sizes] if rank == 0 else None
    dist.gather(padded, chunks, dst=0 if group is None else dist.get_global_rank(group, 0),
                group=group)
    if chunks is None:
        return None
    return [pickle.loads(bytes(chunk[:size].tolist())) for chunk, size in zip(chunks, sizes)]
