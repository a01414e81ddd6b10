"""The step IR: what one rank does at one point of a pipeline schedule.

A :class:`Step` is an immutable, hashable value. Leaves name a stage (and, for everything but
FSDP control, a microbatch); composites hold leaves. The text form of a step is its ``str``;
:mod:`pipeswap.schedule.text` parses it back.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pipeswap.schedule.errors import StepError


class StepType(Enum):
    """Every kind of step. The value is the code used in the text form."""

    FWD = "F"
    BWD = "B"
    BWD_INPUT = "I"
    BWD_WEIGHT = "W"
    FWD_SEND = "SEND_F"
    FWD_RECV = "RECV_F"
    BWD_SEND = "SEND_B"
    BWD_RECV = "RECV_B"
    BATCH_SEND_RECV = "BATCH_P2P"
    OVERLAP_F_B = "OVERLAP_F_B"
    OVERLAP_B_F = "OVERLAP_B_F"
    FSDP_UNSHARD = "UNSHARD"
    FSDP_RESHARD = "RESHARD"
    FSDP_REDUCE_GRAD = "REDUCE_GRAD"
    SWAP_LAUNCH_OFFLOAD = "LO"
    SWAP_WAIT_OFFLOAD = "WO"
    SWAP_LAUNCH_LOAD = "LL"
    SWAP_WAIT_LOAD = "WL"
    SWAP_STREAM_OFFLOAD = "SO"
    SWAP_STREAM_LOAD = "SL"
    RECOMPUTE = "RC"

    # Members are singletons, so identity hashing agrees with equality; it runs in C, which
    # keeps the passes' many `step.type in CATEGORY` tests cheap (Enum's default is Python).
    __hash__ = object.__hash__


#: Steps that run a model chunk on the compute stream; each occupies one compute slot.
COMPUTE = frozenset({StepType.FWD, StepType.BWD, StepType.BWD_INPUT, StepType.BWD_WEIGHT})
#: Backward steps that consume a chunk's saved activations (dw works from dx's kept state).
ACTIVATION_CONSUMERS = frozenset({StepType.BWD, StepType.BWD_INPUT})
#: Point-to-point leaves between neighbouring stages.
P2P = frozenset({StepType.FWD_SEND, StepType.FWD_RECV, StepType.BWD_SEND, StepType.BWD_RECV})
SENDS = frozenset({StepType.FWD_SEND, StepType.BWD_SEND})
RECVS = frozenset({StepType.FWD_RECV, StepType.BWD_RECV})
#: P2P leaves and their batched form.
COMM = P2P | {StepType.BATCH_SEND_RECV}
OVERLAPS = frozenset({StepType.OVERLAP_F_B, StepType.OVERLAP_B_F})
COMPOSITES = OVERLAPS | {StepType.BATCH_SEND_RECV}
FSDP = frozenset({StepType.FSDP_UNSHARD, StepType.FSDP_RESHARD, StepType.FSDP_REDUCE_GRAD})
SWAP = frozenset(
    {
        StepType.SWAP_LAUNCH_OFFLOAD,
        StepType.SWAP_WAIT_OFFLOAD,
        StepType.SWAP_LAUNCH_LOAD,
        StepType.SWAP_WAIT_LOAD,
        StepType.SWAP_STREAM_OFFLOAD,
        StepType.SWAP_STREAM_LOAD,
    }
)
#: The launches of a streaming (layer by layer) swap: SO arms the chunk's forward to offload
#: each layer as it finishes, SL loads its last layers and arms the backward to load each
#: layer ahead of the layer it is computing (one ahead by default; its lag says how many).
STREAMING = frozenset({StepType.SWAP_STREAM_OFFLOAD, StepType.SWAP_STREAM_LOAD})
#: The layer lag of an SO or SL step when its text gives none.
DEFAULT_LAYER_LAG = 1
#: RC marks layers of a chunk recomputed: their forward keeps only each layer's input, and
#: the backward runs the layer's forward again just before the layer's own backward.
RECOMPUTE = frozenset({StepType.RECOMPUTE})
#: Local control steps that take no compute slot and exchange nothing with pipeline peers.
#: Passes that look for "the P2P right after a compute" see through them.
ZERO_WIDTH = FSDP | SWAP | RECOMPUTE
_WITH_MICRO = COMPUTE | P2P | SWAP | RECOMPUTE

#: A chunk: (stage, microbatch).
ChunkKey = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a rank's order.

    Leaves carry ``stage`` and ``micro`` (FSDP control steps have no micro); composites carry
    only ``sub_steps``: an overlap holds one forward and one backward leaf (in the order its
    name says), a P2P batch holds P2P leaves. ``lag`` belongs to SO and SL steps only. SO's:
    layer ``k`` of the chunk leaves the device when the forward ends layer ``k + lag`` (the
    copy hides behind those ``lag`` layers; the last ``lag`` layers leave at the chunk's WO).
    SL's: how far ahead of the backward the loads run; SL loads the last ``lag`` layers, and
    the backward's start of layer ``k`` loads layer ``k - lag`` (each copy hides behind
    ``lag`` layers' backward, and one more layer is resident for each beyond the first).
    Either defaults to :data:`DEFAULT_LAYER_LAG`. ``layers`` belongs to RC steps only: the
    chunk's layers that are recomputed, ascending (layer 0 is the first the chunk's forward
    runs).
    """

    type: StepType
    stage: int | None = None
    micro: int | None = None
    sub_steps: tuple[Step, ...] = ()
    lag: int | None = None
    layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        stage, micro = self.stage, self.micro
        if (  # the common case, a leaf of a chunk, checked first and fast
            self.type in _WITH_MICRO and type(stage) is int and type(micro) is int
            and stage >= 0 and micro >= 0 and not self.sub_steps and self.lag is None
            and self.layers is None and self.type not in STREAMING
            and self.type is not StepType.RECOMPUTE
        ):
            return
        kind = self.type
        self._check_layers()
        if kind in STREAMING:
            if self.lag is None:
                object.__setattr__(self, "lag", DEFAULT_LAYER_LAG)
            elif not _is_index(self.lag) or self.lag < 1:
                raise StepError(f"{kind.value}'s layer lag is a whole number >= 1, got "
                                f"{self.lag!r}")
        elif self.lag is not None and isinstance(kind, StepType):
            raise StepError(f"{kind.name} takes no layer lag (only SO and SL steps have one)")
        if not isinstance(kind, StepType):
            raise StepError(f"a step's type is a StepType, got {kind!r}")
        if not isinstance(self.sub_steps, tuple):
            raise StepError(f"sub_steps must be a tuple, got {type(self.sub_steps).__name__}")
        if kind in COMPOSITES:
            self._check_composite()
            return
        if self.sub_steps:
            raise StepError(f"{kind.name} is a leaf step and cannot hold sub-steps")
        if not _is_index(self.stage):
            raise StepError(f"{kind.name} needs a stage index >= 0, got {self.stage!r}")
        if kind in _WITH_MICRO:
            if not _is_index(self.micro):
                raise StepError(f"{kind.name} needs a microbatch index >= 0, got {self.micro!r}")
        elif self.micro is not None:
            raise StepError(f"{kind.name} applies to a whole stage and takes no microbatch")

    def _check_layers(self) -> None:
        layers = self.layers
        if self.type is not StepType.RECOMPUTE:
            if layers is not None and isinstance(self.type, StepType):
                raise StepError(f"{self.type.name} takes no layers (only RC steps have them)")
            return
        if (not isinstance(layers, tuple) or not layers
                or not all(_is_index(k) for k in layers)
                or any(b <= a for a, b in zip(layers, layers[1:]))):
            raise StepError(f"RC's layers are one or more layer indices >= 0 in ascending "
                            f"order, without repeats, got {layers!r}")

    def _check_composite(self) -> None:
        kind = self.type
        if self.stage is not None or self.micro is not None:
            raise StepError(f"{kind.name} is a composite: put stage and micro on its sub-steps")
        subs = self.sub_steps
        if kind is StepType.BATCH_SEND_RECV:
            other = next((s for s in subs if s.type not in P2P), None)
            if not subs or other is not None:
                raise StepError(
                    f"BATCH_P2P holds one or more P2P leaves (SEND_F, RECV_F, SEND_B, RECV_B), "
                    f"got {other if subs else 'none'}"
                )
            return
        if len(subs) != 2:
            raise StepError(f"{kind.name} holds exactly two sub-steps, got {len(subs)}")
        f_first = kind is StepType.OVERLAP_F_B
        fwd, bwd = subs if f_first else (subs[1], subs[0])
        if fwd.type is not StepType.FWD or bwd.type not in ACTIVATION_CONSUMERS:
            shape = "(forward;backward)" if f_first else "(backward;forward)"
            raise StepError(
                f"{kind.name} holds {shape}: one F leaf and one B or I leaf, "
                f"got ({';'.join(str(s) for s in subs)})"
            )

    def __str__(self) -> str:
        if self.sub_steps:
            return f"({';'.join(str(s) for s in self.sub_steps)}){self.type.value}"
        if self.micro is None:
            return f"{self.stage}{self.type.value}"
        if self.lag is not None and self.lag != DEFAULT_LAYER_LAG:
            return f"{self.stage}{self.type.value}{self.micro}:{self.lag}"
        if self.layers is not None:
            return f"{self.stage}{self.type.value}{self.micro}:{format_layers(self.layers)}"
        return f"{self.stage}{self.type.value}{self.micro}"

    @property
    def key(self) -> ChunkKey:
        """The (stage, micro) chunk a leaf step belongs to."""
        if self.stage is None or self.micro is None:
            raise StepError(f"{self} does not belong to a single (stage, micro) chunk")
        return (self.stage, self.micro)

    @property
    def compute_leaves(self) -> tuple[Step, ...]:
        """The compute leaves this step runs (an overlap runs two)."""
        if self.type in COMPUTE:
            return (self,)
        if self.type in OVERLAPS:
            return self.sub_steps
        return ()

    @property
    def p2p_leaves(self) -> tuple[Step, ...]:
        """The P2P leaves this step issues (a batch issues several)."""
        if self.type in P2P:
            return (self,)
        if self.type is StepType.BATCH_SEND_RECV:
            return self.sub_steps
        return ()


