"""The bundled text corpus (no download), a character vocabulary, and reproducible batches."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources

import torch


@dataclass(frozen=True)
class Corpus:
    text: str
    vocab: tuple[str, ...]

    @staticmethod
    def bundled() -> Corpus:
        text = resources.files("pipeswap.runtime.models").joinpath("corpus.txt").read_text("utf-8")
        return Corpus(text, tuple(sorted(set(text))))

    def encode(self) -> torch.Tensor:
        index = {ch: i for i, ch in enumerate(self.vocab)}
        return torch.tensor([index[ch] for ch in self.text], dtype=torch.int64)


def batches(ids: torch.Tensor, batch_size: int, seq_len: int, steps: int, seed: int
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` (inputs, next-token targets) pairs of random windows, each made when it is
    asked for (a long run holds one batch at a time); the same on every rank for one seed."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=generator)
        windows = torch.stack([ids[s:s + seq_len + 1] for s in starts.tolist()])
        yield windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
