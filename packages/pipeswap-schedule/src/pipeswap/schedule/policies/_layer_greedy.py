"""The greedy loop and the prune step of the peak policy's plan at layer resolution
(:mod:`pipeswap.schedule.policies._layer_plan`): take, swap another way or drop one chunk at a
time while the peak can be lowered, then drop what lowers nothing. The loop is the
slot-resolution plan's (:mod:`pipeswap.schedule.policies._chunk_plan`)."""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from pipeswap.schedule.policies._layer_plan import Changes, LayerPlan, Way
from pipeswap.schedule.policies._slots import MAX_COPY_SLOTS
from pipeswap.schedule.steps import ChunkKey


def fill(plan: LayerPlan) -> None:
    """Take every chunk, in forward order, the first way (streamed where it may be,
    fewest load slots) whose copies hide behind those taken before."""
    for key in sorted(plan.chunks, key=lambda k: plan.chunks[k].forward_points):
        for way in _ways(plan, key, allow_stall=False, prefer_streamed=True):
            found = plan.option(key, way, allow_stall=False)
            if found is not None:
                plan.apply(key, way, *found)
                break


def take(plan: LayerPlan, ways: dict[ChunkKey, Way], allow_stall: bool) -> None:
    """Take these chunks, in forward order, each as given (where its copies hide, unless
    stalls are allowed)."""
    for key in sorted(ways, key=lambda k: plan.chunks[k].forward_points):
        found = plan.option(key, ways[key], allow_stall)
        if found is not None:
            plan.apply(key, ways[key], *found)


def lower(plan: LayerPlan, budget: int | None, *, allow_stall: bool) -> None:
    """Change one chunk at a time (take it, swap it another way, or drop it) while the
    peak can be lowered: with copies hidden as far as it goes, then, with
    ``allow_stall``, until it is within ``budget``."""
    while plan.profile.raw:
        peak = plan.peak
        if allow_stall and budget is not None and peak <= budget:
            return
        first = plan.profile.first(peak)
        best: tuple[tuple[float, int, int, int, int], int, ChunkKey, Way | None, Changes,
                    float] | None = None
        for at, key, ways, bound, alone in _ranked(plan, _moves(plan, first, allow_stall),
                                                        peak, first):
            if best is not None and (0.0, -bound) > best[0][:2]:
                break  # no move left can lower as many points at the peak
            # per way but its load slots: the fewest that lowered the peak (with copies
            # hidden), or that (the chunk alone) did not: more slots hold more
            enough: dict[tuple[bool, int | None, int | None], int] = {}
            now = plan.taken.get(key)
            if alone and now is not None:  # more slots than now hold more, and that is all
                enough[now.streamed, now.lag, now.offload] = now.load + 1
            for way in ways:
                if way is None and alone:
                    continue  # dropping it would only raise what it holds itself
                kind = (True, None, None) if way is None else (
                    way.streamed, way.lag, way.offload)
                if way is not None and way.load >= enough.get(kind, way.load + 1):
                    continue
                option = plan.option(key, way, allow_stall)
                if option is None:
                    continue
                found = _score(plan, way, option, peak, first, allow_stall)
                if way is not None and (found is not None and not allow_stall or alone):
                    enough[kind] = min(way.load, enough.get(kind, way.load))
                if found is not None and (best is None or (found[0], at) < best[:2]):
                    best = (found[0], at, key, way, found[1], found[2])
        if best is None:
            return
        _, _, key, way, changes, stall = best
        plan.apply(key, way, changes, stall)


def _ranked(plan: LayerPlan, moves: list[tuple[ChunkKey, list[Way | None]]], peak: int,
            first: int) -> list[tuple[int, ChunkKey, list[Way | None], int, bool]]:
    """``moves`` numbered, each with the most points at ``peak`` it may lower (most
    first) and whether its chunk is taken with no copy waiting on its own (then what it
    holds itself is all a move of it changes for the better), leaving out the moves that
    cannot lower point ``first``. A move changes what its own chunk holds and, through
    the copy streams, only the chunks whose copies waited for its chunk's (taking a
    chunk not yet taken only delays those, which then hold no more; over a link of no
    limit nothing waits)."""
    count = plan.profile.count
    ranked = []
    for at, (key, ways) in enumerate(moves):
        c = plan.chunks[key]
        start, stop, alone = c.forward_points, c.end, key in plan.taken
        if not plan.instant and key in plan.taken:
            for stream in plan.streams.values():
                for other in stream.waiting(key):
                    alone = False
                    start = min(start, plan.chunks[other].forward_points)
                    stop = max(stop, plan.chunks[other].end)
        if start <= first < stop:
            ranked.append((at, key, ways, count(peak, start, stop), alone))
    return sorted(ranked, key=lambda move: (-move[3], move[0]))


def _moves(plan: LayerPlan, first: int, allow_stall: bool
           ) -> list[tuple[ChunkKey, list[Way | None]]]:
    """What may lower the bytes held at point ``first``: a chunk held there swapped
    another way, or a chunk taken before it dropped, where its copies delay those of a
    chunk held there (on a stream that was busy from one to the other)."""
    lo = bisect_left(plan.forwards, first - plan.longest + 1)
    hi = bisect_right(plan.forwards, first)
    held = [at for at in range(lo, hi) if plan.chunks[plan.keys[at]].end > first]
    drops = _drops(plan, [plan.keys[at] for at in held], first)
    moves: list[tuple[ChunkKey, list[Way | None]]] = []
    for at in sorted({*held, *drops}):
        key = plan.keys[at]
        ways: list[Way | None] = []
        if plan.chunks[key].end > first and at < hi:
            ways += _ways(plan, key, allow_stall)
        if at in drops:
            ways.append(None)
        if ways:
            moves.append((key, ways))
    return moves


