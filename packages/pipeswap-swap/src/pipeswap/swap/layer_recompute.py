"""Recomputed layers: a layer's forward keeps only its inputs, and runs again in backward.

While a recomputed layer's forward runs (:meth:`SwapManager.record_layer` to
:meth:`~SwapManager.end_recording`), the tensors it was called with are saved in the
collecting group like any activation (they swap, and count, as the layer's *kept* bytes),
and what its ops save is replaced by a :class:`Placeholder`. The backward's first read of a
placeholder runs the layer again from its kept inputs, with the random state, autocast state
and buffers of the first run, and collects what it saves into the frame's slots, stopping
once the last is made again; each placeholder then takes its tensor.

That is the algorithm of ``torch.utils.checkpoint``'s non-reentrant mode. pipeswap runs it on
the manager's own saved-tensor hooks for one reason: what a recompute makes must count in the
manager's device bytes held from the recompute until autograd frees it, to the byte (the
simulator's peaks are checked against that count), and torch keeps its recomputed tensors
where nothing outside it can see them.

Buffers: a recomputed layer runs again on its buffers as its first run found them (copied
then: later forwards may change them before this one's backward), and its buffers are put
back afterwards, so a recompute leaves no trace in them (BatchNorm's running statistics
move once). Both writes go through ``.data``, which autograd's version counter does not
see: other microbatches may have saved views of a buffer that never changes (a rotary
table, a mask) for their backwards, and a counted write, even of the same values, would
make those saved tensors look modified.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from typing import TYPE_CHECKING, Protocol

from pipeswap.swap.group_state import Group, SavedEntry, StorageEntry
from pipeswap.swap.values import SwapError

if TYPE_CHECKING:
    import torch

    from pipeswap.swap.ledger import Ledger

_remaking: ContextVar[bool] = ContextVar("pipeswap_swap_remaking", default=False)


class Enough(Exception):  # noqa: N818 - a signal, not an error
    """Raised by the recompute's save hook once every placeholder has its tensor: the rest
    of the layer's forward would only make what nothing reads."""


def remaking() -> bool:
    """Whether a recompute runs here (the layer's own hooks must not record again)."""
    return _remaking.get()


class Placeholder:
    """What autograd keeps for a tensor a recomputed layer's op saved: the frame, the
    tensor's place among the layer's saves, and the group collecting then (its first read
    loads the groups ahead, as a saved tensor's does)."""

    __slots__ = ("frame", "index", "group")

    def __init__(self, frame: Frame, index: int, group: Group | None) -> None:
        self.frame, self.index, self.group = frame, index, group


