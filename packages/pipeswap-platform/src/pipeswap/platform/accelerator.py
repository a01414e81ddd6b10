"""Torch accelerators (CUDA first) through torch's device-generic stream, event and memory APIs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, cast

from pipeswap.platform.introspection import ModuleIntrospection
from pipeswap.platform.protocol import AllocationPeak, Event, MemoryStats, Stream

if TYPE_CHECKING:
    import torch


class AcceleratorPlatform(ModuleIntrospection):
    """One accelerator device: ``torch.Stream``/``torch.Event``, pinned host buffers, and the
    caching allocator's statistics from ``torch.accelerator``."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    @property
    def name(self) -> str:
        return self._device.type

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def pins_host_memory(self) -> bool:
        return True

    def current_stream(self) -> Stream:
        import torch

        return torch.accelerator.current_stream(self._device)

    def new_stream(self) -> Stream:
        import torch

        return torch.Stream(device=self._device)

    @contextmanager
    def stream(self, stream: Stream) -> Iterator[None]:
        import torch

        previous = torch.accelerator.current_stream(self._device)
        torch.accelerator.set_stream(cast("torch.Stream", stream))  # one of this platform's
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)

    def new_event(self) -> Event:
        return _TorchEvent(self._device)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        import torch

        with torch.no_grad():
            dst.copy_(src, non_blocking=True)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        import torch

        # on the CPU whatever torch.set_default_device says: pinned host memory
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=True)

    def memory_stats(self) -> MemoryStats | None:
        import torch

        return MemoryStats(
            allocated=torch.accelerator.memory_allocated(self._device),
            peak=torch.accelerator.max_memory_allocated(self._device),
        )

    def reset_peak_memory_stats(self) -> None:
        import torch

        torch.accelerator.reset_peak_memory_stats(self._device)

    @contextmanager
    def measure_allocations(self) -> Iterator[AllocationPeak]:
        """The caching allocator's own peak (``max_memory_allocated`` after
        ``reset_peak_memory_stats``) minus what it held on entry: device tensors only, pinned
        host buffers not. Resets the device's peak statistics on entry, as
        :meth:`reset_peak_memory_stats` does."""
        result = AllocationPeak(scope="device allocator")
        self.reset_peak_memory_stats()
        start = self.memory_stats()
        yield result
        end = self.memory_stats()
        if start is not None and end is not None:
            result.peak_bytes = max(0, end.peak - start.allocated)
            result.held_bytes = end.allocated - start.allocated

    def __repr__(self) -> str:
        return f"AcceleratorPlatform({self._device})"


class _TorchEvent:
    """``torch.Event`` behind the protocol's signatures (streams are this platform's)."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self._event = torch.Event(device=device)

    def record(self, stream: Stream | None = None) -> None:
        self._event.record(cast("torch.Stream | None", stream))

    def wait(self, stream: Stream | None = None) -> None:
        self._event.wait(cast("torch.Stream | None", stream))

    def query(self) -> bool:
        return bool(self._event.query())

    def synchronize(self) -> None:
        self._event.synchronize()
