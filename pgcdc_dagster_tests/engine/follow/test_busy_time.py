"""The follow's busy-time totals: the same figures as keeping every interval, in bounded
memory (pure arithmetic: no server involved)."""

from __future__ import annotations

import pickle
import random

import pytest

from pgcdc_dagster.engine.follow.busy_time import FOLD_AT, BusyTime, overlap


def sides(seed: int, n: int) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Two threads' busy intervals: each side one after the other, gaps between, the sides
    overlapping each other anyhow."""
    chance = random.Random(seed)
    made: list[list[tuple[float, float]]] = []
    for _ in range(2):
        t, intervals = 0.0, []
        for _ in range(n):
            t += chance.uniform(0.0, 0.3)
            end = t + chance.uniform(0.0, 0.5)
            intervals.append((t, end))
            t = end
        made.append(intervals)
    return made[0], made[1]


@pytest.mark.parametrize("seed", range(5))
def test_folded_totals_equal_the_totals_of_every_interval_and_memory_stays_bounded(seed):
    xs, ys = sides(seed, 5_000)
    busy = BusyTime()
    most = 0
    # Each thread adds an interval when it ends: in the order of the ends.
    for end, side, start in sorted([(b, 0, a) for a, b in xs] + [(b, 1, a) for a, b in ys]):
        busy.add(side, start, end)
        most = max(most, busy.held())
    assert busy.busy_s(0) == pytest.approx(sum(b - a for a, b in xs))
    assert busy.busy_s(1) == pytest.approx(sum(b - a for a, b in ys))
    assert busy.both_s() == pytest.approx(overlap(xs, ys))
    assert 0 < busy.both_s() < min(busy.busy_s(0), busy.busy_s(1))
    assert most <= 4 * FOLD_AT, most  # of the 10,000 intervals added

    again = pickle.loads(pickle.dumps(busy))  # a follow process sends its summary
    assert again.both_s() == pytest.approx(busy.both_s())
    again.add(0, xs[-1][1] + 1, xs[-1][1] + 2)


def test_a_side_that_adds_nothing_keeps_the_other_whole_until_it_does():
    """Nothing is folded while one side has no interval: one it adds later may have begun
    before everything the other side added."""
    busy = BusyTime()
    for n in range(3 * FOLD_AT):
        busy.add(0, n, n + 0.5)
    busy.add(1, 0.25, 3 * FOLD_AT)  # began with the first, ended after the last
    assert busy.both_s() == pytest.approx(3 * FOLD_AT * 0.5 - 0.25)
