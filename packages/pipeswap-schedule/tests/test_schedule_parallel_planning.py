"""The ranks' plans under a budget made in worker processes: the same plans as in one, an
error raised in the caller, and no worker left behind however the caller ends."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from pipeswap.schedule import (
    ScheduleError,
    ScheduleKind,
    ScheduleSpec,
    build_planned,
    build_schedule,
)
from pipeswap.schedule.costs import Link, TransformerShape, from_preset
from pipeswap.schedule.policies import PeakPolicy
from pipeswap.schedule.policies._parallel import plan_ranks
from pipeswap.schedule.simulate import simulate

GEN4 = replace(from_preset("h100-pcie5", TransformerShape(hidden=4096, seq_len=4096, layers=4)),
               link=Link(25e9, 25e9))
SPEC = ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=4, microbatches=8, swap=True)
Cli = Callable[..., tuple[int, str, str]]  # the `cli` fixture of conftest.py


def test_plans_made_in_worker_processes_are_those_made_in_one() -> None:
    plain = simulate(build_schedule(replace(SPEC, swap=False)), GEN4)
    budget = int(max(r.peak_activation_bytes for r in plain.ranks) * 0.3)
    told: list[tuple[int, int, int]] = []
    made = {jobs: PeakPolicy(GEN4, budget, recompute="auto", jobs=jobs,
                             progress=lambda *said: told.append(said)) for jobs in (1, 2)}
    built = {jobs: build_planned(SPEC, policy) for jobs, policy in made.items()}
    assert built[1][0].orders == built[2][0].orders
    plans = {jobs: plan for jobs, (_, plan) in built.items()}
    assert plans[1] == plans[2] is not None  # the same plan: outcomes and choices included
    assert any(plan.recomputed for plan in plans[2].ranks.values())  # a plan worth comparing
    # each rank reported once per policy, counted up to every rank
    assert sorted(said[1] for said in told) == [1, 1, 2, 2, 3, 3, 4, 4]
    assert multiprocessing.active_children() == []


def test_no_processes_is_refused() -> None:
    with pytest.raises(ScheduleError, match="jobs must be 1 or more processes, not 0"):
        PeakPolicy(GEN4, 1, jobs=0)


def test_a_workers_error_is_raised_in_the_caller_and_no_worker_outlives_it() -> None:
    schedule = build_schedule(replace(SPEC, swap=False))
    gaps = PeakPolicy(GEN4, {0: 10**9, 2: 10**9, 3: 10**9}, recompute="auto")  # no rank 1
    with pytest.raises(ScheduleError, match="the memory budget gives no figure for rank 1"):
        plan_ranks(gaps, schedule, [0, 1, 2, 3], 2, lambda rank, done: None)
    assert multiprocessing.active_children() == []


_KILLED_CALLER = textwrap.dedent("""
    import os, sys, threading
    from dataclasses import dataclass
    from pipeswap.schedule import ScheduleKind, ScheduleSpec, build_schedule
    from pipeswap.schedule.policies._parallel import plan_ranks

    @dataclass
    class Blocking:  # tells its pid, then plans forever
        pids: str
        def options_for(self, schedule, rank):
            with open(os.path.join(self.pids, str(os.getpid())), "w"):
                pass
            threading.Event().wait()

    if __name__ == "__main__":
        schedule = build_schedule(ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=2,
                                               microbatches=2))
        plan_ranks(Blocking(sys.argv[1]), schedule, [0, 1], 2, lambda rank, done: None)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its new parent) counts as gone
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_leave_when_their_caller_is_killed(tmp_path: Path) -> None:
    """kill -9 runs no clean-up in the caller: the workers see their pipe to it close."""
    script = tmp_path / "caller.py"
    script.write_text(_KILLED_CALLER)
    pids = tmp_path / "pids"
    pids.mkdir()
    caller = subprocess.Popen([sys.executable, str(script), str(pids)])
    try:
        deadline = time.monotonic() + 60
        while len(list(pids.iterdir())) < 2:  # both workers planning
            assert caller.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        workers = [int(p.name) for p in pids.iterdir()]
        assert all(_alive(pid) for pid in workers)
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived their caller"
        time.sleep(0.05)


SMALL_ARGS = ["--schedule", "1f1b", "--ranks", "4", "--microbatches", "8", "--preset",
              "h100-pcie5", "--hidden", "4096", "--seq-len", "4096", "--layers-per-stage", "4",
              "--d2h-bandwidth", "25e9", "--h2d-bandwidth", "25e9"]


