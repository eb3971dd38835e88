"""The output store's layout: ranges in buckets of WAL, walked only as far as a caller needs,
and stores in the flat layout read too (no database: stores written by hand)."""

from __future__ import annotations

import os
import time

import pytest

from pgcdc_dagster.engine.control.next_step import (
    ApplyStored,
    CatchUpStateError,
    ReceiveNext,
    decide,
)
from pgcdc_dagster.engine.lsn import Lsn, LsnRange
from pgcdc_dagster.engine.store import output_store as store_module
from pgcdc_dagster.engine.store.output_store import MANIFEST, OutputStore
from pgcdc_dagster.engine.store.retention import prune, retention_status
from pgcdc_dagster_tests.support.calls import CallCount
from pgcdc_dagster_tests.support.stores import on_disk, range_manifest, store_ranges, store_with

MIB16 = 0x100_0000


def spread(count: int, first: int = 0x1_0000_0000) -> list[tuple[str, str, str]]:
    """``count`` contiguous ranges of 8 MiB of WAL, one transaction each: two per bucket."""
    ranges = []
    for i in range(count):
        start, end = first + i * MIB16 // 2, first + (i + 1) * MIB16 // 2
        ranges.append((str(Lsn(start)), str(Lsn(end)), str(Lsn(end - 0x100))))
    return ranges


def test_ranges_are_stored_in_buckets_of_their_start_and_walked_in_lsn_order(tmp_path):
    ranges = spread(6, first=0x2_FF00_0000)  # across the 4 GiB boundary at 3/0
    store = store_with(tmp_path, ranges, ranges[0][0])
    first = LsnRange(ranges[0][0], ranges[0][1])
    assert store.range_path(first) == store.changes_dir / "00000002" / "FF" / first.key
    assert sorted(p.name for p in store.changes_dir.iterdir()) == ["00000002", "00000003"]
    every = [LsnRange(a, b) for a, b, _ in ranges]
    assert store.ranges() == every
    assert list(store.walk(reverse=True)) == every[::-1]
    middle = every[3].start
    assert list(store.walk(middle)) == every[3:]
    assert list(store.walk(Lsn(middle + 1))) == every[4:]
    assert list(store.walk(middle, reverse=True)) == every[3::-1]
    assert list(store.walk(Lsn(middle - 1), reverse=True)) == every[2::-1]
    assert store.chain_end() == every[-1].end and store.chain_count() == 6
    assert store.chain_from(Lsn(every[2].start + 5)) == every[2:]
    assert store.chain_from(Lsn(0)) == every


def test_what_comes_next_lists_a_few_buckets_whatever_the_store_holds(tmp_path, monkeypatch):
    """A follow stores a range every few hundred milliseconds and a week of them is kept: the
    decision of what comes next, the range written next and the chain's end each list the
    buckets they need (the last ones), not the whole store (a listing of every stored range
    grows slower with every range: ``benchmarks/store_scale.py``)."""
    ranges = spread(200)
    store = store_with(tmp_path, ranges, ranges[0][0])
    origin = Lsn(ranges[-2][2])  # the last range not applied
    listed = CallCount(monkeypatch, store_module, "listed")

    fresh = OutputStore(store.root)
    step = decide(fresh, origin, None, Lsn(int(Lsn(ranges[-1][1])) + MIB16), MIB16)
    assert isinstance(step, ApplyStored) and step.range == LsnRange(*ranges[-1][:2])
    assert fresh.chain_end() == Lsn(ranges[-1][1])
    end = ranges[-1][1]
    with fresh.writer(LsnRange(end, str(Lsn(int(Lsn(end)) + 0x1000)))) as writer:
        writer.commit(range_manifest(end, str(Lsn(int(Lsn(end)) + 0x1000)), None))
    assert listed.count <= 12, listed.count  # of the store's 100 buckets

    walks = CallCount(monkeypatch, OutputStore, "walk")
    step = decide(OutputStore(store.root), Lsn(ranges[-1][2]), None, Lsn(end), MIB16)
    assert not isinstance(step, ApplyStored), step.describe()
    assert walks.count == 2  # back to the range the origin falls in, then on from it


def test_a_hole_after_the_origin_is_found_and_one_before_it_does_not_matter(tmp_path):
    ranges = spread(8)
    store = store_with(tmp_path, ranges, ranges[0][0])
    beyond = Lsn(int(Lsn(ranges[-1][1])) + MIB16)
    os.rename(store.range_path(LsnRange(*ranges[5][:2])), tmp_path / "lost")
    with pytest.raises(CatchUpStateError, match="has a hole"):
        decide(OutputStore(store.root), Lsn(ranges[3][2]), None, beyond, MIB16)
    os.rename(tmp_path / "lost", store.range_path(LsnRange(*ranges[5][:2])))
    os.rename(store.range_path(LsnRange(*ranges[1][:2])), tmp_path / "lost")
    step = decide(OutputStore(store.root), Lsn(ranges[3][2]), None, beyond, MIB16)
    assert isinstance(step, ApplyStored) and step.range == LsnRange(*ranges[4][:2])
    with pytest.raises(CatchUpStateError, match="has a hole"):  # the origin before it
        decide(OutputStore(store.root), Lsn(ranges[0][2]), None, beyond, MIB16)


