"""A checkpoint directory belongs to one run at a time (pipeswap.runtime.checkpoint.ownership):
a live run's claim refuses another, naming it; a dead or silent one's is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeswap.runtime import CheckpointError
from pipeswap.runtime.checkpoint.ownership import OWNER, claimed


def test_a_claimed_directory_is_refused_while_its_run_lives(tmp_path: Path) -> None:
    with claimed(tmp_path / "ckpt", "--checkpoint-dir x") as claim:
        assert claim.is_file() and json.loads(claim.read_text())["pid"] == os.getpid()
        with pytest.raises(CheckpointError, match=r"^--checkpoint-dir x is in use by another "
                                                  rf"run \(pid {os.getpid()} on "):
            with claimed(tmp_path / "ckpt", "--checkpoint-dir x"):
                pass
        assert claim.is_file()  # the refused claim took nothing from the live one
    assert not (tmp_path / "ckpt" / OWNER).exists()  # released with the block


def test_the_claim_of_a_run_that_is_gone_is_taken_over(tmp_path: Path) -> None:
    """A run killed outright leaves its claim: its process is gone (or its pid reused by
    another process, started at another time), so the next run takes the directory."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    claim = tmp_path / OWNER
    for pid, started in ((int(gone.stdout), "1"), (os.getpid(), "not this process's")):
        claim.write_text(json.dumps({"host": socket.gethostname(), "pid": pid,
                                     "started": started, "run": "old", "since": "then"}))
        with claimed(tmp_path, "--checkpoint-dir x") as mine:
            assert json.loads(mine.read_text())["pid"] == os.getpid()
    assert not list(tmp_path.glob(f"{OWNER}*"))


def test_a_run_on_another_host_holds_its_claim_until_it_goes_silent(tmp_path: Path) -> None:
    """Another host's run cannot be looked up: its claim stands while it is touched, and
    a minute untouched it is taken over."""
    claim = tmp_path / OWNER
    claim.write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": "1", "run": "old",
                                 "since": "then"}))
    with pytest.raises(CheckpointError, match=r"in use by another run \(pid 1 on elsewhere"):
        with claimed(tmp_path, "--checkpoint-dir x"):
            pass
    past = time.time() - 120
    os.utime(claim, (past, past))
    with claimed(tmp_path, "--checkpoint-dir x") as mine:
        assert json.loads(mine.read_text())["host"] == socket.gethostname()


def test_pipeswap_train_refuses_a_directory_another_run_saves_into(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A second pipeswap-train given the --checkpoint-dir of a live run stops before any
    rank starts, in one line naming that run (exit 2: the input's fault)."""
    from pipeswap.runtime.train.cli import main

    with claimed(tmp_path, "--checkpoint-dir x"):
        code = main(["--ranks", "2", "--microbatches", "2", "--batch-size", "2", "--steps",
                     "1", "--seq-len", "8", "--width", "16", "--checkpoint-dir", str(tmp_path)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"pipeswap-train: error: --checkpoint-dir {tmp_path} is in use "
                               f"by another run (pid {os.getpid()} on ")
