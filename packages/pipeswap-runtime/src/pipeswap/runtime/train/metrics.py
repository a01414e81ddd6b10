"""Per-rank figures of a run: what each step measured (:class:`ModeResult`, filled step by
step from the executor's reports) and the ``--metrics`` file rank 0 writes as the run goes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from pipeswap.runtime.executor.planning import Measured
from pipeswap.runtime.train.config import Mode, TrainConfig
from pipeswap.runtime.distributed.collectives import gather_object

if TYPE_CHECKING:
    import torch

    from pipeswap.runtime.executor.step_report import StepReport
    from pipeswap.schedule import StepType

#: A value of one step's figures: seconds, bytes, a flag, the microbatch losses.
Figure = Union[float, int, bool, None, list[float]]


@dataclass
class ModeResult:
    """One rank's figures for one mode (no swap, or swap), filled as the run goes."""

    first_step: int = 1  # the number of the first step this run took (later when resumed)
    losses: list[list[float]] = field(default_factory=list)  # per step, per microbatch
    step_seconds: list[float] = field(default_factory=list)  # of the steps timed
    peak_activation_bytes: int = 0
    peak_memory_bytes: int = 0  # activations and gathered FSDP parameters, counted
    peak_allocated_bytes: int | None = None  # the most of the measured steps
    # what building this rank's stages left allocated (the allocator's word): their
    # parameters, sharded with FSDP; None where not measured
    parameter_bytes: int | None = None
    bytes_offloaded: int = 0
    swapped_chunks: int = 0
    streamed_chunks: int = 0  # of the swapped ones, those streamed layer by layer
    groups_alive_after_step: list[int] = field(default_factory=list)
    host_bytes_in_use_after_step: list[int] = field(default_factory=list)
    grads: dict[str, torch.Tensor] | None = None  # '<stage>.<name>' -> first step's gradient
    chunk_bytes: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    chunk_bytes_after_input: dict[tuple[int, int], int] = field(default_factory=dict)
    # per streamed chunk, per layer: (held, movable) when the layer closed, and held after I
    layer_bytes: dict[tuple[int, int], tuple[tuple[int, int], ...]] = field(default_factory=dict)
    layer_bytes_after_input: dict[tuple[int, int], tuple[int, ...]] = field(
        default_factory=dict)
    gathered_bytes: dict[int, int] = field(default_factory=dict)  # per sharded stage
    # per step: seconds, the step's peaks (allocator's where measured) and bytes offloaded
    per_step: list[dict[str, Figure]] = field(default_factory=list)
    # the step that timed its computes: their mean seconds by kind and stage, and the seconds
    # compute waited for copies
    compute_seconds: dict[tuple[StepType, int], float] = field(default_factory=dict)
    copy_wait_seconds: float | None = None
    # what the plan expected of this rank, on the costs the mode without swap measured
    predicted_step_seconds: float | None = None
    predicted_exposed_copy: float | None = None
    setup_seconds: float = 0.0  # from the mode's start to its first step: stages, schedule, plan
    recomputed_layers: int = 0  # layer forwards a step runs again in backwards
    # per chunk with recomputed layers: the device bytes each one's recompute made; per
    # chunk held whole, per layer: the bytes its forward added to the group, and the bytes
    # of the storages it was called with
    remade_bytes: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)
    layer_held: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    layer_inputs: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    order: str = ""  # the order this rank ran, in the schedule's text form
    # under a budget: the plan's predicted peak of saved activations on this rank, and the
    # bytes by which it stays over the budget (0: met)
    planned_peak_bytes: int | None = None
    budget_shortfall_bytes: int | None = None
    planned_in_pipeline: bool | None = None  # weighed in the whole pipeline, not alone

    def measured(self) -> Measured:
        """What the last step measured of this rank's chunks, for a plan to rest on."""
        return Measured(self.chunk_bytes, self.layer_held, self.layer_inputs)

    def record(self, report: StepReport, *, measured: bool, timed: bool) -> None:
        """Take in one step's report: ``measured`` when the allocator was measured in it,
        ``timed`` when its time counts (a measured step runs slower, as does one that times
        its computes)."""
        assert report.peak_activation_bytes is not None  # the trainer accounts every chunk
        assert report.peak_memory_bytes is not None
        self.losses.append(list(report.losses))
        chunks = Measured.of(report)  # what a plan under a budget rests on
        self.chunk_bytes = dict(chunks.chunk_bytes)
        self.chunk_bytes_after_input = dict(report.chunk_bytes_after_input)
        self.layer_bytes = {key: tuple((b.held, b.movable) for b in layers)
                            for key, layers in report.layer_bytes.items()}
        self.layer_bytes_after_input = dict(report.layer_bytes_after_input)
        self.recomputed_layers = report.recomputed_layers
        self.remade_bytes = {key: dict(made) for key, made in report.remade_bytes.items()}
        self.layer_held, self.layer_inputs = dict(chunks.layer_held), dict(chunks.layer_inputs)
        if timed:
            self.step_seconds.append(report.seconds)
        if report.compute_seconds:
            self.compute_seconds = dict(report.compute_seconds)
            self.copy_wait_seconds = report.copy_wait_seconds
        self.peak_activation_bytes = max(self.peak_activation_bytes,
                                         report.peak_activation_bytes)
        self.peak_memory_bytes = max(self.peak_memory_bytes, report.peak_memory_bytes)
        if report.peak_allocated_bytes is not None:
            self.peak_allocated_bytes = max(self.peak_allocated_bytes or 0,
                                            report.peak_allocated_bytes)
        self.bytes_offloaded += report.bytes_offloaded
        self.per_step.append({
            "seconds": report.seconds,
            "allocator_measured": measured,
            "peak_activation_bytes": report.peak_activation_bytes,
            "peak_memory_bytes": report.peak_memory_bytes,
            "peak_allocated_bytes": report.peak_allocated_bytes,
            "bytes_offloaded": report.bytes_offloaded})


