"""The job plan's memory model against the runtime: ``pipeswap-train`` run with the
configuration ``plan`` chose counts exactly the activation peak the plan predicts, rank by
rank, and the allocator's peak is within 10% of the plan's total."""

from __future__ import annotations

import shlex
from typing import Any

import pytest

from pipeswap.runtime.models.data import Corpus
from pipeswap.runtime.train import parse_args, run_rank, summarize
from pipeswap.schedule.build import ScheduleKind
from pipeswap.schedule.jobplan import Job, ModelShape, SearchSpace, machine_preset, plan
from pipeswap.schedule.jobplan.report import commands
from pipeswap_pool import POOL

pytestmark = pytest.mark.multiprocess  # full tier only

SEQ, WIDTH, HEADS, BATCH, MICRO_BATCH = 16, 32, 4, 8, 2


def _built_in(family: str, layers: int) -> ModelShape:
    """A shape ``pipeswap-train``'s model of ``family`` takes, with the bundled corpus's
    vocabulary."""
    vocab = len(Corpus.bundled().vocab)
    if family == "llama":
        # its own key/value heads and FFN, which the plan's command passes on
        return ModelShape("llama", layers, WIDTH, HEADS, 1, 40, vocab)
    return ModelShape("gpt", layers, WIDTH, HEADS, HEADS, 4 * WIDTH, vocab, gated_mlp=False)


def _train(command: str) -> dict[str, Any]:
    """The --json summary of the plan's ``pipeswap-train`` command (its launcher and budget
    left out) run without swap, its ranks on the shared pool."""
    words = shlex.split(command)
    argv = words[words.index("pipeswap.runtime.train") + 1:]
    budget = argv.index("--budget")
    del argv[budget:budget + 2]
    config, _ = parse_args([*argv, "--steps", "2", "--no-swap", "--json"])
    summary: dict[str, Any] = summarize(config, POOL.run(run_rank, config.parallel.world,
                                                         config, timeout_s=60))
    return summary


@pytest.mark.parametrize(("family", "layers", "kind", "v"), [
    ("llama", 4, ScheduleKind.ONE_F_ONE_B, 1),
    # a split backward (what a chunk's I lets go of, what it holds until its W), uneven
    # stages (7 blocks in 6), the batch's ids and targets with stages beside them on a rank
    ("llama", 7, ScheduleKind.INTERLEAVED_ZB, 3),
    # two stages a rank, uneven (5 blocks in 4 stages), the GPT's masks and positions
    ("gpt", 5, ScheduleKind.INTERLEAVED_1F1B, 2),
])
def test_pipeswap_train_counts_the_activation_peak_the_plan_predicts(
        family: str, layers: int, kind: ScheduleKind, v: int) -> None:
    shape = _built_in(family, layers)
    job = Job(gpus=2, global_batch=BATCH, seq_len=SEQ, dtype_bytes=4, fsdp=False,
              reserve_bytes=0)
    found = plan(shape, job, machine_preset("h100-sxm"), SearchSpace(
        ranks=(2,), schedules=(kind,), stages_per_rank=(v,), micro_batches=(MICRO_BATCH,)),
        top=1)
    best = found.best
    assert (best.config.kind, best.config.stages_per_rank) == (kind, v)
    assert sum(best.swapped) + sum(best.streamed) + sum(best.recomputed) == 0  # it keeps
    summary = _train(commands(found)["pipeswap_train"])
    assert summary["schedule"] == kind.value and summary["microbatches"] == (
        best.config.microbatches)
    for entry in summary["per_rank"]:
        predicted = best.memory[entry["rank"]]
        assert entry["peak_activation_bytes_no_swap"] == predicted.activations, entry["rank"]
        # the allocator's peak above the step's start, on top of what the start holds in a
        # step after the first: the parameters and AdamW's two moments (fp32, as the weights;
        # the built-in models' biases and positions make them a little more than the plan's)
        allocated = entry["peak_allocated_bytes_no_swap"] + 3 * entry["parameter_bytes"]
        assert abs(allocated - predicted.total) <= 0.1 * predicted.total, (
            entry["rank"], allocated, predicted)
