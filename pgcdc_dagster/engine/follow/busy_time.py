"""Busy seconds of two threads, and how long both were busy at once, in bounded memory.

A follow reports how much its receiver and applier each worked and how much of that overlapped
(the pipelining). Keeping every busy interval of both sides until it ends would be two
intervals a range, so a follow that runs for days at 5 ranges a second would keep about 900,000
tuples a day. So the intervals are folded into running totals as soon as nothing can
overlap them any more, which holds for the part of both lists before the earlier of the two
sides' last ends: each side is one thread working one interval after the other, so every
interval it adds starts at or after its last one ended.
"""

from __future__ import annotations

import threading
from typing import Any

Interval = tuple[float, float]

FOLD_AT = 64
"""Intervals a side holds before a fold is tried."""


class BusyTime:
    """Add each side's busy intervals (``side`` 0 or 1, each in time order, disjoint) from any
    thread; read the totals at any time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sides: tuple[list[Interval], list[Interval]] = ([], [])
        self._folded = [0.0, 0.0]
        self._folded_both = 0.0
        self._fold_at = [FOLD_AT, FOLD_AT]

    def add(self, side: int, start: float, end: float) -> None:
        with self._lock:
            self._sides[side].append((start, end))
            if len(self._sides[side]) >= self._fold_at[side]:
                self._fold()
                # A side far ahead of the other stays long until the other adds again: try
                # again only once it doubled, so the folding stays linear.
                self._fold_at[side] = max(FOLD_AT, 2 * len(self._sides[side]))

    def busy_s(self, side: int) -> float:
        with self._lock:
            return self._folded[side] + sum(b - a for a, b in self._sides[side])

    def both_s(self) -> float:
        with self._lock:
            return self._folded_both + overlap(*self._sides)

    def held(self) -> int:
        """Intervals held now (what stays bounded)."""
        with self._lock:
            return len(self._sides[0]) + len(self._sides[1])

    def _fold(self) -> None:
        xs, ys = self._sides
        if not xs or not ys:
            return  # the idle side may yet add an interval that started long ago
        settled = min(xs[-1][1], ys[-1][1])
        kept: list[list[Interval]] = []
        done: list[list[Interval]] = []
        for side, intervals in enumerate((xs, ys)):
            done.append([(a, min(b, settled)) for a, b in intervals if a < settled])
            kept.append([(max(a, settled), b) for a, b in intervals if b > settled])
            self._folded[side] += sum(b - a for a, b in done[side])
        self._folded_both += overlap(done[0], done[1])
        self._sides = (kept[0], kept[1])

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (a follower in its own process sends its summary): without the lock."""
        with self._lock:
            state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def overlap(xs: list[Interval], ys: list[Interval]) -> float:
    """Seconds covered by both lists (each sorted, its intervals disjoint)."""
    total, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            total += max(0.0, min(b, ys[k][1]) - max(a, ys[k][0]))
            k += 1
    return total
