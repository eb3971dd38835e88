"""Following the source: continuous receive and apply in one process, on real servers."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator

import psycopg
import pyarrow as pa
import pytest

from pgcdc_dagster.engine import failpoints
from pgcdc_dagster.engine.compare import verify
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.control.range_lock import lent_lock, lock_holders, range_lock
from pgcdc_dagster.engine.follow import backlog, range_sizing
from pgcdc_dagster.engine.follow import follower as follow
from pgcdc_dagster.engine.follow.follower import Follower, backlog_range_bytes
from pgcdc_dagster.engine.follow.process import adopt, head_start
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster.engine.settings import MiB, ReplicationSettings
from pgcdc_dagster.engine.source import walsender as slot_stream
from pgcdc_dagster.engine.source.peek import receive_in_cuts
from pgcdc_dagster.engine.source.slot import read_slot
from pgcdc_dagster.engine.store.output_store import EndposOutcome
from pgcdc_dagster_tests.support.pg import flush_lsn, run_sql, set_for_database
from pgcdc_dagster_tests.support.replication import settings_for
from pgcdc_dagster_tests.support.stores import assert_chain_records, on_disk

SCHEMA = """
CREATE TABLE items (id int PRIMARY KEY, name text);
INSERT INTO items SELECT g, 'seed' FROM generate_series(1, 1000) g;
CREATE TABLE log (n int, note text);
ALTER TABLE log REPLICA IDENTITY FULL;
CREATE TABLE unpublished (id serial PRIMARY KEY, payload text);
"""


@pytest.fixture
def settings(source_dsn, target_dsn, spark, tmp_path) -> ReplicationSettings:
    run_sql(source_dsn, SCHEMA)
    settings = settings_for(
        source_dsn,
        target_dsn,
        tmp_path,
        "follow",
        tables="public.items,public.log",
        follow_cut_ms=100,
        follow_idle_s=1.0,
    )
    pipeline.take_snapshot(settings, spark)
    return settings


def follow_to(settings: ReplicationSettings, endpos: Lsn) -> tuple[Follower, list]:
    follower = Follower(settings, endpos)
    with pipeline.range_lock(settings):
        ranges = list(follower.run())
    return follower, ranges


def count(dsn: str, table: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]


def equal(settings: ReplicationSettings) -> bool:
    comparisons = verify.compare_tables(settings, pipeline.replicated_tables(settings))
    return all(c.equal for c in comparisons)


def insert_lsn(dsn: str) -> Lsn:
    with psycopg.connect(dsn) as conn:
        return Lsn(conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])


def test_follow_stops_at_an_endpos_in_each_of_the_four_outcomes(settings):
    src = settings.source_dsn

    # At a commit boundary: the endpos is the last commit's end.
    run_sql(src, "INSERT INTO items VALUES (2001, 'a')")
    boundary = insert_lsn(src)
    follower, ranges = follow_to(settings, boundary)
    assert follower.summary.stopped_by == "endpos"
    last = ranges[-1].done.received
    assert last.endpos == str(boundary)
    assert last.endpos_outcome == EndposOutcome.AT_COMMIT_BOUNDARY
    assert pipeline.origin_progress(settings) == boundary

    # Between transactions: WAL of an unpublished table after the last commit.
    run_sql(src, "INSERT INTO items VALUES (2002, 'b')")
    committed = insert_lsn(src)
    run_sql(src, "INSERT INTO unpublished (payload) VALUES ('x')", "SELECT pg_switch_wal()")
    between = flush_lsn(src)
    follower, ranges = follow_to(settings, between)
    last = ranges[-1].done.received
    assert (last.endpos, last.endpos_outcome) == (str(between), EndposOutcome.BETWEEN_TRANSACTIONS)
    assert pipeline.origin_progress(settings) == committed  # never past the last commit

    # Mid-transaction: the straddler is not applied, and goes whole to the next range.
    with psycopg.connect(src) as open_txn:
        open_txn.execute("INSERT INTO items VALUES (3001, 'straddler 1')")
        mid = insert_lsn(src)
        open_txn.execute("INSERT INTO items VALUES (3002, 'straddler 2')")
        open_txn.commit()
    run_sql(src, "SELECT pg_switch_wal()")
    follower, ranges = follow_to(settings, mid)
    last = ranges[-1].done.received
    assert (last.endpos, last.endpos_outcome) == (str(mid), EndposOutcome.MID_TRANSACTION)
    assert count(settings.target_dsn, "items WHERE id > 3000") == 0

    # Empty: nothing published between the previous endpos and this one... except the
    # straddler, which commits after it: so first take the straddler, then an empty range.
    follow_to(settings, flush_lsn(src))
    assert count(settings.target_dsn, "items WHERE id > 3000") == 2
    run_sql(src, "INSERT INTO unpublished (payload) VALUES ('y')")
    empty = flush_lsn(src)
    follower, ranges = follow_to(settings, empty)
    (only,) = ranges
    assert (only.done.received.endpos_outcome, only.done.received.endpos) == (
        EndposOutcome.EMPTY,
        str(empty),
    )
    assert follower.summary.stopped_by == "endpos"
    assert equal(settings)

    # Asking again for an endpos already reached does nothing.
    follower, ranges = follow_to(settings, empty)
    assert ranges == [] and follower.summary.stopped_by == "endpos"


def cut(backlog: int, cap: int) -> list[int]:
    """The sizes the receiver cuts a backlog of ``backlog`` bytes into (nothing arriving)."""
    sizes: list[int] = []
    previous = None
    while backlog > 0:
        size = backlog_range_bytes(previous, backlog, cap)
        taken = min(size, backlog)
        sizes.append(taken)
        backlog -= taken
        previous = size if taken == size and backlog else None
    return sizes


def test_a_backlog_of_up_to_two_ranges_is_cut_small_first_doubling_then_halving():
    first = range_sizing.FIRST_RANGE_BYTES
    sizes = cut(43_700_000, 32 * MiB)  # 80k pgbench transactions
    assert sum(sizes) == 43_700_000
    assert sizes[:2] == [first, 2 * first]
    assert sizes[-1] <= first and max(sizes) < 32 * MiB
    # A bigger backlog is cut at the cap (every range more costs the source a decode).
    big = cut(2_000 * MiB, 32 * MiB)
    assert big[:-1] == [32 * MiB] * (len(big) - 1) and big[-1] == 2_000 * MiB % (32 * MiB)
    # A cap below the first size keeps its meaning: every range at most the cap.
    assert set(cut(10 * MiB, MiB)) == {MiB}
    assert set(cut(int(1.5 * MiB), MiB)) == {MiB, MiB // 2}
    # A backlog that fits in one range is one range, as is every live range.
    assert cut(20 * MiB, 32 * MiB) == [20 * MiB]
    assert cut(first - 1, 32 * MiB) == [first - 1]


def write_backlog(settings: ReplicationSettings) -> tuple[Lsn, Lsn]:
    """2,000 transactions of an insert into ``log`` and an update of ``items``, written while
    nothing follows; the flushed WAL position before and after them."""
    start = flush_lsn(settings.source_dsn)
    with psycopg.connect(settings.source_dsn, autocommit=True) as conn:
        for n in range(1, 2001):
            with conn.transaction():
                conn.execute("INSERT INTO log VALUES (%s, 'backlog')", (n,))
                conn.execute("UPDATE items SET name = %s WHERE id = %s", (f"b{n}", n % 1000 + 1))
    return start, flush_lsn(settings.source_dsn)


def record_peeks(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Lsn, Lsn, Lsn]]:
    """Every peek the follower reads in cuts, as it happens: (its start, where it ended, its
    goal); the real :func:`receive_in_cuts` still does the work."""
    peeks: list[tuple[Lsn, Lsn, Lsn]] = []

    def recorded(conn, slot, publication, store, range_start, goal, **kwargs):
        ended = receive_in_cuts(conn, slot, publication, store, range_start, goal, **kwargs)
        peeks.append((range_start, ended, goal))
        return ended

    monkeypatch.setattr(follow, "receive_in_cuts", recorded)
    return peeks


def backlog_of_one_and_a_half_ranges(
    settings: ReplicationSettings, monkeypatch: pytest.MonkeyPatch
) -> tuple[ReplicationSettings, Lsn]:
    """2,000 transactions written while nothing follows, a first size of 64 KiB and a cap for
    which the backlog is 1.5 ranges: a first range, then the rest by one peek in cuts."""
    monkeypatch.setattr(range_sizing, "FIRST_RANGE_BYTES", 64 * 1024)
    start, endpos = write_backlog(settings)
    cap = (endpos - start) * 2 // 3
    assert cap > 256 * 1024
    return settings.model_copy(update={"follow_range_bytes": cap}), endpos


def test_a_backlog_is_received_in_growing_then_shrinking_ranges_exactly_once(settings, monkeypatch):
    """Real servers: the ranges are contiguous, grow then shrink, every cut of the one peek is
    a commit boundary, the endpos range ends exactly at the endpos, and every row arrives once
    (a table without a key keeps the source's count)."""
    settings, endpos = backlog_of_one_and_a_half_ranges(settings, monkeypatch)
    follower, ranges = follow_to(settings, endpos)
    received = [r.done.received for r in ranges]
    bounds = [(Lsn.parse(r.start_lsn), Lsn.parse(r.endpos)) for r in received]
    sizes = [end - start for start, end in bounds]
    assert len(ranges) >= 4, sizes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    # The first two ranges are a peek each; the rest is one peek cut just after the first
    # COMMIT at or past each size, so every cut is a commit boundary. That peek's first range
    # is the size of the one before (the applier waits for it), then they double and halve.
    assert sizes[:2] == [64 * 1024, 128 * 1024]
    assert 128 * 1024 <= sizes[2] < 128 * 1024 + 4096, sizes
    planned = sizes[1] // 2
    for r, (start, end) in zip(received[2:-1], bounds[2:-1], strict=True):
        planned = backlog_range_bytes(planned, endpos - start, settings.follow_range_bytes)
        assert planned <= end - start < planned + 4096, sizes
        assert r.transform_lsn == r.endpos == r.safe_point
        assert r.endpos_outcome == EndposOutcome.AT_COMMIT_BOUNDARY
    assert sizes[-1] <= 64 * 1024 and bounds[-1][1] == endpos
    assert follower.summary.stopped_by == "endpos"
    assert sum(r.transactions for r in received) == 2000
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") == 2000
    assert equal(settings)


def test_a_stop_between_the_cuts_of_one_peek_ends_at_a_cut_and_the_next_follow_resumes(
    settings, monkeypatch
):
    """A stop while the rest of a backlog streams from one peek: the follower ends at the
    next cut, every stored range is applied, the slot is advanced to it (the peek advances
    it once, at its end or its stop), and a new follow finishes exactly once."""
    settings, endpos = backlog_of_one_and_a_half_ranges(settings, monkeypatch)
    monkeypatch.setenv(failpoints.ENV, "receive.after_store=sleep(0.3)")
    monkeypatch.setattr(failpoints, "_armed", None)
    follower = Follower(settings, endpos)
    seen = []
    with pipeline.range_lock(settings):
        for followed in follower.run():
            seen.append(followed.done.received)
            if len(seen) == 2:
                follower.stop("test")
    monkeypatch.setattr(failpoints, "_armed", {})
    assert follower.summary.stopped_by == "test"
    last_end = Lsn.parse(seen[-1].endpos)
    assert len(seen) == 3 and last_end < endpos  # two peeks of their own, one cut
    assert read_slot_confirmed(settings) == last_end
    assert pipeline.origin_progress(settings) == pipeline.expected_origin_progress(settings)
    follow_to(settings, endpos)
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") == 2000
    assert equal(settings)


def test_a_peek_read_in_cuts_ends_where_the_applier_falls_behind_and_the_next_goes_on(
    settings, monkeypatch
):
    """A slow applier: a peek does not hold its transaction open waiting for room in the
    queue (a source's idle_in_transaction_session_timeout would end it). It ends at that cut
    and the next peek goes on from there, the sizes going on as planned, spanning one range
    (not decoding again what the applier could not take); every transaction arrives once."""
    settings, endpos = backlog_of_one_and_a_half_ranges(settings, monkeypatch)
    monkeypatch.setattr(follow, "PEEK_WAIT_S", 0.01)
    monkeypatch.setenv(failpoints.ENV, "catchup.before_apply=sleep(0.3)")
    monkeypatch.setattr(failpoints, "_armed", None)
    peeks = record_peeks(monkeypatch)
    follower, ranges = follow_to(settings, endpos)
    monkeypatch.setattr(failpoints, "_armed", {})
    received = [r.done.received for r in ranges]
    bounds = [(Lsn.parse(r.start_lsn), Lsn.parse(r.endpos)) for r in received]
    start, ended, goal = peeks[0]
    assert start < ended < goal  # ended at a cut, short of its goal: the applier was behind
    cap = settings.follow_range_bytes
    assert len(peeks) >= 2 and all(g - s <= cap for s, _, g in peeks[1:]), (cap, peeks)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert follower.summary.stopped_by == "endpos" and bounds[-1][1] == endpos
    assert sum(r.transactions for r in received) == 2000
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") == 2000
    assert equal(settings)


def test_a_backlog_of_many_ranges_is_read_by_bounded_peeks_exactly_once(settings, monkeypatch):
    """Real servers: after its first range, a backlog of many capped ranges is read by
    several peeks of at most PEEK_MAX_RANGES caps each, neither a peek per range nor one for
    it all. The ranges are contiguous, a cut inside a peek is a commit boundary, the last
    range ends at the endpos, and every row arrives once."""
    monkeypatch.setattr(follow, "PEEK_MAX_RANGES", 2)
    cap = 64 * 1024
    settings = settings.model_copy(update={"follow_range_bytes": cap})
    start, endpos = write_backlog(settings)
    assert endpos - start > 8 * cap
    recorded = record_peeks(monkeypatch)
    follower, ranges = follow_to(settings, endpos)
    peeks = [(begin, goal) for begin, _, goal in recorded]
    received = [r.done.received for r in ranges]
    bounds = [(Lsn.parse(r.start_lsn), Lsn.parse(r.endpos)) for r in received]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert bounds[-1][1] == endpos and follower.summary.stopped_by == "endpos"
    # The first range by a peek of its own, the rest by peeks of at most two caps, which
    # follow each other to the endpos.
    assert bounds[0][1] - bounds[0][0] == cap
    assert len(peeks) >= 3 and peeks[0][0] == bounds[1][0] and peeks[-1][1] == endpos, peeks
    assert all(goal - begin <= 2 * cap for begin, goal in peeks), peeks
    assert all(a[1] == b[0] for a, b in itertools.pairwise(peeks))
    assert len(ranges) < 2 * len(peeks) + 2, (len(ranges), len(peeks))
    ends = {goal for _, goal in peeks}
    for r, (_, end) in zip(received[1:-1], bounds[1:-1], strict=True):
        if end not in ends:  # a cut inside a peek: just after a COMMIT
            assert r.transform_lsn == r.endpos == r.safe_point
            assert r.endpos_outcome == EndposOutcome.AT_COMMIT_BOUNDARY
    assert sum(r.transactions for r in received) == 2000
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") == 2000
    assert equal(settings)
    assert_chain_records(pipeline.store_of(settings), pipeline.origin_progress(settings))


def test_ranges_waiting_for_their_run_past_the_backlogs_memory_wait_on_disk_in_order(
    settings, monkeypatch
):
    """A follow's run that cannot record (Dagster's storage away) does not hold its follower
    back: the ranges it applies meanwhile wait, past the first BACKLOG_KEPT in memory, in the
    backlog's file, and reach the run in order, each once; the file goes with the follower."""
    monkeypatch.setattr(backlog, "BACKLOG_KEPT", 2)
    settings = settings.model_copy(update={"follow_range_bytes": 64 * 1024})
    _, endpos = write_backlog(settings)
    follower = Follower(settings, endpos)
    with pipeline.range_lock(settings):
        follower.start()  # nobody takes its ranges yet: a run held up by its storage
        deadline = time.monotonic() + 60
        while pipeline.origin_progress(settings) != endpos:
            assert time.monotonic() < deadline, "the follower waited for its run"
            time.sleep(0.1)
        waiting = follower._done
        assert waiting.in_memory == 2 and waiting.qsize() > 3 and waiting.spilled > 0
        ranges = list(follower.run())
    bounds = [(r.done.received.start_lsn, r.done.received.endpos) for r in ranges]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    assert Lsn.parse(bounds[-1][1]) == endpos and follower.summary.stopped_by == "endpos"
    assert len(ranges) == follower.summary.ranges > 3
    assert sum(r.done.received.transactions for r in ranges) == 2000
    assert waiting._file is None
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") == 2000
    assert equal(settings)


_KILLED_FOLLOWER = """
import sys
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.follow import follower as follow
from pgcdc_dagster.engine.follow import range_sizing
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster.engine.settings import ReplicationSettings

range_sizing.FIRST_RANGE_BYTES = 64 * 1024
follow.PEEK_MAX_RANGES = int(sys.argv[3])
settings = ReplicationSettings.model_validate_json(sys.argv[1])
endpos = None if sys.argv[2] == "none" else Lsn.parse(sys.argv[2])
with pipeline.range_lock(settings):
    for _ in follow.Follower(settings, endpos).run():
        pass
"""


@pytest.mark.parametrize(
    ("point", "stored_before"),
    [
        # Just after the second range cut from the peek (the fourth range) is stored.
        ("receive.after_store=kill@4", 4),
        # While the third range from the peek is decoded: its writer's folder is half made.
        ("receive.fetching=kill@4", 3),
    ],
)
def test_a_kill_between_the_cuts_of_one_peek_then_a_follow_converges_exactly_once(
    settings, monkeypatch, point, stored_before
):
    """SIGKILL of a real follower process while one peek is cut into ranges, with the slot
    still where the second range (a peek of its own) left it: stored ranges the slot lags
    (applied or not), perhaps a range's unfinished folder. A new follow finishes them, exactly
    once, and leaves no unfinished folder behind."""
    settings, endpos = backlog_of_one_and_a_half_ranges(settings, monkeypatch)
    kill_follower(settings, endpos, point)
    store = pipeline.store_of(settings)
    stored = store.chain_ranges()
    assert len(stored) == stored_before and stored[-1].end < endpos
    # The crash window: the slot stands where the second range left it (its end, or the start
    # of a COMMIT record its end fell inside: the range's safe point).
    second = store.get(stored[1])
    assert second is not None and read_slot_confirmed(settings) == second.safe_point
    unfinished = [n for n in on_disk(store) if n.startswith(".tmp-")]
    assert bool(unfinished) == point.startswith("receive.fetching")
    follower, _ = follow_to(settings, endpos)
    assert follower.summary.stopped_by == "endpos"
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") == 2000
    assert equal(settings)
    assert not [n for n in on_disk(store) if n.startswith(".tmp-")]
    assert_chain_records(store, pipeline.origin_progress(settings))


def test_a_kill_between_a_ranges_rename_and_its_scratch_folders_removal_then_a_follow_converges(
    settings, monkeypatch
):
    """SIGKILL of a real follower process once a range is renamed into its bucket and synced,
    before its writer's emptied scratch folder goes and before the slot moves: the range is
    stored whole (it counts, and is not received again), and a new follow finishes exactly
    once and removes the empty scratch folder (no writer of that start comes again; left,
    it would keep its bucket once a prune empties it)."""
    settings, endpos = backlog_of_one_and_a_half_ranges(settings, monkeypatch)
    kill_follower(settings, endpos, "store.renamed=kill@3")
    store = pipeline.store_of(settings)
    stored = store.chain_ranges()
    assert len(stored) == 3 and stored[-1].end < endpos
    third = store.get(stored[2])
    assert third is not None and third.manifest.result.range_key == stored[2].key
    left = [n for n in on_disk(store) if n.startswith(".tmp-")]
    assert left == [f".tmp-{stored[2].start.hex16}"]
    assert not any(store.bucket_of(stored[2].start).joinpath(left[0]).iterdir())
    follower, ranges = follow_to(settings, endpos)
    assert follower.summary.stopped_by == "endpos"
    received = [r.done.received.range_key for r in ranges if r.lag_bytes is not None]
    assert received and stored[2].key not in received  # found stored, not received again
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") == 2000
    assert equal(settings)
    assert not [n for n in on_disk(store) if n.startswith(".tmp-")]
    assert_chain_records(store, pipeline.origin_progress(settings))


def kill_follower(
    settings: ReplicationSettings, endpos: Lsn | None, point: str, peek_max_ranges: int = 4
) -> None:
    """Follow to ``endpos`` (``None``: for ever) in a real process that the failpoint ``point``
    SIGKILLs."""
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_FOLLOWER, settings.model_dump_json(),
         "none" if endpos is None else str(endpos), str(peek_max_ranges)],
        env={**os.environ, failpoints.ENV: point},
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr


