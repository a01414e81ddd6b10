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
and frees them. SL allocates the last layer and starts its H2D copy, WL waits for it, and
the backward, layer by layer from the last, waits for the layer's load, allocates the layer
below and starts its load, then frees the layer it computed; a split backward's I keeps
every layer until it ends (it keeps the graph for W) and then frees all but what W needs.
A lag beyond the chunk's layers is refused: it counts layers the chunk does not have.

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
from dataclasses import dataclass, field
from typing import NamedTuple

from pipeswap.schedule._gc import gc_paused
from pipeswap.schedule.costs import ChunkBytes, CostModel, Link
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import COMPUTE, RECVS, ChunkKey, Order, Step, StepType
from pipeswap.schedule.validation import check_layer_lags, validate

_F, _B, _I, _W = StepType.FWD, StepType.BWD, StepType.BWD_INPUT, StepType.BWD_WEIGHT
_SEND_F, _SEND_B = StepType.FWD_SEND, StepType.BWD_SEND
_LO, _WO = StepType.SWAP_LAUNCH_OFFLOAD, StepType.SWAP_WAIT_OFFLOAD
_LL, _WL = StepType.SWAP_LAUNCH_LOAD, StepType.SWAP_WAIT_LOAD
_SO, _SL = StepType.SWAP_STREAM_OFFLOAD, StepType.SWAP_STREAM_LOAD
_SWAPS = frozenset({_LO, _WO, _LL, _WL, _SO, _SL})
_UNSHARD, _RESHARD = StepType.FSDP_UNSHARD, StepType.FSDP_RESHARD


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

    @property
    def streamed(self) -> bool:
        return self.layer_lag > 0


class Span(NamedTuple):
    """Something that occupied a stream: for traces and plots. (A NamedTuple: a big schedule
    makes one per step, and these build several times faster than a dataclass.)"""

    stream: str  # "compute", "d2h", "h2d", "copy"
    label: str
    start: float
    end: float


@dataclass(frozen=True)
class RankResult:
    """One rank's simulated step. Peaks are the most held at once, in bytes; ``_no_swap``
    peaks are those of the same order with its swap steps left out."""

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


@dataclass(frozen=True)
class SimulationResult:
    step_time: float  # the whole pipeline's: the last rank to finish
    ranks: tuple[RankResult, ...]


@dataclass
class _Streamed:
    """A streamed chunk's layers and its copies so far: D2H ends in layer order, H2D ends
    by layer."""

    lag: int
    layers: tuple[ChunkBytes, ...]
    offloaded: list[float] = field(default_factory=list)
    loaded: dict[int, float] = field(default_factory=dict)

    @property
    def tail(self) -> range:
        """The layers the forward leaves for WO to free (those within the lag of its end)."""
        return range(max(0, len(self.layers) - self.lag), len(self.layers))


@dataclass
class _Rank:
    rank: int
    leaves: list[Step]  # its order's leaves (overlaps and batches opened), receives left out
    link: Link
    timeline: bool  # keep ``memory`` and ``spans``
    index: int = 0  # the next leaf to run
    compute: float = 0.0  # when the compute stream is free
    d2h: float = 0.0
    h2d: float = 0.0
    busy: float = 0.0
    exposed: float = 0.0
    held: int = 0  # activation bytes
    peak: int = 0
    gathered: int = 0  # parameter bytes of the stages gathered now
    peak_gathered: int = 0
    peak_memory: int = 0  # of held + gathered
    plain: int = 0  # activation bytes it would hold if nothing were swapped
    peak_plain: int = 0
    peak_plain_memory: int = 0  # of plain + gathered
    memory: list[tuple[float, int]] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    copies: dict[ChunkKey, dict[str, float]] = field(default_factory=dict)
    split: set[ChunkKey] = field(default_factory=set)  # chunks whose backward ends with W
    forwarded: dict[ChunkKey, float] = field(default_factory=dict)  # forward end
    lifespans: dict[ChunkKey, float] = field(default_factory=dict)
    streams: dict[ChunkKey, _Streamed] = field(default_factory=dict)  # SO seen

    def change(self, delta: int) -> None:
        """The activation bytes held change by ``delta``."""
        self.held += delta
        if self.timeline:
            self.memory.append((self.compute, self.held))
        if self.held > self.peak:
            self.peak = self.held
        if self.held + self.gathered > self.peak_memory:
            self.peak_memory = self.held + self.gathered

    def change_plain(self, delta: int) -> None:
        """A compute changes the bytes it would hold if nothing were swapped by ``delta``."""
        self.plain += delta
        if self.plain > self.peak_plain:
            self.peak_plain = self.plain
        if self.plain + self.gathered > self.peak_plain_memory:
            self.peak_plain_memory = self.plain + self.gathered

    def gather(self, delta: int) -> None:
        """The gathered parameter bytes change by ``delta`` (an UNSHARD or a RESHARD)."""
        self.gathered += delta
        if self.gathered > self.peak_gathered:
            self.peak_gathered = self.gathered
        if self.held + self.gathered > self.peak_memory:
            self.peak_memory = self.held + self.gathered
        if self.plain + self.gathered > self.peak_plain_memory:
            self.peak_plain_memory = self.plain + self.gathered


