"""The swap manager on the CPU platform (worker-thread copy streams), with real autograd."""

from __future__ import annotations

import math
import os
import threading
import warnings
import weakref
from collections.abc import Callable

import pytest
import torch

from pipeswap.platform import Platform, get_platform
from pipeswap.platform.cpu import CpuPlatform, WorkerStream
from pipeswap.swap import (
    GroupState,
    InPlaceModificationError,
    PoolExhaustedError,
    SwapError,
    SwapManager,
    SwapResidencyError,
)

DEVICE = os.environ.get("PIPESWAP_TEST_DEVICE", "cpu")  # see conftest.py

Model = Callable[[torch.Tensor], torch.Tensor]


@pytest.fixture
def mgr() -> SwapManager:
    return SwapManager(get_platform(DEVICE))


def backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]


def _round_trip(mgr: SwapManager, name: str) -> None:
    mgr.launch_offload(name)
    mgr.wait_offload(name)
    mgr.launch_load(name)
    mgr.wait_load(name)


def _grads(model: torch.nn.Module, x: torch.Tensor, mgr: SwapManager | None) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    if mgr is None:
        loss = model(x).sum()
    else:
        with mgr.group_context("g"):
            loss = model(x).sum()
        _round_trip(mgr, "g")
    backward(loss)
    assert x.grad is not None
    return [x.grad.clone(), *(p.grad.clone() for p in model.parameters() if p.grad is not None)]


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # views of one storage
        scores = (q @ k.transpose(-2, -1)) / 4.0
        mixed = torch.softmax(scores, dim=-1) @ v
        out: torch.Tensor = self.out(torch.nn.functional.gelu(mixed)) + x
        return out


class InPlaceAndDtypes(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16).to(torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.relu_(h * 1.0)  # in-place op autograd allows
        t = h.transpose(-2, -1).contiguous().transpose(-2, -1)  # transposed views
        d = self.b(t.to(torch.float64))  # a float64 leg
        out: torch.Tensor = (d.to(torch.float32) * h).tanh() + h * h  # h saved more than once
        return out


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16)),
        Attention,
        InPlaceAndDtypes,
    ],
)
def test_gradients_are_bit_identical_with_swap(make: Callable[[], torch.nn.Module]) -> None:
    torch.manual_seed(0)
    model = make()
    x = torch.randn(4, 8, 16)
    reference = _grads(model, x, None)
    mgr = SwapManager(get_platform(DEVICE))
    mgr.protect_module(model)
    swapped = _grads(model, x, mgr)
    assert mgr.stats().bytes_offloaded > 0
    assert len(reference) == len(swapped)
    for want, got in zip(reference, swapped):
        assert torch.equal(want, got)