def test_a_kill_in_the_second_of_a_backlogs_bounded_peeks_then_a_follow_converges_exactly_once(
    settings,
):
    """SIGKILL of a real follower process once the second bounded peek of a backlog of many
    ranges has stored its first range: the slot stands where the first bounded peek ended
    (advanced once, at its end), behind the range stored since. A new follow finishes,
    exactly once, and every range records the chain's last commit."""
    cap = 64 * 1024
    settings = settings.model_copy(update={"follow_range_bytes": cap})
    start, endpos = write_backlog(settings)
    assert endpos - start > 8 * cap
    # Ranges: the first (a peek of its own), two from the first bounded peek, then the kill
    # just after the first of the second is stored.
    kill_follower(settings, endpos, "receive.after_store=kill@4", peek_max_ranges=2)
    store = pipeline.store_of(settings)
    stored = store.chain_ranges()
    assert len(stored) == 4 and stored[-1].end < endpos
    assert stored[2].end - stored[1].start <= 2 * cap  # the first bounded peek: two ranges
    third = store.get(stored[2])  # the crash window: the slot where the first peek left it
    assert third is not None and read_slot_confirmed(settings) == third.safe_point
    follower, _ = follow_to(settings, endpos)
    assert follower.summary.stopped_by == "endpos"
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") == 2000
    assert equal(settings)
    assert_chain_records(store, pipeline.origin_progress(settings))


