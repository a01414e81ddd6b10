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
topmost weight node) is run once more on its own, with no gradient (no arithmetic), by a
backward that frees what it saved. W keeps only the weight nodes, their subgraphs and the
gradients they received; its own backward frees those.

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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.autograd.graph import GradientEdge, Node

    from pipeswap.runtime.comm import PyTree

Grads = tuple["torch.Tensor | None", ...]

_ACCUMULATE = "torch::autograd::AccumulateGrad"


def forward_chunk(
    forward: Callable[[PyTree], PyTree],
    x: PyTree,
    *,
    inputs: Sequence[torch.Tensor] | None = None,
    carries: Callable[[PyTree], Sequence[torch.Tensor]] | None = None,
    target: PyTree | None = None,
    # Any: the loss function's own parameter types (the executor's LossFn takes tensors)
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    scale: int = 1,
    saving: AbstractContextManager[object] | None = None,
) -> ChunkAutograd:
    """Run the stage on ``x`` (a tensor or a pytree of them; ``inputs``: its tensors that
    carry a gradient back, by default ``x`` itself where it is a tensor that requires grad)
    inside ``saving`` (the swap group that collects what autograd
    saves). ``carries`` picks the output's tensors that carry a gradient (default: the
    output itself, one tensor). With a ``target`` (the last stage) the output goes through
    ``loss_fn`` and is divided by ``scale`` (the microbatch count), so the gradients are the
    mean loss's."""
    import torch

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
        # the loss is read by the caller once a step: no host sync per chunk
        return ChunkAutograd(tuple(inputs), (value / scale,), None, value.detach())


@dataclass(eq=False)
class _Plan:
    """How one chunk's backward splits (see the module's docstring)."""

    nodes: list[Node]  # the weight nodes W starts from
    groups: list[tuple[list[int], list[torch.Tensor]]]  # (indices into nodes, parameters)
    in_input: list[torch.Tensor]  # parameters I computes (the groups W cannot)
    release: list[tuple[Node, GradientEdge]]  # nodes only I runs, and a child edge each
    received: list[Grads | None] = field(default_factory=list)  # per weight node, from I


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
    _plan: _Plan | None = field(default=None, repr=False)
    _done: str = ""  # "", "B", "I" or "W": the backward steps run so far

    def backward(self, grads: Sequence[torch.Tensor] | None) -> list[torch.Tensor | None]:
        """B: the whole backward from the outputs (``grads``: theirs; None for the scaled
        loss). Parameters and the inputs accumulate ``.grad``; returns the inputs'."""
        import torch

        outputs, xs = self._take("B")
        live = _live(outputs, grads)
        if live:
            # Any: None for the loss, which autograd takes but torch's stubs do not
            given: Any = [g for _, g in live]
            torch.autograd.backward([o for o, _ in live], given)
        return [x.grad for x in xs]

    def backward_input(self, grads: Sequence[torch.Tensor] | None
                       ) -> list[torch.Tensor | None]:
        """I: the inputs' gradients, accumulated into their ``.grad`` as B does and returned
        (None where the output does not depend on one). Keeps for W the gradients arriving
        at the weight nodes, and frees what W does not need."""
        import torch

        outputs, xs = self._take("I")
        root, grad = _root(outputs, grads)
        plan = _split(root, xs) if root is not None and xs else None
        if plan is None:  # no dx path: W does it all, as a B
            self.output, self._grad = root, grad
            return [None] * len(xs)
        assert root is not None
        plan.received = [None] * len(plan.nodes)
        handles = [node.register_prehook(_keeper(plan.received, index))
                   for index, node in enumerate(plan.nodes)]
        try:
            torch.autograd.backward(root, grad, inputs=[*xs, *plan.in_input],
                                    retain_graph=True)
        finally:
            for handle in handles:
                handle.remove()
        for node, child in plan.release:
            _release(node, child)
        plan.release = []
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
                torch.autograd.backward(edges, grads, inputs=params)

    def _take(self, step: str) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
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


def _keeper(store: list[Grads | None], index: int) -> Callable[[Grads], None]:
    def keep(grads: Grads) -> None:
        store[index] = grads
    return keep


def _no_gradient(grads: Grads) -> Grads:
    return tuple(None for _ in grads)


def _release(node: Node, child: GradientEdge) -> None:
    """Run ``node`` alone with no gradient and free what it saved: the backward's target is
    one of its child edges that no other child reaches, so nothing else runs, and the
    pre-hook turns the placeholder gradient into none."""
    import torch
    from torch.autograd.graph import GradientEdge

    slots = [(slot, meta) for slot, meta in enumerate(getattr(node, "_input_metadata", ()))
             if meta.dtype.is_floating_point or meta.dtype.is_complex]
    if not slots:
        return  # nothing to root a backward at; autograd frees it with the graph
    slot, meta = slots[0]
    placeholder = torch.zeros((), dtype=meta.dtype, device=meta.device).expand(meta.shape)
    handle = node.register_prehook(_no_gradient)
    try:
        torch.autograd.grad([GradientEdge(node, slot)], [child], [placeholder],
                            allow_unused=True)
    finally:
        handle.remove()


