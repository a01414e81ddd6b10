"""The example a user copies runs as its docstring says: under torchrun, on CPU."""

from __future__ import annotations

import pytest

import re
import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.multiprocess  # full tier only, unless also marked everyday

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_pipeline.py"


def test_the_pipeline_example_trains_with_swap_under_torchrun() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", str(EXAMPLE),
         "--steps", "4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)", done.stdout, re.M)]
    assert len(losses) == 4 and losses[-1] < losses[0] / 2, done.stdout
    swapped = re.findall(r"^rank (\d): (\d+) chunks swapped", done.stdout, re.M)
    assert sorted(rank for rank, _ in swapped) == ["0", "1"], done.stdout
    assert all(int(count) > 0 for _, count in swapped), done.stdout


HF_EXAMPLE = EXAMPLE.with_name("hf_llama.py")


def test_the_hugging_face_example_trains_with_swap_through_pytorchs_schedule_api() -> None:
    pytest.importorskip("transformers")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         str(HF_EXAMPLE), "--steps", "6", "--schedule", "ScheduleZBVZeroBubble"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)", done.stdout, re.M)]
    assert len(losses) == 6 and losses[-1] < losses[0], done.stdout
    swapped = dict(re.findall(r"^rank (\d): (\d+) chunks swapped", done.stdout, re.M))
    assert sorted(swapped) == ["0", "1"] and int(swapped["0"]) > 0, done.stdout
    said = re.findall(r"^rank \d: swap leaves these saved tensors on the device each step",
                      done.stderr + done.stdout, re.M)
    assert 1 <= len(said) <= 2, done.stderr[-4000:]  # once a run, per rank that swaps
