"""``benchmarks/gpu_check.py --nccl`` where no GPU is: its case list, the no-GPU line, and the
runner of its cases (a case in its own process group; a hung one stopped with the group, a
stray process of one that exited caught). The cases themselves need two or more GPUs: they
are run by hand where those are lent (docs/gpu.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import _nccl  # noqa: E402

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_the_cases_and_their_commands() -> None:
    assert _nccl.NAMES == ("batch-p2p", "pytree", "recover", "fsdp-dp", "torchrun")
    commands = {case.name: case.command(8) for case in _nccl.CASES}
    assert {"--batch-p2p", "--device", "cuda"} <= set(commands["batch-p2p"])
    assert commands["batch-p2p"][commands["batch-p2p"].index("--ranks") + 1] == str(
        _nccl.MAX_RANKS)  # at most MAX_RANKS GPUs however many there are
    assert ["--ranks", "2", "--dp", "2", "--fsdp"] == commands["fsdp-dp"][
        commands["fsdp-dp"].index("--ranks"):commands["fsdp-dp"].index("--fsdp") + 1]
    assert commands["torchrun"][1:3] == ["-m", "torch.distributed.run"]
    assert commands["torchrun"][-2:] == [_nccl.JOB, "torchrun"]
    assert commands["recover"][1:3] == [_nccl.JOB, "recover"]
    assert commands["pytree"][1:3] == [_nccl.JOB, "pytree"]


def test_fsdp_needs_four_gpus_and_says_so_without_starting_anything(tmp_path: Path) -> None:
    (fsdp,) = [case for case in _nccl.CASES if case.name == "fsdp-dp"]
    result = _nccl.run_case(fsdp, 3, 1.0, tmp_path)
    assert result["status"] == "skipped"
    assert result["line"] == "skipped: needs 4 GPUs, this machine has 3"
    listing = "\n".join(_nccl.describe(2))
    assert "skipped on 2 GPUs: needs 4" in listing
    assert "$ python -m torch.distributed.run --standalone --nproc-per-node 2" in listing


def test_first_error_line_and_reading_the_outputs() -> None:
    output = ("pipeswap-train: 1f1b ...\n[rank0]:[W Warning: something]\n"
              "pipeswap-train: error: rank 1 failed at step 2: ValueError: boom\n"
              "pipeswap-train: every rank's traceback is in /tmp/x.log\n")
    assert _nccl.first_error(output) == "pipeswap-train: error: rank 1 failed at step 2: " \
                                        "ValueError: boom"
    assert _nccl.first_error("a\nlast words\n") == "last words"
    summary = {"losses": {"no-swap": [3.0, 2.5], "swap": [3.0, 2.5]}, "max_abs_loss_diff": 0.0,
               "losses_match": True, "per_rank": [{"swapped_chunks": 2}, {"swapped_chunks": 0}]}
    assert _nccl.read_train("noise\n" + json.dumps(summary)) == (
        "2 ranks, losses bit-identical with and without swap (2 chunks swapped)")
    summary |= {"losses": {"no-swap": [3.0], "swap": [2.0]}, "max_abs_loss_diff": 1.0,
                "losses_match": False}
    with pytest.raises(_nccl.CaseFailed, match="differ from those without by 1.00e"):
        _nccl.read_train(json.dumps(summary))
    assert _nccl.read_job("x\nnccl_job: ok: rank 0: short\nnccl_job: ok: rank 1: longer one\n"
                          ) == "rank 1: longer one"
    with pytest.raises(_nccl.CaseFailed):
        _nccl.read_job("nccl_job: FAILED: rank 1: boom\n")


def test_list_prints_every_case_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    import gpu_check

    assert gpu_check.main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in _nccl.NAMES:
        assert f"\n{name}: " in out
    assert "--batch-p2p" in out and "benchmarks/nccl_job.py torchrun" in out


@no_cuda
def test_nccl_without_cuda_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    import gpu_check

    for argv in (["--nccl"], ["--only", "nccl", "--device", "cpu"], ["--case", "recover"]):
        assert gpu_check.main(argv) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == ""
        lines = captured.err.splitlines()
        assert len(lines) == 1, lines
        assert lines[0].startswith("gpu_check.py: error: --nccl runs its cases over NCCL")
        assert "this machine has no CUDA GPU" in lines[0]


def _case(name: str, code: str) -> _nccl.Case:
    return _nccl.Case(name, "a test", 2, lambda gpus: [sys.executable, "-c", code],
                      lambda output: "fine")


def _alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (not zombies)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            alive.append(pid)
    return alive


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_hung_case_is_stopped_with_its_group_and_a_stray_is_caught(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_nccl, "STRAY_WAIT_S", 0.3)
    # each leaves a child: sleeping on (hung), or running after the case exited (stray)
    child = "import subprocess; p = subprocess.Popen(['sleep', '30']); print(p.pid, flush=True)"
    hung = _nccl.run_case(_case("hung", child + "; print('RuntimeError: stuck', flush=True); "
                                "import time; time.sleep(30)"), 2, 2.0, tmp_path)
    assert hung["status"] == "timed out"
    assert hung["line"] == ("TIMED OUT after 2 s, stopped with its process group (first "
                            "error: RuntimeError: stuck)")
    stray = _nccl.run_case(_case("stray", child), 2, 10.0, tmp_path)
    assert stray["status"] == "failed"
    assert stray["line"] == ("FAILED: it exited 0 but left 1 process(es) of its group running "
                             "(killed)")
    failed = _nccl.run_case(_case("failed", "print('x'); raise ValueError('bad input')"), 2,
                            10.0, tmp_path)
    assert failed["line"] == "FAILED (exit 1): ValueError: bad input"
    ok = _nccl.run_case(_case("ok", "print('fine')"), 2, 10.0, tmp_path)
    assert ok["status"] == "ok" and ok["line"].endswith(": fine")
    children = [int((tmp_path / f"{name}.log").read_text().split()[0])
                for name in ("hung", "stray")]
    assert _alive(children) == []
