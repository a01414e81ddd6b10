"""What to build: the schedule kinds, the lowerings of sends and receives, and
:class:`ScheduleSpec`, which refuses a combination that cannot be built."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.generators import check_positive


class ScheduleKind(Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"
    LOOPED_BFS = "looped-bfs"
    INTERLEAVED_ZB = "interleaved-zb"
    ZBV = "zbv"
    DUALPIPEV = "dualpipev"


E = TypeVar("E", bound=Enum)


class Lowering(Enum):
    """How sends and receives are added to compute orders.

    ``EARLY``: PyTorch's default, receives posted where a run of all ranks reaches them;
    valid on every transport. ``DEFERRED``: each receive right before its consumer; tagged
    transports (gloo) only. ``COLUMNS``: MindSpore hyper-parallel's scan of aligned time
    columns, interleaved-1f1b's own. GPipe and 1F1B are generated with their P2P in place.
    """

    EARLY = "early"
    DEFERRED = "deferred"
    COLUMNS = "columns"


#: Schedules that place several stages per rank (their generators emit computes only).
MULTI_STAGE = frozenset({ScheduleKind.INTERLEAVED_1F1B, ScheduleKind.LOOPED_BFS,
                         ScheduleKind.INTERLEAVED_ZB, ScheduleKind.ZBV, ScheduleKind.DUALPIPEV})
#: Schedules on a V: exactly two stages per rank.
V_SHAPED = frozenset({ScheduleKind.ZBV, ScheduleKind.DUALPIPEV})
#: The most (stage, micro) chunks a spec may ask for: with its sends, receives and swap steps
#: a chunk takes about ten steps and 1 KiB, so this bounds a build near 1 GiB.
MAX_CHUNKS = 2**20


def lowering_kind(name: str | Lowering) -> Lowering:
    return _member(Lowering, name, "lowering")


def schedule_kind(name: str | ScheduleKind) -> ScheduleKind:
    return _member(ScheduleKind, name, "schedule")


def _member(enum: type[E], name: str | E, what: str) -> E:
    """``name``'s member of ``enum`` (a member passes through), or a one-line error listing
    the allowed names."""
    if isinstance(name, enum):
        return name
    try:
        return enum(name)
    except ValueError:
        allowed = ", ".join(member.value for member in enum)
        raise ScheduleError(f"unknown {what} {name!r}; allowed: {allowed}") from None


@dataclass(frozen=True)
class ScheduleSpec:
    """What to build. Invalid combinations raise :class:`ScheduleError` naming the option."""

    kind: ScheduleKind
    ranks: int
    microbatches: int
    stages_per_rank: int = 1
    overlap_b_f: bool = False
    dxdw_split: bool = False
    less_memory: bool = False
    fsdp: bool = False
    batch_p2p: bool = False
    swap: bool = False
    lowering: Lowering | None = None  # None: the schedule's default (effective_lowering)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", schedule_kind(self.kind))
        if self.lowering is not None:
            object.__setattr__(self, "lowering", lowering_kind(self.lowering))
        check_positive("ranks", self.ranks)
        check_positive("microbatches", self.microbatches)
        check_positive("stages_per_rank", self.stages_per_rank)
        kind = self.kind
        interleaved = kind is ScheduleKind.INTERLEAVED_1F1B
        if not interleaved:
            for option in ("overlap_b_f", "less_memory"):
                if getattr(self, option):
                    raise ScheduleError(
                        f"{option} applies to interleaved-1f1b only, not {kind.value}")
        if kind not in MULTI_STAGE and self.stages_per_rank != 1:
            raise ScheduleError(
                f"{kind.value} runs one stage per rank: stages_per_rank must be 1, got "
                f"{self.stages_per_rank} (use interleaved-1f1b for several)")
        if kind in V_SHAPED and self.stages_per_rank not in (1, 2):
            raise ScheduleError(f"{kind.value} runs exactly two stages per rank (a V); "
                                f"stages_per_rank must be 2, got {self.stages_per_rank}")
        if kind in V_SHAPED:
            object.__setattr__(self, "stages_per_rank", 2)
        chunks = self.ranks * self.stages_per_rank * self.microbatches
        if chunks > MAX_CHUNKS:
            raise ScheduleError(
                f"{self.ranks} ranks x {self.stages_per_rank} stages per rank x "
                f"{self.microbatches} microbatches make {chunks:,} chunks, over the "
                f"{MAX_CHUNKS:,} that can be built (about 1 GiB of memory); ask for fewer "
                "ranks, stages per rank or microbatches")
        if self.dxdw_split and kind in (ScheduleKind.INTERLEAVED_ZB, ScheduleKind.ZBV,
                                        ScheduleKind.DUALPIPEV):
            raise ScheduleError(f"{kind.value} splits its backwards into I and W itself: "
                                "drop dxdw_split")
        if self.dxdw_split and not self.overlap_b_f:
            raise ScheduleError(
                "dxdw_split=True requires overlap_b_f=True: the split applies to the backward "
                "inside each OVERLAP_B_F step")
        if self.lowering is not None and kind not in MULTI_STAGE:
            raise ScheduleError(
                f"{kind.value} is generated with its sends and receives in place (MindSpore "
                f"hyper-parallel's order); a lowering (here {self.lowering.value!r}) applies to "
                "multi-stage schedules only: drop it")
        if self.lowering is Lowering.COLUMNS and not interleaved:
            raise ScheduleError(
                f"the columns lowering needs interleaved-1f1b's time-aligned orders; "
                f"{kind.value} takes 'early' (the default) or 'deferred'")
        if self.lowering is Lowering.COLUMNS and self.overlap_b_f and self.less_memory:
            raise ScheduleError(
                "the columns lowering cannot order less_memory with overlap_b_f: the shallow "
                "warm-up leaves no slot between a forward and the overlap that consumes its "
                "output, so a receive would land after its consumer; use lowering 'early' "
                "(the default for this combination)")

    @property
    def effective_lowering(self) -> Lowering | None:
        """The lowering this spec builds with (None for GPipe and 1F1B)."""
        if self.lowering is not None or self.kind not in MULTI_STAGE:
            return self.lowering
        if self.kind is ScheduleKind.INTERLEAVED_1F1B and not (
                self.overlap_b_f and self.less_memory):
            return Lowering.COLUMNS  # hyper-parallel's exact orders
        return Lowering.EARLY