class _Watch:
    """A weak handle on a tensor's storage, to read its size once only autograd holds the
    tensor. Not the storage object itself: a tensor can be built over it at any time, so swap
    keeps on the device a storage whose object the program holds."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._ref = weakref.ref(tensor.untyped_storage())

    def storage(self) -> torch.UntypedStorage:
        storage = self._ref()
        assert storage is not None, "the storage died: nothing saved holds it any more"
        return storage

    def nbytes(self) -> int:
        return self.storage().nbytes()


def _storages(*tensors: torch.Tensor) -> list[_Watch]:
    return [_Watch(t) for t in tensors]


def _on(watch: _Watch) -> torch.Tensor:
    """A new float32 tensor over the storage (how a program could reach a released one)."""
    return torch.empty(0).set_(watch.storage())


def test_device_memory_is_released_and_accounted_exactly(mgr: SwapManager) -> None:
    x = torch.randn(64, 64, requires_grad=True)
    w = torch.randn(64, 64, requires_grad=True)

    def forward() -> tuple[torch.Tensor, list[_Watch]]:
        a, b = x * 0.1, w * 0.1
        y = (a @ b).exp()  # saves a, b and exp's output: nothing else holds them
        return y.sum(), _storages(a, b, y)

    backward(forward()[0])
    expected = x.grad
    x.grad = None
    with mgr.group_context("g"):
        loss, saved = forward()
    held = mgr.stats().device_bytes_held
    assert held == 3 * 64 * 64 * 4  # one storage each
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    assert [storage.nbytes() for storage in saved] == [0, 0, 0]
    stats = mgr.stats()
    assert stats.device_bytes_held == 0 and stats.bytes_offloaded == held
    assert stats.host_bytes_in_use >= held and stats.peak_device_bytes_held == held
    assert stats.bytes_kept_referenced == 0
    mgr.launch_load("g")
    mgr.wait_load("g")
    stats = mgr.stats()
    assert stats.device_bytes_held == held and stats.bytes_reloaded == held
    assert stats.host_bytes_in_use == 0
    backward(loss)
    assert x.grad is not None and expected is not None and torch.equal(x.grad, expected)
    mgr.finish_group("g")
    assert mgr.stats().device_bytes_held == 0 and mgr.active_group_count() == 0


def test_views_of_one_storage_are_copied_once_and_all_restored(mgr: SwapManager) -> None:
    base = torch.randn(10, 10, requires_grad=True)
    with mgr.group_context("g"):
        a = base * 2
        parts = [a[:5].sin(), a[5:].cos(), a.t().exp()]  # three views of a saved
        loss = torch.stack([p.sum() for p in parts]).sum()
    # a is saved three times (by sin, cos and, through its transpose, nowhere else: exp saves
    # its output): one entry for a's storage, one for exp's output; base * 2 saves nothing
    assert mgr.stats().device_bytes_held == 2 * 100 * 4
    _round_trip(mgr, "g")
    backward(loss)
    assert base.grad is not None
    expected = 2 * torch.cat([(base[:5] * 2).cos(), -(base[5:] * 2).sin()]) + \
        2 * (base * 2).t().exp().t()
    assert torch.allclose(base.grad, expected)


def test_protected_aliases_are_never_freed(mgr: SwapManager) -> None:
    layer = torch.nn.Linear(8, 8)
    alias = layer.weight.detach()  # shares the parameter's storage, not a Parameter
    x = torch.randn(2, 8, requires_grad=True)
    mgr.protect_module(layer)
    with mgr.group_context("g"):
        out = (x @ alias).sum() + layer(x).sum()
    keep = torch.randn(4, 8, requires_grad=True)
    with mgr.group_context("g"):
        out = out + (keep * keep).sum()
    mgr.protect_alias_tensors("g", {"inputs": [keep]})
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    assert layer.weight.untyped_storage().nbytes() == 8 * 8 * 4
    assert keep.untyped_storage().nbytes() == 4 * 8 * 4
    assert x.untyped_storage().nbytes() == 2 * 8 * 4  # the test still holds x: kept
    assert mgr.stats().skipped["parameter"] >= 1
    assert mgr.stats().skipped["referenced outside saved activations"] == 1
    mgr.launch_load("g")
    mgr.wait_load("g")
    backward(out)


def test_a_storage_shared_across_groups_stays_resident(mgr: SwapManager) -> None:
    shared = torch.randn(16, 16, requires_grad=True)
    with mgr.group_context("first"):
        a = shared.sin().sum()  # saves shared
    with mgr.group_context("second"):
        b = shared.cos().sum()  # saves shared again, in another group
    assert mgr.stats().skipped["shared across groups"] == 1
    mgr.launch_offload("first")
    mgr.wait_offload("first")
    assert shared.untyped_storage().nbytes() == 16 * 16 * 4
    mgr.launch_load("first")
    mgr.wait_load("first")
    backward(a + b)


class _SaveOnly(torch.autograd.Function):
    """Saves its input without reading it, like an op whose kernel ran before the save."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.zeros(())

    @staticmethod
    def backward(ctx: torch.autograd.function.BackwardCFunction, grad: torch.Tensor
                 ) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.zeros_like(x)


def test_sharing_with_a_group_whose_offload_is_in_flight_keeps_the_storage(
    mgr: SwapManager,
) -> None:
    shared = torch.randn(16, 16, requires_grad=True)
    with mgr.group_context("first"):
        a = shared.sin().sum()
    mgr.launch_offload("first")  # the copy is in flight; nothing is freed yet
    with mgr.group_context("second"):
        b = shared.cos().sum()
    mgr.wait_offload("first")
    assert shared.untyped_storage().nbytes() == 16 * 16 * 4
    assert mgr.stats().host_bytes_in_use == 0  # the stale copy's buffer went back
    mgr.launch_load("first")
    mgr.wait_load("first")
    backward(a + b)
    assert shared.grad is not None
    assert torch.equal(shared.grad, shared.detach().cos() - shared.detach().sin())


