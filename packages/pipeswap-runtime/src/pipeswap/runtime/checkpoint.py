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

``pipeswap.json`` holds the step, the data position and the layout (which stages each global
rank held). A save writes into ``step-N.tmp`` and rank 0 renames it to ``step-N`` once every
rank's data and the manifest are written, so a crash mid-save leaves nothing that loads. The
``keep`` newest checkpoints up to the one just saved stay and older ones are removed; those of
later steps (left by a run that was resumed from before them) stay too, and saving a step
that has a checkpoint replaces it.

DCP exchanges its save and load plans with torch's object collectives, which need numpy (a
dependency of this package for that reason).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from pipeswap.runtime.errors import PipelineError

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.state_dict import (
        OptimizerStateType,
        StateDictOptions,
        ValueType,
    )

    from pipeswap.runtime.stage import PipelineStage

MANIFEST = "pipeswap.json"
LATEST = "latest"
_NAME = re.compile(r"step-(\d+)")

T = TypeVar("T")


class CheckpointError(PipelineError):
    """A checkpoint could not be saved, is missing, or does not fit this job; raised on every
    rank alike."""


@dataclass(frozen=True)
class ResumePoint:
    """Where a loaded run stands: ``step`` steps done (the next is ``step + 1``), and
    ``data_position`` batches consumed (skip that many)."""

    step: int
    data_position: int
    path: Path  # the checkpoint loaded


@dataclass(frozen=True)
class _Layout:
    """Which stages each global rank holds: a checkpoint fits only the layout it was saved
    with, as every key and shard belongs to one rank."""

    num_stages: int
    stages: tuple[tuple[int, ...], ...]  # per global rank, its stage indices

    def describe(self) -> str:
        ranks = [f"rank {rank}: stage{'s' * (len(s) > 1)} {', '.join(map(str, s))}"
                 for rank, s in enumerate(self.stages)]
        return f"{len(self.stages)} ranks and {self.num_stages} stages ({_some(ranks, 8, '; ')})"


@dataclass(frozen=True)
class _Manifest:
    step: int
    data_position: int
    layout: _Layout

    def dumps(self) -> str:
        return json.dumps({"step": self.step, "data_position": self.data_position,
                           "num_stages": self.layout.num_stages,
                           "stages": [list(s) for s in self.layout.stages]}, indent=1)

    @staticmethod
    def read(path: Path) -> _Manifest:
        data = json.loads((path / MANIFEST).read_text("utf-8"))
        return _Manifest(data["step"], data["data_position"],
                         _Layout(data["num_stages"], tuple(tuple(s) for s in data["stages"])))


@dataclass(frozen=True)
class _Found:
    """The checkpoint to load, as rank 0 read it: its manifest, and each saved key's global
    shape (None for a key that is not a tensor)."""

    path: Path
    manifest: _Manifest
    shapes: dict[str, tuple[int, ...] | None]


# -- finding checkpoints --------------------------------------------------------------------


def checkpoint_path(directory: str | os.PathLike[str], step: int) -> Path:
    """Where :func:`save_checkpoint` puts the checkpoint of ``step`` in ``directory``."""
    return Path(directory) / f"step-{step:08d}"


def latest_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The checkpoint to resume from: ``directory`` itself if it is one, else the one its
    ``latest`` file names, else its complete checkpoint of the highest step; None if none."""
    root = Path(directory)
    if _complete(root):
        return root
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text("utf-8").strip()
        if _complete(named):
            return named
    done = _checkpoints(root)
    return done[-1][1] if done else None


def saved_step(directory: str | os.PathLike[str]) -> int | None:
    """The step of the checkpoint :func:`latest_checkpoint` finds; None if there is none."""
    path = latest_checkpoint(directory)
    return None if path is None else _Manifest.read(path).step


def _complete(path: Path) -> bool:
    """Whether ``path`` is a whole checkpoint: the manifest is written last, before the
    rename that gives it its name."""
    return _NAME.fullmatch(path.name) is not None and (path / MANIFEST).is_file()


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``root``, by step."""
    if not root.is_dir():
        return []
    return sorted((int(match.group(1)), path) for path in root.iterdir()
                  if (match := _NAME.fullmatch(path.name)) and _complete(path))


