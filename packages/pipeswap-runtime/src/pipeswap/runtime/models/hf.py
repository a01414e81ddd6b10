"""Hugging Face causal language models split into pipeline stages (``pipeswap-runtime[hf]``).

A transformers causal LM whose decoder is a layer list (``model.embed_tokens``,
``model.layers``, ``model.rotary_emb``, ``model.norm``, ``lm_head``: Llama, Qwen 2 and 3,
Mistral, Phi-3, OLMo 2, Gemma 3, Mixtral, Qwen 3 MoE and models built like them;
transformers 5.25 or later) is split into stage modules that run exactly what the unsplit
model runs on a batch without padding: the first stage embeds the tokens, each stage runs
its run of decoder layers, the last normalises, projects to the vocabulary (and caps the
logits where the model does). Between stages goes only the hidden state (and, for a
mixture-of-experts model asked for its router loss, the routing sums: below). Each stage works
out the rotary tables and the attention masks itself, from the hidden state's shape, as
the unsplit model does once: each layer gets the mask of its kind (full causal, or within
the sliding window, as the config's ``layer_types`` or ``sliding_window`` say) and, where
the model keeps one rotary table per kind (Gemma 3), that kind's table. They hold no
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

The router loss: a mixture-of-experts model whose config sets ``output_router_logits`` adds
``router_aux_loss_coef`` times a load-balancing loss to its language-model loss. That loss is
a product of two means over every routed layer of the model (the share of top-k choices
each expert got, and its mean router probability), so no stage can compute its own part.
transformers sums both layer by layer before dividing; the stages carry the two running sums
(one number per expert each) forward with the hidden state, each adding its own layers', and
the last stage makes the loss from them. The sums are the unsplit model's to the bit (the
same additions in the same order), and the router's gradient flows back through the
probability sums. The last stage then returns ``(logits, weighted router loss)``, which
:func:`causal_lm_loss` adds to the language-model loss as the unsplit model does.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pipeswap.runtime.errors import PipelineSetupError
from pipeswap.runtime.models.gpt import even_runs

__all__ = ["CausalLMStage", "RouterLoss", "causal_lm_stages", "causal_lm_loss"]

#: The kinds of attention the stages mask, as transformers names a layer's.
_MASKED = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class RouterLoss:
    """A mixture-of-experts model's load-balancing loss, as its stages add it: the module
    class whose output ``index`` is a layer's router logits, the experts and how many each
    token picks, the loss's weight, and how many routed layers the whole model has (the
    means divide by every layer's rows)."""

    router: type[torch.nn.Module]
    index: int
    experts: int
    top_k: int
    coefficient: float
    layers: int

    def add(self, sums: tuple[torch.Tensor, torch.Tensor], logits: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The running (choices, probabilities) per expert with one layer's router logits
        added, as transformers adds them (counted in float32 where it counts so)."""
        choices, probs = sums
        weights = torch.nn.functional.softmax(logits, dim=-1)
        _, chosen = torch.topk(weights, self.top_k, dim=-1)
        counting = torch.float32 if logits.device.type in ("cpu", "mps") else torch.int32
        choices = choices + torch.histc(chosen.reshape(-1).to(counting), bins=self.experts,
                                        min=0, max=self.experts)
        return choices, probs + weights.float().sum(dim=0)

    def loss(self, sums: tuple[torch.Tensor, torch.Tensor], rows: int) -> torch.Tensor:
        """The weighted loss of a microbatch of ``rows`` tokens from the whole model's sums."""
        choices, probs = sums
        total = float(self.layers * rows)
        shares = choices / total
        balance = torch.sum(shares * (probs / total).unsqueeze(0)) * self.experts
        return self.coefficient * balance


class CausalLMStage(torch.nn.Module):
    """One stage of a causal LM: the embedding (first stage), a run of decoder layers, the
    final norm and head (last stage). Takes token ids (first stage) or the hidden state, and
    returns the hidden state, or the logits on the last stage. With ``routing``, the routing
    sums travel after the hidden state, and the last stage returns ``(logits, router
    loss)``."""

    def __init__(self, config: Any,  # Any: a transformers config (untyped)
                 rotary: torch.nn.Module, layers: Sequence[torch.nn.Module],
                 embed: torch.nn.Module | None = None, norm: torch.nn.Module | None = None,
                 head: torch.nn.Module | None = None,
                 layer_types: Sequence[str] | None = None,
                 routing: RouterLoss | None = None) -> None:
        super().__init__()
        self.routing = routing
        self.config = config
        self.embed_tokens = embed
        self.rotary_emb = rotary
        self.layers = torch.nn.ModuleList(layers)
        self.norm = norm
        self.lm_head = head
        # each layer's attention: full causal, or within the sliding window
        self.layer_types = tuple(layer_types or ("full_attention",) * len(layers))

    def forward(self, x: torch.Tensor, *sums: torch.Tensor
                ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        if self.routing is None:
            return self._decode(hidden, [])
        logits: list[torch.Tensor] = []
        hidden = self._decode(hidden, logits)
        running = (sums[0], sums[1]) if sums else (
            torch.zeros(self.routing.experts, dtype=torch.float32, device=hidden.device),
            torch.zeros(self.routing.experts, dtype=torch.float32, device=hidden.device))
        for made in logits:
            running = self.routing.add(running, made)
        if self.lm_head is not None:
            return hidden, self.routing.loss(running, x.shape[0] * x.shape[1])
        return (hidden, *running)

    def _decode(self, hidden: torch.Tensor, routed: list[torch.Tensor]) -> torch.Tensor:
        """The stage's layers, norm and head on ``hidden``; each router's logits appended
        to ``routed`` as its layer makes them (hooked for this call only: a recompute in
        backward makes them again, and they must not count twice)."""
        routing = self.routing

        def record(_module: torch.nn.Module, _args: object, out: object) -> None:
            assert routing is not None
            made = out[routing.index] if isinstance(out, tuple) else out
            assert isinstance(made, torch.Tensor)
            routed.append(made)

        hooks = [module.register_forward_hook(record) for module in self.layers.modules()
                 if routing is not None and isinstance(module, routing.router)]
        try:
            return self._layers(hidden)
        finally:
            for hook in hooks:
                hook.remove()

    def _layers(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        kinds = set(self.layer_types)
        masks = {kind: _mask_of(kind)(config=self.config, inputs_embeds=hidden,
                                      attention_mask=None, cache=None, position_ids=positions)
                 for kind in kinds}
        # a rotary of one table per attention kind (Gemma 3's) is asked for each kind
        by_kind = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        tables = {kind: self.rotary_emb(hidden, positions, kind) if by_kind
                  else self.rotary_emb(hidden, position_ids=positions) for kind in kinds}
        for layer, kind in zip(self.layers, self.layer_types):
            out = layer(hidden, attention_mask=masks[kind], position_embeddings=tables[kind],
                        position_ids=positions)
            hidden = out[0] if isinstance(out, tuple) else out  # transformers 4: a tuple
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.lm_head is not None:
            hidden = self.lm_head(hidden)
            cap = getattr(self.config, "final_logit_softcapping", None)
            if cap is not None:  # as the unsplit model does after its head (Gemma's)
                hidden = torch.tanh(hidden / cap) * cap
        return hidden


def causal_lm_stages(model: torch.nn.Module, num_stages: int,
                     layers_per_stage: Sequence[int] | None = None) -> list[CausalLMStage]:
    """``model`` (a transformers causal LM of the Llama layout) as ``num_stages`` stage
    modules: the decoder layers split evenly (the earlier stages taking the extra ones), or
    ``layers_per_stage`` a stage; every stage holds at least one layer. Refused: a model
    whose layers attend otherwise than causally (in full or within a sliding window, as the
    config's ``layer_types`` or ``sliding_window`` say: each stage masks its own layers so).
    A head tied to the embedding (``tie_word_embeddings``) stays one parameter object on
    the first and the last stage: across ranks each computes its own use's gradient, which
    :class:`~pipeswap.runtime.models.tied.TiedGradients` sums (find the pair with
    :func:`~pipeswap.runtime.models.llama.tied_parameter_names` on every stage module).
    A mixture-of-experts model whose config sets ``output_router_logits`` gets its router
    loss (:class:`RouterLoss`)."""
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
    types = _layer_types(type(model).__name__, config, len(inner.layers))
    head, embed = getattr(model, "lm_head"), inner.embed_tokens
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
    routing = _router_loss(model, inner)
    return [CausalLMStage(config, inner.rotary_emb, [blocks[k] for k in run],
                          embed=embed if index == 0 else None,
                          norm=inner.norm if index == last else None,
                          head=head if index == last else None,
                          layer_types=[types[k] for k in run], routing=routing)
            for index, run in enumerate(runs)]


def _router_loss(model: Any, inner: Any  # Any: transformers is untyped
                 ) -> RouterLoss | None:
    """The router loss the unsplit model adds, where its config asks for one
    (``output_router_logits``): the router module as transformers records its logits, and
    the loss's constants as the model holds them. Refused: a model that asks for the loss
    but does not say how its routers are found."""
    if not getattr(model.config, "output_router_logits", False):
        return None
    recorded = getattr(inner, "_can_record_outputs", None) or {}
    recorder = recorded.get("router_logits")
    experts, top_k, coefficient = (getattr(model, name, None) for name in
                                   ("num_experts", "num_experts_per_tok",
                                    "router_aux_loss_coef"))
    router = getattr(recorder, "target_class", None)
    if (router is None or experts is None or top_k is None or coefficient is None
            or getattr(recorder, "layer_name", None)):
        raise PipelineSetupError(
            f"{type(model).__name__} asks for its router loss (output_router_logits), but "
            "the stages cannot find its routers' logits or the loss's constants "
            "(num_experts, num_experts_per_tok, router_aux_loss_coef): set "
            "config.output_router_logits = False, or split the model by hand")
    layers = sum(isinstance(module, router) for module in inner.layers.modules())
    return RouterLoss(router, int(getattr(recorder, "index", 0)), int(experts), int(top_k),
                      float(coefficient), layers)


def _mask_of(kind: str) -> Callable[..., torch.Tensor | None]:
    """transformers' mask function of a kind of attention (imported here: the [hf] extra)."""
    from transformers.masking_utils import (
        create_causal_mask,
        create_sliding_window_causal_mask,
    )

    made: Callable[..., torch.Tensor | None] = (
        create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask)
    return made


def _layer_types(name: str, config: Any,  # Any: a transformers config (untyped)
                 count: int) -> list[str]:
    """Each decoder layer's attention, as the unsplit model picks its mask: the config's
    ``layer_types`` (Gemma 3 mixes sliding and global layers), else every layer sliding
    where the config has a window (Mistral's), else full causal attention. Refused: a kind
    of attention the stages do not mask, and bidirectional attention."""
    given = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None) is not None and getattr(
        config, "use_sliding_window", True)
    types = (list(given)[:count] if given else
             ["sliding_attention" if window else "full_attention"] * count)
    unknown = sorted(set(types) - set(_MASKED))
    if unknown or getattr(config, "use_bidirectional_attention", False):
        raise PipelineSetupError(
            f"{name}'s layers attend as {', '.join(unknown) or 'bidirectional attention'}, "
            f"which the stages cannot mask (they make {' and '.join(_MASKED)} masks): split "
            "the model by hand")
    return types


def causal_lm_loss(output: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
                   labels: torch.Tensor) -> torch.Tensor:
    """The next-token loss of a microbatch: the logits at each position against the label
    one position on (``labels`` as the model's ``input_ids``, ignored where -100), averaged
    over the tokens, in float32 as transformers computes it; plus the router loss where the
    last stage returns ``(logits, router loss)``."""
    logits, router = output if isinstance(output, tuple) else (output, None)
    shifted = logits[:, :-1, :].float()
    loss = torch.nn.functional.cross_entropy(shifted.flatten(0, 1), labels[:, 1:].flatten(),
                                             ignore_index=-100)
    return loss if router is None else loss + router.to(loss.device)
