"""One configuration, judged: built, its memory counted rank by rank, simulated without swap
and, where that does not fit, with each rank's keep, swap and recompute chosen under the
memory its device has left (the peak policy with ``recompute="auto"``, on each rank's own
timeline)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from pipeswap.schedule.build import ScheduleSpec, apply_swap, build_schedule, rank_plan
from pipeswap.schedule.costs import CostModel
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.jobplan.activations import batch_bytes, rank_bytes, weight_grad_bytes
from pipeswap.schedule.jobplan.held import Shared, timed, waiting_for_w
from pipeswap.schedule.jobplan.machines import Machine
from pipeswap.schedule.jobplan.memory import Job, MemoryParts, stage_layers, static_parts
from pipeswap.schedule.jobplan.models import ModelShape
from pipeswap.schedule.jobplan.space import Config, cost_model, lower_bound
from pipeswap.schedule.policies import PeakPlanner, PeakPolicy
from pipeswap.schedule.policies._pipeline import beyond, least_step, placed
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.simulate import (
    Logged,
    RankResult,
    SimulationResult,
    simulate,
    simulate_logged,
)
from pipeswap.schedule.swap_order import swap_candidates
from pipeswap.schedule.swap_plan import RankPlan, SwapPlan


@dataclass(frozen=True)
class Outcome:
    """What one configuration does: whether it fits, its simulated step, each rank's memory
    by part, the host memory a node needs for what its ranks swap, and what each rank swaps
    and recomputes. ``why``: one line, the reason it fits or not."""

    config: Config
    fits: bool
    step_time: float
    tokens_per_s: float
    bubble: float  # the ranks' mean idle share of the step
    exposed_copy: float  # the most compute time a rank waited for copies
    memory: tuple[MemoryParts, ...]
    capacity: int  # bytes a rank may use (device memory less the reserve)
    host_bytes_per_node: int
    swapped: tuple[int, ...]  # per rank: chunks swapped whole
    streamed: tuple[int, ...]  # per rank: chunks streamed layer by layer
    recomputed: tuple[int, ...]  # per rank: layer forwards run again
    why: str
    # not planned to the end: its plans already make its step at least ``step_time``,
    # slower than the configurations it had to beat
    abandoned: bool = False

    @property
    def peak_device_bytes(self) -> int:
        return max(parts.total for parts in self.memory)

    @property
    def worst_rank(self) -> int:
        return max(range(len(self.memory)), key=lambda rank: self.memory[rank].total)


@dataclass(frozen=True)
class Judge:
    """How configurations of one job are judged: the model, the job, the machine."""

    model: ModelShape
    job: Job
    machine: Machine

    @property
    def capacity(self) -> int:
        return self.machine.memory_bytes - self.job.reserve_bytes

    def costs(self, config: Config) -> CostModel:
        return cost_model(self.model, self.job, self.machine, config)

    def bound(self, config: Config) -> float:
        return lower_bound(config, self.costs(config))

    def statics(self, config: Config) -> tuple[MemoryParts, ...]:
        layers = stage_layers(self.model.layers, config.stages)
        ranks = config.stage_ranks()
        return tuple(static_parts(self.model, self.job,
                                  tuple(s for s, r in enumerate(ranks) if r == rank), layers,
                                  config.dp, config.micro_batch)
                     for rank in range(config.ranks))

    def shared(self, config: Config) -> tuple[Shared, ...]:
        """Per rank, the activations its chunks share (no plan moves them)."""
        ranks = config.stage_ranks()
        layers = stage_layers(self.model.layers, config.stages)
        batch = batch_bytes(config.microbatches * config.micro_batch, self.job.seq_len)
        last, seq = config.stages - 1, self.job.seq_len
        out = []
        for rank in range(config.ranks):
            mine = tuple(stage for stage, owner in enumerate(ranks) if owner == rank)
            # the ids stay with the embedding until W; the targets go with the loss at I,
            # as do the rotary tables and masks with the attention
            parts: list[tuple[tuple[int, ...], int, bool]] = [
                ((stage,), batch, stage == last and not first)
                for stage, first in ((0, True), (last, False)) if stage in mine]
            if self.model.gated_mlp:
                parts.append((mine, rank_bytes(self.model, seq, 0), True))
            else:
                parts += [((stage,), rank_bytes(self.model, seq, layers[stage]), True)
                          for stage in mine]
            out.append(Shared(tuple(parts), len(mine) > 1))
        return tuple(out)

    def weight_grads(self, config: Config) -> dict[int, int]:
        """Per stage, the gradients a chunk's weight nodes hold from its I to its W."""
        layers = stage_layers(self.model.layers, config.stages)
        return {stage: weight_grad_bytes(self.model, config.micro_batch, self.job.seq_len,
                                         self.job.dtype_bytes, blocks=count, first=stage == 0,
                                         last=stage == config.stages - 1)
                for stage, count in enumerate(layers)}

    def keeping(self, config: Config) -> Outcome | None:
        """``config`` judged with every activation kept (no swap, no recompute); None where
        its schedule cannot be built (a family's own rule on microbatches, say). A step
        with swap or recompute is never shorter: those only add steps to a rank's order."""
        statics = self.statics(config)
        over = [r for r, parts in enumerate(statics) if parts.static > self.capacity]
        if over:
            return self._static_over(config, statics, over[0])
        try:
            plain = build_schedule(_spec(config))
        except ScheduleError:
            return None
        costs = self.costs(config)
        result = simulate(plain, costs, timeline=timed(config), check=False)
        return self.outcome(config, statics, result, costs, "keeps every activation")

    def swapping(self, config: Config, kept_step: float) -> Outcome:
        """``config`` judged with each rank's keep, swap and recompute chosen to fit the
        memory its device has left, on the rank's own timeline: whole chunks swapped first
        (quick to plan), which where it fits at ``kept_step`` (the step keeping everything,
        which no plan beats) is the answer; else the better of it and the peak policy's
        full choice (streaming, recompute)."""
        whole = self.whole_chunks(config)
        if settled(whole, kept_step):
            return whole
        return better(whole, self.streaming(config))

    def whole_chunks(self, config: Config) -> Outcome:
        """``config`` with whole chunks swapped where a rank's memory needs it."""
        return self.whole_chunk_plans(config).run()

    def whole_chunk_plans(self, config: Config) -> Planning:
        """``config``'s planning with whole chunks swapped where a rank's memory needs it."""
        return self._planning(config, lambda costs, budget: PeakPolicy(
            costs, budget=budget, granularity="chunk", whole_pipeline=False))

    def streaming(self, config: Config, beat: float = math.inf) -> Outcome:
        """``config`` with the peak policy's full choice per rank (see
        :meth:`full_choice`), planned to the end or until its plans already make the
        step longer than ``beat``."""
        return self.full_choice(config).run(beat)

    def full_choice(self, config: Config) -> Planning:
        """``config``'s planning with the peak policy's full choice per rank: whole or
        streamed swap, and recompute (slower to plan than :meth:`whole_chunks`)."""
        return self._planning(config, lambda costs, budget: PeakPolicy(
            costs, budget=budget, recompute="auto", whole_pipeline=False))

    def _planning(self, config: Config,
                  policy: Callable[[CostModel, dict[int, int]], PeakPolicy]) -> Planning:
        statics, costs = self.statics(config), self.costs(config)
        shared, grads = self.shared(config), self.weight_grads(config)
        plain = build_schedule(_spec(config))
        kept = simulate(plain, costs, timeline=timed(config), check=False)
        # the split backward's gradients as the schedule without swap holds them: the plan
        # only adds steps, which moves them little
        waiting = [waiting_for_w(r, grads) if timed(config) else 0 for r in kept.ranks]
        budget = {r: max(0, self.capacity - statics[r].static - shared[r].most - waiting[r])
                  for r in range(config.ranks)}
        # the furthest over its budget first: its plan bounds the step the most
        ranks = sorted(range(config.ranks), key=lambda r: (
            budget[r] - kept.ranks[r].peak_activation_bytes, r))
        return Planning(self, config, statics, costs, plain,
                        policy(costs, budget).prepare(plain, None), ranks, kept.step_time)

    def evaluate(self, config: Config, swap: bool = True) -> Outcome | None:
        """``config`` judged: kept where that fits, else (with ``swap``) swapped and
        recomputed."""
        kept = self.keeping(config)
        if kept is None or kept.fits or not swap or kept.step_time == math.inf:
            return kept
        return self.swapping(config, kept.step_time)

    def _static_over(self, config: Config, statics: tuple[MemoryParts, ...],
                     rank: int) -> Outcome:
        parts = statics[rank]
        why = (f"rank {rank}'s weights, gradients, optimizer state and buffers alone need "
               f"{gib(parts.static)} of {gib(self.capacity)}")
        return Outcome(config, False, math.inf, 0.0, 0.0, 0.0, statics, self.capacity, 0,
                       (0,) * config.ranks, (0,) * config.ranks, (0,) * config.ranks, why)

    def outcome(self, config: Config, statics: tuple[MemoryParts, ...],
                result: SimulationResult, costs: CostModel, how: str) -> Outcome:
        shared, grads = self.shared(config), self.weight_grads(config)
        memory = tuple(replace(statics[r.rank], activations=shared[r.rank].peak(r),
                               buffers=statics[r.rank].buffers + waiting_for_w(r, grads))
                       for r in result.ranks)
        fits = all(parts.total <= self.capacity for parts in memory)
        swapped = tuple(sum(1 for c in r.swapped if not c.streamed) for r in result.ranks)
        streamed = tuple(sum(1 for c in r.swapped if c.streamed) for r in result.ranks)
        host = max(_host_peak(r, costs) for r in result.ranks)
        node = host * min(self.machine.gpus_per_node, config.ranks * config.dp)
        fits = fits and node <= self.machine.host_memory_bytes
        tokens = config.dp * config.microbatches * config.micro_batch * self.job.seq_len
        worst = max(memory, key=lambda parts: parts.total)
        why = (f"{how}; the fullest rank needs {gib(worst.total)} of {gib(self.capacity)}"
               if fits else _over(memory, self.capacity, node,
                                  self.machine.host_memory_bytes, how))
        return Outcome(config, fits, result.step_time, tokens / result.step_time,
                       sum(r.bubble_fraction for r in result.ranks) / len(result.ranks),
                       max(r.exposed_copy for r in result.ranks), memory, self.capacity, node,
                       swapped, streamed, tuple(r.recomputed_layers for r in result.ranks), why)


