"""Both ends of every message are posted alike: NCCL pairs an operation posted inside
``batch_isend_irecv`` only with one posted the same way (the group's communicator), and one
posted alone only with one posted alone (a communicator of the two ranks), so a message
posted differently on its two ends hangs there. gloo, whose tags match anything, would not
show it; these runs record every call each rank makes instead, over the built-in schedules
and the options that change what crosses the ranks."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import cast

import pytest
from pipeswap_p2p_record import Record, recorded, train
from pipeswap_e2e_workers import (
    watched_last_device_work,
    watched_slow,
    watched_stop,
    without_cpu_backend,
)
from pipeswap_pool import POOL
from pipeswap_pytree_workers import train as pytree_train

from pipeswap.runtime import spawn
from pipeswap.runtime.train import TrainConfig

pytestmark = pytest.mark.multiprocess

SMALL = dict(steps=1, batch_size=8, seq_len=16, width=32, verbose=False,
             measure_allocator=False, microbatches=4)

FOUR_RANKS = [
    TrainConfig.of(schedule="gpipe", ranks=4, batch_p2p=True, **SMALL),
    TrainConfig.of(schedule="1f1b", ranks=4, batch_p2p=True, modes=("swap",), **SMALL),
    TrainConfig.of(schedule="interleaved-1f1b", ranks=2, dp=2, fsdp=True, stages_per_rank=2,
                   batch_p2p=True, modes=("swap",), **SMALL),
]
TWO_RANKS = [
    TrainConfig.of(schedule="interleaved-1f1b", ranks=2, stages_per_rank=2, overlap_b_f=True,
                   dxdw_split=True, batch_p2p=True, modes=("swap",), **SMALL),
    TrainConfig.of(schedule="looped-bfs", ranks=2, stages_per_rank=2, batch_p2p=True,
                   modes=("swap",), **SMALL),
    TrainConfig.of(schedule="interleaved-zb", ranks=2, stages_per_rank=2, batch_p2p=True,
                   modes=("swap",), **SMALL),
    TrainConfig.of(schedule="zbv", ranks=2, stages_per_rank=2, batch_p2p=True, modes=("swap",), **SMALL),
    TrainConfig.of(schedule="dualpipev", ranks=2, stages_per_rank=2, batch_p2p=True, modes=("swap",), **SMALL),
]


def mismatches(ranks: list[list[Record]]) -> list[str]:
    """Each message whose two ends were not posted alike, or that has one end only."""
    ends: dict[tuple[str, int, int, int], list[Counter[str]]] = defaultdict(
        lambda: [Counter(), Counter()])
    for rank, records in enumerate(ranks):
        for group, src, dst, tag, kind in records:
            ends[group, src, dst, tag][rank == dst][kind] += 1
    return [f"{src}->{dst} tag {tag} in {group}: sent {dict(sent)}, received {dict(got)}"
            for (group, src, dst, tag), (sent, got) in sorted(ends.items()) if sent != got]


@pytest.mark.parametrize(("world", "configs"), [
    pytest.param(4, FOUR_RANKS, id="4-ranks"),
    pytest.param(2, TWO_RANKS, id="2-ranks", marks=pytest.mark.everyday),  # a few seconds
])
def test_every_message_is_posted_alike_on_both_ends(world: int,
                                                    configs: list[TrainConfig]) -> None:
    ranks = POOL.run(recorded, world, train, configs, timeout_s=120)
    assert not mismatches(ranks)
    # set-up and steps moved messages, and every one of them through a batch
    kinds = Counter(record[4] for records in ranks for record in records)
    assert kinds["batched"] > 100 and kinds["alone"] == 0, kinds


def test_multi_tensor_boundaries_post_alike() -> None:
    ranks = POOL.run(recorded, 2, pytree_train, "interleaved-1f1b", True, timeout_s=120)
    assert not mismatches(ranks)
    assert {record[4] for records in ranks for record in records} == {"batched"}


def test_the_check_sees_a_message_posted_differently() -> None:
    """A message batched on one end and alone on the other, or with one end only."""
    sent = ("g", 0, 1, 7, "batched")
    assert mismatches([[sent], [("g", 0, 1, 7, "alone")]]) == [
        "0->1 tag 7 in g: sent {'batched': 1}, received {'alone': 1}"]
    assert mismatches([[sent], []]) == ["0->1 tag 7 in g: sent {'batched': 1}, received {}"]
    assert mismatches([[sent], [sent]]) == []


def test_a_world_without_a_cpu_backend_runs() -> None:
    """Plain ``init_process_group("nccl")`` gives a group with no CPU backend, where
    pipeswap's control traffic (CPU tensors) would fail; ``cuda:gloo`` is such a group on a
    machine without a GPU. pipeswap makes gloo groups for that traffic itself."""
    first, last = spawn(without_cpu_backend, 2, backend="cuda:gloo", timeout_s=60)
    assert first["world_has_cpu"] is False
    assert first["asked"] == first["transport"] == "cuda:gloo,cpu:gloo"
    assert first["control"] == "cpu:gloo,cuda:gloo"  # gloo's own, for every device
    # the executor's two groups (transport, CPU control); close() frees accelerator groups
    assert first["groups"] == last["groups"] == [(1, 3, 3), (3, 5, 5)]
    plain, swapped = cast("list[tuple[float, ...]]", last["losses"])  # the last stage's
    assert len(plain) == 4 and plain == swapped


def test_a_watched_rank_names_the_peer_that_stopped() -> None:
    """With ``failure_timeout_s``, a watch follows the peers' beats: a rank that stops
    (SIGSTOP) mid-step is named by its peer's error within about the timeout. (On NCCL the
    watch also aborts the communicators; see test_runtime_watch for that path.)"""
    first, second = POOL.run(watched_stop, 2, 1.0, timeout_s=60)
    assert str(first["operation_timeout"]) == "0:30:00"  # long: the watch finds the silent
    assert first["failed_rank"] == 1, first
    assert "rank 1 stopped answering" in cast(str, first["error"])
    assert 1.0 <= cast(float, first["seconds"]) < 10.0
    assert "rank 1 stopped answering" in cast(str, second["error"])  # told once it went on


def test_a_slow_but_healthy_rank_never_fails_the_step() -> None:
    """A watched rank whose forward takes twice the failure timeout still beats: its
    neighbour waits for it (the group's own timeout is long) and the step finishes."""
    first, last = POOL.run(watched_slow, 2, 0.5, timeout_s=60)
    assert first["operation_timeout_s"] == last["operation_timeout_s"] == 1800
    assert len(cast("list[float]", last["losses"])) == 1
    assert cast(float, first["seconds"]) >= 1.0  # it did wait past the timeout


def test_the_watch_stays_armed_through_the_steps_last_device_work() -> None:
    """A neighbour lost after the end-of-step agreement, while this rank's last kernel still
    waits for it (a stand-in that only the groups' stop releases): the watch is armed until
    that work is done, finds the silence, releases it, and the step fails naming the rank."""
    first, second = POOL.run(watched_last_device_work, 2, 0.5, timeout_s=60)
    assert first["failed_rank"] == 1, first
    assert "rank 1 stopped answering" in cast(str, first["error"])
    assert "last device work" in cast(str, first["error"])
    assert cast(float, first["seconds"]) < 8.0  # not the stand-in kernel's own 10 s limit
    assert second["error"] is None