def test_saving_a_storage_another_group_offloaded_is_refused(mgr: SwapManager) -> None:
    x = torch.randn(16, 16, requires_grad=True)
    with mgr.group_context("first"):
        shared = x * 1
        a = shared.sin().sum()
    (storage,) = _storages(shared)
    del shared  # only autograd holds it: the offload releases it
    mgr.launch_offload("first")
    mgr.wait_offload("first")
    with pytest.raises(SwapResidencyError, match=r"group_context\('second'\).*group 'first' "
                       r"\(offloaded\).*protect_alias_tensors\('first'"):
        with mgr.group_context("second"):  # reached through the storage: not legal
            _SaveOnly.apply(_on(storage).requires_grad_())  # type: ignore[no-untyped-call]
    mgr.launch_load("first")  # the first group is untouched by the refusal
    mgr.wait_load("first")
    backward(a)
    assert x.grad is not None and torch.equal(x.grad, x.detach().cos())


def test_protection_counts_until_wait_offload_and_is_refused_after(mgr: SwapManager) -> None:
    x = torch.randn(32, 32, requires_grad=True)

    def forward(name: str) -> tuple[torch.Tensor, _Watch]:
        with mgr.group_context(name):
            h = x.exp()
            loss = (h * h).sum()  # saves h
        return loss, _Watch(h)

    a, h_storage = forward("late")
    mgr.launch_offload("late")
    mgr.protect_alias_tensors("late", [_on(h_storage)])  # in flight: still in time
    mgr.wait_offload("late")
    assert h_storage.nbytes() == 32 * 32 * 4
    mgr.launch_load("late")
    mgr.wait_load("late")
    backward(a)

    b, h_storage = forward("too late")
    mgr.launch_offload("too late")
    mgr.wait_offload("too late")
    with pytest.raises(SwapError, match=r"protect_alias_tensors\('too late'\): group is "
                       "offloaded and a storage to protect is already off the device"):
        mgr.protect_alias_tensors("too late", [_on(h_storage)])
    mgr.launch_load("too late")  # the refusal changed nothing: h comes back with the group
    mgr.wait_load("too late")
    assert h_storage.nbytes() == 32 * 32 * 4
    backward(b)


@pytest.mark.parametrize(
    ("calls", "message"),
    [
        (["wait_offload"], "wait_offload('g'): group is collecting, wait_offload needs it offloading"),
        (["launch_offload", "launch_offload"], "group is offloading, launch_offload needs it collecting"),
        (["launch_offload", "launch_load"], "call wait_offload first"),
        (["launch_offload", "wait_offload", "wait_load"], "group is offloaded, wait_load needs it loading"),
        (["launch_load"], "group is collecting, launch_load needs it offloaded"),
    ],
)
def test_illegal_calls_name_the_group_state_and_call(
    mgr: SwapManager, calls: list[str], message: str
) -> None:
    x = torch.randn(8, requires_grad=True)
    with mgr.group_context("g"):
        (x * x).sum()
    *legal, illegal = calls
    for call in legal:
        getattr(mgr, call)("g")
    with pytest.raises(SwapError, match=message.replace("(", r"\(").replace(")", r"\)")):
        getattr(mgr, illegal)("g")
    mgr.abort_group("g")
    assert mgr.active_group_count() == 0


def test_unknown_groups_and_collecting_during_a_transfer(mgr: SwapManager) -> None:
    with pytest.raises(SwapError, match=r"launch_offload\('nope'\): no such group"):
        mgr.launch_offload("nope")
    x = torch.randn(8, requires_grad=True)
    with mgr.group_context("g"):
        (x * x).sum()
    mgr.launch_offload("g")
    with pytest.raises(SwapError, match="group_context.*group is offloading"):
        with mgr.group_context("g"):
            pass
    mgr.abort_group("g")


