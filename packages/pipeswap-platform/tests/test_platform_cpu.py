"""The CPU platform's streams and events are really asynchronous, ordered and error-reporting."""

from __future__ import annotations

import gc
import sys
import threading
from contextlib import ExitStack

import pytest
import torch

from pipeswap.platform import PlatformUnavailableError, available_platforms, get_platform
from pipeswap.platform.cpu import (
    AllocationEvent,
    CopyStreamError,
    CpuPlatform,
    HostBlocks,
    WorkerStream,
    _allocation_events,
    allocation_peak,
)


@pytest.fixture
def cpu() -> CpuPlatform:
    platform = get_platform("cpu")
    assert isinstance(platform, CpuPlatform)
    return platform


def _gated(stream: WorkerStream) -> threading.Event:
    """Hold ``stream`` until the returned gate is set."""
    gate = threading.Event()
    stream.submit(lambda: assert_wait(gate))
    return gate


def assert_wait(gate: threading.Event) -> None:
    assert gate.wait(timeout=30), "test gate never opened"


def test_probing_never_offers_a_missing_device() -> None:
    available = available_platforms()
    assert available[-1] == "cpu"
    assert get_platform().name == available[0]
    if "cuda" not in available:
        with pytest.raises(PlatformUnavailableError, match=r"no 'cuda' device here; available: .*cpu"):
            get_platform("cuda")
    with pytest.raises(PlatformUnavailableError, match="no 'tpu7' device here"):
        get_platform("tpu7")


def test_copy_on_a_worker_stream_runs_after_the_call_returns(cpu: CpuPlatform) -> None:
    stream = cpu.new_stream()
    gate = _gated(stream)
    src, dst = torch.arange(1000.0), torch.zeros(1000)
    with cpu.stream(stream):
        assert cpu.current_stream() is stream
        cpu.copy_(dst, src)
    assert cpu.current_stream() is not stream
    done = cpu.new_event()
    done.record(stream)
    assert not done.query()
    assert torch.count_nonzero(dst) == 0  # the copy has not run: the stream is held
    gate.set()
    done.synchronize()
    assert done.query()
    assert torch.equal(dst, src)


def test_a_stream_waits_for_an_event_of_another(cpu: CpuPlatform) -> None:
    first, second = cpu.new_stream(), cpu.new_stream()
    gate = _gated(first)
    a, b, c = torch.full((64,), 7.0), torch.zeros(64), torch.zeros(64)
    with cpu.stream(first):
        cpu.copy_(b, a)
    produced = cpu.new_event()
    produced.record(first)
    produced.wait(second)  # second must not copy b until first has written it
    with cpu.stream(second):
        cpu.copy_(c, b)
    consumed = cpu.new_event()
    consumed.record(second)
    assert not consumed.query()
    gate.set()
    consumed.synchronize()
    assert torch.equal(c, a)


def test_the_compute_stream_runs_inline_and_waits_on_the_host(cpu: CpuPlatform) -> None:
    src, dst = torch.ones(8), torch.zeros(8)
    cpu.copy_(dst, src)
    assert torch.equal(dst, src)
    event = cpu.new_event()
    assert event.query()  # never recorded: complete
    event.record()
    assert event.query()
    worker = cpu.new_stream()
    gate = _gated(worker)
    pending = cpu.new_event()
    pending.record(worker)
    opener = threading.Timer(0.05, gate.set)
    opener.start()
    pending.wait()  # on the compute stream: blocks the host until the worker passes the point
    assert pending.query()
    opener.join()


def test_a_failed_copy_is_reported_not_swallowed(cpu: CpuPlatform) -> None:
    stream = cpu.new_stream()
    with cpu.stream(stream):
        cpu.copy_(torch.zeros(3), torch.zeros(5))
    after = cpu.new_event()
    after.record(stream)
    with pytest.raises(CopyStreamError, match="failed") as info:
        after.synchronize()
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(CopyStreamError):
        stream.synchronize()


