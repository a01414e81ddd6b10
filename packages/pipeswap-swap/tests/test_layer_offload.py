"""LayerOffload with real autograd on the CPU platform, whose copy streams are worker threads:
a copy that runs late, or a storage freed before its copy finished, shows up here as wrong
numbers or a failed check, as it would on a GPU.

What a forward run inside ``with LayerOffload(layers):`` must keep: every gradient bit, the
per-layer memory bound its rules promise (checked against the manager's count and the
allocator), torch.utils.checkpoint's behaviour, and a clean manager after every step, failed
ones included.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from pipeswap.platform import Platform, get_platform
from pipeswap.swap import GroupBytes, LayerOffload, SwapError, SwapManager

DEVICE = os.environ.get("PIPESWAP_TEST_DEVICE", "cpu")  # see conftest.py

WIDTH = 32


def backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]


class Block(torch.nn.Module):
    """A pre-norm transformer block: attention (softmax saves its output, the matmuls views of
    one qkv storage), LayerNorm, a GELU MLP, and residuals, so a layer's output is saved by
    the next layer only."""

    def __init__(self, width: int = WIDTH, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.fc1 = torch.nn.Linear(width, 4 * width)
        self.fc2 = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        head = width // self.heads
        q, k, v = (t.reshape(batch, seq, self.heads, head).transpose(1, 2)
                   for t in self.qkv(self.norm1(x)).chunk(3, dim=-1))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head)
        mixed = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(batch, seq, width)
        x = x + self.proj(mixed)
        out: torch.Tensor = x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))
        return out


def mlp_layer(width: int = WIDTH) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                               torch.nn.Linear(2 * width, width))


def stack(make: Callable[[], torch.nn.Module], layers: int,
          dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    return torch.nn.Sequential(*(make() for _ in range(layers))).to(dtype)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    """A loss that saves the output (pow), so the last layer's group holds it too."""
    return out.float().pow(2).mean()


def step(model: torch.nn.Module, x: torch.Tensor, offload: LayerOffload | None,
         ) -> list[torch.Tensor]:
    """Loss, input gradient and parameter gradients of one forward and backward (inside
    ``offload`` if given, which is finished after the backward)."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    with offload if offload is not None else nullcontext():
        loss = loss_of(model(x))
    backward(loss)
    if offload is not None:
        offload.finish()
    assert x.grad is not None
    return [loss.detach(), x.grad, *(p.grad.clone() for p in model.parameters()
                                     if p.grad is not None)]


def assert_bit_identical(want: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> None:
    assert len(want) == len(got)
    for expected, actual in zip(want, got):
        assert expected.dtype == actual.dtype and torch.equal(expected, actual)


def assert_clean(offload: LayerOffload) -> None:
    """Nothing left behind: no group, no device byte counted, no host buffer in use."""
    stats = offload.manager.stats()
    assert offload.manager.active_group_count() == 0
    assert stats.device_bytes_held == 0 and stats.host_bytes_in_use == 0


# -- gradients -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lag", [1, 2, 3])
@pytest.mark.parametrize("make", [mlp_layer, Block], ids=["mlp", "transformer"])
def test_gradients_are_bit_identical_over_two_steps(
        make: Callable[[], torch.nn.Module], lag: int, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = stack(make, 6, dtype)
    offload = LayerOffload(list(model), lag=lag, platform=get_platform(DEVICE))
    for number in range(2):  # the second step reuses the offload, its host buffers included
        x = torch.randn(2, 16, WIDTH, dtype=dtype)
        want = step(model, x, None)
        before = offload.manager.stats()
        got = step(model, x, offload)
        assert_bit_identical(want, got)
        stats = offload.manager.stats()
        moved = stats.bytes_offloaded - before.bytes_offloaded
        assert moved > 0, f"step {number}: nothing left the device"
        assert stats.bytes_reloaded - before.bytes_reloaded == moved
        assert stats.bytes_kept_referenced == 0
        assert_clean(offload)
    offload.close()


@pytest.mark.parametrize("depth", [2, 3, 6])
def test_loads_further_ahead_keep_every_gradient_bit(depth: int) -> None:
    torch.manual_seed(0)
    model = stack(Block, 6)
    offload = LayerOffload(list(model), load_depth=depth, platform=get_platform(DEVICE))
    x = torch.randn(2, 16, WIDTH)
    assert_bit_identical(step(model, x, None), step(model, x, offload))
    stats = offload.manager.stats()
    assert stats.bytes_offloaded > 0 and stats.bytes_reloaded == stats.bytes_offloaded
    assert_clean(offload)
    offload.close()


class Scale(torch.nn.Module):
    """Multiplies by a constant: autograd saves nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 0.5