_new_step = object.__new__
_SET = tuple(Step.__dict__[name].__set__
             for name in ("type", "stage", "micro", "sub_steps", "lag", "layers"))


def chunk_leaf(kind: StepType, stage: int, micro: int) -> Step:
    """``Step(kind, stage, micro)`` without the checks, for passes that build hundreds of
    thousands of leaves from stages and micros of steps already checked (the checks are
    half of a step's cost). ``kind`` takes a microbatch and is none of SO, SL and RC (whose
    lag and layers are set)."""
    step = _new_step(Step)
    set_type, set_stage, set_micro, set_subs, set_lag, set_layers = _SET
    set_type(step, kind)
    set_stage(step, stage)
    set_micro(step, micro)
    set_subs(step, ())
    set_lag(step, None)
    set_layers(step, None)
    return step


def format_layers(layers: tuple[int, ...]) -> str:
    """Ascending layer indices as text, runs as ranges: (0, 1, 2, 5) is ``0-2,5``."""
    parts: list[str] = []
    start = previous = layers[0]
    for k in (*layers[1:], None):
        if k is not None and k == previous + 1:
            previous = k
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if k is not None:
            start = previous = k
    return ",".join(parts)


def _is_index(value: object) -> bool:
    return type(value) is int and value >= 0


def peer_stage(kind: StepType, stage: int) -> int:
    """The stage a P2P step of ``kind`` on ``stage`` talks to: the next one for activations
    sent and gradients received, the previous one otherwise (-1 or past the last stage when
    there is no such stage)."""
    return stage + 1 if kind is StepType.FWD_SEND or kind is StepType.BWD_RECV else stage - 1


#: One rank's list of steps; ``None`` is an idle slot.
Order = tuple["Step | None", ...]