def test_worker_copies_do_not_record_autograd(cpu: CpuPlatform) -> None:
    stream = cpu.new_stream()
    leaf = torch.ones(4, requires_grad=True)
    dst = torch.zeros(4)
    with cpu.stream(stream):
        cpu.copy_(dst, leaf)
    stream.synchronize()
    assert dst.grad_fn is None and not dst.requires_grad


def test_stream_threads_end_with_their_streams(cpu: CpuPlatform) -> None:
    closed, dropped = cpu.new_stream(), cpu.new_stream()
    threads = [closed.thread, dropped.thread]
    assert all(t.is_alive() for t in threads)
    closed.close()
    with pytest.raises(RuntimeError, match="closed"):
        closed.submit(lambda: None)
    del dropped
    gc.collect()
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive()


def test_host_buffers_and_memory_statistics(cpu: CpuPlatform) -> None:
    buffer = cpu.host_buffer(4096)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 4096 and buffer.device.type == "cpu"
    assert cpu.pins_host_memory is False
    assert cpu.device == torch.device("cpu")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_memory_statistics_follow_the_resident_set(cpu: CpuPlatform) -> None:
    size = 256 << 20
    before = cpu.memory_stats()
    assert before is not None and before.scope == "process resident set"
    block = torch.ones(size // 4)  # touched, so resident
    during = cpu.memory_stats()
    assert during is not None
    assert during.allocated - before.allocated >= size * 0.9
    assert during.peak >= before.allocated + size * 0.9  # the kernel counts pages lazily
    del block
    after = cpu.memory_stats()
    assert after is not None and after.allocated <= during.allocated - size * 0.9
    assert after.peak >= before.allocated + size * 0.9  # the peak remembers the block
    cpu.reset_peak_memory_stats()
    reset = cpu.memory_stats()
    assert reset is not None and reset.peak <= during.peak - size * 0.9


def test_module_introspection(cpu: CpuPlatform) -> None:
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 3)
            self.register_buffer("scale", torch.ones(3))
            self.register_buffer("cache", torch.zeros(3), persistent=False)

    model = torch.nn.Sequential(Block(), Block())
    assert sorted(cpu.parameters_dict(model)) == [
        "0.linear.bias", "0.linear.weight", "1.linear.bias", "1.linear.weight"]
    assert sorted(cpu.buffers_dict(model)) == ["0.cache", "0.scale", "1.cache", "1.scale"]
    state = cpu.get_model_state_dict(model)
    assert "0.scale" in state and "0.cache" not in state  # non-persistent buffers stay out
    first = model[0]
    assert isinstance(first, Block)
    weight = state["0.linear.weight"]
    assert isinstance(weight, torch.Tensor)
    assert weight.data_ptr() == first.linear.weight.data_ptr()


MIB = 1 << 20


def _bytes(n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.uint8)


def test_the_allocator_peak_is_the_largest_running_sum_from_the_start() -> None:
    def events(*deltas: tuple[int, int, bool]) -> list[AllocationEvent]:
        return [AllocationEvent(t, ptr, n, host) for t, (ptr, n, host) in enumerate(deltas)]

    assert allocation_peak([]) == 0
    assert allocation_peak(events((1, 100, False), (2, 50, False), (1, -100, False),
                                  (3, 30, False))) == 150
    # Frees of blocks from before the window count: the peak is above the start, not above
    # the lowest point, and 0 when the window never holds more than at its start.
    assert allocation_peak(events((9, -200, False), (4, 150, False))) == 0
    assert allocation_peak(events((9, -200, False), (4, 150, False), (5, 80, False))) == 30
    # Events are taken in time order, whatever order they come in.
    assert allocation_peak([AllocationEvent(2, 1, -100), AllocationEvent(1, 1, 100),
                            AllocationEvent(3, 2, 60)]) == 100
    # Host buffers are left out, their frees too (in a later window: the addresses carry
    # over), until their address is allocated again as device memory.
    host = HostBlocks()
    assert allocation_peak(events((7, 1000, True), (1, 10, False)), host) == 10
    assert allocation_peak(events((7, -1000, False), (1, -10, False), (2, 20, False)),
                           host) == 10
    assert allocation_peak(events((7, 300, False), (7, -300, False), (8, 5, False)), host) == 300


