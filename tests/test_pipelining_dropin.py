"""pipeswap behind torch.distributed.pipelining's schedule classes: every class, side by side
with PyTorch's own on the same stages' modules and weights (gloo, 2 and 4 ranks): losses,
output and gradients bit-identical to PyTorch's, without swap and with it; and one
clear error on every rank for a stage on another device, a last stage without a loss, stages
that do not match the class's layout, and a batch that does not split."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from pipeswap_pool import POOL

pytestmark = pytest.mark.multiprocess  # full tier only, unless also marked everyday

pytest.importorskip("torch.distributed.pipelining")

from pipeswap_dropin_workers import CLASSES, MICRO, ZERO_BUBBLE  # noqa: E402

EVERYDAY = {("Schedule1F1B", 2), ("ScheduleZBVZeroBubble", 2)}


@functools.lru_cache(maxsize=None)
def _ranks(name: str, world: int, scale: float | None = None) -> list[dict[str, Any]]:
    from pipeswap_dropin_workers import side_by_side

    results: list[dict[str, Any]] = POOL.run(
        side_by_side, world, name, None if scale is None else {"scale": scale},
        timeout_s=120)
    return results


def _cases() -> list[Any]:
    """Every class at 2 and 4 ranks, and one with loss_kwargs (the loss scaled by 3)."""
    return [pytest.param(name, world, None, id=f"{name}-{world}",
                         marks=[pytest.mark.everyday] if (name, world) in EVERYDAY else [])
            for world in (2, 4) for name in CLASSES] + [
        pytest.param("Schedule1F1B", 2, 3.0, id="Schedule1F1B-2-loss_kwargs")]


@pytest.mark.parametrize(("name", "world", "scale"), _cases())
def test_each_class_matches_pytorchs_and_swap_changes_no_bit(name: str, world: int,
                                                             scale: float | None) -> None:
    ranks = _ranks(name, world, scale)
    last = [rank for rank in ranks if rank["torch"]["losses"]]
    assert len(last) == 1 and len(last[0]["torch"]["losses"]) == MICRO
    for mine in ("pipeswap", "swap"):
        for rank in ranks:  # only the last stage's rank has losses and an output
            assert (rank[mine]["output"] is None) == (rank["torch"]["output"] is None)
            assert rank[mine]["grads"].keys() == rank["torch"]["grads"].keys()
    theirs, ours, swapped = (last[0][mode] for mode in ("torch", "pipeswap", "swap"))
    assert len(ours["losses"]) == len(swapped["losses"]) == MICRO
    # the same compute order, losses backpropagated unscaled and gradients divided by the
    # microbatch count afterwards, as PyTorch does: the very same numbers
    assert all(torch.equal(a, b) for a, b in zip(ours["losses"], theirs["losses"]))
    assert torch.equal(ours["output"], theirs["output"])
    for rank in ranks:
        for key, grad in rank["torch"]["grads"].items():
            assert torch.equal(rank["pipeswap"]["grads"][key], grad), key
    # swap: the very same numbers as without it, and something was swapped
    assert all(torch.equal(a, b) for a, b in zip(swapped["losses"], ours["losses"]))
    assert torch.equal(swapped["output"], ours["output"])
    for rank in ranks:
        for key, grad in rank["pipeswap"]["grads"].items():
            assert torch.equal(rank["swap"]["grads"][key], grad), key
    assert sum(rank["swap"]["swapped"] for rank in ranks) > 0
    # eval: forward only, the same losses and output as the step's (on the same weights),
    # and as PyTorch's eval where PyTorch's class runs one (its zero-bubble classes do not)
    modes = ("pipeswap", "swap") if name in ZERO_BUBBLE else ("torch", "pipeswap", "swap")
    for mode in modes:
        for rank in ranks:
            assert (rank[mode]["eval_output"] is None) == (rank is not last[0])
        mine = last[0][mode]
        assert len(mine["eval_losses"]) == MICRO
        assert torch.equal(mine["eval_output"], theirs["output"])
        if scale is None:  # eval takes no loss_kwargs (PyTorch's neither)
            assert all(torch.equal(a, b) for a, b in zip(mine["eval_losses"],
                                                         theirs["losses"]))
    if scale is not None:  # the step's loss_kwargs reached the loss function
        plain = [rank for rank in _ranks(name, world) if rank["torch"]["losses"]][0]
        for loss, unscaled in zip(ours["losses"], plain["pipeswap"]["losses"]):
            assert loss.item() == pytest.approx(scale * unscaled.item(), rel=1e-6)


@pytest.mark.parametrize(("case", "message"), [
    ("device", "stage 0 is on cuda:1 but this rank computes on cpu"),
    # a schedule without a loss function runs forward only, so every rank must say alike
    ("loss", "given different schedules or arguments (fingerprints by rank: "),
    ("loss", "this rank: Schedule1F1B(loss_fn=None, "),
    ("budget", "this rank: Schedule1F1B(loss_fn=given, scale_grads=True, budget=given, "),
    ("layout", "ScheduleZBVZeroBubble: rank 0 runs stages [0, 3] in this schedule but was "
               "given stages [0, 2]"),
    ("single", "Schedule1F1B: "),
    ("spec", "Schedule1F1B: pipeswap splits every input and merges every output along "
             "dimension 0; drop args_chunk_spec"),
    ("batch", "does not split into 8 equal microbatches"),
])
def test_bad_input_gets_one_clear_error_on_every_rank(case: str, message: str) -> None:
    from pipeswap_dropin_workers import refused

    said = POOL.run(refused, 2, case, timeout_s=60)
    assert all(text != "no error" for text in said), said
    assert any(message in text for text in said), said


def test_a_budget_is_planned_on_what_the_first_step_measured() -> None:
    """budget=: the first step runs without swap and measures each chunk; from the second
    the plan runs, holding what it predicted to the byte, under the budget (60% of what the
    first step held) where a plan can reach it and with a warning where none can, with the
    same numbers as the run with room to spare."""
    from pipeswap_dropin_workers import budgeted

    ranks = POOL.run(budgeted, 2, timeout_s=120)
    met = 0
    for rank in ranks:
        roomy, tight = rank["roomy"], rank["tight"]
        first, second = tight["steps"]
        assert first["swapped"] == 0 and second["peak"] == tight["planned"]
        if tight["planned"] <= tight["budget"]:
            met += 1
            assert second["swapped"] > 0 and second["peak"] < first["peak"]
            assert not tight["warned"]
        else:
            assert [w for w in tight["warned"] if "no plan meets the budget" in w]
        for step in (*tight["steps"], *roomy["steps"]):  # every step, the measuring one too
            assert (len(step["losses"]), step["output"] is None) == (
                (MICRO, False) if rank is ranks[-1] else (0, True))
        for mine, theirs in zip(tight["steps"], roomy["steps"]):
            assert all(torch.equal(a, b) for a, b in zip(mine["losses"], theirs["losses"]))
            assert mine["grads"].keys() == theirs["grads"].keys()
            assert all(torch.equal(mine["grads"][n], g) for n, g in theirs["grads"].items())
    assert met  # the first rank's chunks wait for their backwards: swap reaches it


def test_a_budget_sizes_chunks_whose_bytes_depend_on_the_data_as_the_largest() -> None:
    """Stages whose saved bytes follow the data (tokens dropped by a router): the plan
    under a budget sizes each stage's microbatches as its largest measured chunk and says
    so once, so the next step on the same data never holds more than the plan expected;
    losses and gradients stay bit for bit the run's without a budget."""
    from pipeswap_dropin_workers import routed_budget

    ranks = POOL.run(routed_budget, 2, timeout_s=120)
    for rank, found in enumerate(ranks):
        plain, budget = found["plain"], found["budget"]
        [varying] = budget["varying"]
        assert varying.stage == rank and varying.smallest < varying.largest
        [said] = [line for line in budget["said"] if "sizes every microbatch" in line]
        assert f"stage {rank}'s chunks measured {varying.smallest:,} to" in said
        assert plain["varying"] == ()
        assert budget["steps"][1]["peak"] <= budget["planned"].peak
        for mine, theirs in zip(budget["steps"], plain["steps"]):
            assert all(torch.equal(a, b) for a, b in zip(mine["losses"], theirs["losses"]))
            assert all(torch.equal(mine["grads"][n], g) for n, g in theirs["grads"].items())
    assert sum(found["budget"]["steps"][1]["moved"] for found in ranks) > 0


