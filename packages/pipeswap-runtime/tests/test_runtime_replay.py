"""The pieces of a one-rank replay that need no process group: stages built on the meta
device and materialized, the boundaries found by dry runs, and the replay's transport."""

from __future__ import annotations

import pytest
import torch

from pipeswap.runtime.distributed.transport import BoundaryMeta
from pipeswap.runtime.errors import PipelineSetupError
from pipeswap.runtime.models.llama import LlamaConfig, build_llama, split_layers
from pipeswap.runtime.models.gpt import GPTConfig, build_gpt, split_stages
from pipeswap.runtime.executor.replay import Replay, ReplayTransport, input_boundaries, materialize
from pipeswap.runtime.executor.stage import PipelineStage, output_meta
from pipeswap.schedule import Step, StepType


def _buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: buffer for name, buffer in module.named_buffers()}


@pytest.mark.parametrize("which", ["gpt", "llama"])
def test_a_stage_built_on_meta_gets_every_parameter_and_buffer(which: str) -> None:
    """Each parameter is drawn afresh (nothing left at zero or unset) and each derived
    buffer (the GPT's causal mask, Llama's rotary angles) equals the one built directly."""
    def build() -> list[torch.nn.Module]:
        if which == "gpt":
            return list(split_stages(build_gpt(GPTConfig(vocab=11, seq_len=8, width=16), 0), 2))
        return list(split_layers(build_llama(LlamaConfig(vocab=11, seq_len=8, dim=16), 0), 2))

    built = build()[1]
    with torch.device("meta"):
        deferred = build()[1]
    assert all(p.is_meta for p in deferred.parameters())
    materialize(deferred, "cpu")
    assert not any(p.is_meta for p in deferred.parameters())
    shapes = {name: p.shape for name, p in built.named_parameters()}
    assert {name: p.shape for name, p in deferred.named_parameters()} == shapes
    assert all(p.std() > 0 or name.endswith("weight") and torch.equal(p, torch.ones_like(p))
               or name.endswith("bias") for name, p in deferred.named_parameters())
    mine, theirs = _buffers(deferred), _buffers(built)
    assert mine.keys() == theirs.keys() and mine
    assert all(torch.equal(mine[name], theirs[name]) for name in mine)


def test_materialize_keeps_a_tied_embedding_tied() -> None:
    """A V-shaped rank holds the first and the last stage, which share the tied embedding: one
    parameter after materializing, as in the model built directly."""
    config = LlamaConfig(vocab=11, seq_len=8, dim=16, tie_embeddings=True)
    with torch.device("meta"):
        first, last = split_layers(build_llama(config, 0), 2)
    both = torch.nn.ModuleList([first, last])
    materialize(both, "cpu")
    assert first.embed is not None and last.output is not None
    assert first.embed.weight is last.output.weight and not first.embed.weight.is_meta
    assert len(list(both.parameters())) == len({id(p) for p in both.parameters()})


def test_materialize_refuses_what_it_cannot_initialise() -> None:
    class Bare(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(3, 3), Bare())
    with pytest.raises(PipelineSetupError, match="Bare hold parameters or buffers but have no "
                                                 "reset_parameters"):
        materialize(module, "cpu")


