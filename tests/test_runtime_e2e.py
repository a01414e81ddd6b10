"""End to end: a small GPT trained across real gloo process groups, with and without swap.

All seven built-in schedules run, each with its default lowering, which the executor checks
on the in-order (NCCL) transport model before it runs anything.

Each case spawns its ranks once and trains in both modes from the same weights; it checks
that swap changes no loss and no gradient bit, that both match the unsplit model on one
process, that swap lowers the peak of saved activations where the schedule can lower it (and
never raises it), and that every step ends with no swap group alive and no host buffer out.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch

from pipeswap.runtime import RankFailedError, spawn
from pipeswap.runtime.models.data import Corpus, batches
from pipeswap.runtime.models.gpt import GPTConfig, build_gpt, lm_loss, split_stages
from pipeswap.runtime.executor.planning import named_policy
from pipeswap.runtime.train import (
    ModeResult,
    TrainConfig,
    run_rank,
    stage_layer_counts,
)
from pipeswap.schedule import ScheduleKind, ScheduleSpec, Step, StepType, build_schedule
from pipeswap.schedule.costs import ChunkBytes, CostModel, StageCosts
from pipeswap.schedule.simulate import simulate
from pipeswap_pool import POOL

pytestmark = pytest.mark.multiprocess  # full tier only, unless also marked everyday

# The plans weigh layer counts alone (--swap-costs layers): the same plan in every run, which
# the simulator below rebuilds and a replayed rank must make again; a plan on measured costs
# depends on each run's timings.
BASE = TrainConfig.of(steps=2, batch_size=8, seq_len=16, width=32, verbose=False,
                      keep_grads=True, timeout_s=60, costs="layers")
P2_V2_M4 = {"ranks": 2, "stages_per_rank": 2, "microbatches": 4}
CASES = {
    "gpipe P2 M4": BASE.but(schedule="gpipe", ranks=2, microbatches=4),
    "gpipe P2 M4 batched p2p": BASE.but(schedule="gpipe", ranks=2, microbatches=4,
                                        batch_p2p=True),
    "interleaved P2 V2 M4": BASE.but(schedule="interleaved-1f1b", **P2_V2_M4),
    "interleaved P2 V2 M4 overlap": BASE.but(schedule="interleaved-1f1b", **P2_V2_M4,
                                             overlap_b_f=True),
    "interleaved P2 V2 M4 overlap dxdw batched": BASE.but(
        schedule="interleaved-1f1b", **P2_V2_M4, overlap_b_f=True, dxdw_split=True,
        batch_p2p=True),
    "1f1b P4 M8": BASE.but(schedule="1f1b", ranks=4, microbatches=8),
    "looped-bfs P2 V2 M4": BASE.but(schedule="looped-bfs", **P2_V2_M4),
    "interleaved-zb P2 V2 M4": BASE.but(schedule="interleaved-zb", **P2_V2_M4),
    "zbv P2 M4": BASE.but(schedule="zbv", **P2_V2_M4),
    "dualpipev P2 M4": BASE.but(schedule="dualpipev", **P2_V2_M4),
    # MindSpore hyper-parallel's gap rule instead of the default peak policy
    "1f1b P4 M8 gap rule": BASE.but(schedule="1f1b", ranks=4, microbatches=8, policy="gap"),
    "zbv P2 M4 gap rule": BASE.but(schedule="zbv", **P2_V2_M4, policy="gap"),
    # every swapped chunk streamed layer by layer, or every one swapped whole
    "1f1b P4 M8 streamed": BASE.but(schedule="1f1b", ranks=4, microbatches=8,
                                    granularity="layer"),
    "1f1b P4 M8 whole chunks": BASE.but(schedule="1f1b", ranks=4, microbatches=8,
                                        granularity="chunk"),
    "interleaved P2 V2 M4 overlap dxdw streamed": BASE.but(
        schedule="interleaved-1f1b", **P2_V2_M4, overlap_b_f=True, dxdw_split=True,
        granularity="layer"),
    "zbv P2 M4 streamed": BASE.but(schedule="zbv", **P2_V2_M4, granularity="layer"),
}
EVERYDAY = "1f1b P4 M8"  # the case the everyday tier runs


@functools.lru_cache(maxsize=None)
def _trained(case: str) -> list[dict[str, ModeResult]]:
    """Each case's ranks run once; the tests below read the same results."""
    config = CASES[case]
    results: list[dict[str, ModeResult]] = POOL.run(run_rank, config.parallel.ranks, config,
                                                    timeout_s=config.job.timeout_s)
    return results