def test_layers_that_save_nothing_keep_the_loads_going() -> None:
    """Layers with empty groups (never read in the backward, so they load nothing ahead):
    the layer before them is still brought back before its backward reads it."""
    torch.manual_seed(0)
    layers = [mlp_layer(), torch.nn.Identity(), Scale(), mlp_layer(), mlp_layer()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(2, 8, WIDTH)
    want = step(model, x, None)
    offload = LayerOffload(layers, platform=get_platform(DEVICE))
    with offload:
        loss = loss_of(model(x.requires_grad_(True)))
    chain = offload.chain
    assert chain is not None
    assert [b.held for b in chain.layer_bytes][1:3] == [0, 0]
    backward(loss)
    offload.finish()
    assert_bit_identical(want, step(model, x, offload))
    stats = offload.manager.stats()
    assert stats.bytes_offloaded > 0 and stats.bytes_offloaded == stats.bytes_reloaded
    assert_clean(offload)


# -- memory ----------------------------------------------------------------------------------


def expected_peak(layer_bytes: Sequence[GroupBytes], lag: int, depth: int = 1) -> int:
    """The most device bytes a chain's rules let it hold, from what each layer's group held
    (``held``) and could move (``movable``) when its layer closed.

    Forward: the end of layer ``k`` frees layer ``k - lag``, so just before that, layers
    ``k - lag`` to ``k`` are whole on the device and each earlier one holds what it could not
    move (the caller's input). Backward: the first read of layer ``k`` loads layer
    ``k - depth``; by then the backward has freed all of layer ``k + 1``, so layers
    ``k - depth`` to ``k`` are whole and the earlier ones as before. The peak is the largest
    of these sums.
    """
    held = [b.held for b in layer_bytes]
    kept = [b.held - b.movable for b in layer_bytes]
    forward = [sum(kept[:max(0, k - lag)]) + sum(held[max(0, k - lag):k + 1])
               for k in range(len(held))]
    backward = [sum(kept[:k - depth]) + sum(held[k - depth:k + 1])
                for k in range(depth, len(held))]
    return max(forward + backward)


@pytest.mark.parametrize(("lag", "depth"), [(1, 1), (2, 1), (3, 1), (1, 2), (2, 3)])
def test_the_peak_held_is_what_the_lag_allows(lag: int, depth: int) -> None:
    """A uniform stack of 8 blocks: the manager's peak is exactly the rules' bound, which
    here is the caller's input, ``lag`` layers (or the load depth's, if more) and the last
    one (it also holds the loss): under 3 layers at lag 1, far below what a whole forward
    saves."""
    torch.manual_seed(0)
    model = stack(Block, 8)
    x = torch.randn(4, 32, WIDTH, requires_grad=True)
    plain = SwapManager(get_platform(DEVICE))  # one group, nothing moved: a forward's total
    plain.protect_module(model)
    with plain.group_context("all"):
        loss = loss_of(model(x))
    total = plain.stats().peak_device_bytes_held
    backward(loss)
    plain.finish_group("all")

    offload = LayerOffload(list(model), lag=lag, load_depth=depth,
                           platform=get_platform(DEVICE))
    with offload:
        loss = loss_of(model(x))
    chain = offload.chain
    assert chain is not None
    layer_bytes = chain.layer_bytes
    backward(loss)
    offload.finish()
    peak = offload.manager.stats().peak_device_bytes_held
    assert len(layer_bytes) == 8 and sum(b.held for b in layer_bytes) == total
    layer, last, given = layer_bytes[0].held, layer_bytes[-1].held, x.untyped_storage().nbytes()
    assert all(b.held == layer for b in layer_bytes[:-1]) and last > layer  # uniform
    assert layer_bytes[0].held - layer_bytes[0].movable == given  # the caller's input stays
    assert all(b.held == b.movable for b in layer_bytes[1:])
    most = max(lag, depth)
    assert peak == expected_peak(layer_bytes, lag, depth) == given + most * layer + last
    assert peak < (most + 2) * layer and 8 * peak < (most + 2) * total
    assert_clean(offload)


def test_the_allocator_peak_drops_with_offload() -> None:
    """The allocator agrees with the count: a step's peak (host buffers left out, as on a
    GPU) is well below the step's without offload."""
    torch.manual_seed(0)
    model = stack(Block, 8)
    x = torch.randn(4, 64, WIDTH)
    platform = get_platform(DEVICE)
    offload = LayerOffload(list(model), platform=platform)
    want = step(model, x, None)
    peaks: dict[bool, int] = {}
    for use in (False, True, False, True):  # the first of each warms up (pool, grads)
        with platform.measure_allocations() as measured:
            got = step(model, x, offload if use else None)
        assert measured.peak_bytes is not None
        peaks[use] = measured.peak_bytes
        assert_bit_identical(want, got)
    assert 2 * peaks[True] < peaks[False], peaks
    assert_clean(offload)


# -- torch.utils.checkpoint ------------------------------------------------------------------


class Checkpointed(torch.nn.Module):
    """A layer run under torch.utils.checkpoint."""

    def __init__(self, inner: torch.nn.Module, use_reentrant: bool) -> None:
        super().__init__()
        self.inner, self.use_reentrant = inner, use_reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=self.use_reentrant)
        return out


