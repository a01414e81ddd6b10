"""The host buffer pool: size classes, a byte cap, reuse only after the copy completed."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from pipeswap.platform import get_platform
from pipeswap.platform.cpu import CpuPlatform
from pipeswap.swap import SwapManager
from pipeswap.swap.pool import HostBufferPool, PoolExhaustedError, default_pool_bytes, size_class

DEVICE = os.environ.get("PIPESWAP_TEST_DEVICE", "cpu")  # see conftest.py


def _hold(gate: threading.Event) -> None:
    assert gate.wait(30), "test gate never opened"


def test_size_classes_are_powers_of_two_from_4_kib() -> None:
    assert [size_class(n) for n in (1, 4096, 4097, 10_000)] == [4096, 4096, 8192, 16384]


def test_a_buffer_is_reused_only_after_its_copy_completed() -> None:
    platform = get_platform("cpu")  # a test of the CPU worker streams
    assert isinstance(platform, CpuPlatform)
    pool = HostBufferPool(platform, max_bytes=1 << 20)
    first = pool.acquire(5000)
    assert first.view.numel() == 5000 and first.block.numel() == 8192
    stream = platform.new_stream()
    gate = threading.Event()
    stream.submit(lambda: _hold(gate))
    copy_done = platform.new_event()
    copy_done.record(stream)  # the copy "using" first is still running
    pool.release(first, copy_done)
    second = pool.acquire(5000)
    assert second.block.data_ptr() != first.block.data_ptr()  # not reused while pending
    gate.set()
    copy_done.synchronize()
    pool.release(second)
    third, fourth = pool.acquire(6000), pool.acquire(6000)
    assert {third.block.data_ptr(), fourth.block.data_ptr()} == {
        first.block.data_ptr(), second.block.data_ptr()}
    assert pool.allocated_blocks == 2 and pool.allocated_bytes == 2 * 8192
    assert pool.in_use_bytes == 2 * 8192


def test_at_the_cap_the_pool_waits_for_a_pending_block_or_refuses() -> None:
    platform = get_platform("cpu")
    assert isinstance(platform, CpuPlatform)
    pool = HostBufferPool(platform, max_bytes=8192)
    buffer = pool.acquire(8000)
    with pytest.raises(PoolExhaustedError, match="need 4096 bytes, 8192 of 8192 allocated"):
        pool.acquire(100)
    stream = platform.new_stream()
    stream.submit(lambda: None)
    done = platform.new_event()
    done.record(stream)
    pool.release(buffer, done)
    again = pool.acquire(100)  # at the cap: waits for `done`, then reuses the larger block
    assert again.block.data_ptr() == buffer.block.data_ptr() and again.view.numel() == 100
    with pytest.raises(ValueError, match="max_bytes must be a positive integer"):
        HostBufferPool(platform, max_bytes=0)
    assert torch.equal(again.view, again.block[:100])


def test_the_default_cap_shares_half_the_host_among_its_local_ranks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = default_pool_bytes()
    assert alone == max(1 << 30, physical // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_pool_bytes() == max(1 << 30, physical // 2 // 4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "100000")
    assert default_pool_bytes() == 1 << 30  # never below 1 GiB
    assert SwapManager(get_platform(DEVICE))._transfers.pool.max_bytes == 1 << 30


def test_a_reservation_pins_the_missing_blocks_of_each_class_ahead() -> None:
    platform = get_platform("cpu")
    pool = HostBufferPool(platform, max_bytes=1 << 20)
    assert pool.reserve([5000, 6000, 100]) == 2 * 8192 + 4096
    assert pool.allocated_blocks == 3 and pool.reserved_bytes == pool.allocated_bytes
    taken = [pool.acquire(n) for n in (8000, 5000, 4096)]  # the reserved blocks: no new one
    assert pool.allocated_blocks == 3 and len({id(b.block) for b in taken}) == 3
    assert pool.reserve([5000, 5000]) == 0  # the pool has both: in use counts
    assert pool.reserve([5000, 5000, 5000, 20_000]) == 8192 + 32768  # only what it lacks
    assert pool.allocated_blocks == 5 and pool.reserved_bytes == 3 * 8192 + 4096 + 32768
    for buffer in taken:
        pool.release(buffer)
    again = [pool.acquire(5000) for _ in range(3)]
    assert pool.allocated_blocks == 5 and len({id(b.block) for b in again}) == 3


def test_a_reservation_over_the_cap_says_by_how_much_and_pins_nothing() -> None:
    pool = HostBufferPool(get_platform("cpu"), max_bytes=5 * 4096)
    pool.acquire(4096)
    with pytest.raises(PoolExhaustedError, match=(
            r"reserving host buffers for 3 storages needs 20480 bytes more than the pool "
            r"holds \(4096 allocated\), 4096 over its cap of 20480: raise the cap "
            r"\(SwapManager's pool_bytes, pipeswap-train's --host-pool-bytes\) to at least "
            r"24576")):
        pool.reserve([4096, 4096, 16384])  # the block in use counts for one
    assert pool.allocated_blocks == 1 and pool.reserved_bytes == 0
    with pytest.raises(ValueError, match="sizes are positive byte counts"):
        pool.reserve([4096, 0])
