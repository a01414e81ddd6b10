"""The autograd of one chunk (one stage, one microbatch): its forward, and its backward, whole
(B) or split at the weight edges into an input part (I) and a weight part (W).

Why split: a zero-bubble schedule runs I as soon as the next stage's gradient arrives (the
previous stage waits for its result) and W later, in what would be a bubble. That only pays
if I + W costs what B costs: W must compute the weight gradients and nothing else.

How. The *dx path* is every graph node on a path from the chunk's output to its input: I runs
exactly those (a backward with the input as its only target). Some of them also send gradient
out of the dx path towards parameters: a Linear's addmm, a LayerNorm, the add of a positional
embedding. These are the *weight nodes*. During I a pre-hook on each weight node keeps the
gradient it receives; W enters the graph again at the weight nodes (``GradientEdge`` roots fed
with the kept gradients) with the parameters as its only targets, so autograd reruns each
weight node for its parameter outputs alone, then the subgraphs below it that lead to
parameters, and no node of the dx path. Each part of B runs once, in I or in W, and the
parameters' own accumulate nodes fill ``.grad`` in W, as in B.

W runs one backward per *group*: parameters whose weight nodes or subgraphs are linked share
one, so every weight node runs once. A group is done in I instead when one of its weight nodes
reaches the group's parameters again through the dx path (one parameter used at two depths,
e.g. one Linear applied twice in a row): from the upper node W would rerun the dx path down to
the lower one and add its gradient twice. I then also targets those parameters, so their
nodes run once, in I, which accumulates their ``.grad``.

Memory between I and W. I must keep the graph (the weight nodes run again in W), so autograd
frees nothing; and the swap manager's saved-tensor hooks hold each saved tensor, so a node
that saved its own output (softmax, log-softmax, LayerNorm's statistics) would keep itself
and everything below it alive forever unless a backward frees it. So right after I every
node with saved tensors that W will not run (the rest of the dx path, the loss above the
topmost weight node) is run once more, with no gradient (no arithmetic), by a backward that
frees what it saved. One such backward frees a batch of them: every node between two weight
nodes, say, where the paths from one to another pass no node that saves tensors or that W
runs. W keeps only the weight nodes, their subgraphs and the gradients they received; its
own backward frees those.

Cost. On small layers a backward call costs as much as the arithmetic, so the split keeps
calls few and cheap: the release runs one backward per batch, W one per group, both straight
on autograd's engine (torch's per-gradient checks in Python cost as much again), and the
analysis above (which nodes are weight nodes, the groups, the batches) runs once per stage
and graph shape (:class:`SplitCache`): each chunk only walks its graph to compare its shape
and find the nodes.

Recomputed layers (:func:`pipeswap.swap.recompute_hooks`) run again when I first reads them, and
what that makes is gone before W (the simulator counts it so): I computes their weight
gradients too, their groups moved from W into I, and a release that reads them again gets
stand-ins (the swap manager's ``releasing``). A first stage with recomputed layers runs its
whole backward in I.

A stage whose input does not require grad (the first) has no dx path: I does nothing and W
is a B. Several tensors between stages: the dx path ends at any input that carries a
gradient, and several outputs that carry one are joined into one root, the sum of each
output times its gradient, whose backward hands every output exactly its gradient.
Limitation: hooks registered on intermediate tensors (``Tensor.register_hook``,
``retain_grad``) or on graph nodes may run again in W, or with no gradient after I.

torch is imported inside the functions: importing the runtime stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

from pipeswap.runtime.executor.backward_split import Grads, Plan, SplitCache, find_plan

if TYPE_CHECKING:
    import torch
    from torch.autograd.graph import GradientEdge, Node

    from pipeswap.runtime.distributed.transport import PyTree


#: The backward steps a chunk has run so far: none, B, I (the dx half) or W after it.
BackwardsRun = Literal["", "B", "I", "W"]


def forward_chunk(
    forward: Callable[[PyTree], PyTree],
    x: PyTree,
    *,
    inputs: Sequence[torch.Tensor] | None = None,
    carries: Callable[[PyTree], Sequence[torch.Tensor]] | None = None,
    target: PyTree | None = None,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    scale: int = 1,
    saving: AbstractContextManager[object] | None = None,
    keep: bool = False,
) -> ChunkAutograd:
    """Run the stage on ``x`` (a tensor or a pytree of them; ``inputs``: its tensors that
    carry a gradient back, by default ``x`` itself where it is a tensor that requires grad)
    inside ``saving`` (the swap group that collects what autograd
    saves). ``carries`` picks the output's tensors that carry a gradient (default: the
    output itself, one tensor). With a ``target`` (the last stage) the output goes through
    ``loss_fn`` and is divided by ``scale`` (the microbatch count), so the gradients are the
    mean loss's; with ``keep`` the output itself stays too (``value``, detached)."""
    import torch
    from torch.utils._pytree import tree_map_only

    if inputs is None:
        inputs = [x] if isinstance(x, torch.Tensor) and x.requires_grad else []
    with saving if saving is not None else nullcontext():
        out = forward(x)
        if target is None:
            if carries is not None:
                roots = tuple(carries(out))
            elif isinstance(out, torch.Tensor):
                roots = (out,)
            else:
                raise TypeError("the output is not one tensor: give carries, which picks "
                                "its tensors that carry a gradient")
            return ChunkAutograd(tuple(inputs), roots, out)
        if loss_fn is None:
            raise ValueError("a target needs a loss_fn")
        value = loss_fn(out, target)
        kept = tree_map_only(torch.Tensor, torch.Tensor.detach, out) if keep else None
        # the loss is read by the caller once a step: no host sync per chunk
        return ChunkAutograd(tuple(inputs), (value if scale == 1 else value / scale,), kept,
                             value.detach())


