"""What a plan says: a ranked table, a reason per configuration, why the nearest losers lost,
and for the winner the commands that run it (``pipeswap-train`` for the built-in models, a
schedule file ``simulate`` and ``validate`` read, PyTorch's drop-in class); or the same as
data (``--format json``)."""

from __future__ import annotations

import math

from pipeswap.schedule.build import MULTI_STAGE, ScheduleKind
from pipeswap.schedule.jobplan.evaluate import Outcome
from pipeswap.schedule.jobplan.models import ModelShape
from pipeswap.schedule.jobplan.search import Plan

GIB = 1 << 30
#: PyTorch's class for each family (pipeswap.runtime.pipelining has the same names).
TORCH_CLASSES = {
    ScheduleKind.GPIPE: "ScheduleGPipe", ScheduleKind.ONE_F_ONE_B: "Schedule1F1B",
    ScheduleKind.INTERLEAVED_1F1B: "ScheduleInterleaved1F1B",
    ScheduleKind.LOOPED_BFS: "ScheduleLoopedBFS",
    ScheduleKind.INTERLEAVED_ZB: "ScheduleInterleavedZeroBubble",
    ScheduleKind.ZBV: "ScheduleZBVZeroBubble", ScheduleKind.DUALPIPEV: "ScheduleDualPipeV"}
#: The model presets pipeswap-train builds, and its options for them.
def _train_family(model: ModelShape) -> str | None:
    """The built-in model of ``pipeswap-train`` that has ``model``'s shape: its Llama for a
    gated MLP, its GPT (its head untied) for a 4x MLP with as many key/value heads as heads;
    None for another shape. (It trains on its bundled text, whose vocabulary is its own.)"""
    if model.gated_mlp:
        return "llama"
    if model.ffn == 4 * model.hidden and model.kv_heads == model.heads:
        return "gpt"
    return None


def _gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def reason(outcome: Outcome) -> str:
    """One line: what the configuration's fullest rank holds and how it fits (or not)."""
    rank = outcome.worst_rank
    parts = outcome.memory[rank]
    moved = []
    if outcome.swapped[rank]:
        moved.append(f"{outcome.swapped[rank]} chunks swapped whole")
    if outcome.streamed[rank]:
        moved.append(f"{outcome.streamed[rank]} streamed")
    if outcome.recomputed[rank]:
        moved.append(f"{outcome.recomputed[rank]} layer forwards recomputed")
    held = (f"rank {rank}: weights {_gib(parts.parameters)}, gradients "
            f"{_gib(parts.gradients)}, optimizer {_gib(parts.optimizer)}, activations "
            f"{_gib(parts.activations)}, buffers {_gib(parts.buffers)} = "
            f"{_gib(parts.total)} of {_gib(outcome.capacity)} GiB")
    return "; ".join([f"{outcome.bubble:.0%} bubble", held, *moved])


def lost(outcome: Outcome, best: Outcome) -> str:
    """Why ``outcome`` ranks below ``best``."""
    if outcome.abandoned:
        least = outcome.step_time / best.step_time - 1
        return f"at least {least:.1%} slower: {outcome.why}"
    if not outcome.fits:
        return f"does not fit: {outcome.why}"
    slower = outcome.step_time / best.step_time - 1
    exposed = (f", {outcome.exposed_copy:.2f} s of copies exposed"
               if outcome.exposed_copy >= 0.005 else "")
    return f"{slower:.1%} slower{exposed}"


def commands(plan: Plan) -> dict[str, str]:
    """How to run the winner: with pipeswap-train (built-in models), as a schedule file, and
    with PyTorch's class from pipeswap's drop-in module."""
    best, job, model = plan.best.config, plan.job, plan.model
    v = f" --stages-per-rank {best.stages_per_rank}" if best.kind in MULTI_STAGE else ""
    found = {"schedule_file": (
        f"pipeswap-schedule orders --schedule {best.kind.value} --ranks {best.ranks} "
        f"--microbatches {best.microbatches}{v} --format json > schedule.json")}
    family = _train_family(model)
    if family is not None:
        budget = plan.best.capacity - plan.best.memory[plan.best.worst_rank].static
        found["pipeswap_train"] = (
            f"torchrun --nproc-per-node {job.gpus} -m pipeswap.runtime.train --model {family} "
            f"--layers {model.layers} --width {model.hidden} --heads {model.heads} "
            f"{f'--kv-heads {model.kv_heads} --ffn {model.ffn} ' if family == 'llama' else ''}"
            f"--seq-len {job.seq_len} --schedule {best.kind.value} --ranks {best.ranks}"
            f"{f' --dp {best.dp} --fsdp' if best.dp > 1 and job.fsdp else ''}{v} "
            f"--microbatches {best.microbatches} --batch-size {job.global_batch} "
            f"--dtype {'bf16' if job.dtype_bytes == 2 else 'fp32'} --budget {budget}")
    found["pytorch"] = (
        f"from pipeswap.runtime.pipelining import {TORCH_CLASSES[best.kind]}; "
        f"{TORCH_CLASSES[best.kind]}(stages, n_microbatches={best.microbatches}, "
        f"loss_fn=loss_fn, swap=True)")
    return found