def read_slot_confirmed(settings: ReplicationSettings) -> Lsn:
    with psycopg.connect(settings.source_dsn) as conn:
        confirmed = read_slot(conn, settings.slot).confirmed_flush_lsn
    assert confirmed is not None
    return confirmed


def writer(dsn: str, stop: threading.Event) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        n = 0
        while not stop.is_set():
            n += 1
            with conn.transaction():
                conn.execute("INSERT INTO log VALUES (%s, 'w')", (n,))
                conn.execute("UPDATE items SET name = %s WHERE id = %s", (f"v{n}", n % 1000 + 1))
            time.sleep(0.002)


def follow_while_writing(
    settings: ReplicationSettings,
    on_range: Callable[[int, Follower], None],
    then: Callable[[Follower], None] = lambda follower: None,
) -> Follower:
    """Follow (no endpos) while :func:`writer` commits, calling ``on_range(n, follower)`` after
    the n-th range is done and ``then(follower)`` once the follower has ended, the writer
    still writing; the writes stop on the way out."""
    stop_writing = threading.Event()
    writing = threading.Thread(target=writer, args=(settings.source_dsn, stop_writing))
    writing.start()
    try:
        follower = Follower(settings)
        with pipeline.range_lock(settings):
            for n, _ in enumerate(follower.run(), 1):
                on_range(n, follower)
        then(follower)
    finally:
        stop_writing.set()
        writing.join()
    return follower