def test_sizing_for_a_plan_takes_each_stages_largest_chunk_where_they_differ() -> None:
    """Measured.at_largest: a stage whose chunks' movable bytes differ is sized as its
    largest chunk (per layer too) and named; pinned bytes alone differing (a storage
    counted where first held) change nothing."""
    from pipeswap.runtime.executor.planning import Measured, VaryingChunks

    measured = Measured({(0, 0): (120, 100), (0, 1): (100, 100),    # pinned differ alone
                         (1, 0): (60, 50), (1, 1): (90, 80), (1, 2): (70, 60)},
                        {(1, 0): (20, 40), (1, 1): (50, 40), (1, 2): (30, 40)},
                        {(1, 0): (8, 8), (1, 1): (8, 9), (1, 2): (8, 8)})
    sized, varying = measured.at_largest()
    assert varying == (VaryingChunks(1, 50, 80),)
    assert sized.chunk_bytes == {(0, 0): (120, 100), (0, 1): (100, 100),
                                 (1, 0): (90, 80), (1, 1): (90, 80), (1, 2): (90, 80)}
    assert sized.layer_held == {key: (50, 40) for key in ((1, 0), (1, 1), (1, 2))}
    assert sized.layer_inputs == {key: (8, 9) for key in ((1, 0), (1, 1), (1, 2))}
    same = Measured({(0, 0): (10, 10)}, {}, {})
    assert same.at_largest() == (same, ())


