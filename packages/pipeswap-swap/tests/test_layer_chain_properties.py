"""Property tests for per-layer groups: random layer stacks run through LayerOffload.

Whatever a layer saves (its input, its output, views of one storage, a cast, an in-place
result, or nothing at all) and whatever the lag, a step with LayerOffload computes every
gradient bit of the step without it, brings back every byte it moved, never holds more than a
whole forward saves, and leaves no group, device byte or host buffer behind: after a
backward, after a forward abandoned for a new one, and after a graph dropped unused.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pipeswap.platform import get_platform
from pipeswap.swap import GroupState, LayerOffload, SwapManager

DEVICE = os.environ.get("PIPESWAP_TEST_DEVICE", "cpu")  # see conftest.py

# CI replays a fixed set of examples (derandomized) so that a run is repeatable; elsewhere
# every run explores new ones.
PROPERTY_SETTINGS = settings(
    deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow],
    derandomize=os.environ.get("CI") == "true")

# What a layer can do to its activation h (batch, seq, width), and what autograd saves then.
OPS = (
    "linear",           # to the layer's width; saves its input
    "gelu",             # saves its input
    "tanh",             # saves its output
    "softmax",          # saves its output
    "layernorm",        # saves its input and two statistics
    "square",           # saves its input twice
    "scale",            # saves nothing
    "shift",            # saves nothing
    "relu_",            # in place on a fresh tensor; saves its output
    "halve_",           # in place on a fresh tensor; saves nothing
    "transposed_tanh",  # saves a transposed (non-contiguous) output
    "halves_mul",       # saves two views of one storage
    "row_mul",          # saves h and a broadcast view of it
    "flat_sigmoid",     # saves a flattened output; the layer goes on with a view of it
    "attention",        # saves h, a transposed view of it, and a softmax output
    "narrow_sin",       # saves a narrow view of h
    "double_tanh",      # saves a float64 output
    "detached_mul",     # saves an alias of h without autograd identity
    "slice_assign",     # an in-place write into a view of a fresh tensor
)
WIDTHS = (2, 4, 6, 8)


@dataclass(frozen=True)
class LayerSpec:
    width: int  # where a "linear" op maps the activation
    ops: tuple[str, ...]


layer_specs = st.builds(LayerSpec, st.sampled_from(WIDTHS),
                        st.lists(st.sampled_from(OPS), max_size=5).map(tuple))
stacks = st.lists(layer_specs, min_size=2, max_size=6)


class RandomLayer(torch.nn.Module):
    """One layer of a random stack: its ops in order, with a Linear for each "linear"."""

    def __init__(self, spec: LayerSpec, width: int) -> None:
        super().__init__()
        self.ops = spec.ops
        self.linears = torch.nn.ModuleList()
        for op in spec.ops:
            if op == "linear":
                self.linears.append(torch.nn.Linear(width, spec.width))
                width = spec.width
        self.width = width  # of the output

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        linears = iter(self.linears)
        for op in self.ops:
            h = next(linears)(h) if op == "linear" else apply(op, h)
        return h


def apply(op: str, h: torch.Tensor) -> torch.Tensor:
    width = h.shape[-1]
    if op == "gelu":
        return torch.nn.functional.gelu(h)
    if op == "tanh":
        return h.tanh()
    if op == "softmax":
        return h.softmax(-1)
    if op == "layernorm":
        return torch.nn.functional.layer_norm(h, (width,))
    if op == "square":
        return h * h
    if op == "scale":
        return h * 0.5
    if op == "shift":
        return h + 1.0
    if op == "relu_":
        return (h * 1.0).relu_()
    if op == "halve_":
        return (h + 0.0).mul_(0.5)
    if op == "transposed_tanh":
        return h.transpose(-2, -1).tanh().transpose(-2, -1)
    if op == "halves_mul":
        a, b = h.chunk(2, dim=-1)
        return torch.cat([a * b, a - b], dim=-1)
    if op == "row_mul":
        return h * h[:, :1]
    if op == "flat_sigmoid":
        return h.reshape(h.shape[0], -1).sigmoid().view(h.shape)
    if op == "attention":
        scores = (h @ h.transpose(-2, -1)) / math.sqrt(width)
        return scores.softmax(-1) @ h
    if op == "narrow_sin":
        return torch.cat([h.narrow(-1, 0, 1).sin(), h.narrow(-1, 1, width - 1)], dim=-1)
    if op == "double_tanh":
        return h.double().tanh().to(h.dtype)
    if op == "detached_mul":
        return h * h.detach()
    if op == "slice_assign":
        out = h * 1.0
        out[:, 0] = out[:, 0] * 2.0
        return out
    raise AssertionError(f"unknown op {op!r}")


def build(specs: Sequence[LayerSpec], width: int) -> torch.nn.Sequential:
    layers = []
    for spec in specs:
        layers.append(RandomLayer(spec, width))
        width = layers[-1].width
    return torch.nn.Sequential(*layers)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.double().tanh().sum()  # saves its output into the last layer's group


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads included)."""
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}
    return a.dtype == b.dtype and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


