"""What steps cost: compute times, activation and parameter bytes, P2P and host-link
bandwidths.

A :class:`CostModel` feeds the simulator and the cost-aware swap policies. Times are seconds,
sizes bytes, bandwidths bytes per second. Everything has a default, and per-stage, per-chunk
and per-rank overrides say where a pipeline is not uniform. :func:`preset` gives the host-link
and P2P figures of known machines; :func:`transformer_costs` derives compute times,
activation bytes and gathered parameter bytes from a transformer's dimensions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.steps import ChunkKey, StepType

@dataclass(frozen=True)
class StageCosts:
    """Compute seconds of one chunk of a stage; I and W default to half of B each."""

    forward: float
    backward: float
    backward_input: float | None = None
    backward_weight: float | None = None
    activation_bytes: int | None = None  # what one chunk's forward saves (default: model's)
    param_bytes: int | None = None  # the stage's parameters, gathered (default: model's)
    layers: int | None = None  # layers of one chunk, for streaming swap (default: model's)
    # of a chunk's bytes, what a split backward's W needs, held from I to W (default: all)
    after_input_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.param_bytes is not None:
            _check_param_bytes("stage costs param_bytes", self.param_bytes)
        if self.layers is not None:
            _check_layers("stage costs layers", self.layers)

    def time(self, kind: StepType) -> float:
        if kind is StepType.FWD:
            return self.forward
        if kind is StepType.BWD:
            return self.backward
        if kind is StepType.BWD_INPUT:
            return self.backward / 2 if self.backward_input is None else self.backward_input
        return self.backward / 2 if self.backward_weight is None else self.backward_weight


@dataclass(frozen=True)
class ChunkBytes:
    """Activation bytes of one chunk: all of it (held from the end of its forward), the part
    that never leaves the device (tensors shared with parameters, stage inputs and outputs),
    and, for a split backward, the part still held between its I and its W (what W needs:
    the inputs of the weight nodes; I frees the rest). ``after_input`` defaults to all of it,
    as if I freed nothing.

    ``layers`` optionally gives the same figures per layer, as measured, for a streaming
    swap (which moves a chunk layer by layer); their totals, pinned and after-input bytes
    must add up to the chunk's. Without them :meth:`CostModel.layer_bytes` splits the chunk
    evenly. ``kept`` is what the chunk holds when every layer is recomputed (each layer's
    input; by default one stage boundary's bytes per layer, see
    :meth:`CostModel.recomputed_layers`)."""

    total: int
    pinned: int = 0
    after_input: int | None = None
    layers: tuple[ChunkBytes, ...] = ()
    kept: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.pinned <= self.total:
            raise ScheduleError(f"chunk bytes: pinned must be from 0 to total ({self.total}), "
                                f"got {self.pinned}")
        if self.after_input is not None and not 0 <= self.after_input <= self.total:
            raise ScheduleError(f"chunk bytes: after_input must be from 0 to total "
                                f"({self.total}), got {self.after_input}")
        if self.kept is not None and not 0 <= self.kept <= self.total:
            raise ScheduleError(f"chunk bytes: kept must be from 0 to total ({self.total}), "
                                f"got {self.kept}")
        if self.layers:
            self._check_layers()

    def _check_layers(self) -> None:
        """The layers must be plain per-layer figures that add up to the chunk's."""
        if not isinstance(self.layers, tuple) or any(
                not isinstance(layer, ChunkBytes) or layer.layers for layer in self.layers):
            raise ScheduleError("chunk bytes: layers is a tuple of ChunkBytes, one per layer, "
                                "each without layers of its own")
        for name, whole, parts in (
                ("total", self.total, sum(layer.total for layer in self.layers)),
                ("pinned", self.pinned, sum(layer.pinned for layer in self.layers)),
                ("after_input", self.held_after_input,
                 sum(layer.held_after_input for layer in self.layers)),
                *((("kept", self.kept, sum(layer.kept or 0 for layer in self.layers)),)
                  if self.kept is not None else ())):
            if parts != whole:
                raise ScheduleError(
                    f"chunk bytes: the layers' {name} bytes add up to {parts}, but the "
                    f"chunk's {name} is {whole}; give layers that sum to the chunk (or "
                    "leave layers out to split the chunk evenly)")

    @property
    def movable(self) -> int:
        return self.total - self.pinned

    @property
    def held_after_input(self) -> int:
        """Bytes held between the chunk's I and W."""
        return self.total if self.after_input is None else self.after_input