def test_backward_never_reads_an_offloaded_activation(mgr: SwapManager) -> None:
    x = torch.randn(32, requires_grad=True)
    with mgr.group_context("g"):
        loss = (x.exp()).sum()
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    with pytest.raises(SwapResidencyError, match="group 'g', which is offloaded"):
        backward(loss)
    mgr.abort_group("g")  # puts the storage back
    assert x.untyped_storage().nbytes() == 32 * 4


def test_load_on_demand_warns_and_keeps_numerics() -> None:
    mgr = SwapManager(get_platform(DEVICE), load_on_demand=True)
    x = torch.randn(32, requires_grad=True)
    with mgr.group_context("g"):
        loss = (x.exp()).sum()
    expected = x.detach().exp()
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    with pytest.warns(UserWarning, match="on demand"):
        backward(loss)
    assert x.grad is not None and torch.equal(x.grad, expected)


def test_load_on_demand_during_a_load_in_flight_waits_for_it() -> None:
    mgr = SwapManager(get_platform(DEVICE), load_on_demand=True)
    x = torch.randn(1 << 16, requires_grad=True)
    with mgr.group_context("g"):
        loss = (x.exp()).sum()
    expected = x.detach().exp()
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    mgr.launch_load("g")  # the copy back may still be running when backward starts
    with pytest.warns(UserWarning, match="on demand"):
        backward(loss)
    assert x.grad is not None and torch.equal(x.grad, expected)
    mgr.wait_load("g")
    stats = mgr.stats()
    assert stats.bytes_reloaded == stats.bytes_offloaded == x.numel() * 4  # counted once
    mgr.finish_group("g")
    assert mgr.stats().host_bytes_in_use == 0 and mgr.stats().device_bytes_held == 0


def _inplace_after_save(mgr: SwapManager | None, moves: int) -> BaseException | None:
    """Save exp's output, write it in place, optionally swap it, then backward: the error."""
    x = torch.randn(1000, requires_grad=True)
    if mgr is None:
        y = (x * 2).exp()
        loss = y.sum()
    else:
        with mgr.group_context("g"):
            y = (x * 2).exp()
            loss = y.sum()
    y.mul_(3)
    steps = [mgr.launch_offload, mgr.wait_offload, mgr.launch_load, mgr.wait_load] if mgr else []
    for call in steps[:moves]:
        call("g")
    try:
        backward(loss)
    except RuntimeError as exc:
        return exc
    finally:
        if mgr is not None:
            mgr.abort_group("g")
    return None


@pytest.mark.parametrize("moves", [0, 1, 2, 4], ids=["collecting", "offloading", "kept",
                                                     "reloaded"])
