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


def model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def reference() -> dict[str, torch.Tensor]:
    """The unsplit model's gradients of the mean microbatch loss."""
    whole, ids = model(), tokens()
    for micro in ids.chunk(MICRO):
        loss: torch.Tensor = causal_lm_loss(whole(micro).logits, micro) / MICRO
        loss.backward()  # type: ignore[no-untyped-call]
    return {name: p.grad for name, p in whole.named_parameters() if p.grad is not None}


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
