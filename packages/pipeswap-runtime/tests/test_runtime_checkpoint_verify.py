"""Checkpoints verify before they load: every file's SHA-256, taken as DCP wrote it, is in a
manifest that checksums itself, and a byte changed anywhere, a file cut short, emptied,
removed or added refuses that checkpoint, naming the file, without touching the model. A
job resumes from the newest checkpoint that verifies and says which it skipped."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeswap.runtime import CheckpointError, PipelineStage, load_checkpoint, save_checkpoint
from pipeswap.runtime.checkpoint import MANIFEST, checkpoint_path
from pipeswap.runtime.checkpoint.manifest import file_sum, newest_verified, read_manifest


def _stage_and_optimizer(seed: int) -> tuple[PipelineStage, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    module(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    return PipelineStage(module, 0, 1), optimizer


def _save(directory: Path, step: int, seed: int) -> Path:
    stage, optimizer = _stage_and_optimizer(seed)
    return save_checkpoint(directory, step=step, stages=[stage], optimizer=optimizer,
                           data_position=step, job={"model": {"width": 8}})


def _weights(stage: PipelineStage) -> list[torch.Tensor]:
    return [p.detach().clone() for p in stage.module.parameters()]


def test_the_manifest_holds_every_file_as_written(group: None, tmp_path: Path) -> None:
    path = _save(tmp_path, step=1, seed=0)
    manifest = read_manifest(path)
    files = {entry.name for entry in path.iterdir()} - {MANIFEST}
    assert set(manifest.files) == files and ".metadata" in files
    for name, saved in manifest.files.items():
        assert file_sum(path / name) == saved  # the sums taken while writing match the disk
    assert manifest.job == {"model": {"width": 8}}
    assert (manifest.step, manifest.data_position) == (1, 1)


def _flip(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset % len(data)] ^= 0x20
    file.write_bytes(bytes(data))


def _kinds(path: Path) -> list[str]:
    return sorted(entry.name for entry in path.iterdir())


@pytest.mark.parametrize("where", [0, 1, 0.5, -1])  # first, second, middle and last byte
def test_a_byte_flipped_in_any_file_refuses_the_checkpoint_and_names_it(
        group: None, tmp_path: Path, where: float) -> None:
    saved = _save(tmp_path / "saved", step=1, seed=0)
    names = _kinds(saved)
    assert len(names) == 3  # .metadata, the rank's data file, the manifest
    for name in names:
        copy = tmp_path / name.strip(".") / saved.name
        shutil.copytree(saved, copy)
        size = (copy / name).stat().st_size
        _flip(copy / name, int(where * size) if isinstance(where, float) else where)
        stage, optimizer = _stage_and_optimizer(seed=99)
        before = _weights(stage)
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(copy, stages=[stage], optimizer=optimizer)
        assert name in str(caught.value) and "verifies" in str(caught.value)
        assert all(torch.equal(a, b) for a, b in zip(before, _weights(stage)))  # untouched


@pytest.mark.parametrize("damage", ["truncate", "empty", "remove", "add"])
def test_a_file_cut_short_emptied_removed_or_added_refuses_it(
        group: None, tmp_path: Path, damage: str) -> None:
    path = _save(tmp_path, step=1, seed=0)
    data = next(entry for entry in path.iterdir() if entry.suffix == ".distcp")
    if damage == "truncate":
        data.write_bytes(data.read_bytes()[:-7])
        expected = f"{data.name}: {data.stat().st_size} bytes"
    elif damage == "empty":
        data.write_bytes(b"")
        expected = f"{data.name}: 0 bytes"
    elif damage == "remove":
        data.unlink()
        expected = f"{data.name}: missing"
    else:
        (path / "stray.bin").write_bytes(b"x")
        expected = "stray.bin: not one of the files saved"
    with pytest.raises(CheckpointError, match=expected):
        newest_verified(tmp_path)
    stage, optimizer = _stage_and_optimizer(seed=99)
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(tmp_path, stages=[stage], optimizer=optimizer)


def test_a_changed_manifest_value_is_refused(group: None, tmp_path: Path) -> None:
    path = _save(tmp_path, step=1, seed=0)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["step"] = 7  # valid JSON, another step: the manifest's own checksum tells
    (path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="changed after it was written"):
        newest_verified(tmp_path)
    (path / MANIFEST).write_text("[1, 2")
    with pytest.raises(CheckpointError, match="cannot be read as JSON"):
        newest_verified(tmp_path)


def test_resume_takes_the_newest_that_verifies_and_names_those_skipped(
        group: None, tmp_path: Path) -> None:
    _save(tmp_path, step=1, seed=1)
    newest = _save(tmp_path, step=2, seed=2)
    wanted, _ = _stage_and_optimizer(seed=1)
    _flip(next(newest.glob("*.distcp")), 100)
    stage, optimizer = _stage_and_optimizer(seed=99)
    point = load_checkpoint(tmp_path, stages=[stage], optimizer=optimizer)
    assert point.path == checkpoint_path(tmp_path, 1) and point.step == 1
    assert [path for path, _ in point.skipped] == [newest]
    assert "checksum differs" in point.skipped[0][1]
    assert all(torch.equal(a, b) for a, b in zip(_weights(wanted), _weights(stage)))


def test_each_file_is_hashed_as_it_is_written(group: None, tmp_path: Path) -> None:
    """The sums come from the writer's streams, not from reading the files back."""
    from torch.distributed.checkpoint.state_dict_saver import save

    from pipeswap.runtime.checkpoint.hashing_writer import digesting_writer

    writer, sums, refused = digesting_writer(tmp_path)
    save({"w": torch.arange(1000.0), "n": 3}, storage_writer=writer)
    assert set(sums) == {entry.name for entry in tmp_path.iterdir()}  # .metadata as renamed
    assert all(file_sum(tmp_path / name) == value for name, value in sums.items())
    assert refused == []


_DISK_REFUSES = """
import os, resource, signal, sys, datetime, torch, torch.distributed as dist
from pipeswap.runtime import PipelineStage
from pipeswap.runtime.errors import CheckpointIOError
from pipeswap.runtime.checkpoint import save_checkpoint
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
stage = PipelineStage(torch.nn.Linear(256, 256), 0, 1)
optimizer = torch.optim.SGD(stage.module.parameters(), lr=0.1, momentum=0.9)
stage.module(torch.ones(1, 256)).sum().backward()
optimizer.step()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.RLIM_INFINITY))
try:
    save_checkpoint(sys.argv[1], step=1, stages=[stage], optimizer=optimizer, data_position=1)
except CheckpointIOError as exc:
    print(exc)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGXFSZ"), reason="needs RLIMIT_FSIZE")
def test_a_write_the_disk_refuses_names_its_cause_and_file(tmp_path: Path) -> None:
    """A save the disk refuses (here a file-size limit, which fails a write as a full disk
    does) says why and which file, not torch's "unexpected pos" alone."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    done = subprocess.run([sys.executable, "-c", _DISK_REFUSES, str(tmp_path), str(port)],
                          capture_output=True, text=True, timeout=120, check=False)
    said = done.stdout.strip()
    assert said.startswith(f"saving step 1 into {tmp_path}/step-00000001.tmp failed: File "
                           "too large (writing "), (said, done.stderr[-2000:])
    assert said.endswith(".distcp): free space on that disk, or save elsewhere"), said