def _split(root: torch.Tensor, xs: Sequence[torch.Tensor]) -> _Plan | None:
    """Find the weight nodes, their groups and the nodes to free after I; None when the
    output reaches none of ``xs`` (leaves)."""
    from torch.autograd.graph import GradientEdge, get_gradient_edge

    assert root.grad_fn is not None
    # the inputs' accumulate nodes: the dx path ends there
    stops = {id(node): node for node in (get_gradient_edge(x).node for x in xs)}
    order, children = _post_order(root.grad_fn, stops)
    position = {id(node): index for index, node in enumerate(order)}
    to_x: dict[int, bool] = {}
    reach: dict[int, int] = {}  # node -> bit set of the parameters it leads to
    leaves: list[Node] = []
    for node in order:
        kids = [child for child, _ in children[id(node)]]
        if id(node) in stops:
            to_x[id(node)], reach[id(node)] = True, 0
        elif node.name() == _ACCUMULATE:  # another leaf: a parameter
            to_x[id(node)], reach[id(node)] = False, 1 << len(leaves)
            leaves.append(node)
        else:
            to_x[id(node)] = any(to_x[id(kid)] for kid in kids)
            mask = 0
            for kid in kids:
                mask |= reach[id(kid)]
            reach[id(node)] = mask
    if not to_x[id(root.grad_fn)]:
        return None
    # Weight nodes: on the dx path, with an edge leaving it towards parameters.
    starts: list[tuple[Node, int, int]] = []  # (node, params off the dx path, params on it)
    for node in order:
        if id(node) in stops or not to_x[id(node)]:
            continue
        off = on = 0
        for kid, _ in children[id(node)]:
            if to_x[id(kid)]:
                on |= reach[id(kid)]
            else:
                off |= reach[id(kid)]
        if off:
            starts.append((node, off, on))
    groups: list[int] = []  # disjoint bit sets; a weight node's parameters share one
    for _, off, _ in starts:
        merged, apart = off, []
        for group in groups:
            if group & merged:
                merged |= group
            else:
                apart.append(group)
        groups = [*apart, merged]
    plan = _Plan([], [], [], [])
    in_input = 0  # bit set of the parameters I computes
    for group in groups:
        members = [(node, on) for node, off, on in starts if off & group]
        params = [_variable(leaves[i]) for i in range(len(leaves)) if group >> i & 1]
        if any(on & group for _, on in members):  # W would rerun the dx path: do it in I
            plan.in_input.extend(params)
            in_input |= group
            continue
        first = len(plan.nodes)
        plan.nodes.extend(node for node, _ in members)
        plan.groups.append((list(range(first, len(plan.nodes))), params))
    # What I runs and W does not: the dx path but W's weight nodes, and the subgraphs of the
    # parameters I computes. Each is freed through its topmost child edge (no other child
    # reaches it, so the freeing backward runs that node alone), never one into a leaf with
    # tensor hooks (they would see the missing gradient).
    in_w = {id(node) for node in plan.nodes}
    for node in order:
        if (id(node) in stops or id(node) in in_w or not _saves_tensors(node)
                or not (to_x[id(node)] or reach[id(node)] & in_input)):
            continue
        usable = [(child, nr) for child, nr in children[id(node)] if not _hooked_leaf(child)]
        if usable:
            child, nr = max(usable, key=lambda edge: position[id(edge[0])])
            plan.release.append((node, GradientEdge(child, nr)))
    return plan


_SAVES: dict[type, bool] = {}


def _saves_tensors(node: Node) -> bool:
    """Whether nodes of this kind keep saved tensors (autograd's own expose them as
    ``_raw_saved_*``; a custom Function's context may always)."""
    kind = type(node)
    saves = _SAVES.get(kind)
    if saves is None:
        saves = _SAVES[kind] = hasattr(kind, "saved_tensors") or any(
            name.startswith("_raw_saved_") for name in dir(kind))
    return saves


def _hooked_leaf(node: Node) -> bool:
    return node.name() == _ACCUMULATE and bool(getattr(_variable(node), "_backward_hooks",
                                                       None))


def _variable(node: Node) -> torch.Tensor:
    variable: torch.Tensor = getattr(node, "variable")  # noqa: B009 - not in Node's stubs
    return variable


def _post_order(root: Node, stops: dict[int, Node]
                ) -> tuple[list[Node], dict[int, list[tuple[Node, int]]]]:
    """Every node reachable from ``root`` without passing ``stops``, children before parents
    (iterative: graphs are deep), and each node's edges (child, input slot), one per child.
    The list holds the node objects, which keeps their ids valid as keys."""
    order: list[Node] = []
    children: dict[int, list[tuple[Node, int]]] = {}

    def edges(node: Node) -> list[tuple[Node, int]]:
        found: dict[int, tuple[Node, int]] = {}
        if id(node) not in stops:
            for child, nr in node.next_functions:
                if child is not None:
                    found.setdefault(id(child), (child, nr))
        children[id(node)] = list(found.values())
        return children[id(node)]

    stack = [(root, iter(edges(root)))]
    while stack:
        node, pending = stack[-1]
        for child, _ in pending:
            if id(child) not in children:
                stack.append((child, iter(edges(child))))
                break
        else:
            stack.pop()
            order.append(node)
    return order, children
