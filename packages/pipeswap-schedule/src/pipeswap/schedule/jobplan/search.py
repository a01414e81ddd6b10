"""The plan: every configuration of the space, bounded from below, judged in the order of
their bounds until no configuration left could enter the ranking (its bound is no shorter
than the slowest of the best ``top`` that fit). The ranking is then the one judging every
configuration would give."""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.jobplan.evaluate import Judge, Outcome, Planning, gib, settled
from pipeswap.schedule.jobplan.machines import Machine
from pipeswap.schedule.jobplan.memory import Job
from pipeswap.schedule.jobplan.models import ModelShape
from pipeswap.schedule.jobplan.space import Config, SearchSpace, check_job, configurations

#: told (configurations judged, configurations in the space, the best fitting so far)
Progress = Callable[[int, int, Outcome | None], None]


@dataclass(frozen=True)
class Plan:
    """The best configurations that fit, fastest first; the others judged (that do not fit,
    or are slower than the last ranked); how many configurations the space held, how many
    were judged, and the seconds the search took."""

    model: ModelShape
    job: Job
    machine: Machine
    ranked: tuple[Outcome, ...]
    others: tuple[Outcome, ...]
    considered: int
    judged: int
    seconds: float

    @property
    def best(self) -> Outcome:
        return self.ranked[0]


class NoFit(ScheduleError):
    """No configuration of the space fits; the message says what would."""


def plan(model: ModelShape, job: Job, machine: Machine, space: SearchSpace = SearchSpace(), *,
         top: int = 5, progress: Progress | None = None) -> Plan:
    """The ``top`` fastest configurations of ``space`` that fit ``machine``'s memory."""
    begun = time.perf_counter()
    check_job(model, job, space)
    judge = Judge(model, job, machine)
    configs = list(configurations(model, job, space))
    if not configs:
        raise ScheduleError("no configuration is left in the search space: widen --ranks, "
                            "--schedules, --stages-per-rank or --micro-batch-sizes")
    search = _Search(judge, configs, top, space.swap)
    while search.queue:
        bound, index, phase = heapq.heappop(search.queue)
        if bound >= search.bar():
            break
        search.judged.add(index)
        search.judge_one(index, phase)
        if progress is not None:
            fitting = [o for o in search.best.values() if o.fits]
            progress(len(search.judged), len(configs),
                     min(fitting, key=lambda o: o.step_time) if fitting else None)
    best = search.best
    ranked = sorted(((o.step_time, index, o) for index, o in best.items() if o.fits),
                    key=lambda item: (item[0], item[1]))
    others = {index: o for index, o in best.items() if not o.fits}
    others.update({index: outcome for _, index, outcome in ranked[top:]})
    if not ranked:
        raise NoFit(_why_none(model, job, machine, list(others.values())))
    return Plan(model, job, machine, tuple(outcome for _, _, outcome in ranked[:top]),
                tuple(sorted(others.values(), key=_nearness)), len(configs),
                len(search.judged), time.perf_counter() - begun)


