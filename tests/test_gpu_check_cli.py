"""``benchmarks/gpu_check.py`` where no GPU is: the NCCL case list, the no-GPU line, and the
runner of its cases and probes (each a command in its own process group; a hung one stopped
with the group, a stray process of one that exited caught; a probe read from its last JSON
line); the budget that skips what does not fit; the one-GPU parts on the CPU platform
(facts and link run, the probes say they need CUDA). The cases and probes themselves need
GPUs: they are run where those are lent (docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
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


def test_a_probe_is_read_from_its_last_json_line_or_failed_with_its_first_error() -> None:
    output = ('_probes: step: init_process_group("nccl")\n{"status": "ok", "line": "early"}\n'
              'NCCL WARN something\n{"status": "ok", "line": "ok: fine", "init_s": 1.5}\n')
    assert _nccl.read_result(output) == {"status": "ok", "line": "ok: fine", "init_s": 1.5}
    assert _nccl.last_step(output) == 'init_process_group("nccl")'
    crashed = ("_probes: step: a fresh group\nTraceback (most recent call last):\n"
               '  File "x.py", line 1\ntorch.distributed.DistBackendError: NCCL error: boom\n'
               '{"not": "a result"}\n')
    assert _nccl.read_result(crashed) == {
        "status": "FAILED", "line": "FAILED: torch.distributed.DistBackendError: NCCL error: boom"}
    assert _nccl.read_result("")["line"] == "FAILED: no output"
    assert _nccl.read_torchrun("nccl_job: ok: rank 0: torchrun, 1 ranks\n")["status"] == "ok"
    assert _nccl.read_torchrun("nccl_job: FAILED: rank 0: boom\n") == {
        "status": "FAILED", "line": "FAILED: nccl_job: FAILED: rank 0: boom"}


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_hung_probe_is_stopped_at_its_timeout_with_its_whole_group(tmp_path: Path) -> None:
    # the probe leaves a child sleeping, says its step, then hangs itself
    code = ("import os, subprocess, time; p = subprocess.Popen(['sleep', '30']); "
            "print(os.getpid(), p.pid, flush=True); print('_probes: step: waiting', flush=True)"
            "; time.sleep(30)")
    for hang_means in ("", "a hang is the finding"):
        probe = _nccl.Probe("hang", "a test", (sys.executable, "-c", code),
                            hang_means=hang_means)
        result = _nccl.run_probe(probe, 1.0, tmp_path)
        assert result["status"] == "TIMED OUT"
        assert result["line"] == "TIMED OUT after 1 s, stopped with its process group, at: " \
                                 "waiting" + (" (a hang is the finding)" if hang_means else "")
        assert result["passed"] == bool(hang_means)  # a finding's hang is no failure
        group, child = (int(pid) for pid in Path(result["log"]).read_text().split()[:2])
        assert _nccl.group_members(group) == []
        assert _alive([group, child]) == []


@pytest.mark.multiprocess
@no_cuda
def test_a_probe_run_here_says_it_needs_cuda(tmp_path: Path) -> None:
    import _probes

    (probe,) = [probe for probe in _probes.PROBES if probe.name == "eager-init"]
    result = _nccl.run_probe(probe, 60.0, tmp_path)
    assert {key: result[key] for key in ("name", "status", "line", "exit", "passed")} == {
        "name": "eager-init", "status": "skipped", "line": "skipped: needs CUDA", "exit": 0,
        "passed": True}


def test_what_does_not_fit_the_budget_is_skipped_with_a_line() -> None:
    import gpu_check

    now = [0.0]
    budget = gpu_check.Budget(100.0, lambda part, timeout_s: None, clock=lambda: now[0])
    assert budget.timeout("tests", 60.0, 300.0) == 100.0  # its own limit, cut to what is left
    now[0] = 90.0
    assert budget.timeout("link", 10.0, 60.0) == 10.0
    line = "skipped: 10 s of the 100 s budget left, it needs 30"
    assert budget.timeout("replay, streaming", 30.0, 150.0) == line
    ran: list[str] = []
    assert budget.run("copies", lambda: ran.append("copies")) is None and ran == []
    fit = budget.fit("probe")  # a probe needs 20 s: none starts
    probes = _nccl.run_probes([_nccl.Probe("never", "a test", ("false",))], True, fit)
    assert probes["ok"] and probes["probes"] == [{
        "name": "never", "status": "skipped", "seconds": 0.0, "passed": True,
        "line": "skipped: 10 s of the 100 s budget left, it needs 20"}]
    assert budget.skipped == {"replay, streaming": line,
                              "copies": "skipped: 10 s of the 100 s budget left, it needs 20",
                              "probe never": probes["probes"][0]["line"]}


def test_a_part_outliving_its_timeout_is_reported_from_another_thread() -> None:
    import gpu_check

    called = threading.Event()
    seen: list[tuple[str, float]] = []

    def overrun(part: str, timeout_s: float) -> None:
        seen.append((part, timeout_s))
        called.set()

    budget = gpu_check.Budget(100.0, overrun)
    with budget.guard("link", 0.01):
        assert called.wait(10.0)  # the part "hangs" until the guard reports it
    assert seen == [("link", 0.01)]


@pytest.mark.multiprocess
@no_cuda
def test_facts_link_and_probes_on_the_cpu_platform_print_one_json_object() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu", "--quick",
         "--only", "facts", "--only", "link", "--only", "probes", "--json"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    figures = json.loads(out.stdout)
    assert set(figures) == {"device", "facts", "probes", "link", "seconds", "budget"}
    assert figures["facts"]["gpu"] is None and figures["facts"]["cpus"] >= 1
    assert figures["facts"]["host_ram_bytes"] > 0 and figures["facts"]["torch"]
    probes = figures["probes"]
    assert probes["ok"] and probes["skipped"] == "needs CUDA"
    assert [p["name"] for p in probes["probes"]] == [
        "eager-init", "batch-raise-torch", "batch-raise-pipeswap", "abort-releases",
        "torchrun-watch"]
    assert {p["line"] for p in probes["probes"]} == {"skipped: needs CUDA"}
    link = figures["link"]
    assert link["ok"] and link["d2h_gb_s"] > 0 and link["h2d_gb_s"] > 0
    assert link["queued"]["matmuls"] >= 1 and link["queued"]["after_compute"]
    assert figures["budget"] == {"total_s": 540.0, "skipped": {}}
    assert "probes: skipped: needs CUDA" in out.stderr


def test_write_records_the_report_and_the_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    import gpu_check

    sections: list[tuple[str, str]] = []
    monkeypatch.setattr(gpu_check, "write_section", lambda *args: sections.append(args))
    monkeypatch.setattr(gpu_check, "RESULTS", tmp_path / "results" / "gpu_check.json")
    assert gpu_check.main(["--device", "cpu", "--only", "facts", "--write"]) == 0
    ((title, text),) = sections
    assert title == gpu_check.SECTION and "**Machine**: the CPU platform" in text
    assert text in capsys.readouterr().out
    saved = json.loads((tmp_path / "results" / "gpu_check.json").read_text())
    assert saved["facts"]["gpu"] is None and saved["budget"]["total_s"] == 540.0