def stop_after(ranges: int) -> Callable[[int, Follower], None]:
    def on_range(n: int, follower: Follower) -> None:
        if n == ranges:
            follower.stop("test")

    return on_range


def test_a_stop_mid_stream_ends_at_a_boundary_and_the_next_follow_resumes_exactly_once(settings):
    def nothing_half_done(follower: Follower) -> None:
        assert follower.summary.stopped_by == "test"
        assert follower.summary.ranges >= 5
        # Nothing half done: the origin is exactly at the last stored commit.
        assert pipeline.origin_progress(settings) == pipeline.expected_origin_progress(settings)
        time.sleep(1)  # more writes for the next follow

    follow_while_writing(settings, stop_after(5), then=nothing_half_done)
    follow_to(settings, flush_lsn(settings.source_dsn))
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") > 0
    assert equal(settings)


def terminate_pgcdc_session(dsn: str, state: str, waiting_for: str | None = None) -> int:
    """Terminate this database's pgcdc sessions once one is in ``state`` (and waits for
    ``waiting_for``, a wait event type, when given); waits up to 5 s for that."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            killed = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name = 'pgcdc_dagster' AND datname = current_database() "
                "AND pid <> pg_backend_pid() AND state = %s "
                "AND (%s::text IS NULL OR wait_event_type = %s)",
                (state, waiting_for, waiting_for),
            ).fetchall()
            if killed:
                return len(killed)
            time.sleep(0.02)
    return 0


@pytest.mark.parametrize("where", ["between ranges", "in a statement", "at its commit"])
def test_the_target_connection_kept_across_ranges_is_replaced_when_lost(
    settings, monkeypatch, where
):
    """The applier keeps one target connection. After the second range its backend is
    terminated: while the applier pauses before the next range, while a statement of that
    range's apply waits for a lock, or while its transaction is open before COMMIT. The range
    is applied again on a new connection and the follow goes on, every transaction once."""
    pause = {
        "between ranges": "catchup.before_apply=sleep(1.5)@3",
        "at its commit": "apply.in_transaction=sleep(1.5)@3",
    }.get(where)
    if pause:
        monkeypatch.setenv(failpoints.ENV, pause)
        monkeypatch.setattr(failpoints, "_armed", None)
    stop = stop_after(6)

    def on_range(n: int, follower: Follower) -> None:
        if n == 2 and where == "in a statement":
            with psycopg.connect(settings.target_dsn) as blocker:  # its transaction: the lock
                blocker.execute("LOCK TABLE items IN SHARE MODE")  # staging passes, writes wait
                assert terminate_pgcdc_session(settings.target_dsn, "active", "Lock") == 1
        elif n == 2:
            state = "idle" if where == "between ranges" else "idle in transaction"
            assert terminate_pgcdc_session(settings.target_dsn, state) == 1  # the kept one
        stop(n, follower)

    follower = follow_while_writing(settings, on_range)
    monkeypatch.setattr(failpoints, "_armed", {})
    assert follower.summary.stopped_by == "test"
    assert follower.summary.target_reconnects == 1
    follow_to(settings, flush_lsn(settings.source_dsn))
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") > 0
    assert equal(settings)


def test_an_idle_source_with_wal_moving_elsewhere_keeps_the_slot_moving(settings):
    follower = Follower(settings)
    thread = threading.Thread(target=lambda: list(follower.run()))
    with pipeline.range_lock(settings):
        thread.start()
        try:
            for _ in range(4):
                run_sql(
                    settings.source_dsn,
                    "INSERT INTO unpublished (payload) SELECT 'w' FROM generate_series(1, 2000)",
                    "SELECT pg_switch_wal()",
                )
                time.sleep(0.8)
            moved_to = flush_lsn(settings.source_dsn)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                with psycopg.connect(settings.source_dsn) as conn:
                    confirmed = read_slot(conn, settings.slot).confirmed_flush_lsn
                if confirmed >= moved_to:
                    break
                time.sleep(0.2)
            assert confirmed >= moved_to
        finally:
            follower.stop("test")
            thread.join()
    assert follower.summary.transactions == 0
    # Empty ranges were stored now and then, not at every poll.
    assert 1 <= follower.summary.ranges <= 10


def test_a_200k_row_transaction_under_follow_keeps_memory_bounded(settings):
    run_sql(
        settings.source_dsn,
        "INSERT INTO log SELECT g, repeat('z', 40) FROM generate_series(1, 200000) g",
    )
    pool = pa.default_memory_pool()
    before = pool.max_memory()
    tracemalloc.start()
    try:
        follower, _ = follow_to(settings, flush_lsn(settings.source_dsn))
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert follower.summary.changes == 200_000
    assert count(settings.target_dsn, "log") == 200_000
    # No row is ever a Python object for long: the decoder builds columns and spills past
    # 100k rows, the queue between receive and apply holds manifests, not rows. (200k rows as
    # Python tuples would take well over 60 MB.)
    assert python_peak < 40 * 1024 * 1024, f"peak Python memory {python_peak / 1e6:.1f} MB"
    # The in-process compaction holds one range's changes as Arrow (~600 bytes a change here);
    # ranges past partition_changes are applied one key-hash partition at a time, which bounds
    # it (test_big_transaction.py).
    assert pool.max_memory() - before < 200 * 1024 * 1024, pool.max_memory()


def test_a_head_start_works_before_its_consumer_exists_and_hands_over_lock_and_ranges(settings):
    """The CLI's head start: the lock is taken and lent, the follower works on its own, and
    whoever adopts it later gets every range it did, in order, once."""
    src = settings.source_dsn
    run_sql(src, "INSERT INTO items SELECT g, 'head' FROM generate_series(5001, 5200) g")
    run_sql(src, "INSERT INTO log VALUES (1, 'head start')")
    endpos = flush_lsn(src)
    dsn, slot = settings.target_dsn, settings.slot
    assert lent_lock(dsn, slot) is None
    with range_lock(dsn, slot, "pid test", lend=True) as lock:
        assert lent_lock(dsn, slot) is lock
        follower = head_start(settings, endpos, None)
        deadline = time.monotonic() + 60
        while pipeline.origin_progress(settings) != endpos:  # nobody is consuming yet
            assert time.monotonic() < deadline, "the head start did not apply on its own"
            time.sleep(0.1)
        lock.rename("run adopted")
        assert [h.holder for h in lock_holders(dsn, slot)] == ["run adopted"]
        assert adopt(slot) is follower
        assert adopt(slot) is None  # adopted once
        ranges = list(follower.run())
    assert lent_lock(dsn, slot) is None
    assert lock_holders(dsn, slot) == []
    assert ranges and ranges[-1].done.received.endpos == str(endpos)
    assert sum(r.done.received.transactions for r in ranges) == 2
    assert follower.summary.stopped_by == "endpos"
    assert count(settings.target_dsn, "items WHERE name = 'head'") == 200
    assert equal(settings)


# -- reading by stream once the follow keeps up --------------------------------------------------


@contextlib.contextmanager
def following(settings: ReplicationSettings) -> Iterator[Follower]:
    """A follower without an endpos, running in a thread under the range lock, half a second
    in (its stream or first peek under way); stopped and joined on the way out."""
    follower = Follower(settings)
    thread = threading.Thread(target=lambda: list(follower.run()))
    with pipeline.range_lock(settings):
        thread.start()
        try:
            time.sleep(0.5)
            yield follower
        finally:
            follower.stop("test")
            thread.join()


def streaming_sessions(dsn: str) -> int:
    """The follower's walsender sessions on the source (``START_REPLICATION`` under way)."""
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE backend_type = 'walsender' AND application_name = %s",
            (slot_stream.STREAMING,),
        ).fetchone()[0]


