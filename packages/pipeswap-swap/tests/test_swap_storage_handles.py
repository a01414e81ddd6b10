"""A storage the program reaches outside autograd, through any handle torch offers, stays put.

A module may keep a handle on an activation autograd also saves (the tensor, a view, a
``.detach()`` or ``.data`` alias, its ``untyped_storage()``, the legacy typed ``storage()``)
and read through it after its forward: in its backward, in the next microbatch's forward while
the first is offloaded, in a later layer, in the next step. Freeing that storage would make the
read see no values or garbage (building a tensor over a released storage grows it again,
uninitialized), with no error. So each test runs its model once without swap and once with
it, compares loss and gradients bit for bit, and checks that the storage was kept and reported
as kept. A storage object only made for a moment (by the program, by torch, by the release
check itself) must not keep anything: swap would then save no memory.
"""

from __future__ import annotations

import copy
import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from contextlib import nullcontext

import pytest
import torch

from pipeswap.platform import get_platform
from pipeswap.swap import LayerOffload, SwapManager, SwapStats
from pipeswap.swap.group_state import SavedEntry
from pipeswap.swap.references import referenced_elsewhere

DEVICE = os.environ.get("PIPESWAP_TEST_DEVICE", "cpu")  # see conftest.py

WIDTH, HIDDEN, BATCH = 16, 32, 8
KEPT = "referenced outside saved activations"  # the stats' reason for a kept storage
KINDS = ["tensor", "view", "detach", "data", "untyped-storage", "typed-storage"]


def keep(h: torch.Tensor, kind: str) -> object:
    """A handle of ``kind`` on ``h``'s storage, as a module would keep it."""
    if kind == "tensor":
        return h
    if kind == "view":
        return h.view(-1)
    if kind == "detach":
        return h.detach()
    if kind == "data":
        return h.data
    if kind == "untyped-storage":
        return h.untyped_storage()
    assert kind == "typed-storage"
    return typed_storage(h)


def typed_storage(h: torch.Tensor) -> torch.TypedStorage:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        typed: torch.TypedStorage = h.storage()  # type: ignore[no-untyped-call]
    return typed


def storage_of(handle: object) -> torch.UntypedStorage:
    if isinstance(handle, torch.Tensor):
        return handle.untyped_storage()
    if isinstance(handle, torch.TypedStorage):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            untyped: torch.UntypedStorage = handle.untyped()  # type: ignore[no-untyped-call]
        return untyped
    assert isinstance(handle, torch.UntypedStorage)
    return handle


