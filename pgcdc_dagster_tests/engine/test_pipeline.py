"""Range planning and ordering, on a real output store on disk (no database needed)."""

import pytest

from pgcdc_dagster.engine.lsn import Lsn, LsnRange
from pgcdc_dagster.engine.next_step import plan_next_range
from pgcdc_dagster.engine.pipeline import RangeOrderError, check_range_order
from pgcdc_dagster.engine.store import OutputStore
from pgcdc_dagster_tests.stores import range_manifest, store_ranges


def store_with(tmp_path, consistent_point: str, ranges: list[tuple[str, str]]) -> OutputStore:
    return store_ranges(
        OutputStore(tmp_path / "store"), [(s, e, None) for s, e in ranges], consistent_point
    )


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
    store = store_with(tmp_path, "0/1000", [("0/1000", "0/2000")])
    check_range_order(store, LsnRange("0/2000", "0/3000"))  # next
    check_range_order(store, LsnRange("0/1000", "0/2000"))  # stored: a re-run is allowed


def test_order_check_refuses_a_gap_and_names_the_missing_range(tmp_path):
    store = store_with(tmp_path, "0/1000", [("0/1000", "0/2000")])
    with pytest.raises(RangeOrderError, match="0/2000 to 0/2800 must be received"):
        check_range_order(store, LsnRange("0/2800", "0/3000"))


def test_order_check_refuses_history_from_before_the_snapshot(tmp_path):
    store = store_with(tmp_path, "0/5000", [("0/1000", "0/2000")])
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
