"""Stages that pass dicts and tuples of tensors (gradient-carrying, integer, and floating ones
that carry no gradient) on real gloo ranks, with a whole backward and with the zero-bubble
split one: every loss and gradient equals the unsplit model's, swap changes no bit, and each
send or receive of several tensors is one batched transfer."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from pipeswap_pool import POOL

pytestmark = pytest.mark.multiprocess  # full tier only, unless also marked everyday

SCHEDULES = ["interleaved-1f1b", "zbv"]  # zbv: I/W split, and a local hand-over on rank 1


@functools.lru_cache(maxsize=None)
def _run(schedule: str, swap: bool) -> list[dict[str, Any]]:
    from pipeswap_pytree_workers import train

    results: list[dict[str, Any]] = POOL.run(train, 2, schedule, swap, timeout_s=60)
    return results


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pytrees_cross_stages_with_the_unsplit_models_numbers(schedule: str) -> None:
    from pipeswap_pytree_workers import MICRO, reference

    want_loss, want_grads = reference()
    ranks = _run(schedule, False)
    losses = [loss for rank in ranks for loss in rank["losses"]]
    assert len(losses) == MICRO
    assert sum(losses) / MICRO == pytest.approx(want_loss, rel=1e-6)
    grads = {name: grad for rank in ranks for name, grad in rank["grads"].items()}
    assert grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-7)
    for rank in ranks:  # one batched call per send or receive, several tensors or one
        assert rank["batch_calls"] == rank["p2p_steps"] and rank["batched_steps"] > 0, rank


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_swap_changes_no_bit_with_pytree_boundaries(schedule: str) -> None:
    plain, swapped = _run(schedule, False), _run(schedule, True)
    assert any(rank["swapped"] for rank in swapped)
    for a, b in zip(plain, swapped):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["grads"][name], b["grads"][name]) for name in a["grads"])
        assert b["groups_alive"] == 0
