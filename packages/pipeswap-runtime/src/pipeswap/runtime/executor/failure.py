"""How a failed step stops every rank at once, and how :meth:`recover` makes the executor
usable again.

The rank that fails first posts why on the transport's failure board and stops its groups,
the pipeline's communication group and the data-parallel ones (gloo's connections broken,
NCCL's communicators aborted: :class:`~pipeswap.runtime.distributed.peer_watch.GroupStopper`), so
that every peer, in this replica or another, stops at its next transfer or collective with a
:class:`~pipeswap.runtime.errors.PeerFailedError` naming that rank instead of waiting until its
timeout. On NCCL, where a peer's operations do not fail by themselves, each rank's
:class:`~pipeswap.runtime.distributed.peer_watch.PeerWatch` reads the post and stops its own
groups. The step's collectives go through :func:`collective` and :meth:`FailureProtocol.agree`,
which turn the broken connection into that error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import suppress
from typing import TYPE_CHECKING, TypeVar

from pipeswap.runtime.distributed.collectives import agree, members
from pipeswap.runtime.errors import PeerFailedError, PipelineCommError, PipelineError

if TYPE_CHECKING:
    import torch.distributed as dist

    from pipeswap.runtime.distributed.peer_watch import GroupStopper
    from pipeswap.runtime.distributed.transport import Transport
    from pipeswap.runtime.executor.sharded_stage import ShardedStage
    from pipeswap.schedule import Step

_T = TypeVar("_T")


class FailureProtocol:
    """One executor's side of the protocol: why its last step failed (until
    :meth:`recover`), and the step's collectives that name a failed peer.

    ``rank``: this rank in the pipeline; ``dp_group`` and ``dp_size``: its data-parallel
    group; ``replayed``: a replayed rank, which has nobody to tell or agree with;
    ``spans_world``: whether the pipeline's groups span the world (see :meth:`recover`);
    ``stopper``: the groups a failure stops
    (:class:`~pipeswap.runtime.distributed.peer_watch.GroupStopper`).
    """

    def __init__(self, rank: int, dp_group: dist.ProcessGroup | None, dp_size: int, *,
                 replayed: bool, spans_world: bool,
                 stopper: GroupStopper) -> None:
        self.rank = rank
        self.stopper = stopper  # the groups a failure stops (the executor keeps it current)
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.replayed = replayed
        self.spans_world = spans_world
        self.reason: str | None = None  # why the last step failed, until recover()
        self._members: dict[dist.ProcessGroup | None, list[int]] = {}  # agree()'s ranks

    def check_ready(self) -> None:
        """Refuse a step while a failed one has not been recovered from."""
        if self.reason is not None:
            raise PipelineError(
                f"rank {self.rank}: a previous step failed ({self.reason}); call recover() on "
                "every rank before the next step")

    def fail(self, exc: BaseException, where: str, transport: Transport) -> None:
        """Tell the peers the step failed here, at ``where``: post the reason (this rank's
        failure, or the failure that stopped it) to the pipeline and the data-parallel
        group, and stop both, so that no peer, in this replica or another, waits for this
        rank until its timeout."""
        import torch.distributed as dist

        first_line = (str(exc).strip().splitlines() or [""])[0][:300]
        if self.replayed:  # no peers to tell
            self.reason = f"replayed rank {self.rank} failed at {where}: {first_line}"
            return
        who = f"rank {dist.get_rank()}"
        if self.dp_size > 1:
            dp_rank = dist.get_rank(self.dp_group)
            who += f" (pipeline rank {self.rank}, data-parallel rank {dp_rank})"
        reason = f"{who} failed at {where}: {type(exc).__name__}: {first_line}"
        assert transport.board is not None
        if isinstance(exc, PeerFailedError):  # pass the first failure on to other groups
            first = transport.board.read()
            if first is not None:
                transport.board.post(first)
        elif not isinstance(exc, PipelineCommError):
            transport.board.post(reason)
        self.reason = reason
        self.stopper.stop()

    def agree(self, transport: Transport, what: str, group: dist.ProcessGroup | None) -> None:
        """The step's end on every rank of ``group``
        (:func:`~pipeswap.runtime.distributed.collectives.agree`); a peer that failed makes it
        raise at once, naming that peer. A replayed rank has nobody to agree with."""
        if self.replayed:
            return
        ranks = self._members.get(group)
        if ranks is None:  # looked up once: torch walks a group's ranks for each one
            ranks = self._members[group] = members(group)
        try:
            agree(group, ranks)
        except RuntimeError as exc:
            raise transport.failure(what, exc) from exc

    def recover(self, transport: Transport, sharded: Iterable[ShardedStage],
                replace: Callable[[], Transport]) -> Transport:
        """After a failed step, on every rank: reset the sharded stages (FSDP drops what the
        step left in flight) and return a transport over a fresh communication group from
        ``replace`` (a replayed rank keeps its own: no connection to replace). Refused with
        more than one data-parallel replica: the failure closed the data-parallel group,
        which cannot be reopened."""
        import torch.distributed as dist

        if self.dp_size > 1:
            raise PipelineError(
                f"rank {self.rank}: a failed step closed the data-parallel group to stop the "
                "other pipeline replicas, and a closed group cannot be reopened: end the run "
                "and restart it (from a checkpoint)")
        for stage in sharded:
            stage.reset()
        if self.replayed:
            self.reason = None
            return transport
        old = transport.group
        fresh = replace()
        self.reason = None
        # A pipeline that spans the world destroys its broken group; one replica of several
        # keeps it, as destroying it would let a new group repeat a live group's name (see
        # pipeswap.runtime.executor.setup.new_transport).
        if old is not None and self.spans_world:
            with suppress(Exception):  # already broken on purpose; only its memory is left
                dist.destroy_process_group(old)
        return fresh


def collective(transport: Transport, what: Step | str, call: Callable[[], _T]) -> _T:
    """Run FSDP's gathers, waits or reductions over the data-parallel group: where they
    fail because a peer failed and said so, raise the error that names it."""
    try:
        return call()
    except RuntimeError as exc:
        if transport.board is not None and transport.board.read() is not None:
            raise transport.failure(f"{what} (FSDP, data-parallel group)", exc) from exc
        raise
