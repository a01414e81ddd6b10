"""Streaming swap: one forward's saved activations in one swap group per layer.

A :class:`LayerChain` cuts a forward at its layers' ends. As the forward ends layer ``k``, the
group of layer ``k`` starts its copy to host and the group of layer ``k - lag`` is freed (its
copy had ``lag`` layers of compute to hide behind); the last layer's group, which also holds
what the forward saves after its last layer (a loss), closes when the forward ends. For the
backward, the last layer's group is loaded first, and reading layer ``k``'s activations loads
layer ``k - 1`` (:meth:`~pipeswap.swap.SwapManager.load_ahead`), so each copy overlaps the
backward of the layer after it; a load depth ``d`` > 1 loads the last ``d`` layers first and
layer ``k - d`` at layer ``k``, for a copy slower than one layer's backward. What the forward
saves before its first layer joins the first layer's group.

Every guarantee of the manager's groups holds per layer: storages are moved whole, nothing
still referenced is freed, backward never reads a storage that is not resident. A storage
two layers save (a layer's output, saved by the op that made it and by the next layer's first
op) belongs to the later layer (:meth:`~pipeswap.swap.SwapManager.link_groups`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

from pipeswap.swap.manager import SwapManager
from pipeswap.swap.values import GroupBytes, GroupState, SwapError

if TYPE_CHECKING:
    import torch


class LayerChain:
    """The per-layer groups ``names`` of one forward (layer ``k`` saves into ``names[k]``),
    their offloads ``lag`` layers behind the forward and their loads one layer (or
    :meth:`launch_load`'s ``depth``) ahead of the backward. Steps, in order:
    :meth:`forward` (with :meth:`layer_done` at each layer's end, which :func:`layer_hooks`
    calls), :meth:`forward_done`, :meth:`wait_offload`, :meth:`launch_load`,
    :meth:`wait_load`, the backward, :meth:`finish`."""

    def __init__(self, manager: SwapManager, names: Sequence[str], lag: int = 1) -> None:
        if not names:
            raise SwapError("a layer chain needs at least one group name (one per layer)")
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise SwapError(f"lag is the whole number of layers a copy hides behind (>= 1), "
                            f"got {lag!r}")
        self.manager, self.names, self.lag = manager, tuple(names), lag
        self.position = 0  # the layer the forward is in
        self._last_ended = False
        self._launched: list[int] = []  # layers whose offload runs, not yet freed
        self._freed: list[int] = []  # freed layers whose deferred storages wait for WO
        self._bytes: dict[int, GroupBytes] = {}  # per layer, when it left or the forward ended
        for name in self.names:
            manager.ensure_group(name)
        manager.link_groups(self.names)

    @property
    def layers(self) -> int:
        return len(self.names)

    @property
    def layer_bytes(self) -> tuple[GroupBytes, ...]:
        """Per layer, what its group held (and could move) when it left the device, or, for
        the layers that had not, when the forward ended."""
        return tuple(self._bytes[index] for index in sorted(self._bytes))

    def protect(self, tensors: object) -> None:
        """Keep storages shared with ``tensors`` (a tensor, or a nest of lists, tuples, dicts
        and sets holding some) on the device in every layer's group (the forward's inputs
        before it runs, its output after)."""
        for name in self.names:
            if self.manager.group_state(name) in (GroupState.COLLECTING, GroupState.OFFLOADING):
                self.manager.protect_alias_tensors(name, tensors)

    @contextmanager
    def forward(self) -> Iterator[None]:
        """Collect the forward's saved activations, starting with the first layer's group."""
        if self.position != 0 or self._bytes:
            raise SwapError(f"layer chain {self.names[0]!r}: its forward already ran")
        with self.manager.group_context(self.names[0]):
            yield

    def layer_done(self, index: int) -> None:
        """The forward ended layer ``index``: start its copy, free the layer ``lag`` before
        it, and collect into the next layer's group. (The last layer's end only counts: its
        group closes with :meth:`forward_done`, after what the forward saves after it.)"""
        if index != self.position or self._last_ended:
            raise SwapError(
                f"layer chain {self.names[0]!r}: layer {index} ended but the forward is "
                f"{'past its last layer' if self._last_ended else f'in layer {self.position}'}"
                f" of {self.layers}; each layer must run once, in order (name a stage's "
                "layers in the order its forward calls them)")
        if index == self.layers - 1:
            self._last_ended = True
            return
        self._launch(index)
        self._free_before(index)
        self.position = index + 1
        self.manager.switch_group(self.names[index + 1])

    def forward_done(self, *, offload_last: bool = True) -> None:
        """The forward (and whatever it saves after its last layer) ended: start the last
        layer's copy (unless ``offload_last``: False keeps it, for a backward right after) and
        free the layer ``lag`` before it."""
        last = self.layers - 1
        if not self._last_ended:
            raise SwapError(
                f"layer chain {self.names[0]!r}: the forward ended in layer {self.position} "
                f"of {self.layers} without ending it; every layer must run, once, in order "
                "(are the layers right?)")
        for index in range(self.layers):  # what the layers not yet freed hold
            if index not in self._bytes and (index in self._launched or index == last):
                self._bytes[index] = self.manager.group_bytes(self.names[index])
        if offload_last:
            self._launch(last)
        self._free_before(last)
        self.position = self.layers

    def wait_offload(self) -> None:
        """Free every layer whose copy was started and not yet waited for, then what the
        forward still referenced when its layer left (see :meth:`SwapManager.wait_offload`'s
        ``defer_referenced``), which nothing should reference any more."""
        while self._launched:
            self._free(self._launched.pop(0))
        for index in self._freed:
            self.manager.release_deferred(self.names[index])
        self._freed = []

    def launch_load(self, depth: int = 1) -> None:
        """Start loading the last ``depth`` layers (the last first), and arm the backward to
        load each layer ``depth`` ahead of the one it reaches."""
        self.manager.load_ahead(self.names, depth)
        for name in reversed(self.names[-depth:]):
            if self.manager.group_state(name) is GroupState.OFFLOADED:
                self.manager.launch_load(name)

    def wait_load(self) -> None:
        """Make compute wait for the last layer's load (the backward's first)."""
        last = self.names[-1]
        if self.manager.group_state(last) is GroupState.LOADING:
            self.manager.wait_load(last)

    def finish(self) -> None:
        """The backward is done: forget every layer's group."""
        _each(self.manager.end_group, self.names)

    def abort(self) -> None:
        """Stop everything (a failed step): every group restored and forgotten."""
        _each(self.manager.abort_group, self.names)

    def _launch(self, index: int) -> None:
        self.manager.launch_offload(self.names[index], copy_referenced=True)
        self._launched.append(index)

    def _free_before(self, index: int) -> None:
        freed = index - self.lag
        if freed >= 0 and freed in self._launched:
            self._launched.remove(freed)
            self._free(freed)

    def _free(self, index: int) -> None:
        self._bytes.setdefault(index, self.manager.group_bytes(self.names[index]))
        self.manager.wait_offload(self.names[index], defer_referenced=True)
        self._freed.append(index)


