"""``pipeswap-train`` refuses every bad argument with one line, before it starts any rank."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeswap.runtime.checkpoint import MANIFEST, checkpoint_path
from pipeswap.runtime.checkpoint.manifest import Layout, Manifest, file_sum
from pipeswap.runtime.train.components import build_stage_modules
from pipeswap.runtime.train import cli
from pipeswap.runtime.train.preflight import saved_model
from pipeswap.runtime.models.data import Corpus
from pipeswap.runtime.train import TrainConfig, main, parse_args

CORPUS = len(Corpus.bundled().text)
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")

BAD = [
    (["--budget", "lots"], ["--budget", "not a size: 'lots'"]),
    (["--budget", "1MiB", "--policy", "gap"], ["--budget applies to the peak policy"]),
    (["--swap-costs", "layers", "--policy", "cost"], ["--swap-costs applies to the peak policy"]),
    (["--swap-costs", "guessed"], ["--swap-costs", "invalid choice: 'guessed'"]),
    (["--budget", "1MiB", "--swap-only"], ["--budget plans on the chunk sizes", "--swap-only"]),
    (["--recompute", "never"], ["--recompute never applies under a --budget"]),
    (["--recompute", "auto"], ["without one nothing is recomputed", "give --budget BYTES"]),
    (["--budget", "1MiB", "--recompute", "sometimes"], ["--recompute", "invalid choice"]),
    (["--device", "bogus"], ["--device", "cpu or cuda", "'bogus'"]),
    (["--device", "cuda:1"], ["--device", "cpu or cuda", "a GPU of its own"]),
    pytest.param(["--device", "cuda"], ["no CUDA device", "--device cpu"], marks=NO_GPU),
    (["--timeout", "0"], ["--timeout", "finite", "from 1 to 86400", "got 0.0"]),
    (["--timeout", "-1"], ["--timeout", "finite", "got -1.0"]),
    (["--timeout", "inf"], ["--timeout", "finite", "got inf"]),
    (["--timeout", "nan"], ["--timeout", "finite", "got nan"]),
    (["--timeout", "1e9"], ["--timeout", "86400"]),
    (["--seq-len", "100000"], ["--seq-len", f"{CORPUS} characters", f"{CORPUS - 2} or less"]),
    (["--seq-len", "0"], ["--seq-len must be at least 1, got 0"]),
    (["--width", "0"], ["--width must be at least 4, got 0"]),
    (["--width", "-64"], ["--width must be at least 4"]),
    (["--width", "30"], ["--width 30", "4 attention heads", "multiple of 4"]),
    (["--layers", "0"], ["--layers 0 cannot fill 4 stages", "at least 4"]),
    (["--layers", "-3"], ["--layers -3 cannot fill 4 stages"]),
    (["--lr", "0"], ["--lr", "finite number above 0", "got 0.0"]),
    (["--lr", "-0.1"], ["--lr", "finite number above 0"]),
    (["--lr", "nan"], ["--lr", "finite number above 0", "got nan"]),
    (["--lr", "inf"], ["--lr", "finite number above 0", "got inf"]),
    (["--seed", "-1"], ["--seed must be at least 0, got -1"]),
    (["--heads", "0"], ["--heads must be at least 1, got 0"]),
    (["--heads", "5"], ["--width 64", "5 attention heads", "multiple of 5"]),
    (["--replay-rank", "4"], ["--replay-rank 4", "ranks 0 to 3"]),
    (["--replay-rank", "-1"], ["--replay-rank -1", "ranks 0 to 3"]),
    (["--replay-rank", "0", "--dp", "2", "--fsdp"], ["--replay-rank", "drop --dp and --fsdp"]),
    (["--replay-rank", "0", "--checkpoint-dir", "x"], ["no --checkpoint-dir or --resume"]),
    (["--seed", str(2**64)], ["--seed must be at most 18446744073709551615", "64-bit"]),
    (["--batch-size", "0"], ["--batch-size must be at least 1, got 0"]),
    (["--batch-size", "10"], ["--batch-size 10 does not split into 8 microbatches"]),
    (["--steps", "-5"], ["--steps must be at least 1, got -5"]),
    (["--steps", "1000000000000"], ["--steps must be at most 100000000, got 1000000000000",
                                   "a larger number is a typo"]),
    (["--microbatches", "0"], ["--microbatches must be at least 1, got 0"]),
    (["--ranks", "0"], ["--ranks must be at least 1, got 0"]),
    (["--stages-per-rank", "0"], ["--stages-per-rank must be at least 1, got 0"]),
    (["--stages-per-rank", "2"], ["stages_per_rank must be 1", "interleaved-1f1b"]),
    (["--schedule", "zbv", "--stages-per-rank", "3"], ["zbv runs exactly two stages per rank"]),
    (["--schedule", "dualpipev", "--microbatches", "2"],
     ["dualpipev needs at least as many microbatches as stages (8 for 4 ranks), got 2"]),
    (["--schedule", "dualpipev", "-P", "2", "-M", "2", "--batch-size", "4"],
     ["dualpipev needs at least as many microbatches as stages (4 for 2 ranks)"]),
    (["--overlap-b-f"], ["overlap_b_f applies to interleaved-1f1b only"]),
    (["--schedule", "interleaved-1f1b", "-P", "2", "-V", "2", "--dxdw-split"],
     ["dxdw_split=True requires overlap_b_f=True"]),
    (["-P", "512", "-M", "100000"], ["--ranks must be at most 64, got 512", "process"]),
    (["-P", "64", "-M", "2000", "--batch-size", "2000"],
     ["64 ranks x 1 stage(s) per rank x 2000 microbatches", "at most 100000"]),
    (["-M", "100000", "--batch-size", "100000"], ["at most 100000", "--microbatches"]),
    (["--width", "100000"], ["GiB", "more than this machine's", "--width"]),
    (["--layers", "10000000"], ["GiB", "more than this machine's"]),
    (["--batch-size", "800000000"], ["GiB", "more than this machine's", "--batch-size"]),
    (["--ranks", "four"], ["--ranks/-P: invalid int value: 'four'"]),
    (["--dp", "0"], ["--dp must be at least 1, got 0"]),
    (["--dp", "2"], ["--dp 2", "add --fsdp"]),
    (["--dp", "2", "--fsdp", "--batch-size", "8"],
     ["--batch-size 8 does not split into 8 microbatches in each of 2 replicas",
      "a multiple of 16"]),
    (["-P", "40", "--dp", "2", "--fsdp"], ["--ranks x --dp must be at most 64, got 80"]),
    (["--checkpoint-every", "2"], ["--checkpoint-every needs --checkpoint-dir"]),
    (["--checkpoint-dir", "x", "--checkpoint-every", "0"],
     ["--checkpoint-every must be at least 1, got 0"]),
    (["--resume", "/nonexistent"], ["no checkpoint to resume from: /nonexistent/no-swap does "
                                    "not exist"]),
    (["--budget", "0"], ["--budget", "'0' leaves no room for activations", "above 0 bytes"]),
    (["--budget", "0.4B"], ["--budget", "leaves no room for activations"]),
    (["--budget=-1GiB"], ["--budget", "not a size: '-1GiB'"]),
    (["--metrics", ""], ["--metrics '' is empty: name a file"]),
    (["--metrics", "/"], ["--metrics '/' is a directory"]),
    (["--metrics", "/proc/pipeswap-metrics"], ["--metrics '/proc/pipeswap-metrics' cannot be "
                                               "written"]),
    (["--metrics", "/nonexistent/m.jsonl"], ["cannot be made: /nonexistent is not a "
                                             "directory"]),
    (["--checkpoint-dir", ""], ["--checkpoint-dir '' is empty: name a directory"]),
    (["--checkpoint-dir", "/proc/pipeswap"], ["--checkpoint-dir '/proc/pipeswap' cannot be "
                                              "written"]),
    (["--checkpoint-dir", "/proc/self/status/x"], ["cannot be made: /proc/self/status is a "
                                                   "file"]),
    (["--tie-embeddings"], ["--tie-embeddings applies to --model llama"]),
    (["--model", "llama", "--width", "12"], ["heads of 3 dimensions", "multiple of 8"]),
    (["--ffn", "64"], ["--ffn shapes the llama model", "--model llama"]),
    (["--model", "llama", "--kv-heads", "0"], ["--kv-heads must be at least 1, got 0"]),
    (["--model", "llama", "--heads", "4", "--kv-heads", "3"],
     ["--kv-heads 3 does not divide --heads 4"]),
]


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not under torchrun, and fail the test if anything tries to start a rank."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)

    def started(*args: Any, **kwargs: Any) -> None:
        pytest.fail("a rank was started for arguments that should have been refused")

    monkeypatch.setattr(cli, "spawn", started)
    monkeypatch.setattr(cli, "init_from_env", started)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("pipeswap-train: error: "), captured.err
    assert len(captured.err.splitlines()) <= 3, captured.err  # no screenful of usage
    return errors[0]


@pytest.mark.parametrize(("argv", "words"), BAD)
def test_a_bad_argument_gets_one_line_and_starts_no_rank(
        argv: list[str], words: list[str], no_ranks: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    line = _refused(argv, capsys)
    for word in words:
        assert word in line


def _as_torchrun(monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    """The environment torchrun gives rank 0 of ``world`` processes."""
    for name, value in (("RANK", "0"), ("WORLD_SIZE", str(world)),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)


def test_under_torchrun_its_world_size_meets_the_same_limits(
        monkeypatch: pytest.MonkeyPatch, no_ranks: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    _as_torchrun(monkeypatch, 512)
    line = _refused([], capsys)
    assert "torchrun's world size" in line and "at most 64, got 512" in line


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_needs_a_gpu_per_rank(no_ranks: None, capsys: pytest.CaptureFixture[str]) -> None:
    count = torch.cuda.device_count()
    line = _refused(["--device", "cuda", "--ranks", str(count + 1)], capsys)
    assert f"this machine has {count}" in line


def test_the_defaults_parse_to_the_default_config(no_ranks: None) -> None:
    config, args = parse_args([])
    assert config == TrainConfig.of() and not args.json
    assert config.swap.costs == "measured"
    assert parse_args(["--swap-costs", "layers"])[0].swap.costs == "layers"
    assert parse_args(["--budget", "1MiB"])[0].swap.recompute == "auto"
    assert parse_args(["--budget", "1MiB", "--recompute", "never"])[0].swap.recompute == "never"


def test_kv_heads_and_ffn_shape_the_llama_built(no_ranks: None) -> None:
    """The widths ``pipeswap-schedule plan`` passes on for a Llama preset build that shape."""
    config, _ = parse_args(["--model", "llama", "--width", "64", "--heads", "8",
                            "--kv-heads", "2", "--ffn", "100", "--ranks", "1"])
    (stage,) = build_stage_modules(config, vocab=10)
    block = stage.get_submodule("layers.0")
    assert block.get_submodule("attention.wk").weight.shape == (2 * 8, 64)  # 2 heads of 8
    assert block.get_submodule("feed_forward.w1").weight.shape == (100, 64)


@pytest.mark.parametrize("argv", [
    ["--schedule", "gpipe", "--ranks", "2", "--microbatches", "4"],
    ["--schedule", "interleaved-1f1b", "--ranks", "2", "--stages-per-rank", "2",
     "--overlap-b-f", "--dxdw-split", "--batch-p2p"],
    ["--schedule", "dualpipev", "--ranks", "2", "--microbatches", "4"],
    ["--schedule", "zbv", "-P", "2", "-V", "2", "-M", "2", "--batch-size", "4"],
    ["--no-swap", "--json", "--lr", "1e-4", "--timeout", "1", "--seed", str(2**64 - 1)],
    ["-P", "64", "-M", "16", "--width", "4", "--seq-len", str(CORPUS - 2), "--steps", "1"],
    ["--replay-rank", "3", "--model", "llama", "--width", "128", "--heads", "8"],
    ["--model", "llama", "--heads", "8", "--kv-heads", "2", "--ffn", "100"],
])
def test_the_documented_and_boundary_values_parse(argv: list[str], no_ranks: None) -> None:
    config, _ = parse_args(argv)
    assert config.num_layers >= config.num_stages


def test_under_torchrun_dp_splits_the_world_into_replicas(
        monkeypatch: pytest.MonkeyPatch, no_ranks: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    _as_torchrun(monkeypatch, 6)
    config, _ = parse_args(["--dp", "2", "--fsdp"])
    assert (config.parallel.ranks, config.parallel.dp, config.parallel.world) == (3, 2, 6)
    line = _refused(["--dp", "4", "--fsdp"], capsys)
    assert "world size 6 does not split into --dp 4 replicas" in line


# -- resuming: every checkpoint problem that can be seen before the ranks start ---------------

JOB = ["--ranks", "2", "--microbatches", "2", "--batch-size", "2", "--no-swap", "--steps", "4"]


def _checkpoint(root: Path, step: int = 2, data_position: int = 2,
                stages: tuple[tuple[int, ...], ...] = ((0,), (1,)),
                model: dict[str, object] | None = None) -> Path:
    """A checkpoint of ``JOB``'s layout and model as far as the launcher reads one: files with
    their sums in a checksummed manifest (the ranks' DCP data is never opened before they
    start)."""
    path = checkpoint_path(root / "no-swap", step)
    path.mkdir(parents=True)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        (path / name).write_bytes(name.encode() * 100)
    if model is None:
        model = saved_model(parse_args(JOB)[0])
    manifest = Manifest(step, data_position, Layout(2, stages),
                        {entry.name: file_sum(entry) for entry in path.iterdir()},
                        {"model": model})
    (path / MANIFEST).write_text(manifest.dumps())
    return path


def _damaged(root: Path, how: str) -> None:
    path = _checkpoint(root)
    if how == "flip":
        data = bytearray((path / "__1_0.distcp").read_bytes())
        data[7] ^= 1
        (path / "__1_0.distcp").write_bytes(bytes(data))
    elif how == "truncate":
        (path / "__0_0.distcp").write_bytes(b"__0_0")
    elif how == "empty":
        (path / ".metadata").write_bytes(b"")
    elif how == "remove":
        (path / "__1_0.distcp").unlink()
    elif how == "manifest-json":
        (path / MANIFEST).write_text("{not json")
    elif how == "manifest-type":  # a checksummed manifest of the wrong shape
        body = {"format": 2, "step": "two", "data_position": 2, "num_stages": 2,
                "stages": [[0], [1]], "files": {}, "job": {}}
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        body["checksum"] = hashlib.sha256(text.encode()).hexdigest()
        (path / MANIFEST).write_text(json.dumps(body))
    elif how == "manifest-old":  # a manifest without checksums
        (path / MANIFEST).write_text(json.dumps({"step": 2, "data_position": 2,
                                                 "num_stages": 2, "stages": [[0], [1]]}))


RESUME_BAD = [
    (lambda root: _checkpoint(root, stages=((0, 1), ())), [],
     ["was saved by a job of 2 ranks", "the same --ranks, --dp"]),
    (lambda root: _checkpoint(root), ["--ranks", "4", "--batch-size", "4"],
     ["saved by a job of 2 ranks and 2 stages", "this job has 4 ranks"]),
    (lambda root: _checkpoint(root), ["--width", "32"],
     ["holds another model", "--width 64 saved, 32 here"]),
    (lambda root: _checkpoint(root), ["--model", "llama"],
     ["holds another model", "--model 'gpt' saved, 'llama' here"]),
    (lambda root: _checkpoint(root, step=4, data_position=4), [],
     ["checkpoint is of step 4", "give more than 4 steps"]),
    (lambda root: _checkpoint(root, step=1, data_position=9), [],
     ["data position 9 is past the 4 batches"]),
    (lambda root: _damaged(root, "flip"), [],
     ["no checkpoint in", "verifies", "__1_0.distcp: its checksum differs"]),
    (lambda root: _damaged(root, "truncate"), [], ["__0_0.distcp: 5 bytes, 1200 saved"]),
    (lambda root: _damaged(root, "empty"), [], [".metadata: 0 bytes, 900 saved"]),
    (lambda root: _damaged(root, "remove"), [], ["__1_0.distcp: missing"]),
    (lambda root: _damaged(root, "manifest-json"), [], ["cannot be read as JSON"]),
    (lambda root: _damaged(root, "manifest-type"), [], ["does not hold a manifest of format 2"]),
    (lambda root: _damaged(root, "manifest-old"), [], ["not a pipeswap manifest with checksums"]),
    (lambda root: (root / "no-swap" / "step-00000002.tmp").mkdir(parents=True), [],
     ["holds no complete checkpoint", "step-N.tmp"]),
    (lambda root: (root / "no-swap").write_text("a file"), [],
     ["holds no complete checkpoint"]),
]


@pytest.mark.parametrize(("make", "argv", "words"), RESUME_BAD)
def test_a_checkpoint_that_cannot_resume_this_job_is_refused_before_any_rank(
        make: Callable[[Path], object], argv: list[str], words: list[str], tmp_path: Path,
        no_ranks: None, capsys: pytest.CaptureFixture[str]) -> None:
    make(tmp_path)
    line = _refused([*JOB, *argv, "--resume", str(tmp_path)], capsys)
    for word in words:
        assert word in line


def test_a_model_spelled_another_way_resumes(tmp_path: Path, no_ranks: None) -> None:
    """Saved without --layers (two blocks a stage), resumed with the same count given."""
    saved = _checkpoint(tmp_path)
    config, _ = parse_args([*JOB, "--layers", "4", "--resume", str(tmp_path)])
    assert config.checkpoint.resume_path("no-swap") == str(saved)


def test_resume_skips_a_newer_checkpoint_that_does_not_verify_and_says_so(
        tmp_path: Path, no_ranks: None, capsys: pytest.CaptureFixture[str]) -> None:
    older = _checkpoint(tmp_path, step=1, data_position=1)
    newer = _checkpoint(tmp_path, step=2, data_position=2)
    (newer / "__0_0.distcp").write_bytes(b"")
    config, _ = parse_args([*JOB, "--resume", str(tmp_path)])
    assert config.checkpoint.resume_path("no-swap") == str(older)
    warning = capsys.readouterr().err.strip()
    assert "\n" not in warning and warning.startswith("pipeswap-train: warning: ")
    assert "resumes from step-00000001" in warning and "step-00000002" in warning
    assert "__0_0.distcp: 0 bytes" in warning


def test_paths_refused_are_left_as_they_were(tmp_path: Path, no_ranks: None,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("mine")
    _refused(["--checkpoint-dir", str(blocker / "sub")], capsys)
    _refused(["--metrics", str(tmp_path / "m.jsonl"), "--budget", "0"], capsys)
    _refused(["--metrics", str(tmp_path / "m.jsonl"), "--checkpoint-dir", str(blocker)], capsys)
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["a-file"]
    assert blocker.read_text() == "mine"