def test_measured_peaks_of_the_cpu_allocator(cpu: CpuPlatform) -> None:
    with cpu.measure_allocations() as first:
        assert first.peak_bytes is None and "host buffers" in first.scope
        block = _bytes(MIB)
        del block
        kept = _bytes(MIB // 2)
    assert first.peak_bytes == MIB
    assert first.held_bytes == MIB // 2
    with cpu.measure_allocations() as second:  # frees `kept` (allocated while measuring)
        del kept
        again = _bytes(MIB // 2)
    assert (second.peak_bytes, second.held_bytes) == (0, 0)
    with cpu.measure_allocations() as third:
        host = cpu.host_buffer(4 * MIB)  # host memory: not the device allocator's
        more = _bytes(MIB // 4)
    assert (third.peak_bytes, third.held_bytes) == (MIB // 4, MIB // 4)
    with cpu.measure_allocations() as fourth:
        del again
    assert (fourth.peak_bytes, fourth.held_bytes) == (0, -(MIB // 2))
    del host, more


def test_an_offload_shows_as_a_drop(cpu: CpuPlatform) -> None:
    """Device data copied to a host buffer on a worker stream, then freed on this thread:
    the peak is the device data alone, and what follows fits under it."""
    stream = cpu.new_stream()
    with cpu.measure_allocations() as measured:
        device = torch.ones(MIB // 4)  # 1 MiB of float32
        host = cpu.host_buffer(MIB).view(torch.float32)
        with cpu.stream(stream):
            cpu.copy_(host, device)
        done = cpu.new_event()
        done.record(stream)
        done.synchronize()
        device.untyped_storage().resize_(0)  # the swap manager's release
        later = _bytes(MIB)  # fits in what the offload released
    assert measured.peak_bytes == MIB
    assert torch.equal(host, torch.ones(MIB // 4))
    del later


def test_copies_on_worker_streams_allocate_nothing(cpu: CpuPlatform) -> None:
    """The profiler records only the thread that started it, so measure_allocations does not
    see the copy threads; a profiler started on a copy thread itself shows they need not be
    seen: its copies both ways allocate nothing (an allocation there would show)."""
    with cpu.measure_allocations():  # the profiler's first start, on the main thread
        pass
    stream = cpu.new_stream()
    device, host = torch.ones(MIB // 4), cpu.host_buffer(MIB).view(torch.float32)
    profiler = torch.autograd.profiler.profile(use_kineto=True, profile_memory=True)
    running = ExitStack()

    def start() -> None:
        running.enter_context(profiler)

    def control() -> None:  # seen
        _bytes(100).fill_(0)

    stream.submit(start)
    stream.submit(control)
    with cpu.stream(stream):
        cpu.copy_(host, device)
        cpu.copy_(device, host)
    stream.submit(running.close)
    stream.synchronize()
    assert profiler.kineto_results is not None
    assert sorted(e.nbytes for e in _allocation_events(profiler.kineto_results)) == [-100, 100]


def test_no_measurement_while_another_profiler_runs(cpu: CpuPlatform) -> None:
    with torch.profiler.profile(), pytest.warns(UserWarning, match="another torch profiler"):
        with cpu.measure_allocations() as measured:
            _bytes(MIB)
    assert measured.peak_bytes is None


def test_host_buffers_stay_on_the_host_whatever_the_default_device() -> None:
    """A program that sets torch's default device (to an accelerator; here the meta device,
    which any machine has) still gets host buffers in host memory."""
    with torch.device("meta"):
        buffer = CpuPlatform().host_buffer(64)
    assert buffer.device.type == "cpu" and buffer.numel() == 64
