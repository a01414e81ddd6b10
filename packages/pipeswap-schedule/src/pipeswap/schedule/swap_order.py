"""Where the swap pass puts one rank's swap steps: offload a chunk's activations after its
forward, reload them before its backward.

For every chunk (stage, micro) the policy picks on a rank, four steps go between the rank's
existing steps, never inside one:

============  ==============================================================================
``LO``        launch the device→host copy, right after the forward's step
``WO``        wait for that copy and free device memory, after the first compute that follows
              (and after that compute's own send, so a P2P block is never split)
``LL``        launch the host→device copy one compute before the backward; for an FSDP
              stage, before its last parameter all-gather ahead of the backward so the two
              overlap, or right before the backward when no gather lies after ``WO``
              (MindSpore hyper-parallel's rule, for policies that choose chunks only)
``WL``        make compute wait for the copy, right before the backward
============  ==============================================================================

A plan that places each chunk (:class:`SwapPlacement`, as the default peak policy does)
gets its placement on FSDP stages too: its copies were planned to hide behind those computes,
and the rule above would leave a reload with no compute to hide behind when the stage's
parameters stay gathered (one stage a rank, the common case).

A plan that also recomputes layers (:attr:`RankPlan.recomputed`, as the peak policy's do
with ``recompute="auto"``) gets an RC step right before each such chunk's forward (and its
``SO``). An order that has RC steps already is planned around them by the peak policy.

A placement may stream the chunk layer by layer instead (``layer_lag`` >= 1): ``SO`` goes
right before the forward, and the forward offloads each layer as it finishes it, freeing
layer ``k`` when it ends layer ``k + layer_lag``; ``WO`` frees what is left; ``SL`` takes
``LL``'s place, loads the last layer and arms the backward to load each layer while it
computes the one after it (or, with ``load_depth`` d > 1, loads the last d layers and arms
the backward to load each layer d ahead of the one it computes); ``WL`` waits for the last
layer.

Compute slots count containers: an overlap of a backward and a forward is one slot.
Differences from MindSpore hyper-parallel: local control steps (FSDP, swap) are transparent when
looking for a compute's P2P block, FSDP placement applies per stage, and a reload never
precedes the offload wait. The pass is linear in the order length;
:mod:`pipeswap.schedule.build.swap_pass` runs it over every rank of a schedule.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from operator import itemgetter

from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.schedule import Schedule
from pipeswap.schedule.steps import (
    ACTIVATION_CONSUMERS,
    COMM,
    COMPUTE,
    OVERLAPS,
    SWAP,
    ZERO_WIDTH,
    ChunkKey,
    Order,
    Step,
    StepType,
    chunk_leaf,
)
from pipeswap.schedule.swap_plan import RankPlan, SwapCandidate, SwapPlacement

_OWN_SEND = {StepType.FWD: StepType.FWD_SEND, StepType.BWD: StepType.BWD_SEND,
             StepType.BWD_INPUT: StepType.BWD_SEND}


def swap_candidates(order: Order, rank: int = 0) -> list[SwapCandidate]:
    """Every chunk of ``order`` that could be swapped, in order of first forward."""
    return _Slots(order).candidates(rank)


_OFFLOAD_LAUNCHES = frozenset({StepType.SWAP_LAUNCH_OFFLOAD, StepType.SWAP_STREAM_OFFLOAD})


def swapped_chunks(schedule: Schedule) -> tuple[tuple[ChunkKey, ...], ...]:
    """Per rank, the chunks that have a launch-offload step (whole or streaming), in
    execution order."""
    return tuple(
        tuple(s.key for s in order if s is not None and s.type in _OFFLOAD_LAUNCHES)
        for order in schedule.orders
    )


class _Slots:
    """Compute slots of one order: which container holds each, and each chunk's F and B."""

    def __init__(self, order: Order) -> None:
        self.container: list[int] = []  # slot -> container index
        self.fwd: dict[ChunkKey, int] = {}  # key -> slot of its forward
        self.bwd: dict[ChunkKey, int] = {}  # key -> slot of its activation-consuming backward
        self.unshards: dict[int, list[int]] = {}  # stage -> positions of its FSDP_UNSHARD steps
        for index, step in enumerate(order):
            if step is None:
                continue
            kind = step.type
            if kind in COMPUTE:
                leaves: tuple[Step, ...] = (step,)
            elif kind in OVERLAPS:
                leaves = step.sub_steps
            elif kind in SWAP:
                raise ScheduleError(f"the order already has swap steps ({step}); inject them once")
            else:
                if kind is StepType.FSDP_UNSHARD:
                    stage = step.stage
                    assert stage is not None  # Step requires it
                    self.unshards.setdefault(stage, []).append(index)
                continue
            slot = len(self.container)
            self.container.append(index)
            for leaf in leaves:  # compute leaves: stage and micro are set
                if leaf.type is StepType.FWD:
                    self.fwd[leaf.stage, leaf.micro] = slot  # type: ignore[index]
                elif leaf.type in ACTIVATION_CONSUMERS:
                    self.bwd[leaf.stage, leaf.micro] = slot  # type: ignore[index]

    def candidates(self, rank: int) -> list[SwapCandidate]:
        bwd = self.bwd
        return [
            SwapCandidate(rank, key[0], key[1], f_slot, bwd[key])
            for key, f_slot in self.fwd.items()
            if key in bwd and bwd[key] > f_slot
        ]


