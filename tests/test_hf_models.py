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


#: Small random configs of the decoder families the splitter serves: Llama's layout with
#: full, sliding-window (Mistral's default window, Qwen 2's upper layers) or mixed sliding and
#: global attention (Gemma 3, with its own rotary table per kind and its logits capped), and
#: mixture-of-experts layers (Mixtral, Qwen 3 MoE).
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM",
                     {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 8}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"pad_token_id": 0, "eos_token_id": 1}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               {"head_dim": 8, "sliding_window": 5, "final_logit_softcapping": 30.0,
                "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "head_dim": 8}),
}
SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": False}


def _family(name: str) -> torch.nn.Module:
    import transformers

    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SMALL, **extra})
    model: torch.nn.Module = getattr(transformers, model_class)(config)
    return model.eval()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_split_gives_the_unsplit_models_logits(name: str) -> None:
    """Chained, the stages give the model's own logits bit for bit: on 12 tokens, longer
    than the sliding windows (5), so a stage that masked a sliding layer in full would
    differ."""
    whole = _family(name)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=generator)
    want = whole(ids).logits
    for stages in (causal_lm_stages(whole, 3), causal_lm_stages(whole, 2, [1, 5])):
        hidden = ids
        for stage in stages:
            hidden = stage(hidden)
        assert torch.equal(hidden, want)


def test_a_model_the_stages_would_run_otherwise_is_refused() -> None:
    """A kind of attention the stages cannot mask, and a head tied to the embedding on
    another stage, whose two gradients nobody would sum."""
    from transformers import LlamaConfig, LlamaForCausalLM

    small = {"vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
             "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}
    chunked = LlamaForCausalLM(LlamaConfig(**small))
    chunked.config.layer_types = ["chunked_attention", "full_attention"]
    with pytest.raises(PipelineSetupError, match="attend as chunked_attention, which the stages"):
        causal_lm_stages(chunked, 2)
    tied = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **small))
    with pytest.raises(PipelineSetupError, match="ties its head to its embedding"):
        causal_lm_stages(tied, 2)
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
