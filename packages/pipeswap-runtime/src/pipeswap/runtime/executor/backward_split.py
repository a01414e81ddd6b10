"""How the backward of one chunk splits into I and W: its graph's weight nodes, the groups W
runs them in, the nodes only I runs (released in batches), found once per graph shape.

The reasons are in :mod:`pipeswap.runtime.executor.backward`'s docstring, which runs the plan this
module makes. torch is imported inside the functions: importing the runtime stays cheap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch.autograd.graph import GradientEdge, Node

Grads = tuple["torch.Tensor | None", ...]

_ACCUMULATE = "torch::autograd::AccumulateGrad"


@dataclass(eq=False)
class Plan:
    """How one chunk's backward splits (see the module's docstring)."""

    nodes: list[Node]  # the weight nodes W starts from
    groups: list[tuple[Sequence[int], list[torch.Tensor]]]  # (indices into nodes, parameters)
    in_input: list[torch.Tensor]  # parameters I computes (the groups W cannot)
    release: list[tuple[list[Node], list[GradientEdge]]]  # nodes only I runs, in batches
    received: list[Grads | None]  # per weight node, what I gave it
    keepers: list[Callable[[Grads], None]]  # per weight node, the pre-hook that keeps it


def find_plan(root: torch.Tensor, xs: Sequence[torch.Tensor], cache: SplitCache | None
          ) -> Plan | None:
    """How this chunk's backward splits; None when the output reaches none of ``xs``."""
    from torch.autograd.graph import get_gradient_edge

    assert root.grad_fn is not None
    order, shape = _walk(root.grad_fn, {id(get_gradient_edge(x).node) for x in xs})
    split = cache.find(shape) if cache is not None else _analyse(shape)
    return None if split is None else split.bind(order)


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

    def bind(self, order: Sequence[Node]) -> Plan:
        """The plan of the chunk whose walk found ``order``."""
        from torch.autograd.graph import GradientEdge

        received: list[Grads | None] = [None] * len(self.weight)
        return Plan(
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