def write_metrics(config: TrainConfig, mode: Mode, step: int, mine: dict[str, Figure],
                  rank: int) -> None:
    """After each step, on every rank: rank 0 gathers the ranks' figures and appends the
    step's line to ``config.job.metrics``: the step's loss (the mean microbatch loss over
    every replica), tokens per second (the whole batch over the slowest rank's step) and
    each rank's peaks and bytes offloaded. A replayed rank writes its own (loss null unless it
    runs the last stage)."""

    assert config.job.metrics is not None
    replayed = config.job.replay_rank is not None
    gathered = [mine] if replayed else gather_object(mine)
    if gathered is None:
        return
    figures = [_figures(entry) for entry in gathered]
    losses = [loss for entry in figures for loss in _floats(entry["losses"])]
    slowest = max(float(_number(entry["seconds"])) for entry in figures)
    record = {
        "step": step,
        "mode": mode,
        "loss": sum(losses) / len(losses) if losses else None,
        "tokens_per_s": config.training.batch_size * config.model.seq_len / slowest,
        # a step that measured the allocator ran slower (torch's profiler on CPU)
        "allocator_measured": figures[0]["allocator_measured"],
        "per_rank": [{"rank": index, **{k: v for k, v in entry.items()
                                        if k not in ("seconds", "losses", "allocator_measured")}}
                     for index, entry in enumerate(figures, rank if replayed else 0)],
    }
    with open(config.job.metrics, "a", encoding="utf-8") as out:
        out.write(json.dumps(record) + "\n")


def _figures(entry: object) -> dict[str, Figure]:
    assert isinstance(entry, dict)  # each rank sent its own step figures
    return entry


def _floats(value: Figure) -> list[float]:
    assert isinstance(value, list)
    return value


def _number(value: Figure) -> float:
    assert isinstance(value, (int, float))
    return value
