"""Checkpoints of a pipeline training run with torch.distributed.checkpoint (DCP), from which
a resumed run continues exactly where the saved one stood.

Every rank of the job calls :func:`save_checkpoint` and :func:`load_checkpoint` together. One
DCP checkpoint holds every rank's state under keys unique across the pipeline:

- ``model.stage<i>.<name>``: the parameters and buffers of stage ``i`` (FSDP2 shards saved
  as DTensors, each replica writing its own shard),
- ``optim.state.stage<i>.<name>.<exp_avg|exp_avg_sq|step>`` and
  ``optim.param_groups.stage<i>.<name>.<lr|betas|...>``: the optimizer's state per parameter
  (``flatten_optimizer_state_dict``, so that pipeline ranks never write the same key),
- ``rng.rank<r>.cpu`` (and ``.cuda``): the random generators of global rank ``r``.

On disk, a checkpoint directory given to :func:`save_checkpoint` holds::

    DIR/latest                the name of the newest complete checkpoint ("step-00000004")
    DIR/step-00000002/        a complete checkpoint: DCP's files and pipeswap.json
    DIR/step-00000004/
    DIR/step-00000006.tmp/    a save in progress, or one a crash interrupted: never loaded

``pipeswap.json``, the manifest (:mod:`pipeswap.runtime.checkpoint.manifest`), holds the
step, the data position, the layout (which stages each global rank held), the saving job's
description, and every other file's size and SHA-256, taken as each rank wrote its files.
:func:`load_checkpoint` loads the newest checkpoint whose files all verify, every rank
checking a share of them, and says which newer ones it skipped and why. A save writes into
``step-N.tmp`` and rank 0 renames it to ``step-N`` once every rank's data and the manifest
are written, so a crash mid-save leaves nothing that loads. The ``keep`` newest checkpoints
up to the one just saved stay and older ones are removed; those of later steps (left by a
run that was resumed from before them) stay too, and saving a step that has a checkpoint
replaces it.

DCP exchanges its save and load plans with torch's object collectives, which need numpy (a
dependency of this package for that reason).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pipeswap.runtime.checkpoint.manifest import (
    LATEST,
    MANIFEST,
    Layout,
    FileSum,
    Manifest,
    candidates,
    checkpoint_path,
    checkpoints,
    examine,
    file_sum,
    latest_checkpoint,
    no_checkpoint,
    some,
)
from pipeswap.runtime.errors import CheckpointError, CheckpointIOError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        OptimizerStateType,
        StateDictOptions,
        ValueType,
    )

    from pipeswap.runtime.executor.stage import PipelineStage

__all__ = ["LATEST", "MANIFEST", "CheckpointError", "ResumePoint", "checkpoint_path",
           "latest_checkpoint", "load_checkpoint", "save_checkpoint"]

T = TypeVar("T")


@dataclass(frozen=True)
class ResumePoint:
    """Where a loaded run stands: ``step`` steps done (the next is ``step + 1``), and
    ``data_position`` batches consumed (skip that many); ``skipped``: newer checkpoints that
    did not verify, each with why (the caller says so: this function prints nothing)."""

    step: int
    data_position: int
    path: Path  # the checkpoint loaded
    job: Mapping[str, object] = field(default_factory=dict)  # as given to save_checkpoint
    skipped: tuple[tuple[Path, str], ...] = ()


@dataclass(frozen=True)
class _Found:
    """The checkpoint to load: its manifest, each saved key's global shape (None for a key
    that is not a tensor), and the newer checkpoints that did not verify."""

    path: Path
    manifest: Manifest
    shapes: dict[str, tuple[int, ...] | None]
    skipped: tuple[tuple[Path, str], ...]


# -- saving ---------------------------------------------------------------------------------


def save_checkpoint(directory: str | os.PathLike[str], *, step: int,
                    stages: Sequence[PipelineStage], optimizer: torch.optim.Optimizer,
                    data_position: int, keep: int = 2,
                    job: Mapping[str, object] | None = None) -> Path:
    """Save this job's state after ``step`` steps, having consumed ``data_position`` batches,
    into ``directory``; every rank calls it, with its own stages and optimizer (over those
    stages' parameters). Returns the checkpoint's path. ``keep``: how many checkpoints up to
    this one stay in ``directory``. ``job``: a JSON-able description of the run (its model's
    options, say), kept in the manifest so that a resuming job can be checked against it
    before it starts. (:func:`~pipeswap.runtime.checkpoint.background.save_in_background`
    writes the same checkpoint while training goes on.)"""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import save

    from pipeswap.runtime.checkpoint.hashing_writer import digesting_writer

    begun = begin_save(directory, step=step, stages=stages, optimizer=optimizer,
                       data_position=data_position, keep=keep, job=job)
    writer, sums, refused = digesting_writer(begun.staging)
    try:
        save(state_of(stages, optimizer), storage_writer=writer)
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        if not refused:
            raise
        raise begun.refused(refused[0]) from exc
    return finish_save(begun, sums, None)


@dataclass(frozen=True)
class BegunSave:
    """A save whose staging directory is ready: where it goes and what its manifest says."""

    root: Path
    staging: Path
    final: Path
    step: int
    data_position: int
    layout: Layout
    keep: int
    job: Mapping[str, object]

    def refused(self, why: str) -> CheckpointIOError:
        return CheckpointIOError(
            f"saving step {self.step} into {self.staging} failed: {why}: free space on that "
            "disk, or save elsewhere")


def begin_save(directory: str | os.PathLike[str], *, step: int,
               stages: Sequence[PipelineStage], optimizer: torch.optim.Optimizer,
               data_position: int, keep: int, job: Mapping[str, object] | None) -> BegunSave:
    """Check what every rank saves and prepare the staging directory (every rank, on the
    default group)."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1 (the checkpoint just saved), got {keep}")
    root = Path(directory)
    layout, views = _gather_layout(stages, ((step, data_position), bool(optimizer.state)))
    positions = [position for position, _ in views]
    if len(set(positions)) > 1 or min(min(position) for position in positions) < 0:
        raise CheckpointError(
            "save_checkpoint needs the same step and data_position on every rank, neither "
            f"below 0; got (step, data_position) per rank {positions}: call it on every "
            "rank after the same step")
    if not all(stepped for _, stepped in views):
        # torch's state-dict API would create the state with a step of its own, which
        # changes how the run goes on
        raise CheckpointError("the optimizer holds no state yet: save after its first step")
    try:
        json.dumps(dict(job or {}))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"job= must be JSON-able (it goes into the manifest): {exc}") \
            from None
    final = checkpoint_path(root, step)
    staging = final.with_name(final.name + ".tmp")
    _on_rank0(lambda: _prepare(root, staging), f"preparing {staging}")
    return BegunSave(root, staging, final, step, data_position, layout, keep, dict(job or {}))


