"""The accelerator platform on a real device (skipped where torch sees none)."""

from __future__ import annotations

import pytest
import torch

from pipeswap.platform import get_platform

pytestmark = pytest.mark.skipif(not torch.accelerator.is_available(),
                                reason="no accelerator on this machine")


def test_round_trip_through_pinned_host_memory_on_a_side_stream() -> None:
    platform = get_platform()
    device_data = torch.randn(1 << 20, device=platform.device)
    host = platform.host_buffer(device_data.numel() * 4).view(torch.float32)
    assert host.is_pinned()
    copy_stream = platform.new_stream()
    produced = platform.new_event()
    produced.record()
    produced.wait(copy_stream)
    with platform.stream(copy_stream):
        platform.copy_(host, device_data)
    copied = platform.new_event()
    copied.record(copy_stream)
    copied.synchronize()
    assert torch.equal(host, device_data.cpu())
    stats = platform.memory_stats()
    assert stats is not None and stats.allocated >= device_data.numel() * 4
    assert stats.peak >= stats.allocated


def test_the_allocator_peak_counts_device_tensors_not_host_buffers() -> None:
    platform = get_platform()
    size = 4 << 20
    before = torch.empty(size, dtype=torch.uint8, device=platform.device)
    with platform.measure_allocations() as measured:
        host = platform.host_buffer(8 * size)  # pinned host memory: not the device's
        block = torch.empty(size, dtype=torch.uint8, device=platform.device)
        del block
        kept = torch.empty(size // 2, dtype=torch.uint8, device=platform.device)
        del before  # allocated before the block: its free counts too, so that ...
        again = torch.empty(size, dtype=torch.uint8, device=platform.device)  # ... this fits
    assert measured.scope == "device allocator"
    assert measured.peak_bytes == size
    assert measured.held_bytes == size // 2  # kept and again, less before
    del host, kept, again
