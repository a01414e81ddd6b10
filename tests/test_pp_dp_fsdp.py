"""Pipeline x FSDP2 x data parallel on real gloo groups: 2 pipeline ranks x 2 replicas, each
stage sharded over its data-parallel group, the schedule's UNSHARD, RESHARD and REDUCE_GRAD
steps driving FSDP. Swap changes no bit, the run equals a pipeline-only run on the same
global batch, parameters take half the memory, the simulator predicts the counted peak, FSDP
gathers nothing behind the schedule's back, and a failure in one replica stops both."""

from __future__ import annotations

import functools

import pytest
import torch

from pipeswap.runtime.models.data import Corpus
from pipeswap.runtime.executor.planning import named_policy
from pipeswap.runtime.train import (
    ModeResult,
    TrainConfig,
    run_rank,
    stage_layer_counts,
    summarize,
)
from pipeswap.schedule import SwapPolicy
from pipeswap.schedule import ScheduleKind, ScheduleSpec, StepType, build_schedule
from pipeswap.schedule.costs import ChunkBytes, CostModel, StageCosts
from pipeswap.schedule.simulate import simulate
from pipeswap_pool import POOL

pytestmark = pytest.mark.multiprocess  # full tier only, unless also marked everyday

BASE = TrainConfig.of(ranks=2, dp=2, fsdp=True, microbatches=4, steps=2, batch_size=8,
                      seq_len=16, width=32, policy="gap", keep_grads=True, verbose=False)
CASES = {
    # the peak policy streams two of rank 0's chunks here (neither the gap rule nor whole
    # chunks would swap any on 1F1B with P=2 M=4)
    # (on layer counts alone: the plan the simulator below rebuilds)
    "1f1b": BASE.but(policy="peak", granularity="layer", costs="layers"),
    # four stages a rank: the FSDP window (three) evicts and gathers again, so reloads are
    # anchored to those gathers, and the gap rule swaps
    "interleaved-1f1b": BASE.but(schedule="interleaved-1f1b", stages_per_rank=4),
}


@functools.lru_cache(maxsize=None)
def _trained(case: str, data_parallel: bool = True) -> list[dict[str, ModeResult]]:
    """The case on 2 x 2 ranks, or (``data_parallel=False``) on the 2 pipeline ranks alone
    with unsharded stages and the same global batch."""
    config = CASES[case]
    if not data_parallel:
        config = config.but(dp=1, fsdp=False)
    results: list[dict[str, ModeResult]] = POOL.run(run_rank, config.parallel.world, config,
                                                 timeout_s=config.job.timeout_s)
    return results


def _policy(config: TrainConfig) -> SwapPolicy | None:
    return named_policy(config.swap.policy, stage_layer_counts(config, len(Corpus.bundled().vocab)),
                       config.swap.granularity)


def _spec(config: TrainConfig) -> ScheduleSpec:
    parallel = config.parallel
    return ScheduleSpec(ScheduleKind(parallel.schedule), ranks=parallel.ranks,
                        microbatches=parallel.microbatches,
                        stages_per_rank=parallel.stages_per_rank, fsdp=parallel.fsdp, swap=True)


@pytest.mark.parametrize(
    "case", [pytest.param(name, marks=[pytest.mark.everyday] if name == "1f1b" else [])
             for name in CASES])