class _Flat(NamedTuple):
    """A rank's order as the simulator walks it."""

    leaves: list[Step]  # the leaves it runs, in order, receives left out (they only post)
    split: set[ChunkKey]  # chunks whose backward ends with W
    streams: bool  # it has SO steps


def _flatten(order: Order) -> _Flat:
    leaves: list[Step] = []
    split: set[ChunkKey] = set()
    streams = False
    for step in order:
        if step is None:
            continue
        for leaf in step.sub_steps or (step,):
            kind = leaf.type
            if kind in RECVS:
                continue
            leaves.append(leaf)
            if kind is _W:
                split.add(leaf.key)
            elif kind is _SO:
                streams = True
    return _Flat(leaves, split, streams)


@gc_paused
def simulate(schedule: Schedule, costs: CostModel, *, timeline: bool = True) -> SimulationResult:
    """Run every rank's order with ``costs``; see the module docstring for the model.

    ``timeline=False`` leaves each rank's ``memory`` and ``spans`` empty (what traces and
    plots draw), which makes a large schedule's simulation faster; every figure is the same.
    """
    validate(schedule, transport="tagged")  # the model below: sends never wait
    stage_ranks = schedule.stage_ranks
    last_stage = schedule.num_stages - 1
    flat = [_flatten(order) for order in schedule.orders]
    ranks = [_Rank(r, f.leaves, costs.rank_link(r), timeline, split=f.split)
             for r, f in enumerate(flat)]
    # ("F", s, m): stage s's output for micro m is where stage s + 1 runs; ("B", s, m): the
    # gradient of stage s's input is where stage s - 1 runs. Value: the time it got there.
    ready: dict[tuple[str, int, int], float] = {}
    waiting: dict[tuple[str, int, int], list[int]] = defaultdict(list)
    runnable = list(range(len(ranks)))
    transfer = costs.p2p_time()
    bytes_of = _ChunkBytesCache(costs)
    if any(f.streams for f in flat):
        check_layer_lags(schedule, lambda key: len(bytes_of.layers(key)),
                         "the cost model gives a chunk of stage {stage} {layers} layer(s) "
                         "(--layers-per-stage; CostModel.layers, StageCosts.layers or the "
                         "chunk's measured ChunkBytes.layers)")
    times: dict[tuple[StepType, int, int], float] = {}

    def duration_of(kind: StepType, stage: int, rank: int) -> float:
        found = times.get((kind, stage, rank))
        if found is None:
            found = times[(kind, stage, rank)] = costs.compute_time(kind, stage, rank)
        return found

    def publish(key: tuple[str, int, int], at: float) -> None:
        ready[key] = at
        for rank in waiting.pop(key, ()):
            heapq.heappush(runnable, rank)

    def compute(state: _Rank, leaf: Step, kind: StepType, key: ChunkKey,
                wanted: tuple[str, int, int] | None) -> None:
        stage, micro = key
        start = state.compute if wanted is None else max(state.compute, ready[wanted])
        duration = duration_of(kind, stage, state.rank)
        state.busy += duration
        streamed = state.streams.get(key) if kind is not _W else None
        if streamed is not None:
            run = _stream_forward if kind is _F else _stream_backward
            end = run(state, leaf, streamed, start, duration)
        else:
            state.compute = end = start + duration
            if state.timeline:
                state.spans.append(Span("compute", str(leaf), start, end))
        chunk = bytes_of(key)
        split_input = kind is _I and key in state.split
        if kind is _F:
            state.change_plain(chunk.total)
            if streamed is None:
                state.change(chunk.total)
            state.forwarded[key] = end
            if stage < last_stage and stage_ranks[stage + 1] == state.rank:
                publish(("F", stage, micro), end)  # local hand-off
            return
        if kind is not _W:
            state.lifespans[key] = start - state.forwarded[key]
            if stage > 0 and stage_ranks[stage - 1] == state.rank:
                publish(("B", stage, micro), end)
        freed = _freed(kind, chunk, split_input)
        state.change_plain(-freed)
        if streamed is None and (freed or not split_input):  # streamed: freed layer by layer
            state.change(-freed)

    def advance(state: _Rank) -> None:
        """Run the rank's leaves until one waits for another rank, or none is left."""
        leaves, index = state.leaves, state.index
        while index < len(leaves):
            leaf = leaves[index]
            kind = leaf.type
            if kind in COMPUTE:
                stage, micro = leaf.stage, leaf.micro
                assert stage is not None and micro is not None  # a leaf of a chunk
                wanted: tuple[str, int, int] | None
                if kind is _F:
                    wanted = None if stage == 0 else ("F", stage - 1, micro)
                elif kind is _W or stage == last_stage:
                    wanted = None
                else:
                    wanted = ("B", stage + 1, micro)
                if wanted is not None and wanted not in ready:
                    waiting[wanted].append(state.rank)
                    break
                compute(state, leaf, kind, (stage, micro), wanted)
            elif kind is _SEND_F or kind is _SEND_B:
                stage, micro = leaf.stage, leaf.micro
                assert stage is not None and micro is not None  # a leaf of a chunk
                publish(("F" if kind is _SEND_F else "B", stage, micro), state.compute + transfer)
            elif kind in _SWAPS:
                stage, micro = leaf.stage, leaf.micro
                assert stage is not None and micro is not None  # a leaf of a chunk
                key = (stage, micro)
                if kind is _SO:
                    state.streams[key] = _Streamed(leaf.lag or 1, bytes_of.layers(key))
                streamed = state.streams.get(key)
                if streamed is None:
                    _swap(state, leaf, key, bytes_of(key).movable)
                else:
                    _stream_swap(state, leaf, streamed)
            elif kind is _UNSHARD or kind is _RESHARD:
                state.gather(_gathered_change(costs, leaf))
            # FSDP steps take no time
            index += 1
        state.index = index

    while runnable:
        advance(ranks[heapq.heappop(runnable)])
    unfinished = [s.rank for s in ranks if s.index < len(s.leaves)]
    if unfinished:  # validate() proved the orders run together; this would be a bug here
        raise AssertionError(f"simulation stalled on ranks {unfinished}")
    step_time = max((s.compute for s in ranks), default=0.0)
    return SimulationResult(step_time, tuple(_result(s, step_time) for s in ranks))


