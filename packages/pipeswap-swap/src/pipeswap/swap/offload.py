"""Streaming activation offload in one process, without a pipeline.

:class:`LayerOffload` takes a model's layers: during a forward run inside it, each layer's
saved activations go to host as the forward moves past the layer, and during the backward
each layer comes back while the backward computes the layer after it, the last layer never
leaving (its backward comes first). This is the per-layer machinery the pipeline executor
streams chunks with (:mod:`pipeswap.swap.layers`), on its own.

Layers named in ``recompute`` keep only their inputs, which offload like any saved activation,
and run again just before their backward (:mod:`pipeswap.swap.layer_recompute`): the choice
between keeping, offloading and recomputing a layer that the pipeline planner makes per
chunk, here for one process.

With ``torch.utils.checkpoint`` inside a layer (reentrant or not), what the checkpointed
region saves for backward, its inputs, is offloaded like any saved activation, and the
recomputation in backward reads it back through the same checks; what the recomputation
saves again never leaves the device (it is made during the backward that uses it).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from types import TracebackType
from typing import TYPE_CHECKING

from pipeswap.platform import Platform, get_platform
from pipeswap.swap.layers import LayerChain, layer_hooks
from pipeswap.swap.manager import SwapManager
from pipeswap.swap.layer_recompute import recompute_hooks
from pipeswap.swap.values import SwapError, check_load_depth

if TYPE_CHECKING:
    import torch

_ids = itertools.count()


class LayerOffload:
    """Offload the activations of ``layers`` (in call order, each called once per forward)
    layer by layer during a forward run inside ``with offload:``, and load them back one
    layer ahead during its backward.

    ``lag``: layer ``k`` leaves the device when the forward ends layer ``k + lag`` (its copy
    hides behind ``lag`` layers). ``load_depth``: how many layers ahead of the backward the
    loads run (a load slower than one layer's backward hides behind more; each layer
    beyond one stays resident). ``protect``: modules whose parameters and buffers never
    move (default: the layers). ``manager``: a :class:`SwapManager` to share (default: a new
    one on ``platform``). ``recompute``: indices of layers that keep only their inputs and
    run again in backward (the random state, autocast and buffers of their first run
    restored: losses and gradients are unchanged). Each ``with`` block starts a new
    forward; the previous one's groups end then, or at :meth:`finish` after its backward.
    """

    def __init__(self, layers: Sequence[torch.nn.Module], *, lag: int = 1,
                 manager: SwapManager | None = None, platform: Platform | None = None,
                 protect: Sequence[torch.nn.Module] | None = None,
                 recompute: Collection[int] = (), load_depth: int = 1) -> None:
        if isinstance(lag, bool) or not isinstance(lag, int) or lag < 1:
            raise SwapError(f"lag is the whole number of layers a copy hides behind (>= 1), "
                            f"got {lag!r}")
        check_load_depth(load_depth, len(layers), "load_depth")
        if len(layers) < 2:
            raise SwapError(f"streaming offload needs at least 2 layers, got {len(layers)}: "
                            "with one, nothing can leave the device before its backward")
        wrong = [index for index in recompute
                       if isinstance(index, bool) or not isinstance(index, int)
                       or not 0 <= index < len(layers)]
        if wrong:
            raise SwapError(f"recompute names layers {wrong}, which are not layer indices "
                            f"0 to {len(layers) - 1}")
        self.manager = manager or SwapManager(platform or get_platform())
        self.layers = list(layers)
        self.recompute = frozenset(recompute)
        self.lag, self.load_depth = lag, load_depth
        for module in self.layers if protect is None else protect:
            self.manager.protect_module(module)
        self._prefix = f"offload{next(_ids)}"
        self._forwards = 0
        self._chain: LayerChain | None = None
        self._active: LayerChain | None = None
        remove_hooks = layer_hooks(self.layers, lambda: self._active)
        remove_recompute = recompute_hooks(
            self.manager, self.layers,
            lambda: self.recompute if self._active is not None else None)
        # The first layer's inputs are the caller's: they stay on the device.
        entry = self.layers[0].register_forward_pre_hook(self._protect_inputs, with_kwargs=True)

        def remove() -> None:
            remove_hooks()
            remove_recompute()
            entry.remove()

        self._remove = remove

    def _protect_inputs(self, module: torch.nn.Module, args: tuple[object, ...],
                        kwargs: dict[str, object]) -> None:
        if self._active is not None:
            self._active.protect([args, kwargs])

    @property
    def chain(self) -> LayerChain | None:
        """The groups of the last forward (for its per-layer bytes, ``layer_bytes``)."""
        return self._chain

    def protect(self, tensors: object) -> None:
        """Keep storages shared with ``tensors`` on the device (call it inside the ``with``
        for inputs the caller keeps using; the forward's output is the caller's too)."""
        if self._active is None:
            raise SwapError("protect() belongs inside `with offload:`")
        self._active.protect(tensors)

    def __enter__(self) -> LayerOffload:
        if self._active is not None:
            raise SwapError("this LayerOffload is already in a forward")
        self.finish()
        self._forwards += 1
        names = [f"{self._prefix}.f{self._forwards}.l{k}" for k in range(len(self.layers))]
        self._chain = chain = LayerChain(self.manager, names, self.lag)
        self._context = chain.forward()
        self._context.__enter__()
        self._active = chain
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        chain, self._active = self._active, None
        assert chain is not None
        self._context.__exit__(kind, error, trace)
        if error is not None:
            self.finish()
            return
        try:
            chain.forward_done(offload_last=False)
            chain.wait_offload()
            chain.launch_load(self.load_depth)  # arms the backward; the last layer never left
        except BaseException:
            self.finish()  # whatever left the device comes back; nothing stays half-done
            raise

    def finish(self) -> None:
        """End the last forward's groups (after its backward; before it, whatever left the
        device comes back now)."""
        chain, self._chain = self._chain, None
        if chain is not None:
            chain.finish()

    def close(self) -> None:
        """Finish, remove the layers' hooks, and wait for every copy in flight."""
        self.finish()
        self._remove()
        self.manager.close()