@dataclass(frozen=True)
class Link:
    """A rank's host link: copy bandwidths, and whether D2H and H2D run at the same time."""

    d2h_bandwidth: float = math.inf
    h2d_bandwidth: float = math.inf
    duplex: bool = True


@dataclass(frozen=True)
class CostModel:
    """Costs of every step of a schedule. See the module docstring for units.

    ``param_bytes`` is what one stage's parameters take on the device while FSDP has them
    gathered (from its UNSHARD to its RESHARD); it counts only in schedules with FSDP steps.
    """

    forward: float = 1.0
    backward: float = 2.0
    activation_bytes: int = 1 << 30
    pinned_bytes: int = 0
    param_bytes: int = 0
    boundary_bytes: int = 0  # one P2P message (a stage's output, or its gradient)
    p2p_latency: float = 0.0
    p2p_bandwidth: float = math.inf
    link: Link = Link()
    stages: Mapping[int, StageCosts] = field(default_factory=dict)
    chunks: Mapping[ChunkKey, ChunkBytes] = field(default_factory=dict)
    ranks: Mapping[int, Link] = field(default_factory=dict)
    compute_scale: Mapping[int, float] = field(default_factory=dict)  # per-rank slowdown
    layers: int = 1  # layers of one chunk (every stage's, unless its StageCosts say)

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "p2p_latency"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ScheduleError(f"cost {name} must be a finite number of seconds >= 0, "
                                    f"got {getattr(self, name)}")
        for name, value in (("p2p_bandwidth", self.p2p_bandwidth),
                            ("d2h_bandwidth", self.link.d2h_bandwidth),
                            ("h2d_bandwidth", self.link.h2d_bandwidth),
                            *((f"rank {r} d2h_bandwidth", l.d2h_bandwidth)
                              for r, l in self.ranks.items()),
                            *((f"rank {r} h2d_bandwidth", l.h2d_bandwidth)
                              for r, l in self.ranks.items())):
            if not value > 0:
                raise ScheduleError(f"{name} must be > 0 bytes/s (a copy over a link of 0 "
                                    f"never ends), got {value}")
        if self.pinned_bytes > self.activation_bytes:
            raise ScheduleError("pinned_bytes cannot exceed activation_bytes")
        _check_param_bytes("param_bytes", self.param_bytes)
        _check_layers("layers", self.layers)

    def stage(self, stage: int) -> StageCosts:
        return self.stages.get(stage) or StageCosts(self.forward, self.backward)

    def compute_time(self, kind: StepType, stage: int, rank: int) -> float:
        return self.stage(stage).time(kind) * self.compute_scale.get(rank, 1.0)

    def chunk_bytes(self, key: ChunkKey) -> ChunkBytes:
        found = self.chunks.get(key)
        if found is not None:
            return found
        stage = self.stage(key[0])
        total = self.activation_bytes if stage.activation_bytes is None else (
            stage.activation_bytes)
        return ChunkBytes(total, min(self.pinned_bytes, total),
                          None if stage.after_input_bytes is None else min(
                              stage.after_input_bytes, total))

    def stage_layers(self, stage: int) -> int:
        """How many layers one chunk of ``stage`` has: what a streaming swap moves one by
        one, each taking an equal share of the chunk's compute."""
        per_stage = self.stage(stage).layers
        return self.layers if per_stage is None else per_stage

    def layer_bytes(self, key: ChunkKey) -> tuple[ChunkBytes, ...]:
        """The chunk's bytes per layer: its measured layers, else its bytes split evenly over
        :meth:`stage_layers` layers (the remainders on the last layers, so that the layers
        add up to the chunk exactly)."""
        chunk = self.chunk_bytes(key)
        return chunk.layers or split_chunk_bytes(chunk, self.stage_layers(key[0]))

    def recomputed_layers(self, key: ChunkKey, recomputed: tuple[int, ...]
                          ) -> tuple[tuple[ChunkBytes, ...], tuple[int, ...]]:
        """The chunk's layers as its forward leaves them when ``recomputed`` layers keep only
        their input, and per layer the bytes its recompute makes again (0 for a layer not
        recomputed), alive from the recompute to the end of the layer's backward.

        A recomputed layer keeps its measured ``kept`` bytes, else one stage boundary's
        (:attr:`boundary_bytes`, its input), never more than it held; it pins no more than
        it keeps, and nothing of it is left after a split backward's I (the layer's weight
        gradients are computed there, from what the recompute made)."""
        layers = self.layer_bytes(key)
        chosen = set(recomputed)
        effective: list[ChunkBytes] = []
        remade: list[int] = []
        for k, layer in enumerate(layers):
            if k not in chosen:
                effective.append(layer)
                remade.append(0)
                continue
            kept = min(layer.total, self.boundary_bytes if layer.kept is None else layer.kept)
            effective.append(ChunkBytes(kept, min(layer.pinned, kept), 0))
            remade.append(layer.total - kept)
        return tuple(effective), tuple(remade)

    def with_recomputed(self, recomputed: Mapping[ChunkKey, tuple[int, ...]]) -> CostModel:
        """This model as the swap policies see chunks with recomputed layers: each such chunk
        holds what :meth:`recomputed_layers` leaves it, layer by layer (what a swap of it
        moves); what a recompute makes again in the backward is not in it."""
        if not recomputed:
            return self
        chunks = dict(self.chunks)
        shared: dict[tuple[int, tuple[int, ...]], ChunkBytes] = {}  # one per stage and layers
        for key, layers in recomputed.items():
            found = shared.get((key[0], layers)) if key not in self.chunks else None
            if found is None:
                effective, _ = self.recomputed_layers(key, layers)
                found = ChunkBytes(sum(layer.total for layer in effective),
                                   sum(layer.pinned for layer in effective),
                                   sum(layer.held_after_input for layer in effective),
                                   layers=effective)
                if key not in self.chunks:
                    shared[key[0], layers] = found
            chunks[key] = found
        return replace(self, chunks=chunks)

    def gathered_bytes(self, stage: int) -> int:
        """What ``stage``'s parameters take on the device from its UNSHARD to its RESHARD."""
        per_stage = self.stage(stage).param_bytes
        return self.param_bytes if per_stage is None else per_stage

    def rank_link(self, rank: int) -> Link:
        return self.ranks.get(rank, self.link)

    def p2p_time(self) -> float:
        return self.p2p_latency + self.boundary_bytes / self.p2p_bandwidth


