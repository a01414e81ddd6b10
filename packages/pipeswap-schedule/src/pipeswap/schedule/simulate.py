"""An event-driven simulation of all ranks of a schedule: time, memory and copy overlap.

Each rank has one compute stream and copy streams for D2H and H2D (one shared copy stream
where the link is not duplex). Steps run in order on the compute stream; a forward waits for
its input (a message from the previous stage's rank, or that stage's forward on this rank),
a backward for its gradient. Sends leave when the compute stream reaches them and arrive
after latency + bytes / bandwidth; receives only post. Swap steps behave as in the runtime:
LO starts a copy on the D2H stream once the compute before it is done, WO makes compute wait
for that copy and then frees the chunk's movable bytes, LL allocates them again and starts
the H2D copy, WL makes compute wait for it. A chunk's activations are allocated by its
forward and freed by its backward: B frees them all, a split backward's I all but what its
W needs (``ChunkBytes.after_input``), and W the rest. A forward's bytes count in full at
once (the runtime collects them one by one during the forward, never more), so a rank's peak
is what the runtime's swap manager counts: the most its chunks' saved activations hold.

A streamed chunk (SO before its forward, lag D) moves layer by layer, each layer taking an
equal share of the chunk's compute and its own bytes (``CostModel.layer_bytes``). Its
forward counts each layer when it ends, starts that layer's D2H copy and, from layer D on,
waits for the copy of the layer D back and frees it; WO waits for the last D layers' copies
and frees them. SL (lag E, its load depth) allocates the last E layers and starts their H2D
copies, the last first; WL waits for the last layer's, and the backward, layer by layer from
the last, waits for the layer's load, allocates the layer E below and starts its load, then
frees the layer it computed; a split backward's I keeps every layer until it ends (it keeps
the graph for W) and then frees all but what W needs.
A lag beyond the chunk's layers is refused: it counts layers the chunk does not have.

A chunk with recomputed layers (RC before its forward) keeps only each such layer's input
(``CostModel.recomputed_layers``), whole or streamed alike. Its backward, layer by layer
from the last, runs a recomputed layer's forward again (its share of the chunk's forward
time) just before the layer's own part, and holds what that makes from then until the part
ends; a B frees each layer's bytes as its part ends (autograd frees a layer's saved tensors,
and a recomputed layer's kept input, once its backward is done), while a split backward's I
keeps them until it ends. Such an I also does a recomputed layer's share of W (its weight
gradients, from what the recompute made), so W is shorter by as much. A layer the chunk
does not have is refused.

FSDP steps take no time here, but the parameters they gather count in memory: UNSHARD adds
the stage's ``CostModel.gathered_bytes`` to the rank's gathered bytes, RESHARD takes the
same away (REDUCE_GRAD, and gradients, are not counted). The rank's memory is its saved
activations plus its gathered parameters, its peak taken after every change in program
order as the activation peak is: without FSDP steps the two peaks are equal, and with them
the peak is what the runtime counts (the swap manager's bytes plus those of the stages it
has unsharded). The validator refuses an UNSHARD of a stage already gathered and a RESHARD
of one that is not, as it refuses any schedule that cannot run (a deadlock names its cycle).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import NamedTuple

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule._messages import Message, MessageLog
from pipeswap.schedule._rank_walk import (
    RankState,
    Recomputed,
    Span,
    Streamed,
    recompute_backward,
    stream_backward,
    stream_forward,
    stream_swap,
    swap_whole,
)
from pipeswap.schedule.costs import ChunkBytes, CostModel
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import COMPUTE, RECVS, ChunkKey, Order, Step, StepType
from pipeswap.schedule.validation import check_order_layer_counts, validate

_F, _I, _W = StepType.FWD, StepType.BWD_INPUT, StepType.BWD_WEIGHT
_SEND_F, _SEND_B = StepType.FWD_SEND, StepType.BWD_SEND
_LO, _WO = StepType.SWAP_LAUNCH_OFFLOAD, StepType.SWAP_WAIT_OFFLOAD
_LL, _WL = StepType.SWAP_LAUNCH_LOAD, StepType.SWAP_WAIT_LOAD
_SO, _SL = StepType.SWAP_STREAM_OFFLOAD, StepType.SWAP_STREAM_LOAD
_SWAPS = frozenset({_LO, _WO, _LL, _WL, _SO, _SL})
_UNSHARD, _RESHARD = StepType.FSDP_UNSHARD, StepType.FSDP_RESHARD
_RC = StepType.RECOMPUTE


@dataclass(frozen=True)
class SwappedChunk:
    """One swapped chunk on its rank: when its copies ran and whether they were hidden."""

    stage: int
    micro: int
    offload: tuple[float, float]  # D2H copy start, end
    wait_offload: float  # when compute reached WO (and, if later, the copy's end)
    load: tuple[float, float]  # H2D copy start, end
    wait_load: float
    lifespan: float  # from the end of its forward to the start of its backward
    off_device: float  # seconds its movable bytes were not on the device
    hidden: bool  # no wait for its copies stalled compute
    layer_lag: int = 0  # 0: swapped whole; from 1: streamed layer by layer with this lag
    load_depth: int = 0  # a streamed chunk's: how many layers ahead of its backward it loads

    @property
    def streamed(self) -> bool:
        return self.layer_lag > 0


@dataclass(frozen=True)
class RankResult:
    """One rank's simulated step. Peaks are the most held at once, in bytes; ``_no_swap``
    peaks are those of the same order with its swap and recompute steps left out."""

    rank: int
    step_time: float  # when the rank's last step finished
    busy: float  # compute seconds
    bubble_fraction: float  # idle share of the whole pipeline's step time
    exposed_copy: float  # compute seconds spent waiting on swap copies
    peak_activation_bytes: int  # saved activations
    peak_activation_bytes_no_swap: int
    peak_parameter_bytes: int  # parameters gathered by FSDP (0 without FSDP steps)
    peak_memory_bytes: int  # saved activations and gathered parameters together
    peak_memory_bytes_no_swap: int
    memory: tuple[tuple[float, int], ...]  # (time, activation bytes held) after each change
    swapped: tuple[SwappedChunk, ...]
    spans: tuple[Span, ...]
    recomputed_layers: int = 0  # layer forwards run again in backwards
    recompute_s: float = 0.0  # the compute seconds they took (part of busy)


@dataclass(frozen=True)
class SimulationResult:
    step_time: float  # the whole pipeline's: the last rank to finish
    ranks: tuple[RankResult, ...]


class _Flat(NamedTuple):
    """A rank's order as the simulator walks it."""

    leaves: list[Step]  # the leaves it runs, in order, receives and RC left out
    split: set[ChunkKey]  # chunks whose backward ends with W
    streams: bool  # it has SO steps
    recomputed: dict[ChunkKey, tuple[int, ...]]  # each RC's layers


