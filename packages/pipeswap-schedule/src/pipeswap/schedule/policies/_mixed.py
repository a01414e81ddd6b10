"""Keep, offload or recompute: what the peak policy plans on one rank under a budget when it
may recompute layers as well as swap them.

Recomputing a layer costs a forward share of compute and frees the layer's activations but
its input, with no copy; swapping costs no compute while its copies hide and stalls compute
when they do not. Where the link falls short differs along a rank's order: its first
forwards (before any backward) make activations faster than the D2H stream takes them, its
last backwards (after every forward) need them back faster than the H2D stream brings them,
and in between a forward and a backward share each copy's time. So the rank's chunks form
groups (those forwarded before the rank's first backward, those whose backward follows its
last forward, the rest), and each group has a ladder of recompute levels: at level ``t`` of
``n`` its chunks recompute their first layers, ``t / n`` of them on average, spread evenly.
The swap plan at each choice of levels then offloads what is left (a recomputed layer's
kept input too) with copies that hide.

More recompute holds less, so the search starts with every layer recomputed and lowers one
group's level at a time, by bisection, as far as the swap plan still meets the budget with
every copy hidden. The plan kept is the fastest (the stall plus the recompute seconds) of
that mix, swap alone (copies stalling where the budget needs them), recompute alone and the
plans alike on every chunk (:func:`alike`: the same layers recomputed, the first or some
spread out, and the same streaming, copies stalling where the link falls short), among
those that meet the budget, or the one that comes closest; so, on the rank's own timeline,
the mix is never slower than either alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.policies.base import Granularity
from pipeswap.schedule.steps import ChunkKey
from pipeswap.schedule.swap_plan import SwapCandidate, SwapPlacement

#: Recompute levels per layer of a chunk: the ladder's resolution.
LEVELS_PER_LAYER = 8
#: The most levels a ladder has (a bound on the bisection's plans).
MAX_LEVELS = 64
#: How far ahead of its backward a streamed plan alike on every chunk may load.
DEEPEST_LOAD = 2
#: The layer lags plans alike on every chunk try: these (up to the chunk's layers), and
#: a quarter, half, three quarters and all of a longer chunk's layers (a plan is a
#: simulation, and their number grows with the square of a chunk's layers otherwise).
LAGS = (1, 2, 3, 4)
#: The recompute counts plans alike on every chunk try: each below this, and as many
#: spread evenly over a longer chunk's layers (few recomputed layers are where the
#: fastest plans are, and where one more layer counts most).
RECOMPUTE_COUNTS = 8


class Outcome(Protocol):
    """What a search compares of a rank's plan."""

    @property
    def shortfall(self) -> int: ...

    @property
    def exposed_copy(self) -> float: ...

    @property
    def recompute_s(self) -> float: ...


_Outcome = TypeVar("_Outcome", bound=Outcome)


@dataclass(frozen=True)
class Trial(Generic[_Outcome]):
    """One rank's plan: the layers recomputed per chunk, the chunks swapped, its outcome."""

    recomputed: Mapping[ChunkKey, tuple[int, ...]]
    placements: dict[ChunkKey, SwapPlacement]
    outcome: _Outcome

    @property
    def free(self) -> bool:
        """Whether it meets the budget with every copy hidden."""
        return self.outcome.shortfall == 0 and self.outcome.exposed_copy == 0

    @property
    def merit(self) -> tuple[int, float, float]:
        """Smaller is better: the budget's shortfall, the time added, the recompute."""
        outcome = self.outcome
        return (outcome.shortfall, outcome.exposed_copy + outcome.recompute_s,
                outcome.recompute_s)


def levels_for(layers: Sequence[int]) -> int:
    """The ladder's levels for chunks of at most ``max(layers)`` layers."""
    return min(MAX_LEVELS, LEVELS_PER_LAYER * max(layers, default=1))


