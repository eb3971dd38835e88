"""Range planning and ordering, on a real output store on disk (no database needed)."""

import itertools
import shutil

import pytest

from pgcdc_dagster.engine.apply.results import ApplyGapError
from pgcdc_dagster.engine.apply.transaction import check_no_gap
from pgcdc_dagster.engine.control.next_step import plan_next_range
from pgcdc_dagster.engine.control.pipeline import (
    RangeOrderError,
    check_range_order,
    expected_origin_progress,
)
from pgcdc_dagster.engine.lsn import Lsn, LsnRange
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster.engine.store import output_store as store_module
from pgcdc_dagster.engine.store.output_store import OutputStore
from pgcdc_dagster_tests.support.calls import CallCount
from pgcdc_dagster_tests.support.stores import range_manifest, store_ranges, store_with


def test_next_range_starts_at_the_consistent_point_and_is_capped():
    cp = Lsn("0/1000")
    assert plan_next_range(cp, None, Lsn("0/5000"), 0x1000) == LsnRange("0/1000", "0/2000")
    assert plan_next_range(cp, Lsn("0/2000"), Lsn("0/2800"), 0x1000) == LsnRange("0/2000", "0/2800")
    assert plan_next_range(cp, Lsn("0/2800"), Lsn("0/2800"), 0x1000) is None


def test_ranges_of_an_earlier_snapshot_are_ignored_after_a_resnapshot():
    # The last registered range ended before the new consistent point: start afresh there.
    assert plan_next_range(Lsn("0/9000"), Lsn("0/3000"), Lsn("0/9100"), 0x1000) == LsnRange(
        "0/9000", "0/9100"
    )


def test_order_check_accepts_the_next_range_and_re_runs(tmp_path):
    store = store_with(tmp_path, [("0/1000", "0/2000", None)], "0/1000")
    check_range_order(store, LsnRange("0/2000", "0/3000"))  # next
    check_range_order(store, LsnRange("0/1000", "0/2000"))  # stored: a re-run is allowed


def test_order_check_refuses_a_gap_and_names_the_missing_range(tmp_path):
    store = store_with(tmp_path, [("0/1000", "0/2000", None)], "0/1000")
    with pytest.raises(RangeOrderError, match="0/2000 to 0/2800 must be received"):
        check_range_order(store, LsnRange("0/2800", "0/3000"))


def test_order_check_refuses_history_from_before_the_snapshot(tmp_path):
    store = store_with(tmp_path, [("0/1000", "0/2000", None)], "0/5000")
    with pytest.raises(RangeOrderError, match="earlier snapshot"):
        check_range_order(store, LsnRange("0/2000", "0/3000"))
    assert store.chain_ranges() == []


def test_a_crashed_write_leaves_no_range_behind(tmp_path):
    store = OutputStore(tmp_path / "store")
    rng = LsnRange("0/1000", "0/2000")
    crashed = store.writer(rng)  # never committed: what a kill mid-write leaves
    (crashed.tmp / "part-00000.parquet").write_bytes(b"half a file")
    assert store.ranges() == [] and store.get(rng) is None
    retry = store.writer(rng)  # the next attempt sweeps the leftovers of its range
    assert not crashed.tmp.exists()
    retry.commit(range_manifest("0/1000", "0/2000", None))
    assert store.ranges() == [rng]


def test_the_range_before_a_range_is_found_by_its_end_without_listing_the_store(
    tmp_path, monkeypatch
):
    """A follow stores a range every few hundred milliseconds: the gap check before each apply
    and the origin each range must leave walk back by ends, not through a listing of every
    range stored so far. Ranges another process stored are found by one listing."""
    chain = [("0/1000", "0/2000", "0/1800"), ("0/2000", "0/3000", None), ("0/3000", "0/4000", None)]
    store_with(tmp_path, chain, "0/1000")
    settings = ReplicationSettings(store=str(tmp_path / "store"))
    last = LsnRange("0/3000", "0/4000")
    listings = CallCount(monkeypatch, OutputStore, "walk")  # a walk of the store

    store = OutputStore(tmp_path / "store")  # another instance, as the applier's is
    previous = store.range_ending_at(Lsn("0/3000"))
    assert previous is not None and previous.range == LsnRange("0/2000", "0/3000")
    check_no_gap(store, store.get(last), Lsn("0/1800"))  # two empty ranges back: no gap
    assert expected_origin_progress(settings, through=last) == Lsn("0/1800")
    assert expected_origin_progress(settings, through=LsnRange("0/1000", "0/2000")) == Lsn("0/1800")
    with pytest.raises(ApplyGapError, match="range 0000000000001000-0000000000002000"):
        check_no_gap(store, store.get(last), Lsn("0/1000"))  # its first range not applied
    assert listings.count == 0

    shutil.rmtree(store.range_path(LsnRange("0/2000", "0/3000")))  # lost by hand
    with pytest.raises(ApplyGapError, match="no stored range ends at 0/3000"):
        check_no_gap(OutputStore(tmp_path / "store"), store.get(last), Lsn("0/1800"))
    assert listings.count == 1

    with store.writer(LsnRange("0/2000", "0/3000")) as writer:  # back, then forgotten:
        writer.commit(range_manifest("0/2000", "0/3000", None))
    store_module._SEEN.clear()  # what a process that did not store them knows
    check_no_gap(OutputStore(tmp_path / "store"), store.get(last), Lsn("0/1800"))
    assert listings.count == 2


