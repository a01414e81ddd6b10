"""Stopping pipeswap-train as schedulers and people do: SIGTERM (timeout, Slurm, Docker),
Ctrl-C (SIGINT to the launcher alone) and SIGKILL. No rank may outlive the launcher."""

from __future__ import annotations

import os
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