def over(storage: torch.UntypedStorage, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor of ``shape`` built over ``storage``, as a module would build one
    (over a released storage, this grows it again, uninitialized: garbage, no error)."""
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.insert(0, step)
        step *= size
    empty = torch.empty(0, dtype=dtype, device=storage.device)
    return empty.set_(storage, 0, shape, strides)


def read(handle: object, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A copy of the values ``handle`` reaches; over a storage, through a tensor built on it."""
    if isinstance(handle, torch.Tensor):
        return handle.detach().reshape(shape).clone()
    return over(storage_of(handle), shape, dtype).clone()


class ScaleReadingBack(torch.autograd.Function):
    """``x * w``, whose backward reads ``x`` through a handle its module kept instead of through
    autograd's saved tensors (it saves only ``w``, a parameter swap leaves alone)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, w: torch.Tensor,
                reader: Callable[[], torch.Tensor]) -> torch.Tensor:
        ctx.reader = reader  # type: ignore[attr-defined]
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx: torch.autograd.function.BackwardCFunction, grad: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, None]:
        (w,) = ctx.saved_tensors
        x = ctx.reader()  # type: ignore[attr-defined]
        return grad * w, (grad * x).flatten(0, -2).sum(0), None


class KeepsHandle(torch.nn.Module):
    """Linear, GELU, Linear, tanh (which saves its output ``h``, an activation swap moves),
    then ``h * w`` whose backward reads ``h`` through a handle of ``kind``, kept in
    ``self.handle``. With ``add_previous``, the previous forward's ``h``, read through its
    handle, is added to the output."""

    def __init__(self, kind: str, *, add_previous: bool = False) -> None:
        super().__init__()
        self.kind, self.add_previous = kind, add_previous
        self.lin1 = torch.nn.Linear(WIDTH, HIDDEN)
        self.lin2 = torch.nn.Linear(HIDDEN, WIDTH)
        self.w = torch.nn.Parameter(torch.randn(WIDTH))
        self.handle: object = None
        self.shape = torch.Size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin2(torch.nn.functional.gelu(self.lin1(x))))
        previous = None
        if self.add_previous and self.handle is not None:
            previous = read(self.handle, self.shape, h.dtype)
        self.handle = handle = keep(h, self.kind)
        self.shape = shape = h.shape
        dtype = h.dtype
        out: torch.Tensor = ScaleReadingBack.apply(  # type: ignore[no-untyped-call]
            h, self.w, lambda: read(handle, shape, dtype))
        return out if previous is None else out + previous


class ReadsHandle(torch.nn.Module):
    """Adds the activation ``source`` (an earlier layer) last kept a handle on."""

    def __init__(self, source: KeepsHandle) -> None:
        super().__init__()
        self.source = [source]  # a list: not a submodule, its parameters are not ours

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        source = self.source[0]
        return x + read(source.handle, source.shape, x.dtype)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def results(loss: torch.Tensor, model: torch.nn.Module, inputs: Sequence[torch.Tensor]
            ) -> list[torch.Tensor]:
    grads = [x.grad for x in inputs] + [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    return [loss.detach(), *(g.clone() for g in grads if g is not None)]


def assert_bit_identical(want: Sequence[torch.Tensor], got: Sequence[torch.Tensor]) -> None:
    assert len(want) == len(got)
    for expected, actual in zip(want, got):
        assert torch.equal(expected, actual)


def nbytes() -> int:
    """The bytes of one ``h`` (of one kept storage)."""
    return BATCH * WIDTH * 4


def backward(loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]


# -- the whole-group manager -----------------------------------------------------------------


def offload(mgr: SwapManager, name: str) -> list[str]:
    """Offload group ``name``; the warnings that gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr.launch_offload(name)
        mgr.wait_offload(name)
    return [str(w.message) for w in caught]


def group_step(model: KeepsHandle, x: torch.Tensor, mgr: SwapManager | None
               ) -> list[torch.Tensor]:
    x = x.detach().requires_grad_(True)
    if mgr is None:
        loss = loss_of(model(x))
        backward(loss)
        return results(loss, model, [x])
    with mgr.group_context("g"):
        loss = loss_of(model(x))
    mgr.protect_alias_tensors("g", [x])  # the program holds its input: no need to warn
    kept = weakref.ref(storage_of(model.handle))
    movable = mgr.group_bytes("g").movable
    messages = offload(mgr, "g")
    assert len(messages) == 1 and "still references it" in messages[0]
    stats = mgr.stats()
    storage = kept()
    assert storage is not None and storage.nbytes() == nbytes()  # still there
    del storage
    assert (stats.bytes_kept_referenced, stats.skipped[KEPT]) == (nbytes(), 1)
    assert stats.bytes_offloaded == movable - nbytes() > 0  # the rest did leave
    mgr.launch_load("g")
    mgr.wait_load("g")
    backward(loss)  # reads h through the handle
    mgr.finish_group("g")
    return results(loss, model, [x])


@pytest.mark.parametrize("kind", KINDS)
def test_a_handle_read_in_backward_keeps_its_storage(kind: str) -> None:
    torch.manual_seed(0)
    model = KeepsHandle(kind)
    swapped = copy.deepcopy(model)
    x = torch.randn(BATCH, WIDTH)
    want = group_step(model, x, None)
    mgr = SwapManager(get_platform(DEVICE))
    mgr.protect_module(swapped)
    assert_bit_identical(want, group_step(swapped, x, mgr))
    assert mgr.stats().host_bytes_in_use == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_handle_read_by_the_next_microbatch_keeps_its_storage(kind: str) -> None:
    """The second microbatch's forward reads the first's activation through its handle while
    the first is offloaded (as a pipeline schedule runs them)."""
    torch.manual_seed(0)
    model = KeepsHandle(kind, add_previous=True)
    swapped = copy.deepcopy(model)
    x0, x1 = (torch.randn(BATCH, WIDTH, requires_grad=True) for _ in range(2))
    losses = [loss_of(model(x)) for x in (x0, x1)]
    for loss in reversed(losses):
        backward(loss)
    want = [*(loss.detach() for loss in losses), *results(losses[0], model, [x0, x1])[1:]]

    mgr = SwapManager(get_platform(DEVICE))
    mgr.protect_module(swapped)
    y0, y1 = (x.detach().requires_grad_(True) for x in (x0, x1))
    with mgr.group_context("mb0"):
        first = loss_of(swapped(y0))
    mgr.protect_alias_tensors("mb0", [y0])
    kept = weakref.ref(storage_of(swapped.handle))
    messages = offload(mgr, "mb0")
    storage = kept()
    assert storage is not None
    size = storage.nbytes()  # now: mb1's read would grow a released storage again
    del storage
    with mgr.group_context("mb1"):
        second = loss_of(swapped(y1))  # reads mb0's h
    mgr.protect_alias_tensors("mb1", [y1])
    messages += offload(mgr, "mb1")  # the module holds mb1's handle as well
    for name, loss in (("mb1", second), ("mb0", first)):
        mgr.launch_load(name)
        mgr.wait_load(name)
        backward(loss)
        mgr.finish_group(name)
    got = [first.detach(), second.detach(), *results(first, swapped, [y0, y1])[1:]]
    assert_bit_identical(want, got)
    assert size == nbytes()
    assert len(messages) == 2 and all("still references it" in m for m in messages)
    stats = mgr.stats()
    assert (stats.bytes_kept_referenced, stats.skipped[KEPT]) == (2 * nbytes(), 2)
    assert stats.bytes_offloaded > 0 and stats.host_bytes_in_use == 0


# -- per layer: LayerOffload, on LayerChain ----------------------------------------------------


def layered(kind: str) -> torch.nn.Sequential:
    """Four layers: the first keeps a handle on its activation, which its backward reads and
    the last layer reads in the forward, long after the first layer's group was freed."""
    first = KeepsHandle(kind)
    mlp = [torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.GELU(),
                               torch.nn.Linear(HIDDEN, WIDTH)) for _ in range(2)]
    return torch.nn.Sequential(first, *mlp, ReadsHandle(first))