def test_of_two_ranges_ending_alike_the_one_that_starts_last_is_the_range_before(tmp_path):
    """Only ranges of two chains could end alike; a listing in LSN order gave the later one."""
    store = store_with(
        tmp_path,
        [("0/1800", "0/3000", None), ("0/1000", "0/3000", "0/2000")],
        "0/1000",
    )
    assert store.range_ending_at(Lsn("0/3000")).range == LsnRange("0/1800", "0/3000")
    store_module._SEEN.clear()
    fresh = OutputStore(tmp_path / "store")
    assert fresh.range_ending_at(Lsn("0/3000")).range == LsnRange("0/1800", "0/3000")


def test_a_long_lived_store_keeps_a_bounded_number_of_ranges_in_memory(tmp_path, monkeypatch):
    """A follow's receiver writes through one store for as long as it runs: what it remembers
    of the ranges it stored stays bounded, and what it forgot is read again from the disk."""
    monkeypatch.setattr(store_module, "MANIFESTS_KEPT", 3)
    monkeypatch.setattr(store_module, "ENDS_SEEN", 3)
    ends = [f"0/{0x1000 * i:X}" for i in range(1, 10)]
    store = store_with(
        tmp_path,
        [(a, b, f"0/{int(b[2:], 16) - 8:X}") for a, b in itertools.pairwise(ends)],
        ends[0],
    )
    assert len(store._manifests) == 3 and len(store._seen.by_end) == 3
    listings = CallCount(monkeypatch, OutputStore, "walk")
    assert store.range_ending_at(Lsn(ends[-1])).range == LsnRange(ends[-2], ends[-1])
    assert listings.count == 0
    oldest = store.range_ending_at(Lsn(ends[1]))  # forgotten: one listing finds it
    assert oldest.range == LsnRange(ends[0], ends[1])
    assert oldest.transform_lsn == Lsn(int(ends[1][2:], 16) - 8)
    assert listings.count == 1
    assert len(store._manifests) == 3 and len(store._seen.by_end) == 3


def test_an_idle_sources_empty_ranges_are_walked_back_in_one_step(tmp_path, monkeypatch):
    """An idle source leaves empty range after empty range behind its last commit. Each range
    stored records the chain's last commit so far, so the gap check and the expected origin
    read one range, not all of them; ranges stored before that record existed are walked, past
    the ends this process remembers, with one listing each."""
    monkeypatch.setattr(store_module, "ENDS_SEEN", 3)
    ends = [f"0/{0x1000 * i:X}" for i in range(1, 13)]
    ranges = [(a, b, None) for a, b in itertools.pairwise(ends)]
    ranges[1] = (ends[1], ends[2], "0/2F00")  # the last commit, then nine empty ranges
    last = LsnRange(ends[-2], ends[-1])

    def check(root, *, listed: int) -> None:
        settings = ReplicationSettings(store=str(root))
        listings = CallCount(monkeypatch, OutputStore, "walk")
        reads = CallCount(monkeypatch, OutputStore, "get")
        store = OutputStore(root)
        check_no_gap(store, store.get(last), Lsn("0/2F00"))
        assert expected_origin_progress(settings, through=last) == Lsn("0/2F00")
        assert (listings.count, reads.count <= 4) == (listed, listed == 0)
        with pytest.raises(ApplyGapError, match="transactions up to 0/2F00"):
            check_no_gap(store, store.get(last), Lsn("0/2E00"))
        monkeypatch.undo()
        monkeypatch.setattr(store_module, "ENDS_SEEN", 3)

    store = store_ranges(OutputStore(tmp_path / "new"), ranges, ends[0])
    marks = [store.get(LsnRange(a, b)).chain_last_commit for a, b, _ in ranges]
    assert marks == [Lsn(ends[0])] + [Lsn("0/2F00")] * 10  # the first: the consistent point
    check(tmp_path / "new", listed=0)

    with monkeypatch.context() as older:  # as stored before the record: own last commit only
        older.setattr(OutputStore, "last_commit_before", lambda self, start: None)
        store_ranges(OutputStore(tmp_path / "old"), ranges, ends[0])
    store_module._SEEN.clear()
    check(tmp_path / "old", listed=2)  # once per walk: the gap check, the expected origin

    # The first range stored after that walks back once and records, and the next ones follow.
    old = OutputStore(tmp_path / "old")
    more = [(ends[-1], "0/D000", None), ("0/D000", "0/E000", None)]
    store_ranges(old, more, ends[0])
    assert [old.get(LsnRange(a, b)).chain_last_commit for a, b, _ in more] == [Lsn("0/2F00")] * 2
