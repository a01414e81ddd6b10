"""The swap session of one executor step: group names, forward collection, and clean-up."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from pipeswap.schedule import ChunkKey
from pipeswap.swap import SwapManager

if TYPE_CHECKING:
    import torch


class SwapSession:
    """Names one swap group per (run, stage, microbatch) and closes them all at the end.

    The executor enters a chunk's group only around that chunk's forward (and its loss), so
    nothing else lands in it. :meth:`close` runs in ``finally``: after it, no group of this
    run is alive, no transfer is in flight and every host buffer is back in the pool.
    """

    def __init__(self, manager: SwapManager, run: str) -> None:
        self.manager = manager
        self.run = run  # unique among the runs sharing the manager
        self._names: dict[ChunkKey, str] = {}

    def name(self, key: ChunkKey) -> str:
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = f"{self.run}.s{key[0]}.m{key[1]}"
        return name

    @contextmanager
    def forward(self, key: ChunkKey) -> Iterator[None]:
        with self.manager.group_context(self.name(key)):
            yield

    def protect(self, key: ChunkKey, tensors: Any) -> None:
        """Keep storages shared with ``tensors`` (boundary inputs, outputs, targets) on the
        device; None entries are skipped."""
        self.manager.protect_alias_tensors(self.name(key), tensors)

    def finish(self, key: ChunkKey) -> None:
        """The chunk's backward is complete: forget its group."""
        self.manager.finish_group(self._names[key])
        del self._names[key]

    def close(self) -> None:
        """Abort every group still alive; all are tried, then the first failure raises."""
        errors = []
        for name in self._names.values():
            try:
                self.manager.abort_group(name)
            except Exception as exc:  # noqa: BLE001 - the others still need aborting
                errors.append(exc)
        self._names.clear()
        if errors:
            raise errors[0]