def _spec(config: TrainConfig) -> ScheduleSpec:
    parallel = config.parallel
    return ScheduleSpec(
        ScheduleKind(parallel.schedule), ranks=parallel.ranks, microbatches=parallel.microbatches,
        stages_per_rank=parallel.stages_per_rank, overlap_b_f=parallel.overlap_b_f,
        dxdw_split=parallel.dxdw_split, batch_p2p=parallel.batch_p2p, swap=True)


def _resident_peaks(order: tuple[Step | None, ...]) -> tuple[int, int]:
    """(peak, peak ignoring swap) of chunks holding activations, counted at each forward:
    a chunk holds from its F until its last backward, except between WO and LL."""
    def walk(with_swap: bool) -> int:
        held, peak = 0, 0
        pending_w = {step.key for step in order if step and step.type is StepType.BWD_WEIGHT}
        for step in order:
            for leaf in (step.sub_steps if step and step.type in _OVERLAPS else (step,)):
                if leaf is None:
                    continue
                kind = leaf.type
                if kind is StepType.FWD:
                    held += 1
                    peak = max(peak, held)
                elif kind is StepType.BWD or kind is StepType.BWD_WEIGHT or (
                        kind is StepType.BWD_INPUT and leaf.key not in pending_w):
                    held -= 1
                elif with_swap and kind is StepType.SWAP_WAIT_OFFLOAD:
                    held -= 1
                elif with_swap and kind in (StepType.SWAP_LAUNCH_LOAD,
                                            StepType.SWAP_STREAM_LOAD):
                    held += 1
        return peak

    return walk(True), walk(False)


_OVERLAPS = {StepType.OVERLAP_B_F, StepType.OVERLAP_F_B}


def _reference(config: TrainConfig) -> tuple[float, dict[str, torch.Tensor], list[str]]:
    """Loss and gradients of the first batch on the unsplit model, one process; and the
    global parameter name of each '<stage>.<name>' the ranks report."""
    corpus = Corpus.bundled()
    gpt = GPTConfig(vocab=len(corpus.vocab), seq_len=config.model.seq_len, width=config.model.width,
                    layers=config.num_layers)
    model = build_gpt(gpt, config.training.seed)
    inputs, targets = next(batches(corpus.encode(), config.training.batch_size,
                                   config.model.seq_len, 1, config.training.seed))
    loss = lm_loss(model(inputs), targets)
    loss.backward()  # type: ignore[no-untyped-call]
    names = {id(p): name for name, p in model.named_parameters()}
    by_stage = {f"{index}.{name}": names[id(p)]
                for index, stage in enumerate(split_stages(model, config.num_stages))
                for name, p in stage.named_parameters()}
    grads = {key: dict(model.named_parameters())[global_name].grad
             for key, global_name in by_stage.items()}
    return float(loss.detach()), {k: g for k, g in grads.items() if g is not None}, list(by_stage)


@pytest.mark.parametrize(
    "case", [pytest.param(name, marks=[pytest.mark.everyday] if name == EVERYDAY else [])
             for name in CASES])
