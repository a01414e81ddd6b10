"""``pipeswap-schedule plan``: the presets and a config.json read as the model, the memory
model's parts against hand-computed figures, the search against judging every configuration,
and the command line's output and one-line refusals."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from pipeswap.schedule.build import ScheduleKind
from pipeswap.schedule.cli.commands import main
from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.jobplan import (
    Job,
    Judge,
    ModelShape,
    NoFit,
    SearchSpace,
    best_of_all,
    from_hf_config,
    machine_preset,
    model_preset,
    plan,
)
from pipeswap.schedule.jobplan.activations import (
    batch_bytes,
    layer_after_input_bytes,
    first_stage_bytes,
    last_stage_bytes,
    layer_bytes,
    rank_bytes,
    weight_grad_bytes,
)
from pipeswap.schedule.jobplan.memory import stage_layers, stage_params, static_parts
from pipeswap.schedule.jobplan.report import lost
from pipeswap.schedule.jobplan.space import Config, configurations

GIB = 1 << 30
#: a small Llama-like model: 8 layers, grouped-query attention, a gated MLP
SMALL = ModelShape("small", layers=8, hidden=512, heads=8, kv_heads=2, ffn=1536, vocab=32000)


def test_presets_have_the_published_sizes() -> None:
    """Parameter counts as the models' cards give them (within rounding)."""
    assert round(model_preset("llama3-8b").params() / 1e9, 1) == 8.0
    assert round(model_preset("llama3-70b").params() / 1e9, 1) == 70.6
    assert round(model_preset("llama3-405b").params() / 1e9) == 406
    assert round(model_preset("gpt-small").params() / 1e6) == 124
    assert machine_preset("h100-sxm").memory_bytes == 80 * GIB
    with pytest.raises(ScheduleError, match="unknown model preset 'llama9'.*llama3-8b"):
        model_preset("llama9")
    with pytest.raises(ScheduleError, match="unknown GPU preset 'b300'.*h100-sxm"):
        machine_preset("b300")


def test_a_hugging_face_config_is_read_as_json(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "hidden_act": "silu", "tie_word_embeddings": False}
    path = tmp_path / "Meta-Llama-3-8B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(config))
    shape = from_hf_config(path)
    assert shape.params() == model_preset("llama3-8b").params()
    assert shape.name == "Meta-Llama-3-8B"
    gpt2 = tmp_path / "config.json"
    gpt2.write_text(json.dumps({"n_layer": 12, "n_embd": 768, "n_head": 12,
                                "vocab_size": 50257, "activation_function": "gelu_new"}))
    assert from_hf_config(gpt2).params() == model_preset("gpt-small").params()  # tied head
    del config["hidden_size"]
    path.write_text(json.dumps(config))
    with pytest.raises(ScheduleError, match="lacks hidden_size or n_embd"):
        from_hf_config(path)


