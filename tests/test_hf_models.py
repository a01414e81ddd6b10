"""Hugging Face causal LMs split into pipeline stages (pipeswap.runtime.models.hf): the stages
chained give the unsplit model's logits bit for bit; trained on gloo ranks on a plain and a
V schedule, every gradient is the unsplit model's and swap changes no bit; what swap leaves
on the device is said once a run."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from pipeswap.runtime import PipelineSetupError  # noqa: E402
from pipeswap.runtime.models.hf import causal_lm_loss, causal_lm_stages  # noqa: E402
from pipeswap_hf_workers import FAMILIES  # noqa: E402


def test_the_stages_chained_give_the_unsplit_models_logits_and_loss() -> None:
    from pipeswap_hf_workers import model, tokens

    whole, ids = model(), tokens()
    for stages in (causal_lm_stages(whole, 3), causal_lm_stages(whole, 2, [1, 7])):
        hidden = ids
        for stage in stages:
            hidden = stage(hidden)
        assert torch.equal(hidden, whole(ids).logits)
        # transformers pads the labels instead of cutting the logits: the same mean, summed
        # in another order
        assert causal_lm_loss(hidden, ids).item() == pytest.approx(
            whole(ids, labels=ids).loss.item(), rel=1e-6)
    first, *_, last = causal_lm_stages(whole, 3)
    assert first.embed_tokens is whole.model.embed_tokens and last.lm_head is whole.lm_head
    assert [len(stage.layers) for stage in causal_lm_stages(whole, 3)] == [3, 3, 2]


@pytest.mark.parametrize(("args", "message"), [
    ((9,), "9 stages for 8 decoder layers: give 1 to 8 stages"),
    ((2, [4, 3]), r"layers_per_stage=\[4, 3\] must give each of the 2 stages"),
])
def test_a_split_that_cannot_be_made_is_refused(args: tuple[Any, ...], message: str) -> None:
    from pipeswap_hf_workers import model

    with pytest.raises(PipelineSetupError, match=message):
        causal_lm_stages(model(), *args)
    with pytest.raises(PipelineSetupError, match="has no model, lm_head"):
        causal_lm_stages(torch.nn.Linear(2, 2), 1)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_split_gives_the_unsplit_models_logits(name: str) -> None:
    """Chained, the stages give the model's own logits bit for bit: on 12 tokens, longer
    than the sliding windows (5), so a stage that masked a sliding layer in full would
    differ. The mixture-of-experts models' router loss, made from routing sums carried
    across the stages, is the unsplit model's bit for bit too, and so is the total loss."""
    from pipeswap_hf_workers import SMALL, family

    whole = family(name).train()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=generator)
    want = whole(ids, labels=ids)
    for stages in (causal_lm_stages(whole, 3), causal_lm_stages(whole, 2, [1, 5])):
        carried: tuple[torch.Tensor, ...] = (ids,)
        for stage in stages:
            out = stage(*carried)
            carried = out if isinstance(out, tuple) else (out,)
        assert torch.equal(carried[0], want.logits)
        if getattr(whole.config, "output_router_logits", False):
            logits, router = carried
            assert torch.equal(router, whole.router_aux_loss_coef * want.aux_loss)
            assert torch.equal(causal_lm_loss((logits, router), ids), want.loss)
        else:
            assert len(carried) == 1


def test_a_model_the_stages_would_run_otherwise_is_refused() -> None:
    """A kind of attention the stages cannot mask is refused; a head tied to the
    embedding stays one parameter on the first and the last stage, found as a pair."""
    from pipeswap.runtime.models.llama import TiedParameter, tied_parameter_names

    from transformers import LlamaConfig, LlamaForCausalLM

    small = {"vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
             "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
    chunked = LlamaForCausalLM(LlamaConfig(**small))
    chunked.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(PipelineSetupError, match="attend as chunked_attention, which the stages"):
        causal_lm_stages(chunked, 2)
    routed = LlamaForCausalLM(LlamaConfig(**small))
    routed.config.output_router_logits = True  # asks for a router loss it has no routers for
    with pytest.raises(PipelineSetupError, match="asks for its router loss"):
        causal_lm_stages(routed, 2)
    tied = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **small))
    first, last = causal_lm_stages(tied, 2)
    assert first.embed_tokens is not None and last.lm_head is not None
    assert first.embed_tokens.weight is last.lm_head.weight
    assert tied_parameter_names([first, last]) == [
        TiedParameter(0, "embed_tokens.weight", 1, "lm_head.weight")]
    assert len(causal_lm_stages(tied, 1)) == 1  # one stage holds both: nothing to sum


