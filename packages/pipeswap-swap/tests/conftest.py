"""Where the swap tests run: the CPU platform by default, or the device that the environment
variable ``PIPESWAP_TEST_DEVICE`` names (``cuda``; ``benchmarks/gpu_check.py`` sets it). Each
test file's ``DEVICE`` picks its platform, and during each test of this directory the device
is torch's default (in the test's thread: a thread a test starts sets it itself), so every
tensor a test makes lives there. ``copy_platform`` gives the platform also with copies that
lag far behind compute."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from pipeswap.platform import Platform, get_platform
from pipeswap.platform.accelerator import AcceleratorPlatform
from pipeswap.platform.cpu import CpuPlatform, WorkerStream

_DEVICE = os.environ.get("PIPESWAP_TEST_DEVICE", "cpu")


@pytest.fixture(autouse=True)
def _on_the_test_device() -> Iterator[None]:
    with torch.device(_DEVICE):
        yield


class LaggingCopies(CpuPlatform):
    """The CPU platform with copy streams far behind compute: every copy on a copy stream
    first works through a scratch buffer, so copies finish long after the compute that
    follows their launch. Whatever frees or reads a storage before its copy's event
    completed then does so before the copy ran."""

    def __init__(self) -> None:
        super().__init__()
        self._scratch = torch.zeros(1 << 20)

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self.current_stream()
        if isinstance(stream, WorkerStream):
            stream.submit(self._busy)
        super().copy_(dst, src)

    def _busy(self) -> None:
        for _ in range(4):
            self._scratch.add_(1.0)


class LaggingDeviceCopies(AcceleratorPlatform):
    """A CUDA device with copy streams far behind compute: every copy on a side stream first
    spins the GPU there (about a millisecond), so it ends long after the compute queued after
    its launch, as a loaded PCIe link would make it."""

    def __init__(self) -> None:
        super().__init__(torch.device("cuda", torch.cuda.current_device()))

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if torch.cuda.current_stream(self.device) != torch.cuda.default_stream(self.device):
            torch.cuda._sleep(2_000_000)  # type: ignore[no-untyped-call]  # GPU cycles
        super().copy_(dst, src)


@pytest.fixture(params=["plain", "lagging"])
def copy_platform(request: pytest.FixtureRequest) -> Platform:
    """The test device's platform as it is, and with its copies lagging far behind compute
    (where freeing or reading a storage before its copy ended shows)."""
    if request.param == "plain":
        return get_platform(_DEVICE)
    return LaggingCopies() if _DEVICE == "cpu" else LaggingDeviceCopies()