def test_swap_is_exact_and_the_replicas_train_as_one_pipeline(case: str) -> None:
    config = CASES[case]
    per_rank, alone = _trained(case), _trained(case, data_parallel=False)
    summary = summarize(config, per_rank)
    assert summary["max_abs_loss_diff"] == 0.0 and summary["losses_match"]
    for result in per_rank:
        plain, swap = result["no-swap"], result["swap"]
        assert swap.losses == plain.losses
        assert plain.grads is not None and swap.grads is not None and plain.grads
        assert plain.grads.keys() == swap.grads.keys()
        assert all(torch.equal(swap.grads[k], plain.grads[k]) for k in plain.grads)
        # nothing left behind by any step
        assert set(swap.groups_alive_after_step) == {0}
        assert set(swap.host_bytes_in_use_after_step) == {0}
    if case == "1f1b":  # swap really ran: pipeline rank 0 streams, in both replicas
        assert all(per_rank[rank]["swap"].streamed_chunks > 0 for rank in range(config.parallel.dp))
        assert all(per_rank[rank]["swap"].bytes_offloaded > 0 for rank in range(config.parallel.dp))
    if case == "interleaved-1f1b":  # swap really ran, loads anchored to re-gathers included
        assert all(result["swap"].bytes_offloaded > 0 for result in per_rank)
        order = build_schedule(_spec(config), _policy(config)).orders[0]
        kinds = [step.type for step in order if step is not None]
        assert (StepType.SWAP_LAUNCH_LOAD, StepType.FSDP_UNSHARD) in set(zip(kinds, kinds[1:]))

    # Each step's loss (the mean over both replicas' microbatches) is the pipeline-only run's
    # on the same global batch.
    reference = summarize(config.but(dp=1, fsdp=False), alone)
    for mode in ("no-swap", "swap"):
        torch.testing.assert_close(summary["losses"][mode], reference["losses"][mode],
                                   rtol=1e-5, atol=0)
    # Each rank's gradient shard is its part (FSDP shards dim 0 as torch.chunk does) of the
    # pipeline-only gradient, averaged over the replicas by FSDP's reduce-scatter.
    for rank, result in enumerate(per_rank):
        pp_rank, dp_rank = divmod(rank, config.parallel.dp)
        full = alone[pp_rank]["no-swap"].grads
        assert full is not None and result["no-swap"].grads is not None
        assert result["no-swap"].grads.keys() == full.keys()
        for name, shard in result["no-swap"].grads.items():
            want = full[name].chunk(config.parallel.dp, dim=0)[dp_rank]
            torch.testing.assert_close(shard, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", list(CASES))
def test_sharded_parameters_take_half_the_memory(case: str) -> None:
    """What building a rank's stages leaves allocated, by the allocator's count: with FSDP
    over two replicas, about half of the unsharded stages (padding to an even split and
    small per-parameter metadata make it a little more)."""
    per_rank, alone = _trained(case), _trained(case, data_parallel=False)
    for rank, result in enumerate(per_rank):
        sharded = result["no-swap"].parameter_bytes
        whole = alone[rank // CASES[case].parallel.dp]["no-swap"].parameter_bytes
        assert sharded is not None and whole is not None and whole > 0
        assert 0.45 <= sharded / whole <= 0.55, (rank, sharded, whole)


@pytest.mark.parametrize("case", list(CASES))
def test_the_simulator_predicts_activations_plus_gathered_parameters(case: str) -> None:
    """Fed each chunk's measured bytes and each stage's gathered parameter bytes, the
    simulator's peak of activations plus parameters is the executor's count, to the byte,
    with and without swap; the allocator, which also sees gradients and temporaries, saw
    more."""
    config = CASES[case]
    per_rank = _trained(case)
    schedule = build_schedule(_spec(config), _policy(config))
    replica = [result for rank, result in enumerate(per_rank) if rank % config.parallel.dp == 0]
    chunks = {key: ChunkBytes(held, pinned=held - movable, layers=tuple(
                  ChunkBytes(h, pinned=h - m) for h, m in result["swap"].layer_bytes.get(key, ())))
              for result in replica for key, (held, movable) in
              result["swap"].chunk_bytes.items()}
    gathered = {stage: size for result in replica
                for stage, size in result["swap"].gathered_bytes.items()}
    assert len(gathered) == config.num_stages and all(gathered.values())
    layers = stage_layer_counts(config, len(Corpus.bundled().vocab))
    stages = {stage: StageCosts(1.0, 2.0, param_bytes=size, layers=layers[stage])
              for stage, size in gathered.items()}
    predicted = simulate(schedule, CostModel(chunks=chunks, stages=stages))
    for sim, result in zip(predicted.ranks, replica):
        assert sim.peak_memory_bytes == result["swap"].peak_memory_bytes
        assert sim.peak_memory_bytes_no_swap == result["no-swap"].peak_memory_bytes
        assert sim.peak_activation_bytes == result["swap"].peak_activation_bytes
        assert sim.peak_memory_bytes > sim.peak_activation_bytes
        allocated = result["no-swap"].peak_allocated_bytes
        assert allocated is not None and allocated > result["no-swap"].peak_memory_bytes


def test_fsdp_runs_only_the_schedule_collectives_and_never_offloads_parameters() -> None:
    """... and a measured step times a forward after its stage's gather is done: the
    replica that waited for a late peer's gather books no wait as forward time."""
    from pipeswap_fsdp_workers import SLOW_REPLICA_S, collectives_of_a_step

    outcomes = POOL.run(collectives_of_a_step, 4, timeout_s=60)
    # a stage's forward mean over 4 microbatches would carry a quarter of the wait
    assert outcomes[0]["slowest_forward_ms"] < 1e3 * SLOW_REPLICA_S / 8, outcomes[0]
    for counts in outcomes:
        assert counts["all_gathers"] == counts["unshard_gathers"] > 0, counts
        assert counts["reduce_scatters"] == counts["reduce_grad_scatters"] > 0, counts
        assert counts["loads_at_unshard"] > 0, counts
        # gathered parameters are never offloaded with the activations
        assert counts["offloads"] > 0 and counts["gathered_parameters"] > 0, counts
        assert counts["parameters_offloaded"] == 0, counts


def test_a_failure_in_one_replica_stops_every_rank_of_both_promptly() -> None:
    from pipeswap_fsdp_workers import one_replica_fails

    timeout_s = 60.0
    outcomes = POOL.run(one_replica_fails, 4, 2, timeout_s=timeout_s)
    assert outcomes[2]["error"] == "ValueError"
    for rank in (0, 1, 3):  # its pipeline peer, and both ranks of the other replica
        outcome = outcomes[rank]
        assert outcome["error"] == "peer" and outcome["failed_rank"] == 2, outcome
        assert "injected failure in a forward" in str(outcome["message"])
    for outcome in outcomes:
        assert float(str(outcome["seconds"])) < timeout_s / 4, outcome  # not a timeout
        assert outcome["groups_alive"] == 0 and outcome["host_bytes_in_use"] == 0
        assert "restart" in str(outcome["recover"])


def test_replicas_without_fsdp_are_refused() -> None:
    """Nothing would average unsharded replicas' gradients: every rank refuses to build."""
    from pipeswap_fsdp_workers import replicas_without_fsdp

    for message in POOL.run(replicas_without_fsdp, 2, timeout_s=60):
        assert "2 data-parallel replicas but no stage is sharded" in message, message