def inject_swap_order(order: Order, plan: RankPlan) -> list[Step | None]:
    """Insert ``plan``'s swap and RC steps into its rank's order (see the module docstring
    for the anchors)."""
    slots = _Slots(order)
    candidates = slots.candidates(plan.rank)
    unknown = (plan.placements.keys() | plan.recomputed.keys()) - {c.key for c in candidates}
    if unknown:
        raise ScheduleError(
            f"the swap policy selected chunk(s) {sorted(unknown)} on rank {plan.rank}, which "
            "are not candidates (forward and backward must both run on this rank, backward "
            "later)"
        )
    # Where each step goes: (container, before (0, 1) or after (2, 3) it, launches ahead of
    # waits, the step); a stable sort keeps the candidates' order within each place.
    placed_steps: list[tuple[int, int, Step]] = []
    after_compute = _after_compute(order)
    for candidate in candidates:
        placed_steps += _chunk_steps(candidate, plan, slots, after_compute)
    placed_steps.sort(key=itemgetter(0, 1))
    out: list[Step | None] = []
    done = 0  # the order's steps before this are in ``out``
    for index, where, step in placed_steps:
        if where < 2:
            out += order[done:index]
        else:
            out += order[done:index + 1]
        done = index + (where >= 2)
        out.append(step)
    out += order[done:]
    return out


def _after_compute(order: Order) -> Callable[[int], int]:
    """Where a wait goes after the compute at an index: after the compute's own send in
    the run of P2P (and zero-width) steps that follows it, else after the run's last P2P."""
    anchors: dict[int, int] = {}

    def after_compute(index: int) -> int:
        if index in anchors:
            return anchors[index]
        step = order[index]
        assert step is not None
        own = _OWN_SEND.get(step.type)
        found = index
        for j in range(index + 1, len(order)):
            nxt = order[j]
            if nxt is None or (nxt.type not in COMM and nxt.type not in ZERO_WIDTH):
                break
            if nxt.type in COMM:
                found = j
                if own is not None and any(
                    p.type is own and p.stage == step.stage and p.micro == step.micro
                    for p in nxt.p2p_leaves
                ):
                    break
        anchors[index] = found
        return found

    return after_compute


def _chunk_steps(candidate: SwapCandidate, plan: RankPlan, slots: _Slots,
                 after_compute: Callable[[int], int]) -> list[tuple[int, int, Step]]:
    """Where ``candidate``'s RC and swap steps go under ``plan``: (container, before (0, 1)
    or after (2, 3) it, the step)."""
    _, stage, micro, f_slot, b_slot = candidate
    out: list[tuple[int, int, Step]] = []
    container = slots.container
    layers = plan.recomputed.get((stage, micro))
    if layers:  # before the forward, and before its SO
        out.append((container[f_slot], 0, Step(StepType.RECOMPUTE, stage, micro, layers=layers)))
    placement = plan.placements.get((stage, micro))
    if placement is None:
        return out
    off, load, lag, depth = SwapPlacement(*placement)  # a plain tuple of three works
    _check_placement(candidate, plan.rank, off, load, lag, depth)
    f_container, b_container = container[f_slot], container[b_slot]
    wait_offload_at = after_compute(container[f_slot + off])
    gathers = slots.unshards.get(stage) if plan.gather_reloads else None
    if gathers is None:  # H2D overlaps the computes right before the backward
        load_at = container[b_slot - load]
    else:  # FSDP stage: overlap the H2D with the last re-gather of its parameters, if any
        latest = bisect_left(gathers, b_container) - 1
        gather = gathers[latest] if latest >= 0 else -1
        load_at = gather if gather > wait_offload_at else b_container
    if lag:
        out.append((f_container, 0, Step(StepType.SWAP_STREAM_OFFLOAD, stage, micro, lag=lag)))
    else:
        out.append((f_container, 2, chunk_leaf(StepType.SWAP_LAUNCH_OFFLOAD, stage, micro)))
    out.append((wait_offload_at, 3, chunk_leaf(StepType.SWAP_WAIT_OFFLOAD, stage, micro)))
    out.append((load_at, 0, Step(StepType.SWAP_STREAM_LOAD, stage, micro, lag=depth) if lag
                else chunk_leaf(StepType.SWAP_LAUNCH_LOAD, stage, micro)))
    out.append((b_container, 1, chunk_leaf(StepType.SWAP_WAIT_LOAD, stage, micro)))
    return out


def _check_placement(candidate: SwapCandidate, rank: int, off: int, load: int, lag: int,
                     depth: int) -> None:
    """Refuse a placement its chunk's gap has no room for."""
    key, gap = candidate.key, candidate.gap
    if lag and depth < 1:
        raise ScheduleError(
            f"the swap policy selected chunk {key} on rank {rank} with a load "
            f"depth of {depth}; a streamed load runs at least one layer ahead (>= 1)")
    if min(off, load, lag) < 0 or gap < off + load + 1:
        raise ScheduleError(
            f"the swap policy selected chunk {key} on rank {rank} with "
            f"{off} slot(s) to offload and {load} to reload, but its backward is "
            f"{gap} compute slot(s) after its forward; slots are >= 0 and the "
            "offload must end before the reload starts (gap >= slots + 1)"
        )