@functools.lru_cache(maxsize=None)
def _trained(schedule: str, swap: bool) -> list[dict[str, Any]]:
    from pipeswap_hf_workers import train
    from pipeswap_pool import POOL

    results: list[dict[str, Any]] = POOL.run(train, 2, schedule, swap, timeout_s=120)
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_a_split_llama_trains_with_the_unsplit_models_gradients(schedule: str) -> None:
    from pipeswap_hf_workers import LAYERS, reference

    want = reference()
    plain, swapped = _trained(schedule, False), _trained(schedule, True)
    grads = {name: grad for rank in plain for name, grad in rank["grads"].items()}
    assert grads.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, msg=name)
    for mine, theirs in zip(swapped, plain):
        assert mine["losses"] == theirs["losses"]
        assert mine["grads"].keys() == theirs["grads"].keys()
        assert all(torch.equal(mine["grads"][n], g) for n, g in theirs["grads"].items())
    assert sum(sum(rank["layers"]) for rank in plain) == LAYERS  # decoder layers, split
    assert sum(rank["streamed"] for rank in swapped) > 0  # decoder layers streamed
    for rank in swapped:  # three steps, one line, where the rank swaps
        assert len(rank["logged"]) == (1 if rank["swapped"] else 0)
    assert any("rotary cos and sin" in line for rank in swapped for line in rank["logged"])


@pytest.mark.multiprocess
def test_every_family_trains_on_two_ranks_with_the_unsplit_models_gradients() -> None:
    """Each family split over two gloo ranks (1F1B), one step: every gradient is the
    unsplit model's (to rounding: the microbatches sum in another order), and with swap,
    or through PyTorch's class under a budget, every bit is the same, the
    mixture-of-experts models' routed activations, whose sizes depend on the data,
    included."""
    from pipeswap_hf_workers import family_reference, train_families
    from pipeswap_pool import POOL

    ranks = POOL.run(train_families, 2, timeout_s=240)
    for name in FAMILIES:
        want = family_reference(name)
        got = {key: grad for rank in ranks for key, grad in rank[name]["plain"].items()}
        assert got.keys() == want.keys(), name
        for key, grad in want.items():
            assert torch.allclose(got[key], grad, rtol=1e-4, atol=1e-6), (name, key)
        for rank in ranks:
            for key, grad in rank[name]["plain"].items():
                assert torch.equal(rank[name]["swap"][key], grad), (name, key)
        assert sum(rank[name]["swapped"] for rank in ranks) > 0, name
        # under a budget (PyTorch's class, planned on what its first step measured): the
        # same bits as without one, with chunks swapped or layers recomputed
        for rank in ranks:
            for key, grad in rank[name]["dropin"].items():
                assert torch.equal(rank[name]["budget"][key], grad), (name, key)
        assert sum(rank[name]["budget_moved"] for rank in ranks) > 0, name
        # each routed expert saves what it got, but every token goes to top-k experts, so
        # a chunk's bytes add up alike in every microbatch: no stage is sized otherwise
        # than measured, and the plan says so of none
        for rank in ranks:
            assert rank[name]["varying"] == () and rank[name]["sizing_said"] == [], name


@pytest.mark.multiprocess
def test_a_head_tied_across_ranks_gets_the_unsplit_models_gradient() -> None:
    """The embedding on rank 0 and the head tied to it on rank 1: with the two uses'
    gradients summed (TiedGradients), both ranks hold the unsplit model's gradient of the
    shared weight, every other gradient is the unsplit model's too, and swap changes no
    bit."""
    from pipeswap_hf_workers import tied_reference, train_tied
    from pipeswap_pool import POOL

    want = tied_reference()
    plain, swapped = (POOL.run(train_tied, 2, swap, timeout_s=120) for swap in (False, True))
    shared = "model.embed_tokens.weight"
    assert shared in want and "lm_head.weight" not in want  # one parameter, one name
    for rank in plain:
        assert torch.allclose(rank[shared], want[shared], rtol=1e-4, atol=1e-6)
    merged = {name: grad for rank in plain for name, grad in rank.items()}
    assert merged.keys() == want.keys()
    for name, grad in want.items():
        assert torch.allclose(merged[name], grad, rtol=1e-4, atol=1e-6), name
    for mine, theirs in zip(swapped, plain):
        assert all(torch.equal(mine[name], grad) for name, grad in theirs.items())
