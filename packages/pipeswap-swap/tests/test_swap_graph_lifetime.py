"""What the swap manager's saved entries keep alive: never the graph that saved them.

An entry holds an alias of the saved tensor, not the tensor: for an op that saves its own
output (softmax, tanh, exp, LayerNorm's statistics...) the tensor's ``grad_fn`` is the node
holding the entry, a cycle through C++ that Python's collector cannot break. These tests drop
graphs without a backward and check, through weak references, that the output and the saved
activations' storages are freed like without swap; that gradients stay exact through the
aliases (first and second order); and that the release check still tells a storage only
autograd holds from one the program can still reach.
"""

from __future__ import annotations

import gc
import os
import warnings
import weakref
from collections.abc import Callable

import pytest
import torch

from pipeswap.platform import get_platform
from pipeswap.swap import SwapManager

DEVICE = os.environ.get("PIPESWAP_TEST_DEVICE", "cpu")  # see conftest.py

Refs = list[weakref.ref[torch.Tensor] | weakref.ref[torch.UntypedStorage]]


@pytest.fixture
def mgr() -> SwapManager:
    return SwapManager(get_platform(DEVICE), min_bytes=0)


def _forward(mgr: SwapManager | None, refs: Refs) -> torch.Tensor:
    """A forward whose ops save their inputs and their outputs; ``refs`` gets weak references
    to its output and to the storages of the activations it saved."""
    lin = torch.nn.Linear(64, 64)
    norm = torch.nn.LayerNorm(64)
    if mgr is not None:
        mgr.protect_module(lin)
        mgr.protect_module(norm)
    x = torch.randn(32, 64, requires_grad=True)
    h = lin(x)
    t = (h * h).tanh()  # mul saves h twice, tanh its output
    y: torch.Tensor = norm(t).log_softmax(-1).softmax(-1)  # LayerNorm saves t and its statistics
    refs.append(weakref.ref(y))
    refs.extend(weakref.ref(a.untyped_storage()) for a in (h, t, y))
    return y


def _collected(refs: Refs) -> bool:
    gc.collect()
    return all(ref() is None for ref in refs)


