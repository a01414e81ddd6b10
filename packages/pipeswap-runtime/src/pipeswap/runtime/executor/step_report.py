"""What one step did on a rank (:class:`StepReport`), and the memory accounting behind its
byte counts (:class:`MemoryAccount`).

The counts come from the swap manager, which sees every saved tensor of an accounted chunk;
the peaks fold in the FSDP parameters gathered at the time, at every change of them, so that
they equal the simulator's ``peak_memory_bytes`` byte for byte.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pipeswap.schedule import ChunkKey, StepType
from pipeswap.swap import GroupBytes

if TYPE_CHECKING:
    import torch

    from pipeswap.runtime.distributed.transport import PyTree
    from pipeswap.runtime.executor.swap_session import SwapSession
    from pipeswap.swap import SwapManager


@dataclass(frozen=True)
class StepReport:
    """What one :meth:`~pipeswap.runtime.executor.PipelineExecutor.step` did on this rank."""

    losses: tuple[float, ...]  # per microbatch, on the rank of the last stage; else empty
    seconds: float
    # most device bytes held by saved activations at once; None unless the executor
    # accounts every chunk (count_activations)
    peak_activation_bytes: int | None
    bytes_offloaded: int
    swapped_chunks: int
    # per chunk of this rank, at the end of its forward: device bytes its saved activations
    # hold, and the part an offload moves (the rest is shared with protected tensors)
    chunk_bytes: Mapping[ChunkKey, GroupBytes]
    # the most bytes the device allocator held at once during the step, above what it held
    # when the step began: everything the step allocated, not only saved activations (see
    # Platform.measure_allocations for what each platform counts); None unless the step ran
    # with Measure(allocator=True)
    peak_allocated_bytes: int | None = None
    # per chunk whose backward is split, right after its I: the device bytes its saved
    # activations still hold for W (I frees the rest)
    chunk_bytes_after_input: Mapping[ChunkKey, int] = field(default_factory=dict)
    # most device bytes held at once by saved activations and gathered FSDP parameters (each
    # sharded stage's full parameter bytes from its UNSHARD to its RESHARD): what the
    # simulator's peak_memory_bytes predicts; equal to peak_activation_bytes without FSDP;
    # None unless the executor accounts every chunk
    peak_memory_bytes: int | None = None
    # per chunk that streams, per layer when the layer closed: what its group held and
    # could move (chunk_bytes holds their sums)
    layer_bytes: Mapping[ChunkKey, tuple[GroupBytes, ...]] = field(default_factory=dict)
    # per chunk that streams and splits its backward, per layer right after its I
    layer_bytes_after_input: Mapping[ChunkKey, tuple[int, ...]] = field(default_factory=dict)
    # with Measure(compute=True): each compute's mean seconds by kind and stage (an overlap's time
    # shared between its two as the default costs weigh them), and the seconds compute
    # waited for copies (its WO and WL steps); empty and None otherwise
    compute_seconds: Mapping[tuple[StepType, int], float] = field(default_factory=dict)
    copy_wait_seconds: float | None = None
    # layer forwards run again in backwards (the schedule's RC steps), and per chunk with
    # recomputed layers, the device bytes each one's recompute made, by layer index
    recomputed_layers: int = 0
    remade_bytes: Mapping[ChunkKey, Mapping[int, int]] = field(default_factory=dict)
    # per chunk held whole (accounted, not streamed), per layer: the device bytes its
    # forward added to the chunk's group (a recomputed layer's: what it keeps; what the
    # forward saves before the first layer counts in the first, after the last in the
    # last), and the bytes of the storages the layer was called with
    layer_held: Mapping[ChunkKey, tuple[int, ...]] = field(default_factory=dict)
    layer_inputs: Mapping[ChunkKey, tuple[int, ...]] = field(default_factory=dict)
    # on the rank of the last stage: each microbatch's loss as a tensor (unscaled, detached)
    # and, where the step's Measure(outputs=True) asked, the last stage's outputs (detached)
    loss_tensors: tuple[torch.Tensor, ...] = field(default=(), compare=False, repr=False)
    outputs: tuple[PyTree, ...] = field(default=(), compare=False, repr=False)


@dataclass
class LayerMarks:
    """A chunk held whole, measured as its forward goes: its group, what the group held as
    each layer began, and the bytes of the storages each layer was called with."""

    group: str
    held: list[int] = field(default_factory=list)
    inputs: list[int] = field(default_factory=list)


@dataclass
class MemoryAccount:
    """One step's count of device memory: each accounted chunk's bytes, and the peaks of
    saved activations and of activations plus gathered FSDP parameters. Start it with
    :meth:`begin`."""

    manager: SwapManager
    # whether every chunk goes through the manager (else only swapped ones, and the peaks
    # are not reported)
    every_chunk: bool
    offloaded_before: int  # the manager's bytes_offloaded when the step began
    accounted: set[ChunkKey] = field(default_factory=set)  # chunks with a swap group
    chunk_bytes: dict[ChunkKey, GroupBytes] = field(default_factory=dict)
    chunk_bytes_after_input: dict[ChunkKey, int] = field(default_factory=dict)
    layer_bytes: dict[ChunkKey, tuple[GroupBytes, ...]] = field(default_factory=dict)
    layer_bytes_after_input: dict[ChunkKey, tuple[int, ...]] = field(default_factory=dict)
    remade_bytes: dict[ChunkKey, dict[int, int]] = field(default_factory=dict)
    layer_held: dict[ChunkKey, tuple[int, ...]] = field(default_factory=dict)
    layer_inputs: dict[ChunkKey, tuple[int, ...]] = field(default_factory=dict)
    recomputed_layers: int = 0
    gathered: int = 0  # bytes of FSDP parameters gathered now
    peak_activations: int = 0  # the step's peaks so far (see flush)
    peak_memory: int = 0

    @classmethod
    def begin(cls, manager: SwapManager, every_chunk: bool) -> MemoryAccount:
        """Count a step from what ``manager`` holds now."""
        manager.reset_peak()
        return cls(manager, every_chunk, manager.stats().bytes_offloaded)

    def flush(self) -> None:
        """Fold the swap manager's peak since the last flush into the step's peaks (with the
        FSDP parameters gathered meanwhile), and start a new one from what it holds now.
        Called before every change of the gathered bytes and at the end of the step, so the
        peak of activations plus parameters is exact, as the simulator counts it."""
        stats = self.manager.stats()
        self.peak_activations = max(self.peak_activations, stats.peak_device_bytes_held)
        self.peak_memory = max(self.peak_memory, stats.peak_device_bytes_held + self.gathered)
        self.manager.reset_peak()

    def parameters_changed(self, delta: int) -> None:
        """After an UNSHARD (``delta`` > 0) or a RESHARD (``delta`` < 0), which :meth:`flush`
        preceded: the gathered bytes, and the peak with them."""
        self.gathered += delta
        self.peak_memory = max(self.peak_memory,
                               self.manager.stats().device_bytes_held + self.gathered)

    def forward_done(self, key: ChunkKey, session: SwapSession,
                     marks: LayerMarks | None = None) -> None:
        """After an accounted chunk's forward: what its group (or its layers' groups) holds,
        and per layer, if ``marks`` measured them, what each added and was called with."""
        self.accounted.add(key)
        chain = session.chain(key)
        if chain is not None:
            self.layer_bytes[key] = chain.layer_bytes
            self.chunk_bytes[key] = GroupBytes(sum(b.held for b in chain.layer_bytes),
                                               sum(b.movable for b in chain.layer_bytes))
        else:
            self.chunk_bytes[key] = self.manager.group_bytes(session.name(key))
            if marks is not None and marks.held:
                starts = [0, *marks.held[1:]]
                ends = [*starts[1:], self.chunk_bytes[key].held]
                self.layer_held[key] = tuple(end - start for start, end in zip(starts, ends))
                self.layer_inputs[key] = tuple(marks.inputs)

    def input_done(self, key: ChunkKey, session: SwapSession) -> None:
        """After the I of a chunk: what its groups still hold for W, if it is accounted."""
        if key not in self.accounted:
            return
        names = session.names(key)
        held = tuple(self.manager.group_bytes(name).held for name in names)
        self.chunk_bytes_after_input[key] = sum(held)
        if session.chain(key) is not None:
            self.layer_bytes_after_input[key] = held

    def recomputed(self, key: ChunkKey, session: SwapSession) -> None:
        """After the backward (B or I) of a chunk with recomputed layers: what each layer's
        recompute made."""
        made: dict[int, int] = {}
        for name in session.names(key):
            made.update(self.manager.remade_bytes(name))
        self.remade_bytes[key] = made

    def report(self, *, losses: tuple[float, ...], seconds: float, swapped_chunks: int,
               peak_allocated_bytes: int | None) -> StepReport:
        """The step's report, with its peaks if every chunk was accounted."""
        return StepReport(
            losses=losses,
            seconds=seconds,
            peak_activation_bytes=self.peak_activations if self.every_chunk else None,
            peak_memory_bytes=self.peak_memory if self.every_chunk else None,
            bytes_offloaded=self.manager.stats().bytes_offloaded - self.offloaded_before,
            swapped_chunks=swapped_chunks,
            chunk_bytes=self.chunk_bytes,
            chunk_bytes_after_input=self.chunk_bytes_after_input,
            layer_bytes=self.layer_bytes,
            layer_bytes_after_input=self.layer_bytes_after_input,
            peak_allocated_bytes=peak_allocated_bytes,
            recomputed_layers=self.recomputed_layers,
            remade_bytes=self.remade_bytes,
            layer_held=self.layer_held,
            layer_inputs=self.layer_inputs,
        )


