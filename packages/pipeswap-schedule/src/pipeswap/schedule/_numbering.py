"""Numberings that must run 0..N-1 (ranks, stages, microbatches), checked without building
``range(N)``: one stray huge number in a file must cost neither memory nor a page of output."""

from __future__ import annotations

from collections.abc import Container, Sequence

SHOWN = 5


def gaps(present: Container[int], end: int) -> list[int]:
    """The first few numbers of ``0..end-1`` absent from ``present``; the work is linear in how
    many are present, whatever ``end`` is."""
    found: list[int] = []
    number = 0
    while number < end and len(found) < SHOWN:
        if number not in present:
            found.append(number)
        number += 1
    return found


def listing(shown: Sequence[int], total: int) -> str:
    """``[1, 4]``, or ``[0, 1, 2, 3, 4] and 95 more`` when ``total`` exceeds what is shown."""
    more = total - len(shown)
    return f"{list(shown)}" + (f" and {more} more" if more > 0 else "")
