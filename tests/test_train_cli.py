"""`pipeswap-train` as people run it: spawned by itself (JSON for tools) and under torchrun;
and its options (budget, llama, resume) run from the command line's own config on the shared
rank pool, which saves starting a launcher and its ranks for each."""

from __future__ import annotations

import functools
import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeswap.runtime.train import parse_args, render, run_rank, summarize
from pipeswap_pool import POOL

pytestmark = pytest.mark.multiprocess  # full tier only, unless also marked everyday

SMALL = ["--schedule", "gpipe", "--microbatches", "4", "--steps", "2", "--width", "32",
         "--seq-len", "16", "--batch-size", "8"]


def _run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


@functools.cache
def _json_run() -> dict[str, Any]:
    """The spawned fp32 run of SMALL on 2 ranks, both modes, as --json prints it."""
    out = _run([sys.executable, "-m", "pipeswap.runtime.train", "--ranks", "2", *SMALL,
                "--json"])
    summary: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return summary


def _pooled(argv: list[str]) -> dict[str, Any]:
    """The --json summary of ``argv`` (with ``--json``), the ranks run on the shared pool from
    the config the command line makes of it."""
    config, _ = parse_args([*argv, "--json"])
    summary: dict[str, Any] = summarize(config, POOL.run(run_rank, config.parallel.world,
                                                         config, timeout_s=60))
    return summary


def test_spawned_run_prints_the_json_contract() -> None:
    summary = _json_run()
    assert summary["max_abs_loss_diff"] == 0.0 and summary["losses_match"] is True
    assert summary["step_time_ratio"] > 0
    assert [entry["rank"] for entry in summary["per_rank"]] == [0, 1]
    for entry in summary["per_rank"]:
        # The default policy swaps a chunk only where that lowers the rank's peak; on GPipe
        # P=2 M=4 it does on both ranks.
        assert entry["swapped_chunks"] > 0
        assert 0 < entry["peak_activation_bytes_swap"] < entry["peak_activation_bytes_no_swap"]
        # the swap plan weighed what the run without swap measured, and says what it expects
        # next to what the step that timed its computes saw
        assert entry["step_time_s_swap_predicted"] > 0
        assert entry["exposed_copy_s_swap_predicted"] == 0.0  # planned to hide, no budget
        assert entry["exposed_copy_s_swap"] >= 0
        # The allocator's peak, measured beside the manager's count: at least what it counts.
        assert entry["peak_allocated_bytes_swap"] >= entry["peak_activation_bytes_swap"]
        assert entry["peak_allocated_bytes_no_swap"] >= entry["peak_activation_bytes_no_swap"]
    rank0 = summary["per_rank"][0]
    assert 0 < rank0["peak_allocated_bytes_swap"] < rank0["peak_allocated_bytes_no_swap"]
    assert summary["losses"]["swap"] == summary["losses"]["no-swap"]


def test_under_torchrun_bf16_prints_progress_metrics_and_the_table(tmp_path: Path) -> None:
    """Under torchrun with --dtype bf16: the last stage's rank prints progress, each line
    naming its rank, and the table; losses are bit-identical with and without swap and not
    those of fp32 (the forwards really ran in bfloat16); --metrics has a line per step and
    mode; nothing warns."""
    metrics_file = tmp_path / "metrics.jsonl"
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           "2", "-m", "pipeswap.runtime.train", *SMALL, "--dtype", "bf16",
                           "--metrics", str(metrics_file)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert "[rank 1] [no-swap] step 2/2  loss" in out and "[rank 1] [   swap] step 1/2  loss" in out
    progress = [line for line in out.splitlines() if "] step " in line]
    assert progress and all(line.startswith("[rank 1] [") for line in progress), progress
    assert "tokens/s" in out
    assert "peak activations (counted)" in out and "peak allocated (allocator)" in out
    assert "(allocator measured)" in out  # the odd steps, which are not timed
    assert "losses with and without swap: bit-identical" in out
    assert "Warning" not in out + done.stderr, done.stderr[-4000:]
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [(r["step"], r["mode"]) for r in records] == [
        (1, "no-swap"), (2, "no-swap"), (1, "swap"), (2, "swap")]
    for record in records:
        assert record["tokens_per_s"] > 0 and [e["rank"] for e in record["per_rank"]] == [0, 1]
        assert all(e["peak_activation_bytes"] > 0 for e in record["per_rank"])
    bf16 = [r["loss"] for r in records if r["mode"] == "swap"]
    assert bf16 == [r["loss"] for r in records if r["mode"] == "no-swap"]
    fp32 = _json_run()["losses"]["no-swap"]
    assert bf16 != fp32
    assert all(abs(a - b) < 0.05 * abs(b) for a, b in zip(bf16, fp32))


