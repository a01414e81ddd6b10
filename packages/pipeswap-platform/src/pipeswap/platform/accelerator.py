"""Torch accelerators (CUDA first) through torch's device-generic stream, event and memory APIs.

Everything names the platform's device explicitly. torch's defaults follow the *current*
device instead: ``torch.Event.record()`` records on the current device's stream (and refuses
an event of another device), ``Event.wait()`` makes the current device's stream wait, and
``torch.accelerator.set_stream`` makes the stream's device current. A rank whose device is not
the current one (``cuda:1`` while ``cuda:0`` is current) would then order the wrong stream.
"""

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
        import torch

        # An index-less device means the current one: pin it now, so that the platform's
        # device equals its tensors' (``cuda`` != ``cuda:0``) and never follows a later change.
        if device.index is None:
            device = torch.device(device.type, torch.accelerator.current_device_index())
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
        """Make ``stream`` (one of this platform's) current on the platform's device; the
        caller's current device is restored after, which ``set_stream`` alone would change."""
        import torch

        with torch.accelerator.device_index(self._device.index):
            previous = torch.accelerator.current_stream(self._device)
            torch.accelerator.set_stream(cast("torch.Stream", stream))
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
        """Pinned host memory, pinned with the platform's device current: torch pins through
        a device that has a context, the current one first, and creates one on the current
        device where none has, which on another device costs that device memory."""
        import torch

        with torch.accelerator.device_index(self._device.index):
            # on the CPU whatever torch.set_default_device says
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
    """``torch.Event`` behind the protocol's signatures (streams are this platform's); with no
    stream, the platform device's current stream, never the current device's."""

    def __init__(self, device: torch.device) -> None:
        import torch

        self._device = device
        self._event = torch.Event(device=device)

    def record(self, stream: Stream | None = None) -> None:
        self._event.record(self._stream(stream))

    def wait(self, stream: Stream | None = None) -> None:
        self._event.wait(self._stream(stream))

    def _stream(self, stream: Stream | None) -> torch.Stream:
        import torch

        if stream is None:
            return torch.accelerator.current_stream(self._device)
        return cast("torch.Stream", stream)

    def query(self) -> bool:
        return bool(self._event.query())

    def synchronize(self) -> None:
        self._event.synchronize()
