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
    groups: list[tuple[Sequence[int], list[torch.Tensor]]]  # (indices into nodes, parameters)
    in_input: list[torch.Tensor]  # parameters I computes (the groups W cannot)
    release: list[tuple[list[Node], list[GradientEdge]]]  # nodes only I runs, in batches
    received: list[Grads | None]  # per weight node, what I gave it
    keepers: list[Callable[[Grads], None]]  # per weight node, the pre-hook that keeps it


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

    def backward_input(self, grads: Sequence[torch.Tensor] | None,
                       cache: SplitCache | None = None, *,
                       recomputed: Sequence[torch.Tensor] = (),
                       releasing: Callable[[], AbstractContextManager[object]] | None = None
                       ) -> list[torch.Tensor | None]:
        """I: the inputs' gradients, accumulated into their ``.grad`` as B does and returned
        (None where the output does not depend on one). Keeps for W the gradients arriving
        at the weight nodes, and frees what W does not need. ``cache``: the stage's splits
        (without one, each chunk's graph is analysed).

        ``recomputed``: the parameters of the chunk's recomputed layers, whose gradients I
        computes too (from what the recompute made, which is gone before W); ``releasing``:
        the swap manager's context for the backward that frees what only I needed."""
        import torch

        outputs, xs = self._take("I")
        root, grad = _root(outputs, grads)
        plan = _plan(root, xs, cache) if root is not None and xs else None
        if plan is None:  # no dx path: W does it all, as a B
            if recomputed and root is not None and root.requires_grad:  # or I, for W
                torch.autograd.backward(root, grad)  # could not read what I made again
                return [None] * len(xs)
            self.output, self._grad = root, grad
            return [None] * len(xs)
        assert root is not None
        if recomputed:
            _weights_in_input(plan, recomputed)
        handles = [node.register_prehook(keep) for node, keep in zip(plan.nodes, plan.keepers)]
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


def _plan(root: torch.Tensor, xs: Sequence[torch.Tensor], cache: SplitCache | None
          ) -> _Plan | None:
    """How this chunk's backward splits; None when the output reaches none of ``xs``."""
    from torch.autograd.graph import get_gradient_edge

    assert root.grad_fn is not None
    order, shape = _walk(root.grad_fn, {id(get_gradient_edge(x).node) for x in xs})
    split = cache.find(shape) if cache is not None else _analyse(shape)
    return None if split is None else split.bind(order)


def _weights_in_input(plan: _Plan, params: Sequence[torch.Tensor]) -> None:
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


class SplitCache:
    """The splits of one stage's chunks, by the shape of their graph.

    A stage's forward builds a graph of the same shape every microbatch, so the analysis
    (weight nodes, groups, release batches) runs once per shape, and each chunk only walks
    its graph to compare shapes and find the nodes at the same places. The shape is every
    node's type and edges, which leaves are the chunk's inputs and which parameters have
    hooks: another op, a parameter frozen, hooked or shared changes it. The analysis reads the
    shape and nothing else, so a split found in the cache is the one a fresh analysis would
    give; tensor shapes, and which tensors the nodes hold, are not part of it (a replaced
    parameter is bound where its node is). Holds the last ``size`` shapes it analysed."""

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._splits: dict[tuple[object, ...], _Split | None] = {}

    def find(self, shape: tuple[object, ...]) -> _Split | None:
        """The split of graphs of ``shape`` (None: no dx path), analysed if new."""
        if shape in self._splits:
            return self._splits[shape]
        if len(self._splits) >= self._size:
            del self._splits[next(iter(self._splits))]
        split = self._splits[shape] = _analyse(shape)
        return split


_NODE, _LEAF, _STOP, _HOOKED = 0, 1, 2, 4  # kinds: a node; bits: leaf, input, tensor hooks
_Release = tuple[tuple[int, ...], tuple[tuple[int, int], ...]]  # nodes, their child edges


