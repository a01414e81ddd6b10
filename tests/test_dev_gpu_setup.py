"""`python3 dev.py gpu-setup`, the set-up on a GPU machine, refuses what it cannot do with one
line (the install itself is checked by hand where a GPU is lent: see BENCHMARKS.md)."""

from __future__ import annotations

import pytest

import subprocess
import sys
from pathlib import Path

pytestmark = pytest.mark.multiprocess  # full tier only, unless also marked everyday

DEV = Path(__file__).resolve().parent.parent / "dev.py"


def test_installed_torch_and_an_index_exclude_each_other() -> None:
    done = subprocess.run([sys.executable, str(DEV), "gpu-setup", "--use-installed-torch",
                           "--torch-index", "https://example.invalid/simple"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--use-installed-torch keeps the torch installed" in done.stderr


def test_installed_torch_needs_a_python_that_has_one(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")],
                   check=True, timeout=120)
    done = subprocess.run([str(tmp_path / "bare" / "bin" / "python"), str(DEV), "gpu-setup",
                           "--use-installed-torch"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "has no torch to use" in done.stderr and ".venv-gpu" in done.stderr