def finish_save(begun: BegunSave, sums: Mapping[str, FileSum], failed: str | None,
                group: dist.ProcessGroup | None = None) -> Path:
    """Every rank's file sums (or why its write failed) to rank 0, which commits the
    checkpoint; over ``group`` (a background save's own)."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size(group)  # Any: each rank's pickled part
    dist.all_gather_object(every, (dict(sums), failed), group=group)
    problems = [problem for _, problem in every if problem is not None]
    if problems:
        raise begun.refused(problems[0])
    files = {name: value for rank_sums, _ in every for name, value in rank_sums.items()}
    manifest = Manifest(begun.step, begun.data_position, begun.layout, files, dict(begun.job))
    _on_rank0(lambda: _commit(begun.root, begun.staging, begun.final, manifest, begun.keep),
              f"committing {begun.final}", group)
    return begun.final


def state_of(stages: Sequence[PipelineStage], optimizer: torch.optim.Optimizer
             ) -> dict[str, object]:
    """What a checkpoint saves of ``stages`` and ``optimizer``, flat, under keys unique
    across the pipeline."""
    return _state(stages, optimizer).flat()


def _prepare(root: Path, staging: Path) -> None:
    """An empty staging directory; what crashed saves left behind is removed."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("step-*.tmp"):
        shutil.rmtree(stale)
    staging.mkdir()


def _commit(root: Path, staging: Path, final: Path, manifest: Manifest, keep: int) -> None:
    """Make the staged checkpoint the latest: manifest, rename, pointer, then pruning."""
    written = {entry.name: entry.stat().st_size for entry in staging.iterdir()}
    sums = dict(manifest.files)
    for name, size in written.items():
        if name not in sums or sums[name].size != size:
            # a file this torch's DCP wrote other than through its file system's streams:
            # its sum comes from the disk instead
            sums[name] = file_sum(staging / name)
    manifest = Manifest(manifest.step, manifest.data_position, manifest.layout,
                        {name: sums[name] for name in written}, manifest.job)
    _write_synced(staging / MANIFEST, manifest.dumps())
    if final.exists():  # the same step saved again (a run resumed from before it)
        displaced = final.with_name(final.name + ".replaced.tmp")
        final.rename(displaced)
        staging.rename(final)
        shutil.rmtree(displaced)
    else:
        staging.rename(final)
    pointer = root / (LATEST + ".tmp")
    _write_synced(pointer, final.name + "\n")
    pointer.replace(root / LATEST)
    older = [path for step, path in checkpoints(root) if step <= manifest.step]
    for path in older[:-keep]:
        shutil.rmtree(path)


