"""The store's retention: what a prune removes and keeps, on stores written on disk, and a
follow with a retention of zero on real servers (every applied range but the last removed as
it goes) that stays exact and resumes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psycopg
import pytest

from pgcdc_dagster.engine.apply.transaction import check_no_gap
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.control.next_step import (
    ApplyStored,
    CatchUpStateError,
    ReceiveNext,
    decide,
)
from pgcdc_dagster.engine.control.pipeline import RangeOrderError, check_range_order
from pgcdc_dagster.engine.follow.follower import Follower
from pgcdc_dagster.engine.lsn import Lsn, LsnRange
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster.engine.store import retention
from pgcdc_dagster.engine.store.output_store import MANIFEST, OutputStore
from pgcdc_dagster.engine.store.retention import (
    prune,
    prune_if_due,
    prune_interval,
    retention_status,
)
from pgcdc_dagster_tests.support.pg import flush_lsn, run_sql
from pgcdc_dagster_tests.support.replication import settings_for
from pgcdc_dagster_tests.support.stores import assert_chain_records, on_disk, store_with

CAP = 0x1000
HOUR = 3600.0

# A chain from 0/1000: two transactions, an empty range, a transaction, then one the target
# has not applied (the origin stands at 0/3F00).
RANGES = [
    ("0/1000", "0/2000", "0/1F00"),
    ("0/2000", "0/3000", "0/2E00"),
    ("0/3000", "0/3800", None),
    ("0/3800", "0/4000", "0/3F00"),
    ("0/4000", "0/5000", "0/4E00"),
]
ORIGIN = Lsn("0/3F00")
OLD = 2 * HOUR  # how long ago the ranges were stored, unless a test says otherwise


def keys(ranges) -> list[str]:
    return [LsnRange(a, b).key for a, b, _ in ranges]


def test_a_prune_removes_applied_ranges_keeping_the_last_applied_and_every_unapplied(tmp_path):
    store = store_with(tmp_path, RANGES, age_s=OLD)
    result = prune(store, ORIGIN, HOUR)
    assert [r.key for r in result.removed] == keys(RANGES[:3])
    assert result.kept == LsnRange("0/3800", "0/4000")  # the last applied: walks end there
    assert result.pruned_through == Lsn("0/3800")
    assert [r.key for r in store.chain_ranges()] == keys(RANGES[3:])
    assert on_disk(store) == keys(RANGES[3:])
    chain = store.chain()
    assert chain is not None and chain.pruned_last_commit == Lsn("0/2E00")
    # Every decision still stands on the durable facts alone.
    assert store.chain_start() == Lsn("0/3800") and store.chain_end() == Lsn("0/5000")
    assert store.last_commit_before(Lsn("0/3800")) == Lsn("0/2E00")
    step = decide(store, ORIGIN, Lsn("0/4000"), Lsn("0/9000"), CAP)
    assert isinstance(step, ApplyStored) and step.range == LsnRange("0/4000", "0/5000")
    check_no_gap(store, step.stored, ORIGIN)  # walks back to the kept range
    step = decide(store, Lsn("0/4E00"), Lsn("0/5000"), Lsn("0/9000"), CAP)
    assert isinstance(step, ReceiveNext) and step.range == LsnRange("0/5000", "0/6000")
    assert_chain_records(store, Lsn("0/4E00"))
    # A second prune at once finds nothing more to take.
    assert prune(store, ORIGIN, HOUR).removed == []


def test_young_ranges_and_a_target_that_applied_nothing_keep_everything(tmp_path):
    young = store_with(tmp_path, RANGES, age_s=60)
    assert prune(young, ORIGIN, HOUR).removed == []
    assert prune(young, None, 0).removed == []  # no origin: nothing is known applied
    assert prune(young, Lsn("0/1000"), 0).removed == []  # the origin at the consistent point
    assert len(young.chain_ranges()) == len(RANGES)
    assert prune(young, ORIGIN, 0).removed  # retention 0: every applied range but the last


def test_nothing_goes_while_a_table_is_being_added(tmp_path):
    """An add reads the ranges stored since its copy began once the copy is done (its
    table's changes the applies held back): a prune removes none until the add is done."""
    from pgcdc_dagster.engine.identifiers import TableName

    store = store_with(tmp_path, RANGES, age_s=OLD)
    store.begin_adding([TableName("public", "b")])
    result = prune(store, ORIGIN, HOUR)
    assert (
        result.removed == [] and result.skipped == "adding public.b (pgcdc add-table) is not done"
    )
    assert len(store.chain_ranges()) == len(RANGES)
    chain = store.chain()
    assert chain is not None and chain.pruned_at is not None  # looked: spaced as any prune
    store.record_added([TableName("public", "b")], Lsn("0/2000"), {})
    assert [r.key for r in prune(store, ORIGIN, HOUR).removed] == keys(RANGES[:3])


def test_only_an_old_enough_prefix_goes(tmp_path):
    store = store_with(tmp_path, RANGES, age_s=OLD)
    now = time.time()
    os.utime(store.range_path(LsnRange("0/2000", "0/3000")) / MANIFEST, (now, now))
    result = prune(store, ORIGIN, HOUR)
    assert [r.key for r in result.removed] == keys(RANGES[:1])  # the chain stays contiguous
    assert store.chain_start() == Lsn("0/2000")
    assert store.last_commit_before(Lsn("0/2000")) == Lsn("0/1F00")


def test_a_pruned_range_run_again_is_refused_and_a_target_gone_back_is_refused(tmp_path):
    store = store_with(tmp_path, RANGES, age_s=OLD)
    prune(store, ORIGIN, HOUR)
    with pytest.raises(RangeOrderError, match="removed from the output store by its retention"):
        check_range_order(store, LsnRange("0/2000", "0/3000"))
    with pytest.raises(CatchUpStateError, match=r"before 0/2E00.*re-take the base snapshot"):
        decide(store, Lsn("0/1F00"), Lsn("0/4000"), Lsn("0/9000"), CAP)


def test_ranges_of_an_earlier_snapshot_go_by_age_alone(tmp_path):
    store = store_with(tmp_path, RANGES, age_s=OLD)
    store.record_chain("slot", Lsn("0/5000"), "snap2")  # a re-snapshot: all of them history
    result = prune(store, Lsn("0/5000"), HOUR)
    assert result.removed == [] and len(result.history) == len(RANGES)
    assert store.ranges() == []


def test_prunes_are_spaced_across_processes_and_never_without_a_retention(tmp_path):
    store = store_with(tmp_path, RANGES, age_s=OLD)
    assert prune_if_due(store, lambda: ORIGIN, None) is None
    first = prune_if_due(store, lambda: ORIGIN, HOUR)  # in a thread of its own
    assert first is not None
    first.join()
    assert on_disk(store) == keys(RANGES[3:])
    within = prune_if_due(OutputStore(store.root), lambda: ORIGIN, HOUR)
    assert within is None  # within the interval
    later = time.time() + prune_interval(HOUR)
    again = prune_if_due(OutputStore(store.root), lambda: ORIGIN, HOUR, now=later)
    assert again is not None
    again.join()


def test_a_retention_that_fell_behind_is_reported_and_a_stalled_apply_is_not(tmp_path):
    store = store_with(tmp_path, RANGES, age_s=OLD + 2 * prune_interval(HOUR) + 60)
    behind = retention_status(store, ORIGIN, HOUR)
    assert behind.ranges == len(RANGES) and behind.last_prune_age_s is None
    assert behind.overdue is not None and "run pgcdc prune" in behind.overdue
    # The target applied only the first range: keeping it is the rule, not a failing prune.
    assert retention_status(store, Lsn("0/1F00"), HOUR).overdue is None
    assert retention_status(store, ORIGIN, None).overdue is None  # forever
    prune(store, ORIGIN, HOUR)
    caught_up = retention_status(store, ORIGIN, HOUR)
    assert caught_up.overdue is None and caught_up.ranges == 2
    assert caught_up.pruned_through == Lsn("0/3800") and caught_up.last_prune_age_s is not None


def test_a_dry_run_removes_nothing(tmp_path):
    store = store_with(tmp_path, RANGES, age_s=OLD)
    result = prune(store, ORIGIN, HOUR, dry_run=True)
    assert len(result.removed) == 3
    assert len(store.ranges()) == len(RANGES)
    chain = store.chain()
    assert chain is not None and chain.pruned_through is None


_KILLED_PRUNE = """
import sys
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster.engine.store.retention import prune
from pgcdc_dagster.engine.store.output_store import OutputStore
prune(OutputStore(sys.argv[1]), Lsn(sys.argv[2]), 3600.0)
"""


@pytest.mark.parametrize("point", ["prune.recorded", "prune.removing"])
def test_a_prune_killed_after_its_record_leaves_ranges_the_chain_skips_and_the_next_removes(
    tmp_path, point
):
    """SIGKILL after the chain record (the ranges still in place) or after they were taken out
    of the store (hidden, not deleted): the chain skips them, decisions stand, the chain lock
    is free again, and the next prune leaves nothing of them."""
    store = store_with(tmp_path, RANGES, age_s=OLD)
    env = {**os.environ, "PGCDC_FAILPOINT": f"{point}=kill"}
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_PRUNE, str(store.root), str(ORIGIN)], env=env, check=False
    )
    assert killed.returncode == -9
    fresh = OutputStore(store.root)
    hidden = sorted(p.name for p in fresh.changes_dir.glob(".pruned-*"))
    if point == "prune.recorded":
        assert len(fresh.ranges()) == len(RANGES) and hidden == []  # nothing removed yet
    else:
        assert [r.key for r in fresh.ranges()] == keys(RANGES[3:])
        assert hidden == [f".pruned-{k}" for k in keys(RANGES[:3])]
    assert [r.key for r in fresh.chain_ranges()] == keys(RANGES[3:])  # the chain skips them
    step = decide(fresh, ORIGIN, Lsn("0/4000"), Lsn("0/9000"), CAP)
    assert isinstance(step, ApplyStored) and step.range == LsnRange("0/4000", "0/5000")
    with fresh.chain_lock():  # the dead prune's lock went with it (a holder would block this)
        pass
    assert prune(fresh, ORIGIN, HOUR).removed == []
    assert on_disk(fresh) == keys(RANGES[3:])


