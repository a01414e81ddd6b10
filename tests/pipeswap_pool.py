"""Shared rank processes for the multi-process tests: started once per test session and
reused by every case that only needs "run this function on P ranks", so that the suite pays
for starting a process and importing torch four times, not once per rank of every case.

Each case still gets a process group of its own (a fresh TCP store on a free port, torn
down after it), the environment torchrun would give it, and every rank's error if one
fails (a rank that raised reports it and serves the next case). A case that leaves a rank
dead or still running gets the pool restarted, so the next case starts clean, and so does one
that runs past ``CASE_LIMIT_S`` or is interrupted. What a
case changes in its process (torch's thread count, loggers, the random state) stays for the
next one, as the environment does, set as :func:`~pipeswap.runtime.spawn` sets it; the ranks
are daemons and start no processes of their own. Tests of launching itself (signals, a rank
that dies or hangs, fresh processes) use ``spawn``, which starts new ones each time.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import pickle
import time
import traceback
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import torch.multiprocessing as mp

from pipeswap.runtime import RankFailedError
from pipeswap.runtime.distributed.launch import _die_with_parent, _served_store  # as spawn

SIZE = 4  # the most ranks a pooled case runs
CASE_LIMIT_S = 900.0  # a case still running after this is hung: its ranks are killed
_context = mp.get_context("spawn")


def _serve(rank: int, tasks: Any, results: Any, parent: int) -> None:
    """A pooled rank: run each task it is sent in a process group of the task's own."""
    import torch.distributed as dist

    _die_with_parent(parent)  # with the test session, however it ends
    while (task := tasks.get()) is not None:
        job, fn, args, world, port, timeout_s = task
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), TORCHELASTIC_USE_AGENT_STORE="True")
        try:
            dist.init_process_group("gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            try:
                value = fn(rank, world, *args)
            finally:
                dist.destroy_process_group()
            results.put((job, rank, True, pickle.dumps(value)))
        except BaseException:  # noqa: BLE001 - reported to the test, which raises
            results.put((job, rank, False, traceback.format_exc()))
        gc.collect()  # the case's garbage goes now, not inside the next case's measurements


class RankPool:
    """``SIZE`` rank processes, started on first use and kept for the session."""

    def __init__(self) -> None:
        self._processes: list[Any] = []
        self._tasks: list[Any] = []
        self._results: Any = None
        self._job = 0

    def _start(self) -> None:
        self._results = _context.SimpleQueue()
        self._tasks = [_context.SimpleQueue() for _ in range(SIZE)]
        self._processes = [_context.Process(target=_serve, name=f"pipeswap-pooled-rank{rank}",
                                            args=(rank, self._tasks[rank], self._results,
                                                  os.getpid()), daemon=True)
                           for rank in range(SIZE)]
        for process in self._processes:
            process.start()

    def close(self) -> None:
        """Stop every rank: asked first, killed if it does not go."""
        for tasks, process in zip(self._tasks, self._processes):
            if process.is_alive():
                with suppress(OSError, ValueError):
                    tasks.put(None)
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        self._processes = []

    def run(self, fn: Callable[..., Any], world: int, *args: Any,
            timeout_s: float = 60.0) -> list[Any]:
        """``fn(rank, world, *args)`` on ranks ``0..world-1``; their results, as
        :func:`~pipeswap.runtime.spawn` returns them. ``timeout_s`` bounds each collective,
        and how long the others may run on once a rank failed."""
        assert 1 <= world <= SIZE, f"a pooled case runs 1 to {SIZE} ranks, not {world}"
        if not self._processes or not all(p.is_alive() for p in self._processes):
            self.close()
            self._start()
        self._job += 1
        with _served_store(world, timeout_s) as port:  # the store here, as spawn serves it
            for rank in range(world):
                self._tasks[rank].put((self._job, fn, args, world, port, timeout_s))
            try:
                values, failures = self._collect(world, timeout_s)
            except BaseException:  # interrupted: the ranks may be mid-case, so none is reused
                self.close()
                raise
        if failures:
            if not all(process.is_alive() for process in self._processes) or any(
                    "still running" in text for text in failures.values()):
                self.close()  # a rank died or hangs: the next case starts with fresh ranks
            story = "\n".join(f"--- rank {rank} ---\n{text.rstrip()}"
                              for rank, text in sorted(failures.items()))
            raise RankFailedError(f"{len(failures)} of {world} ranks failed:\n{story}",
                                  failures)
        return [values[rank] for rank in range(world)]

    def _collect(self, world: int, timeout_s: float) -> tuple[dict[int, Any], dict[int, str]]:
        """Every rank's result of the current job, or the failures; once one rank failed, the
        others get ``timeout_s`` to report, and none may run past ``CASE_LIMIT_S``."""
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        deadline: float | None = None
        limit = time.monotonic() + CASE_LIMIT_S
        while len(values) + len(failures) < world:
            if not self._results.empty():
                job, rank, ok, value = self._results.get()
                if job != self._job:
                    continue  # a late report of a case that already failed
                if ok:
                    values[rank] = pickle.loads(value)
                else:
                    failures[rank] = value
                continue
            dead = [rank for rank in range(world) if not self._processes[rank].is_alive()]
            for rank in dead:
                if rank not in values and rank not in failures and self._results.empty():
                    failures[rank] = (f"pooled rank {rank} died with exit code "
                                      f"{self._processes[rank].exitcode}")
            if failures and deadline is None:
                deadline = time.monotonic() + timeout_s + 5
            now = time.monotonic()
            if (deadline is not None and now > deadline) or now > limit:
                why = (f"still running {timeout_s:.0f} s after a failure" if failures
                       else f"still running after {CASE_LIMIT_S:.0f} s")
                for rank in sorted(set(range(world)) - set(values) - set(failures)):
                    failures[rank] = f"rank {rank} {why}"
                break
            time.sleep(0.01)
        return values, failures


POOL = RankPool()
atexit.register(POOL.close)
