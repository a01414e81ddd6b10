"""What a rank holds at each slot or point of its own timeline, kept so that a plan's
questions cost a few list operations each, not a step per slot: the peak, the first slot at
it, the highest value and how many slots hold a value over a span, and adding over a span.

Both plans keep one (:mod:`pipeswap.schedule.policies._chunk_plan`,
:mod:`pipeswap.schedule.policies._layer_plan`); a rank of thousands of slots is why.
"""

from __future__ import annotations

from collections.abc import Sequence


class Profile:
    """Bytes held per slot, in blocks that know their highest value and carry an amount
    added to all of their slots."""

    BLOCK = 64

    def __init__(self, values: Sequence[int]) -> None:
        size = self.BLOCK
        self.raw = list(values)  # each slot's value, less its block's ``added``
        self.highest = [max(self.raw[i:i + size]) for i in range(0, len(self.raw), size)]
        self.added = [0] * len(self.highest)

    def _parts(self, start: int, stop: int) -> tuple[list[int], int, int]:
        """The blocks only partly in ``start:stop``, and the range of those wholly in it."""
        size = self.BLOCK
        head, tail = start // size, (stop - 1) // size
        if head == tail:
            return ([head], 0, 0) if stop - start < size else ([], head, head + 1)
        inner = (head + (start % size != 0), tail + 1 - (stop % size != 0))
        return [b for b in (head, tail) if not inner[0] <= b < inner[1]], *inner

    def add(self, start: int, stop: int, amount: int) -> None:
        if start >= stop:
            return
        size, raw, highest, added = self.BLOCK, self.raw, self.highest, self.added
        partial, lo, hi = self._parts(start, stop)
        for block in partial:
            a, b = max(start, block * size), min(stop, (block + 1) * size)
            raw[a:b] = [value + amount for value in raw[a:b]]
            highest[block] = max(raw[block * size:(block + 1) * size]) + added[block]
        if lo < hi:
            added[lo:hi] = [value + amount for value in added[lo:hi]]
            highest[lo:hi] = [value + amount for value in highest[lo:hi]]

    def highest_in(self, start: int, stop: int) -> int:
        size = self.BLOCK
        partial, lo, hi = self._parts(start, stop)
        found = [max(self.raw[max(start, b * size):min(stop, (b + 1) * size)]) + self.added[b]
                 for b in partial]
        if lo < hi:
            found.append(max(self.highest[lo:hi]))
        return max(found)

    def bound(self, start: int, stop: int) -> int:
        """At least :meth:`highest_in` of the same span, from whole blocks only: cheaper, and
        enough where it already answers."""
        size = self.BLOCK
        return max(self.highest[start // size:(stop - 1) // size + 1])

    @property
    def peak(self) -> int:
        return max(self.highest, default=0)

    @property
    def values(self) -> list[int]:
        size = self.BLOCK
        return [value + self.added[at // size] for at, value in enumerate(self.raw)]

    def first(self, value: int) -> int:
        """The first slot holding ``value`` (which some slot must hold)."""
        block = self.highest.index(value)
        return self.raw.index(value - self.added[block], block * self.BLOCK)

    def last(self, value: int, start: int, stop: int) -> int:
        """The last slot from ``start`` to ``stop`` holding ``value`` (-1: none)."""
        size = self.BLOCK
        for block in range((stop - 1) // size, start // size - 1, -1):
            if self.highest[block] >= value:
                lo, hi = max(start, block * size), min(stop, (block + 1) * size)
                part = self.raw[lo:hi]
                if value - self.added[block] in part:
                    return hi - 1 - part[::-1].index(value - self.added[block])
        return -1

    def count(self, value: int, start: int, stop: int) -> int:
        size, total = self.BLOCK, 0
        for block in range(start // size, (stop - 1) // size + 1):
            if self.highest[block] >= value:
                total += self.raw[max(start, block * size):min(stop, (block + 1) * size)
                                  ].count(value - self.added[block])
        return total

    def clone(self) -> Profile:
        other = Profile(())  # by its constructor: the compiled build makes no bare object
        other.raw, other.highest, other.added = list(self.raw), list(self.highest), list(
            self.added)
        return other