@dataclass(eq=False)
class ChunkAutograd:
    """One chunk from its forward to its last backward step.

    ``outputs`` are what backward starts from: the stage output's tensors that carry a
    gradient, or on the last stage the scaled loss (``loss`` holds the unscaled value,
    detached); ``value`` is the whole output, sent to the next stage. ``inputs`` are the
    input's tensors that carry a gradient. Call :meth:`backward`, or :meth:`backward_input`
    then :meth:`backward_weight`, once; each drops what it no longer needs, and after the
    last one the chunk holds nothing.
    """

    inputs: tuple[torch.Tensor, ...] | None
    outputs: tuple[torch.Tensor, ...] | None
    value: PyTree | None = None
    loss: torch.Tensor | None = None
    output: torch.Tensor | None = None  # the root W starts from when I found no dx path
    _grad: torch.Tensor | None = None  # the output's gradient, while W still needs it
    _plan: Plan | None = field(default=None, repr=False)
    _done: BackwardsRun = ""  # the backward steps run so far

    def backward(self, grads: Sequence[torch.Tensor] | None) -> list[torch.Tensor | None]:
        """B: the whole backward from the outputs (``grads``: theirs; None for the scaled
        loss). Parameters and the inputs accumulate ``.grad``; returns the inputs'."""
        import torch

        outputs, xs = self._take("B")
        live = _live(outputs, grads)
        if live:
            given: Any = [g for _, g in live]  # Any: None for a loss, as torch's stubs lack
            torch.autograd.backward([o for o, _ in live], given)
        return [x.grad for x in xs]

    def backward_input(self, grads: Sequence[torch.Tensor] | None,
                       cache: SplitCache | None = None, *,
                       recomputed: Sequence[torch.Tensor] | None = None,
                       releasing: Callable[[], AbstractContextManager[object]] | None = None
                       ) -> list[torch.Tensor | None]:
        """I: the inputs' gradients, accumulated into their ``.grad`` as B does and returned
        (None where the output does not depend on one). Keeps for W the gradients arriving
        at the weight nodes, and frees what W does not need. ``cache``: the stage's splits
        (without one, each chunk's graph is analysed).

        ``recomputed``: where the chunk recomputes layers, their parameters (maybe none),
        whose gradients I computes too (from what the recompute made, which is gone before
        W); ``releasing``:
        the swap manager's context for the backward that frees what only I needed."""
        import torch

        outputs, xs = self._take("I")
        root, grad = _root(outputs, grads)
        plan = find_plan(root, xs, cache) if root is not None and xs else None
        if plan is None:  # no dx path: W does it all, as a B
            if recomputed is not None and root is not None and root.requires_grad:
                torch.autograd.backward(root, grad)  # W could not read the recomputed
                return [None] * len(xs)
            self.output, self._grad = root, grad
            return [None] * len(xs)
        assert root is not None
        if recomputed:
            _weights_in_input(plan, recomputed)
        kept = {index for members, _ in plan.groups for index in members}  # what W runs
        handles = [node.register_prehook(keep) for index, (node, keep)
                   in enumerate(zip(plan.nodes, plan.keepers)) if index in kept]
        try:  # keeps the graph: W runs the weight nodes again
            torch.autograd.backward(root, grad, inputs=[*xs, *plan.in_input],
                                    retain_graph=True)
        finally:
            for handle in handles:
                handle.remove()
        with releasing() if releasing is not None else nullcontext():
            for nodes, targets in plan.release:
                _release(nodes, targets)
        plan.release, plan.keepers = [], []
        self._plan = plan
        return [x.grad for x in xs]

    def backward_weight(self) -> None:
        """W: the parameters' gradients, accumulated into ``.grad`` as B accumulates them."""
        import torch
        from torch.autograd.graph import GradientEdge

        if self._done != "I":
            raise RuntimeError(f"W of a chunk after {self._done or 'its forward'}: run I "
                               "first, and W once")
        self._done = "W"
        plan, root, grad = self._plan, self.output, self._grad
        self._plan = self.output = self._grad = None
        if plan is None:
            if root is not None and root.requires_grad:  # else: frozen, nothing to do
                torch.autograd.backward(root, grad)
            return
        for members, params in plan.groups:
            edges, grads = [], []
            for index in members:
                for slot, g in enumerate(plan.received[index] or ()):
                    if g is not None:
                        edges.append(GradientEdge(plan.nodes[index], slot))
                        grads.append(g)
            if edges:  # frees the graph it runs (weight nodes and their subgraphs)
                _engine(edges, grads, params, accumulate=True)

    def _take(self, step: BackwardsRun
              ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """The outputs and the inputs, dropped from the chunk with its whole output (the
        caller keeps what it needs)."""
        if self._done or self.outputs is None or self.inputs is None:
            raise RuntimeError(f"{step} of a chunk after {self._done}: each chunk runs B, or "
                               "I then W, once")
        outputs, xs = self.outputs, self.inputs
        self.outputs = self.inputs = self.value = None
        self._done = step
        return outputs, xs


def _root(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None
          ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One tensor to start a backward from, and its gradient: the one output that needs a
    gradient, or the sum of each such output times its gradient (whose backward gives each
    output exactly its gradient: the sum's is one, the product's the other factor); None
    when no output needs one."""
    live = _live(outputs, grads)
    if len(live) <= 1:
        return live[0] if live else (None, None)
    total: torch.Tensor | None = None
    for output, grad in live:
        if grad is None:
            raise ValueError("several outputs start a backward: each needs its gradient")
        term = (output * grad).sum()
        total = term if total is None else total + term
    return total, None


def _live(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None
          ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The outputs that need a gradient, each with its own (None: the loss's, implied)."""
    given: Sequence[torch.Tensor | None] = grads if grads is not None else [None] * len(outputs)
    return [(o, g) for o, g in zip(outputs, given) if o.requires_grad]


def _weights_in_input(plan: Plan, params: Sequence[torch.Tensor]) -> None:
    """Move the W groups that hold any of ``params`` into I (their nodes run once, in I)."""
    wanted = {id(param) for param in params}
    groups = []
    for members, group in plan.groups:
        if any(id(param) in wanted for param in group):
            plan.in_input.extend(group)
        else:
            groups.append((members, group))
    plan.groups = groups


def _engine(roots: Sequence[GradientEdge], grads: Sequence[torch.Tensor],
            inputs: Sequence[torch.Tensor | GradientEdge], *, accumulate: bool) -> None:
    """A backward from ``roots`` fed ``grads`` to ``inputs`` (into their ``.grad`` if
    ``accumulate``, else only computed), freeing the graph it runs: autograd's engine as
    ``torch.autograd.backward`` and ``grad`` call it, less their Python checks of each
    gradient (the engine checks shapes and dtypes again). Those cost about what a small
    layer's backward does, and W runs one backward per group, the release one per batch."""
    from torch.autograd.graph import _engine_run_backward

    _engine_run_backward(tuple(roots), tuple(grads), keep_graph=False, create_graph=False,
                         inputs=tuple(inputs), allow_unreachable=True,
                         accumulate_grad=accumulate)


def _no_gradient(grads: Grads) -> Grads:
    return tuple(None for _ in grads)


def _release(nodes: Sequence[Node], targets: Sequence[GradientEdge]) -> None:
    """Run ``nodes`` with no gradient, in one backward that frees what they saved: each is a
    root, ``targets`` hold one child edge of each that no other of its children reaches, and
    what else runs saves nothing (see :func:`_batches`). Pre-hooks turn the placeholder
    gradients into none."""
    import torch
    from torch.autograd.graph import GradientEdge

    roots, placeholders, rooted = [], [], []
    zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
    for node in nodes:
        for slot, meta in enumerate(getattr(node, "_input_metadata", ())):
            if meta.dtype.is_floating_point or meta.dtype.is_complex:
                break
        else:
            continue  # nothing to root a backward at; autograd frees it with the graph
        zero = zeros.get((meta.dtype, meta.device))
        if zero is None:
            zero = zeros[meta.dtype, meta.device] = torch.zeros((), dtype=meta.dtype,
                                                                device=meta.device)
        roots.append(GradientEdge(node, slot))
        placeholders.append(zero.expand(meta.shape))
        rooted.append(node)
    if not roots:
        return
    handles = [node.register_prehook(_no_gradient) for node in rooted]
    try:
        _engine(roots, placeholders, targets, accumulate=False)
    finally:
        for handle in handles:
            handle.remove()