def test_memory_parts_match_hand_computed_figures() -> None:
    """SMALL on 2 stages of 4 layers, 2 replicas sharding with FSDP, Adam, bf16, b=2,
    s=128: every part from its definition, by hand."""
    layer = 2 * 512 * 512 + 2 * 512 * 128 + 3 * 512 * 1536 + 2 * 512  # attention, MLP, norms
    assert SMALL.layer_params() == layer
    layers = stage_layers(8, 2)
    assert layers == (4, 4)
    first = 4 * layer + 32000 * 512  # and the embedding
    last = 4 * layer + 32000 * 512 + 512  # the head and the final norm
    assert (stage_params(SMALL, 0, layers), stage_params(SMALL, 1, layers)) == (first, last)
    job = Job(gpus=4, global_batch=8, seq_len=128, fsdp=True)
    parts = static_parts(SMALL, job, (1,), layers, dp=2, micro_batch=2)
    share = -(-last // 2)
    assert parts.parameters == parts.gradients == 2 * share
    assert parts.optimizer == 12 * share  # Adam's moments and an fp32 master copy
    boundary = 2 * 128 * 512 * 2
    logits = 2 * 2 * 128 * 32000 * 4
    assert parts.buffers == 2 * boundary + logits + 2 * last  # and one stage gathered
    replicated = static_parts(SMALL, Job(gpus=4, global_batch=8, seq_len=128, fsdp=False),
                              (0,), layers, dp=2, micro_batch=2)
    assert replicated.parameters == 2 * first and replicated.buffers == 2 * boundary
    # a GPT block's backward: gradients as large as what the block saved
    gpt_parts = static_parts(replace(SMALL, gated_mlp=False), Job(gpus=4, global_batch=8,
                             seq_len=128, fsdp=False), (0,), layers, dp=2, micro_batch=2)
    assert gpt_parts.buffers == 2 * boundary + layer_bytes(replace(SMALL, gated_mlp=False),
                                                           2, 128, 2)
    # a Llama block: ten hidden-wide tensors and four FFN-wide ones a token in bf16, a
    # log-sum-exp per head and two norm scales in fp32
    per_token = (10 * 512 + 4 * 1536) * 2 + (SMALL.heads + 2) * 4
    assert layer_bytes(SMALL, 2, 128, 2) == 2 * 128 * per_token
    gpt = replace(SMALL, gated_mlp=False)  # its scores' softmax: heads x s a token
    per_token = (8 * 512 + 2 * 1536) * 2 + 4 * 4 + SMALL.heads * 128 * 2
    assert layer_bytes(gpt, 2, 128, 2) == 2 * 128 * per_token
    # the head's norm (input, output, scale) and input, the loss's fp32 log-probabilities,
    # one scalar
    assert last_stage_bytes(SMALL, 2, 128, 2) == 2 * 128 * (3 * 512 * 2 + 4 + 32000 * 4) + 4
    assert first_stage_bytes(SMALL, 128) == 0 and first_stage_bytes(gpt, 128) == 128 * 8
    rotary = 2 * 128 * (512 // SMALL.heads) * 4
    assert rank_bytes(SMALL, 128, blocks=2) == rotary
    assert rank_bytes(gpt, 128, blocks=3) == 3 * 128 * 128  # a causal mask (bool) per block
    assert batch_bytes(16, 128) == 16 * 128 * 8  # the replica's int64 ids (or targets)
    # a split backward: what W needs of a Llama block (its projections' and norms' inputs),
    # and the gradients its weight nodes hold from I to W (each node's output's)
    assert layer_after_input_bytes(SMALL, 2, 128, 2) == 2 * 128 * (5 * 512 + 1536) * 2
    block_grads = 5 * 512 + 2 * 128 + 2 * 1536
    assert weight_grad_bytes(SMALL, 2, 128, 2, blocks=2, first=True, last=False) == (
        2 * 128 * (2 * block_grads + 512) * 2)  # and the embedding's
    assert weight_grad_bytes(SMALL, 2, 128, 2, blocks=1, first=False, last=True) == (
        2 * 128 * (block_grads + 512 + 32000) * 2)  # and the head's norm and logits
    assert stage_layers(10, 4) == (3, 3, 2, 2)  # the earlier stages take the extra ones


def _judge_every(model: ModelShape, job: Job, machine_name: str, space: SearchSpace,
                 memory: int | None = None) -> None:
    machine = machine_preset(machine_name)
    if memory is not None:
        machine = replace(machine, memory_bytes=memory)
    found = plan(model, job, machine, space, top=3)
    brute = best_of_all(model, job, machine, space)
    assert brute is not None
    if memory is not None:  # the case is tight where the winner moves or remakes something
        assert sum(found.best.swapped) + sum(found.best.streamed) + sum(
            found.best.recomputed) > 0
    assert found.best.step_time == brute.step_time
    assert found.best.config == brute.config
    assert all(outcome.fits for outcome in found.ranked)
    times = [outcome.step_time for outcome in found.ranked]
    assert times == sorted(times)
    assert found.judged <= found.considered
    # a configuration whose planning stopped is slower than the table by its bound: the
    # search stops only where no bound left is shorter than the slowest ranked step
    stopped = [outcome.step_time for outcome in found.others if outcome.abandoned]
    assert all(step >= found.ranked[-1].step_time for step in stopped)
    assert len(found.ranked) == 3 or not stopped  # a table not full: everything finished


@pytest.mark.parametrize("case", ["roomy", "tight", "replicated"])
def test_the_search_agrees_with_judging_every_configuration(case: str) -> None:
    """Small cases (P <= 8, M <= 16, every family): the plan's winner is the fastest
    configuration that fits when every configuration is judged, and nothing that does not
    fit is ranked."""
    job = Job(gpus=8, global_batch=16, seq_len=1024, reserve_bytes=0)
    space = SearchSpace(max_microbatch_factor=2)
    if case == "roomy":
        _judge_every(SMALL, job, "h100-sxm", space)
    elif case == "tight":  # 1.5 GiB a GPU: swap and recompute decide
        tight = ModelShape("tight", layers=8, hidden=1024, heads=8, kv_heads=8, ffn=4096,
                           vocab=8000)
        _judge_every(tight, Job(gpus=4, global_batch=16, seq_len=2048, reserve_bytes=0),
                     "a100-80gb", SearchSpace(max_microbatch_factor=2, ranks=(2,)),
                     memory=int(1.5 * GIB))
    else:
        _judge_every(model_preset("gpt-small"), Job(gpus=4, global_batch=8, seq_len=1024,
                                                   fsdp=False), "h100-pcie", space)


def test_a_config_that_fits_only_with_swap_is_found_and_kept_ones_rank_by_time() -> None:
    """Memory just below what keeping every activation needs: the winner swaps or
    recomputes, and its peak stays within the capacity."""
    job = Job(gpus=2, global_batch=8, seq_len=2048, reserve_bytes=0)
    judge = Judge(SMALL, job, machine_preset("h100-sxm"))
    config = Config(ScheduleKind.ONE_F_ONE_B, 2, 1, 1, 8, 1)
    kept = judge.keeping(config)
    assert kept is not None and kept.fits
    memory = kept.peak_device_bytes - (kept.memory[kept.worst_rank].activations // 3)
    machine = machine_preset("h100-sxm")
    smaller = replace(machine, memory_bytes=memory)
    found = plan(SMALL, job, smaller, SearchSpace(ranks=(2,), schedules=(ScheduleKind.ONE_F_ONE_B,),
                                           micro_batches=(1,)), top=1)
    best = found.best
    assert best.peak_device_bytes <= memory
    assert sum(best.swapped) + sum(best.streamed) + sum(best.recomputed) > 0


@pytest.mark.parametrize("kind", [ScheduleKind.ONE_F_ONE_B, ScheduleKind.INTERLEAVED_ZB,
                                  ScheduleKind.DUALPIPEV])
def test_a_full_choice_stops_only_where_its_plans_already_lose(kind: ScheduleKind) -> None:
    """Planning a configuration stops once a rank's plan bounds its step above what it must
    beat; the bound is never above the step the full choice gives, and such a loser says
    how much slower it is at least."""
    tight = ModelShape("tight", layers=8, hidden=1024, heads=8, kv_heads=8, ffn=4096,
                       vocab=8000)
    job = Job(gpus=4, global_batch=16, seq_len=2048, reserve_bytes=0)
    judge = Judge(tight, job, replace(machine_preset("a100-80gb"), memory_bytes=int(1.5 * GIB)))
    config = Config(kind, 2, 2, 1 if kind is ScheduleKind.ONE_F_ONE_B else 2, 8, 1)
    full = judge.streaming(config)
    assert not full.abandoned and sum(full.swapped) + sum(full.streamed) + sum(
        full.recomputed) > 0
    kept = judge.keeping(config)
    assert kept is not None
    unplanned = judge.streaming(config, beat=0.0)  # keeping everything is already slower
    assert unplanned.abandoned and unplanned.step_time == kept.step_time
    assert unplanned.why.startswith("keeping every activation makes a step of")
    stopped = judge.streaming(config, beat=kept.step_time)
    assert stopped.abandoned and not stopped.fits
    assert kept.step_time < stopped.step_time <= full.step_time
    assert judge.streaming(config, beat=full.step_time) == full  # nothing to stop
    assert re.fullmatch(r"at least 100\.0% slower: rank \d's plan alone makes a step of at "
                        r"least \d+\.\d\d s \(not planned further\)",
                        lost(stopped, replace(full, step_time=stopped.step_time / 2)))


def test_a_stopped_plan_goes_on_where_it_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A configuration's planning stopped part way goes on from the rank it stopped at when
    asked for more, planning each rank once, to the outcome planning it at once gives."""
    tight = ModelShape("tight", layers=8, hidden=1024, heads=8, kv_heads=8, ffn=4096,
                       vocab=8000)
    job = Job(gpus=4, global_batch=16, seq_len=2048, reserve_bytes=0)
    judge = Judge(tight, job, replace(machine_preset("a100-80gb"), memory_bytes=int(1.5 * GIB)))
    config = Config(ScheduleKind.INTERLEAVED_ZB, 2, 2, 2, 8, 1)
    planning = judge.full_choice(config)
    planned: list[int] = []
    select = planning.planner.select

    def counted(rank: int, *args: Any) -> Any:
        planned.append(rank)
        return select(rank, *args)

    monkeypatch.setattr(planning.planner, "select", counted)
    kept = judge.keeping(config)
    assert kept is not None
    stopped = planning.run(kept.step_time)  # the least a search asks
    assert stopped.abandoned and len(planned) == 1
    assert planning.run(kept.step_time) == stopped and len(planned) == 1  # nothing more
    assert planning.run() == judge.streaming(config)
    assert sorted(planned) == list(range(config.ranks))


def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    base = ["plan", "--gpu", "h100-sxm", "--seq-len", "4096"]
    cases = [
        (["--model", "llama9", "--gpus", "8", "--global-batch", "8"], "unknown model preset"),
        (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "8", "--ranks", "3"],
         "no pipeline degree in --ranks (3,) divides --gpus 8"),
        (["--model", "llama3-8b", "--gpus", "8", "--global-batch", "3", "--ranks", "1,2,4"],
         "--global-batch 3 does not split"),
        (["--model", "llama3-405b", "--gpus", "8", "--global-batch", "8"],
         "fits in no configuration on 8 h100-sxm"),
        (["--hf-config", str(tmp_path / "missing.json"), "--gpus", "8",
          "--global-batch", "8"], "cannot be read"),
        (["--gpus", "8", "--global-batch", "8"], "no model: give --model"),
    ]
    for extra, said in cases:
        with pytest.raises(SystemExit) as refused:
            main([*base, *extra])
        assert refused.value.code == 2
        err = capsys.readouterr().err
        lines = err.strip().splitlines()
        assert len(lines) == 1 and said in lines[0], err


def test_json_lists_the_candidates_best_first(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "gpt-small", "--gpu", "h100-pcie", "--gpus", "4",
                 "--global-batch", "16", "--seq-len", "1024", "--format", "json", "--top", "3",
                 "--memory", "1GiB", "--reserve", "0"])  # some not even weights fit
    assert code == 0

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    data = json.loads(capsys.readouterr().out, parse_constant=refuse)
    candidates = data["candidates"]
    assert 1 <= len(candidates) <= 3
    needed = {"schedule", "ranks", "dp", "stages_per_rank", "microbatches", "micro_batch_size",
              "step_time_s", "tokens_per_s", "fits", "peak_device_bytes", "command"}
    assert all(needed <= set(entry) for entry in candidates)
    assert [c["step_time_s"] for c in candidates] == sorted(c["step_time_s"] for c in candidates)
    assert candidates[0]["command"].startswith("torchrun --nproc-per-node 4 -m "
                                               "pipeswap.runtime.train --model gpt")
    assert all(entry["fits"] and not entry["abandoned"] for entry in candidates)
    assert all(not (entry["abandoned"] and entry["fits"]) for entry in data["others"])
    first = candidates[0]
    assert first["ranks"] * first["dp"] == 4
    assert first["microbatches"] * first["micro_batch_size"] * first["dp"] == 16


def test_the_space_respects_the_options() -> None:
    job = Job(gpus=8, global_batch=16, seq_len=128)
    space = SearchSpace(ranks=(2, 4), schedules=(ScheduleKind.INTERLEAVED_1F1B, ScheduleKind.ZBV),
                  stages_per_rank=(2,), micro_batches=(1, 2), max_microbatch_factor=4)
    found = list(configurations(SMALL, job, space))
    assert found and all(c.ranks in (2, 4) and c.stages_per_rank == 2 and c.micro_batch in (1, 2)
                         and c.microbatches <= 4 * c.ranks for c in found)
    assert {c.kind for c in found} == {ScheduleKind.INTERLEAVED_1F1B, ScheduleKind.ZBV}
    assert all(c.ranks * c.dp == 8 and c.microbatches * c.micro_batch * c.dp == 16
               for c in found)
    with pytest.raises(NoFit):
        plan(model_preset("llama3-405b"), Job(gpus=2, global_batch=2, seq_len=4096),
             machine_preset("h100-sxm"))
