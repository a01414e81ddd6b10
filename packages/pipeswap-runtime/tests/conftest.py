"""Fixtures shared by the runtime package's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch.distributed as dist


@pytest.fixture
def group() -> Iterator[None]:
    """A one-rank gloo process group (the executor needs torch.distributed initialised)."""
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    yield
    dist.destroy_process_group()
