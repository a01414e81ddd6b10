"""Hugging Face causal language models split into pipeline stages (``pipeswap-runtime[hf]``).

A transformers causal LM of the Llama layout (``model.embed_tokens``, ``model.layers``,
``model.rotary_emb``, ``model.norm``, ``lm_head``: Llama and models built like it, with full
causal attention; transformers 5.25 or later) is split into stage modules that run exactly
what the unsplit model runs on a batch without padding: the first stage embeds the tokens, each stage runs its run of decoder layers, the
last normalises and projects to the vocabulary. Between stages goes only the hidden state.
Each stage works out the rotary tables (cos and sin for every position) and the causal mask
itself, from the hidden state's shape, as the unsplit model does once: they hold no
parameters, and sending them would cost a transfer per microbatch. The decoder layers are
each stage's ``layers``, so streaming swap moves them one by one::

    from transformers import LlamaConfig, LlamaForCausalLM
    from pipeswap.runtime import PipelineStage
    from pipeswap.runtime.models.hf import causal_lm_stages

    model = LlamaForCausalLM(LlamaConfig(...))           # the same seed on every rank
    modules = causal_lm_stages(model, num_stages=4)
    stage = PipelineStage(modules[rank], rank, 4)        # layers: the decoder layers

The stage modules share the model's parameters (nothing is copied), so
``model.named_parameters()`` names their gradients as the unsplit model does.

What stays on the device: every decoder layer of a stage saves the same rotary tables for
its backward, so a streamed chunk's layers share them, and swap keeps them on the device
rather than move one copy per layer (they are a few kilobytes a microbatch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pipeswap.runtime.errors import PipelineSetupError
from pipeswap.runtime.models.gpt import even_runs

__all__ = ["CausalLMStage", "causal_lm_stages", "causal_lm_loss"]


class CausalLMStage(torch.nn.Module):
    """One stage of a causal LM: the embedding (first stage), a run of decoder layers, the
    final norm and head (last stage). Takes token ids (first stage) or the hidden state, and
    returns the hidden state, or the logits on the last stage."""

    def __init__(self, config: Any,  # Any: a transformers config (untyped)
                 rotary: torch.nn.Module, layers: Sequence[torch.nn.Module],
                 embed: torch.nn.Module | None = None, norm: torch.nn.Module | None = None,
                 head: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = embed
        self.rotary_emb = rotary
        self.layers = torch.nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden,
                                  attention_mask=None, cache=None, position_ids=positions)
        tables = self.rotary_emb(hidden, position_ids=positions)
        for layer in self.layers:
            out = layer(hidden, attention_mask=mask, position_embeddings=tables,
                        position_ids=positions)
            hidden = out[0] if isinstance(out, tuple) else out  # transformers 4: a tuple
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.lm_head is not None:
            hidden = self.lm_head(hidden)
        return hidden


def causal_lm_stages(model: torch.nn.Module, num_stages: int,
                     layers_per_stage: Sequence[int] | None = None) -> list[CausalLMStage]:
    """``model`` (a transformers causal LM of the Llama layout) as ``num_stages`` stage
    modules: the decoder layers split evenly (the earlier stages taking the extra ones), or
    ``layers_per_stage`` a stage; every stage holds at least one layer. Refused: a model
    that attends within a sliding window (its stages would build the full causal mask), and
    one whose head shares its embedding's weight across stages (nothing would sum that
    weight's two gradients)."""
    inner: Any = getattr(model, "model", None)  # Any: transformers is untyped
    missing = [name for name, owner in (("model", model), ("lm_head", model),
                                        ("model.embed_tokens", inner),
                                        ("model.layers", inner), ("model.rotary_emb", inner),
                                        ("model.norm", inner))
               if owner is None or not hasattr(owner, name.split(".")[-1])]
    if missing:
        raise PipelineSetupError(
            f"{type(model).__name__} has no {', '.join(missing)}: causal_lm_stages splits "
            "causal LMs of the Llama layout (model.embed_tokens, model.layers, "
            "model.rotary_emb, model.norm, lm_head); split other models by hand")
    assert inner is not None
    config: Any = model.config  # Any: transformers is untyped
    if getattr(config, "sliding_window", None) is not None and getattr(
            config, "use_sliding_window", True):
        raise PipelineSetupError(
            f"{type(model).__name__} attends within a sliding window (config.sliding_window="
            f"{config.sliding_window}); its stages would build the full causal mask: set "
            "config.sliding_window = None where no sequence is longer than the window, or "
            "split the model by hand")
    head, embed = getattr(model, "lm_head"), inner.embed_tokens
    if num_stages > 1 and getattr(head, "weight", None) is getattr(embed, "weight", 1):
        raise PipelineSetupError(
            f"{type(model).__name__} ties its head to its embedding (tie_word_embeddings), "
            "which sit on the first and last stages: untie them (build with "
            "tie_word_embeddings=False), or sum the shared weight's gradient across the two "
            "ranks yourself (pipeswap.runtime.models.tied)")
    blocks = list(inner.layers)
    if layers_per_stage is None:
        if not 1 <= num_stages <= len(blocks):
            raise PipelineSetupError(
                f"{num_stages} stages for {len(blocks)} decoder layers: give 1 to "
                f"{len(blocks)} stages (each holds at least one layer)")
        runs = even_runs(len(blocks), num_stages)
    else:
        counts = list(layers_per_stage)
        if len(counts) != num_stages or sum(counts) != len(blocks) or min(counts) < 1:
            raise PipelineSetupError(
                f"layers_per_stage={counts} must give each of the {num_stages} stages at "
                f"least one layer and {len(blocks)} in all")
        starts = [sum(counts[:k]) for k in range(num_stages)]
        runs = [range(start, start + count) for start, count in zip(starts, counts)]
    last = num_stages - 1
    return [CausalLMStage(config, inner.rotary_emb, [blocks[k] for k in run],
                          embed=embed if index == 0 else None,
                          norm=inner.norm if index == last else None,
                          head=head if index == last else None)
            for index, run in enumerate(runs)]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The next-token loss of a microbatch: the logits at each position against the label
    one position on (``labels`` as the model's ``input_ids``, ignored where -100), averaged
    over the tokens, in float32 as transformers computes it."""
    shifted = logits[:, :-1, :].float()
    return torch.nn.functional.cross_entropy(shifted.flatten(0, 1), labels[:, 1:].flatten(),
                                             ignore_index=-100)
