"""A thread that turns a peer's failure into this rank's, where operations would not fail by
themselves.

On gloo a rank that fails breaks its connections and every peer's blocked transfer raises.
NCCL is not like that: a peer's ``work.wait()`` only makes a stream wait, the stream stays
blocked behind receives that will never complete, and the next host sync blocks until NCCL's
watchdog kills the process. And NCCL's per-operation timeout cannot tell a hung peer from a
long step. So each rank runs a :class:`PeerWatch`: it beats (a counter of its own in the
rendezvous store), follows the beats of the ranks it exchanges data with, and reads the
failure board. When a failure is posted, or a neighbour's beat stops for the detection
timeout (a stopped or hung process; a long step still beats), it posts that and stops this
rank's groups (:func:`stop_groups`: gloo's connections broken, other backends' communicators
aborted), so the operations blocked on them return and the step raises
:class:`~pipeswap.runtime.errors.PeerFailedError` naming the rank that failed.

A beat comes from a Python thread, so a rank whose main thread holds the interpreter lock
for longer than the timeout (one long call that never lets it go) falls silent while it
works. Each watch therefore posts where its process is (host and pid), and a silent
neighbour on this host is looked up before it is blamed: a process the kernel says is
running or waiting is busy, not gone, and is waited for; a stopped one (SIGSTOP, a
debugger), a dead one or a vanished one fails the step. For its neighbours on other hosts a
rank also beats from a small process of its own while its process runs
(:mod:`pipeswap.runtime.distributed.process_beat`): silent means both beats stopped.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

from pipeswap.runtime.distributed.failure_board import FailureBoard, break_links, clone_store
from pipeswap.runtime.distributed.process_beat import (
    process_state,
    start_process_beat,
    unprefixed,
)
from pipeswap.runtime.distributed.process_groups import device_types, only_gloo

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import Store


def stop_groups(groups: Sequence[dist.ProcessGroup | None]) -> None:
    """Make the peers' operations on this rank in ``groups`` fail now, and this rank's own
    blocked operations return: gloo's connections are closed; the groups with another
    backend (NCCL) are aborted as well (``ProcessGroup.abort``), all inside one NCCL group
    call as torch aborts its own, so that one communicator's abort cannot wait behind
    another's hung kernel."""
    import torch.distributed as dist

    aborted = []
    for group in groups:
        if group is None:
            continue
        if "cpu" in device_types(group):
            break_links(group)
        if not only_gloo(str(dist.get_backend_config(group))):
            aborted.append(group)
    if not aborted:
        return
    calls = _nccl_group_calls(aborted)
    with suppress(Exception):
        calls[0]()
    try:
        for group in aborted:
            with suppress(Exception):  # already aborted, or gone with a failed peer
                group.abort()
    finally:
        with suppress(Exception):
            calls[1]()


def _nccl_group_calls(groups: Sequence[dist.ProcessGroup]
                      ) -> tuple[Callable[[], None], Callable[[], None]]:
    """The start and end of an NCCL group call (``ncclGroupStart``/``End``, per thread),
    from the first of ``groups`` with a backend that has them; nothing to call without."""
    import torch

    for group in groups:
        try:
            backend = group._get_backend(torch.device("cuda"))
        except RuntimeError:
            continue
        start, end = (getattr(backend, "_group_start", None),
                      getattr(backend, "_group_end", None))
        if start is not None and end is not None:
            return start, end
    return _nothing, _nothing


def _nothing() -> None:
    return None


class GroupStopper:
    """The groups a failure stops on this rank, and whether it has stopped them: after
    that, nothing may be posted into them (an operation posted into an aborted NCCL group
    raises inside the NCCL group call it opened, which the communicator made next would
    inherit). The executor gives it a fresh transport's group after a recovery."""

    def __init__(self, groups: Sequence[dist.ProcessGroup | None]) -> None:
        self.groups = list(groups)
        self._stopped = threading.Event()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self, reason: str | None = None) -> None:
        """Stop the groups (``reason``: what the watch found, unused: a callback's)."""
        self._stopped.set()
        stop_groups(self.groups)

    def renew(self, transport_group: dist.ProcessGroup | None) -> None:
        """A recovered executor's fresh transport group, in place of its broken one."""
        self.groups[0] = transport_group
        self._stopped.clear()