def offload_step(model: torch.nn.Sequential, x: torch.Tensor, offload: LayerOffload | None
                 ) -> tuple[list[torch.Tensor], list[str]]:
    """Loss and gradients of one step, and the warnings its forward gave."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with offload if offload is not None else nullcontext():
            loss = loss_of(model(x))
    backward(loss)
    if offload is not None:
        offload.finish()
    return results(loss, model, [x]), [str(w.message) for w in caught]


def assert_kept_once(messages: list[str]) -> None:
    assert len(messages) == 1 and "still references it" in messages[0], messages


def step_both_ways(model: torch.nn.Sequential, swapped: torch.nn.Sequential,
                   offload: LayerOffload, number: int) -> SwapStats:
    """One step of ``model`` without and of ``swapped`` with ``offload``: bit-identical, the
    handle's storage kept (once, with a warning) and the rest moved; the stats after it."""
    x = torch.randn(BATCH, WIDTH)
    want, _ = offload_step(model, x, None)
    before = offload.manager.stats()
    got, messages = offload_step(swapped, x, offload)
    assert_bit_identical(want, got)
    assert_kept_once(messages)
    stats = offload.manager.stats()
    kept = stats.bytes_kept_referenced - before.bytes_kept_referenced
    assert kept == nbytes(), f"step {number}"
    assert stats.bytes_offloaded > before.bytes_offloaded, f"step {number}: nothing moved"
    return stats