def gradients(loss: torch.Tensor, leaf: torch.Tensor, model: torch.nn.Module
              ) -> list[torch.Tensor]:
    """The loss, then its gradients for the input and every parameter."""
    params = list(model.parameters())
    grads = torch.autograd.grad(loss, [leaf, *params])
    return [loss.detach(), *grads]


def plain(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], int]:
    """The step without LayerOffload, and the bytes its forward saves (one group collecting
    everything, nothing moved: the most any offload may hold)."""
    mgr = SwapManager(get_platform(DEVICE))
    mgr.protect_module(model)
    leaf = x.clone().requires_grad_(True)
    with mgr.group_context("all"):
        loss = loss_of(model(leaf))
    want = gradients(loss, leaf, model)
    mgr.finish_group("all")
    return want, mgr.stats().peak_device_bytes_held


@contextmanager
def quiet() -> Iterator[None]:
    """A layer whose output it saved itself keeps it on the device (with a warning) while
    the forward still holds it, at lag 1; that memory is the price, not a failure."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "swap keeps an activation storage on the device")
        yield


def assert_clean(offload: LayerOffload) -> None:
    stats = offload.manager.stats()
    assert offload.manager.active_group_count() == 0
    assert stats.device_bytes_held == 0 and stats.host_bytes_in_use == 0


@settings(PROPERTY_SETTINGS, max_examples=150)
@given(specs=stacks, width=st.sampled_from(WIDTHS), lag=st.integers(1, 4),
       dtype=st.sampled_from([torch.float32, torch.float32, torch.bfloat16]),
       min_bytes=st.sampled_from([0, 0, 64]), abandon_first=st.booleans(),
       seed=st.integers(0, 2**16))
def test_random_stacks_round_trip_bit_identically(
        specs: list[LayerSpec], width: int, lag: int, dtype: torch.dtype, min_bytes: int,
        abandon_first: bool, seed: int) -> None:
    torch.manual_seed(seed)
    model = build(specs, width).to(dtype)
    x, other = torch.randn(2, 4, width, dtype=dtype), torch.randn(2, 4, width, dtype=dtype)
    want, whole_forward = plain(model, x)
    want_other, _ = plain(model, other)
    manager = SwapManager(get_platform(DEVICE), min_bytes=min_bytes)
    offload = LayerOffload(list(model), lag=lag, manager=manager)
    with quiet():
        if abandon_first:  # a forward whose groups the next `with` ends, restoring them
            first_leaf = other.clone().requires_grad_(True)
            with offload:
                first = loss_of(model(first_leaf))
        leaf = x.clone().requires_grad_(True)
        with offload:
            loss = loss_of(model(leaf))
        chain = offload.chain
        assert chain is not None
        got = gradients(loss, leaf, model)
    unread = [k for k, name in enumerate(chain.names)
              if offload.manager.group_state(name) is GroupState.OFFLOADED]
    unread_bytes = sum(chain.layer_bytes[k].movable for k in unread)
    event(f"groups never read: {'some' if unread_bytes else 'none'}")
    offload.finish()
    assert all(same_bits(a, b) for a, b in zip(want, got, strict=True))
    if abandon_first:
        abandoned = gradients(first, first_leaf, model)
        assert all(same_bits(a, b) for a, b in zip(want_other, abandoned, strict=True))
    stats = offload.manager.stats()
    event(f"bytes moved: {'some' if stats.bytes_offloaded else 'none'}")
    # every byte that left came back, but for groups whose storages died off the device
    assert stats.bytes_reloaded <= stats.bytes_offloaded <= stats.bytes_reloaded + unread_bytes
    assert stats.peak_device_bytes_held <= whole_forward
    assert_clean(offload)
    offload.close()


@settings(PROPERTY_SETTINGS, max_examples=100)
@given(specs=stacks, width=st.sampled_from(WIDTHS), lag=st.integers(1, 4),
       seed=st.integers(0, 2**16))
def test_a_dropped_graph_is_freed_without_coming_back(
        specs: list[LayerSpec], width: int, lag: int, seed: int) -> None:
    """A forward whose graph is dropped unused: the groups keep none of it alive, so its
    storages die off the device, finishing brings nothing back, and every host buffer
    returns."""
    torch.manual_seed(seed)
    model = build(specs, width)
    offload = LayerOffload(list(model), lag=lag, platform=get_platform(DEVICE))
    leaf = torch.randn(2, 4, width, requires_grad=True)
    with quiet():
        with offload:
            loss = loss_of(model(leaf))
    moved = offload.manager.stats().bytes_offloaded
    event(f"bytes moved: {'some' if moved else 'none'}")
    del loss
    offload.finish()
    stats = offload.manager.stats()
    assert stats.bytes_reloaded == 0
    assert_clean(offload)
    offload.close()