def test_a_budget_keeps_every_rank_under_it_with_bit_identical_losses() -> None:
    """--budget plans the peak policy on the chunk sizes the run without swap measured (all
    ranks'), exposing copies where it must: the counted peak of each rank ends under it."""
    budget = 350_000  # GPipe P=2 M=4 holds about 600 KB a rank without swap, 450-500 KB
    summary = _pooled(["--ranks", "2", *SMALL, "--budget", str(budget)])
    assert summary["max_abs_loss_diff"] == 0.0
    for entry in summary["per_rank"]:
        assert entry["peak_activation_bytes_no_swap"] > budget
        assert entry["peak_activation_bytes_swap"] <= budget, entry
        # what the plan expects of the step, the simulator's on the measured costs, every
        # rank's gathered: the plan was weighed in the whole pipeline
        assert entry["planned_in_pipeline"] is True
        assert entry["step_time_s_swap_predicted"] > 0
        assert entry["exposed_copy_s_swap_predicted"] >= 0


def test_under_torchrun_dp_makes_replicas_of_the_pipeline() -> None:
    """docs/fsdp.md's run under torchrun: four processes, --dp 2, two pipeline ranks in each
    of two FSDP replicas, every (pp, dp) rank reported with its peaks."""
    out = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                "-m", "pipeswap.runtime.train", "--dp", "2", "--fsdp", *SMALL, "--json"])
    summary = json.loads(out.strip().splitlines()[-1])
    assert (summary["ranks"], summary["dp"], summary["fsdp"]) == (2, 2, True)
    assert [(e["pp_rank"], e["dp_rank"]) for e in summary["per_rank"]] == [
        (0, 0), (0, 1), (1, 0), (1, 1)]
    assert summary["max_abs_loss_diff"] == 0.0
    for entry in summary["per_rank"]:
        assert entry["peak_memory_bytes_no_swap"] > entry["peak_activation_bytes_no_swap"] > 0
        for key in ("peak_activation_bytes", "peak_memory_bytes", "peak_allocated_bytes"):
            assert entry[f"{key}_swap"] > 0 and entry[f"{key}_no_swap"] > 0, (key, entry)
        assert entry["parameter_bytes"] > 0


def test_llama_in_bf16_swaps_without_changing_a_bit() -> None:
    """--model llama (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU) in bf16:
    losses bit-identical with and without swap, and both ranks' peaks lower with swap."""
    summary = _pooled(["--ranks", "2", *SMALL, "--model", "llama", "--dtype", "bf16"])
    assert summary["max_abs_loss_diff"] == 0.0 and summary["losses_match"] is True
    for entry in summary["per_rank"]:
        assert 0 < entry["peak_activation_bytes_swap"] < entry["peak_activation_bytes_no_swap"]
        assert 0 < entry["peak_allocated_bytes_swap"] < entry["peak_allocated_bytes_no_swap"]


