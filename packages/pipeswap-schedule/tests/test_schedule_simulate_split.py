"""The simulator's memory for split backwards: I frees all but what W needs."""

from __future__ import annotations

import pytest

from pipeswap.schedule import Schedule, ScheduleError, parse_order
from pipeswap.schedule.costs import ChunkBytes, CostModel
from pipeswap.schedule.simulate import peak_without_swap, simulate

# One stage, three microbatches; each chunk holds 100 bytes from its forward, 40 of them
# (what its W needs) from its I to its W.
ORDER = parse_order("0F0 0F1 0I0 0F2 0W0 0I1 0I2 0W1 0W2")
HELD = [100, 200, 140, 240, 200, 140, 80, 40, 0]


def _costs(after_input: int | None) -> CostModel:
    return CostModel(chunks={(0, m): ChunkBytes(100, after_input=after_input) for m in range(3)})


def test_i_frees_what_w_does_not_need() -> None:
    result = simulate(Schedule.from_orders([ORDER]), _costs(40))
    (rank,) = result.ranks
    assert [held for _, held in rank.memory] == HELD
    assert rank.peak_activation_bytes == rank.peak_activation_bytes_no_swap == 240
    assert peak_without_swap(ORDER, _costs(40)) == 240


def test_by_default_i_frees_nothing_and_times_do_not_change() -> None:
    default, split = (simulate(Schedule.from_orders([ORDER]), _costs(after))
                      for after in (None, 40))
    (rank,) = default.ranks
    assert [held for _, held in rank.memory] == [100, 200, 300, 200, 100, 0]
    assert rank.peak_activation_bytes == peak_without_swap(ORDER, _costs(None)) == 300
    assert default.step_time == split.step_time
    assert default.ranks[0].spans == split.ranks[0].spans


def test_an_unsplit_backward_frees_the_whole_chunk() -> None:
    order = parse_order("0F0 0F1 0B0 0F2 0B1 0B2")
    result = simulate(Schedule.from_orders([order]), _costs(40))
    assert [held for _, held in result.ranks[0].memory] == [100, 200, 100, 200, 100, 0]


@pytest.mark.parametrize(("pinned", "after_input"), [(-1, None), (101, None), (0, -1), (0, 101)])
def test_chunk_bytes_out_of_range_are_refused(pinned: int, after_input: int | None) -> None:
    with pytest.raises(ScheduleError, match="chunk bytes"):
        ChunkBytes(100, pinned=pinned, after_input=after_input)