def test_swap_is_exact_and_lowers_the_peak(case: str) -> None:
    config = CASES[case]
    per_rank = _trained(case)
    want_loss, want_grads, stage_names = _reference(config)
    schedule = build_schedule(_spec(config), named_policy(config.swap.policy))
    seen: set[str] = set()
    last_rank = schedule.stage_ranks[-1]
    for rank, result in enumerate(per_rank):
        plain, swap = result["no-swap"], result["swap"]
        # Swap changes no bit: losses of every step, and every gradient of the first step.
        assert swap.losses == plain.losses
        assert plain.grads is not None and swap.grads is not None
        assert plain.grads.keys() == swap.grads.keys()
        for name, grad in plain.grads.items():
            assert torch.equal(grad, swap.grads[name]), name
            assert torch.allclose(grad, want_grads[name], rtol=1e-4, atol=1e-6), name
        seen |= plain.grads.keys()
        if rank == last_rank:
            first = plain.losses[0]
            assert len(first) == config.parallel.microbatches
            assert sum(first) / len(first) == pytest.approx(want_loss, rel=1e-5)
        # Memory: lower where the swapped order holds fewer chunks at its peak, never higher.
        with_swap, without = _resident_peaks(schedule.orders[rank])
        if with_swap < without:
            assert swap.peak_activation_bytes < plain.peak_activation_bytes, rank
        else:
            assert swap.peak_activation_bytes <= plain.peak_activation_bytes, rank
        # The allocator's peak (torch's profiler, in step 1) never rises either, and falls
        # where the counted one fell: by at least half the counted saving, less the bytes of
        # the parameter gradients, which the first backward allocates and the manager does not
        # count: a swap run's peak can move past that backward, as GPipe's does here, where
        # the allocator saves a quarter to a third of what the manager counts.
        assert plain.peak_allocated_bytes is not None and swap.peak_allocated_bytes is not None
        assert swap.peak_allocated_bytes <= plain.peak_allocated_bytes, rank
        counted = plain.peak_activation_bytes - swap.peak_activation_bytes
        if counted > 0:
            allocated = plain.peak_allocated_bytes - swap.peak_allocated_bytes
            grads = sum(grad.numel() * grad.element_size() for grad in plain.grads.values())
            assert allocated > 0 and allocated >= counted / 2 - grads, (rank, allocated, counted)
        assert (swap.bytes_offloaded > 0) == (swap.swapped_chunks > 0)
        assert plain.bytes_offloaded == 0
        # Nothing left behind after any step.
        for mode in (plain, swap):
            assert mode.groups_alive_after_step == [0] * config.training.steps
            assert mode.host_bytes_in_use_after_step == [0] * config.training.steps
    assert seen == set(stage_names)  # every parameter got its gradient on some rank
    assert any(result["swap"].swapped_chunks for result in per_rank)
    streamed = [result["swap"].streamed_chunks for result in per_rank]
    if config.swap.granularity != "auto":  # forced: every swapped chunk streams, or none
        swapped = [result["swap"].swapped_chunks for result in per_rank]
        assert streamed == (swapped if config.swap.granularity == "layer" else [0] * len(swapped))
    assert any(_resident_peaks(order)[0] < _resident_peaks(order)[1]
               for order in schedule.orders)  # the case really tests a lower peak


@pytest.mark.parametrize(
    "case", list(CASES))