def _drops(plan: LayerPlan, held: list[ChunkKey], first: int) -> set[int]:
    """The taken chunks (their places in forward order) whose dropping may end a copy of
    a chunk in ``held`` sooner: those with a copy from the start of the busy spell of
    the first such copy on a stream to the last."""
    if plan.instant:
        return set()  # no copy waits for another
    owners: set[ChunkKey] = set()
    for stream in plan.streams.values():
        at = [i for key in held if key in plan.taken for i in stream.positions(key)]
        if at:
            owners.update(copy.owner for copy in stream.copies[
                stream.busy_from(min(at)):max(at) + 1])
    return {plan.place[key] for key in owners
            if key in plan.taken and plan.chunks[key].forward_points <= first}


def _ways(plan: LayerPlan, key: ChunkKey, allow_stall: bool, prefer_streamed: bool = False
          ) -> list[Way | None]:
    """Whole and streamed (as the granularity and the chunk's layers allow), each with
    every number of load slots the gap leaves, but the way the chunk is swapped now;
    with ``allow_stall`` also ways that stall compute for memory: no slot for a copy,
    or a shorter lag than the copies allow."""
    c = plan.chunks[key]
    kinds = (True,) if plan.streamed_only else (False, True) if plan.may_stream(c) else (
        False,)
    ways: list[Way] = []
    # over a link of no limit a load started later holds less and hides all the same
    slots = 1 if plan.instant else MAX_COPY_SLOTS
    for streamed in kinds[::-1] if prefer_streamed else kinds:
        ways += [Way(streamed, load) for load in range(1, slots + 1) if c.gap >= load + 2]
        if allow_stall:
            ways += [Way(streamed, 0)] if c.gap >= 2 else []
            ways += [Way(streamed, 1, None, 0)] if c.gap >= 2 else []
            ways += [Way(True, 1, lag) for lag in range(1, len(c.layers))
                     if streamed and c.gap >= 3]
            # a backward right after its forward: streamed, each copy waited for
            ways += [Way(True, 0, lag, 0) for lag in range(1, len(c.layers))
                     if streamed and c.gap == 1]
    return [way for way in ways if way != plan.taken.get(key)]


def _score(plan: LayerPlan, way: Way | None, option: tuple[Changes, float], peak: int,
           first: int, allow_stall: bool
           ) -> tuple[tuple[float, int, int, int, int], Changes, float] | None:
    """How well swapping a chunk as ``way`` with this ``option`` (its changes and the
    stall they leave) lowers the peak (smaller is better), or None when it leaves the first
    point at the peak there, raises a point above it, or leaves as many points at it."""
    changes, stall = option
    spans = plan.deltas(changes)
    if next((change for start, stop, change in spans if start <= first < stop), 0) >= 0:
        return None
    lowered = raised = reduction = 0
    profile = plan.profile
    for start, stop, change in spans:
        if change > 0:
            if profile.highest_in(start, stop) + change > peak:
                return None
            raised += profile.count(peak - change, start, stop)
        else:
            count = profile.count(peak, start, stop)
            lowered += count
            reduction -= change * count
    added = stall - plan.stall
    if raised >= lowered or (added > 0 and not allow_stall):
        return None  # fewer points at the peak each time, so that the loop ends
    streamed, load = (way.streamed, way.load) if way is not None else (False, 0)
    return ((max(added, 0.0), raised - lowered, -reduction, int(streamed), load),
            changes, stall)


def unstream(plan: LayerPlan) -> None:
    """Swap whole, latest taken first, each streamed chunk that streams for nothing:
    whose whole swap leaves the peak and the stall as they are."""
    for key, way in reversed(list(plan.taken.items())):
        if not way.streamed:
            continue
        gap = plan.chunks[key].gap
        for whole in (Way(False, load) for load in range(1, MAX_COPY_SLOTS + 1)
                      if gap >= load + 2):
            found = plan.option(key, whole, allow_stall=plan.stall > 0)
            if found is None or found[1] > plan.stall:
                continue
            peak = plan.peak
            if plan.within(plan.deltas(found[0]), peak):
                plan.apply(key, whole, *found)
                break


def without(plan: LayerPlan, key: ChunkKey) -> LayerPlan:
    """A copy of ``plan`` with ``key`` no longer swapped."""
    other = plan.copy()
    found = other.option(key, None, allow_stall=plan.stall > 0)
    assert found is not None  # dropping a chunk only frees its streams
    other.apply(key, None, *found)
    return other


def prune(plan: LayerPlan) -> None:
    """Drop, latest taken first, each chunk whose removal leaves the peak as it is."""
    for key in reversed(list(plan.taken)):
        peak = plan.peak
        found = plan.option(key, None, allow_stall=plan.stall > 0)
        assert found is not None  # dropping a chunk only frees its streams
        changes, stall = found
        if plan.within(plan.deltas(changes), peak):
            plan.apply(key, None, changes, stall)
