"""Recomputed layers with real autograd: a layer keeps only its inputs and runs again in
backward, with every loss, gradient and buffer bit unchanged, and what it makes again counted
by the manager to the byte, from the recompute until autograd frees it.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from pipeswap.platform import get_platform
from pipeswap.swap import LayerOffload, SwapError, SwapManager, recompute_hooks

DEVICE = os.environ.get("PIPESWAP_TEST_DEVICE", "cpu")  # see conftest.py
WIDTH = 32


class Block(torch.nn.Module):
    """A residual MLP block: LayerNorm (saves its statistics), two Linears, GELU (saves its
    input), softmax gating (saves its output)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up, self.down = torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.nn.functional.gelu(self.up(self.norm(x)))
        out: torch.Tensor = x + self.down(hidden * torch.softmax(hidden, dim=-1))
        return out


class Noisy(Block):
    """A block followed by BatchNorm (its running statistics are buffers the forward
    updates) and dropout (random): what a recompute must not change."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_norm = torch.nn.BatchNorm1d(WIDTH)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        out: torch.Tensor = self.drop(self.batch_norm(y.transpose(1, 2)).transpose(1, 2))
        return out


def assert_bit_identical(want: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> None:
    assert len(want) == len(got)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(want, got))


@contextmanager
def input_bytes(layers: Sequence[torch.nn.Module]) -> Iterator[list[int]]:
    """Each layer's input storage bytes, in call order."""
    sizes: list[int] = []
    handles = [layer.register_forward_pre_hook(
        lambda module, args: sizes.append(args[0].untyped_storage().nbytes()))
        for layer in layers]
    yield sizes
    for handle in handles:
        handle.remove()


class Checkpointed(torch.nn.Module):
    """``inner`` under torch.utils.checkpoint's non-reentrant mode."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=False)
        return out


def noisy_stack(layers: int = 4) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(Noisy() for _ in range(layers)))


def train_step(model: torch.nn.Sequential, x: torch.Tensor, manager: SwapManager | None,
               recompute: Collection[int] = ()) -> list[torch.Tensor]:
    """Loss, input and parameter gradients and the buffers after one step from seed 1, the
    forward inside one group of ``manager`` with ``recompute`` layers recomputed."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    torch.manual_seed(1)
    loss: torch.Tensor
    if manager is None:
        loss = model(x).pow(2).mean()
    else:
        remove = recompute_hooks(manager, list(model), lambda: recompute)
        with manager.group_context("step"):
            loss = model(x).pow(2).mean()
        remove()
    loss.backward()  # type: ignore[no-untyped-call]
    if manager is not None:
        manager.finish_group("step")
    assert x.grad is not None
    return [loss.detach(), x.grad, *(p.grad.clone() for p in model.parameters()
                                     if p.grad is not None),
            *(b.clone() for b in model.buffers())]


def test_recomputed_layers_change_no_loss_gradient_or_buffer_bit() -> None:
    """Dropout draws the same mask again and BatchNorm's running statistics move once, over
    two steps, as without recompute; the losses and gradients are also torch.utils.
    checkpoint's (whose recompute moves the running statistics a second time)."""
    x = torch.randn(4, 8, WIDTH)
    plain_model = noisy_stack()
    buffers = len(list(plain_model.buffers()))
    want = [train_step(plain_model, x, None) for _ in range(2)]
    wrapped = torch.nn.Sequential(*(Checkpointed(layer) for layer in noisy_stack()))
    torch_checkpoint = train_step(wrapped, x, None)
    assert_bit_identical(want[0][:-buffers], torch_checkpoint[:-buffers])
    assert not all(torch.equal(a, b) for a, b in zip(want[0][-buffers:],
                                                     torch_checkpoint[-buffers:]))
    for chosen in ({0, 2}, {0, 1, 2, 3}):
        model = noisy_stack()
        manager = SwapManager(get_platform(DEVICE))
        manager.protect_module(model)
        got = [train_step(model, x, manager, chosen) for _ in range(2)]
        for expected, actual in zip(want, got):
            assert_bit_identical(expected, actual)
        assert manager.active_group_count() == 0
        assert manager.stats().device_bytes_held == 0