def ladder(keys: Sequence[ChunkKey], layers_of: Callable[[ChunkKey], int], level: int,
           levels: int) -> dict[ChunkKey, tuple[int, ...]]:
    """Level ``level`` of ``levels``: each chunk of ``keys`` (in forward order) recomputes
    its first layers, ``level / levels`` of its layers on average, spread evenly over the
    chunks of each stage (one tuple per count, shared)."""
    seen: dict[int, int] = {}
    firsts: dict[int, tuple[int, ...]] = {}
    out: dict[ChunkKey, tuple[int, ...]] = {}
    for key in keys:
        count = layers_of(key)
        j = seen.get(key[0], 0)
        seen[key[0]] = j + 1
        share = ((j + 1) * level * count) // levels - (j * level * count) // levels
        if share:
            layers = firsts.get(share)
            if layers is None:
                layers = firsts[share] = tuple(range(share))
            out[key] = layers
    return out


def search(evaluate: Callable[[Mapping[ChunkKey, tuple[int, ...]], bool], Trial[_Outcome]],
           groups: Sequence[Sequence[ChunkKey]], layers_of: Callable[[ChunkKey], int],
           levels: int, alone: Trial[_Outcome],
           pick: Callable[[list[Trial[_Outcome]]], Trial[_Outcome]] | None = None,
           others: Callable[[float], list[Trial[_Outcome]]] | None = None
           ) -> Trial[_Outcome]:
    """The best of the mix, swap alone, recompute alone (``alone``) and ``others`` (made
    only where swap alone does not meet the budget with its copies hidden); see the module
    docstring. ``evaluate(recomputed, stall)`` plans the swap around recomputed layers,
    taking copies that stall compute only with ``stall``; ``groups`` partition the rank's
    chunks, each in forward order. ``pick`` chooses among those that meet the budget where
    more than one does (default: the best :attr:`Trial.merit`). ``others`` is given the time
    the best trial so far that meets the budget adds (infinite without ``pick`` or where
    none does): an other trial that cannot add less need not be finished."""
    swap_alone = evaluate({}, True)
    if swap_alone.free:
        return swap_alone
    hidden: dict[tuple[int, ...], Trial[_Outcome]] = {}

    def at(choice: tuple[int, ...]) -> Trial[_Outcome]:
        if choice not in hidden:
            recomputed: dict[ChunkKey, tuple[int, ...]] = {}
            for group, level in zip(groups, choice):
                recomputed.update(ladder(group, layers_of, level, levels))
            hidden[choice] = evaluate(recomputed, False)
        return hidden[choice]

    current = [levels] * len(groups)
    tried = [swap_alone, alone]
    if at(tuple(current)).free:
        # the biggest group first: its recompute costs the most
        for g in sorted(range(len(groups)), key=lambda g: -len(groups[g])):
            low, high = 0, current[g]
            while low < high:
                middle = (low + high) // 2
                if at((*current[:g], middle, *current[g + 1:])).free:
                    high = middle
                else:
                    low = middle + 1
            current[g] = low
        tried.append(at(tuple(current)))
    else:  # even everything recomputed needs stalls
        tried.append(evaluate(at(tuple(current)).recomputed, True))
    if others is not None:
        tried += others(math.inf if pick is not None else min(
            (trial.merit[1] for trial in tried if trial.outcome.shortfall == 0),
            default=math.inf))
    meeting = [trial for trial in tried if trial.outcome.shortfall == 0]
    if pick is not None and len(meeting) > 1:
        return pick(meeting)
    return min(tried, key=lambda trial: trial.merit)


