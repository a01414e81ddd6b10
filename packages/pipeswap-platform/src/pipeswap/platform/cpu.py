"""The CPU platform: copy streams are real worker threads and events real completion signals.

Work on the current (compute) stream runs inline on the calling thread; work on a stream from
:meth:`CpuPlatform.new_stream` runs in order on that stream's own thread, so a copy really is
still running after :meth:`CpuPlatform.copy_` returns. Code that frees a storage before its
copy finished, or reads data before its load finished, misbehaves here as it would on a GPU,
which lets the swap manager's ordering be tested on machines without one.

Memory. Here the "device" and the host are the same memory, so the allocator figure of
:meth:`CpuPlatform.measure_allocations` (torch's profiler, which records every allocation and
free of torch's CPU allocator) leaves out the host buffers of :meth:`CpuPlatform.host_buffer`,
as an accelerator's allocator does not count pinned host memory: an offload then shows as the
drop it is on a device. The worker threads allocate nothing: they copy between tensors the
caller allocated (same size and dtype) and signal events. Nor do they free anything as long
as the caller keeps the copied tensors until the copy's event completed, as the swap manager
does (a worker lets go of a task's tensors when it takes the next task, the event's signal).
So a step's allocations and frees all happen on the calling thread, which the profiler
records.
"""

from __future__ import annotations

import contextvars
import os
import queue
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeswap.platform.introspection import ModuleIntrospection
from pipeswap.platform.protocol import AllocationPeak, MemoryStats, Stream

if TYPE_CHECKING:
    import torch
    from torch._C._autograd import _ProfilerResult

Task = Callable[[], None]

#: The profiler range around every host buffer allocation: what measure_allocations leaves out.
HOST_BUFFER_RANGE = "pipeswap::host_buffer"
ALLOCATION_SCOPE = "torch's CPU allocator on the measuring thread, less host buffers"


class CopyStreamError(RuntimeError):
    """Work queued on a CPU copy stream raised; the original error is the ``__cause__``."""


class ComputeStream:
    """The calling thread: work runs inline, so it is always synchronized."""

    def synchronize(self) -> None:
        pass

    def __repr__(self) -> str:
        return "ComputeStream()"


class WorkerStream:
    """A stream backed by one worker thread that runs its tasks in order.

    The thread ends when the stream is closed or garbage-collected. A task that raises marks
    the stream failed: later tasks still run (so waiters never hang) and the first error is
    re-raised by :meth:`synchronize` and by events recorded after it.
    """

    def __init__(self, name: str = "pipeswap-cpu-stream") -> None:
        self._tasks: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=_work, args=(self._tasks, weakref.ref(self)),
                                       name=name, daemon=True)
        self.thread.start()
        self._finalizer = weakref.finalize(self, self._tasks.put, None)

    def submit(self, task: Task) -> None:
        """Queue ``task`` to run after everything queued before it."""
        if not self._finalizer.alive:
            raise RuntimeError("this CPU stream is closed; create a new one with new_stream()")
        self._tasks.put(task)

    def synchronize(self) -> None:
        done = threading.Event()
        self.submit(done.set)
        done.wait()
        if self.error is not None:
            raise CopyStreamError(f"work on {self!r} failed: {self.error}") from self.error

    def close(self) -> None:
        """Finish the queued work and stop the thread."""
        self._finalizer()

    def __repr__(self) -> str:
        return f"WorkerStream(id={id(self):#x})"


def _work(tasks: queue.SimpleQueue[Task | None], owner: weakref.ref[WorkerStream]) -> None:
    import torch

    with torch.no_grad():  # grad mode is per thread: copies must not build autograd graphs
        while (task := tasks.get()) is not None:
            try:
                task()
            except BaseException as exc:  # noqa: BLE001 - kept for synchronize() to raise
                stream = owner()
                if stream is not None and stream.error is None:
                    stream.error = exc


