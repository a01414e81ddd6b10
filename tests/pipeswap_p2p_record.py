"""Rank functions that record every point-to-point call a run makes, as NCCL would see it:
each operation posted inside ``batch_isend_irecv`` (on the group's communicator) or alone
(``isend``, ``irecv``, ``send``, ``recv``: on a communicator of the two ranks).

torch's ``P2POp`` accepts only torch's own ``isend``/``irecv``, and ``batch_isend_irecv``
tells them apart by identity, so the recording versions replace those functions under both
names (``torch.distributed`` and its ``distributed_c10d`` module) for the whole call.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from pipeswap.runtime.train import TrainConfig, run_rank

#: One posted operation: (group name, sending rank, receiving rank, tag, "batched"/"alone").
Record = tuple[str, int, int, int, str]

_NAMES = ("isend", "irecv", "send", "recv", "batch_isend_irecv")


@contextmanager
def recording() -> Iterator[list[Record]]:
    """Every point-to-point operation this process posts inside the block."""
    records: list[Record] = []
    inside = threading.local()
    originals = {name: getattr(c10d, name) for name in _NAMES}
    me = dist.get_rank()

    def note(group: Any, peer: int, tag: int, sends: bool, kind: str) -> None:
        name = c10d._group_or_default_group(group).group_name
        records.append((name, me, peer, tag, kind) if sends else (name, peer, me, tag, kind))

    def single(name: str) -> Callable[..., Any]:
        original = originals[name]
        signature = inspect.signature(original)
        peer_name = "dst" if "send" in name else "src"

        def call(*args: Any, **kwargs: Any) -> Any:
            if not getattr(inside, "batch", False):
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                given = bound.arguments
                group = c10d._group_or_default_group(given["group"])
                peer = given[peer_name]
                if peer is None:  # given by group rank
                    peer = dist.get_global_rank(group, given[f"group_{peer_name}"])
                note(group, peer, given["tag"], peer_name == "dst", "alone")
            return original(*args, **kwargs)
        return call

    def batch(ops: list[Any]) -> Any:
        for op in ops:
            note(op.group, op.peer, op.tag, op.op is c10d.isend, "batched")
        inside.batch = True
        try:
            return originals["batch_isend_irecv"](ops)
        finally:
            inside.batch = False

    replacements = {name: single(name) for name in _NAMES[:4]}
    replacements["batch_isend_irecv"] = batch
    for name, replacement in replacements.items():
        setattr(c10d, name, replacement)
        setattr(dist, name, replacement)
    try:
        yield records
    finally:
        for name, original in originals.items():
            setattr(c10d, name, original)
            setattr(dist, name, original)


def recorded(rank: int, world_size: int, fn: Callable[..., Any], *args: Any
             ) -> list[Record]:
    """The operations ``fn(rank, world_size, *args)`` posts."""
    with recording() as records:
        fn(rank, world_size, *args)
    return records


def train(rank: int, world_size: int, configs: list[TrainConfig]) -> None:
    """pipeswap-train's rank, for each config in turn."""
    for config in configs:
        run_rank(rank, world_size, config)
