"""Fault injection over real gloo groups: a stage fails at every forward and every backward
of one rank in turn (1F1B, 4 ranks, 8 microbatches, with swap). Every rank must fail that
step within seconds (the failing rank with its own error, the others naming it), leave no swap
group or host buffer behind, and after ``recover()`` run a step equal bit for bit to one that
never failed."""

from __future__ import annotations

import functools

import pytest

from pipeswap.runtime import spawn
from pipeswap_e2e_workers import fault_injection

pytestmark = pytest.mark.multiprocess  # full tier only, unless also marked everyday

RANKS, MICROBATCHES, FAILING = 4, 8, 1
TIMEOUT_S = 60.0  # what each peer would wait without the failure being passed on


@functools.lru_cache(maxsize=None)
def _results() -> list[dict[str, object]]:
    results: list[dict[str, object]] = spawn(fault_injection, RANKS, FAILING, MICROBATCHES,
                                             timeout_s=TIMEOUT_S)
    return results


def test_every_rank_fails_promptly_names_the_failed_rank_and_recovers_exactly() -> None:
    results = _results()
    assert all(result["swapped"] for result in results[:2])  # swap really ran on ranks 0-1
    for rank, result in enumerate(results):
        cases = result["cases"]
        assert isinstance(cases, list) and len(cases) == 2 * MICROBATCHES
        for case in cases:
            where = f"rank {rank}, failure in {case['case']}"
            if rank == FAILING:
                assert case["outcome"].startswith("own: injected failure"), where
            else:
                assert case["outcome"].startswith(f"peer {FAILING}: rank {rank} stopped at"), where
                assert f"rank {FAILING} failed at" in case["outcome"], where
                assert "injected failure" in case["outcome"], where
            assert case["seconds"] < TIMEOUT_S / 4, where  # told at once, not at the timeout
            assert case["leftovers"] == (0, 0), where  # no swap group, no host buffer
            assert case["losses_equal"] and case["grads_equal"], where