class CpuEvent:
    """A completion signal; recording replaces the point it marks, as on a GPU."""

    def __init__(self, platform: CpuPlatform) -> None:
        self._platform = platform
        self._done: threading.Event | None = None  # None: never recorded
        self._stream: WorkerStream | None = None

    def record(self, stream: Stream | None = None) -> None:
        target = self._platform._resolve(stream)
        done = threading.Event()
        if isinstance(target, WorkerStream):
            target.submit(done.set)
            self._stream = target
        else:
            done.set()
            self._stream = None
        self._done = done

    def wait(self, stream: Stream | None = None) -> None:
        target = self._platform._resolve(stream)
        done = self._done
        if done is None:
            return
        if isinstance(target, WorkerStream):
            target.submit(lambda: _block(done))
        else:
            self.synchronize()

    def query(self) -> bool:
        return self._done is None or self._done.is_set()

    def synchronize(self) -> None:
        if self._done is None:
            return
        self._done.wait()
        stream = self._stream
        if stream is not None and stream.error is not None:
            raise CopyStreamError(f"work on {stream!r} failed: {stream.error}") from stream.error


class CpuPlatform(ModuleIntrospection):
    """Activations in host memory; copies on worker-thread streams."""

    def __init__(self) -> None:
        self._compute = ComputeStream()
        self._current: contextvars.ContextVar[Stream] = contextvars.ContextVar(
            f"pipeswap_cpu_stream_{id(self):x}", default=self._compute)

    @property
    def name(self) -> str:
        return "cpu"

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device("cpu")

    @property
    def pins_host_memory(self) -> bool:
        return False

    def current_stream(self) -> Stream:
        return self._current.get()

    def new_stream(self) -> WorkerStream:
        return WorkerStream()

    @contextmanager
    def stream(self, stream: Stream) -> Iterator[None]:
        token = self._current.set(self._resolve(stream))
        try:
            yield
        finally:
            self._current.reset(token)

    def new_event(self) -> CpuEvent:
        return CpuEvent(self)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        target = self._current.get()
        if isinstance(target, WorkerStream):
            target.submit(lambda: _copy(dst, src))
        else:
            _copy(dst, src)

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        import torch

        # Named for the profiler, so that measure_allocations can tell host from device.
        with torch.profiler.record_function(HOST_BUFFER_RANGE):
            return torch.empty(nbytes, dtype=torch.uint8, device="cpu")

    def memory_stats(self) -> MemoryStats | None:
        """The process's resident set (torch keeps no statistics for host memory); None where
        the OS does not report it (only Linux's /proc is read)."""
        try:
            with open("/proc/self/status", encoding="ascii") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            rss, peak = (int(fields[k].split()[0]) << 10 for k in ("VmRSS", "VmHWM"))
        except (OSError, KeyError, ValueError):
            return None
        return MemoryStats(allocated=rss, peak=peak, scope="process resident set")

    def reset_peak_memory_stats(self) -> None:
        """Reset the resident-set high-water mark to the current size (Linux 4.0+); where the
        kernel refuses, the peak keeps counting from process start."""
        with suppress(OSError), open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")

    @contextmanager
    def measure_allocations(self) -> Iterator[AllocationPeak]:
        """The peak of torch's CPU allocator inside the block, above what it held on entry,
        from torch's profiler (``profile_memory``): every allocation and free it records, in
        time order, summed from 0; the peak is the largest partial sum. Host buffers are left
        out (see the module's docstring).

        What the profiler sees: allocations and frees on this thread (the profiler's state is
        per thread; this platform's worker threads allocate nothing). A free inside the block
        of memory allocated before it counts only if torch knew the block's size, that is,
        if it was allocated while a memory profiler was recording (an earlier measured
        block, say); torch cannot report the others ("Memory block of unknown size was
        allocated before the profiling started"), so such a free is missed and the figure
        is then an upper bound. The profiler slows every operation inside the block. Where
        another profiler already runs, nothing is measured (``peak_bytes`` stays None)."""
        import torch

        result = AllocationPeak(scope=ALLOCATION_SCOPE)
        if torch._C._autograd._profiler_enabled():
            warnings.warn("another torch profiler is running, so the allocator's peak is not "
                          "measured here (only one profiler can run at a time)", stacklevel=3)
            yield result
            return
        # Kineto prints two lines at every start and stop otherwise (a user's setting wins).
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        profiler = torch.autograd.profiler.profile(use_kineto=True, profile_memory=True)
        with profiler:
            yield result
        if profiler.kineto_results is not None:
            result.peak_bytes, result.held_bytes = allocation_totals(
                _allocation_events(profiler.kineto_results), _HOST_BLOCKS)

    def _resolve(self, stream: Stream | None) -> Stream:
        if stream is None:
            return self._current.get()
        if not isinstance(stream, (ComputeStream, WorkerStream)):
            raise TypeError(f"not a CPU platform stream: {stream!r}")
        return stream

    def __repr__(self) -> str:
        return "CpuPlatform()"