def test_a_follow_that_keeps_up_reads_by_stream_exactly_once_and_lets_the_slot_go(settings):
    """Without an endpos and caught up, the follow reads by a ``START_REPLICATION`` stream (its
    walsender is seen while it runs). Every range ends outside a transaction, where the slot
    is confirmed once the range is stored; a stop stores what is whole and lets the slot go at
    once (a peek right after does not find it in use); the next follow resumes exactly once."""
    seen: list[int] = []

    def on_range(n: int, follower: Follower) -> None:
        if n == 3:
            seen.append(streaming_sessions(settings.source_dsn))
        if n == 8:
            follower.stop("test")

    def stopped(follower: Follower) -> None:
        with psycopg.connect(settings.source_dsn) as conn:
            assert not read_slot(conn, settings.slot).active
        assert pipeline.origin_progress(settings) == pipeline.expected_origin_progress(settings)
        time.sleep(1)  # more writes for the next follow

    follower = follow_while_writing(settings, on_range, then=stopped)
    assert seen == [1] and follower.summary.streams >= 1
    # Its decoding and storing count as the receiver's busy time, its waits do not.
    assert 0 < follower.summary.receive_busy_s < follower.summary.seconds
    store = pipeline.store_of(settings)
    results = [store.get(r).manifest.result for r in store.chain_ranges()]
    assert {r.endpos_outcome for r in results} <= {
        EndposOutcome.AT_COMMIT_BOUNDARY,
        EndposOutcome.BETWEEN_TRANSACTIONS,
        EndposOutcome.EMPTY,
    }
    assert all(r.safe_point == r.endpos and not r.straddlers for r in results)
    assert read_slot_confirmed(settings) == store.chain_end()
    follow_to(settings, flush_lsn(settings.source_dsn))
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") > 0
    assert equal(settings)
    assert_chain_records(store, pipeline.origin_progress(settings))