class Planning:
    """One configuration's ranks planned one at a time on their own timelines (each rank's
    plan depends on its own order alone), stopped as soon as a plan makes the step longer
    than asked and resumed from there when asked for more: its order run against the
    messages of the schedule without swap (which come no sooner once other ranks swap
    too) bounds the step from below."""

    def __init__(self, judge: Judge, config: Config, statics: tuple[MemoryParts, ...],
                 costs: CostModel, plain: Schedule, planner: PeakPlanner,
                 ranks: list[int], kept_step: float) -> None:
        self.judge, self.config, self.statics, self.costs = judge, config, statics, costs
        self.plain, self.planner, self.left = plain, planner, ranks
        self.plans: dict[int, RankPlan] = {}
        self.logged: Logged | None = None
        # the rank whose plan bounds the step most, and the bound; -1: the step keeping
        # every activation, which no plan beats
        self.least = (-1, kept_step)

    def run(self, beat: float = math.inf) -> Outcome:
        """The outcome with every rank planned; or, as soon as the plans so far make the
        step longer than ``beat``, an :attr:`Outcome.abandoned` one whose step is the
        least they make (a later call goes on from there)."""
        while self.left:
            if beyond(self.least[1], beat):
                return self._abandoned()
            rank, self.left = self.left[0], self.left[1:]
            order = self.plain.orders[rank]
            plan = rank_plan(rank, self.planner.select(rank, swap_candidates(order, rank),
                                                       order))
            self.plans[rank] = plan
            if beat < math.inf:
                if self.logged is None:  # every rank's Ws count as nothing in the tails:
                    # a recompute may shrink any of them
                    self.logged = simulate_logged(self.plain, self.costs, None)
                least = least_step(self.logged, self.plain, rank, placed(
                    order, rank, plan.recomputed, plan.placements), self.costs)
                self.least = max(self.least, (rank, least), key=lambda found: found[1])
        config = self.config
        result = simulate(apply_swap(self.plain, SwapPlan(dict(sorted(self.plans.items())))),
                          self.costs, timeline=timed(config), check=False)
        return self.judge.outcome(config, self.statics, result, self.costs,
                                  "swaps and recomputes")

    def _abandoned(self) -> Outcome:
        rank, least = self.least
        config = self.config
        why = (f"rank {rank}'s plan alone makes a step of at least {least:.2f} s (not "
               "planned further)" if rank >= 0 else f"keeping every activation makes a step "
               f"of {least:.2f} s, which swap and recompute only lengthen (not planned)")
        return Outcome(config, False, least, 0.0, 0.0, 0.0, self.statics,
                       self.judge.capacity, 0, (0,) * config.ranks, (0,) * config.ranks,
                       (0,) * config.ranks, why, abandoned=True)