def test_an_in_place_write_after_save_fails_backward_as_without_swap(
    mgr: SwapManager, moves: int
) -> None:
    plain = _inplace_after_save(None, 0)
    assert plain is not None and "modified by an inplace operation" in str(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # y is held, so it stays on the device
        swapped = _inplace_after_save(mgr, moves)
    assert isinstance(swapped, InPlaceModificationError)
    assert "modified by an inplace operation" in str(swapped)
    assert "is at version 1; expected version 0" in str(swapped)
    assert mgr.active_group_count() == 0 and mgr.stats().host_bytes_in_use == 0


def test_an_in_place_write_to_a_released_activation_fails_backward(mgr: SwapManager) -> None:
    """The saved entry's alias shares the tensor's version counter: a write made before the
    program dropped the tensor still fails backward after the storage was released and
    reloaded (the copies themselves bump no version)."""
    x = torch.randn(64, requires_grad=True)
    with mgr.group_context("g"):
        y = x.exp()
        loss = y.sum()
    with torch.no_grad():
        y.add_(1)
    (storage,) = _storages(y)
    del y
    _round_trip(mgr, "g")
    assert mgr.stats().bytes_offloaded == storage.nbytes() == 64 * 4  # it was released
    with pytest.raises(InPlaceModificationError, match="is at version 1; expected version 0"):
        backward(loss)
    mgr.abort_group("g")


def test_a_saved_parameter_written_before_backward_fails_as_without_swap(
    mgr: SwapManager,
) -> None:
    layer = torch.nn.Linear(8, 8)
    mgr.protect_module(layer)
    x = torch.randn(4, 8, requires_grad=True)  # so backward needs the weight
    plain = layer(x).exp().sum()
    with mgr.group_context("g"):
        loss = layer(x).exp().sum()
    with torch.no_grad():
        layer.weight.add_(1)  # an optimizer step before backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        backward(plain)
    with pytest.raises(InPlaceModificationError, match="modified by an inplace operation"):
        backward(loss)
    mgr.abort_group("g")


def test_abort_restores_everything_and_the_manager_goes_on(mgr: SwapManager) -> None:
    x = torch.randn(64, requires_grad=True)
    with mgr.group_context("g"):
        loss = (x.exp()).sum()
    expected = x.detach().exp()
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    mgr.abort_group("g")
    assert x.untyped_storage().nbytes() == 64 * 4
    assert mgr.stats().host_bytes_in_use == 0 and mgr.active_group_count() == 0
    backward(loss)  # the data came back
    assert x.grad is not None and torch.equal(x.grad, expected)
    mgr.abort_group("g")  # a missing group: no-op
    y = torch.randn(8, requires_grad=True)
    with mgr.group_context("next"):
        loss2 = (y * y).sum()
    _round_trip(mgr, "next")
    backward(loss2)


def test_host_buffers_are_reused_in_steady_state(mgr: SwapManager) -> None:
    for step in range(3):
        x = torch.randn(256, requires_grad=True)
        with mgr.group_context(f"step{step}"):
            loss = x.exp().sum()
        _round_trip(mgr, f"step{step}")
        backward(loss)
        mgr.finish_group(f"step{step}")
        if step == 0:
            after_first = mgr.stats().host_buffers_allocated
    assert mgr.stats().host_buffers_allocated == after_first


def test_small_tensors_stay_below_the_threshold() -> None:
    mgr = SwapManager(get_platform(DEVICE), min_bytes=1024)
    x_small, x_big = torch.randn(8, requires_grad=True), torch.randn(1024, requires_grad=True)
    with mgr.group_context("g"):
        small, big = x_small * 1, x_big * 1
        loss = small.sin().sum() + big.sin().sum()  # sin saves its input
    storages = _storages(small, big)
    del small, big
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    assert [storage.nbytes() for storage in storages] == [8 * 4, 0]
    assert mgr.stats().skipped["below min_bytes"] == 1
    mgr.launch_load("g")
    mgr.wait_load("g")
    backward(loss)


def test_a_failed_launch_leaves_the_group_intact_and_returns_its_buffers() -> None:
    mgr = SwapManager(get_platform(DEVICE), pool_bytes=64 * 1024)
    tensors = [torch.randn(4096, requires_grad=True) for _ in range(6)]  # 16 KiB each
    with mgr.group_context("g"):
        loss = torch.stack([(t * 1).sin().sum() for t in tensors]).sum()
    with pytest.raises(PoolExhaustedError, match="raise the cap .SwapManager's pool_bytes"):
        mgr.launch_offload("g")  # the fifth buffer does not fit under the cap
    assert mgr.group_state("g") is GroupState.COLLECTING
    assert mgr.stats().host_bytes_in_use == 0
    assert mgr.stats().device_bytes_held == 6 * 4096 * 4  # nothing was freed
    mgr.abort_group("g")
    backward(loss)  # nothing was lost
    assert all(t.grad is not None and torch.equal(t.grad, t.detach().cos()) for t in tensors)


def test_groups_on_two_threads_do_not_mix() -> None:
    mgr = SwapManager(get_platform(DEVICE))
    errors: list[BaseException] = []

    def step(name: str) -> None:
        try:
            for _ in range(5):
                x = torch.randn(512, requires_grad=True, device=DEVICE)  # a thread's own default
                with mgr.group_context(name):
                    loss = x.sin().sum()
                expected = x.detach().cos()
                _round_trip(mgr, name)
                backward(loss)
                assert x.grad is not None and torch.equal(x.grad, expected)
                mgr.finish_group(name)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            errors.append(exc)

    threads = [threading.Thread(target=step, args=(f"t{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert mgr.active_group_count() == 0 and mgr.stats().device_bytes_held == 0


def test_nested_group_contexts_restore_the_outer_group(mgr: SwapManager) -> None:
    leaves = [torch.randn(64, requires_grad=True) for _ in range(3)]
    with mgr.group_context("outer"):
        a, b, c = (leaf * 1 for leaf in leaves)
        outer_first = a.sin().sum()
        with mgr.group_context("inner"):
            inner = b.sin().sum()
        outer_last = c.sin().sum()  # back in the outer group
    storages = _storages(a, b, c)
    del a, b, c
    mgr.launch_offload("inner")
    mgr.wait_offload("inner")
    assert [s.nbytes() for s in storages] == [64 * 4, 0, 64 * 4]  # only the inner save moved
    mgr.launch_offload("outer")
    mgr.wait_offload("outer")
    assert [s.nbytes() for s in storages] == [0, 0, 0]
    for name in ("inner", "outer"):
        mgr.launch_load(name)
        mgr.wait_load(name)


def test_the_manager_does_not_keep_freed_activations_alive(mgr: SwapManager) -> None:
    x = torch.randn(1024, requires_grad=True)
    with mgr.group_context("g"):
        h = x * 2
        loss = h.sin().sum()  # autograd saves h; after backward nothing needs it
    saved = weakref.ref(h)
    del h
    _round_trip(mgr, "g")
    backward(loss)
    del loss
    assert saved() is None  # autograd released it, and swap did not hold on to it
    mgr.finish_group("g")
    assert mgr.stats().device_bytes_held == 0


def test_reset_peak_starts_from_what_is_held(mgr: SwapManager) -> None:
    x = torch.randn(256, requires_grad=True)
    with mgr.group_context("big"):
        big = (x * x).sum()  # saves x twice: one storage
    backward(big)
    mgr.finish_group("big")
    assert mgr.stats().peak_device_bytes_held == 1024 and mgr.stats().device_bytes_held == 0
    mgr.reset_peak()
    assert mgr.stats().peak_device_bytes_held == 0
    y = torch.randn(16, requires_grad=True)
    with mgr.group_context("small"):
        small = y.sin().sum()
    assert mgr.stats().peak_device_bytes_held == 64
    backward(small)


def test_group_bytes_split_what_moves_from_what_stays(mgr: SwapManager) -> None:
    x = torch.randn(64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    with mgr.group_context("g"):
        loss = (x.exp() * w).sum()  # saves exp(x) (its output) and w; exp saves its output
    mgr.protect_alias_tensors("g", [w])
    held, movable = mgr.group_bytes("g").held, mgr.group_bytes("g").movable
    assert (held, movable) == (2 * 64 * 4, 64 * 4)
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    assert mgr.group_bytes("g") == type(mgr.group_bytes("g"))(64 * 4, 0)
    assert mgr.stats().bytes_offloaded == movable
    mgr.launch_load("g")
    mgr.wait_load("g")
    backward(loss)


def test_tensors_the_program_still_holds_are_never_freed(mgr: SwapManager) -> None:
    """docs/swap.md's example: the input is a slice of a batch the program keeps. Releasing its
    storage would make reading or writing ``x`` or ``batch`` a use-after-free."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    batch = torch.randn(32, 16)
    x = batch[:8]
    mgr.protect_module(model)
    expected = torch.autograd.grad(model(x).sum(), list(model.parameters()))
    before = batch.clone()
    with mgr.group_context("mb0"):
        out = model(x)
        loss = out.sum()
    mgr.protect_alias_tensors("mb0", [out])
    with pytest.warns(UserWarning, match="still references it"):
        mgr.launch_offload("mb0")
    mgr.wait_offload("mb0")
    assert torch.equal(batch, before) and torch.equal(x, before[:8])  # readable: not freed
    batch.data.add_(0)  # and writable (through .data: no version bump for autograd to see)
    stats = mgr.stats()
    assert stats.bytes_kept_referenced == batch.untyped_storage().nbytes()
    assert stats.skipped["referenced outside saved activations"] == 1
    assert stats.bytes_offloaded > 0  # the activations nothing else holds did move
    mgr.launch_load("mb0")
    mgr.wait_load("mb0")
    got = torch.autograd.grad(loss, list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    mgr.finish_group("mb0")
    assert mgr.stats().host_bytes_in_use == 0


def test_a_cpp_holder_outside_the_group_keeps_the_storage(mgr: SwapManager) -> None:
    """An op outside the group saved the group's activation (no hooks): autograd reads it
    directly in backward, so it must stay on the device."""
    x = torch.randn(100, requires_grad=True)
    w = torch.randn(100, requires_grad=True)

    def forward() -> torch.Tensor:
        with mgr.group_context("g"):
            y = x.exp()
        return (y * w).sum()  # mul saves y outside the group

    loss = forward()
    with pytest.warns(UserWarning, match="still references it"):
        _round_trip(mgr, "g")
    assert mgr.stats().bytes_kept_referenced == 100 * 4
    backward(loss)
    assert w.grad is not None and torch.equal(w.grad, x.detach().exp())
    mgr.finish_group("g")


def test_exiting_with_an_offload_in_flight_exits_cleanly() -> None:
    """The interpreter used to abort ("terminate called without an active exception") when
    it exited while a copy stream was still copying."""
    import subprocess
    import sys

    program = (
        "import torch\n"
        "from pipeswap.platform import get_platform\n"
        "from pipeswap.swap import SwapManager\n"
        "mgr = SwapManager(get_platform('cpu'))\n"
        "def forward():\n"
        "    x = torch.randn(2048, 2048, requires_grad=True)\n"
        "    with mgr.group_context('g'):\n"
        "        return (x * 1).exp().sum()\n"
        "loss = forward()\n"
        "mgr.launch_offload('g')\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "terminate called" not in done.stderr


def test_memory_reused_while_copies_run_leaves_values_intact(copy_platform: Platform) -> None:
    """Each group waited for right after its launch, and tensors as large as everything moved
    so far allocated and filled with NaN right after each launch and each wait, with two
    loads in flight at once. A storage freed before its copy to host ended, or read before
    its load ended, would lend its bytes to one of them (on a GPU: without the stream waits
    the manager records), and a gradient would show it. (``copy_platform``: see
    conftest.py.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Attention() for _ in range(4)))
    xs = [torch.randn(8, 64, 16) for _ in range(3)]
    want = [_grads(model, x, None) for x in xs]
    mgr = SwapManager(copy_platform, min_bytes=0)
    litter: list[torch.Tensor] = []

    def fill() -> None:
        moved = mgr.stats().bytes_offloaded
        litter.append(torch.empty(max(1, moved // 4)).fill_(math.nan))

    for _ in range(2):
        leaves = [x.detach().requires_grad_(True) for x in xs]
        losses = []
        for index, leaf in enumerate(leaves):
            with mgr.group_context(f"g{index}"):
                losses.append(model(leaf).sum())
            mgr.protect_alias_tensors(f"g{index}", [leaf])  # the input stays, as in a stage
            mgr.launch_offload(f"g{index}")
            fill()
            mgr.wait_offload(f"g{index}")
            fill()
        got: list[list[torch.Tensor]] = []
        mgr.launch_load("g2")
        for index in reversed(range(3)):
            if index:
                mgr.launch_load(f"g{index - 1}")
            fill()
            mgr.wait_load(f"g{index}")
            fill()
            model.zero_grad(set_to_none=True)
            backward(losses[index])
            mgr.finish_group(f"g{index}")
            grad = leaves[index].grad
            assert grad is not None
            got.insert(0, [grad, *(p.grad for p in model.parameters() if p.grad is not None)])
        for mine, theirs in zip(got, want):
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
        assert mgr.stats().bytes_offloaded > 0 and mgr.active_group_count() == 0
        assert all(t.isnan().all() for t in litter)
        litter.clear()


class GatedCopies(CpuPlatform):
    """The CPU platform with copies held back: each copy on a copy stream waits for ``gate``
    (so it stays queued, holding a tensor on its source's storage, until the test opens
    it), and ``copied`` counts the copies that ran."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.copied = 0

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self.current_stream()
        if isinstance(stream, WorkerStream):
            stream.submit(self._wait)
        super().copy_(dst, src)
        if isinstance(stream, WorkerStream):
            stream.submit(self._count)

    def _wait(self) -> None:
        self.gate.wait()

    def _count(self) -> None:
        self.copied += 1


def test_load_ahead_with_a_missing_group_arms_none(mgr: SwapManager) -> None:
    """load_ahead used to arm the groups before a missing one although it raised."""
    x = torch.randn(32, requires_grad=True)
    with mgr.group_context("g"):
        loss = x.exp().sum()
    mgr.launch_offload("g")
    mgr.wait_offload("g")
    with pytest.raises(SwapError, match=r"load_ahead\('missing'\): no such group"):
        mgr.load_ahead(["g", "missing"])
    with pytest.raises(SwapResidencyError, match="'g'"):  # not armed: not loaded
        backward(loss)
    assert mgr.group_state("g") is GroupState.OFFLOADED
    mgr.abort_group("g")


def test_a_first_read_of_an_offloading_group_keeps_it_without_a_warning(
    mgr: SwapManager,
) -> None:
    """A first read (load_ahead) of a group whose offload was not waited for used to wait
    for it as wait_offload does, which took the tensor being unpacked for an outside
    reference: its storage stayed, with a false warning. Nothing needs to move there."""
    x = torch.randn(64, 64, requires_grad=True)
    with mgr.group_context("g"):
        loss = (x * 1).exp().sum()  # saves exp's output only
    mgr.launch_offload("g")
    mgr.load_ahead(["g"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backward(loss)
    assert not caught, [str(w.message) for w in caught]
    assert mgr.group_state("g") is GroupState.RESIDENT
    stats = mgr.stats()
    assert (stats.bytes_offloaded, stats.bytes_reloaded, stats.bytes_kept_referenced,
            stats.host_bytes_in_use) == (0, 0, 0, 0)
    assert x.grad is not None and torch.equal(x.grad, x.detach().exp())
    mgr.finish_group("g")


@pytest.mark.parametrize("held", [False, True], ids=["unreferenced", "still-held"])
def test_a_storage_taken_over_while_its_copy_is_queued_moves(held: bool) -> None:
    """A plain launch_offload used to count the copy the layer before's offload still had
    queued (on the CPU platform, a closure holding a tensor on the storage) as a reference
    to a storage its group took over (link_groups), and kept it with a warning. A storage
    the program still holds stays all the same (wait_offload checks it)."""
    platform = GatedCopies()
    mgr = SwapManager(platform)
    mgr.ensure_group("a")
    mgr.ensure_group("b")
    mgr.link_groups(["a", "b"])
    x = torch.randn(64, 64, device="cpu", requires_grad=True)
    try:
        with mgr.group_context("a"):
            h = torch.relu(x * 1)  # saves h
            mgr.launch_offload("a", copy_referenced=True)  # h's copy waits at the gate
            mgr.switch_group("b")
            loss = (h * h).sum()  # saves h again: b takes it over
        (storage,) = _storages(h)
        if not held:
            del h
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mgr.launch_offload("b")
            platform.gate.set()
            mgr.wait_offload("a")
            mgr.wait_offload("b")
    finally:
        platform.gate.set()
    assert len(caught) == held
    assert all("swap keeps an activation storage" in str(w.message) for w in caught)
    nbytes = 64 * 64 * 4
    assert storage.nbytes() == (nbytes if held else 0)
    stats = mgr.stats()
    assert (stats.bytes_offloaded, stats.bytes_kept_referenced) == (
        (0, nbytes) if held else (nbytes, 0))
    for name in ("b", "a"):
        mgr.launch_load(name)
        mgr.wait_load(name)
    backward(loss)
    assert x.grad is not None and torch.equal(x.grad, 2 * torch.relu(x.detach()))
    for name in ("a", "b"):
        mgr.finish_group(name)
    assert mgr.stats().host_bytes_in_use == 0


def test_close_waits_for_the_copies_each_time() -> None:
    """close() used to drain the copy streams only the first time: a copy started after it
    still ran when a second close() returned (and when the interpreter exited)."""
    platform = GatedCopies()
    mgr = SwapManager(platform)
    x = torch.randn(64, 64, device="cpu", requires_grad=True)
    for index in range(2):
        with mgr.group_context(f"g{index}"):
            loss = (x * 1).exp().sum()  # saves exp's output
        platform.gate.clear()
        mgr.launch_offload(f"g{index}")
        threading.Timer(0.2, platform.gate.set).start()
        mgr.close()
        assert platform.copied == index + 1
        mgr.abort_group(f"g{index}")
        del loss
