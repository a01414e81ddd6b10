"""Starting the ranks: under torchrun, or spawned here as local processes.

:func:`spawn` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes with a
process group already initialized, and returns each rank's result. A rank that raises or dies
makes :func:`spawn` raise :class:`RankFailedError` with every rank's story. No rank outlives
the job: ranks still running ``timeout_s`` after another failed are killed, and when the
launching process is interrupted (Ctrl-C), terminated (SIGTERM, as ``timeout``, Slurm and
Docker send) or killed, its ranks go with it.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import SimpleQueue
    from types import FrameType

    # what a rank reports: its rank, and its pickled result or the story of its failure
    Results = SimpleQueue[tuple[int, bytes | str]]

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 60.0
_GRACE_S = 5.0  # how long a rank asked to stop may take before it is killed


class RankFailedError(RuntimeError):
    """One or more spawned ranks raised or died; the message holds each rank's error."""

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


def launched_by_torchrun() -> bool:
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_from_env(backend: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the process group torchrun describes in the environment; (rank, world size)."""
    import torch.distributed as dist

    _select_device(backend)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def backend_for(device: str) -> str:
    """gloo on CPU; on CUDA, NCCL for device tensors and gloo for the small CPU tensors of
    the set-up checks and shape exchange."""
    return "gloo" if device == "cpu" else "cpu:gloo,cuda:nccl"


def _select_device(backend: str) -> None:
    """One GPU per local rank, before NCCL starts."""
    if "nccl" in backend:
        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent(parent: int) -> None:
    """Have the kernel kill this process when the launching one dies (Linux), so a killed
    launcher leaves no rank behind; elsewhere, the launcher's own clean-up has to do."""
    if sys.platform.startswith("linux"):
        import ctypes

        with suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


def _rank_main(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
               fn: Callable[..., object], args: tuple[object, ...], results: Results,
               parent: int) -> None:
    import torch.distributed as dist

    _die_with_parent(parent)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))  # as torchrun: all on this host
    try:
        _select_device(backend)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, traceback.format_exc()))
        return
    # Pickled here, by value: torch's queue would share tensors through file descriptors
    # that vanish when this process exits.
    results.put((rank, pickle.dumps(value)))


def spawn(fn: Callable[..., T], world_size: int, *args: object, backend: str = "gloo",
          timeout_s: float = DEFAULT_TIMEOUT_S) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; their results.

    ``fn`` and ``args`` must be picklable (a module-level function). ``timeout_s`` bounds
    every collective and transfer, and how long the other ranks may run on once one failed;
    the whole run may take longer. Interrupting or terminating this process stops every rank
    before the exception (``KeyboardInterrupt``, or ``SystemExit`` for SIGTERM) goes on.
    """
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results: Results = context.SimpleQueue()
    port = _free_port()
    processes: list[BaseProcess] = [
        context.Process(target=_rank_main, name=f"pipeswap-rank{rank}",
                        args=(rank, world_size, port, backend, timeout_s, fn, args, results,
                              os.getpid()))
        for rank in range(world_size)]
    values: dict[int, T] = {}
    failures: dict[int, str] = {}
    with _stopping_on_signals(), _stopped_at_exit(processes):
        for process in processes:
            process.start()
        _collect(processes, results, values, failures, timeout_s)
    if failures:
        story = "\n".join(f"--- rank {rank} ---\n{text.rstrip()}"
                          for rank, text in sorted(failures.items()))
        raise RankFailedError(f"{len(failures)} of {world_size} ranks failed:\n{story}",
                              failures)
    return [values[rank] for rank in range(world_size)]


def _collect(processes: list[BaseProcess], results: Results, values: dict[int, T],
             failures: dict[int, str], timeout_s: float) -> None:
    """Read every rank's result as it comes; once one rank failed, the others get
    ``timeout_s`` (plus a grace period) to finish before they are killed."""
    reported: set[int] = set()
    deadline: float | None = None
    while len(reported) < len(processes):
        if not results.empty():
            rank, value = results.get()
            reported.add(rank)
            if isinstance(value, bytes):
                values[rank] = pickle.loads(value)
            else:
                failures[rank] = value
        else:
            for rank, process in enumerate(processes):
                process.join(timeout=0.05)
                if not process.is_alive() and rank not in reported and results.empty():
                    reported.add(rank)
                    failures[rank] = f"rank {rank} died with exit code {process.exitcode}"
        if failures and deadline is None:
            deadline = time.monotonic() + timeout_s + _GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            first = min(failures)
            for rank in sorted(set(range(len(processes))) - reported):
                failures[rank] = (f"rank {rank} was killed: still running {timeout_s:.0f} s "
                                  f"after rank {first} failed")
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
