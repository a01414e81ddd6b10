"""Host buffers pinned ahead of the step that takes them, and reused by the next offload once
compute has waited for their copy."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import nullcontext

import pytest
import torch

from pipeswap.platform import Stream, get_platform
from pipeswap.platform.cpu import CpuEvent, CpuPlatform, WorkerStream, _allocation_events
from pipeswap.swap import LayerChain, SwapManager, layer_hooks, size_class

DEVICE = os.environ.get("PIPESWAP_TEST_DEVICE", "cpu")  # see conftest.py


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                               torch.nn.Linear(256, 96), torch.nn.Tanh(),
                               torch.nn.Linear(96, 8))


def _forward(mgr: SwapManager, model: torch.nn.Module, x: torch.Tensor, name: str
             ) -> torch.Tensor:
    with mgr.group_context(name):
        loss: torch.Tensor = model(x).square().sum()
    mgr.protect_alias_tensors(name, x)  # the chunk's input, as an executor protects it
    return loss


def _offloaded_step(mgr: SwapManager, model: torch.nn.Module, x: torch.Tensor
                    ) -> tuple[list[torch.Tensor], int]:
    """One forward and backward with its group offloaded and loaded back; the gradients,
    and how many host buffers the profiler saw allocated (on CPU; else -1)."""
    on_cpu = isinstance(mgr.platform, CpuPlatform)
    profiler = torch.autograd.profiler.profile(use_kineto=True, profile_memory=True)
    with profiler if on_cpu else nullcontext():
        loss = _forward(mgr, model, x, "step")
        for call in (mgr.launch_offload, mgr.wait_offload, mgr.launch_load, mgr.wait_load):
            call("step")
        loss.backward()  # type: ignore[no-untyped-call]
        mgr.finish_group("step")
    pinned = -1
    if on_cpu and profiler.kineto_results is not None:
        pinned = sum(1 for event in _allocation_events(profiler.kineto_results)
                     if event.host and event.nbytes > 0)
    return [p.grad for p in model.parameters() if p.grad is not None], pinned


def test_reserving_one_microbatchs_buffers_leaves_its_step_nothing_to_pin() -> None:
    platform = get_platform(DEVICE)
    x = torch.randn(32, 64)
    plain_model = _model()
    plain = SwapManager(platform)
    plain.protect_module(plain_model)
    expected, pinned_plain = _offloaded_step(plain, plain_model, x)
    allocated = plain.stats().host_buffers_allocated
    assert allocated >= 4  # what an unreserved step pins, in the step
    if pinned_plain >= 0:
        assert pinned_plain == allocated  # the profiler sees each of them

    model = _model()
    mgr = SwapManager(platform)
    mgr.protect_module(model)
    probe = _forward(mgr, model, x, "probe")  # a forward on the same shapes, not offloaded
    sizes = mgr.movable_sizes("probe")
    mgr.abort_group("probe")
    del probe
    assert len(sizes) == allocated
    assert mgr.reserve_host(sizes) == sum(size_class(n) for n in sizes)
    before = mgr.stats()
    grads, pinned = _offloaded_step(mgr, model, x)
    after = mgr.stats()
    assert after.bytes_offloaded == sum(sizes) > 0
    assert after.host_buffers_allocated == before.host_buffers_allocated == len(sizes)
    assert after.host_bytes_reserved == after.host_bytes_allocated == before.host_bytes_reserved
    if pinned >= 0:
        assert pinned == 0  # the allocator's word too: no host buffer allocated in the step
    for got, want in zip(grads, expected):
        assert torch.equal(got, want)


class UnobservedEvent(CpuEvent):
    """An event whose end the host learns only by synchronizing on it, as on a GPU, where
    compute waiting for a copy tells the host nothing: :meth:`query` stays False until
    then, even though the CPU's compute (the calling thread) really waited."""

    def __init__(self, platform: CpuPlatform) -> None:
        super().__init__(platform)
        self.seen = False

    def record(self, stream: Stream | None = None) -> None:
        super().record(stream)
        self.seen = False

    def wait(self, stream: Stream | None = None) -> None:
        if isinstance(self._platform._resolve(stream), WorkerStream):
            super().wait(stream)
        else:
            super().synchronize()  # compute waits; the host is not told (self.seen)

    def query(self) -> bool:
        return self.seen or self._done is None

    def synchronize(self) -> None:
        super().synchronize()
        self.seen = True


class UnobservedCopies(CpuPlatform):
    def new_event(self) -> CpuEvent:
        return UnobservedEvent(self)


@pytest.fixture
def on_cpu() -> Iterator[None]:
    """Tensors on the CPU, whatever the test device: the tests below model a GPU there."""
    with torch.device("cpu"):
        yield


def test_a_buffer_compute_waited_for_is_reused_before_the_host_sees_its_copy_end(
        on_cpu: None) -> None:
    mgr = SwapManager(UnobservedCopies())
    for step in range(3):
        x = torch.randn(2048, requires_grad=True)
        with mgr.group_context(f"g{step}"):
            loss = x.exp().sum()
        for call in (mgr.launch_offload, mgr.wait_offload, mgr.launch_load, mgr.wait_load):
            call(f"g{step}")
        loss.backward()  # type: ignore[no-untyped-call]
        mgr.finish_group(f"g{step}")
        assert x.grad is not None and torch.equal(x.grad, x.detach().exp())
    stats = mgr.stats()
    assert stats.host_buffers_allocated == 1 and stats.host_bytes_in_use == 0


def test_buffers_of_storages_the_next_layer_took_over_are_reused_once_compute_waited(
        on_cpu: None) -> None:
    """Each Tanh's output, copied by its layer's offload, moves to the next layer (whose
    Linear saves it again) while that copy may run; its buffer is free again once compute
    has waited for the copy (the layer is freed), so later steps pin nothing new."""
    mgr = SwapManager(UnobservedCopies())
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(3)]
    model = torch.nn.Sequential(*layers)
    mgr.protect_module(model)
    active: list[LayerChain] = []
    remove = layer_hooks(layers, lambda: active[0] if active else None)
    allocated = []
    for step in range(3):
        x = torch.randn(32, 64, requires_grad=True)
        (expected,) = torch.autograd.grad(model(x).square().sum(), x)
        chain = LayerChain(mgr, [f"s{step}.l{index}" for index in range(3)])
        chain.protect(x)
        active.append(chain)
        with chain.forward():
            loss: torch.Tensor = model(x).square().sum()
        active.clear()
        chain.forward_done()
        for call in (chain.wait_offload, chain.launch_load, chain.wait_load):
            call()
        loss.backward()  # type: ignore[no-untyped-call]
        chain.finish()
        allocated.append(mgr.stats().host_buffers_allocated)
        assert mgr.stats().bytes_offloaded > 0 and x.grad is not None
        assert torch.equal(x.grad, expected)
    remove()
    assert allocated == [allocated[0]] * 3
