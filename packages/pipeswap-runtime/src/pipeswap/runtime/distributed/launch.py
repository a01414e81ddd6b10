"""Starting the ranks: under torchrun, or spawned here as local processes.

:func:`spawn` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes with a
process group already initialized, and returns each rank's result. A rank that raises or dies
makes :func:`spawn` raise :class:`RankFailedError` with every rank's story. No rank outlives
the job: ranks still running a few seconds after another failed are killed, and when the
launching process is interrupted (Ctrl-C), terminated (SIGTERM, as ``timeout``, Slurm and
Docker send) or killed, its ranks go with it.

The rendezvous store (where the ranks meet, and where the failure board and the peer watch
keep their keys) is served by the launching process, on the loopback interface only: no rank
holds it, so any rank, rank 0 included, may die or stop and the others still reach it, and
nothing off this host can. The failure protocol tells a failed rank's peers at once, and a
rank waiting on a hung peer fails at its timeout; so a hung rank ends the job within its
peers' timeout plus those few seconds. Each rank's ending is a :class:`~pipeswap.runtime.distributed.rank_failure.RankFailure`,
with the step it had begun (:func:`mark_step`).
"""

from __future__ import annotations

import ctypes
import datetime
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

from pipeswap.runtime.distributed.process_beat import process_state
from pipeswap.runtime.distributed.rank_failure import (
    Ending,
    RankFailure,
    cause,
    describe,
    exit_summary,
)
from pipeswap.runtime.errors import PipelineSetupError

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import SimpleQueue

    from torch.distributed.device_mesh import DeviceMesh
    from types import FrameType

    # what a rank reports: its rank, and its pickled result or its failure
    Results = SimpleQueue[tuple[int, bytes | RankFailure]]

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 60.0
_GRACE_S = 5.0  # how long a rank asked to stop may take before it is killed
_REPORT_S = 5.0  # how long the other ranks may take to report once one has failed


class RankFailedError(RuntimeError):
    """One or more spawned ranks raised or died; the message holds each rank's error,
    ``failures`` each rank's story and ``reports`` each rank's :class:`RankFailure`."""

    def __init__(self, message: str, failures: dict[int, str],
                 reports: dict[int, RankFailure] | None = None) -> None:
        super().__init__(message)
        self.failures = failures
        self.reports = reports or {}

    @property
    def cause(self) -> RankFailure | None:
        """The failure that explains the others (None when the ranks gave no reports)."""
        return cause(self.reports) if self.reports else None


class _Progress:
    """Each rank's current step, in memory the launcher shares with its ranks."""

    def __init__(self, steps: Sequence[int], rank: int) -> None:
        self.steps, self.rank = steps, rank


_progress: _Progress | None = None  # set in a spawned rank's process by _rank_main


def current_step() -> int | None:
    """The step this rank last began (:func:`mark_step`), None before the first."""
    return None if _progress is None else _step(_progress.steps, _progress.rank)


def mark_step(step: int) -> None:
    """Tell the launcher this rank has begun ``step``, so that a failure report names it; a
    no-op outside a rank :func:`spawn` started."""
    if _progress is not None:
        cast("list[int]", _progress.steps)[_progress.rank] = step


def launched_by_torchrun() -> bool:
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_from_env(backend: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the process group torchrun describes in the environment; (rank, world size).

    Where the workers share their agent's store, which outlives a restart
    (``--max-restarts``), each attempt keeps its keys apart under a prefix of its own: the
    groups of a restarted job have the names they had before, and would otherwise read the
    addresses the killed attempt's ranks left there."""
    import torch.distributed as dist
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, unstubbed

    global _progress
    _select_device(backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)
        shared = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=timeout)
        apart = dist.distributed_c10d.PrefixStore(f"pipeswap/attempt-{attempt}", shared)
        dist.init_process_group(backend, timeout=timeout, rank=rank, world_size=world,
                                store=apart)
    else:
        dist.init_process_group(backend, timeout=timeout)
    _progress = _Progress([-1], 0)  # no launcher to tell: kept for this rank's own report
    return dist.get_rank(), dist.get_world_size()