def test_input_boundaries_dry_run_the_stages_before_the_rank_one_at_a_time() -> None:
    """Rank 1 of a loop of 3 ranks x 2 stages runs stages 1 and 4: it receives the outputs
    of stages 0 and 3, found by dry runs of stages 0 to 3 (never 4 or 5), each built when
    its turn comes."""
    gpt = GPTConfig(vocab=11, seq_len=8, width=16, layers=6)
    with torch.device("meta"):
        pending = dict(enumerate(split_stages(build_gpt(gpt, 0), 6)))
    built: list[int] = []

    def build(index: int) -> PipelineStage:
        built.append(index)
        return PipelineStage(materialize(pending.pop(index), "cpu"), index, 6)

    example = torch.zeros(2, 8, dtype=torch.int64)
    found = input_boundaries((0, 1, 2, 0, 1, 2), 1, example, build, torch.device("cpu"),
                             torch.enable_grad)
    assert built == [0, 1, 2, 3]
    assert sorted(found) == [0, 3]
    for meta in found.values():
        assert [leaf.shape for leaf in meta.leaves] == [(2, 8, 16)]
        assert [leaf.dtype for leaf in meta.leaves] == [torch.float32]
        assert meta.grads == (True,)
    with pytest.raises(PipelineSetupError, match="rank 3 runs no stage"):
        input_boundaries((0, 1, 2), 3, example, build, torch.device("cpu"), torch.enable_grad)


def test_the_replay_transport_makes_receives_and_drops_sends() -> None:
    gpt = GPTConfig(vocab=11, seq_len=8, width=16)
    stage = PipelineStage(split_stages(build_gpt(gpt, 0), 2)[0], 0, 2)
    ids = BoundaryMeta.of(torch.zeros(2, 8, dtype=torch.int64), "x")[0].with_grads([False])
    meta = output_meta(stage, ids, torch.device("cpu"), torch.enable_grad)
    replay = Replay(1, 2, {0: 2, 1: 2}, {0: meta}, seed=3)
    transport = ReplayTransport(replay, (0, 1), 4, torch.device("cpu"))
    assert transport.recv_meta(1) == meta
    with pytest.raises(PipelineSetupError, match="no boundary meta of stage 1's output"):
        transport.recv_meta(2)
    transport.boundary[0] = meta
    recv = Step(StepType.FWD_RECV, stage=1, micro=0)
    send = Step(StepType.BWD_SEND, stage=1, micro=0)
    grad = torch.ones(2, 8, 16)
    received, sent = transport.post(1, [(recv, transport.receive_buffers(recv)),
                                        (send, [grad])], batched=False)
    (values,) = transport.wait(received)
    assert values.shape == (2, 8, 16) and values.std() > 0.5  # normal values, not zeros
    assert transport.wait(sent) == [grad] and torch.equal(grad, torch.ones(2, 8, 16))
    again = ReplayTransport(replay, (0, 1), 4, torch.device("cpu"))
    again.boundary[0] = meta
    (same,) = again.wait(again.post(1, [(recv, again.receive_buffers(recv))], False)[0])
    assert torch.equal(same, values)  # one seed, one sequence: equal in both modes


def test_an_order_that_recomputes_a_layer_the_stage_lacks_is_refused_before_any_step() -> None:
    import dataclasses

    from pipeswap.runtime import PipelineExecutor
    from pipeswap.runtime.models.gpt import lm_loss
    from pipeswap.schedule import ScheduleKind, ScheduleSpec, build_schedule

    stages = [PipelineStage(module, index, 2) for index, module in
              enumerate(split_stages(build_gpt(GPTConfig(vocab=13, seq_len=8, width=16,
                                                         layers=4), 0), 2))]
    plain = build_schedule(ScheduleSpec(ScheduleKind.ONE_F_ONE_B, ranks=2, microbatches=2))
    count = len(stages[0].layers)
    marked = dataclasses.replace(plain, orders=(
        (Step(StepType.RECOMPUTE, 0, 0, layers=(0, count)), *plain.orders[0]),
        plain.orders[1]))
    replay = Replay(0, 2, {s.stage_index: len(s.layers) for s in stages}, {})
    with pytest.raises(PipelineSetupError, match=rf"rank 0: 0RC0:0,{count} \(position 0\) "
                       rf"recomputes layer {count} of \(stage 0, micro 0\), but stage 0 has "
                       rf"{count} layer\(s\) \(PipelineStage.layers\); name layers from 0 to "
                       rf"{count - 1}"):
        PipelineExecutor([stages[0]], marked, 2, lm_loss, replay=replay)