def test_the_command_line_plans_alike_with_any_number_of_jobs(cli: Cli) -> None:
    said = {jobs: cli("simulate", *SMALL_ARGS, "--budget", "4GiB", "--jobs", jobs)
            for jobs in ("1", "3")}
    assert said["1"][0] == 0 and said["1"] == said["3"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--jobs", "2"], "--jobs 2 makes the peak policy's plans under --budget"),
    (["--jobs", "2", "--budget", "4GiB", "--recompute", "never"],
     "--jobs 2 makes the peak policy's plans under --budget, where it may recompute"),
    (["--jobs", "2", "--budget", "4GiB", "--policy", "budget"],
     "--jobs 2 makes the peak policy's plans under --budget"),
    (["--jobs", "0", "--budget", "4GiB"], "0 is out of range: give 1 to 256"),
])
def test_jobs_that_cannot_apply_are_refused(cli: Cli, extra: list[str], message: str) -> None:
    code, out, err = cli("simulate", *SMALL_ARGS, *extra)
    assert code == 2 and out == "" and message in err and err.count("\n") == 1


_CALLER_OF_STUCK_WORKERS = _KILLED_CALLER.replace(
    "    plan_ranks(Blocking(sys.argv[1]), schedule, [0, 1], 2, lambda rank, done: None)",
    "    from pipeswap.schedule.policies._parallel import PlanningWorkerError\n"
    "    try:\n"
    "        plan_ranks(Blocking(sys.argv[1]), schedule, [0, 1], 2, lambda r, d: None)\n"
    "    except PlanningWorkerError as exc:\n"
    "        print(exc)")
assert _CALLER_OF_STUCK_WORKERS != _KILLED_CALLER


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_worker_that_dies_or_stays_stopped_ends_the_planning_in_one_line(
        tmp_path: Path, signum: int) -> None:
    """A worker killed (the pool breaks) or stopped (seen in /proc) fails the planning
    with one line naming what happened, within a few seconds; no worker outlives it."""
    from pipeswap.schedule.policies._parallel import STOPPED_S

    script = tmp_path / "caller.py"
    script.write_text(_CALLER_OF_STUCK_WORKERS)
    pids = tmp_path / "pids"
    pids.mkdir()
    caller = subprocess.Popen([sys.executable, str(script), str(pids)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(pids.iterdir())) < 2:
            assert caller.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        workers = [int(p.name) for p in pids.iterdir()]
        started = time.monotonic()
        os.kill(workers[0], signum)
        out, err = caller.communicate(timeout=STOPPED_S + 30)
        took = time.monotonic() - started
    finally:
        if caller.poll() is None:
            caller.kill()
            caller.wait()
    lines = out.strip().splitlines()
    assert caller.returncode == 0 and len(lines) == 1 and "Traceback" not in err, (out, err)
    if signum == signal.SIGKILL:
        assert lines[0].startswith("a planning worker died (killed, or out of memory) with 0 "
                                   "of 2 ranks planned"), lines
        assert took < 10
    else:
        assert lines[0].startswith(f"planning worker {workers[0]} has been stopped (SIGSTOP, "
                                   f"or a debugger) for {STOPPED_S:g} s"), lines
        assert STOPPED_S <= took < STOPPED_S + 10
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived their caller"
        time.sleep(0.05)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_while_workers_plan_is_one_line(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) while workers
    plan: one line, exit 130, and no worker left."""
    args = ["--schedule", "1f1b", "--ranks", "32", "--microbatches", "64", "--preset",
            "h100-pcie5", "--hidden", "4096", "--seq-len", "4096", "--layers-per-stage", "4",
            "--budget", "20GiB", "--jobs", "2", "--pipeline-choice", "turns"]
    command = subprocess.Popen([sys.executable, "-m", "pipeswap.schedule.cli", "simulate", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while len(workers) < 2:  # both workers started
            assert command.poll() is None and time.monotonic() < deadline
            workers = [int(entry.name) for entry in Path("/proc").iterdir()
                       if entry.name.isdigit() and _parent(int(entry.name)) == command.pid]
            time.sleep(0.1)
        time.sleep(1.0)  # planning
        os.killpg(command.pid, signal.SIGINT)
        out, err = command.communicate(timeout=30)
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
    assert command.returncode == 130, (out, err)
    assert err.strip().splitlines() == ["pipeswap-schedule: interrupted"], err
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in workers):
        assert time.monotonic() < deadline, f"workers {workers} outlived their caller"
        time.sleep(0.05)


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