def _swap(state: _Rank, leaf: Step, key: ChunkKey, movable: int) -> None:
    """LO, WO, LL and WL of a chunk swapped whole."""
    kind = leaf.type
    if kind is _LO:
        start, end = _copy(state, True, movable, key, "LO")
        state.copies[key] = {"offload_start": start, "offload_end": end}
        return
    record = state.copies[key]  # LO came first: the validator checks the order
    if kind is _WO:
        _wait(state, record["offload_end"], record, "wait_offload")
        state.change(-movable)
    elif kind is _LL:
        state.change(movable)
        record["off_until"] = state.compute
        start, end = _copy(state, False, movable, key, "LL")
        record["load_start"], record["load_end"] = start, end
    else:
        _wait(state, record["load_end"], record, "wait_load")


def _wait(state: _Rank, until: float, record: dict[str, float], name: str) -> None:
    reached = state.compute
    if until > reached:
        state.exposed += until - reached
        if state.timeline:
            state.spans.append(Span("compute", f"wait {name.removeprefix('wait_')}", reached,
                                    until))
        state.compute = until
        record["stalled"] = 1.0
    record[name] = state.compute


def _copy(state: _Rank, offload: bool, size: int, key: ChunkKey, code: str,
          layer: int | None = None) -> tuple[float, float]:
    """Start a copy of ``size`` bytes on its stream once compute has reached it and the
    stream is free (D2H and H2D share one stream on a link that is not duplex); ``code``
    and ``layer`` name it in the timeline."""
    link = state.link
    if offload:
        start = max(state.compute, state.d2h)
        state.d2h = end = start + size / link.d2h_bandwidth
    else:
        start = max(state.compute, state.h2d)
        state.h2d = end = start + size / link.h2d_bandwidth
    if not link.duplex:
        state.d2h = state.h2d = end
    if state.timeline:
        stream = "copy" if not link.duplex else "d2h" if offload else "h2d"
        label = f"{key[0]}{code}{key[1]}" + ("" if layer is None else f".l{layer}")
        state.spans.append(Span(stream, label, start, end))
    return start, end