def _flatten(order: Order) -> _Flat:
    leaves: list[Step] = []
    split: set[ChunkKey] = set()
    streams = False
    recomputed: dict[ChunkKey, tuple[int, ...]] = {}
    for step in order:
        if step is None:
            continue
        for leaf in step.sub_steps or (step,):
            kind = leaf.type
            if kind in RECVS:
                continue
            if kind is _RC:  # it marks how the chunk's computes run; it runs nothing
                assert leaf.layers is not None  # Step gives every RC its layers
                recomputed[leaf.key] = leaf.layers
                continue
            leaves.append(leaf)
            if kind is _W:
                split.add(leaf.key)
            elif kind is _SO:
                streams = True
    return _Flat(leaves, split, streams, recomputed)


@gc_paused
def simulate(schedule: Schedule, costs: CostModel, *, timeline: bool = True,
             check: bool = True) -> SimulationResult:
    """Run every rank's order with ``costs``; see the module docstring for the model.

    ``timeline=False`` leaves each rank's ``memory`` and ``spans`` empty (what traces and
    plots draw), which makes a large schedule's simulation faster; every figure is the same.
    ``check=False`` skips validating the schedule first, for one a pass made from a valid
    schedule (the swap planners' many trials): it is half of a simulation's time.
    """
    if check:
        validate(schedule, transport="tagged")  # the model below: sends never wait
    ranks = _walk(list(enumerate(schedule.orders)), schedule.stage_ranks,
                  schedule.num_stages - 1, costs, timeline, {})
    step_time = max((s.compute for s in ranks), default=0.0)
    return SimulationResult(step_time, tuple(_result(s, step_time) for s in ranks))