@dataclass(frozen=True, eq=False)
class _Split:
    """How every graph of one shape splits, in places of its walk (see the module's
    docstring)."""

    weight: tuple[int, ...]  # the weight nodes W starts from
    groups: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (indices into weight, leaves)
    in_input: tuple[int, ...]  # leaves of the parameters I computes (the groups W cannot)
    release: tuple[_Release, ...]  # nodes only I runs, in batches (one backward each)

    def bind(self, order: Sequence[Node]) -> _Plan:
        """The plan of the chunk whose walk found ``order``."""
        from torch.autograd.graph import GradientEdge

        received: list[Grads | None] = [None] * len(self.weight)
        return _Plan(
            [order[place] for place in self.weight],
            [(members, [_variable(order[leaf]) for leaf in leaves])
             for members, leaves in self.groups],
            [_variable(order[leaf]) for leaf in self.in_input],
            [([order[node] for node in nodes],
              [GradientEdge(order[child], nr) for child, nr in targets])
             for nodes, targets in self.release],
            received, [partial(received.__setitem__, index) for index in range(len(received))])


_IS_LEAF: dict[type, bool] = {}
_SAVES: dict[type, bool] = {}


def _saves_tensors(kind: type) -> bool:
    """Whether nodes of this kind keep saved tensors (autograd's own expose them as
    ``_raw_saved_*``; a custom Function's context may always)."""
    saves = _SAVES.get(kind)
    if saves is None:
        saves = _SAVES[kind] = hasattr(kind, "saved_tensors") or any(
            name.startswith("_raw_saved_") for name in dir(kind))
    return saves


def _variable(node: Node) -> torch.Tensor:
    variable: torch.Tensor = getattr(node, "variable")  # noqa: B009 - not in Node's stubs
    return variable


def _walk(root: Node, stops: set[int]) -> tuple[list[Node], tuple[object, ...]]:
    """Every node reachable from ``root`` without passing ``stops`` (ids), in the order a
    breadth-first walk finds them (the root first), and the graph's shape: per node its type,
    kind (_LEAF, _STOP, _HOOKED bits), edge count and edges (child's place, input slot).
    The list holds the nodes, which keeps their ids valid."""
    order = [root]
    place = {id(root): 0}
    shape: list[object] = []
    for node in order:  # the list grows as the walk finds nodes
        cls = type(node)
        leaf = _IS_LEAF.get(cls)
        if leaf is None:
            leaf = _IS_LEAF[cls] = node.name() == _ACCUMULATE
        kind = _LEAF if leaf else _NODE
        if leaf and getattr(_variable(node), "_backward_hooks", None):
            kind |= _HOOKED
        if id(node) in stops:
            shape += (cls, kind | _STOP, 0)
        elif leaf:
            shape += (cls, kind, 0)
        else:
            edges = []
            for child, nr in node.next_functions:
                if child is not None:
                    at = place.get(id(child))
                    if at is None:
                        at = place[id(child)] = len(order)
                        order.append(child)
                    edges.append((at, nr))
            shape += (cls, kind, len(edges), *edges)
    return order, tuple(shape)


def _parse(shape: tuple[object, ...]) -> tuple[list[type], list[int], list[list[tuple[int, int]]]]:
    """A walk's shape, back into each node's type, kind and edges (one per child, the
    first)."""
    types: list[type] = []
    kinds: list[int] = []
    children: list[list[tuple[int, int]]] = []
    at = 0
    while at < len(shape):
        cls, kind, count = shape[at:at + 3]
        assert isinstance(cls, type) and isinstance(kind, int) and isinstance(count, int)
        edges: dict[int, tuple[int, int]] = {}
        for edge in shape[at + 3:at + 3 + count]:
            assert isinstance(edge, tuple)
            edges.setdefault(edge[0], edge)
        types.append(cls)
        kinds.append(kind)
        children.append(list(edges.values()))
        at += 3 + count
    return types, kinds, children