@pytest.mark.parametrize("follow_read", ["stream", "peek"])
def test_an_idle_follow_moves_the_slot_by_either_reader(settings, follow_read):
    """Both readers keep the slot moving while WAL moves elsewhere, by empty ranges now and
    then (the stream by its keepalives' positions)."""
    settings = settings.model_copy(update={"follow_read": follow_read})
    with following(settings) as follower:
        assert streaming_sessions(settings.source_dsn) == (follow_read == "stream")
        run_sql(settings.source_dsn, "INSERT INTO unpublished (payload) VALUES ('w')")
        moved_to = flush_lsn(settings.source_dsn)
        deadline = time.monotonic() + 10
        while read_slot_confirmed(settings) < moved_to and time.monotonic() < deadline:
            time.sleep(0.1)
        assert read_slot_confirmed(settings) >= moved_to
    assert follower.summary.transactions == 0 and follower.summary.ranges >= 1
    assert (follower.summary.streams >= 1) == (follow_read == "stream")


def test_a_200k_row_transaction_read_by_stream_is_stored_whole_in_bounded_memory(settings):
    """A big transaction reaches a follow that streams: it is decoded in batches and spilled
    (as by a peek), stored whole in one range, and the follow goes on streaming."""
    tracemalloc.start()
    try:
        with following(settings) as follower:
            run_sql(
                settings.source_dsn,
                "INSERT INTO log SELECT g, repeat('z', 40) FROM generate_series(1, 200000) g",
            )
            run_sql(settings.source_dsn, "INSERT INTO log VALUES (0, 'after')")
            deadline = time.monotonic() + 60
            while count(settings.target_dsn, "log") < 200_001:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert streaming_sessions(settings.source_dsn) == 1
        _, python_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert follower.summary.changes == 200_001
    store = pipeline.store_of(settings)
    sizes = [store.get(r).manifest.result.changes for r in store.chain_ranges()]
    assert 200_000 in sizes or 200_001 in sizes  # whole, in one range
    assert python_peak < 40 * 1024 * 1024, f"peak Python memory {python_peak / 1e6:.1f} MB"
    assert equal(settings)


@pytest.mark.parametrize(
    "point",
    [
        # A range is stored and the stream has not yet confirmed it to the slot.
        "receive.after_store=kill@6",
        # A range is being decoded from the stream: its writer's folder is half made.
        "receive.fetching=kill@6",
    ],
)
def test_a_kill_while_streaming_then_a_follow_converges_exactly_once(settings, point):
    """SIGKILL of a real follower process that reads by stream while writes go on. Its
    walsender lets the slot go by itself, the slot stands at or before the store's last range,
    and a new follow started at once (no wait for the slot) finishes exactly once."""
    stop_writing = threading.Event()
    writing = threading.Thread(target=writer, args=(settings.source_dsn, stop_writing))
    writing.start()
    try:
        kill_follower(settings, None, point)
    finally:
        stop_writing.set()
        writing.join()
    store = pipeline.store_of(settings)
    assert read_slot_confirmed(settings) <= store.chain_end()
    if point.startswith("receive.after_store"):
        assert read_slot_confirmed(settings) < store.chain_end()  # the window: stored, unconfirmed
    follower, _ = follow_to(settings, flush_lsn(settings.source_dsn))
    assert follower.summary.stopped_by == "endpos"
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") > 0
    assert equal(settings)
    assert not [n for n in on_disk(store) if n.startswith(".tmp-")]
    assert_chain_records(store, pipeline.origin_progress(settings))


def test_a_stream_waits_for_a_slow_applier_and_goes_on_streaming_exactly_once(
    settings, monkeypatch
):
    """The applier stalls (2.5 s on one range) while writes go on: the stream's ranges wait
    for room in the queue, the walsender is told the session is alive meanwhile, and the same
    stream goes on once the applier is back; every transaction once."""
    monkeypatch.setenv(failpoints.ENV, "catchup.before_apply=sleep(2.5)@3")
    monkeypatch.setattr(failpoints, "_armed", None)
    monkeypatch.setattr(failpoints, "_hits", {})
    seen: list[int] = []

    def on_range(n: int, follower: Follower) -> None:
        if n == 10:
            seen.append(streaming_sessions(settings.source_dsn))
            follower.stop("test")

    follower = follow_while_writing(settings, on_range)
    assert seen == [1] and follower.summary.streams == 1
    follow_to(settings, flush_lsn(settings.source_dsn))
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") > 0
    assert equal(settings)


def test_a_stream_left_behind_hands_the_backlog_to_peeks_and_comes_back_exactly_once(
    settings, monkeypatch
):
    """With a 64 KiB range cap, the applier stalls for 2.5 s while writes go on: once the
    source's WAL is more than a cap ahead of the stream, the stream ends, peeks read that
    backlog, and a new stream takes over once they have caught up; every transaction once."""
    settings = settings.model_copy(update={"follow_range_bytes": 64 * 1024})
    monkeypatch.setenv(failpoints.ENV, "catchup.before_apply=sleep(2.5)@3")
    monkeypatch.setattr(failpoints, "_armed", None)
    monkeypatch.setattr(failpoints, "_hits", {})
    streams: list[int] = []

    def on_range(n: int, follower: Follower) -> None:
        if follower.summary.streams >= 2 and not streams:
            streams.append(n)
        if (streams and n >= streams[0] + 3) or n >= 300:  # 300: it never came back
            follower.stop("test")

    follower = follow_while_writing(settings, on_range)
    assert streams and follower.summary.streams >= 2
    follow_to(settings, flush_lsn(settings.source_dsn))
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") > 0
    assert equal(settings)
    assert_chain_records(pipeline.store_of(settings), pipeline.origin_progress(settings))