def test_the_simulator_predicts_the_measured_peaks(case: str) -> None:
    """Fed the bytes the runtime measured per chunk (held and movable at the end of its
    forward; for a split backward, what its I leaves for its W), the simulator's peak per
    rank, with and without swap, is the peak the runtime's swap manager counted, to the byte."""
    config = CASES[case]
    per_rank = _trained(case)
    layer_counts = stage_layer_counts(config, len(Corpus.bundled().vocab))
    schedule = build_schedule(_spec(config), named_policy(config.swap.policy, layer_counts,
                                                         config.swap.granularity))
    after_input: dict[tuple[int, int], int] = {}
    layers: dict[tuple[int, int], tuple[ChunkBytes, ...]] = {}
    for result in per_rank:  # (stage, micro) -> device bytes held right after its I
        after_input.update(result["swap"].chunk_bytes_after_input)
        for key, measured in result["swap"].layer_bytes.items():  # streamed chunks, per layer
            after = result["swap"].layer_bytes_after_input.get(key, (None,) * len(measured))
            layers[key] = tuple(ChunkBytes(held, pinned=held - movable, after_input=rest)
                                for (held, movable), rest in zip(measured, after))
    split = {leaf.key for order in schedule.orders for step in order if step is not None
             for leaf in (step.sub_steps or (step,)) if leaf.type is StepType.BWD_WEIGHT}
    missing = sorted(split - after_input.keys())
    assert not missing, (
        f"the runtime reports no bytes held after I for the split chunks {missing} "
        "(ModeResult.chunk_bytes_after_input): I frees what W does not need, so without them "
        "the simulator keeps whole chunks until W")
    chunks = {key: ChunkBytes(held, pinned=held - movable, after_input=after_input.get(key),
                              layers=layers.get(key, ()))
              for result in per_rank for key, (held, movable) in
              result["swap"].chunk_bytes.items()}
    assert len(chunks) == config.num_stages * config.parallel.microbatches
    costs = CostModel(chunks=chunks, stages={
        index: StageCosts(1.0, 2.0, layers=count) for index, count in layer_counts.items()})
    predicted = simulate(schedule, costs)
    table = [(rank.rank, rank.peak_activation_bytes, result["swap"].peak_activation_bytes,
              rank.peak_activation_bytes_no_swap, result["no-swap"].peak_activation_bytes)
             for rank, result in zip(predicted.ranks, per_rank)]
    # (rank, simulated with swap, measured with swap, simulated without, measured without)
    assert all(row[1] == row[2] and row[3] == row[4] for row in table), table


REPLAYED = ["gpipe P2 M4", "interleaved P2 V2 M4 overlap dxdw streamed", "zbv P2 M4 streamed",
            "dualpipev P2 M4", "1f1b P4 M8"]


@pytest.mark.parametrize(
    "case", REPLAYED)
def test_a_rank_replayed_alone_counts_the_full_runs_peak(case: str) -> None:
    """Each rank replayed alone in one process (pipeswap-train --replay-rank: receives made
    there, sends dropped, its stages built on the meta device and given fresh weights) holds
    exactly what it held in the full multi-process run: the same chunks swapped and streamed,
    each chunk's and layer's bytes, and the peak of saved activations, to the byte."""
    from pipeswap_e2e_workers import replay_each

    config = CASES[case]
    per_rank = _trained(case)
    replays = [config.but(replay_rank=rank, keep_grads=False) for rank in range(len(per_rank))]
    (each,) = POOL.run(replay_each, 1, replays, timeout_s=config.job.timeout_s)
    for rank, (full, alone) in enumerate(zip(per_rank, each)):
        for mode in ("no-swap", "swap"):
            ran, replayed = full[mode], alone[mode]
            assert replayed.swapped_chunks == ran.swapped_chunks, (rank, mode)
            assert replayed.streamed_chunks == ran.streamed_chunks, (rank, mode)
            assert replayed.chunk_bytes == ran.chunk_bytes, (rank, mode)
            assert replayed.layer_bytes == ran.layer_bytes, (rank, mode)
            assert replayed.chunk_bytes_after_input == ran.chunk_bytes_after_input, (rank, mode)
            assert replayed.peak_activation_bytes == ran.peak_activation_bytes, (rank, mode)
            assert replayed.parameter_bytes == ran.parameter_bytes, (rank, mode)
            assert replayed.groups_alive_after_step == [0] * config.training.steps
            assert replayed.host_bytes_in_use_after_step == [0] * config.training.steps
        # The made-up inputs are the same in both modes: swap changes no loss bit there either.
        assert alone["swap"].losses == alone["no-swap"].losses
        assert bool(alone["swap"].losses[0]) == bool(full["swap"].losses[0])
    assert any(result["swap"].swapped_chunks for result in per_rank)


