"""Checkpoint and resume on real gloo ranks: a run saved after 2 of 4 steps and resumed in
fresh processes, from a model built with other weights, ends bit for bit where the run
without a break ends, on 2 pipeline ranks and on 2 pipeline ranks x 2 FSDP2 replicas. Loads
that cannot fit fail on every rank at once with the reason."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeswap.runtime.checkpoint import (
    LATEST,
    MANIFEST,
    checkpoint_path,
    latest_checkpoint,
)
from pipeswap.runtime.distributed.launch import spawn
from pipeswap.runtime.train import TrainConfig
from pipeswap_checkpoint_workers import PP, PP_DP, SAVED_AT, resume, train_and_save
from pipeswap_pool import POOL

pytestmark = pytest.mark.multiprocess  # full tier only, unless also marked everyday

Runs = tuple[list[dict[str, Any]], list[dict[str, Any]]]  # per rank: saving run, resumed run


def _run(config: TrainConfig, directory: Path,
         refusals: dict[str, tuple[TrainConfig, Path]]) -> Runs:
    # saved on the shared ranks; resumed in fresh processes, so nothing but the files carries
    saved = POOL.run(train_and_save, config.parallel.world, config, directory,
                     timeout_s=config.job.timeout_s)
    resumed = spawn(resume, config.parallel.world, config, directory, refusals,
                    timeout_s=config.job.timeout_s)
    return saved, resumed


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory) -> tuple[Runs, Path]:
    """PP=2; before it resumes, it tries an empty directory, 4 stages on its 2 ranks, a model
    twice as wide and one with more layers."""
    directory = tmp_path_factory.mktemp("pp")
    (directory / "step-00000009.tmp").mkdir()  # as a save cut short leaves it
    empty = tmp_path_factory.mktemp("empty")
    refusals = {
        "empty": (PP, empty),
        "four stages": (PP.but(schedule="interleaved-1f1b", stages_per_rank=2), directory),
        "wider": (PP.but(width=64), directory),
        "deeper": (PP.but(layers=6), directory),
    }
    return _run(PP, directory, refusals), directory


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory, pipeline: tuple[Runs, Path]) -> Runs:
    """PP=2 x DP=2 with FSDP2; before it resumes, it tries the PP=2 checkpoint."""
    _, pp_directory = pipeline
    return _run(PP_DP, tmp_path_factory.mktemp("pp-dp"),
                {"two ranks": (PP_DP, pp_directory)})


def _continues_exactly(runs: Runs, config: TrainConfig) -> None:
    saved, resumed = runs
    for rank, (before, after) in enumerate(zip(saved, resumed)):
        assert (after["step"], after["data_position"]) == (SAVED_AT, SAVED_AT)
        assert after["weights_changed"], f"rank {rank}: the load left the fresh weights"
        assert after["losses"] == before["losses"][SAVED_AT:], f"rank {rank}"
        assert before["params"].keys() == after["params"].keys()
        assert all(torch.equal(before["params"][k], after["params"][k])
                   for k in before["params"]), f"rank {rank}"
        # each rank's own generators, set apart before the save, came back
        assert torch.equal(after["rng_after_load"], before["rng_at_save"]), f"rank {rank}"
    last = [run["losses"] for run in resumed if run["losses"][0]]
    assert len(last) == config.parallel.dp  # the last stage's rank of each replica reports losses
    assert len({str(run["rng_at_save"].tolist()) for run in saved}) == config.parallel.world


def test_pipeline_resumes_bit_for_bit(pipeline: tuple[Runs, Path]) -> None:
    runs, _ = pipeline
    _continues_exactly(runs, PP)


def test_fsdp_replicas_resume_bit_for_bit(replicas: Runs) -> None:
    _continues_exactly(replicas, PP_DP)


def test_saves_keep_the_latest_and_drop_unfinished_ones(pipeline: tuple[Runs, Path]) -> None:
    (_, resumed), directory = pipeline
    final = checkpoint_path(directory, SAVED_AT)
    # saved after steps 1 and 2 with keep=1; the unfinished save was cleared away
    assert sorted(p.name for p in directory.iterdir()) == [LATEST, final.name]
    assert (directory / LATEST).read_text() == f"{final.name}\n"
    manifest = json.loads((final / MANIFEST).read_text())
    assert {key: manifest[key] for key in ("step", "data_position", "num_stages", "stages")} \
        == {"step": SAVED_AT, "data_position": SAVED_AT, "num_stages": 2, "stages": [[0], [1]]}
    # DCP's metadata and each rank's file, each with the checksum taken as it was written
    files = sorted(entry.name for entry in final.iterdir() if entry.name != MANIFEST)
    assert sorted(manifest["files"]) == files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert all(manifest["files"][name]["sha256"]
               == hashlib.sha256((final / name).read_bytes()).hexdigest() for name in files)
    assert all(run["path"] == final for run in resumed)


def _refusal(runs: Runs, name: str) -> str:
    """The one error every rank raised, promptly (no rank waited for a peer's timeout)."""
    _, resumed = runs
    outcomes = [run["refused"][name] for run in resumed]
    errors = {outcome["error"] for outcome in outcomes}
    assert len(errors) == 1 and None not in errors, errors
    assert max(outcome["seconds"] for outcome in outcomes) < 10
    error: str = errors.pop()
    return error


def test_save_before_the_first_step_fails_on_every_rank(pipeline: tuple[Runs, Path]) -> None:
    (saved, _), _ = pipeline
    assert {run["too_early"] for run in saved} == {
        "the optimizer holds no state yet: save after its first step"}


def test_load_from_an_empty_directory_fails_on_every_rank(
        pipeline: tuple[Runs, Path]) -> None:
    error = _refusal(pipeline[0], "empty")
    assert "no checkpoint to resume from" in error and "holds no complete checkpoint" in error


def test_load_into_another_layout_fails_on_every_rank(pipeline: tuple[Runs, Path]) -> None:
    error = _refusal(pipeline[0], "four stages")
    assert ("saved by a job of 2 ranks and 2 stages (rank 0: stage 0; rank 1: stage 1), but "
            "this job has 2 ranks and 4 stages (rank 0: stages 0, 2; rank 1: stages 1, 3)"
            in error)


def test_load_into_another_world_fails_on_every_rank(replicas: Runs) -> None:
    error = _refusal(replicas, "two ranks")
    assert "saved by a job of 2 ranks" in error and "this job has 4 ranks" in error


def test_load_into_another_model_names_what_differs(pipeline: tuple[Runs, Path]) -> None:
    error = _refusal(pipeline[0], "wider")
    assert "does not fit this model" in error and "shapes differ" in error
    assert "model.stage0.0.positions.weight saved [16, 32], here [16, 64]" in error
    # 3 blocks a stage instead of 2: two more sublayers, and the head moves up two
    error = _refusal(pipeline[0], "deeper")
    assert "rank 0: not in the checkpoint: model.stage0.5." in error
    assert "rank 1: saved but not in this model: model.stage1.4.out.bias" in error


def test_latest_checkpoint_finds_only_whole_ones(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "absent") is None
    unfinished = tmp_path / "step-00000005.tmp"
    unfinished.mkdir()
    (unfinished / MANIFEST).write_text("{}")  # written, but cut short before the rename
    assert latest_checkpoint(tmp_path) is None
    for step in (1, 3):
        checkpoint_path(tmp_path, step).mkdir()
        (checkpoint_path(tmp_path, step) / MANIFEST).write_text("{}")
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 3)  # no pointer yet
    (tmp_path / LATEST).write_text("step-00000001\n")  # a run resumed from step 1 saved it
    assert latest_checkpoint(tmp_path) == checkpoint_path(tmp_path, 1)
    assert latest_checkpoint(checkpoint_path(tmp_path, 3)) == checkpoint_path(tmp_path, 3)
