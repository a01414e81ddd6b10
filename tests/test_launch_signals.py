"""Stopping pipeswap-train as schedulers and people do: SIGTERM (timeout, Slurm, Docker),
Ctrl-C (SIGINT to the launcher alone) and SIGKILL. No rank may outlive the launcher."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess  # full tier only, unless also marked everyday

COMMAND = [sys.executable, "-m", "pipeswap.runtime.train", "--ranks", "2", "--microbatches",
           "2", "--batch-size", "2", "--steps", "100000", "--seq-len", "8", "--width", "16"]


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.add(pid)
    return alive


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=["SIGTERM", "SIGINT", "SIGKILL"])
def test_stopping_the_launcher_stops_every_rank(signum: int) -> None:
    launcher = subprocess.Popen(COMMAND, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:  # training has started on every rank
            if "step 1/" in line:
                break
        ranks = {pid for pid in _children(launcher.pid)
                 if "spawn" in (Path("/proc") / str(pid) / "cmdline").read_text()}
        assert len(ranks) == 2
        started = time.monotonic()
        os.kill(launcher.pid, signum)
        code = launcher.wait(timeout=30)
        while _alive(ranks) and time.monotonic() - started < 15:
            time.sleep(0.1)  # the kernel delivers the ranks' SIGKILL asynchronously
        assert _alive(ranks) == set()
        stderr = launcher.stderr.read() if launcher.stderr else ""
        assert "Traceback" not in stderr
        if signum == signal.SIGTERM:
            assert code == 128 + signal.SIGTERM and "terminated" in stderr
        elif signum == signal.SIGINT:
            assert code == 130 and "interrupted" in stderr
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


THREE = [*COMMAND[:3], "--ranks", "3", "--microbatches", "3", "--batch-size", "3",
         *COMMAND[9:]]
FAULTS = {
    # a rank killed outright: its peers' transfers break at once (rank 0 too: the launcher,
    # not rank 0, serves the rendezvous store the ranks and their failure board use)
    "killed": (1, signal.SIGKILL, COMMAND, 20.0,
               r"rank 1 died \(SIGKILL\) at step \d+; the other ranks stopped"),
    "rank 0 killed": (0, signal.SIGKILL, THREE, 20.0,
                      r"rank 0 died \(SIGKILL\) at step \d+; the other ranks stopped"),
    # a rank stopped (hung) in a pipeline of FSDP replicas: the device mesh's groups too
    # must give up at --timeout
    "hung": (1, signal.SIGSTOP, [*COMMAND, "--dp", "2", "--fsdp", "--batch-size", "4",
                                 "--timeout", "10"], 10.0 + 10.0,
             r"rank 1 hung at step \d+: the other ranks waited their timeout \(10 s\) for it"),
    "rank 0 hung": (0, signal.SIGSTOP, [*THREE, "--timeout", "10"], 10.0 + 10.0,
                    r"rank 0 hung at step \d+: the other ranks waited their timeout \(10 s\)"),
    "middle rank hung": (1, signal.SIGSTOP, [*THREE, "--timeout", "10"], 10.0 + 10.0,
                         r"rank 1 hung at step \d+: the other ranks waited their timeout"),
}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_rank_that_dies_or_hangs_ends_the_job_with_one_line(fault: str) -> None:
    which, signum, command, bound_s, headline = FAULTS[fault]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            if "step 2/" in line:
                break
        ranks = sorted(pid for pid in _children(launcher.pid)
                       if "spawn" in (Path("/proc") / str(pid) / "cmdline").read_text())
        started = time.monotonic()
        os.kill(ranks[which], signum)  # ranks start in order: the second is rank 1
        code = launcher.wait(timeout=bound_s + 60)
        took = time.monotonic() - started
        stderr = launcher.stderr.read() if launcher.stderr else ""
        assert code == 1 and took < bound_s, (code, took, stderr)
        assert _alive(set(ranks)) == set()
        lines = stderr.strip().splitlines()
        assert len(lines) <= 3 and "Traceback" not in stderr, stderr
        assert re.fullmatch(f"pipeswap-train: error: {headline}.*", lines[0]), stderr
        log = re.search(r"every rank's traceback is in (\S+)", stderr)
        assert log is not None and Path(log.group(1)).is_file()
        Path(log.group(1)).unlink()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def _rank_of(pid: int) -> int:
    environ = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return int(next(item for item in environ if item.startswith(b"RANK="))[5:])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_under_torchrun_a_stopped_rank_ends_the_job_within_the_timeout() -> None:
    """torchrun's agent ends a failed job's workers with SIGTERM, which a stopped worker
    takes only once resumed, and kills it 30 s later; its peer, which found it stopped on
    this host, ends it instead, so the job ends within --timeout plus a few seconds, the
    error naming the stopped rank."""
    timeout_s = 5.0
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         *COMMAND[1:], "--timeout", str(timeout_s)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            if "step 2/" in line:
                break
        workers = {_rank_of(pid): pid for pid in _children(launcher.pid)
                   if b"pipeswap.runtime.train" in (Path("/proc") / str(pid) / "cmdline"
                                                    ).read_bytes()}
        assert sorted(workers) == [0, 1]
        started = time.monotonic()
        os.kill(workers[1], signal.SIGSTOP)
        code = launcher.wait(timeout=120)
        took = time.monotonic() - started
        stderr = launcher.stderr.read() if launcher.stderr else ""
        assert code != 0 and took < timeout_s + 10, (code, took, stderr[-3000:])
        assert _alive(set(workers.values())) == set()
        assert re.search(r"rank 1 stopped answering: no sign of life for 5 s \(its process "
                         rf"{workers[1]} on this host is stopped", stderr), stderr[-3000:]
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