@pytest.mark.parametrize("name", ["Schedule1F1B", "ScheduleZBVZeroBubble"])
def test_keyword_arguments_reach_every_stage_as_pytorchs_classes_pass_them(name: str) -> None:
    """``step(x, shift=tensor, factor=2.0)`` on every rank: each stage is called with its
    microbatch's slice of the tensor and the number itself, as PyTorch's classes call it;
    losses, outputs and gradients bit for bit, with swap, and ``eval`` too, which leaves
    the gradients a step made as they are (PyTorch's 1F1B ``eval`` divides them by the
    microbatch count on this torch: its gradient scaling runs though no backward did)."""
    from pipeswap_dropin_workers import keyword_arguments

    ranks = POOL.run(keyword_arguments, 2, name, timeout_s=120)
    last = [rank for rank in ranks if rank["torch"]["losses"]]
    assert len(last) == 1
    theirs, ours = last[0]["torch"], last[0]["pipeswap"]
    assert len(ours["losses"]) == MICRO
    assert all(torch.equal(a, b) for a, b in zip(ours["losses"], theirs["losses"]))
    assert torch.equal(ours["output"], theirs["output"])
    assert torch.equal(ours["eval_output"], theirs["output"])
    assert all(torch.equal(a, b) for a, b in zip(ours["eval_losses"], theirs["losses"]))
    for rank in ranks:
        assert rank["pipeswap"]["grads"].keys() == rank["torch"]["grads"].keys() != set()
        for key, grad in rank["torch"]["grads"].items():
            assert torch.equal(rank["pipeswap"]["grads"][key], grad), key
            assert torch.equal(rank["pipeswap"]["grads_after_eval"][key], grad), key