@pytest.mark.parametrize("follow_read", ["stream", "peek"])
def test_a_publication_dropped_under_a_follow_ends_it_in_one_line_naming_it(settings, follow_read):
    """The publication is dropped while the follow runs; the next change ends the follow with
    the fix (a stream's walsender finds the publication gone when it decodes the change; a
    peek looks first), not an outage retried for ever; the changes before it are applied."""
    settings = settings.model_copy(update={"follow_read": follow_read})
    follower = Follower(settings)
    errors: list[BaseException] = []

    def follow() -> None:
        try:
            list(follower.run())
        except BaseException as exc:  # the follow's own error, raised by run()
            errors.append(exc)

    thread = threading.Thread(target=follow)
    with pipeline.range_lock(settings):
        thread.start()
        try:
            run_sql(settings.source_dsn, "INSERT INTO log VALUES (1, 'before')")
            deadline = time.monotonic() + 10
            while count(settings.target_dsn, "log") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert streaming_sessions(settings.source_dsn) == (follow_read == "stream")
            run_sql(settings.source_dsn, f'DROP PUBLICATION "{settings.publication}"')
            run_sql(settings.source_dsn, "INSERT INTO log VALUES (2, 'after')")
            thread.join(timeout=20)
        finally:
            follower.stop("test")
            thread.join()
    assert len(errors) == 1, errors
    message = str(errors[0])
    assert settings.publication in message and "does not exist" in message
    assert "create the publication" in message and "\n" not in message
    assert count(settings.target_dsn, "log") == 1


# -- Transactions streamed before their COMMIT (pgoutput protocol 2, `streaming`) -----------


def streamed_settings(settings: ReplicationSettings) -> ReplicationSettings:
    """The walsender streams any transaction past 64 kB of decoded changes (the least
    ``logical_decoding_work_mem``), so a few thousand rows come before their COMMIT."""
    return settings.model_copy(update={"decoding_work_mem": 64 * 1024})


def streamed_transactions(settings: ReplicationSettings) -> int:
    """Transactions the slot's walsenders streamed before their COMMIT, as the source counts
    them (``pg_stat_replication_slots``, reported once a walsender's work is done)."""
    with psycopg.connect(settings.source_dsn, autocommit=True) as conn:
        deadline = time.monotonic() + 10
        while True:
            conn.execute("SELECT pg_stat_clear_snapshot()")
            row = conn.execute(
                "SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = %s",
                (settings.slot,),
            ).fetchone()
            if (row and row[0]) or time.monotonic() > deadline:
                return row[0] if row else 0
            time.sleep(0.2)


def test_a_transaction_streamed_before_its_commit_enters_the_range_of_its_commit_whole(settings):
    """A big transaction with savepoints, one rolled back, while small ones commit around it;
    and a big one that rolls back. The walsender streams both before their end. Ranges cut
    meanwhile report the open one as deferred (``mid_transaction``); it is stored whole in the
    range of its COMMIT, after the small ones that committed first, without the rolled-back
    savepoint's rows; the aborted one leaves nothing. The follow never leaves the stream, and
    the target ends equal."""
    settings = streamed_settings(settings)
    with following(settings) as follower:
        with (
            psycopg.connect(settings.source_dsn) as big,
            psycopg.connect(settings.source_dsn, autocommit=True) as small,
        ):
            xid = big.execute("SELECT txid_current()").fetchone()[0]
            for part in range(4):
                big.execute(
                    "INSERT INTO log SELECT g, repeat('s', 60) "
                    "FROM generate_series(%s::int, %s::int) g",
                    (part * 5000 + 1, part * 5000 + 5000),
                )
                small.execute("UPDATE items SET name = %s WHERE id = %s", (f"p{part}", part + 1))
                time.sleep(0.3)  # ranges are cut while the transaction is open
            big.execute("SAVEPOINT a")
            big.execute("INSERT INTO log SELECT -g, 'gone' FROM generate_series(1, 5000) g")
            big.execute("ROLLBACK TO SAVEPOINT a")
            big.execute("SAVEPOINT b")
            big.execute("UPDATE items SET name = 'big' WHERE id <= 500")
            big.execute("RELEASE SAVEPOINT b")
            big.execute("DELETE FROM log WHERE n BETWEEN 1 AND 100")
            big.commit()
            big.execute("INSERT INTO log SELECT -g, 'aborted' FROM generate_series(1, 8000) g")
            big.rollback()
            small.execute("INSERT INTO log VALUES (0, 'after')")
        expected = count(settings.source_dsn, "log")
        deadline = time.monotonic() + 60
        while count(settings.target_dsn, "log") != expected:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert streaming_sessions(settings.source_dsn) == 1
    assert follower.summary.streams == 1  # never left for a peek
    # The committed one; PostgreSQL 15 streams the aborted one too, 18 drops it unsent once it
    # sees its abort.
    assert streamed_transactions(settings) >= 1
    assert equal(settings)
    store = pipeline.store_of(settings)
    results = [store.get(r).manifest.result for r in store.chain_ranges()]
    deferring = [r for r in results if any(s["xid"] == xid for s in r.straddlers)]
    assert deferring and all(r.endpos_outcome == EndposOutcome.MID_TRANSACTION for r in deferring)
    holding = [r for r in results if r.changes >= 20_000]
    assert len(holding) == 1 and results.index(holding[0]) > results.index(deferring[-1])
    # The transaction's 20,000 inserts, 500 updates, 100 deletes (and the row after it, when
    # its range was not cut between them): nothing of the savepoint rolled back.
    assert holding[0].changes - (20_000 + 500 + 100) in (0, 1)
    assert_chain_records(store, pipeline.origin_progress(settings))
    assert not list(store.streaming_dir.glob("*"))


def test_a_streamed_transaction_written_into_its_range_for_longer_than_the_walsender_timeout(
    settings, monkeypatch
):
    """Writing a streamed transaction into its range reads nothing from the stream for as
    long as it takes (minutes for 50M rows). With the source's ``wal_sender_timeout`` at 2 s
    and each of its chunks taking 60 ms more, the walsender is told between chunks that the
    session is alive: no cut, no outage, the transaction sent once."""
    settings = streamed_settings(settings)
    set_for_database(settings.source_dsn, wal_sender_timeout="2s")
    monkeypatch.setenv(failpoints.ENV, "receive.streamed_commit=sleep(0.06)")
    monkeypatch.setattr(failpoints, "_armed", None)
    monkeypatch.setattr(failpoints, "_hits", {})
    with following(settings) as follower:
        with psycopg.connect(settings.source_dsn) as big:
            for part in range(6):
                big.execute(
                    "INSERT INTO log SELECT g, repeat('w', 60) "
                    "FROM generate_series(%s::int, %s::int) g",
                    (part * 4000 + 1, part * 4000 + 4000),
                )
        expected = count(settings.source_dsn, "log")
        deadline = time.monotonic() + 60
        while count(settings.target_dsn, "log") != expected:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    # Dozens of chunks (a stream block of 64 kB is one): over 3 s without reading the stream.
    assert failpoints._hits.get("receive.streamed_commit", 0) >= 50
    assert follower.summary.outages == 0 and follower.summary.streams == 1
    assert streamed_transactions(settings) >= 1
    assert equal(settings)


