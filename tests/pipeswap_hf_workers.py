"""A small Llama from transformers (built from a config, no download) split into pipeline
stages with pipeswap.runtime.models.hf, trained one step on gloo ranks; and the unsplit model's
gradients on the same batch."""

from __future__ import annotations

import logging
from typing import Any

import torch

from pipeswap.runtime import PipelineExecutor, PipelineStage
from pipeswap.runtime.models.hf import causal_lm_loss, causal_lm_stages

LAYERS, BATCH, SEQ, MICRO, VOCAB = 8, 8, 16, 4, 64


def model(tie_word_embeddings: bool = False) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=tie_word_embeddings))


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def unsplit_gradients(whole: torch.nn.Module, ids: torch.Tensor, microbatches: int
                      ) -> dict[str, torch.Tensor]:
    """The unsplit model's gradients of the mean microbatch loss on ``ids``."""
    for micro in ids.chunk(microbatches):
        loss: torch.Tensor = causal_lm_loss(whole(micro).logits, micro) / microbatches
        loss.backward()  # type: ignore[no-untyped-call]
    return {name: p.grad for name, p in whole.named_parameters() if p.grad is not None}


def reference() -> dict[str, torch.Tensor]:
    return unsplit_gradients(model(), tokens(), MICRO)


def train(rank: int, world: int, schedule: str, swap: bool) -> dict[str, Any]:
    """One step on this rank's stages: its gradients by the unsplit model's names, its
    losses, what it swapped and the warnings the run gave."""
    whole = model()
    count = world if schedule == "1f1b" else 2 * world
    modules = causal_lm_stages(whole, count)
    indices = [rank] if schedule == "1f1b" else [rank, 2 * world - 1 - rank]
    stages = [PipelineStage(modules[index], index, count) for index in indices]
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("pipeswap.runtime.executor")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        executor = PipelineExecutor(stages, schedule, MICRO, causal_lm_loss, swap=swap)
        ids = tokens()
        for _ in range(2):  # the line is said once, whatever the steps after the first
            executor.step(ids, ids)
        whole.zero_grad()
        report = executor.step(ids, ids)
    finally:
        logger.removeHandler(handler)  # the pooled rank serves other cases next
    return {"grads": {name: p.grad for name, p in whole.named_parameters()
                      if p.grad is not None},
            "losses": report.losses, "swapped": report.swapped_chunks,
            "streamed": len(executor.streamed), "layers": [len(s.layers) for s in stages],
            "logged": [line for line in lines if "leaves these saved tensors" in line]}


#: Small random configs of the decoder families the splitter serves: Llama's layout with
#: full, sliding-window (Mistral's default window, Qwen 2's upper layers) or mixed sliding and
#: global attention (Gemma 3, with its own rotary table per kind and its logits capped), and
#: mixture-of-experts layers (Mixtral, Qwen 3 MoE), trained with their router loss weighted
#: enough that a gradient without it would differ.
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
                {"num_local_experts": 4, "num_experts_per_tok": 2,
                 "output_router_logits": True, "router_aux_loss_coef": 0.5}),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                   "head_dim": 8, "output_router_logits": True, "router_aux_loss_coef": 0.5}),
}
SMALL = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "tie_word_embeddings": False}


def family(name: str) -> torch.nn.Module:
    import transformers

    config_class, model_class, extra = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SMALL, **extra})
    model: torch.nn.Module = getattr(transformers, model_class)(config)
    return model.eval()


FAMILY_MICRO, FAMILY_BATCH, FAMILY_SEQ = 4, 8, 12


def family_tokens() -> torch.Tensor:
    return torch.randint(0, SMALL["vocab_size"], (FAMILY_BATCH, FAMILY_SEQ),
                         generator=torch.Generator().manual_seed(2))