@pytest.mark.parametrize("name", ["Schedule1F1B", "ScheduleInterleaved1F1B"])
def test_microbatches_given_already_split_train_as_pytorchs_classes_do(name: str) -> None:
    """``_step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses)``, the step on
    microbatches a caller split itself: the losses and gradients of PyTorch's step on the
    whole batch, bit for bit."""
    from pipeswap_dropin_workers import presplit

    ranks = POOL.run(presplit, 2, name, timeout_s=120)
    last = [rank for rank in ranks if rank["torch"]["losses"]]
    assert len(last) == 1 and len(last[0]["pipeswap"]["losses"]) == MICRO
    assert all(torch.equal(a, b) for a, b in zip(last[0]["pipeswap"]["losses"],
                                                 last[0]["torch"]["losses"]))
    for rank in ranks:
        assert rank["pipeswap"]["grads"].keys() == rank["torch"]["grads"].keys() != set()
        for key, grad in rank["torch"]["grads"].items():
            assert torch.equal(rank["pipeswap"]["grads"][key], grad), key


@pytest.mark.parametrize(("name", "swap"), [("1F1B", True), ("ZBVZeroBubble", True),
                                            ("Interleaved1F1B", False)])
def test_a_trainer_that_picks_its_schedule_by_name_gets_pipeswaps(name: str, swap: bool) -> None:
    """The calls torchtitan's ``build_pipeline_schedule`` makes (a class by name, looped or
    not by PyTorch's base class, built from PyTorch's arguments, ``step``), once with
    PyTorch's ``get_schedule_class`` and once with pipeswap's (swap bound to the class):
    the same layout, losses and gradients bit for bit, and swap happened."""
    from pipeswap_dropin_workers import by_name

    ranks = POOL.run(by_name, 2, name, swap, timeout_s=120)
    for rank in ranks:
        assert rank["pipeswap"]["looped"] == rank["torch"]["looped"]
        assert rank["pipeswap"]["grads"].keys() == rank["torch"]["grads"].keys() != set()
        for key, grad in rank["torch"]["grads"].items():
            assert torch.equal(rank["pipeswap"]["grads"][key], grad), key
        assert all(torch.equal(a, b) for a, b in zip(rank["pipeswap"]["losses"],
                                                     rank["torch"]["losses"], strict=True))
    assert any(rank["pipeswap"]["swapped"] for rank in ranks) == swap


FSDP_CLASSES = ["Schedule1F1B", "ScheduleZBVZeroBubble"]


@pytest.mark.parametrize("dp", [1, 2])
def test_stages_that_are_fsdp_roots_run_as_pytorchs_and_keep_every_gradient(dp: int) -> None:
    """Each stage's blocks and then its module ``fully_shard``ed over a data-parallel
    dimension of one (as torchtitan does) or two (four ranks, each replica its own batch),
    the last stage ending in a norm its root holds: pipeswap's gradients are the
    unpipelined model's averaged over the replicas (to rounding: the microbatches sum in
    another order), swap changes no bit, and on 1F1B they are PyTorch's bit for bit. On
    ZBV, PyTorch's class loses the last stage's block gradients and gets the middle
    stages' wrong on this torch (not asserted: PyTorch's to fix); pipeswap's are right."""
    from pipeswap_dropin_workers import fsdp_wrapped, unpipelined

    ranks = POOL.run(fsdp_wrapped, 2 * dp, FSDP_CLASSES, dp, timeout_s=180)
    for name in FSDP_CLASSES:
        count = 2 if name == "Schedule1F1B" else 4
        replicas = [unpipelined(count, normed=True, replica=k) for k in range(dp)]
        want = {key: torch.stack([r[key] for r in replicas]).sum(0) / dp
                for key in replicas[0]}
        for rank in ranks:
            mine = rank[name]["pipeswap"]
            for key, grad in mine.items():
                assert torch.allclose(grad, want[key], rtol=1e-5, atol=1e-7), (name, key)
                assert torch.equal(rank[name]["swap"][key], grad), (name, key)
                if name == "Schedule1F1B":
                    assert torch.equal(rank[name]["torch"][key], grad), (name, key)
        got = {key for rank in ranks for key in rank[name]["pipeswap"]}
        assert got == want.keys(), name  # every gradient, the final norm's included
        assert any(key.startswith(f"{count - 1}.3.") for key in got)  # the norm's