def split_chunk_bytes(chunk: ChunkBytes, layers: int) -> tuple[ChunkBytes, ...]:
    """``chunk`` split evenly into ``layers`` layers; the remainders go to the last layers."""

    def share(amount: int, k: int) -> int:
        return amount // layers + (k >= layers - amount % layers)

    return tuple(ChunkBytes(share(chunk.total, k), share(chunk.pinned, k),
                            None if chunk.after_input is None else share(chunk.after_input, k),
                            kept=None if chunk.kept is None else share(chunk.kept, k))
                 for k in range(layers))


def _check_layers(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScheduleError(f"{name} must be a whole number >= 1 (the layers of one chunk, "
                            f"which a streaming swap moves one by one), got {value!r}")


def _check_param_bytes(name: str, value: int) -> None:
    # bool is an int, but True bytes is a mistake, not a size.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ScheduleError(f"{name} must be a whole number of bytes >= 0 (what one "
                            f"stage's parameters take when gathered), got {value!r}")


@dataclass(frozen=True)
class Preset:
    """A machine's host link and pipeline P2P figures, and where they come from."""

    name: str
    link: Link
    p2p_bandwidth: float
    p2p_latency: float
    flops: float  # achieved dense bf16 FLOP/s, for transformer_costs
    source: str


