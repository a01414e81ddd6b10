"""What ``pipeswap-train`` checks on disk before any rank starts: that the files it will write
can be written, and that the checkpoints it resumes from verify and fit the job. Each check
returns or raises one line for the user; the command line turns it into its error."""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeswap.runtime.checkpoint.manifest import (
    Layout,
    Manifest,
    describe_skipped,
    newest_verified,
)
from pipeswap.runtime.errors import CheckpointError
from pipeswap.runtime.train.config import Mode, TrainConfig

#: The model options a checkpoint's weights depend on, and how the command line names them.
_TRAINING_OPTIONS = {"lr": "--lr", "batch_size": "--batch-size", "seed": "--seed",
                     "microbatches": "--microbatches", "data": "the data"}
_MODEL_OPTIONS = {"family": "--model", "tie_embeddings": "--tie-embeddings", "width": "--width",
                  "layers": "--layers", "heads": "--heads", "kv_heads": "--kv-heads",
                  "ffn": "--ffn", "seq_len": "--seq-len"}


def directory_problem(path: str) -> str | None:
    """Why a run could not write into directory ``path`` (made if it does not exist), or
    None if it can."""
    if not path.strip():
        return "is empty: name a directory"
    target = Path(path)
    try:
        if target.exists() and not target.is_dir():
            return "is a file, not a directory"
        probe = target
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir():
            return f"cannot be made: {probe} is a file"
        with tempfile.TemporaryDirectory(dir=probe, prefix=".pipeswap-probe-"):
            pass
    except OSError as exc:
        return f"cannot be written: {exc.strerror or exc}"
    return None


def file_problem(path: str) -> str | None:
    """Why a run could not write file ``path``, or None if it can (an existing file is left
    as it is)."""
    if not path.strip():
        return "is empty: name a file"
    target = Path(path)
    try:
        if target.is_dir():
            return "is a directory: name a file in it"
        if not target.parent.is_dir():
            return f"cannot be made: {target.parent} is not a directory"
        if target.exists():
            with target.open("a", encoding="utf-8"):
                pass
        else:  # a name of its own: under torchrun every process checks at once
            with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".pipeswap-probe-"):
                pass
    except OSError as exc:
        return f"cannot be written: {exc.strerror or exc}"
    return None


@dataclass(frozen=True)
class ResumePlan:
    """Each mode's checkpoint to resume from, and a warning line per mode whose newer
    checkpoints did not verify."""

    paths: tuple[tuple[str, str], ...]
    warnings: tuple[str, ...]


def restarted(config: TrainConfig, restart: int) -> tuple[TrainConfig | None, str]:
    """How restart ``restart`` of a job under torchrun goes on (``--max-restarts``): each mode
    from its newest checkpoint in ``--checkpoint-dir`` whose manifest verifies, a mode with
    none yet afresh, a mode already finished not again; and a line that says so. None where
    every mode had finished."""
    save_dir = config.checkpoint.save_dir
    assert save_dir is not None
    saved: dict[Mode, int] = {}
    for mode in config.swap.modes:
        try:
            saved[mode] = newest_verified(Path(save_dir) / mode, files=False).manifest.step
        except CheckpointError:  # none saved yet (or none whole): this mode starts afresh
            continue
    said = f"restart {restart} of the job: "
    if not saved:
        return config, said + f"no checkpoint in {save_dir} yet, so it starts afresh"
    done = [mode for mode, step in saved.items() if step >= config.training.steps]
    running = tuple(mode for mode in config.swap.modes if mode not in done)

    def story(mode: Mode) -> str:
        if mode in done:
            return "finished before it"
        return f"goes on after step {saved[mode]}" if mode in saved else "starts afresh"

    line = (said + "; ".join(f"the {mode} run {story(mode)}" for mode in config.swap.modes)
            + f" (checkpoints in {save_dir})")
    if not running:
        return None, line
    return config.but(resume=save_dir, modes=running,
                      fresh_modes=tuple(mode for mode in running if mode not in saved)), line


