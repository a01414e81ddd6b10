"""A schedule: every rank's order plus the stage→rank placement that routes P2P."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import NamedTuple

from pipeswap.schedule._numbering import gaps, listing
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.steps import (
    ACTIVATION_CONSUMERS,
    SENDS,
    Order,
    Step,
    StepType,
    peer_stage,
)


class Message(NamedTuple):
    """A transfer between stages: an activation (forward) or a gradient, by its sender."""

    activation: bool
    sender: int  # the stage that sends it
    micro: int


class StageMapping(Enum):
    """How stages are laid out on ranks.

    ``LOOP``: stage s on rank s mod P. ``V``: a zig-zag, chunk 0 on ranks 0..P-1, chunk 1 on
    ranks P-1..0, chunk 2 on 0..P-1 again, and so on.
    """

    LOOP = "loop"
    V = "v"


def stage_to_rank(ranks: int, num_stages: int, mapping: StageMapping | str) -> tuple[int, ...]:
    """The rank of every stage under ``mapping``."""
    style = _mapping(mapping)
    if ranks < 1:
        raise ScheduleError(f"ranks must be >= 1, got {ranks}")
    if num_stages < 1:
        raise ScheduleError(f"num_stages must be >= 1, got {num_stages}")
    if style is StageMapping.LOOP:
        return tuple(stage % ranks for stage in range(num_stages))
    if num_stages % ranks:
        raise ScheduleError(
            f"the 'v' mapping needs num_stages to be a multiple of ranks; got {num_stages} "
            f"stages on {ranks} ranks (use {ranks * (num_stages // ranks + 1)} stages, or 'loop')"
        )
    return tuple(
        stage % ranks if (stage // ranks) % 2 == 0 else ranks - 1 - stage % ranks
        for stage in range(num_stages)
    )


def _mapping(mapping: StageMapping | str) -> StageMapping:
    if isinstance(mapping, StageMapping):
        return mapping
    try:
        return StageMapping(mapping)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in StageMapping)
        raise ScheduleError(f"unknown stage mapping {mapping!r}; allowed: {allowed}") from None


@dataclass(frozen=True)
class Schedule:
    """All ranks' orders (indexed by rank) and the rank of every stage."""

    orders: tuple[Order, ...]
    stage_ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.orders:
            raise ScheduleError("a schedule needs at least one rank")
        bad = [r for r in self.stage_ranks if not 0 <= r < len(self.orders)]
        if bad:
            raise ScheduleError(
                f"stage_ranks names rank(s) {sorted(set(bad))} but the schedule has "
                f"{len(self.orders)} ranks"
            )

    @classmethod
    def from_orders(cls, orders: Sequence[Iterable[Step | None]]) -> Schedule:
        """Build a schedule, reading each stage's rank off the steps that name it."""
        frozen = tuple(tuple(order) for order in orders)
        return cls(frozen, infer_stage_ranks(frozen))

    @property
    def num_ranks(self) -> int:
        return len(self.orders)

    @property
    def num_stages(self) -> int:
        return len(self.stage_ranks)

    @cached_property
    def num_microbatches(self) -> int:
        """The microbatch count the computes imply: the highest micro + 1 (0 with none). A
        valid schedule computes every micro below it (see ``validate``)."""
        return 1 + max((leaf.micro for order in self.orders for step in order
                        if step is not None for leaf in step.compute_leaves
                        if leaf.micro is not None), default=-1)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_ranks) if r == rank)

    def remote_input(self, leaf: Step) -> Message | None:
        """What compute ``leaf`` receives from another rank, or None (first stage, last
        stage's backward, or a neighbour on the same rank)."""
        stage, micro = leaf.key
        if leaf.type is StepType.FWD:
            if stage > 0 and self.stage_ranks[stage - 1] != self.stage_ranks[stage]:
                return Message(True, stage - 1, micro)
        elif leaf.type in ACTIVATION_CONSUMERS and stage < self.num_stages - 1 and (
                self.stage_ranks[stage + 1] != self.stage_ranks[stage]):
            return Message(False, stage + 1, micro)
        return None

    def remote_output(self, leaf: Step) -> Message | None:
        """What compute ``leaf`` sends to another rank, or None."""
        stage, micro = leaf.key
        if leaf.type is StepType.FWD:
            if stage < self.num_stages - 1 and (
                    self.stage_ranks[stage + 1] != self.stage_ranks[stage]):
                return Message(True, stage, micro)
        elif leaf.type in ACTIVATION_CONSUMERS and stage > 0 and (
                self.stage_ranks[stage - 1] != self.stage_ranks[stage]):
            return Message(False, stage, micro)
        return None

    def channel(self, kind: StepType, stage: int) -> tuple[int, int] | None:
        """The (sending rank, receiving rank) pair a P2P leaf of ``kind`` on ``stage`` moves
        its message between, or None where the peer stage does not exist or shares the rank
        (such a leaf is needless). Both ends of a channel pair first in, first out."""
        ranks, other = self.stage_ranks, peer_stage(kind, stage)
        if not (0 <= stage < len(ranks) and 0 <= other < len(ranks)) or (
                ranks[stage] == ranks[other]):
            return None
        return (ranks[stage], ranks[other]) if kind in SENDS else (ranks[other], ranks[stage])

    def map_orders(self, rewrite: Callable[[int, Order], Iterable[Step | None]]) -> Schedule:
        """A new schedule whose order for rank r is ``rewrite(r, order)``."""
        return Schedule(
            tuple(tuple(rewrite(rank, order)) for rank, order in enumerate(self.orders)),
            self.stage_ranks,
        )


def infer_stage_ranks(orders: Sequence[Sequence[Step | None]]) -> tuple[int, ...]:
    """Which rank runs each stage, from the stages named in each rank's order."""
    owner: dict[int, int] = {}
    for rank, order in enumerate(orders):
        for step in order:
            if step is None:
                continue
            for leaf in step.sub_steps or (step,):
                stage = leaf.stage
                assert stage is not None
                seen = owner.setdefault(stage, rank)
                if seen != rank:
                    raise ScheduleError(
                        f"stage {stage} appears on rank {seen} and on rank {rank} ({leaf}); "
                        "each stage must live on exactly one rank"
                    )
    if not owner:
        return ()
    end = max(owner) + 1
    if end != len(owner):
        missing = listing(gaps(owner, end), end - len(owner))
        raise ScheduleError(f"stages must be numbered 0..S-1; no rank runs stage(s) {missing}")
    return tuple(owner[stage] for stage in range(end))