def simulate_alone(order: Order, rank: int, costs: CostModel,
                   timeline: bool = False) -> RankResult:
    """One rank's valid ``order`` run on its own, as :func:`simulate` runs it but with every
    other rank's output there whenever it is wanted (compute back to back, as the swap
    policies plan): its peak, and the compute it waits for its own copies; its memory and
    spans only with ``timeline``."""
    state, = _walk([(rank, order)], None, -1, costs, timeline, _AllReady())
    return _result(state, state.compute)


class Logged(NamedTuple):
    """A whole schedule's run, kept to bound the step of the same schedule with one rank's
    order changed (see :mod:`pipeswap.schedule._messages`)."""

    finishes: tuple[float, ...]  # per rank, when its last step ended
    arrivals: dict[Message, float]  # when each message got where it is wanted
    tails: dict[Message, float]  # per message, the least time the step needs after it


@gc_paused
def simulate_logged(schedule: Schedule, costs: CostModel, changing: int | None) -> Logged:
    """Run a schedule a pass made from a valid one (not validated again) and keep its
    messages' arrivals, and their tails for any order of rank ``changing`` (None: of any
    rank) that adds swap or recompute steps to its own."""
    arrivals: dict[Message, float] = {}
    log = MessageLog()
    ranks = _walk(list(enumerate(schedule.orders)), schedule.stage_ranks,
                  schedule.num_stages - 1, costs, False, arrivals, log)
    finishes = tuple(s.compute for s in ranks)
    return Logged(finishes, arrivals, log.tails(costs.p2p_time(), changing))


def simulate_against(logged: Logged, schedule: Schedule, rank: int, order: Order,
                     costs: CostModel) -> tuple[float, dict[Message, float]]:
    """``order`` run as ``rank`` against ``logged``'s messages from the other ranks: when
    it ends, and when each message it sends arrives."""
    sent = _Against(logged.arrivals, {stage for stage, on in enumerate(schedule.stage_ranks)
                                      if on == rank})
    state, = _walk([(rank, order)], schedule.stage_ranks, schedule.num_stages - 1, costs,
                   False, sent)
    return state.compute, sent


class _Against(dict[Message, float]):
    """The messages a rank run alone finds: its own as it sends them, the others' as
    ``arrivals`` has them."""

    def __init__(self, arrivals: Mapping[Message, float], own: set[int]) -> None:
        super().__init__()
        self.arrivals, self.own = arrivals, own

    def __contains__(self, key: object) -> bool:
        return dict.__contains__(self, key) or (
            isinstance(key, tuple) and key[1] not in self.own and key in self.arrivals)

    def __missing__(self, key: Message) -> float:
        if key[1] in self.own:
            raise KeyError(key)
        return self.arrivals[key]


class _AllReady(dict[Message, float]):
    """What a rank run alone finds: every message there from the start."""

    def __contains__(self, key: object) -> bool:
        return True

    def __missing__(self, key: Message) -> float:
        return 0.0


def _walk(orders: list[tuple[int, Order]], stage_ranks: tuple[int, ...] | None,
          last_stage: int, costs: CostModel, timeline: bool,
          ready: MutableMapping[Message, float], log: MessageLog | None = None
          ) -> list[RankState]:
    """Run ``orders`` (rank, order) together, each rank's output published in ``ready``
    (and its computes and messages in ``log``); without ``stage_ranks`` (a rank alone) no
    stage hands off to another on its rank. ``ready`` is typed as a mapping, not a dict:
    the compiled build reads a dict with dict's own lookups, which would pass over the
    ones :class:`_Against` and :class:`_AllReady` give."""
    walk = _Walk(orders, stage_ranks, last_stage, costs, timeline, ready, log)
    ranks, runnable, advance = walk.ranks, walk.runnable, walk.advance
    while runnable:
        advance(ranks[heapq.heappop(runnable)])
    unfinished = [s.rank for s in ranks if s.index < len(s.leaves)]
    if unfinished:  # validate() proved the orders run together; this would be a bug here
        raise AssertionError(f"simulation stalled on ranks {unfinished}")
    return ranks


