"""`python3 dev.py gpu-setup`, the set-up on a GPU machine, refuses what it cannot do with one
line, and after the install stops with one line saying why torch sees no GPU and what to do
(the install itself is checked by hand where a GPU is lent: see BENCHMARKS.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pipeswap_dev_module import DEV, dev_module


@pytest.mark.multiprocess
def test_installed_torch_and_an_index_exclude_each_other() -> None:
    done = subprocess.run([sys.executable, str(DEV), "gpu-setup", "--use-installed-torch",
                           "--torch-index", "https://example.invalid/simple"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--use-installed-torch keeps the torch installed" in done.stderr


@pytest.mark.multiprocess
def test_installed_torch_needs_a_python_that_has_one(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")],
                   check=True, timeout=120)
    done = subprocess.run([str(tmp_path / "bare" / "bin" / "python"), str(DEV), "gpu-setup",
                           "--use-installed-torch"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "has no torch to use" in done.stderr and ".venv-gpu" in done.stderr


WHAT = "torch 2.13.0 in .venv-gpu"
SEEN = {"torch": "2.13.0", "cuda": "12.8", "available": True, "count": 2, "device": "NVIDIA H200",
        "problem": ""}
UNSEEN = SEEN | {"available": False, "count": 0, "device": ""}
DRIVER = {"found": True, "error": "", "gpus": 2, "driver": "570.86", "cuda": "12.8"}


def _problem(cuda: dict[str, object], driver: dict[str, object], visible: str | None = None
             ) -> str | None:
    dev = dev_module()
    problem: str | None = dev.cuda_problem(dev.CudaFacts(**cuda), dev.DriverFacts(**driver),
                                           visible, WHAT)
    assert problem is None or "\n" not in problem
    return problem


def test_a_visible_gpu_that_runs_a_kernel_passes() -> None:
    assert _problem(SEEN, DRIVER) is None
    assert _problem(SEEN, DRIVER | {"found": False}) is None  # torch's word decides


def test_each_reason_for_no_gpu_is_one_line_with_what_to_do() -> None:
    cases: list[tuple[dict[str, object], dict[str, object], str | None, list[str]]] = [
        (UNSEEN | {"cuda": None}, DRIVER, None,
         ["is a CPU-only build", "--torch-index https://download.pytorch.org/whl/cu128"]),
        (UNSEEN, DRIVER, "", ["CUDA_VISIBLE_DEVICES='' hides them all", "unset it"]),
        (UNSEEN, DRIVER, "-1", ["CUDA_VISIBLE_DEVICES='-1' hides them all"]),
        (UNSEEN, DRIVER | {"found": False}, None,
         ["nvidia-smi is not on PATH", "install it", "docker run --gpus all"]),
        (UNSEEN, DRIVER | {"error": "NVIDIA-SMI has failed because it couldn't communicate"},
         None, ["nvidia-smi fails (NVIDIA-SMI has failed", "fix the NVIDIA driver"]),
        (UNSEEN, DRIVER | {"gpus": 0}, None, ["nvidia-smi lists none"]),
        (UNSEEN | {"problem": "CUDA initialization: The NVIDIA driver on your system is too "
                              "old (found version 12020)"},
         DRIVER | {"driver": "535.54", "cuda": "12.2"}, None,
         ["built for CUDA 12.8, but the NVIDIA driver 535.54 supports CUDA up to 12.2",
          "update the driver", "torch says: CUDA initialization"]),
        (UNSEEN, DRIVER, "7", ["CUDA_VISIBLE_DEVICES='7' matches none", "0 to 1"]),
        (UNSEEN, DRIVER, None, ["sees none of the 2 GPU(s) nvidia-smi lists", "/dev/nvidia"]),
        (SEEN | {"problem": "RuntimeError: CUDA error: no kernel image is available"}, DRIVER,
         None, ["sees NVIDIA H200 but cannot run on it", "no kernel image",
                "a torch build for this GPU"]),
    ]
    for cuda, driver, visible, words in cases:
        problem = _problem(cuda, driver, visible)
        assert problem is not None and problem.startswith(WHAT), (cuda, driver, visible)
        for word in words:
            assert word in problem, (word, problem)


@pytest.mark.multiprocess
def test_the_probe_reads_this_pythons_torch() -> None:
    import torch

    dev = dev_module()
    facts = dev.cuda_facts(Path(sys.executable))
    assert facts.torch == torch.__version__ and facts.cuda == torch.version.cuda
    assert facts.available == torch.cuda.is_available()
    if torch.version.cuda is None:
        problem = dev.cuda_problem(facts, dev.driver_facts(), None, "this torch")
        assert problem is not None and "CPU-only build" in problem