@contextmanager
def input_bytes(layers: Sequence[torch.nn.Module]) -> Iterator[list[int]]:
    """The storage bytes of each layer's input, as the forward calls them (sizes only: a
    reference would keep the storage on the device)."""
    sizes: list[int] = []

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        sizes.append(args[0].untyped_storage().nbytes())

    handles = [layer.register_forward_pre_hook(record) for layer in layers]
    try:
        yield sizes
    finally:
        for handle in handles:
            handle.remove()


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpointed_layers(use_reentrant: bool) -> None:
    """Either way a region saves only its inputs for backward (the non-reentrant checkpoint
    through the outer hooks too), and those move (all but the caller's input and the last
    layer's, which never leaves); recomputation reads them back through the same checks."""
    torch.manual_seed(0)
    layers = [Checkpointed(Block(), use_reentrant) for _ in range(6)]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(2, 16, WIDTH)
    want = step(model, x, None)
    offload = LayerOffload(layers, platform=get_platform(DEVICE))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing kept on the device for a held reference
        with input_bytes(layers) as sizes:
            got = step(model, x, offload)
    assert_bit_identical(want, got)
    stats = offload.manager.stats()
    movable_inputs = sum(sizes[1:-1])
    assert stats.bytes_offloaded == movable_inputs > 0
    assert stats.bytes_reloaded == stats.bytes_offloaded
    assert_clean(offload)


# -- no leaks --------------------------------------------------------------------------------


def test_a_step_leaves_nothing_behind() -> None:
    torch.manual_seed(0)
    model = stack(Block, 4)
    offload = LayerOffload(list(model), platform=get_platform(DEVICE))
    x = torch.randn(2, 16, WIDTH, requires_grad=True)
    with offload:
        loss = loss_of(model(x))
    assert offload.manager.active_group_count() == 4
    assert offload.manager.stats().host_bytes_in_use > 0  # the middle layers are on host
    backward(loss)
    offload.finish()
    assert_clean(offload)
    offload.finish()  # twice: nothing to do
    assert_clean(offload)


class Failure(Exception):
    """Raised by a layer mid-forward."""