def spread(count: int, k: int) -> tuple[int, ...]:
    """``k`` of a chunk's ``count`` layers spread evenly, the last among them: each
    streamed layer then has a recomputed one after it, whose recompute in the backward
    hides the streamed layer's load (of four layers, two: 1 and 3)."""
    return tuple(sorted({count - 1 - (i * count) // k for i in range(k)}))


#: A plan alike on every chunk, as :func:`alike` names it: ``(k, d, e, s)``.
AlikeName = tuple[int, int, int, int]


def alike(candidates: Sequence[SwapCandidate], layers_of: Callable[[ChunkKey], int],
          granularity: Granularity
          ) -> dict[AlikeName, tuple[dict[ChunkKey, tuple[int, ...]],
                                     dict[ChunkKey, SwapPlacement]]]:
    """The rank's plans alike on every chunk, by ``(k, d, e, s)``: ``k`` of its layers
    recomputed (``k`` from 0 to one short of its layers: each below
    :data:`RECOMPUTE_COUNTS`, and as many spread over a longer chunk; the first ``k`` for
    ``s`` 0, or for ``s`` 1, where that differs, ``k`` spread evenly, the last among them:
    :func:`spread`), the rest streamed with a lag of ``d`` layers (:data:`LAGS` and shares
    of the chunk; 0: whole, where every chunk has one layer or ``granularity`` is chunk; a
    chunk of one layer goes whole) and loaded ``e`` layers ahead of its backward (1 or
    :data:`DEEPEST_LOAD`; 0 where whole), one compute slot for each copy (none for the load
    where the backward comes two slots after the forward; a chunk whose backward comes
    right after its forward is not swapped). Their copies may stall where a slow link
    cannot keep up, which the greedy plans never take where the budget can be met without:
    in a pipeline another rank's slack may absorb such a stall, and one recomputed layer a
    chunk instead of two saves more than it costs. Loads further ahead hide a load slower
    than a layer's backward for one more layer on the device."""
    counts = [layers_of(c.key) for c in candidates]
    return {name: alike_plan(candidates, counts, name)
            for name in alike_names(max(counts, default=1), granularity)}


def alike_names(most: int, granularity: Granularity) -> list[AlikeName]:
    """The names of :func:`alike`'s plans for a rank whose chunks hold at most ``most``
    layers, in the order it makes them."""
    lags = [0] if granularity == "chunk" or most == 1 else sorted(
        {d for d in LAGS if d <= most} | {-(-most * share // 4) for share in range(1, 5)})
    counts = sorted(set(range(min(most, RECOMPUTE_COUNTS)))
                    | {(i * most) // RECOMPUTE_COUNTS for i in range(RECOMPUTE_COUNTS)})
    return [(k, lag, depth, shape)
            for k in counts
            for shape in ((0, 1) if spread(most, k) != tuple(range(k)) else (0,))
            for lag in lags
            for depth in (range(1, DEEPEST_LOAD + 1) if lag else (0,))]


def alike_plan(candidates: Sequence[SwapCandidate], counts: Sequence[int], name: AlikeName
               ) -> tuple[dict[ChunkKey, tuple[int, ...]], dict[ChunkKey, SwapPlacement]]:
    """The plan :func:`alike` names ``name``, of ``candidates`` holding ``counts`` layers
    each."""
    k, lag, depth, shape = name
    return (alike_recomputed(candidates, counts, k, shape),
            alike_placements(candidates, counts, lag, depth))


def alike_recomputed(candidates: Sequence[SwapCandidate], counts: Sequence[int], k: int,
                     shape: int) -> dict[ChunkKey, tuple[int, ...]]:
    """What a plan :func:`alike` names ``(k, _, _, shape)`` recomputes."""
    return {c.key: spread(count, k) if shape else tuple(range(k))
            for c, count in zip(candidates, counts) if 0 < k < count}


def alike_placements(candidates: Sequence[SwapCandidate], counts: Sequence[int], lag: int,
                     depth: int) -> dict[ChunkKey, SwapPlacement]:
    """Where a plan :func:`alike` names ``(_, lag, depth, _)`` swaps."""
    placements: dict[ChunkKey, SwapPlacement] = {}
    for c, count in zip(candidates, counts):
        if c.gap >= 2:
            streams = count > 1 and lag > 0
            placements[c.key] = SwapPlacement(
                1, min(1, c.gap - 2), min(lag, count) if streams else 0,
                min(depth, count) if streams else 1)
    return placements


def layer_counts(costs: CostModel) -> Callable[[ChunkKey], int]:
    """``len(costs.layer_bytes(key))``, worked out once per stage where the cost model
    gives the chunk no bytes of its own."""
    per_stage: dict[int, int] = {}

    def layers_of(key: ChunkKey) -> int:
        if key in costs.chunks:
            return len(costs.layer_bytes(key))
        found = per_stage.get(key[0])
        if found is None:
            found = per_stage[key[0]] = len(costs.layer_bytes(key))
        return found

    return layers_of