# -- saving ---------------------------------------------------------------------------------


def save_checkpoint(directory: str | os.PathLike[str], *, step: int,
                    stages: Sequence[PipelineStage], optimizer: torch.optim.Optimizer,
                    data_position: int, keep: int = 2) -> Path:
    """Save this job's state after ``step`` steps, having consumed ``data_position`` batches,
    into ``directory``; every rank calls it, with its own stages and optimizer (over those
    stages' parameters). Returns the checkpoint's path. ``keep``: how many checkpoints up to
    this one stay in ``directory``."""
    from torch.distributed.checkpoint.state_dict_saver import save

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
    final = checkpoint_path(root, step)
    staging = final.with_name(final.name + ".tmp")
    _on_rank0(lambda: _prepare(root, staging), f"preparing {staging}")
    save(_state(stages, optimizer).flat(), checkpoint_id=staging)
    manifest = _Manifest(step, data_position, layout)
    _on_rank0(lambda: _commit(root, staging, final, manifest, keep), f"committing {final}")
    return final


def _prepare(root: Path, staging: Path) -> None:
    """An empty staging directory; what crashed saves left behind is removed."""
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("step-*.tmp"):
        shutil.rmtree(stale)
    staging.mkdir()


def _commit(root: Path, staging: Path, final: Path, manifest: _Manifest, keep: int) -> None:
    """Make the staged checkpoint the latest: manifest, rename, pointer, then pruning."""
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
    older = [path for step, path in _checkpoints(root) if step <= manifest.step]
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
    """Restore the model, the optimizer and this rank's random generators from the latest
    checkpoint in ``directory`` (or from ``directory``, a checkpoint itself); every rank calls
    it. Raises :class:`CheckpointError` on every rank when there is none or it was saved by
    a job laid out otherwise."""
    from torch.distributed.checkpoint.state_dict_loader import load

    found = _on_rank0(lambda: _find(Path(directory)), f"reading a checkpoint from {directory}")
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
    return ResumePoint(found.manifest.step, found.manifest.data_position, found.path)


def _find(root: Path) -> _Found:
    """The checkpoint to load, read on rank 0."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = latest_checkpoint(root)
    if path is None:
        where = "does not exist" if not root.exists() else "holds no complete checkpoint"
        raise CheckpointError(
            f"no checkpoint to resume from: {root} {where} (a save cut short leaves only a "
            "step-N.tmp directory, which never loads); give the directory an earlier run "
            "saved its checkpoints into, or one of its step-N directories, or start afresh")
    metadata = FileSystemReader(path).read_metadata().state_dict_metadata
    shapes = {key: tuple(md.size) if isinstance(md, TensorStorageMetadata) else None
              for key, md in metadata.items()}
    return _Found(path, _Manifest.read(path), shapes)


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
    return [f"{what}: {_some(keys)}" for what, keys in
            (("not in the checkpoint", missing), ("saved but not in this model", extra),
             ("shapes differ", shapes)) if keys]


def _some(items: Sequence[str], shown: int = 3, separator: str = ", ") -> str:
    """The first ``shown`` of ``items``, and how many more there are."""
    more = len(items) - shown
    return separator.join(items[:shown]) + (f" and {more} more" if more > 0 else "")


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
                   ) -> tuple[_Layout, list[T]]:
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
    layout = _Layout(max(num for num, _, _ in gathered), tuple(s for _, s, _ in gathered))
    return layout, [e for _, _, e in gathered]


def _on_rank0(action: Callable[[], T], what: str) -> T:
    """Run ``action`` on rank 0 alone and give its result to every rank; if it fails, every
    rank raises its error rather than waiting for rank 0 in the next collective."""
    import torch.distributed as dist

    outcome: list[Any] = [None]  # Any: rank 0's pickled (ok, result or message)
    if dist.get_rank() == 0:
        try:
            outcome[0] = (True, action())
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            message = str(exc) if isinstance(exc, CheckpointError) else (
                f"{what} failed on rank 0: {type(exc).__name__}: {exc}")
            outcome[0] = (False, message)
    dist.broadcast_object_list(outcome, src=0)
    ok, value = outcome[0]
    if not ok:
        raise CheckpointError(value)
    result: T = value
    return result
