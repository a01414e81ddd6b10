"""A Llama with its input embedding and output layer tied, split over pipeline ranks: the
first and the last stage each compute their use's gradient, and their ranks sum them, so
both copies get the unsplit model's gradient of the one weight (and, on a V-shaped schedule
where one rank runs both stages, the one parameter object gets it from autograd)."""

from __future__ import annotations


import pytest
import torch

from pipeswap.runtime.models.data import Corpus, batches
from pipeswap.runtime.models.llama import LlamaConfig, build_llama
from pipeswap.runtime.models.gpt import lm_loss
from pipeswap.runtime.train import TrainConfig, run_rank
from pipeswap_pool import POOL

pytestmark = pytest.mark.multiprocess  # full tier only, unless also marked everyday

BASE = TrainConfig.of(family="llama", tie_embeddings=True, ranks=2, microbatches=4, steps=1,
                      batch_size=8, seq_len=16, width=32, keep_grads=True, verbose=False,
                      measure_allocator=False, modes=("no-swap",))


def _reference(config: TrainConfig) -> torch.Tensor:
    """The tied weight's gradient in the unsplit model, on the first batch, one process."""
    corpus = Corpus.bundled()
    model = build_llama(LlamaConfig(vocab=len(corpus.vocab), seq_len=config.model.seq_len,
                                    dim=config.model.width, layers=config.num_layers,
                                    tie_embeddings=True), config.training.seed)
    inputs, targets = next(batches(corpus.encode(), config.training.batch_size,
                                   config.model.seq_len, 1, config.training.seed))
    lm_loss(model(inputs), targets).backward()  # type: ignore[no-untyped-call]
    assert model.embed is not None and model.embed.weight.grad is not None
    return model.embed.weight.grad


@pytest.mark.parametrize(("schedule", "last_rank"), [("1f1b", 1), ("zbv", 0)])
def test_the_tied_weight_gets_the_unsplit_models_gradient_on_both_stages(
        schedule: str, last_rank: int) -> None:
    config = BASE.but(schedule=schedule, stages_per_rank=2 if schedule == "zbv" else 1)
    per_rank = POOL.run(run_rank, config.parallel.ranks, config, timeout_s=60)
    first = per_rank[0]["no-swap"].grads
    last = per_rank[last_rank]["no-swap"].grads
    assert first is not None and last is not None
    embed = first["0.embed.weight"]
    output = last[f"{config.num_stages - 1}.output.weight"]
    assert torch.equal(embed, output)  # summed to the same bits on both ranks
    torch.testing.assert_close(embed, _reference(config), rtol=1e-5, atol=1e-7)


def test_a_replayed_v_shaped_rank_holds_the_tied_weight_once() -> None:
    """Replayed alone (pipeswap-train --replay-rank), the rank of a V-shaped schedule that
    runs the first and the last stage builds the tied weight once, as the full run's rank
    does: by the allocator's count, its parameters take one embedding less than untied."""
    config = BASE.but(schedule="zbv", stages_per_rank=2, replay_rank=0, keep_grads=False,
                      measure_allocator=True)
    tied = run_rank(0, 1, config)["no-swap"].parameter_bytes
    untied = run_rank(0, 1, config.but(tie_embeddings=False))[
        "no-swap"].parameter_bytes
    assert tied is not None and untied is not None
    assert untied - tied == len(Corpus.bundled().vocab) * config.model.width * 4