class _Walk:
    """What the ranks of one :func:`_walk` share: the messages each waits for, the ranks
    free to run on, and the costs looked up once."""

    __slots__ = ("ranks", "ready", "log", "stage_ranks", "last_stage", "costs", "waiting",
                 "runnable", "position", "transfer", "bytes_of", "times")

    def __init__(self, orders: list[tuple[int, Order]], stage_ranks: tuple[int, ...] | None,
                 last_stage: int, costs: CostModel, timeline: bool,
                 ready: MutableMapping[Message, float], log: MessageLog | None) -> None:
        flat = [_flatten(order) for _, order in orders]
        self.ranks = [RankState(r, f.leaves, costs.rank_link(r), timeline, split=f.split,
                                recomputed=f.recomputed) for (r, _), f in zip(orders, flat)]
        self.ready, self.log, self.costs = ready, log, costs
        self.stage_ranks, self.last_stage = stage_ranks, last_stage
        # ("F", s, m): stage s's output for micro m is where stage s + 1 runs; ("B", s, m):
        # the gradient of stage s's input is where stage s - 1 runs. Value: the time it got
        # there.
        self.waiting: dict[Message, list[int]] = defaultdict(list)
        self.runnable = list(range(len(self.ranks)))  # positions in ranks
        self.position = {rank: k for k, (rank, _) in enumerate(orders)}
        self.transfer = costs.p2p_time()
        self.bytes_of = bytes_of = _ChunkBytesCache(costs)
        if any(f.streams or f.recomputed for f in flat):
            for rank, order in orders:
                check_order_layer_counts(
                    rank, order, lambda key: len(bytes_of.layers(key)),
                    "the cost model gives a chunk of stage {stage} {layers} layer(s) "
                    "(--layers-per-stage; CostModel.layers, StageCosts.layers or the chunk's "
                    "measured ChunkBytes.layers)")
        self.times: dict[tuple[StepType, int, int], float] = {}

    def duration_of(self, kind: StepType, stage: int, rank: int) -> float:
        found = self.times.get((kind, stage, rank))
        if found is None:
            found = self.times[(kind, stage, rank)] = self.costs.compute_time(kind, stage, rank)
        return found

    def publish(self, rank: int, key: Message, at: float) -> None:
        self.ready[key] = at
        if self.log is not None:
            self.log.published(rank, key)
        for rank in self.waiting.pop(key, ()):
            heapq.heappush(self.runnable, rank)

    def advance(self, state: RankState) -> None:
        """Run the rank's leaves until one waits for another rank, or none is left."""
        leaves, index = state.leaves, state.index
        ready, last_stage = self.ready, self.last_stage
        while index < len(leaves):
            leaf = leaves[index]
            kind = leaf.type
            if kind in COMPUTE:
                stage, micro = leaf.stage, leaf.micro
                assert stage is not None and micro is not None  # a leaf of a chunk
                wanted: Message | None
                if kind is _F:
                    wanted = None if stage == 0 else ("F", stage - 1, micro)
                elif kind is _W or stage == last_stage:
                    wanted = None
                else:
                    wanted = ("B", stage + 1, micro)
                if wanted is not None and wanted not in ready:
                    self.waiting[wanted].append(self.position[state.rank])
                    break
                self.compute(state, leaf, kind, (stage, micro), wanted)
            elif kind is _SEND_F or kind is _SEND_B:
                stage, micro = leaf.stage, leaf.micro
                assert stage is not None and micro is not None  # a leaf of a chunk
                self.publish(state.rank, ("F" if kind is _SEND_F else "B", stage, micro),
                             state.compute + self.transfer)
            elif kind in _SWAPS:
                self.swap(state, leaf, kind)
            elif kind is _UNSHARD or kind is _RESHARD:
                state.gather(_gathered_change(self.costs, leaf))
            # FSDP steps take no time
            index += 1
        state.index = index

    def swap(self, state: RankState, leaf: Step, kind: StepType) -> None:
        """A swap step: a chunk's whole copy, or a streamed chunk's layers."""
        stage, micro = leaf.stage, leaf.micro
        assert stage is not None and micro is not None  # a leaf of a chunk
        key = (stage, micro)
        bytes_of = self.bytes_of
        recomputed = state.recomputed.get(key)
        redo = None if recomputed is None else bytes_of.recomputed(key, recomputed)
        if kind is _SO:
            state.streams[key] = Streamed(
                leaf.lag or 1, bytes_of.layers(key) if redo is None else redo.layers)
        streamed = state.streams.get(key)
        if streamed is None:
            kept = bytes_of(key) if redo is None else redo.chunk
            swap_whole(state, leaf, key, kept.movable)
        else:
            stream_swap(state, leaf, streamed)

    def compute(self, state: RankState, leaf: Step, kind: StepType, key: ChunkKey,
                wanted: Message | None) -> None:
        """A compute leaf whose input is there: its time, and what it holds or frees."""
        stage, micro = key
        start = state.compute if wanted is None else max(state.compute, self.ready[wanted])
        duration = self.duration_of(kind, stage, state.rank)
        chunk = plain = self.bytes_of(key)
        split_input = kind is _I and key in state.split
        redo = None
        again = 0.0  # in a backward, before each recomputed layer's own part
        recomputed = state.recomputed.get(key)
        if recomputed is not None:
            redo = self.bytes_of.recomputed(key, recomputed)
            chunk = redo.chunk
            if kind is not _F:  # a recomputed layer's W runs in I, from what I made again
                redone = len(redo.chosen)
                w_share = self.duration_of(_W, stage, state.rank) / len(redo.layers)
                if kind is _W:  # (never below 0 by a rounding, every layer recomputed)
                    duration = max(0.0, duration - w_share * redone)
                else:
                    forward = self.duration_of(_F, stage, state.rank) / len(redo.layers)
                    again = forward + (w_share if split_input else 0.0)
                    state.recomputed_layers += redone
                    state.recompute_s += forward * redone
        seconds = duration + again * (0 if redo is None else len(redo.chosen))
        state.busy += seconds
        if self.log is not None:
            self.log.computed(state.rank, wanted, seconds, kind is _W)
        streamed = state.streams.get(key) if kind is not _W else None
        if streamed is not None:
            if kind is _F:
                end = stream_forward(state, leaf, streamed, start, duration)
            else:
                end = stream_backward(state, leaf, streamed, start, duration, redo, again)
        elif redo is not None and kind is not _F and kind is not _W:  # B or I
            end = recompute_backward(state, leaf, redo, start, duration, again)
        else:
            state.compute = end = start + duration
            if state.timeline:
                state.spans.append(Span("compute", str(leaf), start, end))
        if kind is _F:
            state.change_plain(plain.total)
            if streamed is None:
                state.change(chunk.total)
            state.forwarded[key] = end
            stage_ranks = self.stage_ranks
            if stage_ranks and stage < self.last_stage and stage_ranks[stage + 1] == state.rank:
                self.publish(state.rank, ("F", stage, micro), end)  # local hand-off
            return
        if kind is not _W:
            state.lifespans[key] = start - state.forwarded[key]
            stage_ranks = self.stage_ranks
            if stage_ranks and stage > 0 and stage_ranks[stage - 1] == state.rank:
                self.publish(state.rank, ("B", stage, micro), end)
        state.change_plain(-_freed(kind, plain, split_input))
        if streamed is not None or (redo is not None and kind is not _W and not split_input):
            return  # freed layer by layer
        freed = _freed(kind, chunk, split_input)
        if freed or not split_input:
            state.change(-freed)