def plan_resume(config: TrainConfig, layout: Layout, verify: bool) -> ResumePlan:
    """The checkpoint of each mode ``config`` resumes, checked against the job: its layout
    (``layout``: which stages each global rank will hold), model, step and data position.
    ``verify``: check every file's checksum here (else only the manifest's, and the ranks
    check the files as they load). Raises :class:`CheckpointError` with one line."""
    resume = config.checkpoint.resume
    assert resume is not None
    paths, warnings = [], []
    for mode in config.swap.modes:
        if mode in config.checkpoint.fresh_modes:  # a restarted job's mode not saved yet
            continue
        where = Path(resume) / mode
        try:
            found = newest_verified(where, files=verify)
        except CheckpointError as exc:
            raise CheckpointError(
                f"--resume {resume}: nothing to resume the {mode} run from: {exc} (resume "
                "from a directory --checkpoint-dir filled, with the same choice of "
                "--no-swap / --swap-only)") from None
        if found.skipped:
            warnings.append(f"--resume {resume}: the {mode} run resumes from "
                            f"{found.path.name}; skipped, as they do not verify: "
                            f"{describe_skipped(found.skipped)}")
        _check_fits(config, mode, found.path, found.manifest, layout)
        paths.append((mode, str(found.path)))
    return ResumePlan(tuple(paths), tuple(warnings))


def _check_fits(config: TrainConfig, mode: Mode, path: Path, manifest: Manifest,
                layout: Layout) -> None:
    resume, steps = config.checkpoint.resume, config.training.steps
    name = f"--resume {resume}: {path}"
    if manifest.layout != layout:
        raise CheckpointError(
            f"{name} was saved by a job of {manifest.layout.describe()}, but this job has "
            f"{layout.describe()}: resume with the layout it was saved with (the same --ranks, "
            "--dp, --stages-per-rank and --schedule), or start afresh")
    _check_training(config, name, manifest.job.get("training"))
    saved = manifest.job.get("model")
    if isinstance(saved, dict):
        mine = saved_model(config)
        differ = [f"{option} {saved.get(key)!r} saved, {mine[key]!r} here"
                  for key, option in _MODEL_OPTIONS.items() if saved.get(key) != mine[key]]
        if differ:
            raise CheckpointError(f"{name} holds another model ({'; '.join(differ)}): give "
                                  "the model options it was saved with, or start afresh")
    if manifest.step >= steps:
        raise CheckpointError(f"{name}: the {mode} run's checkpoint is of step "
                              f"{manifest.step}, and --steps {steps} counts from the run's "
                              f"start: give more than {manifest.step} steps")
    if manifest.data_position >= steps:
        raise CheckpointError(f"{name}: its data position {manifest.data_position} is past "
                              f"the {steps} batches of --steps {steps}: give more steps")


def _check_training(config: TrainConfig, name: str, saved: object) -> None:
    """Refuse a checkpoint saved with other training options, unless told to go on with
    this run's (``--resume-anyway``): resumed so, the run is no longer the one it
    continues."""
    if not isinstance(saved, dict) or config.checkpoint.resume_anyway:
        return
    mine = saved_training(config)
    differ = [f"{option} {saved.get(key)!r} saved, {mine[key]!r} here"
              for key, option in _TRAINING_OPTIONS.items() if saved.get(key) != mine[key]]
    if differ:
        raise CheckpointError(f"{name} was saved with other training options "
                              f"({'; '.join(differ)}): give the options it was saved with, "
                              "or add --resume-anyway to go on with these")


def saved_training(config: TrainConfig) -> dict[str, object]:
    """The training options a checkpoint records, which a resumed run must share: the
    learning rate, the batch and its split, the random seed, and the data (the bundled corpus's
    digest)."""
    from pipeswap.runtime.models.data import Corpus  # with torch: the launcher checks first

    text = Corpus.bundled().text
    return {"lr": config.training.lr, "batch_size": config.training.batch_size,
            "seed": config.training.seed, "microbatches": config.parallel.microbatches,
            "data": "bundled:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]}


def saved_model(config: TrainConfig) -> dict[str, object]:
    """The model options a checkpoint records: as given, with the layer count resolved (no
    ``--layers`` means two blocks a stage), so that spellings of one model compare equal."""
    return {**dataclasses.asdict(config.model), "layers": config.num_layers}


def expected_layout(config: TrainConfig, stage_ranks: tuple[int, ...]) -> Layout:
    """Which stages each global rank of ``config``'s job holds (pipeline rank major, as the
    device mesh lays out replicas), ``stage_ranks`` being the schedule's rank of each stage."""
    dp = config.parallel.dp
    return Layout(len(stage_ranks), tuple(
        tuple(stage for stage, rank in enumerate(stage_ranks) if rank == world_rank // dp)
        for world_rank in range(config.parallel.world)))
