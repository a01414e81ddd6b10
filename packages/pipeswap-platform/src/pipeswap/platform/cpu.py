"""The CPU platform: copy streams are real worker threads and events real completion signals.

Work on the current (compute) stream runs inline on the calling thread; work on a stream from
:meth:`CpuPlatform.new_stream` runs in order on that stream's own thread, so a copy really is
still running after :meth:`CpuPlatform.copy_` returns. Code that frees a storage before its
copy finished, or reads data before its load finished, misbehaves here as it would on a GPU,
which lets the swap manager's ordering be tested on machines without one.
"""

from __future__ import annotations

import contextvars
import queue
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING

from pipeswap.platform.introspection import ModuleIntrospection
from pipeswap.platform.protocol import MemoryStats, Stream

if TYPE_CHECKING:
    import torch

Task = Callable[[], None]


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

        return torch.empty(nbytes, dtype=torch.uint8)

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