def render(plan: Plan, others: int = 5) -> str:
    """The ranked table, each configuration's reason, the nearest losers, the commands."""
    head = (f"{plan.model.describe()}\n{plan.job.gpus} x {plan.machine.name} "
            f"({plan.machine.memory_bytes / GIB:.0f} GiB, {_gib(plan.best.capacity)} usable), "
            f"global batch {plan.job.global_batch} x {plan.job.seq_len} tokens; "
            f"{plan.judged} of {plan.considered} configurations simulated in "
            f"{plan.seconds:.1f} s")
    rows = [("#", "schedule", "P", "DP", "V", "M", "b", "step s", "tokens/s", "bubble",
             "exposed s", "peak GiB", "host GiB/node")]
    for place, outcome in enumerate(plan.ranked, 1):
        c = outcome.config
        rows.append((str(place), c.kind.value, str(c.ranks), str(c.dp),
                     str(c.stages_per_rank), str(c.microbatches), str(c.micro_batch),
                     f"{outcome.step_time:.2f}", f"{outcome.tokens_per_s:,.0f}",
                     f"{outcome.bubble:.0%}", f"{outcome.exposed_copy:.2f}",
                     f"{_gib(outcome.peak_device_bytes)}/{_gib(outcome.capacity)}",
                     _gib(outcome.host_bytes_per_node)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    reasons = [f"{place}. {reason(outcome)}" for place, outcome in enumerate(plan.ranked, 1)]
    losers = [f"- {outcome.config.describe()}: {lost(outcome, plan.best)}"
              for outcome in plan.others[:others]]
    runs = [f"  {name}: {text}" for name, text in commands(plan).items()]
    return "\n".join([head, "", *table, "", *reasons,
                      *(["", "nearest that lost:", *losers] if losers else []),
                      "", "run the best:", *runs])


def as_data(plan: Plan) -> dict[str, object]:
    """The plan for tools (``--format json``): ``candidates`` best first, then ``others``."""
    runs = commands(plan)

    def entry(outcome: Outcome, command: str | None) -> dict[str, object]:
        c, parts = outcome.config, outcome.memory[outcome.worst_rank]
        return {"schedule": c.kind.value, "ranks": c.ranks, "dp": c.dp,
                "stages_per_rank": c.stages_per_rank, "microbatches": c.microbatches,
                "micro_batch_size": c.micro_batch,
                "step_time_s": outcome.step_time if math.isfinite(outcome.step_time) else None,
                "tokens_per_s": outcome.tokens_per_s, "bubble": outcome.bubble,
                "exposed_copy_s": outcome.exposed_copy, "fits": outcome.fits,
                "peak_device_bytes": outcome.peak_device_bytes,
                "capacity_bytes": outcome.capacity,
                "memory": {"rank": outcome.worst_rank, "parameters": parts.parameters,
                           "gradients": parts.gradients, "optimizer": parts.optimizer,
                           "activations": parts.activations, "buffers": parts.buffers},
                "host_bytes_per_node": outcome.host_bytes_per_node,
                "swapped_chunks": list(outcome.swapped),
                "streamed_chunks": list(outcome.streamed),
                "recomputed_layers": list(outcome.recomputed), "reason": outcome.why,
                "abandoned": outcome.abandoned, "command": command}

    best = runs.get("pipeswap_train", runs["schedule_file"])
    return {"model": plan.model.name, "machine": plan.machine.name, "gpus": plan.job.gpus,
            "global_batch": plan.job.global_batch, "seq_len": plan.job.seq_len,
            "considered": plan.considered, "simulated": plan.judged, "seconds": plan.seconds,
            "commands": runs,
            "candidates": [entry(outcome, best if place == 0 else None)
                           for place, outcome in enumerate(plan.ranked)],
            "others": [entry(outcome, None) for outcome in plan.others]}
