"""The CPU platform's streams and events are really asynchronous, ordered and error-reporting."""

from __future__ import annotations

import gc
import sys
import threading

import pytest
import torch

from pipeswap.platform import PlatformUnavailableError, available_platforms, get_platform
from pipeswap.platform.cpu import CopyStreamError, CpuPlatform, WorkerStream


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
    assert state["0.linear.weight"].data_ptr() == first.linear.weight.data_ptr()
