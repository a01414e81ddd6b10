"""What a rank holds besides its chunks' own activations, read off the simulated timeline:
what its chunks share (counted once while one of them holds it), and, under a split
backward, the gradients its weight nodes received at a chunk's I and keep until its W."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from pipeswap.schedule.jobplan.space import Config
from pipeswap.schedule.simulate import RankResult


@dataclass(frozen=True)
class Shared:
    """What a rank's chunks share (:mod:`pipeswap.schedule.jobplan.activations`): each of
    ``parts`` (stages, bytes, whether a chunk lets go of it at its I) while a chunk of one
    of those stages holds it. On a rank of several stages, when comes from the simulated
    timeline; on a rank of one, a chunk is in flight at the peak, and holds them all."""

    parts: tuple[tuple[tuple[int, ...], int, bool], ...]
    several_stages: bool

    @property
    def most(self) -> int:
        return sum(size for _, size, _ in self.parts)

    def peak(self, rank: RankResult) -> int:
        """The rank's peak of saved activations with what its chunks share."""
        if not self.several_stages:
            return rank.peak_activation_bytes + self.most
        # one sweep in time: each part's chunks coming (+1) and going (-1), a chunk held
        # from its start up to, not at, its end; ends sort before starts at one time
        changes = sorted((time, step, part)
                         for part, (stages, _, until_input) in enumerate(self.parts)
                         for start, end in _held(rank, set(stages), until_input)
                         for time, step in ((start, 1), (end, -1)))
        holding = [0] * len(self.parts)
        shared = most = next_change = 0
        for time, held in rank.memory:  # in time order
            while next_change < len(changes) and changes[next_change][0] <= time:
                _, step, part = changes[next_change]
                before = holding[part] > 0
                holding[part] += step
                if before != (holding[part] > 0):
                    shared += step * self.parts[part][1]
                next_change += 1
            most = max(most, held + shared)
        return most


def _held(rank: RankResult, stages: set[int], until_input: bool) -> list[tuple[float, float]]:
    """Each chunk of ``stages``' time on the rank: from its forward's start to its
    backward's end (the last of B, I and W; with ``until_input``, the first)."""
    starts: dict[tuple[int, int], float] = {}
    ends: dict[tuple[int, int], float] = {}
    for span in rank.spans:
        found = _LABEL.fullmatch(span.label) if span.stream == "compute" else None
        if found is None or int(found[1]) not in stages:
            continue
        key = (int(found[1]), int(found[3]))
        if found[2] == "F":
            starts[key] = span.start
        elif found[2] in ("B", "I", "W"):
            now = ends.get(key)
            ends[key] = span.end if now is None else (
                min(now, span.end) if until_input else max(now, span.end))
    return [(start, ends.get(key, math.inf)) for key, start in starts.items()]


#: A compute span's label: stage, kind, microbatch (``3W0``).
_LABEL = re.compile(r"(\d+)([A-Z]+)(\d+)")


def waiting_for_w(rank: RankResult, grads: Mapping[int, int]) -> int:
    """The most bytes of gradients ``rank`` holds at once for chunks between their I and
    their W: ``grads[stage]`` for each such chunk of that stage (0 without a split
    backward)."""
    events: list[tuple[float, int]] = []
    inputs: dict[tuple[int, int], float] = {}
    for span in rank.spans:
        found = _LABEL.fullmatch(span.label) if span.stream == "compute" else None
        if found is None or found[2] not in ("I", "W"):
            continue
        key = (int(found[1]), int(found[3]))
        if found[2] == "I":
            inputs[key] = span.end
        elif key in inputs:
            size = grads.get(key[0], 0)
            events += [(inputs[key], size), (span.end, -size)]
    held = most = 0
    for _, change in sorted(events):
        held += change
        most = max(most, held)
    return most


def timed(config: Config) -> bool:
    """Whether ``config``'s memory needs the simulated timeline: on a rank of several
    stages, what a stage's chunks share counts only while one of them is in flight, and only
    those families split the backward, whose gradients wait for W."""
    return config.stages_per_rank > 1