def pipeline_mesh(device_type: str, ranks: int, dp: int, timeout_s: float) -> DeviceMesh:
    """The world as a (``pp``, ``dp``) device mesh, ``ranks`` pipeline ranks by ``dp``
    replicas (pipeline-rank major), whose groups fail after ``timeout_s`` as the world group
    does: ``init_device_mesh`` gives the groups it makes torch's default (30 minutes), so a
    hung rank would hang FSDP's collectives that long. Every rank calls it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if ranks * dp != dist.get_world_size():
        raise PipelineSetupError(f"a mesh of {ranks} pipeline ranks x {dp} replicas needs "
                                 f"{ranks * dp} ranks, but the world has "
                                 f"{dist.get_world_size()}: start ranks x dp processes")
    layout = torch.arange(ranks * dp).reshape(ranks, dp)
    timeout = datetime.timedelta(seconds=timeout_s)
    me = dist.get_rank()
    mine: dict[str, dist.ProcessGroup] = {}
    # every rank creates every group, in the same order, as new_group requires
    for name, lines in (("pp", layout.t().tolist()), ("dp", layout.tolist())):
        for line in lines:
            group = dist.new_group(line, timeout=timeout)
            if me in line:
                assert group is not None
                mine[name] = group
    return DeviceMesh.from_group([mine["pp"], mine["dp"]], device_type, mesh=layout,
                                 mesh_dim_names=("pp", "dp"))


def backend_for(device: str) -> str:
    """gloo on CPU; on CUDA, NCCL for device tensors and gloo for the small CPU tensors of
    the set-up checks and shape exchange."""
    return "gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"


def _select_device(backend: str) -> None:
    """One GPU per local rank, before NCCL starts. (The world group is not bound to it with
    ``device_id``: torch then makes every later NCCL group by splitting the world's
    communicator, which every rank must join, and a pipeline replica's groups are made by its
    own ranks alone. The executor's own group is created eagerly instead.)"""
    if "nccl" in backend:
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


@contextmanager
def _served_store(world_size: int, timeout_s: float) -> Iterator[int]:
    """A rendezvous store served here while the block runs, listening on 127.0.0.1 only (a
    socket bound there, handed to the store); its port. The ranks join it as torchrun's
    workers join their agent's (``TORCHELASTIC_USE_AGENT_STORE``)."""
    from torch.distributed import TCPStore  # type: ignore[attr-defined]  # public, unstubbed

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(max(128, 2 * world_size))
        port: int = sock.getsockname()[1]
        store = TCPStore("127.0.0.1", port, world_size, is_master=True,
                              timeout=datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=sock.fileno())
        sock.detach()  # the store closes it
    try:
        yield port
    finally:
        del store


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when the launching one dies (Linux), so a killed
    launcher leaves no rank behind; elsewhere, the launcher's own clean-up has to do."""
    if sys.platform.startswith("linux"):

        with suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def _rank_main(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
               fn: Callable[..., object], args: tuple[object, ...], results: Results,
               parent: int, steps: Sequence[int]) -> None:
    import torch.distributed as dist

    global _progress
    _die_with_parent(parent)
    _progress = _Progress(steps, rank)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size),  # as torchrun: all on this host
                      TORCHELASTIC_USE_AGENT_STORE="True")  # the launcher serves the store
    try:
        _select_device(backend)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args)
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        # reported before the teardown, which may block on work a failed peer never ends
        results.put((rank, describe(exc, traceback.format_exc(), rank, _step(steps, rank))))
        if dist.is_initialized():
            with suppress(Exception):
                dist.destroy_process_group()
        return
    # Pickled here, by value: torch's queue would share tensors through file descriptors
    # that vanish when this process exits.
    results.put((rank, pickle.dumps(value)))


