"""Applying received ranges to a real target: net effects, exactly once, drift, crash safety.

Every test writes on a real source, receives ranges from a real pgoutput slot, applies them to
a real target whose tables were created with the same DDL, and compares the two sides row by
row.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pgcdc_dagster.demo.local_cluster import LocalCluster, temporary_cluster
from pgcdc_dagster.engine.apply import merge as merge_module
from pgcdc_dagster.engine.apply import shared_staging, staging
from pgcdc_dagster.engine.apply.ddl import SourceDdl, record_copied
from pgcdc_dagster.engine.apply.origin import read_progress
from pgcdc_dagster.engine.apply.partitioned_staging import SCRATCH
from pgcdc_dagster.engine.apply.results import ApplyGapError, ApplyResult, ApplyStatus
from pgcdc_dagster.engine.apply.transaction import ApplyError, apply_range
from pgcdc_dagster.engine.compaction import (
    NetChanges,
    TableRelation,
    compact_arrow,
    compact_table,
    relations_of,
)
from pgcdc_dagster.engine.compaction.kernel import KERNEL_COLUMNS
from pgcdc_dagster.engine.compaction.partitions import Router
from pgcdc_dagster.engine.compaction.spark import route_changes, unjoin_toast
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.lsn import Lsn, LsnRange
from pgcdc_dagster.engine.source.peek import receive
from pgcdc_dagster.engine.store.output_store import OutputStore, StoredRange
from pgcdc_dagster_tests.support.pg import flush_lsn, run_sql

SLOT = "apply_slot"
PUB = "apply_pub"
ORIGIN = "pgcdc_apply_slot"

BIG = "(SELECT string_agg(md5(g::text || {seed}), '') FROM generate_series(1, 200) g)"
"""A 6400-character value; with STORAGE EXTERNAL it is always TOASTed out of line."""


def big(seed: str | int) -> str:
    return BIG.format(seed=f"'{seed}'")


@dataclass
class Replica:
    source_dsn: str
    target_dsn: str
    store: OutputStore
    tables: list[str]
    start: Lsn
    ranges: list[StoredRange] = field(default_factory=list)

    def source(self, *statements: str) -> None:
        run_sql(self.source_dsn, *statements)

    def target(self, *statements: str) -> None:
        run_sql(self.target_dsn, *statements)

    def receive(self) -> StoredRange:
        flush = flush_lsn(self.source_dsn)
        result = receive(self.source_dsn, SLOT, PUB, self.store, self.start, flush)
        self.start = flush
        stored = self.store.get(LsnRange.from_key(result.range_key))
        assert stored is not None
        self.ranges.append(stored)
        return stored

    def apply(self, stored: StoredRange, **kwargs) -> ApplyResult:
        kwargs.setdefault("ddl", SourceDdl(self.source_dsn))
        return apply_range(self.target_dsn, stored, ORIGIN, **kwargs)

    def sync(self, **kwargs) -> ApplyResult:
        return self.apply(self.receive(), **kwargs)

    def progress(self) -> Lsn:
        with psycopg.connect(self.target_dsn) as conn:
            (text,) = conn.execute(
                "SELECT pg_replication_origin_progress(%s, true)::text", (ORIGIN,)
            ).fetchone()
        return Lsn.parse(text)

    def rows(self, dsn: str, table: str) -> list[str]:
        with psycopg.connect(dsn) as conn:
            return [r[0] for r in conn.execute(f"SELECT t::text FROM {table} t ORDER BY 1")]

    def target_rows(self, table: str) -> list[str]:
        return self.rows(self.target_dsn, table)

    def assert_in_sync(self) -> None:
        for table in self.tables:
            assert self.rows(self.target_dsn, table) == self.rows(self.source_dsn, table), table


@pytest.fixture
def make_replica(source_dsn, target_dsn, tmp_path):
    """Same DDL on both sides, a publication of ``tables``, a slot, and the target's origin at
    the slot's consistent point (what the base snapshot leaves behind)."""

    def make(ddl: str, tables: list[str], target: str | None = None) -> Replica:
        """``target``: another target's DSN than the shared cluster's (its origin is left)."""
        target_dsn_ = target or target_dsn
        for dsn in (source_dsn, target_dsn_):
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(ddl)
                conn.execute("CREATE TABLE unpublished (id serial PRIMARY KEY, note text)")
        with psycopg.connect(source_dsn, autocommit=True) as conn:
            conn.execute(f"CREATE PUBLICATION {PUB} FOR TABLE {', '.join(tables)}")
            (start,) = conn.execute(
                "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,)
            ).fetchone()
        with psycopg.connect(target_dsn_, autocommit=True) as conn:
            conn.execute("SELECT pg_replication_origin_create(%s)", (ORIGIN,))
            conn.execute("SELECT pg_replication_origin_advance(%s, %s::pg_lsn)", (ORIGIN, start))
        with psycopg.connect(source_dsn) as src, psycopg.connect(target_dsn_) as tgt:
            record_copied(src, tgt, [TableName.parse(t) for t in tables])  # as a snapshot does
        store = OutputStore(tmp_path / "store")
        return Replica(source_dsn, target_dsn_, store, tables, Lsn(start))

    yield make
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin "
            "WHERE roname = %s",
            (ORIGIN,),
        )


ITEMS = """
CREATE TABLE items (id int PRIMARY KEY, name text, n int, big text);
ALTER TABLE items ALTER COLUMN big SET STORAGE EXTERNAL;
"""