def _block(done: threading.Event) -> None:
    done.wait()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    import torch

    with torch.no_grad():
        dst.copy_(src)


@dataclass(frozen=True)
class AllocationEvent:
    """One allocation (``nbytes`` > 0) or free (``nbytes`` < 0) the profiler recorded at
    ``time_ns``, of the block at address ``ptr``; ``host``: allocated by :meth:`host_buffer`."""

    time_ns: int
    ptr: int
    nbytes: int
    host: bool = False


class HostBlocks:
    """Addresses of host buffers seen allocated, and not yet seen freed or reused: a free of
    one is a host buffer's (left out), an allocation at one that is not a host buffer's makes
    it device memory again. Shared by all measurements of the process (addresses are)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.addresses: set[int] = set()


_HOST_BLOCKS = HostBlocks()


def allocation_peak(events: Iterable[AllocationEvent], host: HostBlocks | None = None) -> int:
    """The most bytes held at once above the start: the largest running sum of the events'
    byte deltas in time order (events at one instant in the order given), from 0, and 0 if
    it never went above. A free counts whether its block was allocated before or during the
    window. Host buffers are left out: their allocations (``host``) and the frees of their
    addresses; ``host`` carries those addresses from one window to the next."""
    return allocation_totals(events, host)[0]


def allocation_totals(events: Iterable[AllocationEvent], host: HostBlocks | None = None
                      ) -> tuple[int, int]:
    """:func:`allocation_peak`, and the running sum at the end: the bytes the window left
    held above its start."""
    blocks = host if host is not None else HostBlocks()
    running = peak = 0
    with blocks.lock:
        for event in sorted(events, key=lambda e: e.time_ns):
            if event.nbytes > 0:
                if event.host:
                    blocks.addresses.add(event.ptr)
                    continue
                blocks.addresses.discard(event.ptr)
            elif event.ptr in blocks.addresses:
                blocks.addresses.discard(event.ptr)
                continue
            running += event.nbytes
            peak = max(peak, running)
    return peak, running


def _allocation_events(results: _ProfilerResult) -> list[AllocationEvent]:
    """The CPU allocations and frees of a profile, each marked if made inside a host buffer's
    range (:data:`HOST_BUFFER_RANGE`)."""
    from torch._C._profiler import _EventType, _ExtraFields_Allocation

    events = []
    pending = list(results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        fields = event.extra_fields
        if event.tag != _EventType.Allocation or not isinstance(fields, _ExtraFields_Allocation):
            continue
        if fields.device.type != "cpu" or fields.alloc_size == 0:
            continue
        host = False
        parent = event.parent
        while parent is not None and not host:
            host, parent = parent.name == HOST_BUFFER_RANGE, parent.parent
        events.append(AllocationEvent(event.start_time_ns, fields.ptr, fields.alloc_size, host))
    return events