def _gathered_change(costs: CostModel, leaf: Step) -> int:
    """What an UNSHARD adds to its rank's gathered parameter bytes, or a RESHARD takes away."""
    assert leaf.stage is not None  # Step requires a stage on FSDP steps
    size = costs.gathered_bytes(leaf.stage)
    return size if leaf.type is _UNSHARD else -size


def _result(state: RankState, step_time: float) -> RankResult:
    swapped = []
    for (stage, micro), rec in state.copies.items():
        if "wait_load" not in rec:
            continue
        swapped.append(SwappedChunk(
            stage, micro, (rec["offload_start"], rec["offload_end"]), rec["wait_offload"],
            (rec["load_start"], rec["load_end"]), rec["wait_load"],
            lifespan=state.lifespans[(stage, micro)],
            off_device=rec["off_until"] - rec["wait_offload"],
            hidden=not rec.get("stalled"), layer_lag=int(rec.get("lag", 0)),
            load_depth=int(rec.get("depth", 0))))
    return RankResult(
        rank=state.rank, step_time=state.compute, busy=state.busy,
        bubble_fraction=1 - state.busy / step_time if step_time > 0 else 0.0,
        exposed_copy=state.exposed, peak_activation_bytes=state.peak,
        peak_activation_bytes_no_swap=state.peak_plain,
        peak_parameter_bytes=state.peak_gathered, peak_memory_bytes=state.peak_memory,
        peak_memory_bytes_no_swap=state.peak_plain_memory,
        memory=tuple(state.memory), swapped=tuple(swapped), spans=tuple(state.spans),
        recomputed_layers=state.recomputed_layers, recompute_s=state.recompute_s)