class FailOnce(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner, self.armed = inner, True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            self.armed = False
            raise Failure("the forward failed")
        out: torch.Tensor = self.inner(x)
        return out


def test_a_forward_that_raises_leaves_nothing_and_the_next_step_works() -> None:
    torch.manual_seed(0)
    layers = [Block(), Block(), Block(), FailOnce(Block()), Block()]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(2, 16, WIDTH)
    offload = LayerOffload(layers, lag=1, platform=get_platform(DEVICE))
    with pytest.raises(Failure):
        step(model, x, offload)
    assert offload.chain is None
    assert offload.manager.stats().bytes_offloaded > 0  # layers 0 and 1 had left
    assert_clean(offload)
    want = step(model, x, None)
    assert_bit_identical(want, step(model, x, offload))
    assert_clean(offload)


def test_a_forward_without_backward_is_restored_by_the_next() -> None:
    """A new ``with`` ends the previous forward's groups, bringing back what had left: the
    abandoned graph is still exact, and so is the new one streaming."""
    torch.manual_seed(0)
    model = stack(Block, 5)
    x1, x2 = torch.randn(2, 16, WIDTH), torch.randn(2, 16, WIDTH)
    params = list(model.parameters())
    want1 = torch.autograd.grad(loss_of(model(x1)), params)
    want2 = torch.autograd.grad(loss_of(model(x2)), params)
    offload = LayerOffload(list(model), platform=get_platform(DEVICE))
    with offload:
        first = loss_of(model(x1))
    moved = offload.manager.stats().bytes_offloaded
    assert moved > 0
    with offload:
        second = loss_of(model(x2))
    stats = offload.manager.stats()
    assert stats.bytes_reloaded == moved  # the first forward's groups came back whole
    assert offload.manager.active_group_count() == 5  # only the second forward's
    assert_bit_identical(want2, torch.autograd.grad(second, params))
    assert_bit_identical(want1, torch.autograd.grad(first, params))
    offload.finish()
    assert_clean(offload)
    assert offload.manager.stats().bytes_offloaded == offload.manager.stats().bytes_reloaded


# -- errors ----------------------------------------------------------------------------------


def test_fewer_than_two_layers_is_refused() -> None:
    for layers in ([], [torch.nn.Linear(4, 4)]):
        with pytest.raises(SwapError, match="at least 2 layers"):
            LayerOffload(layers, platform=get_platform(DEVICE))


@pytest.mark.parametrize("depth", [0, 4, True, 1.0])
def test_a_load_depth_outside_the_layers_is_refused(depth: object) -> None:
    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    with pytest.raises(SwapError, match=r"load_depth is the whole number of layers a load "
                                        r"runs ahead of the backward, from 1 to 3, got"):
        LayerOffload(layers, load_depth=depth,  # type: ignore[arg-type]
                     platform=get_platform(DEVICE))
    manager = SwapManager(get_platform(DEVICE))
    for name in ("a", "b", "c"):
        manager.ensure_group(name)
    with pytest.raises(SwapError, match=r"load_ahead: depth is the whole number of layers"):
        manager.load_ahead(["a", "b", "c"], depth)  # type: ignore[arg-type]
    manager.close()


class Shared(torch.nn.Module):
    """Calls its first layer twice (weight sharing)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.c(self.a(self.b(self.a(x).tanh()).tanh()))
        return out


def test_a_layer_called_twice_is_refused_by_name_and_order() -> None:
    torch.manual_seed(0)
    model = Shared()
    x = torch.randn(4, 8)
    offload = LayerOffload([model.a, model.b, model.c], platform=get_platform(DEVICE))
    with pytest.raises(SwapError, match=r"layer 0 ended but the forward is in layer 2 of 3; "
                                        r"each layer must run once, in order"):
        step(model, x, offload)
    assert_clean(offload)
    model(x)  # outside the with, the hooks let any call order through


def test_layers_called_out_of_order_are_refused() -> None:
    a, b, c = (torch.nn.Linear(8, 8) for _ in range(3))
    offload = LayerOffload([a, b, c], platform=get_platform(DEVICE))
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(SwapError, match="layer 1 ended but the forward is in layer 0"):
        with offload:
            c(a(b(x)))
    assert_clean(offload)


@pytest.mark.parametrize("skipped", ["middle", "last"])
def test_a_skipped_layer_is_refused_and_finish_cleans_up(skipped: str) -> None:
    a, b, c = (torch.nn.Linear(8, 8) for _ in range(3))
    offload = LayerOffload([a, b, c], platform=get_platform(DEVICE))
    x = torch.randn(4, 8, requires_grad=True)
    message = ("layer 2 ended but the forward is in layer 1 of 3" if skipped == "middle"
               else "ended in layer 2 of 3 without ending it; every layer must run")
    with pytest.raises(SwapError, match=message):
        with offload:
            if skipped == "middle":
                c(a(x).tanh())
            else:
                b(a(x).tanh())
    assert_clean(offload)  # nothing left, even when the end of the forward raised
    with offload:
        loss = c(b(a(x).tanh()).tanh()).sum()
    backward(loss)
    offload.finish()
    assert_clean(offload)


def test_the_last_layer_called_twice_is_refused() -> None:
    a, b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
    offload = LayerOffload([a, b], platform=get_platform(DEVICE))
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(SwapError, match="past its last layer"):
        with offload:
            b(b(a(x)))
    assert_clean(offload)


def relu_layer() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU())


def test_a_layer_output_saved_by_two_layers_moves_with_the_later_one() -> None:
    """ReLU saves its output, which the next layer's Linear saves again: the storage belongs
    to the later layer, so every layer but the last (and the caller's input) still leaves."""
    torch.manual_seed(0)
    model = stack(relu_layer, 8)
    x = torch.randn(16, WIDTH)
    want = step(model, x, None)
    offload = LayerOffload(list(model), platform=get_platform(DEVICE))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = step(model, x, offload)
    assert_bit_identical(want, got)
    stats = offload.manager.stats()
    assert "shared across groups" not in stats.skipped
    # layers 1..6 each hold their input (the previous ReLU's output) when they leave
    assert stats.bytes_offloaded == stats.bytes_reloaded == 6 * 16 * WIDTH * 4
    assert_clean(offload)


def test_protect_belongs_inside_the_with() -> None:
    layers = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
    offload = LayerOffload(layers, platform=get_platform(DEVICE))
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(SwapError, match="inside `with offload:`"):
        offload.protect(x)
    with offload:
        offload.protect(x)
        loss = layers[1](layers[0](x).tanh()).sum()
    with pytest.raises(SwapError, match="inside `with offload:`"):
        offload.protect(loss)
    backward(loss)
    offload.finish()
    assert_clean(offload)


def test_a_with_inside_its_own_forward_is_refused() -> None:
    layers = [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]
    offload = LayerOffload(layers, platform=get_platform(DEVICE))
    with offload:
        with pytest.raises(SwapError, match="already in a forward"):
            with offload:
                pass
        loss = layers[1](layers[0](torch.randn(4, 8, requires_grad=True))).sum()
    backward(loss)
    offload.finish()
    assert_clean(offload)


# -- freed memory reused at once ---------------------------------------------------------------


def test_memory_reused_right_after_each_offload_leaves_values_intact(
        copy_platform: Platform) -> None:
    """Whenever storages have just been freed (in the forward right after each layer's end,
    where the layer ``lag`` before it goes; after the forward; between layers of the
    backward, while loads are in flight), tensors as large as every group so far are
    allocated and filled with NaN. A storage freed before its copy to host completed, or read
    before its load completed, would hand its bytes to one of them (or be copied from after
    it was freed), and a gradient would show it. (``copy_platform``: see conftest.py.)"""
    torch.manual_seed(0)
    model = stack(Block, 6)
    x = torch.randn(4, 64, WIDTH)
    want = step(model, x, None)
    offload = LayerOffload(list(model), lag=1, platform=copy_platform)
    litter: list[torch.Tensor] = []

    def fill() -> None:
        chain = offload.chain
        assert chain is not None
        for closed in chain.layer_bytes:
            litter.append(torch.empty(closed.movable // 4).fill_(math.nan))

    def after_layer(module: torch.nn.Module, args: tuple[object, ...], output: torch.Tensor
                    ) -> None:
        # runs after the offload's own hook, which has just freed a layer's storages
        fill()
        # in the backward, between layers
        output.register_hook(lambda grad: fill())  # type: ignore[no-untyped-call]

    handles = [layer.register_forward_hook(after_layer) for layer in model]
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        leaf = x.detach().requires_grad_(True)
        with offload:
            loss = loss_of(model(leaf))
        fill()
        backward(loss)
        offload.finish()
        assert leaf.grad is not None
        assert_bit_identical(want, [loss.detach(), leaf.grad,
                                    *(p.grad for p in model.parameters() if p.grad is not None)])
        assert offload.manager.stats().bytes_offloaded > 0
        assert_clean(offload)
        assert any(t.isnan().all() for t in litter)  # the litter kept its own values
        litter.clear()
    for handle in handles:
        handle.remove()
