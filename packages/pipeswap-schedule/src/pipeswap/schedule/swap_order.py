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

A policy that places each chunk (:class:`SwapPlacement`, as the default peak policy does)
gets its placement on FSDP stages too: its copies were planned to hide behind those computes,
and the rule above would leave a reload with no compute to hide behind when the stage's
parameters stay gathered (one stage a rank, the common case).

A policy that also recomputes layers (:class:`RecomputingPolicy`, as the peak policy does
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
:mod:`pipeswap.schedule.swap` runs it over every rank of a schedule.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Mapping
from operator import itemgetter

from pipeswap.schedule.errors import ScheduleError
from pipeswap.schedule.policies.base import (
    DEFAULT_PLACEMENT,
    RecomputingPolicy,
    SwapCandidate,
    SwapPlacement,
    SwapPolicy,
)
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

_OWN_SEND = {StepType.FWD: StepType.FWD_SEND, StepType.BWD: StepType.BWD_SEND,
             StepType.BWD_INPUT: StepType.BWD_SEND}


def swap_candidates(order: Order, rank: int = 0) -> list[SwapCandidate]:
    """Every chunk of ``order`` that could be swapped, in order of first forward."""
    return _Slots(order).candidates(rank)


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


def inject_swap_order(order: Order, policy: SwapPolicy, *, rank: int = 0) -> list[Step | None]:
    """Insert swap steps into one rank's order (see the module docstring for the anchors)."""
    slots = _Slots(order)
    candidates = slots.candidates(rank)
    chosen = policy.select(candidates, order)
    recomputed = policy.recomputed(rank) if isinstance(policy, RecomputingPolicy) else {}
    placed = isinstance(chosen, Mapping)  # the policy placed each chunk itself
    selected: Mapping[ChunkKey, SwapPlacement] = (
        chosen if isinstance(chosen, Mapping) else dict.fromkeys(chosen, DEFAULT_PLACEMENT))
    unknown = (selected.keys() | recomputed.keys()) - {(c.stage, c.micro) for c in candidates}
    if unknown:
        raise ScheduleError(
            f"the swap policy selected chunk(s) {sorted(unknown)} on rank {rank}, which are not "
            "candidates (forward and backward must both run on this rank, backward later)"
        )
    anchors: dict[int, int] = {}

    def after_compute(index: int) -> int:
        """Where a wait goes after the compute at ``index``: after the compute's own send in
        the run of P2P (and zero-width) steps that follows it, else after the run's last P2P."""
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

    # Where each step goes: (container, before (0, 1) or after (2, 3) it, launches ahead of
    # waits, the step); a stable sort keeps the candidates' order within each place.
    placed_steps: list[tuple[int, int, Step]] = []
    add = placed_steps.append
    container = slots.container
    for _, stage, micro, f_slot, b_slot in candidates:
        layers = recomputed.get((stage, micro))
        if layers:  # before the forward, and before its SO
            add((container[f_slot], 0, Step(StepType.RECOMPUTE, stage, micro, layers=layers)))
        placement = selected.get((stage, micro))
        if placement is None:
            continue
        off, load, lag, depth = SwapPlacement(*placement)  # a plain tuple of three works
        if lag and depth < 1:
            raise ScheduleError(
                f"the swap policy selected chunk {(stage, micro)} on rank {rank} with a load "
                f"depth of {depth}; a streamed load runs at least one layer ahead (>= 1)")
        if min(off, load, lag) < 0 or b_slot - f_slot < off + load + 1:
            raise ScheduleError(
                f"the swap policy selected chunk {(stage, micro)} on rank {rank} with "
                f"{off} slot(s) to offload and {load} to reload, but its backward is "
                f"{b_slot - f_slot} compute slot(s) after its forward; slots are >= 0 and the "
                "offload must end before the reload starts (gap >= slots + 1)"
            )
        f_container, b_container = container[f_slot], container[b_slot]
        wait_offload_at = after_compute(container[f_slot + off])
        gathers = None if placed else slots.unshards.get(stage)
        if gathers is None:  # H2D overlaps the computes right before the backward
            load_at = container[b_slot - load]
        else:  # FSDP stage: overlap the H2D with the last re-gather of its parameters, if any
            latest = bisect_left(gathers, b_container) - 1
            gather = gathers[latest] if latest >= 0 else -1
            load_at = gather if gather > wait_offload_at else b_container
        if lag:
            add((f_container, 0, Step(StepType.SWAP_STREAM_OFFLOAD, stage, micro, lag=lag)))
        else:
            add((f_container, 2, chunk_leaf(StepType.SWAP_LAUNCH_OFFLOAD, stage, micro)))
        add((wait_offload_at, 3, chunk_leaf(StepType.SWAP_WAIT_OFFLOAD, stage, micro)))
        add((load_at, 0, Step(StepType.SWAP_STREAM_LOAD, stage, micro, lag=depth) if lag
             else chunk_leaf(StepType.SWAP_LAUNCH_LOAD, stage, micro)))
        add((b_container, 1, chunk_leaf(StepType.SWAP_WAIT_LOAD, stage, micro)))
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
