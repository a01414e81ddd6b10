"""The accelerator platform orders its own device's streams, whichever device is current.

Runs without an accelerator: torch's device and stream state is replaced by a model of what
torch documents for it (a current device; a current stream per device; ``set_stream`` makes
the stream's device current; ``Event.record()`` and ``Event.wait()`` with no stream use the
current device's stream, and recording an event of one device on another's stream fails), so
these tests check which device and stream the platform asks torch for, not CUDA itself
(``test_platform_accelerator.py`` runs on a real device where there is one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from pipeswap.platform.accelerator import AcceleratorPlatform


@dataclass(frozen=True)
class FakeStream:
    device_index: int
    name: str

    def synchronize(self) -> None:
        """Nothing runs on it."""


@dataclass
class FakeTorch:
    """Two devices, device 0 current; each device's current stream starts as its default."""

    device: int = 0
    streams: dict[int, FakeStream] = field(
        default_factory=lambda: {i: FakeStream(i, f"default{i}") for i in (0, 1)})
    pinned_on: list[int] = field(default_factory=list)  # the current device at each pinning
    events: list[FakeEvent] = field(default_factory=list)  # every torch.Event made

    def current_device_index(self) -> int:
        return self.device

    def current_stream(self, device: torch.device | int | None = None) -> FakeStream:
        if isinstance(device, torch.device):
            device = device.index
        return self.streams[self.device if device is None else device]

    def set_stream(self, stream: FakeStream) -> None:
        self.streams[stream.device_index] = stream
        self.device = stream.device_index  # as torch.accelerator.set_stream documents

    def device_index(self, index: int | None) -> DeviceIndex:
        return DeviceIndex(self, index)

    def new_stream(self, device: torch.device) -> FakeStream:
        assert device.index is not None
        return FakeStream(device.index, "side")

    def new_event(self, device: torch.device) -> FakeEvent:
        self.events.append(FakeEvent(self, device))
        return self.events[-1]

    def empty(self, nbytes: int, **kwargs: object) -> torch.Tensor:
        assert kwargs.get("pin_memory") is True and kwargs.get("device") == "cpu"
        self.pinned_on.append(self.device)
        return torch.zeros(nbytes, dtype=torch.uint8)


class DeviceIndex:
    def __init__(self, fake: FakeTorch, index: int | None) -> None:
        self.fake, self.index, self.previous = fake, index, fake.device

    def __enter__(self) -> None:
        self.previous = self.fake.device
        if self.index is not None:
            self.fake.device = self.index

    def __exit__(self, *exc: object) -> None:
        if self.index is not None:
            self.fake.device = self.previous


class FakeEvent:
    def __init__(self, fake: FakeTorch, device: torch.device) -> None:
        self.fake, self.device = fake, device
        self.recorded: list[FakeStream] = []
        self.waited: list[FakeStream] = []

    def _resolve(self, stream: FakeStream | None) -> FakeStream:
        return self.fake.current_stream() if stream is None else stream

    def record(self, stream: FakeStream | None = None) -> None:
        target = self._resolve(stream)
        if target.device_index != self.device.index:  # as c10's Event::record refuses
            raise RuntimeError(f"Event device index {self.device.index} does not match "
                               f"recording stream's device index {target.device_index}")
        self.recorded.append(target)

    def wait(self, stream: FakeStream | None = None) -> None:
        self.waited.append(self._resolve(stream))


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeTorch:
    state = FakeTorch()
    for name in ("current_device_index", "current_stream", "set_stream", "device_index"):
        monkeypatch.setattr(torch.accelerator, name, getattr(state, name))
    monkeypatch.setattr(torch, "Stream", lambda device: state.new_stream(device))
    monkeypatch.setattr(torch, "Event", lambda device: state.new_event(device))
    return state


def test_events_default_to_the_platform_devices_stream_not_the_current_devices(
        fake: FakeTorch) -> None:
    platform = AcceleratorPlatform(torch.device("cuda", 1))
    event = platform.new_event()
    event.record()
    event.wait()
    (inner,) = fake.events  # the torch.Event behind it
    assert inner.recorded == [fake.streams[1]] and inner.waited == [fake.streams[1]]
    assert fake.device == 0
    side = platform.new_stream()
    with platform.stream(side):
        event.record()  # the platform's current stream is the side stream now
    event.wait(side)
    assert inner.recorded[-1] == side and inner.waited[-1] == side


def test_a_stream_block_restores_the_callers_device_and_the_platforms_stream(
        fake: FakeTorch) -> None:
    platform = AcceleratorPlatform(torch.device("cuda", 1))
    side = platform.new_stream()
    with platform.stream(side):
        assert platform.current_stream() == side
        assert fake.streams[0].name == "default0"  # device 0's stream is untouched
    assert fake.device == 0  # set_stream alone would have left device 1 current
    assert platform.current_stream() == fake.streams[1] == FakeStream(1, "default1")


def test_host_buffers_are_pinned_with_the_platforms_device_current(
        fake: FakeTorch, monkeypatch: pytest.MonkeyPatch) -> None:
    platform = AcceleratorPlatform(torch.device("cuda", 1))
    with monkeypatch.context() as patch:
        patch.setattr(torch, "empty", fake.empty)
        buffer = platform.host_buffer(64)
    assert buffer.numel() == 64 and fake.pinned_on == [1] and fake.device == 0


def test_a_device_without_an_index_is_the_current_one_from_then_on(fake: FakeTorch) -> None:
    fake.device = 1
    platform = AcceleratorPlatform(torch.device("cuda"))
    fake.device = 0
    assert platform.device == torch.device("cuda", 1)
    platform.new_event().record()  # records on device 1's stream: no device mismatch