@pytest.mark.parametrize(
    ("point", "commit_first"),
    [
        # While a block is spooled; the transaction commits after the kill.
        ("receive.streamed=kill@3", False),
        # Once it committed, while its spool is written into its range.
        ("receive.streamed_commit=kill@1", True),
    ],
)
def test_a_kill_while_a_transaction_streams_then_a_follow_converges_exactly_once(
    settings, point, commit_first
):
    """SIGKILL of a real follower process holding a transaction streamed before its COMMIT
    (the slot confirmed past the transaction's start by ranges cut meanwhile): while it spools
    a block, or once the transaction committed, while it is written into its range. A new
    follow is sent the transaction again, whole, and applies it exactly once; what the killed
    process spooled is gone."""
    settings = streamed_settings(settings)
    opened = threading.Event()
    done = threading.Event()

    def write_big() -> None:
        with psycopg.connect(settings.source_dsn) as big:
            for part in range(8):
                big.execute(
                    "INSERT INTO log SELECT g, repeat('k', 60) "
                    "FROM generate_series(%s::int, %s::int) g",
                    (part * 4000 + 1, part * 4000 + 4000),
                )
                opened.set()
                if done.wait(0.4):
                    break
            while not commit_first and not done.wait(0.1):
                pass
            big.commit()

    writing = threading.Thread(target=write_big)
    writing.start()
    try:
        opened.wait(10)
        kill_follower(settings, None, point)
    finally:
        done.set()
        writing.join()
    store = pipeline.store_of(settings)
    assert read_slot_confirmed(settings) <= store.chain_end()
    follower, _ = follow_to(settings, flush_lsn(settings.source_dsn))
    assert follower.summary.stopped_by == "endpos"
    assert count(settings.target_dsn, "log") == count(settings.source_dsn, "log") > 0
    assert equal(settings)
    assert not list(store.streaming_dir.glob("*"))
    assert not [n for n in on_disk(store) if n.startswith(".tmp-")]
    assert_chain_records(store, pipeline.origin_progress(settings))


def transactions_of_ranges(settings: ReplicationSettings) -> list[int]:
    """Transactions in each stored range of the chain that holds any, in LSN order."""
    store = pipeline.store_of(settings)
    results = [store.get(r).manifest.result for r in store.chain_ranges()]
    return [r.transactions for r in results if r.transactions]


def log_rows_applied(settings: ReplicationSettings, n: int) -> None:
    """Wait (20 s at most) until the target's ``log`` holds ``n`` rows."""
    deadline = time.monotonic() + 20
    while count(settings.target_dsn, "log") < n:
        assert time.monotonic() < deadline, f"row {n} not applied in 20 s"
        time.sleep(0.05)


def test_a_stream_cuts_when_the_applier_is_ready_not_when_the_cut_interval_ends(
    settings, monkeypatch
):
    """With a cut interval of a minute, each COMMIT still reaches the target as soon as the
    applier is free: the stream cuts its range then. While the applier is busy (here 3 s on
    one range) the commits meanwhile wait for it in the stream, and go into one range."""
    settings = settings.model_copy(update={"follow_cut_ms": 60_000})
    monkeypatch.setenv(failpoints.ENV, "catchup.before_apply=sleep(3)@2")
    monkeypatch.setattr(failpoints, "_armed", None)
    monkeypatch.setattr(failpoints, "_hits", {})

    with following(settings):
        run_sql(settings.source_dsn, "INSERT INTO log VALUES (1, 'first')")
        log_rows_applied(settings, 1)
        run_sql(settings.source_dsn, "INSERT INTO log VALUES (2, 'the applier sleeps')")
        time.sleep(0.5)  # its range is being applied, slowly
        for n in range(3, 13):
            run_sql(settings.source_dsn, f"INSERT INTO log VALUES ({n}, 'meanwhile')")
        log_rows_applied(settings, 12)
    assert transactions_of_ranges(settings)[-3:] == [1, 1, 10]
    assert equal(settings)


def test_a_paced_stream_cuts_no_sooner_than_its_pace_and_at_once_when_let_go(settings):
    """A follow run whose records trail asks its follower for a pace (``RecordPace``): while
    paced, the commits that come within the pace of the last cut wait and go into one range;
    let go, each COMMIT is cut as soon as the applier is free again."""
    settings = settings.model_copy(update={"follow_cut_ms": 60_000})

    with following(settings) as follower:
        follower.pace(3.0)
        run_sql(settings.source_dsn, "INSERT INTO log VALUES (1, 'cut at once: no cut yet')")
        log_rows_applied(settings, 1)
        paced_at = time.monotonic()
        for n in range(2, 7):
            run_sql(settings.source_dsn, f"INSERT INTO log VALUES ({n}, 'within the pace')")
        assert time.monotonic() - paced_at < 2.5, "the commits took longer than the pace"
        log_rows_applied(settings, 6)
        assert time.monotonic() - paced_at > 2.0  # they waited for the pace
        follower.pace(0.0)
        run_sql(settings.source_dsn, "INSERT INTO log VALUES (7, 'let go')")
        log_rows_applied(settings, 7)
    assert transactions_of_ranges(settings)[-3:] == [1, 5, 1]
    assert equal(settings)


def test_a_pace_reaches_a_follower_in_its_own_process_down_its_stop_pipe(settings):
    """The parent of a forked follower paces it with a line down the pipe its stops take
    (``ProcessFollower.pace``); the child tells the two apart: a pace is not a stop."""
    from pgcdc_dagster.engine.follow.process import PACE, _stops_from

    follower = Follower(settings)
    down_r, down_w = os.pipe()
    reader = threading.Thread(target=_stops_from, args=(down_r, follower))
    reader.start()
    os.write(down_w, f"{PACE}0.250\n".encode())
    deadline = time.monotonic() + 10
    while follower._min_cut_s != 0.25:
        assert time.monotonic() < deadline, "the pace did not arrive"
        time.sleep(0.01)
    assert not follower.stopping
    os.write(down_w, b"stopped by the test\n")
    os.close(down_w)
    reader.join(timeout=10)
    assert follower.stopping and follower._min_cut_s == 0.25
