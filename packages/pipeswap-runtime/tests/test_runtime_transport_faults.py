"""The transport on NCCL's failure paths, on CPU: what NCCL does is played by stand-ins
that behave as torch's sources say it does (a thread's count of open NCCL group calls,
which a raise inside ``batch_isend_irecv`` leaves up; a group that an abort stops)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

from pipeswap.runtime.distributed.peer_watch import GroupStopper
from pipeswap.runtime.distributed.transport import Transport
from pipeswap.runtime.errors import PipelineCommError
from pipeswap.schedule import parse_step


class NcclStandIn:
    """One thread's NCCL group calls and the communicator's state, as
    ``ProcessGroupNCCL`` keeps them: ``_start_coalescing`` opens a group call,
    ``_end_coalescing`` closes it; an operation on an aborted communicator raises. A
    communicator made while a call is open never launches what is posted to it."""

    supports_coalescing = True

    def __init__(self) -> None:
        self.depth = 0  # ncclGroupStart calls not yet ended, on this thread
        self.aborted = False
        self.launched: list[str] = []

    def _get_backend(self, device: torch.device) -> NcclStandIn:
        return self

    def _start_coalescing(self, device: torch.device) -> None:
        self.depth += 1

    def _end_coalescing(self, device: torch.device) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.launched.append("batch")

    def post(self, op: Op) -> None:
        if self.aborted:
            raise RuntimeError("NCCL communicator was aborted")


@contextmanager
def _coalescing(group: NcclStandIn, device: torch.device) -> Iterator[None]:
    """torch's ``_coalescing_manager`` for P2P: opened before, closed after, no finally."""
    group._start_coalescing(device)
    yield
    group._end_coalescing(device)


def torch_batch(ops: list[Op]) -> list[Any]:
    """torch's ``batch_isend_irecv`` on a coalescing backend, with the stand-in's ops."""
    group = ops[0].group
    with _coalescing(group, ops[0].tensor.device):
        for op in ops:
            group.post(op)
    return [object()]


class Op(NamedTuple):
    """``P2POp``'s fields (torch's checks that the group is registered left out)."""

    op: object
    tensor: torch.Tensor
    peer: int
    group: NcclStandIn
    tag: int


@pytest.fixture
def nccl(monkeypatch: pytest.MonkeyPatch) -> NcclStandIn:
    monkeypatch.setattr(dist, "batch_isend_irecv", torch_batch)
    monkeypatch.setattr(dist, "P2POp", Op)
    return NcclStandIn()


def _transport(group: NcclStandIn, stopper: GroupStopper | None = None) -> Transport:
    made = Transport(group, (0, 1), 2, torch.device("cpu"), global_rank=0,  # type: ignore[arg-type]
                     stopper=stopper)
    made._globals = {0: 0, 1: 1}
    return made


SEND = parse_step("0SEND_F1")


def test_a_raise_inside_a_batch_closes_the_group_call_it_opened(nccl: NcclStandIn) -> None:
    """Posting into an aborted communicator raises inside the batch; the NCCL group call it
    opened is closed again, so the communicator made next launches its batches."""
    transport = _transport(nccl)
    nccl.aborted = True
    with pytest.raises(PipelineCommError, match="NCCL communicator was aborted"):
        transport.post(0, [(SEND, [torch.ones(2)])], batched=False)
    assert nccl.depth == 0
    fresh = NcclStandIn()  # recover()'s new group: its count is the thread's, shared
    fresh.depth = nccl.depth
    _transport(fresh).post(1, [(SEND, [torch.ones(2)])], batched=False)
    assert fresh.launched == ["batch"]


def test_torchs_own_batch_leaves_the_call_open(nccl: NcclStandIn) -> None:
    """What the stand-in plays: torch's function alone leaves the count up after a raise,
    and a communicator made next then never launches (the review's finding)."""
    nccl.aborted = True
    with pytest.raises(RuntimeError):
        dist.batch_isend_irecv([Op(dist.isend, torch.ones(2), 1, nccl, 0)])  # type: ignore[list-item]
    assert nccl.depth == 1
    fresh = NcclStandIn()
    fresh.depth = nccl.depth
    dist.batch_isend_irecv([Op(dist.isend, torch.ones(2), 1, fresh, 0)])  # type: ignore[list-item]
    assert fresh.launched == []


def test_nothing_is_posted_once_the_groups_are_stopped(
        nccl: NcclStandIn, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a failure has stopped the groups (the watch or this rank's own failure), the
    transport refuses to post, naming the step, before anything reaches NCCL."""
    posted: list[list[Op]] = []

    def record(ops: list[Op]) -> list[object]:
        posted.append(ops)
        return [object()]

    monkeypatch.setattr(dist, "batch_isend_irecv", record)
    stopper = GroupStopper([None])
    transport = _transport(nccl, stopper)
    stopper.stop()
    with pytest.raises(PipelineCommError, match=r"0SEND_F1 \(sending to rank 1\).*stopped"):
        transport.post(0, [(SEND, [torch.ones(2)])], batched=False)
    assert posted == [] and nccl.depth == 0
    stopper.renew(None)
    transport.post(0, [(SEND, [torch.ones(2)])], batched=False)
    assert len(posted) == 1