def _write_synced(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


# -- loading --------------------------------------------------------------------------------


def load_checkpoint(directory: str | os.PathLike[str], *, stages: Sequence[PipelineStage],
                    optimizer: torch.optim.Optimizer) -> ResumePoint:
    """Restore the model, the optimizer and this rank's random generators from the newest
    checkpoint in ``directory`` that verifies (or from ``directory``, a checkpoint itself);
    every rank calls it. Raises :class:`CheckpointError` on every rank when none verifies or
    it was saved by a job laid out otherwise."""
    from torch.distributed.checkpoint.state_dict_loader import load

    found = _find(Path(directory))
    layout, _ = _gather_layout(stages, None)
    if layout != found.manifest.layout:
        raise CheckpointError(
            f"checkpoint {found.path} was saved by a job of {found.manifest.layout.describe()}, "
            f"but this job has {layout.describe()}: resume with the layout it was saved with "
            "(the same pipeline ranks, replicas, stages per rank and schedule), or start "
            "afresh in another directory")
    state = _state(stages, optimizer)
    flat = state.flat()
    _check_keys(found, flat, [stage.stage_index for stage in stages])
    load(flat, checkpoint_id=found.path)
    state.restore(flat, optimizer)
    manifest = found.manifest
    return ResumePoint(manifest.step, manifest.data_position, found.path, manifest.job,
                       found.skipped)


def _find(root: Path) -> _Found:
    """The newest checkpoint in ``root`` that verifies: every rank reads its manifest and
    checks its share of the files, and all agree on the verdict."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    paths = _on_rank0(lambda: candidates(root), f"listing the checkpoints in {root}")
    skipped: list[tuple[Path, str]] = []
    for path in paths:
        manifest, problems = examine(path, lambda index: index % world == rank)
        every: list[Any] = [None] * world  # Any: each rank's pickled list of problems
        dist.all_gather_object(every, problems)
        found = sorted({line for lines in every for line in lines})
        if found or manifest is None:
            skipped.append((path, some(found, separator="; ")))
            continue
        shapes = _on_rank0(lambda: _shapes(path), f"reading {path}")
        return _Found(path, manifest, shapes, tuple(skipped))
    raise no_checkpoint(root, skipped)


def _shapes(path: Path) -> dict[str, tuple[int, ...] | None]:
    """Each key DCP saved in ``path``, with its global shape (None for a non-tensor)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    return {key: tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
            for key, md in metadata.items()}


def _check_keys(found: _Found, mine: Mapping[str, object], indices: Sequence[int]) -> None:
    """Every key this rank loads is saved with its shape, and nothing saved for its stages is
    left behind; the problems of every rank raise on every rank."""
    import torch.distributed as dist

    problems = _key_problems(found.shapes, mine, indices)
    gathered: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(gathered, problems)
    lines = [f"rank {rank}: {line}" for rank, lines in enumerate(gathered) for line in lines]
    if lines:
        raise CheckpointError(
            f"checkpoint {found.path} does not fit this model, though its stages sit on the "
            "same ranks: " + "; ".join(lines) + ". Build the model and optimizer as the saved "
            "run did (the same width, layers, vocabulary, optimizer and device), or start "
            "afresh")


def _key_problems(saved: Mapping[str, tuple[int, ...] | None], mine: Mapping[str, object],
                  indices: Sequence[int]) -> list[str]:
    import torch

    missing = sorted(key for key in mine if key not in saved)
    prefixes = tuple(f"{part}stage{index}." for index in indices
                     for part in ("model.", "optim.state.", "optim.param_groups."))
    extra = sorted(key for key in saved if key.startswith(prefixes) and key not in mine)
    shapes = [f"{key} saved {list(shape)}, here {list(value.shape)}"
              for key, value in sorted(mine.items())
              if isinstance(value, torch.Tensor) and (shape := saved.get(key)) is not None
              and shape != tuple(value.shape)]
    return [f"{what}: {some(keys)}" for what, keys in
            (("not in the checkpoint", missing), ("saved but not in this model", extra),
             ("shapes differ", shapes)) if keys]


# -- what a checkpoint holds ----------------------------------------------------------------


@dataclass(frozen=True)
class _State:
    """This rank's part of a checkpoint, as DCP state dicts over its stages."""

    wrapper: torch.nn.Module  # this rank's stage modules, named stage<i>
    model: dict[str, ValueType]
    optim: OptimizerStateType
    rng: dict[str, torch.Tensor]

    def flat(self) -> dict[str, object]:
        """One flat state dict; DCP loads tensors in place and replaces other values."""
        return {**_prefixed("model.", self.model), **_prefixed("optim.", self.optim),
                **_prefixed("rng.", self.rng)}

    def restore(self, flat: Mapping[str, object], optimizer: torch.optim.Optimizer) -> None:
        """Put what DCP loaded into ``flat`` (made by :meth:`flat`, so each part holds what
        its state dict held) into the stages, optimizer and generators."""
        import torch
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        set_model_state_dict(self.wrapper,
                             cast("dict[str, ValueType]", _unprefixed("model.", flat)))
        set_optimizer_state_dict(self.wrapper, optimizer,
                                 cast("OptimizerStateType", _unprefixed("optim.", flat)),
                                 options=_options())
        rng = cast("dict[str, torch.Tensor]", _unprefixed("rng.", flat))
        rank = _rank_key()
        torch.set_rng_state(rng[f"{rank}.cpu"])
        if f"{rank}.cuda" in rng:
            torch.cuda.set_rng_state(rng[f"{rank}.cuda"])


def _state(stages: Sequence[PipelineStage], optimizer: torch.optim.Optimizer) -> _State:
    import torch
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    wrapper = torch.nn.ModuleDict({f"stage{s.stage_index}": s.module for s in stages})
    rank = _rank_key()
    rng = {f"{rank}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng[f"{rank}.cuda"] = torch.cuda.get_rng_state()
    return _State(wrapper, get_model_state_dict(wrapper),
                  get_optimizer_state_dict(wrapper, optimizer, options=_options()), rng)


def _options() -> StateDictOptions:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # one key per parameter and setting, so that no two pipeline ranks write the same key
    return StateDictOptions(flatten_optimizer_state_dict=True)


def _rank_key() -> str:
    import torch.distributed as dist

    return f"rank{dist.get_rank()}"


def _prefixed(prefix: str, values: Mapping[str, T]) -> dict[str, T]:
    return {prefix + key: value for key, value in values.items()}


def _unprefixed(prefix: str, values: Mapping[str, T]) -> dict[str, T]:
    return {key.removeprefix(prefix): value for key, value in values.items()
            if key.startswith(prefix)}


# -- agreeing across ranks ------------------------------------------------------------------


def _gather_layout(stages: Sequence[PipelineStage], extra: T
                   ) -> tuple[Layout, list[T]]:
    """The job's layout, and every rank's ``extra``, the same on every rank."""
    import torch.distributed as dist

    mine = (max((s.num_stages for s in stages), default=0),
            tuple(sorted(s.stage_index for s in stages)), extra)
    gathered: list[Any] = [None] * dist.get_world_size()  # Any: every rank's pickled tuple
    dist.all_gather_object(gathered, mine)
    empty = [rank for rank, (_, indices, _) in enumerate(gathered) if not indices]
    if empty:
        raise CheckpointError(f"rank{'s' * (len(empty) > 1)} {', '.join(map(str, empty))} "
                              "gave no stages: give every rank its PipelineStage objects")
    layout = Layout(max(num for num, _, _ in gathered), tuple(s for _, s, _ in gathered))
    return layout, [e for _, _, e in gathered]


def _on_rank0(action: Callable[[], T], what: str,
              group: dist.ProcessGroup | None = None) -> T:
    """Run ``action`` on rank 0 of ``group`` alone and give its result to every rank; if it
    fails, every rank raises its error rather than waiting for rank 0 in the next collective
    (a :class:`CheckpointIOError` for anything but a :class:`CheckpointError`)."""
    import torch.distributed as dist

    outcome: list[Any] = [None]  # Any: rank 0's pickled (ok, result or message, on disk)
    if dist.get_rank(group) == 0:
        try:
            outcome[0] = (True, action(), False)
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            ours = isinstance(exc, CheckpointError)
            message = str(exc) if ours else (
                f"{what} failed on rank 0: {type(exc).__name__}: {exc}")
            outcome[0] = (False, message, not ours)
    dist.broadcast_object_list(outcome, group_src=0, group=group)
    ok, value, on_disk = outcome[0]
    if not ok:
        raise (CheckpointIOError if on_disk else CheckpointError)(value)
    result: T = value
    return result
