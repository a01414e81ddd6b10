"""Train a Hugging Face Llama across pipeline ranks with pipeswap, activations swapped to host,
through PyTorch's own pipelining API (``pip install 'pipeswap-runtime[hf]'``).

    torchrun --nproc-per-node 2 examples/hf_llama.py
    torchrun --nproc-per-node 2 examples/hf_llama.py --schedule ScheduleZBVZeroBubble
    torchrun --nproc-per-node 2 examples/hf_llama.py --device cuda

The model is built from a config (nothing is downloaded; load your checkpoint with
``from_pretrained`` instead) and split with ``pipeswap.runtime.models.hf.causal_lm_stages``: the
embedding and the first decoder layers on the first stage, the norm and head on the last,
the decoder layers as each stage's streamed layers. The stages are PyTorch's
``PipelineStage`` objects and the schedule is PyTorch's class by name: the one line that
differs from a script for ``torch.distributed.pipelining`` is the import of the schedule.
"""

from __future__ import annotations

import argparse
import logging

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

import pipeswap.runtime.pipelining as schedules  # was: torch.distributed.pipelining
from pipeswap.runtime.models.hf import causal_lm_loss, causal_lm_stages
from pipeswap.runtime.distributed.launch import backend_for

V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
MULTI = ("ScheduleInterleaved1F1B", "ScheduleLoopedBFS", "ScheduleInterleavedZeroBubble")


def batch(step: int, size: int, length: int, vocab: int, device: torch.device) -> torch.Tensor:
    """Token ids that count up modulo ``vocab`` from a random start: learnable at a glance.
    The same on every rank; the loss compares each position with the next."""
    generator = torch.Generator().manual_seed(step)
    start = torch.randint(0, vocab, (size, 1), generator=generator)
    return ((start + torch.arange(length)) % vocab).to(device)


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", default="Schedule1F1B",
                        choices=["ScheduleGPipe", "Schedule1F1B", *MULTI, *V_SHAPED])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (one GPU per rank)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # what swap leaves, once

    dist.init_process_group(backend_for(args.device))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # the same weights on every rank
    vocab = 64
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)).to(device)
    # PyTorch's placement: stage r on rank r; looped (r, r + P); or a V (r, 2P - 1 - r)
    count = world if args.schedule in ("ScheduleGPipe", "Schedule1F1B") else 2 * world
    mine = ([rank] if count == world else [rank, 2 * world - 1 - rank]
            if args.schedule in V_SHAPED else [rank, rank + world])
    modules = causal_lm_stages(model, count)
    stages = [PipelineStage(modules[index], index, count, device) for index in mine]
    schedule = getattr(schedules, args.schedule)(
        stages if len(stages) > 1 else stages[0], n_microbatches=args.microbatches,
        loss_fn=causal_lm_loss, swap=True)
    parameters = [p for module in (modules[index] for index in mine) for p in module.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=3e-3)

    for step in range(1, args.steps + 1):
        ids = batch(step, 2 * args.microbatches, 16, vocab, device)
        optimizer.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        schedule.step(ids if 0 in mine else None, target=ids if count - 1 in mine else None,
                      losses=losses)
        optimizer.step()
        if losses:  # on the rank of the last stage
            print(f"step {step}: loss {torch.stack(losses).mean().item():.4f}", flush=True)
    report = schedule.report
    line = (f"rank {rank}: {report.swapped_chunks} chunks swapped, "
            f"{report.bytes_offloaded} bytes offloaded")
    lines: list[object] = [None] * world
    dist.all_gather_object(lines, line)
    if rank == 0:
        print("\n".join(str(each) for each in lines), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
