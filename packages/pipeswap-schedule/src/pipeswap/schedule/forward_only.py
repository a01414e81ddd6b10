"""A rank's order for a forward-only step (evaluation): its forwards and the sends and
receives of their activations, in the order the training step runs them.

Taken from a validated order, not built anew: dropping every backward, gradient transfer,
swap, recompute and gradient reduction removes whole messages (both their ends, on every
rank alike) and only loosens what waits for what, so the forwards run, and their messages
pair, as they do in the training step, on every transport that step passes.
"""

from __future__ import annotations

from pipeswap.schedule.steps import Order, Step, StepType

__all__ = ["forward_order"]

#: The leaves a forward-only step keeps: forwards, their activations' transfers, and the
#: FSDP gathers and frees around them.
_KEPT = frozenset({StepType.FWD, StepType.FWD_SEND, StepType.FWD_RECV,
                   StepType.FSDP_UNSHARD, StepType.FSDP_RESHARD})


def forward_order(order: Order) -> tuple[Step, ...]:
    """``order``'s forward-only steps: its forwards (an overlap's forward on its own), the
    sends and receives of activations (a batch keeps those of its transfers), and FSDP's
    gathers and frees; idle slots dropped."""
    kept: list[Step] = []
    for step in order:
        if step is None:
            continue
        if step.type is StepType.BATCH_SEND_RECV:
            transfers = tuple(s for s in step.sub_steps if s.type in _KEPT)
            if transfers:
                kept.append(Step(StepType.BATCH_SEND_RECV, sub_steps=transfers))
        elif step.type in (StepType.OVERLAP_F_B, StepType.OVERLAP_B_F):
            kept.extend(s for s in step.sub_steps if s.type is StepType.FWD)
        elif step.type in _KEPT:
            kept.append(step)
    return tuple(kept)