def spawn(fn: Callable[..., T], world_size: int, *args: object, backend: str = "gloo",
          timeout_s: float = DEFAULT_TIMEOUT_S) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; their results.

    ``fn`` and ``args`` must be picklable (a module-level function). ``timeout_s`` bounds
    every collective and transfer; the whole run may take longer. Interrupting or
    terminating this process stops every rank before the exception (``KeyboardInterrupt``,
    or ``SystemExit`` for SIGTERM) goes on.
    """
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results: Results = context.SimpleQueue()
    steps = context.Array("q", [-1] * world_size, lock=False)  # each rank's step, -1: none
    values: dict[int, T] = {}
    failures: dict[int, RankFailure] = {}
    with _served_store(world_size, timeout_s) as port:
        processes: list[BaseProcess] = [
            context.Process(target=_rank_main, name=f"pipeswap-rank{rank}",
                            args=(rank, world_size, port, backend, timeout_s, fn, args,
                                  results, os.getpid(), steps))
            for rank in range(world_size)]
        with _stopping_on_signals(), _stopped_at_exit(processes):
            for process in processes:
                process.start()
            _collect(processes, results, values, failures, steps)
    if failures:
        story = "\n".join(f"--- rank {rank} ---\n{failure.story.rstrip()}"
                          for rank, failure in sorted(failures.items()))
        raise RankFailedError(f"{len(failures)} of {world_size} ranks failed:\n{story}",
                              {rank: failure.story for rank, failure in failures.items()},
                              failures)
    return [values[rank] for rank in range(world_size)]


def _step(steps: Sequence[int], rank: int) -> int | None:
    step = steps[rank]
    return None if step < 0 else step


def _collect(processes: list[BaseProcess], results: Results, values: dict[int, T],
             failures: dict[int, RankFailure], steps: Sequence[int]) -> None:
    """Read every rank's result as it comes; once one rank failed, the others get a few
    seconds to report before they are killed (each is told at once, or fails at its timeout
    waiting for a hung peer, which is the one left running)."""
    reported: set[int] = set()
    deadline: float | None = None

    def read() -> None:
        rank, value = results.get()
        reported.add(rank)
        if isinstance(value, bytes):
            values[rank] = pickle.loads(value)
        else:
            failures[rank] = value

    while len(reported) < len(processes):
        if not results.empty():
            read()
        else:
            for rank, process in enumerate(processes):
                process.join(timeout=0.05)
                if not process.is_alive() and rank not in reported and results.empty():
                    reported.add(rank)
                    summary = exit_summary(process.exitcode)
                    failures[rank] = RankFailure(rank, Ending.DIED, summary,
                                                 f"rank {rank} {summary}", _step(steps, rank))
        if failures and deadline is None:
            deadline = time.monotonic() + _REPORT_S
        if deadline is not None and time.monotonic() > deadline:
            while not results.empty():  # what came in while the ranks were polled
                read()
            first = next(iter(failures))
            for rank in sorted(set(range(len(processes))) - reported):
                story = (f"rank {rank} was killed: still running {_REPORT_S:.0f} s after rank "
                         f"{first} failed")
                failures[rank] = RankFailure(rank, Ending.KILLED, "was killed", story,
                                             _step(steps, rank))
                processes[rank].kill()  # it had its chance: no SIGTERM grace for a hung rank
            while not results.empty():  # a report sent just before the kill stands
                read()
            return


@contextmanager
def _stopped_at_exit(processes: list[BaseProcess]) -> Iterator[None]:
    """However the block ends (an error, Ctrl-C, SIGTERM), no rank is left running."""
    try:
        yield
    finally:
        _stop(processes)


def _stop(processes: list[BaseProcess]) -> None:
    """Ask the ranks still running to stop (SIGTERM), then kill those that do not."""
    started = [p for p in processes if p.pid is not None]
    for process in started:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + _GRACE_S
    for process in started:
        process.join(timeout=max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


@contextmanager
def _stopping_on_signals() -> Iterator[None]:
    """SIGTERM raises ``SystemExit(143)`` here (Python's default would end the process
    without any clean-up); SIGINT already raises ``KeyboardInterrupt``."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


#: How the peer watch names a neighbour it found stopped on this host.
_STOPPED_HERE = re.compile(r"its process (\d+) on this host is stopped")


def end_stopped_sibling(error: str) -> None:
    """Under torchrun, kill the stopped worker that ``error`` (a peer watch's report) names,
    where it is this process's sibling (the same agent's worker) and still stopped: the
    agent ends a failed job's workers with SIGTERM, which a stopped process takes only once
    resumed, and waits 30 s before its SIGKILL. spawn's launcher kills such a rank itself."""
    found = _STOPPED_HERE.search(error)
    if found is None:
        return
    pid = int(found.group(1))
    try:
        parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return
    if parent == os.getppid() and process_state(pid) in ("T", "t"):
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