def family_reference(name: str) -> dict[str, torch.Tensor]:
    """The unsplit model's gradients of its own loss (with its router loss, where it adds
    one), averaged over the microbatches."""
    whole, ids = family(name).train(), family_tokens()
    for micro in ids.chunk(FAMILY_MICRO):
        (whole(micro, labels=micro).loss / FAMILY_MICRO).backward()
    return {key: p.grad for key, p in whole.named_parameters() if p.grad is not None}


def train_families(rank: int, world: int) -> dict[str, dict[str, Any]]:
    """Each family split over the ranks (1F1B), one step without and one with swap from the
    same weights: this rank's gradients by the unsplit model's names, and what it swapped."""
    found: dict[str, dict[str, Any]] = {}
    for name in FAMILIES:
        found[name] = {}
        for mode in ("plain", "swap"):
            whole = family(name).train()
            stage = PipelineStage(causal_lm_stages(whole, world)[rank], rank, world)
            executor = PipelineExecutor([stage], "1f1b", FAMILY_MICRO, causal_lm_loss,
                                        swap=mode == "swap")
            ids = family_tokens()
            report = executor.step(ids, ids)
            executor.close()
            found[name][mode] = {key: p.grad for key, p in whole.named_parameters()
                                 if p.grad is not None}
            if mode == "swap":
                found[name]["swapped"] = report.swapped_chunks
        found[name].update(_budgeted(name, rank, world))
    return found


def _budgeted(name: str, rank: int, world: int) -> dict[str, Any]:
    """PyTorch's 1F1B class over pipeswap without a budget and under one no plan meets
    (one byte: every chunk swapped or recomputed as far as it goes), two steps from the same
    weights (the first measures what the second's plan rests on): the second step's
    gradients of each, and what the budgeted one swapped and recomputed."""
    import warnings

    from pipeswap.runtime.pipelining import Schedule1F1B

    found: dict[str, Any] = {}
    for mode, budget in (("dropin", None), ("budget", 1)):
        whole = family(name).train()
        stage = PipelineStage(causal_lm_stages(whole, world)[rank], rank, world)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")  # the budget no plan meets, said per rank
            schedule = Schedule1F1B(stage, FAMILY_MICRO, causal_lm_loss, budget=budget)
            ids = family_tokens()
            for _ in range(2):
                whole.zero_grad()
                schedule.step(ids if rank == 0 else None, target=ids if rank == world - 1
                              else None)
        found[mode] = {key: p.grad for key, p in whole.named_parameters() if p.grad is not None}
        if mode == "budget":
            report = schedule.report
            assert report is not None
            found["budget_moved"] = report.swapped_chunks + report.recomputed_layers
            found["varying"] = schedule.varying
            found["sizing_said"] = [str(w.message) for w in said
                                    if "sizes every microbatch" in str(w.message)]
        schedule.executor.close()
    return found


def tied_reference() -> dict[str, torch.Tensor]:
    return unsplit_gradients(model(tie_word_embeddings=True), tokens(), MICRO)


def train_tied(rank: int, world: int, swap: bool) -> dict[str, torch.Tensor]:
    """A Llama whose head is tied to its embedding, split over the ranks (the embedding on
    the first, the head on the last): one step, the tied weight's two gradients summed by
    TiedGradients; this rank's gradients by the unsplit model's names."""
    from pipeswap.runtime.models.llama import tied_parameter_names
    from pipeswap.runtime.models.tied import TiedGradients

    whole = model(tie_word_embeddings=True)
    modules = causal_lm_stages(whole, world)
    stage = PipelineStage(modules[rank], rank, world)
    tied = TiedGradients([stage], list(range(world)), tied_parameter_names(modules))
    executor = PipelineExecutor([stage], "1f1b", MICRO, causal_lm_loss, swap=swap)
    ids = tokens()
    executor.step(ids, ids)
    tied.sum_gradients()
    executor.close()
    return {name: p.grad for name, p in whole.named_parameters() if p.grad is not None}