def _stream_swap(state: _Rank, leaf: Step, streamed: _Streamed) -> None:
    """SO, WO, SL and WL of a streamed chunk (its forward and backward do the rest)."""
    key, kind = leaf.key, leaf.type
    record = state.copies.setdefault(key, {})
    last = len(streamed.layers) - 1
    if kind is _SO:
        record["lag"] = float(streamed.lag)
    elif kind is _WO:
        tail = streamed.tail  # never empty: the lag is at least 1
        _wait(state, max(streamed.offloaded[k] for k in tail), record, "wait_offload")
        state.change(-sum(streamed.layers[k].movable for k in tail))
    elif kind is _SL:
        state.change(streamed.layers[last].movable)
        record["off_until"] = state.compute
        start, end = _copy(state, False, streamed.layers[last].movable, key, "LL", last)
        streamed.loaded[last] = end
        record.update(load_start=start, load_end=end)
    else:
        _wait(state, streamed.loaded[last], record, "wait_load")


def _stall(state: _Rank, until: float, record: dict[str, float], leaf: Step,
           piece: float) -> float:
    """Compute waits inside a streamed compute until ``until``; returns where the compute's
    next piece starts (the compute's span is cut around the wait)."""
    reached = state.compute
    if until <= reached:
        return piece
    if state.timeline:
        state.spans.append(Span("compute", str(leaf), piece, reached))
    _wait(state, until, record, "wait_layer")
    return until


def _stream_forward(state: _Rank, leaf: Step, streamed: _Streamed, start: float,
                    duration: float) -> float:
    """A streamed chunk's forward, layer by layer (see the module docstring); returns its end."""
    key, layers, lag = leaf.key, streamed.layers, streamed.lag
    record = state.copies.setdefault(key, {})
    part = duration / len(layers)
    state.compute = piece = start
    for k, layer in enumerate(layers):
        state.compute += part
        state.change(layer.total)
        copy_start, end = _copy(state, True, layer.movable, key, "LO", k)
        streamed.offloaded.append(end)
        if k == 0:
            record["offload_start"] = copy_start
        if k >= lag:
            piece = _stall(state, streamed.offloaded[k - lag], record, leaf, piece)
            state.change(-layers[k - lag].movable)
    record["offload_end"] = streamed.offloaded[-1]
    _last_piece(state, leaf, start, piece)
    return state.compute


def _stream_backward(state: _Rank, leaf: Step, streamed: _Streamed, start: float,
                     duration: float) -> float:
    """A streamed chunk's B or I, layer by layer from the last (see the module docstring);
    returns its end."""
    key, layers = leaf.key, streamed.layers
    record = state.copies.setdefault(key, {})
    keeps = leaf.type is _I and key in state.split  # I leaves W what it needs
    part = duration / len(layers)
    state.compute = piece = start
    for k in reversed(range(len(layers))):
        if k < len(layers) - 1:
            piece = _stall(state, streamed.loaded[k], record, leaf, piece)
        if k >= 1:
            state.change(layers[k - 1].movable)
            _, end = _copy(state, False, layers[k - 1].movable, key, "LL", k - 1)
            streamed.loaded[k - 1] = end
        state.compute += part
        if not keeps:  # autograd frees each layer's activations as it goes
            state.change(-layers[k].total)
    if keeps:  # I keeps the whole graph for W and then frees what W does not need
        state.change(-sum(layer.total - layer.held_after_input for layer in layers))
    record["load_end"] = streamed.loaded[0]
    _last_piece(state, leaf, start, piece)
    return state.compute


