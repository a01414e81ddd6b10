"""The swap session of one executor step: group names, forward collection, and clean-up."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pipeswap.schedule import ChunkKey
from pipeswap.swap import SwapManager
from pipeswap.swap import LayerChain


class SwapSession:
    """Names one swap group per (run, stage, microbatch), or one per layer for a chunk that
    streams (:meth:`stream`), and closes them all at the end.

    The executor enters a chunk's group only around that chunk's forward (and its loss), so
    nothing else lands in it. :meth:`close` runs in ``finally``: after it, no group of this
    run is alive, no transfer is in flight and every host buffer is back in the pool.
    """

    def __init__(self, manager: SwapManager, run: str) -> None:
        self.manager = manager
        self.run = run  # unique among the runs sharing the manager
        self._names: dict[ChunkKey, str] = {}
        self._chains: dict[ChunkKey, LayerChain] = {}

    def stream(self, key: ChunkKey, layers: int, lag: int) -> LayerChain:
        """The chunk's per-layer groups, for an SO step (before its forward)."""
        names = [f"{self.name(key)}.l{index}" for index in range(layers)]
        chain = self._chains[key] = LayerChain(self.manager, names, lag)
        return chain

    def chain(self, key: ChunkKey) -> LayerChain | None:
        """The chunk's per-layer groups, if it streams."""
        return self._chains.get(key)

    def name(self, key: ChunkKey) -> str:
        name = self._names.get(key)
        if name is None:
            name = self._names[key] = f"{self.run}.s{key[0]}.m{key[1]}"
        return name

    @contextmanager
    def forward(self, key: ChunkKey) -> Iterator[None]:
        chain = self._chains.get(key)
        with chain.forward() if chain is not None else self.manager.group_context(
                self.name(key)):
            yield

    def protect(self, key: ChunkKey, tensors: object) -> None:
        """Keep storages shared with ``tensors`` (boundary inputs, outputs, targets) on the
        device, in the groups the chunk's forward saves into now or later; None entries are
        skipped."""
        chain = self._chains.get(key)
        if chain is not None:
            chain.protect(tensors)
        else:
            self.manager.protect_alias_tensors(self.name(key), tensors)

    def names(self, key: ChunkKey) -> tuple[str, ...]:
        """The chunk's group names: one per layer if it streams, else one."""
        chain = self._chains.get(key)
        return chain.names if chain is not None else (self.name(key),)

    def release_remade(self, key: ChunkKey) -> None:
        """The chunk's recomputed layers are done with (after its I, which computed their
        weight gradients too): what they keep and what their recomputes left goes."""
        for name in self.names(key):
            self.manager.release_remade(name)

    def finish(self, key: ChunkKey) -> None:
        """The chunk's backward is complete: forget its group (or groups)."""
        chain = self._chains.pop(key, None)
        if chain is not None:
            chain.finish()
        else:
            self.manager.finish_group(self._names[key])
        del self._names[key]

    def close(self) -> None:
        """Abort every group still alive; all are tried, then the first failure raises."""
        errors = []
        aborts = [*(chain.abort for chain in self._chains.values()),
                  *(lambda name=name: self.manager.abort_group(name)
                    for key, name in self._names.items() if key not in self._chains)]
        for abort in aborts:
            try:
                abort()
            except Exception as exc:  # noqa: BLE001 - the others still need aborting
                errors.append(exc)
        self._names.clear()
        self._chains.clear()
        if errors:
            raise errors[0]
