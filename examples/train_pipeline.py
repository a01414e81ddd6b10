"""Train your own model across pipeline ranks with pipeswap, activations swapped to host.

    torchrun --nproc-per-node 2 examples/train_pipeline.py
    torchrun --nproc-per-node 4 examples/train_pipeline.py --schedule 1f1b
    torchrun --nproc-per-node 2 examples/train_pipeline.py --device cuda

Copy it and put your model in place of ``TinyLM``. What pipeswap needs from a model: its
blocks in an ``nn.ModuleList`` (or ``nn.ModuleDict``) attribute, and a forward that skips the
parts a stage does not hold (``split_layers`` sets them to None). Every rank builds the whole
model from the same seed and keeps its own stages.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch import nn

from pipeswap.runtime import PipelineExecutor, PipelineStage
from pipeswap.runtime.distributed.launch import backend_for
from pipeswap.runtime.models.llama import split_layers
from pipeswap.schedule import ScheduleKind, ScheduleSpec, build_schedule


class Block(nn.Module):
    """A residual MLP block: the unit the pipeline splits on."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(self.norm(x))))
        return out


class TinyLM(nn.Module):
    """Embedding, blocks, head; a stage holds some blocks and maybe the ends."""

    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed: nn.Embedding | None = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head: nn.Linear | None = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.layers:
            x = block(x)
        return x if self.head is None else self.head(x)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(step: int, size: int, length: int, vocab: int, device: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up modulo ``vocab`` from a random start: learnable at a glance.
    The same on every rank (only the first stage's rank reads inputs, the last's targets)."""
    generator = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (size, 1), generator=generator)
    tokens = (start + torch.arange(length + 1)) % vocab
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="interleaved-1f1b",
                        choices=[k.value for k in ScheduleKind])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank)")
    args = parser.parse_args()

    dist.init_process_group(backend_for(args.device))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)

    # The schedule decides which stages each rank runs (two a rank for interleaved ones).
    per_rank = 1 if args.schedule in ("gpipe", "1f1b") else 2
    spec = ScheduleSpec(ScheduleKind(args.schedule), ranks=world,
                        microbatches=args.microbatches, stages_per_rank=per_rank)
    placement = build_schedule(spec).stage_ranks
    torch.manual_seed(0)  # the same weights on every rank
    vocab, dim = 32, 64
    modules = split_layers(TinyLM(vocab, dim, layers=2 * len(placement)), len(placement),
                           first=("embed",), last=("head",))
    stages = [PipelineStage(module.to(device), index, len(placement))
              for index, module in enumerate(modules) if placement[index] == rank]
    executor = PipelineExecutor(stages, spec, args.microbatches, loss_fn, swap=True)
    optimizer = torch.optim.AdamW([p for s in stages for p in s.module.parameters()], lr=1e-2)

    for step in range(1, args.steps + 1):
        inputs, targets = batch(step, 4 * args.microbatches, 16, vocab, device)
        optimizer.zero_grad(set_to_none=True)
        report = executor.step(inputs, targets)
        optimizer.step()
        if report.losses:  # on the rank of the last stage
            print(f"step {step}: loss {sum(report.losses) / len(report.losses):.4f}, "
                  f"{report.seconds * 1e3:.0f} ms", flush=True)
    # The last step's swap, per rank (the default policy swaps only where the peak drops).
    # Rank 0 prints every rank's line so that output from several processes never interleaves.
    line = (f"rank {rank}: {report.swapped_chunks} chunks swapped, "
            f"{report.bytes_offloaded} bytes offloaded, peak of saved activations "
            f"{report.peak_activation_bytes} bytes")
    lines: list[object] = [None] * world
    dist.all_gather_object(lines, line)
    if rank == 0:
        print("\n".join(str(each) for each in lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
