"""Starting the ranks: under torchrun, or spawned here as local processes.

:func:`spawn` runs ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes with a
process group already initialized, and returns each rank's result. A rank that raises or dies
makes :func:`spawn` raise :class:`RankFailedError` with every rank's story; the other ranks
then fail within the process group's timeout instead of hanging.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import traceback
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT_S = 60.0


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


def _rank_main(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
               fn: Callable[..., Any], args: tuple[Any, ...], results: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    try:
        _select_device(backend)
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        results.put((rank, False, traceback.format_exc()))
        return
    # Pickled here, by value: torch's queue would share tensors through file descriptors
    # that vanish when this process exits.
    results.put((rank, True, pickle.dumps(value)))


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
          timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` local processes; their results.

    ``fn`` and ``args`` must be picklable (a module-level function). ``timeout_s`` bounds
    every collective and transfer; the whole run may take longer.
    """
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = _free_port()
    processes = [context.Process(target=_rank_main, name=f"pipeswap-rank{rank}",
                                 args=(rank, world_size, port, backend, timeout_s, fn, args,
                                       results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    reported: set[int] = set()
    while len(reported) < world_size:
        if not results.empty():
            rank, ok, value = results.get()
            reported.add(rank)
            if ok:
                values[rank] = pickle.loads(value)
            else:
                failures[rank] = value
            continue
        for rank, process in enumerate(processes):
            process.join(timeout=0.05)
            if not process.is_alive() and rank not in reported and results.empty():
                reported.add(rank)
                failures[rank] = f"rank {rank} died with exit code {process.exitcode}"
    for process in processes:
        process.join()
    if failures:
        story = "\n".join(f"--- rank {rank} ---\n{text.rstrip()}"
                          for rank, text in sorted(failures.items()))
        raise RankFailedError(f"{len(failures)} of {world_size} ranks failed:\n{story}",
                              failures)
    return [values[rank] for rank in range(world_size)]