def _remade_by_hand(layer: torch.nn.Module, x: torch.Tensor) -> int:
    """The bytes of the distinct storages a layer's ops save that are neither its input nor
    a parameter or buffer: what a recompute of it makes again."""
    own = {t.untyped_storage()._cdata for t in [*layer.parameters(), *layer.buffers(), x]}
    sizes: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in own:
            sizes[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(sizes.values())


def test_a_recompute_counts_what_it_makes_until_its_backward_frees_it() -> None:
    """Every layer recomputed in one group: after the forward the group holds the layers'
    inputs and the loss's saved output; the backward's peak is that plus what the last
    layer's recompute makes, which is what its ops save beyond its input and parameters."""
    model = torch.nn.Sequential(*(Block() for _ in range(4)))
    x = torch.randn(4, 16, WIDTH, requires_grad=True)
    manager = SwapManager(get_platform(DEVICE))
    manager.protect_module(model)
    remove = recompute_hooks(manager, list(model), lambda: range(4))
    with input_bytes(list(model)) as sizes, manager.group_context("step"):
        out: torch.Tensor = model(x)
        loss = out.pow(2).mean()  # saves the output
    remove()
    held = manager.stats().device_bytes_held
    assert held == sum(sizes) + out.untyped_storage().nbytes()
    manager.reset_peak()
    loss.backward()  # type: ignore[no-untyped-call]
    remade = manager.remade_bytes("step")
    by_hand = [_remade_by_hand(layer, torch.randn(4, 16, WIDTH, requires_grad=True))
               for layer in model]
    assert [remade[k] for k in range(4)] == by_hand and by_hand[3] > 0
    assert manager.stats().peak_device_bytes_held == sum(sizes) + remade[3]
    manager.finish_group("step")
    assert manager.stats().device_bytes_held == 0


def test_the_allocator_peak_drops_with_recompute() -> None:
    """The allocator agrees: a step with every layer recomputed peaks well below one
    without, and its gradients are the same."""
    model = torch.nn.Sequential(*(Block() for _ in range(8)))
    x = torch.randn(4, 64, WIDTH)
    platform = get_platform(DEVICE)
    manager = SwapManager(platform)
    manager.protect_module(model)
    peaks: dict[bool, int] = {}
    results: dict[bool, list[torch.Tensor]] = {}
    for use in (False, True, False, True):  # the first of each warms up (gradients)
        with platform.measure_allocations() as measured:
            results[use] = train_step(model, x, manager, range(8) if use else ())
        assert measured.peak_bytes is not None
        peaks[use] = measured.peak_bytes
    assert_bit_identical(results[False], results[True])
    assert 2 * peaks[True] < peaks[False], peaks


def test_streamed_layers_offload_what_recomputed_layers_keep() -> None:
    """LayerOffload with layers 1 to 4 of 6 recomputed: those layers' groups hold only their
    inputs, which move like any saved activation, and every bit is unchanged."""
    x = torch.randn(2, 16, WIDTH)
    want = train_step(noisy_stack(6), x, None)
    model = noisy_stack(6)
    layers = list(model)
    offload = LayerOffload(layers, platform=get_platform(DEVICE), recompute={1, 2, 3, 4})
    model.zero_grad(set_to_none=True)
    xs = x.detach().requires_grad_(True)
    torch.manual_seed(1)
    with input_bytes(layers) as sizes, offload:
        loss: torch.Tensor = model(xs).pow(2).mean()
    chain = offload.chain
    assert chain is not None
    assert [b.held for b in chain.layer_bytes[1:5]] == sizes[1:5]
    loss.backward()  # type: ignore[no-untyped-call]
    offload.finish()
    assert xs.grad is not None
    got = [loss.detach(), xs.grad, *(p.grad.clone() for p in model.parameters()
                                     if p.grad is not None), *(b.clone() for b in model.buffers())]
    assert_bit_identical(want, got)
    stats = offload.manager.stats()
    assert stats.bytes_offloaded >= sum(sizes[1:5])
    assert stats.bytes_reloaded == stats.bytes_offloaded
    assert offload.manager.active_group_count() == 0
    assert stats.device_bytes_held == stats.host_bytes_in_use == 0
    offload.close()


def test_a_second_backward_over_a_kept_graph_recomputes_again() -> None:
    """backward(retain_graph=True) twice: the second recomputes the layers again and the
    gradients add up as without recompute."""
    model = torch.nn.Sequential(*(Block() for _ in range(3)))
    x = torch.randn(2, 8, WIDTH)

    def twice(manager: SwapManager | None) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        loss: torch.Tensor
        if manager is None:
            loss = model(x).pow(2).mean()
        else:
            remove = recompute_hooks(manager, list(model), lambda: {0, 1, 2})
            with manager.group_context("g"):
                loss = model(x).pow(2).mean()
            remove()
        loss.backward(retain_graph=True)  # type: ignore[no-untyped-call]
        loss.backward()  # type: ignore[no-untyped-call]
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    manager = SwapManager(get_platform(DEVICE))
    manager.protect_module(model)
    assert_bit_identical(twice(None), twice(manager))
    manager.finish_group("g")


class Wobbly(torch.nn.Module):
    """A layer whose forward saves less the second time it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.linear = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y: torch.Tensor = self.linear(x)
        return y * 2.0 if self.calls > 1 else y.sin()


@pytest.mark.parametrize("bad", ["indices", "strings"])
def test_layer_offload_refuses_recompute_indices_it_does_not_have(bad: str) -> None:
    layers = [Block(), Block()]
    chosen: Sequence[object] = [2] if bad == "indices" else ["0"]
    with pytest.raises(SwapError, match="not layer indices 0 to 1"):
        LayerOffload(layers, recompute=chosen)  # type: ignore[arg-type]


def test_a_layer_that_saves_other_tensors_when_run_again_fails_its_backward() -> None:
    layer = Wobbly()
    manager = SwapManager(get_platform(DEVICE))
    remove = recompute_hooks(manager, [layer], lambda: {0})
    x = torch.randn(2, WIDTH, requires_grad=True)
    with manager.group_context("g"):
        loss: torch.Tensor = layer(x).sum()
    remove()
    with pytest.raises(SwapError, match="must do the same work every time it runs"):
        loss.backward()  # type: ignore[no-untyped-call]
    manager.abort_group("g")


def _grads_with(model: torch.nn.Sequential, x: torch.Tensor, recompute: Collection[int],
                forwards: int = 1) -> list[torch.Tensor]:
    """Parameter gradients of the first of ``forwards`` forwards (each in its own group of
    one manager, the later ones never backward), ``recompute`` layers recomputed."""
    model.zero_grad(set_to_none=True)
    manager = SwapManager(get_platform(DEVICE))
    manager.protect_module(model)
    remove = recompute_hooks(manager, list(model), lambda: recompute)
    losses: list[torch.Tensor] = []
    for number in range(forwards):
        with manager.group_context(f"f{number}"):
            losses.append(model(x).pow(2).sum())
    remove()
    losses[0].backward()  # type: ignore[no-untyped-call]
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_a_pre_hook_that_changes_the_call_changes_it_once() -> None:
    """The layer's own pre-hooks run on the call as made, in the first run and in the
    recompute alike: a hook that doubles the input doubles it once."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block(), Block())
    model[1].register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    x = torch.randn(2, 8, WIDTH)
    assert_bit_identical(_grads_with(model, x, ()), _grads_with(model, x, {1}))


class Drifting(torch.nn.Module):
    """A layer that reads a buffer and then moves it, as a forward's statistics do."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.linear(x) * float(self.scale))
        with torch.no_grad():
            self.scale.add_(1)
        return out


def test_a_recompute_reads_the_buffers_its_first_run_read() -> None:
    """Two forwards, then the first one's backward: the recompute runs on the buffer as the
    first forward found it, not as the second left it, and leaves it as it was."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Drifting(), Block())
    x = torch.randn(2, 8, WIDTH)
    want = _grads_with(model, x, (), forwards=2)
    drifting = model[1]
    assert isinstance(drifting, Drifting)
    after = drifting.scale.clone()
    drifting.scale.fill_(1)
    assert_bit_identical(want, _grads_with(model, x, {1}, forwards=2))
    assert torch.equal(drifting.scale, after)