def test_insert_update_delete_of_one_key_in_one_range_nets_out(make_replica, staged):
    replica = make_replica(ITEMS, ["items"])
    replica.source("INSERT INTO items (id, name, n) VALUES (1, 'a', 1), (2, 'b', 2), (3, 'c', 3)")
    first = replica.sync()
    assert first.status == ApplyStatus.APPLIED
    assert first.tables["public.items"].inserted == 3
    replica.source(
        "INSERT INTO items (id, name, n) VALUES (4, 'd', 4)",
        "UPDATE items SET name = 'd2' WHERE id = 4",
        "DELETE FROM items WHERE id = 4",
        "UPDATE items SET n = n + 10 WHERE id = 2",
        "UPDATE items SET name = '' WHERE id = 2",  # an empty string is not NULL
        "DELETE FROM items WHERE id = 3",
        "INSERT INTO items (id, name, n) VALUES (3, 'c again', NULL)",
    )
    stored = replica.receive()
    result = replica.apply(stored)
    assert result.status == ApplyStatus.APPLIED
    assert result.replay_lsn == stored.manifest.result.transform_lsn == str(replica.progress())
    counts = result.tables["public.items"]
    assert counts.changes == 7
    assert counts.net_rows == 3  # delete 4 (the target never had it), upsert 2 and 3
    assert (counts.inserted, counts.updated, counts.deleted) == (0, 2, 0)
    replica.assert_in_sync()
    assert '(2,"",12,)' in replica.target_rows("items")


def test_a_range_that_nets_to_nothing_on_the_target_still_moves_the_origin(make_replica, staged):
    """A row inserted and deleted inside one range (a job queue's whole life) writes nothing
    on the target. The origin still moves to the range's end, with the transaction's COMMIT
    (without a COMMIT record it would not move: the next range would find a gap, and every
    re-run would stop there again)."""
    replica = make_replica(ITEMS, ["items"])
    replica.source("INSERT INTO items (id, name, n) VALUES (1, 'a', 1)")
    replica.sync()
    replica.source(
        "INSERT INTO items (id, name, n) VALUES (4, 'job', 4)", "DELETE FROM items WHERE id = 4"
    )
    stored = replica.receive()
    result = replica.apply(stored)
    assert result.status == ApplyStatus.APPLIED and result.changes == 2
    assert str(replica.progress()) == stored.manifest.result.transform_lsn == result.replay_lsn
    replica.source("UPDATE items SET name = 'after' WHERE id = 1")
    assert replica.sync().status == ApplyStatus.APPLIED  # no gap behind it
    replica.assert_in_sync()


@pytest.fixture
def crashable_target() -> Iterator[LocalCluster]:
    """A target of its own, to crash: its WAL writer writes an asynchronous commit's WAL only
    every 10 s (``wal_writer_delay``), so a crash soon after one loses it."""
    cluster = temporary_cluster({"wal_writer_delay": "10s"}, prefix="pgcdc-test-crash-")
    try:
        yield cluster.start()
    finally:
        cluster.destroy()


def _unwritten(dsn: str) -> bool:
    """Whether the origin's last commit is past what the target wrote of its WAL (lost by a
    crash now)."""
    with psycopg.connect(dsn) as conn:
        (unwritten,) = conn.execute(
            "SELECT local_lsn > pg_current_wal_lsn() FROM pg_replication_origin_status "
            "WHERE external_id = %s",
            (ORIGIN,),
        ).fetchone()
    return unwritten


def test_an_apply_not_waiting_for_the_disk_is_lost_whole_by_a_target_crash_and_applied_again(
    make_replica, crashable_target
):
    """``synchronous_commit = off`` (the default, PGCDC_APPLY_SYNCHRONOUS_COMMIT): a target
    crash before the WAL writer wrote the apply's commit loses its rows and the origin's
    progress together, so the same stored range is applied again; once the origin's durable
    progress is read (what the store's retention reads) the apply survives a crash."""
    replica = make_replica(ITEMS, ["items"], target=crashable_target.dsn())
    replica.source("INSERT INTO items (id, name, n) VALUES (1, 'a', 1), (2, 'b', 2)")
    replica.sync()  # the server's synchronous commit: on disk
    durable = replica.progress()
    before = replica.target_rows("items")
    # The WAL writer may write a commit early if its 10-s timer fires just then: look again.
    for attempt in range(3):
        replica.source(f"UPDATE items SET n = n + 1 WHERE id = 1 -- {attempt}")
        stored = replica.receive()
        assert replica.apply(stored, synchronous_commit="off").status == ApplyStatus.APPLIED
        if _unwritten(replica.target_dsn):
            break
        durable, before = replica.progress(), replica.target_rows("items")
    else:
        pytest.fail("the WAL writer wrote every asynchronous apply's commit at once")
    with psycopg.connect(replica.target_dsn) as conn:
        assert read_progress(conn, ORIGIN) == Lsn.parse(stored.manifest.result.transform_lsn)

    crashable_target.crash()
    crashable_target.start()
    with psycopg.connect(replica.target_dsn) as conn:
        assert read_progress(conn, ORIGIN) == durable  # the origin lost the range...
    assert replica.target_rows("items") == before  # ...with its rows, never one without the other
    assert replica.apply(stored, synchronous_commit="off").status == ApplyStatus.APPLIED
    replica.assert_in_sync()

    assert _unwritten(replica.target_dsn)
    with psycopg.connect(replica.target_dsn) as conn:
        assert read_progress(conn, ORIGIN, durable=True) == Lsn.parse(
            stored.manifest.result.transform_lsn
        )
    assert not _unwritten(replica.target_dsn)
    crashable_target.crash()
    crashable_target.start()
    replica.assert_in_sync()