PRESETS: dict[str, Preset] = {
    preset.name: preset for preset in (
        Preset("h100-pcie5", Link(55e9, 55e9, duplex=True), p2p_bandwidth=360e9,
               p2p_latency=10e-6, flops=400e12,
               source="host link: PCIe Gen5 x16, 64 GB/s per direction (128 GB/s duplex), "
                      "about 55 GB/s measured pinned H2D with nvbandwidth; P2P: NVLink 4, "
                      "450 GB/s per direction, 80% achieved assumed; 400 TFLOP/s achieved "
                      "bf16 (about 40% of dense peak)"),
        Preset("h200-pcie5", Link(55e9, 55e9, duplex=True), p2p_bandwidth=360e9,
               p2p_latency=10e-6, flops=400e12,
               source="host link: PCIe Gen5 x16 as the H100 (the H200 has the same Hopper "
                      "compute and host link, more and faster HBM: 141 GB HBM3e, 4.8 TB/s)"),
        Preset("gh200-nvlink-c2c", Link(297e9, 375e9, duplex=True), p2p_bandwidth=360e9,
               p2p_latency=10e-6, flops=400e12,
               source="host link: NVLink-C2C, 450 GB/s per direction specified, 297 GB/s D2H "
                      "and 375 GB/s H2D measured; P2P and compute as the H100 preset"),
    )
}


def preset(name: str) -> Preset:
    found = PRESETS.get(name)
    if found is None:
        raise ScheduleError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    return found


@dataclass(frozen=True)
class TransformerShape:
    """A transformer stage: ``layers`` per stage of width ``hidden`` on ``micro_batch``
    sequences of ``seq_len`` tokens, ``dtype_bytes`` per activation element and per gathered
    parameter (FSDP gathers parameters in the compute dtype)."""

    hidden: int
    seq_len: int
    layers: int
    micro_batch: int = 1
    dtype_bytes: int = 2


def transformer_costs(shape: TransformerShape, flops: float) -> StageCosts:
    """One chunk's compute times and activation bytes, and the stage's parameter bytes.

    Per layer, with flash attention: activations ``34·b·s·h`` bytes in 16-bit (scaled by
    ``dtype_bytes / 2``); forward FLOPs ``24·b·s·h²·(1 + s/6h)``, backward twice that
    (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models");
    ``12·h²`` weights (attention 4·h², MLP 8·h²; biases, norms and embeddings left out).
    """
    b, s, h, layers = shape.micro_batch, shape.seq_len, shape.hidden, shape.layers
    if min(b, s, h, layers, shape.dtype_bytes) < 1 or not flops > 0:
        raise ScheduleError("transformer dimensions must be >= 1 and flops > 0")
    forward_flops = 24 * b * s * h * h * (1 + s / (6 * h)) * layers
    activation = 34 * b * s * h * layers * shape.dtype_bytes // 2
    return StageCosts(forward=forward_flops / flops, backward=2 * forward_flops / flops,
                      activation_bytes=activation,
                      param_bytes=12 * h * h * layers * shape.dtype_bytes, layers=layers)


def boundary_bytes(shape: TransformerShape) -> int:
    """One stage-to-stage message: the hidden states of a microbatch."""
    return shape.micro_batch * shape.seq_len * shape.hidden * shape.dtype_bytes


def from_preset(name: str, shape: TransformerShape | None = None) -> CostModel:
    """A cost model for preset ``name``; with ``shape``, its compute and bytes too."""
    found = preset(name)
    model = CostModel(link=found.link, p2p_bandwidth=found.p2p_bandwidth,
                      p2p_latency=found.p2p_latency)
    if shape is None:
        return model
    return with_transformer(model, shape, found.flops)


def with_transformer(model: CostModel, shape: TransformerShape, flops: float) -> CostModel:
    """``model`` with the compute times and bytes of :func:`transformer_costs` as defaults."""
    stage = transformer_costs(shape, flops)
    assert stage.activation_bytes is not None and stage.param_bytes is not None
    return replace(model, forward=stage.forward, backward=stage.backward,
                   activation_bytes=stage.activation_bytes, param_bytes=stage.param_bytes,
                   boundary_bytes=boundary_bytes(shape), layers=shape.layers)
