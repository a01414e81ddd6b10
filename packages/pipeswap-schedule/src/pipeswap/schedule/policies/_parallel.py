"""Making the ranks' plans under a budget in worker processes.

Each rank's plans depend on its own order and the cost model alone (the pipeline chooses
among them afterwards), so the command that plans every rank of a large pipeline can make
them on several cores and get the same plans. Workers are spawned, not forked: the caller
may hold threads (a test runner, a training script), and a forked copy of a lock one of
them holds would hang the worker. A worker leaves as soon as its parent does, however the
parent ends (an error, Ctrl-C, a kill): it watches a pipe only the parent writes to. It
ignores Ctrl-C itself (the terminal sends it to the whole process group): the parent
decides, and says so once. A worker that dies, or stays stopped (SIGSTOP, seen in /proc)
for :data:`STOPPED_S`, fails the planning in one :class:`PlanningWorkerError` line.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Protocol, TypeVar, cast

from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.schedule import Schedule

#: How long a worker may stay stopped before the planning gives up on it.
STOPPED_S = 5.0


class PlanningWorkerError(ScheduleError):
    """A planning worker died or stayed stopped: the plans cannot be made."""


_Options = TypeVar("_Options", covariant=True)
_Made = TypeVar("_Made")


class Planner(Protocol[_Options]):
    """What the workers run: a policy without callbacks (it is pickled to each)."""

    def options_for(self, schedule: Schedule, rank: int) -> _Options: ...


#: The worker process's planner and schedule, set once by _start (a spawned worker serves
#: one call of plan_ranks only).
_work: tuple[Planner[object], Schedule] | None = None


def _start(planner: Planner[object], schedule: Schedule, parent: Connection) -> None:
    global _work
    _work = (planner, schedule)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    threading.Thread(target=_leave_with, args=(parent,), daemon=True).start()


def _leave_with(parent: Connection) -> None:
    """Return never while the parent lives; end the worker once it is gone (the pipe's
    only writer closed)."""
    try:
        parent.recv()
    except EOFError:
        pass
    os._exit(1)


def _plan(rank: int) -> tuple[int, object]:
    assert _work is not None  # _start ran first: it is the pool's initializer
    planner, schedule = _work
    return rank, planner.options_for(schedule, rank)


def plan_ranks(planner: Planner[_Made], schedule: Schedule, ranks: Sequence[int], jobs: int,
               done: Callable[[int, int], None]) -> dict[int, _Made]:
    """``planner.options_for(schedule, rank)`` for each of ``ranks``, in ``jobs`` worker
    processes; ``done`` is told (rank, ranks done so far) as each finishes. A worker's
    error is raised here (a worker that dies as BrokenProcessPool); however this ends, the
    workers end with it."""
    context = multiprocessing.get_context("spawn")
    watched, held = context.Pipe(duplex=False)  # nothing is sent: closing it stops them
    out: dict[int, _Made] = {}
    pool = ProcessPoolExecutor(min(jobs, len(ranks)), context, _start,
                               (planner, schedule, watched))
    finished = False
    try:
        pending: set[Future[tuple[int, object]]] = {pool.submit(_plan, rank) for rank in ranks}
        stopped: dict[int, float] = {}  # worker pid: since when it is seen stopped
        while pending:
            ready, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
            for future in ready:
                rank, options = _result(future, len(out), len(ranks))
                out[rank] = cast(_Made, options)  # what planner.options_for returns, pickled
                done(rank, len(out))
            _check_running(pool, stopped, len(out), len(ranks))
        finished = True
    finally:
        held.close()  # the workers leave now, planning or not
        if not finished:
            _resume_stopped(pool)  # a stopped worker cannot leave until it runs again
        pool.shutdown(wait=True, cancel_futures=True)  # and are gone when it returns
        watched.close()
    return out


def _result(future: Future[tuple[int, object]], made: int, ranks: int) -> tuple[int, object]:
    try:
        return future.result()
    except BrokenProcessPool:
        raise _died(made, ranks) from None


def _died(made: int, ranks: int) -> PlanningWorkerError:
    return PlanningWorkerError(
        f"a planning worker died (killed, or out of memory) with {made} of {ranks} ranks "
        "planned: plan again, with fewer --jobs if memory is short")


def _workers(pool: ProcessPoolExecutor) -> list[multiprocessing.process.BaseProcess]:
    return list((getattr(pool, "_processes", None) or {}).values())


def _check_running(pool: ProcessPoolExecutor, stopped: dict[int, float], made: int,
                   ranks: int) -> None:
    """Fail once a worker has died (the pool itself may miss a worker started while it
    waited) or stayed stopped for :data:`STOPPED_S` (where /proc says)."""
    now = time.monotonic()
    for worker in _workers(pool):
        if worker.exitcode is not None:
            raise _died(made, ranks)
        pid = cast(int, worker.pid)
        if _state(pid) != "T":
            stopped.pop(pid, None)
            continue
        since = stopped.setdefault(pid, now)
        if now - since > STOPPED_S:
            raise PlanningWorkerError(
                f"planning worker {pid} has been stopped (SIGSTOP, or a debugger) for "
                f"{STOPPED_S:g} s: let it go on (kill -CONT {pid}) and plan again, or plan "
                "with --jobs 1")


def _resume_stopped(pool: ProcessPoolExecutor) -> None:
    for worker in _workers(pool):
        if worker.pid is not None and _state(worker.pid) == "T":
            try:
                os.kill(worker.pid, signal.SIGCONT)
            except OSError:
                pass


def _state(pid: int) -> str | None:
    """A process's state letter as /proc gives it (None where there is no /proc)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