def test_primary_key_update_moves_the_row_and_its_unsent_toast_value(make_replica):
    replica = make_replica(ITEMS, ["items"])
    replica.source(
        f"INSERT INTO items VALUES (1, 'a', 1, {big(1)}), (2, 'b', 2, {big(2)}), (3, 'c', 3, NULL)"
    )
    replica.sync()
    replica.source(
        "UPDATE items SET id = 10 WHERE id = 1",  # big is not sent: it lives at key 1
        "UPDATE items SET id = 11, name = 'moved twice' WHERE id = 10",
        # a swap of keys through a free one
        "UPDATE items SET id = 99 WHERE id = 2",
        "UPDATE items SET id = 2 WHERE id = 3",
        "UPDATE items SET id = 3 WHERE id = 99",
    )
    result = replica.sync()
    assert result.status == ApplyStatus.APPLIED
    replica.assert_in_sync()
    assert result.tables["public.items"].deleted == 1  # key 1; 2 and 3 were re-used


def test_update_of_toasted_row_leaves_the_toast_column_untouched(make_replica, staged):
    replica = make_replica(ITEMS, ["items"])
    replica.source(f"INSERT INTO items VALUES (1, 'a', 1, {big('a')}), (2, 'b', 2, {big('b')})")
    replica.sync()
    replica.source(
        "UPDATE items SET name = 'renamed' WHERE id = 1",  # big not sent, kept on the target
        f"UPDATE items SET big = {big('new')} WHERE id = 2",
        "UPDATE items SET name = 'after new big' WHERE id = 2",  # big from within the range
    )
    stored = replica.receive()
    table = stored.read_table()
    assert ["big"] in table.column("unchanged_toast").to_pylist()
    result = replica.apply(stored)
    assert result.tables["public.items"].updated == 2
    replica.assert_in_sync()


ODD_VALUES = """
CREATE SCHEMA "Odd Schema";
CREATE TYPE "Odd Schema"."Mood" AS ENUM ('ok', 'not ok', 'NULL');
CREATE DOMAIN positive AS int CHECK (VALUE > 0);
CREATE TYPE pair AS (a int, b text);
CREATE TABLE odd (
    id int, part text, short varchar(10), padded char(5), money numeric(6, 2),
    grid int[], doc jsonb, raw bytea, at timestamptz(3), span interval, bits bit(3),
    mood "Odd Schema"."Mood", pos positive, spot point, duo pair,
    PRIMARY KEY (id, part)
);
"""

ODD_ROW = (
    "({id}, {part}, 'a,b{{c}}é€😀', 'ab', 123.456, '{{{{1,2}},{{3,NULL}}}}', "
    """'{{"k": "v\\\\ \\"q\\""}}', '\\x00ff', '2026-11-26 12:00:00.123456+00', """
    "'1 day 02:03:04', B'101', {mood}, 7, '(1.5,2)', ROW(1, 'x,\"y\"'))"
)


def test_values_of_every_kind_arrive_exactly_however_they_are_staged(make_replica, staged):
    """Inline staging casts each value's text to its column's type and leaves the typmod to the
    assignment, so the target gets what COPY into a staging table gave it: quotes, commas,
    braces, backslashes, characters beyond ASCII, the string 'NULL', empty strings and NULLs,
    2-D arrays, a padded char, a rounded numeric, a typmod'd timestamp, a bit(3) (which
    ``::bit`` would cut to one bit), an enum in a schema off the search path, a domain, a type
    without equality and a composite, in a composite key."""
    replica = make_replica(ODD_VALUES, ["odd"])
    keys = [("'NULL'", "'NULL'"), ("''", "'not ok'"), ("'x\\y'", "NULL"), ("'\"'", "'ok'")]
    rows = [ODD_ROW.format(id=i, part=part, mood=mood) for i, (part, mood) in enumerate(keys)]
    replica.source("INSERT INTO odd VALUES " + ", ".join(rows))
    replica.sync()
    replica.source(
        "UPDATE odd SET short = NULL, padded = 'abcde', money = -1.005, grid = '{}' WHERE id = 0",
        "UPDATE odd SET part = 'moved ''here''', doc = 'null', raw = '' WHERE id = 1",
        "DELETE FROM odd WHERE id = 2",
        "INSERT INTO odd (id, part, short, mood, duo) "
        "VALUES (9, 'NULL', '', 'NULL', ROW(NULL, ''))",
    )
    result = replica.sync()
    assert result.status == ApplyStatus.APPLIED
    counts = result.tables["public.odd"]
    assert (counts.inserted, counts.updated, counts.deleted) == (2, 1, 2)
    replica.assert_in_sync()
    assert len(replica.target_rows("odd")) == 4


def test_a_keyed_row_the_target_refuses_stops_the_apply_however_it_is_staged(make_replica, staged):
    """A value the target refuses fails the merge statement, inline or from a staging table:
    the table and the server's reason named, nothing of the range applied, the origin where it
    was."""
    replica = make_replica(ITEMS, ["items"])
    _assert_refused(
        replica,
        "items",
        _short("items", "name"),
        ["INSERT INTO items (id, name) VALUES (1, 'ok')"],
        ["UPDATE items SET name = 'abc'", "INSERT INTO items VALUES (2, 'too long')"],
    )
    assert replica.target_rows("items") == ["(1,ok,,)"]


def _short(table: str, column: str) -> tuple[str, str]:
    """A check on the target only (``column`` at most 3 characters), and how it refuses."""
    return (
        f"ALTER TABLE {table} ADD CONSTRAINT short CHECK (length({column}) <= 3)",
        f'new row for relation "{table}" violates check constraint "short"',
    )


def _assert_refused(
    replica: Replica,
    table: str,
    target_only: tuple[str, str],
    before: list[str],
    refused: list[str],
) -> None:
    """With a constraint on the target only (``target_only``: its DDL, and the server's words
    when it refuses a row), ``before`` applies and the range of ``refused`` fails naming the
    table and the constraint, leaving the origin."""
    ddl, reason = target_only
    replica.target(ddl)
    replica.source(*before)
    replica.sync()
    progress = replica.progress()
    replica.source(*refused)
    with pytest.raises(
        ApplyError, match=rf"applying the changes of table public.{table} failed: {reason}"
    ):
        replica.sync()
    assert replica.progress() == progress


POSITIONS = """
CREATE TABLE slots (id int PRIMARY KEY, list int NOT NULL, pos int NOT NULL, UNIQUE (list, pos));
"""


@pytest.mark.parametrize("on_spark", [False, True])
def test_net_rows_a_unique_key_refuses_are_applied_in_the_source_order_instead(
    make_replica, staged, spark, on_spark
):
    replica = make_replica(POSITIONS, ["slots"])
    replica.source("INSERT INTO slots VALUES (1, 1, 1), (2, 1, 2), (3, 1, 3)")
    replica.sync()
    replica.source(
        # 1 and 2 swap places through -1: each statement keeps (list, pos) unique, while the
        # net rows (1 at 2, 2 at 1) cannot be written one after the other.
        "UPDATE slots SET pos = -1 WHERE id = 1",
        "UPDATE slots SET pos = 1 WHERE id = 2",
        "UPDATE slots SET pos = 2 WHERE id = 1",
        "INSERT INTO slots VALUES (4, 1, 4)",
        "DELETE FROM slots WHERE id = 3",
    )
    result = replica.sync(**({"spark": spark, "spark_min_changes": 0} if on_spark else {}))
    assert result.in_commit_order == ["public.slots"]
    assert result.staged_by == ("spark executors" if on_spark else "driver")
    assert _shared_staging_tables(replica.target_dsn) == []
    counts = result.tables["public.slots"]
    assert (counts.inserted, counts.updated, counts.deleted, counts.missing) == (1, 3, 1, 0)
    assert replica.rows(replica.target_dsn, "slots") == replica.rows(replica.source_dsn, "slots")
    assert replica.progress() == replica.ranges[-1].transform_lsn


def test_a_unique_key_of_the_target_alone_still_refuses_the_range_in_any_order(make_replica):
    replica = make_replica(POSITIONS, ["slots"])
    _assert_refused(
        replica,
        "slots",
        (
            "CREATE UNIQUE INDEX one_pos ON slots (pos)",
            'duplicate key value violates unique constraint "one_pos"',
        ),
        ["INSERT INTO slots VALUES (1, 1, 1)"],
        ["INSERT INTO slots VALUES (2, 2, 1)"],  # unique on the source, not on the target
    )
    assert replica.rows(replica.target_dsn, "slots") == ["(1,1,1)"]


def test_truncate_mid_range_discards_earlier_changes_and_keeps_later_ones(make_replica):
    replica = make_replica(ITEMS, ["items"])
    replica.source("INSERT INTO items (id, name) VALUES (1, 'a'), (2, 'b')")
    replica.sync()
    replica.source(
        "INSERT INTO items (id, name) VALUES (5, 'gone')",
        "UPDATE items SET name = 'gone too' WHERE id = 1",
        "TRUNCATE items",
        "INSERT INTO items (id, name) VALUES (7, 'after')",
        "UPDATE items SET n = 70 WHERE id = 7",
    )
    result = replica.sync()
    counts = result.tables["public.items"]
    assert counts.truncated and counts.net_rows == 1 and counts.inserted == 1
    replica.assert_in_sync()
    assert replica.target_rows("items") == ["(7,after,70,)"]


def test_replica_identity_full_duplicates_change_exactly_one_row(make_replica):
    replica = make_replica(
        "CREATE TABLE dup (a int, b text, j json); ALTER TABLE dup REPLICA IDENTITY FULL;",
        ["dup"],
    )
    replica.source(
        "INSERT INTO dup VALUES (1, 'x', '{\"k\": 1}'), (1, 'x', '{\"k\": 1}'), "
        "(2, 'y', NULL), (2, 'y', NULL), (3, NULL, NULL)"
    )
    replica.sync()
    replica.source(
        "UPDATE dup SET b = 'z' WHERE ctid = (SELECT ctid FROM dup WHERE a = 1 LIMIT 1)",
        "DELETE FROM dup WHERE ctid = (SELECT ctid FROM dup WHERE a = 2 LIMIT 1)",
        "UPDATE dup SET b = 'was null' WHERE a = 3",
        "INSERT INTO dup VALUES (3, 'was null', NULL)",
    )
    result = replica.sync()
    counts = result.tables["public.dup"]
    assert (counts.inserted, counts.updated, counts.deleted, counts.missing) == (1, 2, 1, 0)
    replica.assert_in_sync()
    assert replica.target_rows("dup").count('(1,x,"{""k"": 1}")') == 1


def test_insert_only_table_without_identity_is_copied_into_the_target_after_its_truncate(
    make_replica,
):
    """Such a table's rows go into the target by one COPY, with no staging table: identity
    values as the source assigned them, generated columns left to the target, empty strings
    apart from NULLs, rows the range's TRUNCATE came before kept."""
    replica = make_replica(
        "CREATE TABLE log (seq int GENERATED ALWAYS AS IDENTITY, note text, "
        "doubled int GENERATED ALWAYS AS (seq * 2) STORED, at timestamptz)",
        ["log"],
    )
    replica.source("INSERT INTO log (note) VALUES ('before')")
    replica.sync()
    replica.source(
        "TRUNCATE log",
        "INSERT INTO log (note, at) SELECT 'n' || g, now() FROM generate_series(1, 3) g",
        "INSERT INTO log (note) VALUES (''), (NULL), ('same'), ('same')",
    )
    counts = replica.sync().tables["public.log"]
    assert counts.truncated and (counts.net_rows, counts.inserted) == (7, 7)
    replica.assert_in_sync()
    rows = replica.target_rows("log")
    assert '(5,"",10,)' in rows and "(6,,12,)" in rows  # an empty string, then a NULL


def test_a_row_the_target_refuses_stops_the_apply_naming_the_table_and_reason(make_replica):
    """The COPY straight into the target fails as any apply statement does: the table and the
    server's reason named, nothing of the range applied, the origin where it was."""
    replica = make_replica("CREATE TABLE log (note text)", ["log"])
    _assert_refused(
        replica,
        "log",
        _short("log", "note"),
        ["INSERT INTO log VALUES ('ok')"],
        ["INSERT INTO log VALUES ('abc'), ('too long')"],
    )
    assert replica.target_rows("log") == ["(ok)"]


def test_replica_identity_using_index_works_like_a_primary_key(make_replica, staged):
    replica = make_replica(
        """
        CREATE TABLE coded (code text NOT NULL, v int, note text);
        CREATE UNIQUE INDEX coded_code ON coded (code);
        ALTER TABLE coded REPLICA IDENTITY USING INDEX coded_code;
        """,
        ["coded"],
    )
    replica.source("INSERT INTO coded VALUES ('a', 1, 'x'), ('b', 2, 'y'), ('c', 3, 'z')")
    replica.sync()
    replica.source(
        "UPDATE coded SET v = 10 WHERE code = 'a'",
        "UPDATE coded SET code = 'b2' WHERE code = 'b'",
        "DELETE FROM coded WHERE code = 'c'",
        "INSERT INTO coded VALUES ('c', 30, NULL)",
    )
    stored = replica.receive()
    relation = relations_of(stored.manifest.relations)[TableName("public", "coded")]
    assert relation.replica_identity == "i" and relation.identity == ("code",)
    result = replica.apply(stored)
    assert result.tables["public.coded"].deleted == 1  # 'b' moved away
    replica.assert_in_sync()


def test_generated_column_is_left_to_the_target(make_replica):
    replica = make_replica(
        "CREATE TABLE gen (id int PRIMARY KEY, a int, doubled int GENERATED ALWAYS AS (a * 2) "
        "STORED, ident int GENERATED ALWAYS AS IDENTITY)",
        ["gen"],
    )
    replica.source("INSERT INTO gen (id, a) VALUES (1, 1), (2, 2)")
    replica.sync()
    replica.source("UPDATE gen SET a = 21 WHERE id = 2", "INSERT INTO gen (id, a) VALUES (3, 3)")
    stored = replica.receive()
    names = [c["name"] for c in stored.manifest.relations[-1]["columns"]]
    assert names == ["id", "a", "ident"]
    replica.apply(stored)
    replica.assert_in_sync()
    assert "(2,21,42,2)" in replica.target_rows("gen")


def test_reapplying_a_range_is_already_applied_and_changes_nothing(make_replica):
    replica = make_replica(ITEMS, ["items"])
    replica.source("INSERT INTO items (id, name) VALUES (1, 'a')", "UPDATE items SET n = 5")
    stored = replica.receive()
    assert replica.apply(stored).status == ApplyStatus.APPLIED
    before = replica.target_rows("items")
    replica.target("UPDATE items SET name = 'changed on target'")  # a re-apply would undo this
    again = replica.apply(stored)
    assert again.status == ApplyStatus.ALREADY_APPLIED
    assert again.replay_lsn == stored.manifest.result.transform_lsn
    assert replica.target_rows("items") != before
    assert replica.target_rows("items") == ['(1,"changed on target",5,)']


def test_gap_is_refused_but_an_unapplied_empty_range_is_not_a_gap(make_replica):
    replica = make_replica(ITEMS, ["items"])
    replica.source("INSERT INTO items (id, name) VALUES (1, 'a')")
    first = replica.receive()
    replica.source("INSERT INTO unpublished (note) VALUES ('no published change')")
    empty = replica.receive()
    assert empty.manifest.result.transform_lsn is None
    replica.source("UPDATE items SET n = 2 WHERE id = 1")
    third = replica.receive()

    with pytest.raises(ApplyGapError) as refused:
        replica.apply(third)
    assert first.range.key in str(refused.value)
    assert str(replica.progress()) in str(refused.value)

    assert replica.apply(first).status == ApplyStatus.APPLIED
    assert (
        replica.apply(third).status == ApplyStatus.APPLIED
    )  # the empty range between holds nothing
    assert replica.apply(empty).status == ApplyStatus.EMPTY
    replica.assert_in_sync()


def test_missing_origin_is_a_clear_error(make_replica):
    replica = make_replica(ITEMS, ["items"])
    replica.source("INSERT INTO items (id) VALUES (1)")
    stored = replica.receive()
    with pytest.raises(ApplyError, match=r"does not exist on the target.*base snapshot"):
        apply_range(replica.target_dsn, stored, "pgcdc_no_such_slot")


def test_kill_during_apply_leaves_previous_boundary_and_reapply_converges(make_replica, staged):
    """SIGKILL of an apply whose transaction already wrote one table (``accounts``, applied
    first) and waits for the lock of the next (``items``): neither table keeps anything of the
    range, the origin stays, and applying again converges."""
    replica = make_replica(
        ITEMS + "CREATE TABLE accounts (id int PRIMARY KEY, balance int);", ["accounts", "items"]
    )
    replica.source(
        "INSERT INTO items (id, name) SELECT g, 'v' || g FROM generate_series(1, 50) g",
        "INSERT INTO accounts SELECT g, 0 FROM generate_series(1, 10) g",
    )
    replica.sync()
    before = {t: replica.target_rows(t) for t in replica.tables}
    progress = replica.progress()
    replica.source(
        "UPDATE items SET n = id WHERE id <= 25",
        "DELETE FROM items WHERE id > 40",
        "INSERT INTO items (id, name) VALUES (100, 'new')",
        "UPDATE accounts SET balance = balance + id",
        "INSERT INTO accounts VALUES (11, 11)",
    )
    stored = replica.receive()

    with psycopg.connect(replica.target_dsn) as blocker:
        # SHARE lets the apply stage (it reads items' column types) but not write to items.
        blocker.execute("LOCK TABLE items IN SHARE MODE")
        child = _apply_in_child(replica, stored, staged)
        try:
            backend = _wait_for_blocked_apply(replica.target_dsn, timeout=60)
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
        assert child.returncode == -signal.SIGKILL
        blocker.rollback()
    _wait_for_backend_exit(replica.target_dsn, backend, timeout=30)
    _left_nothing_and_converges(replica, stored, before, progress)


def _apply_in_child(
    replica: Replica, stored: StoredRange, staged: int, **env: str
) -> subprocess.Popen[bytes]:
    """``apply_range`` of ``stored`` in a process of its own (to be killed), with the staging
    limit ``staged`` and ``env`` (a failpoint, say) in its environment."""
    script = (
        "import sys; from pgcdc_dagster.engine.apply import staging; "
        "from pgcdc_dagster.engine.apply.transaction import apply_range; "
        "from pgcdc_dagster.engine.store.output_store import OutputStore; "
        "from pgcdc_dagster.engine.lsn import LsnRange; "
        "staging.INLINE_MAX_VALUES = int(sys.argv[5]); "
        "store = OutputStore(sys.argv[1]); "
        "apply_range(sys.argv[2], store.get(LsnRange.from_key(sys.argv[3])), sys.argv[4])"
    )
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            script,
            str(replica.store.root),
            replica.target_dsn,
            stored.range.key,
            ORIGIN,
            str(staged),
        ],
        env={**os.environ, "PGAPPNAME": "pgcdc_killed_apply", **env},
    )


def test_kill_during_the_commit_order_replay_leaves_nothing_and_reapply_converges(
    make_replica, staged
):
    """SIGKILL inside the second transaction of an apply: the one that replays, in commit
    order, a table whose net rows a unique key refused, with another table's rows written
    beside it. Nothing of the range stays, the origin stays, and applying again converges."""
    replica = make_replica(
        POSITIONS + "CREATE TABLE notes (id int PRIMARY KEY);", ["slots", "notes"]
    )
    replica.source("INSERT INTO slots VALUES (1, 1, 1), (2, 1, 2)")
    replica.sync()
    before = {t: replica.target_rows(t) for t in replica.tables}
    progress = replica.progress()
    replica.source(
        "UPDATE slots SET pos = -1 WHERE id = 1",
        "UPDATE slots SET pos = 1 WHERE id = 2",
        "UPDATE slots SET pos = 2 WHERE id = 1",
        "INSERT INTO notes VALUES (1)",
    )
    stored = replica.receive()
    # The first transaction is refused before the point; the point's first passage is the
    # replay's transaction, its rows written and not committed.
    child = _apply_in_child(replica, stored, staged, PGCDC_FAILPOINT="apply.in_transaction=kill@1")
    assert child.wait(timeout=120) == -signal.SIGKILL
    result = _left_nothing_and_converges(replica, stored, before, progress)
    assert result.in_commit_order == ["public.slots"]


def _left_nothing_and_converges(
    replica: Replica, stored: StoredRange, before: dict, progress: Lsn
) -> ApplyResult:
    """After a killed apply of ``stored``: the origin at ``progress``, every table as
    ``before``; then applying it again applies it whole."""
    assert replica.progress() == progress
    assert {t: replica.target_rows(t) for t in replica.tables} == before
    result = replica.apply(stored)
    assert result.status == ApplyStatus.APPLIED
    replica.assert_in_sync()
    return result


def _wait_for_blocked_apply(dsn: str, timeout: float) -> int:
    """The pid of an apply backend waiting on our lock inside its open transaction."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'pgcdc_dagster' "
                "AND wait_event_type = 'Lock' AND backend_xid IS NOT NULL "
                "AND datname = current_database()"
            ).fetchone()
            if row:
                return int(row[0])
            time.sleep(0.05)
    raise AssertionError("the apply never blocked on the table lock with its transaction open")


def _wait_for_backend_exit(dsn: str, pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            if (
                conn.execute("SELECT FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
                is None
            ):
                return
            time.sleep(0.05)
    raise AssertionError(f"backend {pid} of the killed apply did not exit")


@pytest.mark.parametrize("on_spark", [False, True])
def test_column_added_on_source_is_added_on_target_mid_range(make_replica, spark, on_spark):
    """On Spark's path the column comes first, in a transaction of its own, so the shared
    staging tables are typed like the target's columns."""
    replica = make_replica(ITEMS, ["items"])
    replica.source("INSERT INTO items (id, name) VALUES (1, 'a'), (2, 'b')")
    replica.sync()
    replica.source(
        "UPDATE items SET name = 'before the column' WHERE id = 1",
        "ALTER TABLE items ADD COLUMN price numeric(10,2)",
        "UPDATE items SET price = 9.5 WHERE id = 2",
        "INSERT INTO items (id, name, price) VALUES (3, 'c', 1.25)",
    )
    stored = replica.receive()
    assert len(stored.manifest.relations) == 2  # a version before and after the ALTER
    result = replica.apply(stored, **({"spark": spark, "spark_min_changes": 0} if on_spark else {}))
    assert result.schema_changes == [
        "public.items: column price numeric(10,2) added, existing rows NULL"
    ]
    assert result.staged_by == "driver"  # the DDL commits with the rows, so never on Spark
    replica.assert_in_sync()


def test_column_dropped_on_source_is_dropped_on_the_target(make_replica):
    replica = make_replica(ITEMS, ["items"])
    replica.source("INSERT INTO items (id, name) VALUES (1, 'a')")
    replica.sync()
    replica.source("ALTER TABLE items DROP COLUMN n", "UPDATE items SET name = 'b'")
    assert replica.sync().schema_changes == ["public.items: column n dropped (as on the source)"]
    replica.assert_in_sync()


def test_in_process_and_spark_compaction_give_identical_net_rows(make_replica, spark):
    replica = make_replica(
        ITEMS
        + """
        CREATE TABLE pairs (a int, b int, v text, PRIMARY KEY (a, b));
        CREATE TABLE dup (a int, b text); ALTER TABLE dup REPLICA IDENTITY FULL;
        CREATE TABLE fullpk (id int PRIMARY KEY, v text); ALTER TABLE fullpk REPLICA IDENTITY FULL;
        """,
        ["items", "pairs", "dup", "fullpk"],
    )
    replica.source(
        f"INSERT INTO items SELECT g, 'n' || g, g, CASE WHEN g % 7 = 0 THEN {big(0)} END "
        "FROM generate_series(1, 300) g",
        "INSERT INTO pairs SELECT g % 10, g, 'p' FROM generate_series(1, 200) g",
        "INSERT INTO dup SELECT g % 3, 'x' FROM generate_series(1, 12) g",
        "INSERT INTO fullpk SELECT g, 'f' FROM generate_series(1, 40) g",
    )
    replica.sync()
    replica.source(
        "UPDATE items SET n = n * 2 WHERE id % 3 = 0",
        "UPDATE items SET name = 'toast kept' WHERE id % 7 = 0",
        "DELETE FROM items WHERE id % 5 = 0",
        "INSERT INTO items (id, name) SELECT g, 'back' FROM generate_series(5, 100, 5) g",
        "UPDATE items SET id = id + 1000 WHERE id % 14 = 0",  # moves, half of them TOASTed
        "UPDATE items SET id = id + 1000 WHERE id > 1000 AND id % 4 = 0",  # chains
        "UPDATE pairs SET v = 'q' WHERE a = 3",
        "TRUNCATE pairs",
        "INSERT INTO pairs VALUES (1, 1, 'after')",
        "UPDATE dup SET b = 'y' WHERE ctid = (SELECT ctid FROM dup WHERE a = 1 LIMIT 1)",
        "DELETE FROM dup WHERE a = 2",
        "UPDATE fullpk SET v = 'g' WHERE id < 20",
        "UPDATE fullpk SET id = id + 100 WHERE id % 9 = 0",
        "DELETE FROM fullpk WHERE id > 30 AND id < 100",
    )
    stored = replica.receive()
    relations = relations_of(stored.manifest.relations)
    fullpk = TableName("public", "fullpk")
    relations[fullpk] = relations[fullpk].with_identity(["id"])

    in_process = compact_arrow(stored.read_table(), relations)
    assert any(r["f0"] is not None for r in in_process[TableName("public", "items")].sorted_rows())
    # Routed by Spark (the executors' path), each (table, partition) group compacted alone:
    # the union is the whole range's net rows.
    routed = route_changes(spark, [str(f) for f in stored.files], relations, partitions=3)
    on_spark = routed.toArrow()
    spark_groups: dict[tuple[int, int], list[pa.Table]] = {}
    keys = zip(on_spark["_tbl"].to_pylist(), on_spark["_pid"].to_pylist(), strict=True)
    for t, pid in set(keys):
        mask = pc.and_(pc.equal(on_spark["_tbl"], t), pc.equal(on_spark["_pid"], pid))
        spark_groups[(t, pid)] = [unjoin_toast(on_spark.filter(mask))]
    _assert_union_is_net(spark_groups, list(relations), relations, in_process)
    # Routed in this process, batch by batch (small batches: groups span several), each
    # (table, partition) compacted alone: the union is the whole range's net rows.
    router = Router(relations, 3)
    for batch in stored.iter_batches(KERNEL_COLUMNS, batch_rows=50):
        router.learn(batch)
    assert router.moved  # the moves above, and their chains
    groups: dict[tuple[int, int], list[pa.Table]] = {}
    for batch in stored.iter_batches(KERNEL_COLUMNS, batch_rows=50):
        for t, pid, rows in router.route(batch):
            groups.setdefault((t, pid), []).append(rows)
    assert {pid for _, pid in groups} == {0, 1, 2, 3}  # 3 is the moved keys'
    _assert_union_is_net(groups, router.tables, relations, in_process)

    # The same range applied twice from the same start: by Spark's workers staging on the
    # target, then (the target put back) by this process. Same rows, same counts.
    before = replica.progress()
    replica.target(*[f"CREATE TABLE keep_{t} AS TABLE {t}" for t in replica.tables])
    on_executors = replica.apply(stored, spark=spark, spark_min_changes=0)
    assert on_executors.compaction_path == "spark"
    assert on_executors.staged_by == "spark executors"
    replica.assert_in_sync()
    assert _shared_staging_tables(replica.target_dsn) == []  # dropped with the COMMIT
    by_executors = {t: replica.target_rows(t) for t in replica.tables}

    replica.target(
        *[f"TRUNCATE {t}; INSERT INTO {t} SELECT * FROM keep_{t}" for t in replica.tables],
        f"SELECT pg_replication_origin_advance('{ORIGIN}', '{before}')",
    )
    in_process = replica.apply(stored)
    assert (in_process.compaction_path, in_process.staged_by) == ("arrow", "driver")
    assert {t: replica.target_rows(t) for t in replica.tables} == by_executors
    assert in_process.tables == on_executors.tables
    assert on_executors.tables["public.pairs"].truncated

    # And by this process, one key-hash partition at a time (bounded memory).
    replica.target(
        *[f"TRUNCATE {t}; INSERT INTO {t} SELECT * FROM keep_{t}" for t in replica.tables],
        f"SELECT pg_replication_origin_advance('{ORIGIN}', '{before}')",
    )
    partitioned = replica.apply(stored, partition_changes=stored.changes // 3 + 1)
    assert partitioned.compaction_path == "partitioned"
    assert partitioned.staged_by.startswith("driver, ")
    assert {t: replica.target_rows(t) for t in replica.tables} == by_executors
    assert partitioned.tables == on_executors.tables
    assert _shared_staging_tables(replica.target_dsn) == []
    assert not (stored.store_root / SCRATCH).exists()


def _shared_staging_tables(dsn: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = relnamespace "
            "WHERE nspname = %s",
            (staging.SCHEMA,),
        ).fetchall()
    return [r[0] for r in rows]


@pytest.mark.parametrize("path", ["in_memory", "partitioned"])
@pytest.mark.parametrize("diverged", [False, True])
def test_new_keys_are_inserted_apart_and_a_target_that_has_one_falls_back_to_the_upsert(
    make_replica, monkeypatch, path, diverged
):
    """Rows of keys the range inserted first go in by a plain INSERT; a target written by hand
    that holds such a key already takes the whole upsert instead, as before (nothing lost)."""
    monkeypatch.setattr(merge_module, "NEW_ROWS_APART", 100)
    replica = make_replica(ITEMS, ["items"])
    replica.source("INSERT INTO items (id, name) SELECT g, 'old' FROM generate_series(1, 50) g")
    replica.sync()
    if diverged:
        replica.target("INSERT INTO items (id, name) VALUES (120, 'written by hand')")
    replica.source(
        "INSERT INTO items (id, name) SELECT g, 'new' FROM generate_series(51, 400) g",
        "UPDATE items SET n = 1 WHERE id <= 60",  # old keys and new ones
        "DELETE FROM items WHERE id = 2",
        "INSERT INTO items (id, name) VALUES (2, 'again')",  # deleted, then new again: not new
    )
    stored = replica.receive()
    net = compact_arrow(stored.read_table(), relations_of(stored.manifest.relations))
    rows = net[TableName("public", "items")].upserts
    new = {r["c0"] for r in rows.to_pylist() if r["n"]}
    assert new == {str(k) for k in range(51, 401)}
    kwargs = {"partition_changes": stored.changes // 2 + 1} if path == "partitioned" else {}
    inserted_apart: list[bool] = []  # in memory: one INSERT from the staged rows
    direct: list[int] = []  # by partitions: COPYed straight into the target, per partition
    insert_new, copy_new = merge_module.insert_new, shared_staging._insert_new

    def spied(*args, **kw):
        inserted_apart.append(insert_new(*args, **kw))
        return inserted_apart[-1]

    def spied_copy(*args, **kw):
        left, count = copy_new(*args, **kw)
        direct.append(count)
        return left, count

    monkeypatch.setattr(merge_module, "insert_new", spied)
    monkeypatch.setattr(shared_staging, "_insert_new", spied_copy)
    result = replica.apply(stored, **kwargs)
    assert result.compaction_path == ("partitioned" if path == "partitioned" else "arrow")
    replica.assert_in_sync()
    counts = result.tables["public.items"]
    assert (counts.inserted, counts.updated, counts.deleted) == (
        (349, 51, 0) if diverged else (350, 50, 0)
    )
    if path == "in_memory":
        assert inserted_apart == [not diverged]
    elif diverged:  # the partition holding key 120 is upserted whole, the others go straight in
        assert 0 in direct and 0 < sum(direct) < 350 and not any(inserted_apart)
    else:
        assert sum(direct) == 350 and not inserted_apart


def _assert_union_is_net(
    groups: dict[tuple[int, int], list[pa.Table]],
    tables: list[TableName],
    relations: dict[TableName, TableRelation],
    whole: dict[TableName, NetChanges],
) -> None:
    """Each (table index, partition) group of routed changes compacted alone: together they
    give ``whole``'s net rows, counts and truncate, table by table."""
    for t, table in enumerate(tables):
        nets = [
            compact_table(pa.concat_tables(parts), relations[table])
            for (g, _), parts in groups.items()
            if g == t
        ]
        net = whole[table]
        assert sum(n.changes - n.truncates for n in nets) + net.truncates == net.changes, table
        assert {n.truncate for n in nets} == {net.truncate}, table
        if net.ordered:
            assert len(nets) == 1 and nets[0].sorted_rows() == net.sorted_rows(), table
        else:
            routed = sorted(
                (r for n in nets for r in n.sorted_rows()), key=lambda r: (r["op"], str(r))
            )
            assert routed == sorted(net.sorted_rows(), key=lambda r: (r["op"], str(r))), table