@pytest.mark.parametrize("how", ["raise", "die"])
def test_a_failing_rank_makes_the_others_fail_promptly(how: str) -> None:
    from pipeswap_e2e_workers import fail_mid_step

    with pytest.raises(RankFailedError) as caught:
        if how == "die":  # a rank that dies takes fresh ranks
            spawn(fail_mid_step, 2, how, timeout_s=20)
        else:
            POOL.run(fail_mid_step, 2, how, timeout_s=20)
    failures = caught.value.failures
    assert set(failures) == {0, 1}
    if how == "raise":
        assert "boom: a stage failed on purpose" in failures[0]
    else:
        assert "died with exit code 3" in failures[0]
        explained = caught.value.cause  # the dead rank, not its peer's broken receive
        assert explained is not None and explained.rank == 0
        assert explained.headline(20) == ("rank 0 died with exit code 3 at step 1; the other "
                                          "ranks stopped")
    # Rank 1 fails waiting for micro 1, or for micro 0 when rank 0 died before its send of
    # micro 0 left the socket; a rank that raised first also says where and why.
    if how == "raise":
        assert "PeerFailedError" in failures[1]
        assert re.search(r"rank 1 stopped at 1RECV_F[01] \(receiving from rank 0\): rank 0 "
                         r"failed at 0F\d of step 1: ValueError: boom", failures[1])
    else:
        assert "PipelineCommError" in failures[1]
        assert re.search(r"rank 1: 1RECV_F[01] \(receiving from rank 0\) failed", failures[1])


def test_the_end_of_step_agreement_waits_for_every_rank_and_fails_with_one() -> None:
    from pipeswap_e2e_workers import agree_then_fail

    results = POOL.run(agree_then_fail, 4, timeout_s=30)
    assert [result["seen"] for result in results] == [None, True, True, True]
    assert [result["raised"] for result in results] == ["RuntimeError", "RuntimeError", "",
                                                        "RuntimeError"]
    assert all(result["seconds"] < 30 / 4 for result in results)  # at once, not the timeout


@pytest.mark.parametrize(
    ("what", "message"),
    [("schedule", "the ranks were given different schedules"),
     ("stages", "runs stages [1] in this schedule but was given stages [0]")],
)
def test_mismatched_ranks_fail_on_every_rank_before_any_step(what: str, message: str) -> None:
    from pipeswap_e2e_workers import mismatched

    with pytest.raises(RankFailedError) as caught:
        POOL.run(mismatched, 2, what, timeout_s=20)
    failures = caught.value.failures
    assert set(failures) == {0, 1}
    assert all("PipelineSetupError" in text for text in failures.values())
    assert any(message in text for text in failures.values())


@pytest.mark.everyday
def test_a_batch_one_rank_refuses_fails_every_rank_and_recover_goes_on() -> None:
    """No collective guards a step's start: a refused batch fails the step like any other
    failure, the peer stops at its first transfer naming the rank and the reason, and after
    recover() the next step runs."""
    from pipeswap_e2e_workers import bad_batch_then_recover

    (errors0, losses0, groups0), (errors1, losses1, groups1) = POOL.run(
        bad_batch_then_recover, 2, timeout_s=20)
    assert len(errors0) == 1 and errors0[0].startswith("PipelineSetupError")
    assert "batch size 6" in errors0[0]
    assert len(errors1) == 1 and errors1[0].startswith("PeerFailedError")
    assert "rank 0 failed at its batch check of step 1: PipelineSetupError" in errors1[0]
    assert (losses0, losses1) == (0, 4)  # the last stage's rank reports the losses
    assert groups0 == groups1 == 0


def test_a_compute_is_timed_after_its_inputs_arrive() -> None:
    """Behind a slow last rank (0.3 s a forward), the first rank's backward waits for its
    gradient; the measured backward is its own compute, not that wait, so the planner is
    not told the first rank's backward is slow."""
    from pipeswap_e2e_workers import timed_behind_a_slow_rank
    from pipeswap_pool import POOL

    first, last = POOL.run(timed_behind_a_slow_rank, 2, 0.3, timeout_s=60)
    assert last["forward"] >= 0.3  # the slow rank's own time is its own
    assert first["backward"] < 0.1, first  # not the 0.3 s and more it waited