def test_a_snapshot_beginning_waits_for_a_prune_holding_the_chain(tmp_path):
    store = store_with(tmp_path, RANGES, age_s=OLD)
    started = time.monotonic()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\n"
            "from pgcdc_dagster.engine.store.output_store import OutputStore\n"
            "with OutputStore(sys.argv[1]).chain_lock():\n"
            "    print('held', flush=True)\n"
            "    time.sleep(1.5)\n",
            str(store.root),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline() == "held\n"
    store.begin_snapshot("slot")
    assert time.monotonic() - started >= 1.5
    holder.wait()
    chain = store.chain()
    assert chain is not None and not chain.complete


# -- on real servers -------------------------------------------------------------------------


@pytest.fixture
def settings(source_dsn, target_dsn, spark, tmp_path) -> ReplicationSettings:
    run_sql(
        source_dsn,
        "CREATE TABLE log (n int, note text); ALTER TABLE log REPLICA IDENTITY FULL;",
    )
    settings = settings_for(
        source_dsn,
        target_dsn,
        tmp_path,
        "retain",
        tables="public.log",
        follow_cut_ms=50,
        follow_idle_s=1.0,
        store_retention=0.0,
    )
    pipeline.take_snapshot(settings, spark)
    return settings


def count(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM log").fetchone()[0]


def test_a_follow_with_no_retention_keeps_one_applied_range_and_stays_exact(settings):
    """Insert-only, no key: a range applied twice or lost would show in the count."""
    src = settings.source_dsn
    ranges = 0
    for burst in range(4):
        run_sql(src, f"INSERT INTO log SELECT g, 'b{burst}' FROM generate_series(1, 500) g")
        follower = Follower(settings, flush_lsn(src))
        with pipeline.range_lock(settings):
            ranges += sum(1 for _ in follower.run())
        time.sleep(1.1)  # past the prune interval (1 s at retention 0)
    for thread in list(retention._PRUNING.values()):
        thread.join()  # the last apply's prune
    store = pipeline.store_of(settings)
    chain = store.chain()
    assert chain is not None and chain.pruned_through is not None
    assert len(store.ranges()) < ranges
    assert count(settings.target_dsn) == count(src) == 2000
    origin = pipeline.origin_progress(settings)
    assert_chain_records(store, origin)
    assert pipeline.expected_origin_progress(settings) == origin
    # And it goes on from the pruned chain.
    run_sql(src, "INSERT INTO log SELECT g, 'after' FROM generate_series(1, 10) g")
    with pipeline.range_lock(settings):
        list(Follower(settings, flush_lsn(src)).run())
    assert count(settings.target_dsn) == count(src) == 2010
