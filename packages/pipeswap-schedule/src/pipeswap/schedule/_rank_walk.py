"""One rank's state while :mod:`pipeswap.schedule.simulate` runs it, its copy streams, and
the walks of computes that go layer by layer: a streamed chunk's, and a backward that
recomputes layers. The model they follow is in :mod:`pipeswap.schedule.simulate`'s
docstring."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from pipeswap.schedule.costs import ChunkBytes, Link
from pipeswap.schedule.steps import ChunkKey, Step, StepType

_I = StepType.BWD_INPUT
_LO, _WO = StepType.SWAP_LAUNCH_OFFLOAD, StepType.SWAP_WAIT_OFFLOAD
_LL = StepType.SWAP_LAUNCH_LOAD
_SO, _SL = StepType.SWAP_STREAM_OFFLOAD, StepType.SWAP_STREAM_LOAD


#: Where a span of a rank's timeline runs: its compute stream, or a copy stream (one each
#: way, or one shared by both ways).
SpanStream = Literal["compute", "d2h", "h2d", "copy"]


class Span(NamedTuple):
    """Something that occupied a stream: for traces and plots. (A NamedTuple: a big schedule
    makes one per step, and these build several times faster than a dataclass.)"""

    stream: SpanStream
    label: str
    start: float
    end: float


class Recomputed(NamedTuple):
    """A chunk with recomputed layers (its RC step): its layers as the forward leaves them,
    what each layer's recompute makes again (0: not recomputed), and the chunk's totals."""

    layers: tuple[ChunkBytes, ...]
    remade: tuple[int, ...]
    chunk: ChunkBytes  # the layers summed
    chosen: frozenset[int]  # which layers are recomputed
    # the most a B holds above the whole chunk at once: a recompute's bytes less those of
    # the layers after it, which the B has freed by then (an I of a split backward frees
    # none: max(remade))
    rise: int


@dataclass
class Streamed:
    """A streamed chunk's layers and its copies so far: D2H ends in layer order, H2D ends
    by layer; ``depth``: how many layers ahead of its backward the loads run (SL's lag)."""

    lag: int
    layers: tuple[ChunkBytes, ...]
    depth: int = 1
    offloaded: list[float] = field(default_factory=list)
    loaded: dict[int, float] = field(default_factory=dict)

    @property
    def tail(self) -> range:
        """The layers the forward leaves for WO to free (those within the lag of its end)."""
        return range(max(0, len(self.layers) - self.lag), len(self.layers))


@dataclass
class RankState:
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
    streams: dict[ChunkKey, Streamed] = field(default_factory=dict)  # SO seen
    recomputed: dict[ChunkKey, tuple[int, ...]] = field(default_factory=dict)  # RC layers
    recomputed_layers: int = 0
    recompute_s: float = 0.0

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


def swap_whole(state: RankState, leaf: Step, key: ChunkKey, movable: int) -> None:
    """LO, WO, LL and WL of a chunk swapped whole."""
    kind = leaf.type
    if kind is _LO:
        start, end = copy(state, True, movable, key, "LO")
        state.copies[key] = {"offload_start": start, "offload_end": end}
        return
    record = state.copies[key]  # LO came first: the validator checks the order
    if kind is _WO:
        wait(state, record["offload_end"], record, "wait_offload")
        state.change(-movable)
    elif kind is _LL:
        state.change(movable)
        record["off_until"] = state.compute
        start, end = copy(state, False, movable, key, "LL")
        record["load_start"], record["load_end"] = start, end
    else:
        wait(state, record["load_end"], record, "wait_load")


#: How far past compute a copy may end, relative to the time, and still count as hidden: the
#: plans and the simulator sum the same times in other orders, which leaves copies ending a
#: rounding error (1e-16 s) after compute reaches them.
ROUNDING = 1e-12


def later(until: float, reached: float) -> bool:
    """Whether ``until`` is past ``reached`` by more than a rounding error."""
    return until - reached > ROUNDING * max(1.0, abs(until))


def wait(state: RankState, until: float, record: dict[str, float], name: str) -> None:
    reached = state.compute
    if later(until, reached):
        state.exposed += until - reached
        if state.timeline:
            state.spans.append(Span("compute", f"wait {name.removeprefix('wait_')}", reached,
                                    until))
        state.compute = until
        record["stalled"] = 1.0
    record[name] = state.compute


def copy(state: RankState, offload: bool, size: int, key: ChunkKey, code: str,
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
        stream: SpanStream = "copy" if not link.duplex else "d2h" if offload else "h2d"
        label = f"{key[0]}{code}{key[1]}" + ("" if layer is None else f".l{layer}")
        state.spans.append(Span(stream, label, start, end))
    return start, end


def stream_swap(state: RankState, leaf: Step, streamed: Streamed) -> None:
    """SO, WO, SL and WL of a streamed chunk (its forward and backward do the rest)."""
    key, kind = leaf.key, leaf.type
    record = state.copies.setdefault(key, {})
    last = len(streamed.layers) - 1
    if kind is _SO:
        record["lag"] = float(streamed.lag)
    elif kind is _WO:
        tail = streamed.tail  # never empty: the lag is at least 1
        wait(state, max(streamed.offloaded[k] for k in tail), record, "wait_offload")
        state.change(-sum(streamed.layers[k].movable for k in tail))
    elif kind is _SL:  # the last ``depth`` layers, the last first
        streamed.depth = depth = leaf.lag or 1
        record["off_until"] = state.compute
        record["depth"] = float(depth)
        for k in range(last, last - depth, -1):
            state.change(streamed.layers[k].movable)
            start, end = copy(state, False, streamed.layers[k].movable, key, "LL", k)
            streamed.loaded[k] = end
            if k == last:
                record["load_start"] = start
        record["load_end"] = streamed.loaded[last]
    else:
        wait(state, streamed.loaded[last], record, "wait_load")


def _stall(state: RankState, until: float, record: dict[str, float], leaf: Step,
           piece: float) -> float:
    """Compute waits inside a streamed compute until ``until``; returns where the compute's
    next piece starts (the compute's span is cut around the wait)."""
    reached = state.compute
    if not later(until, reached):
        return piece
    if state.timeline:
        state.spans.append(Span("compute", str(leaf), piece, reached))
    wait(state, until, record, "wait_layer")
    return until


def stream_forward(state: RankState, leaf: Step, streamed: Streamed, start: float,
                    duration: float) -> float:
    """A streamed chunk's forward, layer by layer (see the module docstring); returns its end."""
    key, layers, lag = leaf.key, streamed.layers, streamed.lag
    record = state.copies.setdefault(key, {})
    part = duration / len(layers)
    state.compute = piece = start
    for k, layer in enumerate(layers):
        state.compute += part
        state.change(layer.total)
        copy_start, end = copy(state, True, layer.movable, key, "LO", k)
        streamed.offloaded.append(end)
        if k == 0:
            record["offload_start"] = copy_start
        if k >= lag:
            piece = _stall(state, streamed.offloaded[k - lag], record, leaf, piece)
            state.change(-layers[k - lag].movable)
    record["offload_end"] = streamed.offloaded[-1]
    _last_piece(state, leaf, start, piece)
    return state.compute


def stream_backward(state: RankState, leaf: Step, streamed: Streamed, start: float,
                     duration: float, redo: Recomputed | None, again: float) -> float:
    """A streamed chunk's B or I, layer by layer from the last (see the module docstring),
    a recomputed layer run again first (``again`` seconds, what it makes alive until its own
    part ends); returns its end."""
    key, layers, depth = leaf.key, streamed.layers, streamed.depth
    record = state.copies.setdefault(key, {})
    keeps = leaf.type is _I and key in state.split  # I leaves W what it needs
    part = duration / len(layers)
    state.compute = piece = start
    for k in reversed(range(len(layers))):
        if k < len(layers) - 1:
            piece = _stall(state, streamed.loaded[k], record, leaf, piece)
        if k >= depth:  # SL loaded the last ``depth`` layers
            state.change(layers[k - depth].movable)
            _, end = copy(state, False, layers[k - depth].movable, key, "LL", k - depth)
            streamed.loaded[k - depth] = end
        _layer_part(state, redo, k, part, again)
        if not keeps:  # autograd frees each layer's activations as it goes
            state.change(-layers[k].total)
    if keeps:  # I keeps the whole graph for W and then frees what W does not need
        state.change(-sum(layer.total - layer.held_after_input for layer in layers))
    record["load_end"] = streamed.loaded[0]
    _last_piece(state, leaf, start, piece)
    return state.compute


def _layer_part(state: RankState, redo: Recomputed | None, k: int, part: float,
                again: float) -> None:
    """Layer ``k``'s part of a backward; a recomputed layer runs its forward again first
    (``again`` seconds), and what that makes lives until the part ends."""
    if redo is not None and k in redo.chosen:
        state.compute += again
        state.change(redo.remade[k])
        state.compute += part
        state.change(-redo.remade[k])
    else:
        state.compute += part


def recompute_backward(state: RankState, leaf: Step, redo: Recomputed, start: float,
                       duration: float, again: float) -> float:
    """The B or I of a chunk held whole, with recomputed layers: layer by layer from the
    last, each recomputed one run again first, what that makes alive until its own part
    ends. A B frees each layer as its part ends, as autograd does (the caller frees nothing
    more); a split backward's I keeps them all for W, and the caller frees what W does not
    need. Returns its end."""
    keeps = leaf.type is _I and leaf.key in state.split
    part = duration / len(redo.layers)
    state.compute = start
    for k in reversed(range(len(redo.layers))):
        _layer_part(state, redo, k, part, again)
        if not keeps:
            state.change(-redo.layers[k].total)
    end = start + duration + again * len(redo.chosen)
    if state.timeline:
        state.spans.append(Span("compute", str(leaf), start, end))
    state.compute = end
    return end


def _last_piece(state: RankState, leaf: Step, start: float, piece: float) -> None:
    """The span of a streamed compute's last piece (none of no length after a wait)."""
    if state.timeline and (state.compute > piece or piece == start):
        state.spans.append(Span("compute", str(leaf), piece, state.compute))
