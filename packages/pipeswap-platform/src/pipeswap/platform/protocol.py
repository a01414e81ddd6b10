"""The device protocol: what the swap manager and the executor need from a device.

Streams order device work; events mark a point in a stream that other streams (or the host)
can wait for. Copies are issued on the current stream and may run asynchronously to the host,
so a caller must order every use of a copied buffer with events, as on a GPU.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch


class Stream(Protocol):
    """An ordered queue of device work."""

    def synchronize(self) -> None:
        """Block the host until all work queued so far has finished."""


class Event(Protocol):
    """A point in a stream. An event never recorded counts as complete."""

    def record(self, stream: Stream | None = None) -> None:
        """Mark the current end of ``stream`` (default: the platform's current stream, on its
        device, whichever device is current)."""

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream`` (default: the platform's current stream) wait for the recorded point."""

    def query(self) -> bool:
        """True when the work before the recorded point has finished."""

    def synchronize(self) -> None:
        """Block the host until the recorded point is reached; raise if that work failed."""


@dataclass(frozen=True)
class MemoryStats:
    """Bytes held now, and the most since the last peak reset. ``scope`` says what is counted:
    the device allocator's tensors on accelerators, the whole process's resident memory on CPU
    (an upper bound of what tensors hold there)."""

    allocated: int
    peak: int
    scope: str = "device allocator"


@dataclass
class AllocationPeak:
    """What :meth:`Platform.measure_allocations` measured, filled in when its block ends.

    ``peak_bytes``: the most bytes the device's allocator held at once inside the block, above
    what it held when the block began (0 if it never went above); None until the block ended,
    if the block raised, or where the platform could not measure. Memory freed inside the
    block lowers the running figure, so a free followed by an allocation of the same size
    leaves the peak where it was. ``held_bytes``: what the allocator held at the block's end
    above what it held at its start (negative where the block freed more than it allocated),
    e.g. the memory of what the block built and kept; None where ``peak_bytes`` is.
    ``scope`` says what is counted (see each platform)."""

    scope: str
    peak_bytes: int | None = None
    held_bytes: int | None = None


class Platform(Protocol):
    """One device kind: streams, events, copies, host buffers, memory statistics, modules."""

    @property
    def name(self) -> str:
        """The device type: ``"cpu"``, ``"cuda"``, ..."""

    @property
    def device(self) -> torch.device:
        """Where activations live on this platform."""

    @property
    def pins_host_memory(self) -> bool:
        """Whether :meth:`host_buffer` returns page-locked memory (fast asynchronous copies)."""

    def current_stream(self) -> Stream:
        """The stream compute is queued on now, on the platform's device."""

    def new_stream(self) -> Stream: ...

    def stream(self, stream: Stream) -> AbstractContextManager[None]:
        """Make ``stream`` current inside the block."""

    def new_event(self) -> Event: ...

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst.copy_(src)`` on the current stream; it may finish after this returns."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A new uint8 host tensor of ``nbytes``, pinned where the device supports it."""

    def memory_stats(self) -> MemoryStats | None:
        """Memory statistics, or None where the device reports none."""

    def reset_peak_memory_stats(self) -> None: ...

    def measure_allocations(self) -> AbstractContextManager[AllocationPeak]:
        """Measure the peak of the device allocator's bytes inside the block, above what it
        held on entry; the yielded :class:`AllocationPeak` holds it once the block ends."""

    def parameters_dict(self, module: torch.nn.Module) -> dict[str, torch.nn.Parameter]: ...

    def buffers_dict(self, module: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Every buffer, persistent or not, of the module and its children, by dotted name."""

    def get_model_state_dict(self, module: torch.nn.Module) -> dict[str, object]:
        """The module's state dict; ``object``: a module's extra state is whatever it
        returns."""

