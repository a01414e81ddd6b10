"""The manager's count of device bytes held: a storage counts while a saved activation holds it.

A split backward's input part (I) frees the saved tensors its weight part (W) does not need
while the chunk's group lives on until W; those bytes must stop counting then, not at the
group's end, or every forward between I and W sees a peak that is not there.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from pipeswap.platform import get_platform
from pipeswap.swap import SwapManager

DEVICE = os.environ.get("PIPESWAP_TEST_DEVICE", "cpu")  # see conftest.py

FLOATS = 256  # 1 KiB a saved tensor


@pytest.fixture
def mgr() -> SwapManager:
    return SwapManager(get_platform(DEVICE))


def backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]


def _two_branches(mgr: SwapManager, name: str, x: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    with mgr.group_context(name):
        first = x.exp().sum()  # saves exp's output
        second = (x * 3).sin().sum()  # saves x * 3
    return first, second


def test_bytes_a_backward_frees_stop_counting_before_the_group_ends(mgr: SwapManager) -> None:
    x = torch.randn(FLOATS, requires_grad=True)
    first, second = _two_branches(mgr, "g", x)
    assert mgr.group_bytes("g").held == mgr.stats().device_bytes_held == 2048
    backward(first)  # frees exp's output; the group still holds x * 3
    assert mgr.group_bytes("g").held == mgr.stats().device_bytes_held == 1024
    assert mgr.group_bytes("g").movable == 1024
    with mgr.group_context("h"):
        third = (x * 2).sin().sum()
    stats = mgr.stats()
    assert (stats.device_bytes_held, stats.peak_device_bytes_held) == (2048, 2048)
    backward(second)
    backward(third)
    mgr.finish_group("g")
    mgr.finish_group("h")
    assert mgr.stats().device_bytes_held == 0


def test_a_backward_on_another_thread_is_counted_too(mgr: SwapManager) -> None:
    x = torch.randn(FLOATS, requires_grad=True)
    first, second = _two_branches(mgr, "g", x)
    worker = threading.Thread(target=backward, args=(first,))
    worker.start()
    worker.join()
    assert mgr.stats().device_bytes_held == 1024
    backward(second)
    assert mgr.stats().device_bytes_held == 0  # before finish: nothing saved is left
    mgr.finish_group("g")
    assert mgr.stats().device_bytes_held == 0


def test_an_offloaded_group_counts_again_only_what_it_loads(mgr: SwapManager) -> None:
    x = torch.randn(FLOATS, requires_grad=True)
    first, second = _two_branches(mgr, "g", x)
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    assert mgr.stats().device_bytes_held == 0
    mgr.launch_load("g")
    mgr.wait_load("g")
    assert mgr.stats().device_bytes_held == 2048
    backward(first)
    assert mgr.stats().device_bytes_held == 1024
    backward(second)
    mgr.finish_group("g")
    stats = mgr.stats()
    assert (stats.device_bytes_held, stats.peak_device_bytes_held) == (0, 2048)