class PeerWatch:
    """This rank's beat, and the watch on its ``neighbours``' beats and the ``board``.

    ``timeout_s``: how long a neighbour's beat may stop before it counts as failed; it
    checks ``timeout_s / 10`` apart (at most a second). ``store``: where the beats are
    (the rendezvous store by default). ``on_failure(text)`` runs once, in
    the watch's thread, with the failure posted or the one it found (``"rank N ..."``),
    while :meth:`arm` says a step runs; outside a step it only beats. A live rank's beat
    never stops (its own thread beats, whatever its step does), so a silence means a
    stopped, hung or vanished process.
    """

    def __init__(self, rank: int, neighbours: Sequence[int], timeout_s: float,
                 on_failure: Callable[[str], None], store: Store | None = None) -> None:
        import torch.distributed as dist

        if store is None:
            store = dist.distributed_c10d._get_default_store()
        # connections of the watch's own: a store client holds its lock through a blocking
        # call, and the main thread's may block (a rendezvous) while peers wait for a beat
        own = clone_store(store)
        self._beats = dist.distributed_c10d.PrefixStore("pipeswap/beats/", own)
        self._raw = unprefixed(own)  # where the process beats are (no prefix: see those)
        self._beats.set(f"where/{rank}", f"{socket.gethostname()} {os.getpid()}")
        self._where: dict[int, tuple[str, int]] = {}  # neighbours' posts, once read
        self._process_beat: subprocess.Popen[bytes] | None = None
        self._remote_checked = False  # whether the neighbours' hosts were all looked at
        self._given: FailureBoard | None = None
        self.rank = rank
        self.neighbours = sorted(set(neighbours) - {rank})
        self.board: FailureBoard | None = None  # the current step's, while armed
        self.timeout_s = timeout_s
        self.interval_s = min(1.0, timeout_s / 10)
        self.on_failure = on_failure
        self.reason: str | None = None  # what stopped the current step, once found
        self._armed = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pipeswap-watch-{rank}",
                                        daemon=True)
        self._thread.start()

    def arm(self, board: FailureBoard) -> None:
        """A step begins, with the transport's ``board``."""
        if board is not self._given:  # a new transport's
            self._given, self.board = board, board.cloned()
        self.reason = None
        self._armed.set()

    def disarm(self) -> None:
        self._armed.clear()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5 * self.interval_s + 5)
        if self._process_beat is not None:
            self._process_beat.kill()
            self._process_beat.wait()

    def _beat(self, rank: int, by: int) -> int:
        return int(self._beats.add(str(rank), by))

    def _posted(self, rank: int) -> tuple[str, int] | None:
        """Where neighbour ``rank``'s process runs (host, pid), as it posted; None until it
        has."""
        if rank not in self._where:
            key = f"where/{rank}"
            posted = (bytes(self._beats.get(key)).decode().split()
                      if self._beats.check([key]) else [])
            if not posted:
                return None  # not posted yet: ask again next time
            self._where[rank] = (posted[0], int(posted[1]))
        return self._where[rank]

    def _process(self, rank: int) -> int | None:
        """The pid of neighbour ``rank``'s process where it runs on this host, else None."""
        where = self._posted(rank)
        return where[1] if where is not None and where[0] == socket.gethostname() else None

    def _alive(self, rank: int) -> int:
        """Neighbour ``rank``'s beats: its watch thread's and its process beat's."""
        return self._beat(rank, 0) + int(self._raw.add(f"pipeswap/process-beat/{rank}", 0))

    def _start_process_beat(self) -> None:
        """Once a neighbour is known to run on another host, which cannot look this process
        up when its thread falls silent: the process beat
        (:mod:`pipeswap.runtime.distributed.process_beat`)."""
        if self._process_beat is not None or self._remote_checked:
            return
        where = [self._posted(rank) for rank in self.neighbours]
        if any(w is not None and w[0] != socket.gethostname() for w in where):
            self._process_beat = start_process_beat(
                self._raw, f"pipeswap/process-beat/{self.rank}", self.interval_s)
            self._remote_checked = True
        elif all(w is not None for w in where):
            self._remote_checked = True  # every neighbour on this host

    def _busy_here(self, rank: int) -> bool:
        """Whether silent neighbour ``rank`` runs on this host and the kernel says its
        process is running or waiting: busy (its beat held up), not gone."""
        pid = self._process(rank)
        return pid is not None and process_state(pid) in ("R", "S", "D")

    def _why(self, rank: int) -> str:
        pid = self._process(rank)
        state = None if pid is None else process_state(pid)
        if state == "T" or state == "t":
            return f"its process {pid} on this host is stopped: SIGSTOP, or a debugger"
        if pid is not None and (state in ("Z", "X")
                                or (state is None and Path("/proc/self").is_dir())):
            return f"its process {pid} on this host is gone"
        return "a stopped, hung or unreachable process"

    def _run(self) -> None:
        seen = {rank: (-1, time.monotonic()) for rank in self.neighbours}
        board: FailureBoard | None = None
        reached = time.monotonic()  # when the store last answered
        while not self._closed.wait(self.interval_s):
            now = time.monotonic()
            try:
                self._beat(self.rank, 1)
                self._start_process_beat()
                for rank in self.neighbours:
                    count = self._alive(rank)
                    if count != seen[rank][0]:
                        seen[rank] = (count, now)
                board = self.board
                found = board.read() if board is not None and self._armed.is_set() else None
                reached = now
            except Exception as exc:  # noqa: BLE001 - a store that does not answer
                if now - reached > self.timeout_s:  # gone with its host: the job ends
                    warnings.warn(f"rank {self.rank}: the rendezvous store has not answered "
                                  f"for {self.timeout_s:g} s ({exc}); this rank no longer "
                                  "watches its peers", stacklevel=1)
                    return
                continue  # a moment's trouble: try again
            if board is None or not self._armed.is_set() or self.reason is not None:
                continue
            if found is None:
                silent = [rank for rank, (_, at) in seen.items()
                          if now - at > self.timeout_s and not self._busy_here(rank)]
                if not silent:
                    continue
                found = (f"rank {silent[0]} stopped answering: no sign of life for "
                         f"{self.timeout_s:g} s ({self._why(silent[0])})")
                board.post(found)
                found = board.read() or found  # another rank's post may have come first
            self.reason = found
            with suppress(Exception):
                self.on_failure(found)