class Frame:
    """One recomputed layer's forward: how to run it again and what that made.

    The layer's call is ``leaves`` (each tensor a marker, each with whether it required
    grad) in the structure ``spec``, its tensors kept by the saved entries ``kept`` of
    ``group``; ``metas`` are the shape and dtype of every tensor its ops saved, in order;
    ``slots`` what the last recompute saved, each taken once; ``remade`` the device bytes
    that recompute made and counted."""

    __slots__ = ("layer", "index", "group", "leaves", "spec", "grads", "kept", "rng",
                 "autocast", "buffers", "metas", "slots", "made", "fresh", "remade",
                 "finished", "__weakref__")

    def __init__(self, layer: torch.nn.Module, index: int, group: Group, call: Call,
                 kept: list[SavedEntry]) -> None:
        self.layer, self.index, self.group = layer, index, group
        self.leaves, self.spec, self.grads = call.leaves, call.spec, call.grads
        self.kept = kept
        self.rng = RandomState([*call.tensors, *layer.parameters()])
        self.autocast = autocast_state(call.tensors)
        # the buffers as the first run found them (later forwards may change them first)
        self.buffers = [(b, b.clone()) for b in layer.buffers()]
        self.metas: list[tuple[torch.Size, torch.dtype]] = []
        self.slots: list[SavedEntry | None] = []
        self.made = 0  # slots the running recompute has filled
        self.fresh: dict[int, StorageEntry] = {}  # storage key -> what a recompute counted
        self.remade = 0
        self.finished = False

    def placeholder(self, tensor: torch.Tensor, group: Group | None) -> Placeholder:
        self.metas.append((tensor.shape, tensor.dtype))
        return Placeholder(self, len(self.metas) - 1, group)

    def remake(self, inputs: list[torch.Tensor],
               store: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Call the layer again on ``inputs`` (its kept tensors, read back), each tensor its
        ops save going to ``store`` (:meth:`store`, counted), as its first run went: same
        random state, autocast, grad mode and buffers (theirs put back afterwards)."""
        import torch
        from torch.utils._pytree import tree_unflatten

        leaves: list[object] = []
        tensors = iter(inputs)
        for leaf, grad in zip(self.leaves, self.grads):
            leaves.append(next(tensors).detach().requires_grad_(grad) if leaf is _TENSOR
                          else leaf)
        args, kwargs = tree_unflatten(leaves, self.spec)
        self.slots, self.made = [None] * len(self.metas), 0
        self.fresh, self.remade = {}, 0
        buffers = [(b, b.clone()) for b, _ in self.buffers]
        for buffer, first in self.buffers:
            buffer.data.copy_(first)  # uncounted: see the module's docstring
        token = _remaking.set(True)
        try:
            with ExitStack() as stack:
                stack.enter_context(self.rng.restored())
                for kind, enabled, dtype in self.autocast:
                    stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
                stack.enter_context(torch.enable_grad())
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(store, _same))
                try:
                    self.layer(*args, **kwargs)
                except Enough:
                    pass
        finally:
            _remaking.reset(token)
            for buffer, before in buffers:
                buffer.data.copy_(before)
        if self.made != len(self.metas):
            raise SwapError(
                f"{self.describe()} saved {len(self.metas)} tensors for backward in its "
                f"forward and {self.made} when run again: a recomputed layer's forward must "
                "do the same work every time it runs")

    def store(self, tensor: torch.Tensor, ledger: Ledger,
              counted: Callable[[torch.Tensor, int, int], bool]) -> torch.Tensor:
        """A recompute's save hook: ``tensor`` fills the next slot, its storage counted in
        ``ledger`` as held until autograd frees it, unless ``counted(tensor, key, nbytes)``
        says it is counted already or never is. Raises :class:`Enough` once every slot is
        filled."""
        index = self.made
        if index >= len(self.metas) or self.metas[index] != (tensor.shape, tensor.dtype):
            raise SwapError(
                f"{self.describe()} saves different tensors for backward when run again "
                f"(save {index}: {tuple(tensor.shape)} {tensor.dtype}); a recomputed layer's "
                "forward must do the same work every time it runs")
        storage = tensor.untyped_storage()
        key: int = storage._cdata
        nbytes = storage.nbytes()
        if ledger.graveyard:
            ledger.bury()
        entry = None
        if not counted(tensor, key, nbytes):
            entry = self.fresh.get(key)
            if entry is None or not entry.alive():
                entry = self.fresh[key] = StorageEntry(nbytes, ledger.graveyard)
                ledger.held += nbytes
                self.remade += nbytes
                ledger.note_peak()
        saved = SavedEntry(None, entry, tensor)
        if entry is not None:
            entry.saved.add(saved)
        self.slots[index] = saved
        self.made += 1
        if self.made == len(self.metas):
            raise Enough  # everything the backward reads is made: the rest would be waste
        # the recompute's own graph keeps the alias: the tensor itself, an op's own output,
        # would close a cycle through its node that only the collector can break
        return saved.tensor

    def finish(self) -> None:
        """Drop the kept inputs and whatever a recompute left (after the layer's backward):
        a later read raises."""
        self.finished = True
        self.kept, self.slots, self.fresh, self.buffers = [], [], {}, []

    def describe(self) -> str:
        return f"recomputed layer {self.index} ({type(self.layer).__name__})"


class RandomState:
    """The random state a layer's forward started from: the CPU generator's and, for the
    accelerators its inputs and parameters are on, theirs (as ``torch.utils.checkpoint``
    keeps them)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        import torch
        from torch.utils.checkpoint import get_device_states

        self.cpu = torch.get_rng_state()
        accelerated = [t for t in tensors if t.device.type != "cpu"]
        self.device_type = accelerated[0].device.type if accelerated else "cuda"
        self.devices, self.states = (get_device_states(*accelerated) if accelerated
                                     else ([], []))

    @contextmanager
    def restored(self) -> Iterator[None]:
        """The state of the first run, and the caller's back afterwards."""
        import torch
        from torch.utils.checkpoint import set_device_states

        with torch.random.fork_rng(devices=self.devices, device_type=self.device_type):
            torch.set_rng_state(self.cpu)
            if self.devices:
                set_device_states(self.devices, self.states, device_type=self.device_type)
            yield


def autocast_state(tensors: list[torch.Tensor]) -> list[tuple[str, bool, torch.dtype]]:
    """Whether autocast is on, and to which dtype, for the CPU and the tensors' device."""
    import torch

    kinds = {"cpu", *(t.device.type for t in tensors)}
    return [(kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in sorted(kinds)]


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


#: Stands for a tensor in :attr:`Frame.leaves` (the saved entries are kept beside it).
_TENSOR = object()


class Call:
    """A layer call as leaves (each tensor replaced by a marker), whether each required
    grad, its structure, and its tensors in order."""

    def __init__(self, args: tuple[object, ...], kwargs: dict[str, object]) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        leaves, self.spec = tree_flatten((args, kwargs))
        self.tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        self.leaves = [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.grads = [isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves]


class Recorder(Protocol):
    """What :func:`recompute_hooks` calls: a :class:`~pipeswap.swap.SwapManager`'s two
    methods (named by this protocol, as the manager imports this module)."""

    def record_layer(self, layer: torch.nn.Module, index: int, args: tuple[object, ...],
                     kwargs: dict[str, object]) -> None: ...

    def end_recording(self, layer: torch.nn.Module) -> None: ...


def recompute_hooks(manager: Recorder, layers: list[torch.nn.Module],
                    chosen: Callable[[], Container[int] | None],
                    started: Callable[[int, tuple[object, ...], dict[str, object]], None]
                    | None = None) -> Callable[[], None]:
    """Hooks on ``layers`` that make the layers whose indices ``chosen()`` holds (None: none)
    record their forward for a recompute in ``manager`` (a
    :class:`~pipeswap.swap.SwapManager`, inside one of its groups); ``started(index, args,
    kwargs)`` is called as each layer of such a forward starts (to measure what each layer
    saves, and its input).
    Returns the function that removes them."""
    handles = []
    for index, layer in enumerate(layers):
        def before(module: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object],
                   index: int = index) -> None:
            picked = chosen()
            if picked is None or remaking():
                return
            if started is not None:
                started(index, args, kwargs)
            if index in picked:
                manager.record_layer(module, index, args, kwargs)

        def after(module: torch.nn.Module, args: tuple[object, ...], output: object) -> None:
            if not remaking():
                manager.end_recording(module)

        # first of the layer's pre-hooks: it records the call as made, and a recompute
        # makes that call again, through the user's pre-hooks once more
        handles.append(layer.register_forward_pre_hook(before, with_kwargs=True,
                                                       prepend=True))
        handles.append(layer.register_forward_hook(after))

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove

