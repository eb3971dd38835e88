"""Slot and publication scenarios on real PostgreSQL (the shared logical source cluster).

Slot names are cluster-wide, so every test makes its own; the ``source_dsn`` fixture drops the
inactive slots of its database at teardown, so closing connections is all the cleanup needed.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

from pgcdc_dagster.demo.local_cluster import LOGICAL_SOURCE_SETTINGS, temporary_cluster
from pgcdc_dagster.engine import progress
from pgcdc_dagster.engine.connect import connect
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster.engine.source.publication import ensure_publication
from pgcdc_dagster.engine.source.slot import (
    _CREATE_SLOT_SYNTAXES,
    SlotError,
    _create_slot,
    advance_slot,
    create_slot_with_snapshot,
    drop_slot,
    read_slot,
    released,
)
from pgcdc_dagster.engine.source.walsender import Keepalive, SlotStream
from pgcdc_dagster_tests.support.pg import flush_lsn

ORDERS = TableName("public", "orders")


def new_slot_name() -> str:
    return f"pgcdc_test_{uuid.uuid4().hex[:12]}"


def import_snapshot(dsn: str, snapshot_name: str, query: str) -> list[tuple[Any, ...]]:
    """Run ``query`` inside a transaction that imported ``snapshot_name``."""
    with psycopg.connect(dsn, autocommit=True) as reader:
        reader.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        reader.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name)))
        rows = reader.execute(query).fetchall()
        reader.execute("COMMIT")
        return rows


def streamed_insert_count(conn: psycopg.Connection[Any], slot: str, publication: str) -> int:
    """How many INSERT messages the slot would hand out now (without consuming them)."""
    return conn.execute(
        "SELECT count(*) FROM pg_logical_slot_peek_binary_changes("
        "%s, NULL, NULL, 'proto_version', '1', 'publication_names', %s) "
        "WHERE get_byte(data, 0) = ascii('I')",
        (slot, publication),
    ).fetchone()[0]


# --- creating a slot with its snapshot ---------------------------------------------------------


def test_snapshot_and_slot_stream_meet_at_the_consistent_point(source, source_dsn):
    source.execute("CREATE TABLE orders (id int PRIMARY KEY)")
    source.execute("INSERT INTO orders VALUES (1)")
    ensure_publication(source, "pgcdc", [ORDERS])
    name = new_slot_name()

    with create_slot_with_snapshot(source_dsn, name) as exported:
        created = exported.slot
        source.execute("INSERT INTO orders VALUES (2)")
        in_snapshot = import_snapshot(
            source_dsn, created.snapshot_name, "SELECT id FROM orders ORDER BY id"
        )

    assert created.name == name
    assert isinstance(created.consistent_point, Lsn)
    assert in_snapshot == [(1,)], "the snapshot must not see a row committed after the slot"
    assert streamed_insert_count(source, name, "pgcdc") == 1, "row 2 comes through the slot only"
    info = read_slot(source, name)
    assert info.confirmed_flush_lsn == created.consistent_point
    assert (info.plugin, info.database, info.active) == ("pgoutput", source.info.dbname, False)


def test_snapshot_is_no_longer_importable_after_close(source, source_dsn):
    exported = create_slot_with_snapshot(source_dsn, new_slot_name())
    assert import_snapshot(source_dsn, exported.slot.snapshot_name, "SELECT 1") == [(1,)]
    walsender = exported._conn.info.backend_pid
    exported.close()
    exported.close()  # idempotent

    assert exported.closed
    # The walsender ends a moment after its client went: the export ends with it.
    deadline = time.monotonic() + 10
    while source.execute("SELECT FROM pg_stat_activity WHERE pid = %s", (walsender,)).fetchone():
        assert time.monotonic() < deadline, "the exporting walsender did not end"
        time.sleep(0.01)
    # "invalid snapshot identifier" (PostgreSQL 15), "snapshot ... does not exist" (18).
    with pytest.raises(
        (psycopg.errors.InvalidParameterValue, psycopg.errors.UndefinedObject),
        match=r"invalid snapshot|does not exist",
    ):
        import_snapshot(source_dsn, exported.slot.snapshot_name, "SELECT 1")


def test_a_slot_waiting_for_an_open_transaction_names_it_and_the_fix(source, source_dsn):
    source.execute("CREATE TABLE t (id int)")
    reports: list[Any] = []
    made: list[Any] = []
    with (
        psycopg.connect(source_dsn) as blocker,
        progress.listening(reports.append),
    ):
        blocker.execute("INSERT INTO t VALUES (1)")  # holds a transaction id, left open
        pid = blocker.info.backend_pid
        creating = threading.Thread(
            target=lambda: made.append(create_slot_with_snapshot(source_dsn, new_slot_name()))
        )
        creating.start()
        deadline = time.monotonic() + 30
        named = None
        while named is None and time.monotonic() < deadline:
            named = next(
                (r for r in list(reports) if r.phase == "slot" and f"pid {pid} " in r.note), None
            )
            time.sleep(0.2)
        assert named is not None, reports
        assert f"SELECT pg_terminate_backend({pid})" in named.note
        assert "idle in transaction" in named.note
        assert named.line().startswith("snapshot slot: creating the slot waits for 1 transaction")
        assert creating.is_alive() and not made  # it waits as long as the transaction lives
        blocker.commit()
        creating.join(timeout=30)
    assert not creating.is_alive() and made
    made[0].close()


def test_creating_a_slot_that_exists_says_to_drop_and_resnapshot(source, source_dsn):
    name = new_slot_name()
    with create_slot_with_snapshot(source_dsn, name) as first:
        original = first.slot.consistent_point

    with pytest.raises(SlotError, match=f"{name} already exists") as raised:
        create_slot_with_snapshot(source_dsn, name)

    assert "pg_drop_replication_slot" in str(raised.value)
    assert "re-take the base snapshot" in str(raised.value)
    assert read_slot(source, name).confirmed_flush_lsn == original, "the old slot is untouched"


@pytest.mark.parametrize("bad", ["Orders", "has-dash", "", "x" * 64, 'a"; DROP TABLE t; --'])
def test_invalid_slot_names_are_rejected_before_any_connection(bad):
    with pytest.raises(SlotError, match="not a valid replication slot name"):
        create_slot_with_snapshot("host=/nonexistent-socket-dir dbname=nothing", bad)


def test_older_export_snapshot_syntax_is_used_when_the_newer_is_rejected(source, source_dsn):
    name = new_slot_name()
    unknown_to_server = "CREATE_REPLICATION_SLOT {slot} LOGICAL pgoutput (SNAPSHOT 'export') NEW"
    conn = connect(source_dsn, replication=True)
    try:
        created = _create_slot(conn, name, [unknown_to_server, _CREATE_SLOT_SYNTAXES[-1]])
        rows = import_snapshot(source_dsn, created.snapshot_name, "SELECT 1")
    finally:
        conn.close()

    assert rows == [(1,)]
    assert read_slot(source, name).confirmed_flush_lsn == created.consistent_point


# --- reading, advancing, dropping --------------------------------------------------------------


def test_read_slot_on_a_missing_slot_says_how_to_create_it(source):
    with pytest.raises(SlotError, match="does not exist") as raised:
        read_slot(source, "pgcdc_no_such_slot")
    assert "pgcdc snapshot" in str(raised.value)


def test_read_slot_reports_the_wal_the_slot_retains(source, source_dsn):
    name = new_slot_name()
    create_slot_with_snapshot(source_dsn, name).close()
    source.execute("CREATE TABLE filler AS SELECT g FROM generate_series(1, 1000) g")

    info = read_slot(source, name)

    assert info.wal_status == "reserved"
    assert info.restart_lsn is not None and info.restart_lsn <= info.confirmed_flush_lsn
    assert info.retained_wal_bytes == flush_lsn(source) - info.restart_lsn > 0


def test_advance_moves_forward_and_never_back(source, source_dsn):
    name = new_slot_name()
    with create_slot_with_snapshot(source_dsn, name) as exported:
        start = exported.slot.consistent_point
    source.execute("CREATE TABLE orders (id int PRIMARY KEY)")
    source.execute("INSERT INTO orders SELECT generate_series(1, 100)")
    target = flush_lsn(source)

    assert advance_slot(source, name, target) == target
    assert advance_slot(source, name, start) == target, "asking to go back changes nothing"
    assert advance_slot(source, name, target) == target
    assert read_slot(source, name).confirmed_flush_lsn == target

    beyond = advance_slot(source, name, target + 10**9)
    assert target <= beyond <= flush_lsn(source), "the server stops at its flush position"


def test_drop_slot_drops_and_tolerates_a_missing_slot_only_when_asked(source, source_dsn):
    name = new_slot_name()
    create_slot_with_snapshot(source_dsn, name).close()

    drop_slot(source, name)
    drop_slot(source, name)  # missing_ok=True by default

    with pytest.raises(SlotError, match="does not exist"):
        read_slot(source, name)
    with pytest.raises(SlotError, match="does not exist"):
        drop_slot(source, name, missing_ok=False)


def test_a_slot_in_use_by_a_stream_can_be_neither_advanced_nor_dropped(source, source_dsn):
    name = new_slot_name()
    ensure_publication(source, "pgcdc", [])
    create_slot_with_snapshot(source_dsn, name).close()
    streaming = connect(source_dsn, replication=True)
    statement = sql.SQL(
        "START_REPLICATION SLOT {} LOGICAL 0/0 (proto_version '1', publication_names 'pgcdc')"
    ).format(sql.Identifier(name))
    streaming.pgconn.send_query(statement.as_bytes(streaming))
    try:
        _wait_until(lambda: read_slot(source, name).active)
        with pytest.raises(SlotError, match="is active for PID"):
            drop_slot(source, name)
        with pytest.raises(SlotError, match="is active for PID"):
            advance_slot(source, name, flush_lsn(source) + 1, wait_s=0.2)
    finally:
        streaming.close()
    _wait_until(lambda: not read_slot(source, name).active)
    drop_slot(source, name, missing_ok=False)


def test_a_reader_of_the_slot_waits_for_a_stream_that_is_going_away(source, source_dsn):
    """A stream (the engine's, as a follow reads by) holds the slot; it closes 0.5 s later.
    A reader that comes meanwhile waits for the walsender to let the slot go, and the slot is
    then confirmed where the stream's status update said; one that does not wait fails,
    naming the process."""
    name = new_slot_name()
    ensure_publication(source, "pgcdc", [])
    created = create_slot_with_snapshot(source_dsn, name)
    created.close()
    start = read_slot(source, name).confirmed_flush_lsn
    source.execute("SELECT pg_current_xact_id()")  # WAL for a keepalive to report
    stream = SlotStream(source_dsn, name, "pgcdc", start)
    closing = threading.Timer(0.5, stream.close)
    try:
        moved_to = start
        deadline = time.monotonic() + 10
        while moved_to <= start and time.monotonic() < deadline:
            for item in stream.messages(0.1):
                if isinstance(item, Keepalive):
                    moved_to = max(moved_to, item.wal_end)
        assert moved_to > start
        stream.feedback(moved_to)
        with pytest.raises(SlotError, match="is active for PID"):
            advance_slot(source, name, flush_lsn(source) + 1, wait_s=0)
    finally:
        closing.start()
    began = time.monotonic()
    info = released(source, name)
    waited = time.monotonic() - began
    closing.join()
    assert not info.active and 0.3 < waited < 5
    assert info.confirmed_flush_lsn == moved_to
    drop_slot(source, name, missing_ok=False)


def _wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_invalidated_slot_must_be_dropped_and_resnapshotted():
    cluster = temporary_cluster(
        {**LOGICAL_SOURCE_SETTINGS, "max_slot_wal_keep_size": "1MB"}, prefix="pgcdc-test-lost-"
    )
    try:
        cluster.start()
        name = new_slot_name()
        create_slot_with_snapshot(cluster.dsn(), name).close()
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute("CREATE TABLE filler (g int)")
            for _ in range(3):  # move past a few WAL segments, then let a checkpoint remove them
                conn.execute("INSERT INTO filler VALUES (1)")
                conn.execute("SELECT pg_switch_wal()")
            conn.execute("CHECKPOINT")

            with pytest.raises(SlotError, match=f"{name} is invalidated") as raised:
                read_slot(conn, name)
            with pytest.raises(SlotError, match="is invalidated"):
                advance_slot(conn, name, flush_lsn(conn))
    finally:
        cluster.destroy()
    message = str(raised.value)
    assert "wal_status lost" in message
    assert f"pg_drop_replication_slot('{name}')" in message
    assert "re-take the base snapshot" in message
    assert "run pgcdc recover" in message


def test_advance_into_a_partly_flushed_record_does_not_wait_for_wal(source, source_dsn):
    """PostgreSQL's advance waits for the rest of a WAL record past the flush position; an
    open transaction's big record leaves the flush position in its middle, on a server where
    nothing else would ever flush it."""
    name = new_slot_name()
    ensure_publication(source, "pgcdc", [])
    create_slot_with_snapshot(source_dsn, name).close()
    source.execute("CREATE TABLE wide (v text)")
    source.execute("ALTER TABLE wide ALTER COLUMN v SET STORAGE PLAIN")
    # One ~7 kB WAL record in an open transaction: it spans a page boundary, and the WAL writer
    # flushes whole pages only. Every 15 s the background writer logs a running-transactions
    # record that makes the WAL writer flush everything; if that lands in our window, try again.
    for _attempt in range(6):
        open_txn = psycopg.connect(source_dsn)
        open_txn.execute(
            "INSERT INTO wide SELECT string_agg(md5(g::text), '') FROM generate_series(1, 220) g"
        )
        deadline = time.monotonic() + 2
        while True:
            flush, insert = source.execute(
                "SELECT pg_current_wal_flush_lsn()::text, pg_current_wal_insert_lsn()::text"
            ).fetchone()
            partly_flushed = Lsn(flush) % 8192 == 0 and Lsn(insert) > Lsn(flush)
            if partly_flushed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if partly_flushed:
            break
        open_txn.rollback()
        open_txn.close()
    assert partly_flushed, (flush, insert)
    with open_txn:
        started = time.monotonic()
        confirmed = advance_slot(source, name, Lsn(flush))
        assert time.monotonic() - started < 10
        assert confirmed == Lsn(flush)
        open_txn.rollback()