def test_a_store_written_before_buckets_is_read_continued_and_pruned(tmp_path):
    """Ranges stored directly under ``changes/`` (the flat layout) are found, walked
    in order with the ranges stored in buckets after them, decided on, and removed by the
    retention; the ranges written from then on go into buckets."""
    ranges = spread(6)
    store = store_with(tmp_path, ranges[:4], ranges[0][0])
    for a, b, _ in ranges[:4]:  # as the flat layout keeps them
        rng = LsnRange(a, b)
        os.rename(store.range_path(rng), store.changes_dir / rng.key)
    for top in [p for p in store.changes_dir.iterdir() if len(p.name) == 8]:
        for mid in top.iterdir():
            mid.rmdir()
        top.rmdir()
    old = OutputStore(store.root)
    every = [LsnRange(a, b) for a, b, _ in ranges]
    assert old.ranges() == every[:4] and old.chain_end() == every[3].end
    assert old.range_path(every[0]) == old.changes_dir / every[0].key
    step = decide(old, Lsn(ranges[1][2]), None, every[-1].end, MIB16)
    assert isinstance(step, ApplyStored) and step.range == every[2]
    store_ranges(old, ranges[4:], ranges[0][0])
    assert old.ranges() == every and list(old.walk(reverse=True)) == every[::-1]
    assert old.range_path(every[4]).parent == old.bucket_of(every[4].start)
    assert old.get(every[0]).store_root == old.get(every[4]).store_root == old.root
    step = decide(OutputStore(store.root), Lsn(ranges[-1][2]), None, every[-1].end, MIB16)
    assert not isinstance(step, ApplyStored | ReceiveNext)

    when = time.time() - 7200
    for rng in every:
        os.utime(old.range_path(rng) / MANIFEST, (when, when))
    result = prune(OutputStore(store.root), Lsn(ranges[-1][2]), 3600)
    assert result.removed == every[:-1]
    assert on_disk(old) == [every[-1].key]
    status = retention_status(OutputStore(store.root), Lsn(ranges[-1][2]), 3600)
    assert status.ranges == 1 and status.overdue is None


def test_a_prune_removes_the_buckets_it_empties_and_a_writer_makes_them_again(tmp_path):
    ranges = spread(6)
    store = store_with(tmp_path, ranges, ranges[0][0])
    when = time.time() - 7200
    for rng in store.ranges():
        os.utime(store.range_path(rng) / MANIFEST, (when, when))
    prune(OutputStore(store.root), Lsn(ranges[-1][2]), 3600)
    kept = LsnRange(*ranges[-1][:2])
    assert [p.name for p in (store.changes_dir / "00000001").iterdir()] == ["02"]
    assert store.ranges() == [kept]
    # A range whose bucket a prune removed (here: one written again into an emptied bucket).
    gone = store.bucket_of(Lsn(ranges[0][0]))
    assert not gone.exists()
    with store.writer(LsnRange(ranges[0][0], ranges[0][1])) as writer:
        writer.commit(range_manifest(*ranges[0]))
    assert store.holds(LsnRange(ranges[0][0], ranges[0][1])) and gone.is_dir()


def test_a_prune_reads_what_it_removes_and_a_range_more(tmp_path, monkeypatch):
    """Every 10 minutes of a follow, a prune finds a few thousand ranges old enough in a week
    of them: it walks from the store's first range and stops at the first it keeps, for an
    earlier chain's ranges (by age) as for the current chain's (by age and the origin)."""
    from pgcdc_dagster.engine.store import retention

    earlier = spread(40, first=0x1_0000_0000)
    ranges = spread(60, first=0x2_0000_0000)
    store = store_with(tmp_path, earlier, earlier[0][0])
    store_ranges(store, ranges, ranges[0][0])  # a re-snapshot: the earlier chain is history
    old = time.time() - 7200
    for a, b, _ in [*earlier[:10], *ranges[:20]]:
        os.utime(store.range_path(LsnRange(a, b)) / MANIFEST, (old, old))
    aged = CallCount(monkeypatch, retention, "stored_at")
    listed = CallCount(monkeypatch, store_module, "listed")
    result = prune(OutputStore(store.root), Lsn(ranges[-1][2]), 3600)
    assert result.history == [LsnRange(a, b) for a, b, _ in earlier[:10]]
    assert result.removed == [LsnRange(a, b) for a, b, _ in ranges[:20]]
    assert aged.count == 11 + 21, aged.count  # each one too young ends its walk
    assert listed.count <= 25, listed.count  # of 50 buckets and 2 folders above them