def test_a_resumed_run_goes_on_exactly(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Steps 1-2 saved at their end, then --resume with --steps 3: step 3 loses what the
    uninterrupted run's step 3 loses, bit for bit (the run with swap; the checkpoint API's
    own tests cover more), and the resumed run's one step, which measures the allocator, is
    also timed; --metrics goes on in the same file. A byte flipped in the saved shard then
    refuses the checkpoint."""
    def losses(*extra: str) -> dict[str, Any]:
        return _pooled(["--ranks", "2", *SMALL, "--swap-only", *extra])

    whole = losses("--steps", "3")
    metrics = tmp_path / "metrics.jsonl"
    first = losses("--steps", "2", "--checkpoint-dir", str(tmp_path), "--metrics", str(metrics))
    resumed = losses("--steps", "3", "--resume", str(tmp_path), "--metrics", str(metrics))
    assert resumed["first_step"] == 3
    assert resumed["per_rank"][0]["step_time_s_swap"] > 0
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert first["losses"]["swap"] == whole["losses"]["swap"][:2]
    assert resumed["losses"]["swap"] == whole["losses"]["swap"][2:]
    assert (tmp_path / "swap" / "latest").is_file()
    # Other training options: refused by name before any rank starts, unless the run is
    # told to go on with its own.
    resume = ["--ranks", "2", *SMALL, "--swap-only", "--steps", "3", "--resume", str(tmp_path)]
    for changed, said in ((["--lr", "0.01"], "--lr 0.003 saved, 0.01 here"),
                          (["--seed", "7"], "--seed 0 saved, 7 here")):
        with pytest.raises(SystemExit) as refused:
            parse_args([*resume, *changed])
        assert refused.value.code == 2
        err = capsys.readouterr().err
        assert "was saved with other training options (" + said in err, err
        assert "or add --resume-anyway to go on with these" in err
        config, _ = parse_args([*resume, *changed, "--resume-anyway"])
        assert config.checkpoint.resume_anyway
    # One byte of a saved shard changed: the launcher refuses before any rank starts.
    shard = next((tmp_path / "swap" / "step-00000002").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(SystemExit) as refused:
        parse_args(["--ranks", "2", *SMALL, "--swap-only", "--steps", "3", "--resume",
                    str(tmp_path)])
    assert refused.value.code == 2
    assert f"{shard.name}: its checksum differs" in capsys.readouterr().err


def test_the_defaults_stream_and_halve_rank_zeros_peak() -> None:
    """`pipeswap-train` as it comes (1F1B, 4 ranks, 8 microbatches), no swap flag: the
    default policy streams chunks layer by layer where that lowers a rank's peak more than
    whole-chunk swap, and rank 0 holds at most half the saved activations it holds without
    swap, by its count and (lower with swap) by the allocator's. No rank warns."""
    from pipeswap_e2e_workers import run_rank_recording_warnings

    config, _ = parse_args(["--steps", "2", "--json"])
    ran = POOL.run(run_rank_recording_warnings, config.parallel.world, config, timeout_s=60)
    assert [warning for _, caught in ran for warning in caught] == []
    summary = summarize(config, [result for result, _ in ran])
    assert summary["losses"]["swap"] == summary["losses"]["no-swap"]
    ranks = summary["per_rank"]
    assert len(ranks) == 4 and any(entry["streamed_chunks"] > 0 for entry in ranks)
    rank0 = ranks[0]
    assert 2 * rank0["peak_activation_bytes_swap"] <= rank0["peak_activation_bytes_no_swap"]
    assert rank0["peak_allocated_bytes_swap"] < rank0["peak_allocated_bytes_no_swap"]
    for entry in ranks:
        if entry["swapped_chunks"]:  # whatever swaps, saves
            assert entry["peak_activation_bytes_swap"] < entry["peak_activation_bytes_no_swap"]
        else:
            assert entry["peak_activation_bytes_swap"] == entry["peak_activation_bytes_no_swap"]


def test_a_replayed_rank_reports_itself_alone(tmp_path: Path) -> None:
    """--replay-rank: one process, one per_rank entry naming the replayed rank, its peaks and
    step times in both modes, made-up inputs giving the same losses with and without swap,
    a metrics line per step and mode, progress lines, and no warning."""
    metrics = tmp_path / "metrics.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "pipeswap.runtime.train", "--replay-rank", "1", "--ranks", "2",
         *SMALL, "--model", "llama", "--dtype", "bf16", "--metrics", str(metrics), "--json"],
        capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Warning" not in done.stderr + done.stdout
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["replay_rank"] == 1 and summary["losses_match"] is True
    (entry,) = summary["per_rank"]
    assert entry["rank"] == 1 and entry["swapped_chunks"] > 0
    assert 0 < entry["peak_activation_bytes_swap"] < entry["peak_activation_bytes_no_swap"]
    assert 0 < entry["peak_allocated_bytes_swap"] < entry["peak_allocated_bytes_no_swap"]
    assert entry["step_time_s_swap"] > 0 and entry["step_time_s_no_swap"] > 0
    assert entry["step_time_s_swap_predicted"] > 0
    assert entry["exposed_copy_s_swap_predicted"] == 0.0
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [(line["step"], line["mode"]) for line in lines] == [
        (1, "no-swap"), (2, "no-swap"), (1, "swap"), (2, "swap")]
    assert all(line["per_rank"][0]["rank"] == 1 and line["loss"] > 0 for line in lines)
    # Rank 0 of the same pipeline computes no loss: nothing to compare, and the table says
    # so (replayed here, in this process, as the command would, its progress lines caught).
    config, _ = parse_args(["--replay-rank", "0", "--ranks", "2", *SMALL, "--steps", "1"])
    caught = io.StringIO()
    logger = logging.getLogger("pipeswap")
    handler = logging.StreamHandler(caught)
    logger.addHandler(handler)  # the job's own set-up keeps a handler it finds
    try:
        table = render(summarize(config, [run_rank(0, 1, config)]))
    finally:
        logger.removeHandler(handler)
    assert "[   swap] step 1/1" in caught.getvalue() and "peak activations" in caught.getvalue()
    assert "rank 0 of 2 replayed alone" in table
    assert "losses with and without swap" not in table