def _analyse(shape: tuple[object, ...]) -> _Split | None:
    """Find the weight nodes, their groups and the nodes to free after I; None when the
    output reaches none of the inputs."""
    types, kinds, children = _parse(shape)
    size = len(types)
    to_x = [False] * size
    reach = [0] * size  # bit set of the parameters each node leads to
    leaves: list[int] = []  # the parameters' places, by bit
    post = _post_order(children)
    for node in post:
        if kinds[node] & _STOP:
            to_x[node] = True
        elif kinds[node] & _LEAF:  # another leaf: a parameter
            reach[node] = 1 << len(leaves)
            leaves.append(node)
        else:
            mask = 0
            for kid, _ in children[node]:
                to_x[node] = to_x[node] or to_x[kid]
                mask |= reach[kid]
            reach[node] = mask
    if not to_x[0]:  # the root
        return None
    # Weight nodes: on the dx path, with an edge leaving it towards parameters.
    starts: list[tuple[int, int, int]] = []  # (node, params off the dx path, params on it)
    for node in post:
        if kinds[node] & _STOP or not to_x[node]:
            continue
        off = on = 0
        for kid, _ in children[node]:
            if to_x[kid]:
                on |= reach[kid]
            else:
                off |= reach[kid]
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
    weight: list[int] = []
    in_w: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    in_input = in_w_params = 0  # bit sets of the parameters I computes, and W
    for group in groups:
        members = [(node, on) for node, off, on in starts if off & group]
        params = tuple(leaves[i] for i in range(len(leaves)) if group >> i & 1)
        if any(on & group for _, on in members):  # W would rerun the dx path: do it in I
            in_input |= group
            continue
        in_w_params |= group
        first = len(weight)
        weight.extend(node for node, _ in members)
        in_w.append((tuple(range(first, len(weight))), params))
    # What I runs and W does not: the dx path but W's weight nodes, and the subgraphs of the
    # parameters I computes. Each is freed through its topmost child edge: the last in post
    # order, which no other child reaches, so the freeing backward runs that node alone; never
    # one into a leaf with tensor hooks (they would see the missing gradient).
    rank = [0] * size
    for index, node in enumerate(post):
        rank[node] = index
    kept = set(weight)
    entries: list[tuple[int, int, int]] = []  # (node, child, input slot)
    for node in post:
        if (kinds[node] & _STOP or node in kept or not _saves_tensors(types[node])
                or not (to_x[node] or reach[node] & in_input)):
            continue
        usable = [(kid, nr) for kid, nr in children[node] if not kinds[kid] & _HOOKED]
        if usable:
            entries.append((node, *max(usable, key=lambda edge: rank[edge[0]])))
    # what W runs: its weight nodes and their subgraphs off the dx path
    kept |= {node for node in range(size) if not to_x[node] and reach[node] & in_w_params}
    free = [node not in kept and not _saves_tensors(types[node]) for node in range(size)]
    return _Split(tuple(weight), tuple(in_w),
                  tuple(leaves[i] for i in range(len(leaves)) if in_input >> i & 1),
                  _batches(children, post, entries, free))


def _post_order(children: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    """The places of a walk, children before parents (iterative: graphs are deep)."""
    order: list[int] = []
    done = [False] * len(children)
    stack = [(0, iter(children[0]))]
    done[0] = True
    while stack:
        node, pending = stack[-1]
        for kid, _ in pending:
            if not done[kid]:
                done[kid] = True
                stack.append((kid, iter(children[kid])))
                break
        else:
            stack.pop()
            order.append(node)
    return order


def _batches(children: Sequence[Sequence[tuple[int, int]]], post: Sequence[int],
             entries: Sequence[tuple[int, int, int]], free: Sequence[bool]
             ) -> tuple[_Release, ...]:
    """The nodes to free (with a child edge each, in post order), in few backwards.

    A backward rooted at several of them, with their child edges as its targets, also runs
    every node on a path from one of them to another's target, with no gradient: a batch
    takes the next node only while every node such paths pass is ``free`` (saves no tensors
    and W does not run it: a W node would lose what W needs, and a node to free would run
    twice). Paths run from later to earlier in post order, so a check looks only at the span
    of the batch's nodes and targets."""
    rank = [0] * len(children)
    for index, node in enumerate(post):
        rank[node] = index

    def safe(batch: list[tuple[int, int, int]]) -> bool:
        roots = {node for node, _, _ in batch}
        captured = {child for _, child, _ in batch}
        needed: dict[int, bool] = {}  # on a path to a target: the engine runs it
        for node in post[min(rank[child] for child in captured):
                         max(rank[node] for node in roots) + 1]:
            needed[node] = any(kid in captured or needed.get(kid, False)
                               for kid, _ in children[node])
        seen, todo = set(roots), list(roots)
        while todo:
            node = todo.pop()
            if node not in roots and not free[node]:
                return False
            for kid, _ in children[node]:
                if needed.get(kid, False) and kid not in seen:
                    seen.add(kid)
                    todo.append(kid)
        return True

    batches: list[list[tuple[int, int, int]]] = []
    for entry in entries:
        if batches and safe([*batches[-1], entry]):
            batches[-1].append(entry)
        else:
            batches.append([entry])
    return tuple((tuple(node for node, _, _ in batch),
                  tuple(dict.fromkeys((child, nr) for _, child, nr in batch)))
                 for batch in batches)