def settled(whole: Outcome, kept_step: float) -> bool:
    """Whether ``whole`` (whole chunks swapped) is a configuration's answer: it fits at the
    step keeping everything gave, which no plan beats."""
    return whole.fits and whole.step_time <= kept_step


def better(first: Outcome, second: Outcome) -> Outcome:
    """The one that fits, then the faster (the first of equals)."""
    return min((first, second), key=lambda outcome: (not outcome.fits, outcome.step_time))


def _spec(config: Config) -> ScheduleSpec:
    return ScheduleSpec(config.kind, ranks=config.ranks, microbatches=config.microbatches,
                        stages_per_rank=config.stages_per_rank)


def _host_peak(rank: RankResult, costs: CostModel) -> int:
    """The most bytes ``rank``'s swapped chunks hold in host memory at once: each from its
    offload's start to its load's end."""
    events = sorted(event for chunk in rank.swapped for event in (
        (chunk.offload[0], costs.chunk_bytes((chunk.stage, chunk.micro)).movable),
        (chunk.load[1], -costs.chunk_bytes((chunk.stage, chunk.micro)).movable)))
    held = peak = 0
    for _, change in events:
        held += change
        peak = max(peak, held)
    return peak


def _over(memory: tuple[MemoryParts, ...], capacity: int, node: int, host: int,
          how: str) -> str:
    worst = max(range(len(memory)), key=lambda rank: memory[rank].total)
    if memory[worst].total > capacity:
        return (f"rank {worst} needs {gib(memory[worst].total)} of {gib(capacity)} "
                f"({how})")
    return f"a node's swapped activations need {gib(node)} of its {gib(host)} host memory"


def gib(value: float) -> str:
    """Bytes in GiB, to a tenth (to a hundredth below 10 GiB)."""
    return f"{value / (1 << 30):.{1 if value >= 10 * (1 << 30) else 2}f} GiB"