def test_a_replayed_rank_plans_a_budget_as_the_full_run_would() -> None:
    """--replay-rank with --budget: the rank plans on its own measured sizes, recomputes
    layers where swap alone cannot reach the budget, lands on the plan's peak to the byte
    and under the budget, with bit-identical losses and a predicted step time."""
    budget = 100_000  # rank 1 of GPipe P=2 M=4 holds about 650 KB without swap
    config, _ = parse_args(["--replay-rank", "1", "--ranks", "2", *SMALL,
                            "--budget", str(budget), "--json"])
    summary = summarize(config, [run_rank(1, 1, config)])
    assert summary["losses_match"] is True and summary["max_abs_loss_diff"] == 0.0
    (entry,) = summary["per_rank"]
    assert entry["rank"] == 1 and entry["recomputed_layers"] > 0
    assert entry["peak_activation_bytes_no_swap"] > budget
    assert entry["peak_activation_bytes_swap"] == entry["planned_peak_bytes_swap"] <= budget
    assert entry["budget_shortfall_bytes"] == 0
    assert entry["planned_in_pipeline"] is False  # the other ranks' costs are not there
    assert entry["step_time_s_swap_predicted"] > 0
    assert entry["exposed_copy_s_swap_predicted"] >= 0


def test_the_host_pool_cap_is_an_option_and_a_short_one_says_so() -> None:
    """--host-pool-bytes caps each rank's pinned host buffers: with room the run is bit for
    bit the run without swap; a cap one buffer short fails every rank with the error that
    names the option to raise."""
    from pipeswap.runtime import RankFailedError

    roomy = _pooled(["--ranks", "2", *SMALL, "--host-pool-bytes", "64MiB"])
    assert roomy["losses_match"] and roomy["max_abs_loss_diff"] == 0.0
    with pytest.raises(RankFailedError) as short:
        _pooled(["--ranks", "2", *SMALL, "--host-pool-bytes", "4KiB"])
    assert "host buffer pool exhausted" in str(short.value)
    assert "pipeswap-train's --host-pool-bytes" in str(short.value)


#: Put in the restarted job's workers by a sitecustomize module: on rank 1, in the job's
#: first run only, the background save of step 3 marks that it is writing and then waits,
#: so that the test kills the rank while that save is in flight.
_SLOW_SAVE = '''
import os, pathlib, time
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    from pipeswap.runtime.checkpoint import hashing_writer
    _write = hashing_writer._Digesting.write
    def write(self, data):
        if "step-00000003.tmp" in self._path:
            pathlib.Path(os.environ["PIPESWAP_TEST_MARKER"]).touch()
            time.sleep(120)
        return _write(self, data)
    hashing_writer._Digesting.write = write
'''


def test_a_restarted_job_goes_on_from_its_newest_checkpoint_and_loses_nothing(
        tmp_path: Path) -> None:
    """torchrun --max-restarts 1, checkpoints written in the background after every step:
    rank 1 killed while step 3's save is in flight. torchrun restarts the job, every rank
    goes on from step 2 (the interrupted save never became a checkpoint) with no flag but
    --checkpoint-dir, and each step's losses equal those of a run never interrupted."""
    steps = ["--swap-only", "--steps", "5"]
    whole = tmp_path / "whole.jsonl"
    _pooled(["--ranks", "2", *SMALL, *steps, "--metrics", str(whole)])
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(_SLOW_SAVE)
    marker, metrics, saves = tmp_path / "writing", tmp_path / "metrics.jsonl", tmp_path / "ckpt"
    env = {**os.environ, "PIPESWAP_TEST_MARKER": str(marker),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"),
                                          os.environ.get("PYTHONPATH", "")])}
    job = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", "--max-restarts", "1", "-m", "pipeswap.runtime.train", "--ranks", "2", *SMALL, *steps,
         "--checkpoint-dir", str(saves), "--checkpoint-every", "1", "--checkpoint-async",
         "--metrics", str(metrics), "--timeout", "20"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.05)
        assert (saves / "swap" / "step-00000003.tmp").is_dir()
        writer = next(pid for pid in _pids_of(job.pid) if _environ(pid).get("RANK") == "1")
        os.kill(writer, signal.SIGKILL)
        out, err = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 0, err[-4000:]
    assert "restart 1 of the job: the swap run goes on after step 2" in err, err[-4000:]

    def losses(path: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in map(json.loads, path.read_text().splitlines())}

    assert losses(metrics) == losses(whole) and sorted(losses(metrics)) == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in (saves / "swap").glob("step-*")) == [
        "step-00000004", "step-00000005"]


def _pids_of(root: int) -> list[int]:
    """The processes descended from ``root``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = (Path("/proc") / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    return dict(item.decode(errors="replace").partition("=")[::2]
                for item in raw.split(b"\0") if b"=" in item)