#: Why swap left a saved tensor on the device, as a user reads it (the swap manager's
#: reasons, :attr:`pipeswap.swap.SwapStats.skipped`).
KEPT_BECAUSE = {
    "shared across groups": "saved by more than one chunk or layer (a table every layer of "
                            "a stage uses, such as rotary cos and sin: one copy stays)",
    "referenced outside saved activations": "still referenced outside the saved "
                                            "activations (freeing it would break that "
                                            "reference)",
    "parameter": "parameters (they stay with their module)",
    "below min_bytes": "below the swap manager's min_bytes (not worth a copy)",
    "other device": "on another device than the swap manager's",
}


def kept_on_device(rank: int, before: Mapping[str, int], after: Mapping[str, int]
                   ) -> str | None:
    """One line on what swap left on the device in a step and why, from the manager's
    counts of skipped saved tensors before and after it; None where it left nothing."""
    counts = {reason: after.get(reason, 0) - before.get(reason, 0) for reason in after}
    said = [f"{count} {KEPT_BECAUSE.get(reason, reason)}"
            for reason, count in sorted(counts.items(), key=lambda item: -item[1])
            if count > 0 and reason != "empty storage"]
    if not said:
        return None
    return (f"rank {rank}: swap leaves these saved tensors on the device each step: "
            + "; ".join(said))