def _move(mgr: SwapManager, name: str, steps: list[str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the program holds the output: its storage stays
        for step in steps:
            getattr(mgr, step)(name)


def _holds_nothing(mgr: SwapManager) -> None:
    stats = mgr.stats()
    assert stats.device_bytes_held == 0 and stats.host_bytes_in_use == 0
    assert mgr.active_group_count() == 0


def test_a_graph_dropped_without_backward_is_freed_without_swap_too() -> None:
    """The baseline the manager must match."""
    refs: Refs = []
    y = _forward(None, refs)
    del y
    assert _collected(refs)


@pytest.mark.parametrize("moves", ["collecting", "offloading", "offloaded", "loading",
                                   "reloaded"])
@pytest.mark.parametrize("drop_first", [True, False], ids=["dropped-then-aborted",
                                                           "aborted-then-dropped"])
def test_a_graph_dropped_without_backward_is_freed(
    mgr: SwapManager, moves: str, drop_first: bool
) -> None:
    """A failed step: the graph is dropped and the group aborted, in either order, wherever
    the group's transfers were."""
    refs: Refs = []
    with mgr.group_context("g"):
        y = _forward(mgr, refs)
    steps = ["launch_offload", "wait_offload", "launch_load", "wait_load"]
    count = ["collecting", "offloading", "offloaded", "loading", "reloaded"].index(moves)
    _move(mgr, "g", steps[:count])
    if count >= 2:
        assert mgr.stats().bytes_offloaded > 0  # it did release storages
    if drop_first:
        del y
        mgr.abort_group("g")
    else:
        mgr.abort_group("g")
        assert y.isfinite().all()  # the output the program held is intact
        del y
    assert _collected(refs)
    _holds_nothing(mgr)


def test_a_forward_never_backwarded_is_freed_after_finish(mgr: SwapManager) -> None:
    refs: Refs = []
    with mgr.group_context("g"):
        y = _forward(mgr, refs)
    del y
    mgr.finish_group("g")  # a collecting group may be finished
    assert _collected(refs)
    _holds_nothing(mgr)


def test_a_graph_whose_group_was_offloaded_is_freed_without_abort(mgr: SwapManager) -> None:
    """Dropped while its storages are released: the manager forgets them as they die (the
    group still has to be finished or aborted to return its host buffers)."""
    refs: Refs = []
    with mgr.group_context("g"):
        y = _forward(mgr, refs)
    _move(mgr, "g", ["launch_offload", "wait_offload"])
    del y
    assert _collected(refs)
    assert mgr.group_bytes("g").movable == 0  # nothing left alive to move
    mgr.abort_group("g")
    _holds_nothing(mgr)


class _Failure(Exception):
    pass


def test_an_exception_mid_forward_frees_what_the_forward_saved(mgr: SwapManager) -> None:
    refs: Refs = []

    def failing_step() -> None:
        with mgr.group_context("g"):
            y = _forward(mgr, refs)
            assert y.requires_grad
            raise _Failure("a stage failed mid-forward")

    with pytest.raises(_Failure) as failure:
        failing_step()
    del failure  # its traceback holds the forward's frame
    mgr.abort_group("g")
    assert _collected(refs)
    _holds_nothing(mgr)
    x = torch.randn(64, requires_grad=True)  # the manager goes on
    with mgr.group_context("g"):
        loss = x.exp().sum()
    loss.backward()  # type: ignore[no-untyped-call]
    assert x.grad is not None and torch.equal(x.grad, x.detach().exp())
    mgr.finish_group("g")


class _SavesEverything(torch.nn.Module):
    """Saved outputs (tanh, softmax, log_softmax, exp, LayerNorm's statistics), views of
    activations (transposes, chunks), an in-place op on a view saving its output, leaves that
    require grad (``x * x``), parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 48)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.lin(x).chunk(3, dim=-1)
        scores = (q.tanh() @ k.transpose(-2, -1)).softmax(-1)
        z = scores @ v
        z[..., :4].tanh_()  # saves the view it wrote: its grad_fn becomes a CopySlices
        mixed = self.norm(z).log_softmax(-1)
        out: torch.Tensor = mixed * (x * x) + mixed.exp()
        return out


def _first_and_second_order(
    model: torch.nn.Module, x: torch.Tensor, mgr: SwapManager | None
) -> list[torch.Tensor]:
    params = list(model.parameters())
    if mgr is None:
        loss = model(x).sum()
    else:
        with mgr.group_context("g"):
            loss = model(x).sum()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # x is held: its storage stays
            mgr.launch_offload("g")
            mgr.wait_offload("g")
        assert mgr.stats().bytes_offloaded > 0
        mgr.launch_load("g")
        mgr.wait_load("g")
    # create_graph: the second order differentiates through the unpacked saved tensors, so
    # autograd must have given them back their grad_fn (outputs) or accumulator (leaves)
    grads = torch.autograd.grad(loss, [x, *params], create_graph=True)
    penalty = sum((g * g).sum() for g in grads)
    assert isinstance(penalty, torch.Tensor)
    second = torch.autograd.grad(penalty, [x, *params], allow_unused=True)
    if mgr is not None:
        mgr.finish_group("g")
    return [g.detach() for g in grads] + [g for g in second if g is not None]


@pytest.mark.parametrize("protect", [True, False], ids=["protected", "parameters-saved"])
def test_gradients_through_the_aliases_are_bit_identical(protect: bool) -> None:
    torch.manual_seed(0)
    model = _SavesEverything()
    x = torch.randn(4, 8, 16, requires_grad=True)
    reference = _first_and_second_order(model, x, None)
    mgr = SwapManager(get_platform(DEVICE))
    if protect:
        mgr.protect_module(model)
    swapped = _first_and_second_order(model, x, mgr)
    assert len(reference) == len(swapped) > 2 + len(list(model.parameters()))
    for want, got in zip(reference, swapped):
        assert torch.equal(want, got)
    if not protect:
        assert mgr.stats().skipped["parameter"] > 0
    _holds_nothing(mgr)


Keep = Callable[[torch.Tensor], object]


def _typed_storage(y: torch.Tensor) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        return y.storage()  # type: ignore[no-untyped-call]


@pytest.mark.parametrize(
    ("keep", "released"),
    [
        (lambda y: None, True),
        (lambda y: y.untyped_storage().nbytes(), True),  # a storage object made and dropped
        (lambda y: weakref.ref(y.untyped_storage()), True),  # a weak one is no reference
        (lambda y: y.untyped_storage(), False),  # a tensor can be built over it any time
        (_typed_storage, False),
        (lambda y: y, False),
        (lambda y: y[1:], False),
        (lambda y: y.t(), False),
        (lambda y: y.detach(), False),
        (lambda y: y.data, False),
        (lambda y: [y.view(-1)], False),
        (lambda y: y.grad_fn._saved_result, False),
    ],
    ids=["nothing", "storage-dropped", "storage-weakly", "storage", "typed-storage", "output",
         "slice", "transpose", "detached", "data", "view-in-a-list", "unpacked-saved-tensor"],
)
def test_only_storages_nothing_but_autograd_reaches_are_released(
    mgr: SwapManager, keep: Keep, released: bool
) -> None:
    """exp saves its output: the entry's alias alone must not keep the storage, and any
    tensor or storage object the program still holds over it must."""
    x = torch.randn(16, 16, requires_grad=True)
    with mgr.group_context("g"):
        y = x.exp()
        loss = (y * 1).sum()  # mul saves nothing it needs: only exp saves y
    kept = keep(y)
    storage = weakref.ref(y.untyped_storage())  # held, the storage object would keep it
    del y
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr.launch_offload("g")
        mgr.wait_offload("g")
    alive = storage()
    assert alive is not None and alive.nbytes() == (0 if released else 16 * 16 * 4)
    del alive
    assert mgr.stats().bytes_kept_referenced == (0 if released else 16 * 16 * 4)
    assert bool(caught) is not released
    mgr.launch_load("g")
    mgr.wait_load("g")
    del kept
    loss.backward()  # type: ignore[no-untyped-call]
    assert x.grad is not None and torch.equal(x.grad, x.detach().exp())
    mgr.finish_group("g")