def _each(call: Callable[[str], None], names: Sequence[str]) -> None:
    """``call`` on every name, even after one fails; then the first failure raises."""
    errors = []
    for name in names:
        try:
            call(name)
        except Exception as exc:  # noqa: BLE001 - the other groups still need it
            errors.append(exc)
    if errors:
        raise errors[0]


def layer_hooks(layers: Sequence[torch.nn.Module],
                active: Callable[[], LayerChain | None]) -> Callable[[], None]:
    """Forward hooks on ``layers`` that tell the chain ``active()`` returns (if any) that a
    layer ended (the end of the forward is the caller's to report: :meth:`LayerChain.
    forward_done`, once the forward's output is known). Returns the function that removes
    the hooks."""
    handles = []
    for index, layer in enumerate(layers):
        def ended(module: torch.nn.Module, args: tuple[object, ...], output: object,
                  index: int = index) -> None:
            chain = active()
            if chain is not None:
                chain.layer_done(index)

        handles.append(layer.register_forward_hook(ended))

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


def find_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """A model's (or a stage's) layers in call order: the children of an ``nn.Sequential``,
    else the entries of a ``layers`` ``nn.ModuleList`` or ``nn.ModuleDict`` (the usual
    decoder layout), else the module alone."""
    import torch

    if isinstance(module, torch.nn.Sequential):
        return list(module.children())
    found = getattr(module, "layers", None)
    if isinstance(found, torch.nn.ModuleList):
        return list(found)
    if isinstance(found, torch.nn.ModuleDict):
        return list(found.values())
    return [module]