class _Search:
    """The search's state: the queue of (bound, index, phase), and what each configuration
    judged gave so far. Phase 0 judges a configuration keeping every activation, phase 1
    with whole chunks swapped, phase 2 with the full choice (streaming, recompute), which
    is slow to plan: the quick whole-chunk plans, each a real step, lower the bar first.
    Phases 1 and 2 are bounded by the step kept (swap and recompute only add steps to a
    rank's order). A plan of phase 1 or 2 stops where the plans of its ranks so far make
    the step longer than the bar or than the next bound in the queue: it goes back in the
    queue at the least step they make, and goes on from there if that comes first again.
    So no rank is planned twice, and none where its configuration could no longer enter
    the ranking."""

    def __init__(self, judge: Judge, configs: list[Config], top: int, swap: bool) -> None:
        self.judge, self.configs, self.top, self.swap = judge, configs, top, swap
        self.queue = [(judge.bound(config), index, 0) for index, config in enumerate(configs)]
        heapq.heapify(self.queue)
        self.best: dict[int, Outcome] = {}  # each configuration judged: its best so far
        self.kept: dict[int, Outcome] = {}  # each configuration's outcome keeping everything
        self.swapped: dict[tuple[int, int], Outcome] = {}  # (index, phase): its latest
        self.judged: set[int] = set()  # the configurations simulated
        self.pending: dict[tuple[int, int], Planning] = {}  # (index, phase): stopped plans
        self.settled: set[int] = set()  # whole chunks fit at the step kept: no phase 2

    def bar(self) -> float:
        steps = sorted(o.step_time for o in self.best.values() if o.fits)
        return steps[self.top - 1] if len(steps) >= self.top else math.inf

    def judge_one(self, index: int, phase: int) -> None:
        config, judge, queue = self.configs[index], self.judge, self.queue
        if phase == 0:
            found = judge.keeping(config)
            if found is not None:
                self.best[index] = self.kept[index] = found
                if not found.fits and self.swap and found.step_time < math.inf:
                    heapq.heappush(queue, (found.step_time, index, 1))
            return
        if index in self.settled:
            return
        planning = self.pending.pop((index, phase), None) or (
            judge.whole_chunk_plans(config) if phase == 1 else judge.full_choice(config))
        found = planning.run(min(self.bar(), queue[0][0] if queue else math.inf))
        kept = self.kept[index].step_time
        if found.abandoned:
            self.pending[index, phase] = planning
            heapq.heappush(queue, (found.step_time, index, phase))
        if phase == 1 and settled(found, kept):
            self.best[index] = found
            self.settled.add(index)
            return
        if phase == 1 and (index, 1) not in self.swapped:  # stopped, or not fitting at the
            heapq.heappush(queue, (kept, index, 2))  # step kept: the full choice next
        self.swapped[index, phase] = found
        self.best[index] = _best_of([outcome for outcome in (
            self.swapped.get((index, 1)), self.swapped.get((index, 2))) if outcome])


def _best_of(outcomes: list[Outcome]) -> Outcome:
    """A configuration's outcome of its latest whole-chunk and full-choice plans: the one
    that fits, the faster (the first of equals); where neither fits, one stopped part way,
    the least step it makes (the configuration cannot win, and this is how much slower it
    is at least), else the faster."""
    fitting = [outcome for outcome in outcomes if outcome.fits]
    stopped = [outcome for outcome in outcomes if outcome.abandoned]
    return min(fitting or stopped or outcomes, key=lambda outcome: outcome.step_time)


def _nearness(outcome: Outcome) -> tuple[int, float]:
    """Nearest losers first: those that fit (slower) by step time, then those not planned to
    the end by the least step they make, then by how far over."""
    if outcome.fits:
        return 0, outcome.step_time
    if outcome.abandoned:
        return 1, outcome.step_time
    return 2, outcome.peak_device_bytes / outcome.capacity


def _why_none(model: ModelShape, job: Job, machine: Machine, judged: list[Outcome]) -> str:
    if not judged:
        return (f"no configuration of {model.name} on {job.gpus} {machine.name} could be "
                "built: widen the search (--schedules, --stages-per-rank, "
                "--micro-batch-sizes)")
    nearest = min(judged, key=lambda outcome: outcome.peak_device_bytes)
    need = nearest.peak_device_bytes + job.reserve_bytes
    return (f"{model.name} fits in no configuration on {job.gpus} {machine.name} "
            f"({gib(machine.memory_bytes)} each): the nearest, {nearest.config.describe()}, "
            f"{nearest.why}; it would fit a GPU of {gib(need)}, or give more GPUs (--gpus) "
            "so data parallel shards the weights further")


def best_of_all(model: ModelShape, job: Job, machine: Machine, space: SearchSpace = SearchSpace()
                ) -> Outcome | None:
    """Every configuration judged, the fastest that fits: what :func:`plan` must agree
    with (the tests' brute force)."""
    judge = Judge(model, job, machine)
    found: list[tuple[float, int, Outcome]] = []
    for index, config in enumerate(configurations(model, job, space)):
        outcome = judge.evaluate(config, swap=space.swap)
        if outcome is not None and outcome.fits:
            found.append((outcome.step_time, index, outcome))
    return min(found, key=lambda item: (item[0], item[1]))[2] if found else None


__all__ = ["Config", "NoFit", "Plan", "Progress", "best_of_all", "plan"]
