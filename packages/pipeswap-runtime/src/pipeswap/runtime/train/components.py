"""The parts a rank trains: the model's stage modules, this rank's pipeline stages (sharded
with FSDP2 when asked), the parameters stages share, and what a replayed rank needs.

Every function builds from the config alone, so each rank (and a replay) gets the same
weights for one seed; modules that only inform a plan are built on the meta device.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

from pipeswap.runtime.executor.microbatch import split_tree
from pipeswap.runtime.executor.replay import Replay, input_boundaries, materialize
from pipeswap.runtime.executor.sharded_stage import shard_stage
from pipeswap.runtime.executor.stage import PipelineStage
from pipeswap.runtime.train.config import TrainConfig
from pipeswap.swap import find_layers

if TYPE_CHECKING:
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    from pipeswap.runtime.models.llama import LlamaConfig, TiedParameter


def build_stage_modules(config: TrainConfig, vocab: int,
                        device: torch.device | str | None = None) -> list[torch.nn.Module]:
    """Every stage's module of a freshly built ``config.model``, on ``device``."""
    if config.model.family == "llama":
        from pipeswap.runtime.models.llama import build_llama, split_layers

        llama = build_llama(_llama_config(config, vocab), config.training.seed)
        return list(split_layers(llama.to(device), config.num_stages))
    from pipeswap.runtime.models.gpt import GPTConfig, build_gpt, split_stages

    gpt = GPTConfig(vocab=vocab, seq_len=config.model.seq_len, width=config.model.width,
                    heads=config.model.heads, layers=config.num_layers)
    return list(split_stages(build_gpt(gpt, config.training.seed).to(device),
                             config.num_stages))


def build_stages(config: TrainConfig, vocab: int, placement: tuple[int, ...], pp_rank: int,
                 mesh: DeviceMesh | None, device: torch.device) -> list[PipelineStage]:
    """This rank's pipeline stages of a freshly built model (the others are freed on return),
    each sharded with FSDP2 over the mesh's data-parallel dimension with ``fsdp``: every
    transformer block apart, the embedding and head with the stage's root."""

    modules = build_stage_modules(config, vocab, device)
    group = None if mesh is None else mesh.get_group("pp")
    stages = []
    for index, module in enumerate(modules):
        if placement[index] != pp_rank:
            continue
        if config.parallel.fsdp:
            assert mesh is not None  # fsdp lays the ranks out on a mesh
            shard_stage(module, mesh["dp"], _blocks(module))
        stages.append(PipelineStage(module, index, config.num_stages, group))
    return stages


def stage_layer_counts(config: TrainConfig, vocab: int) -> dict[int, int]:
    """Each stage's layer count as the stages built for ``config`` have them (see
    :attr:`PipelineStage.layers`), without building them."""
    import torch


    with torch.device("meta"):
        stages = build_stage_modules(config, vocab)
    return {index: len(find_layers(module)) for index, module in enumerate(stages)}


def tied_parameters(config: TrainConfig, vocab: int) -> list[TiedParameter]:
    """The parameters the whole model's stages share (a tied embedding), found on a copy
    built on the meta device (no memory)."""
    import torch

    from pipeswap.runtime.models.llama import build_llama, split_layers, tied_parameter_names

    if not config.model.tie_embeddings:
        return []
    with torch.device("meta"):
        model = build_llama(_llama_config(config, vocab), config.training.seed)
    return tied_parameter_names(split_layers(model, config.num_stages))


def replay_of(config: TrainConfig, vocab: int, placement: tuple[int, ...],
              layer_counts: Mapping[int, int], inputs: torch.Tensor, device: torch.device
              ) -> Replay:
    """What the executor needs to replay ``config.job.replay_rank``: every stage's layer
    count (``layer_counts``) and what crosses into its stages from other ranks, found by dry
    runs of the stages before them on one microbatch of ``inputs``, each stage built on
    ``device`` alone and dropped after."""
    import torch


    rank = config.job.replay_rank
    assert rank is not None
    with torch.device("meta"):
        pending = dict(enumerate(build_stage_modules(config, vocab)))

    def build(index: int) -> PipelineStage:
        return PipelineStage(materialize(pending.pop(index), device), index, config.num_stages)

    def autocast() -> AbstractContextManager[object]:
        if config.model.dtype != "bf16":
            return nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)

    example = split_tree(inputs, config.parallel.microbatches, "inputs")[0]
    boundaries = input_boundaries(placement, rank, example, build, device, autocast)
    return Replay(rank, config.parallel.ranks, layer_counts, boundaries,
                  seed=config.training.seed)


def replay_stages(config: TrainConfig, vocab: int, placement: tuple[int, ...],
                  device: torch.device) -> list[PipelineStage]:
    """The replayed rank's stages alone, built on the meta device and given memory on
    ``device`` (fresh weights, the same for one seed: a replay measures memory and time, not
    a run's losses)."""
    import torch


    seed = config.training.seed
    with torch.device("meta"):
        mine = {index: module for index, module in enumerate(build_stage_modules(config, vocab))
                if placement[index] == config.job.replay_rank}
    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device.index or 0],
                               device_type="cuda" if device.type == "cpu" else device.type):
        torch.default_generator.manual_seed(seed)
        if device.type != "cpu":
            torch.get_device_module(device.type).manual_seed(seed)  # its current device
        # together, so that a weight two of them share (a tied embedding) stays one
        materialize(torch.nn.ModuleList(mine.values()), device)
    return [PipelineStage(module, index, config.num_stages) for index, module in mine.items()]


def _llama_config(config: TrainConfig, vocab: int) -> LlamaConfig:
    from pipeswap.runtime.models.llama import LlamaConfig

    model = config.model
    heads = model.heads
    kv_heads = model.kv_heads or (heads // 2 if heads % 2 == 0 else heads)
    return LlamaConfig(vocab=vocab, seq_len=model.seq_len, dim=model.width,
                       layers=config.num_layers, heads=heads, kv_heads=kv_heads,
                       ffn_dim=model.ffn, tie_embeddings=model.tie_embeddings)


def _blocks(stage: torch.nn.Module) -> list[torch.nn.Module]:
    """A stage's transformer blocks, or the GPT's sublayers (each gets FSDP's all-gathers of
    its own)."""
    from pipeswap.runtime.models.llama import Block as LlamaBlock
    from pipeswap.runtime.models.gpt import SUBLAYERS

    return [m for m in stage.modules() if isinstance(m, (*SUBLAYERS, LlamaBlock))]