def _last_piece(state: _Rank, leaf: Step, start: float, piece: float) -> None:
    """The span of a streamed compute's last piece (none of no length after a wait)."""
    if state.timeline and (state.compute > piece or piece == start):
        state.spans.append(Span("compute", str(leaf), piece, state.compute))


def _gathered_change(costs: CostModel, leaf: Step) -> int:
    """What an UNSHARD adds to its rank's gathered parameter bytes, or a RESHARD takes away."""
    assert leaf.stage is not None  # Step requires a stage on FSDP steps
    size = costs.gathered_bytes(leaf.stage)
    return size if leaf.type is _UNSHARD else -size


def _result(state: _Rank, step_time: float) -> RankResult:
    swapped = []
    for (stage, micro), rec in state.copies.items():
        if "wait_load" not in rec:
            continue
        swapped.append(SwappedChunk(
            stage, micro, (rec["offload_start"], rec["offload_end"]), rec["wait_offload"],
            (rec["load_start"], rec["load_end"]), rec["wait_load"],
            lifespan=state.lifespans[(stage, micro)],
            off_device=rec["off_until"] - rec["wait_offload"],
            hidden=not rec.get("stalled"), layer_lag=int(rec.get("lag", 0))))
    return RankResult(
        rank=state.rank, step_time=state.compute, busy=state.busy,
        bubble_fraction=1 - state.busy / step_time if step_time > 0 else 0.0,
        exposed_copy=state.exposed, peak_activation_bytes=state.peak,
        peak_activation_bytes_no_swap=state.peak_plain,
        peak_parameter_bytes=state.peak_gathered, peak_memory_bytes=state.peak_memory,
        peak_memory_bytes_no_swap=state.peak_plain_memory,
        memory=tuple(state.memory), swapped=tuple(swapped), spans=tuple(state.spans))


class _ChunkBytesCache:
    """``costs.chunk_bytes`` with each stage's default worked out once."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs
        self._stages: dict[int, ChunkBytes] = {}
        self._layers: dict[ChunkKey, tuple[ChunkBytes, ...]] = {}

    def layers(self, key: ChunkKey) -> tuple[ChunkBytes, ...]:
        """``costs.layer_bytes``, worked out once per chunk."""
        found = self._layers.get(key)
        if found is None:
            found = self._layers[key] = self.costs.layer_bytes(key)
        return found

    def __call__(self, key: ChunkKey) -> ChunkBytes:
        found = self.costs.chunks.get(key)
        if found is not None:
            return found
        default = self._stages.get(key[0])
        if default is None:
            default = self._stages[key[0]] = self.costs.chunk_bytes(key)
        return default


def peak_without_swap(order: Order, costs: CostModel) -> int:
    """The most activation bytes a valid ``order`` holds at once if nothing is swapped,
    counted as :func:`simulate` counts ``peak_activation_bytes_no_swap``."""
    bytes_of = _ChunkBytesCache(costs)
    split = {s.key for s in order if s is not None and s.type is _W}
    held = peak = 0
    for step in order:
        if step is None:
            continue
        for leaf in step.sub_steps or (step,):
            kind = leaf.type
            if kind is _F:
                held += bytes_of(leaf.key).total
                peak = max(peak, held)
            elif kind in COMPUTE:
                held -= _freed(kind, bytes_of(leaf.key), kind is _I and leaf.key in split)
    return peak


def _freed(kind: StepType, chunk: ChunkBytes, split_input: bool) -> int:
    """What a backward leaf frees of its chunk: an I followed by a W (``split_input``) all
    but what the W needs, the W that, a B or a lone I everything."""
    if split_input:
        return chunk.total - chunk.held_after_input
    return chunk.held_after_input if kind is _W else chunk.total