@pytest.mark.parametrize("kind", KINDS)
def test_a_handle_later_layers_and_backward_read_is_kept_per_layer(kind: str) -> None:
    torch.manual_seed(0)
    model = layered(kind)
    swapped = copy.deepcopy(model)
    offload = LayerOffload(list(swapped), platform=get_platform(DEVICE))
    for number in range(2):
        stats = step_both_ways(model, swapped, offload, number)
        assert offload.manager.active_group_count() == 0
        assert stats.device_bytes_held == 0 and stats.host_bytes_in_use == 0
    offload.close()


class Scratch(torch.nn.Module):
    """Computes each step's activation into one storage it obtained in its first step and
    keeps (a tensor rebuilt over it every step, which ``mul`` saves), and adds what the
    previous step left there, read through that storage."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(WIDTH, WIDTH)
        self.w = torch.nn.Parameter(torch.randn(WIDTH))
        self.storage: torch.UntypedStorage | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if self.storage is None:
            self.storage = torch.zeros_like(h).untyped_storage()
        t = over(self.storage, h.shape, h.dtype)
        previous = t.clone()
        t.copy_(h)
        out: torch.Tensor = torch.tanh(t * self.w) + previous  # mul saves t
        return out


def test_a_storage_kept_across_steps_stays_on_the_device() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(Scratch(), torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(),
                                torch.nn.Linear(WIDTH, WIDTH))
    swapped = copy.deepcopy(model)
    offload = LayerOffload(list(swapped), platform=get_platform(DEVICE))
    for number in range(3):
        step_both_ways(model, swapped, offload, number)
    offload.close()


# -- what must still leave ---------------------------------------------------------------------


def test_the_check_reads_its_own_storage_objects_as_nothing() -> None:
    """The check takes the storage's Python object itself; torch keeps that object alive for
    as long as a tensor uses the storage, so taking it must leave no count behind."""
    h = torch.randn(BATCH, WIDTH)
    holders = [SavedEntry(None, None, h), SavedEntry(None, None, h[1:])]
    del h
    for _ in range(3):
        assert not referenced_elsewhere(holders)
    handle = holders[0].tensor.untyped_storage()
    assert referenced_elsewhere(holders)
    assert referenced_elsewhere(holders)
    del handle
    assert not referenced_elsewhere(holders)
    typed = typed_storage(holders[1].tensor)
    assert referenced_elsewhere(holders)
    del typed
    assert not referenced_elsewhere(holders)


@pytest.mark.parametrize(
    "touch",
    [
        lambda h: h.untyped_storage().nbytes(),
        lambda h: weakref.ref(h.untyped_storage()),
        lambda h: typed_storage(h).dtype,
        lambda h: torch.empty(0, dtype=h.dtype).set_(h.untyped_storage()).sum(),
    ],
    ids=["storage-dropped", "weak-reference", "typed-storage-dropped", "tensor-over-it-dropped"],
)
def test_a_storage_object_made_and_dropped_in_the_forward_still_leaves(
        touch: Callable[[torch.Tensor], object]) -> None:
    torch.manual_seed(0)
    model = KeepsHandle("tensor")
    x = torch.randn(BATCH, WIDTH, requires_grad=True)
    mgr = SwapManager(get_platform(DEVICE))
    mgr.protect_module(model)
    with mgr.group_context("g"):
        h = torch.tanh(model.lin2(torch.nn.functional.gelu(model.lin1(x))))
        kept = touch(h)
        loss = loss_of(h * 1)  # tanh saves h (mul saves nothing it needs)
    del h
    mgr.protect_alias_tensors("g", [x])
    movable = mgr.group_bytes("g").movable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mgr.launch_offload("g")
        mgr.wait_offload("g")
    stats = mgr.stats()
    assert (stats.bytes_offloaded, stats.bytes_kept_referenced) == (movable, 0)
    assert movable >= 3 * nbytes()
    mgr.launch_load("g")
    mgr.wait_load("g")
    backward(loss)
    mgr.finish_group("g")
    del kept