class _ChunkBytesCache:
    """``costs.chunk_bytes`` with each stage's default worked out once."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs
        self._stages: dict[int, ChunkBytes] = {}
        self._layers: dict[ChunkKey | int, tuple[ChunkBytes, ...]] = {}
        self._recomputed: dict[tuple[ChunkKey | int, tuple[int, ...]], Recomputed] = {}

    def recomputed(self, key: ChunkKey, layers: tuple[int, ...]) -> Recomputed:
        """The chunk with ``layers`` recomputed, worked out once per stage and layers (per
        chunk where the cost model gives the chunk its own bytes)."""
        shared = (key if key in self.costs.chunks else key[0], layers)
        found = self._recomputed.get(shared)
        if found is None:
            count = len(self.layers(key))
            if layers[-1] >= count:
                raise ScheduleError(f"chunk (stage {key[0]}, micro {key[1]}) has {count} "
                                    f"layer(s) in the cost model; it cannot recompute layer "
                                    f"{layers[-1]}")
            effective, remade = self.costs.recomputed_layers(key, layers)
            chunk = ChunkBytes(sum(layer.total for layer in effective),
                               sum(layer.pinned for layer in effective),
                               sum(layer.held_after_input for layer in effective))
            after = [0] * len(effective)  # per layer, the bytes of the layers after it
            for k in reversed(range(len(effective) - 1)):
                after[k] = after[k + 1] + effective[k + 1].total
            rise = max(remade[k] - after[k] for k in layers)
            found = self._recomputed[shared] = Recomputed(effective, remade, chunk,
                                                           frozenset(layers), rise)
        return found

    def layers(self, key: ChunkKey) -> tuple[ChunkBytes, ...]:
        """``costs.layer_bytes``, worked out once per stage (per chunk where the cost model
        gives the chunk its own bytes)."""
        shared = key if key in self.costs.chunks else key[0]
        found = self._layers.get(shared)
        if found is None:
            found = self._layers[shared] = self.costs.layer_bytes(key)
        return found

    def __call__(self, key: ChunkKey) -> ChunkBytes:
        found = self.costs.chunks.get(key)
        if found is not None:
            return found
        default = self._stages.get(key[0])
        if default is None:
            default = self._stages[key[0]] = self.costs.chunk_bytes(key)
        return default


def peak_without_swap(order: Order, costs: CostModel,
                      recomputed: Mapping[ChunkKey, tuple[int, ...]] | None = None) -> int:
    """The most activation bytes a valid ``order`` holds at once if nothing is swapped,
    counted as :func:`simulate` counts ``peak_activation_bytes_no_swap``; with
    ``recomputed``, those chunks' layers recomputed (as RC steps would have them, counted as
    :func:`simulate` counts an order without swap steps)."""
    bytes_of = _ChunkBytesCache(costs)
    split = {s.key for s in order if s is not None and s.type is _W}
    held = peak = 0
    for step in order:
        if step is None:
            continue
        for leaf in step.sub_steps or (step,):
            kind = leaf.type
            if kind not in COMPUTE:
                continue
            key = leaf.key
            layers = None if recomputed is None else recomputed.get(key)
            if layers is None:
                chunk, remade = bytes_of(key), 0
            else:  # a B frees the layers after a recompute before it runs
                redo = bytes_of.recomputed(key, layers)
                chunk = redo.chunk
                remade = max(redo.remade) if kind is _I and key in split else redo.rise
            if kind is _F:
                held += chunk.total
                peak = max(peak, held)
                continue
            if kind is not _W:  # what a recompute makes lives within the layer's part
                peak = max(peak, held + remade)
            held -= _freed(kind, chunk, kind is _I and key in split)
    return peak


def _freed(kind: StepType, chunk: ChunkBytes, split_input: bool) -> int:
    """What a backward leaf frees of its chunk: an I followed by a W (``split_input``) all
    but what the W needs, the W that, a B or a lone I everything."""
    if split_input:
        return chunk.total - chunk.held_after_input
    return chunk.held_after_input if kind is _W else chunk.total
