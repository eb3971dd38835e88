"""Online verify: source and target compared at one consistent point while a writer commits
and a follow applies, chunk by chunk; a hand edit on the target is named by chunk and key, and
a repair replaces only those chunks while the writes and the follow go on."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from pgcdc_dagster.engine.compare import chunks
from pgcdc_dagster.engine.compare.repair import repair_chunks
from pgcdc_dagster.engine.compare.verify import compare_online
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.follow.follower import Follower
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster_tests.support.replication import (
    catch_up,
    equal_tables,
    following_while,
    settings_for,
)

ITEMS = TableName("public", "items")
LOG = TableName("public", "log")


def _writes(source_dsn: str, stop: threading.Event) -> None:
    """Inserts past id 100000 and updates of ids 2001-3000 and of the keyless log, until
    ``stop``: never the rows the test edits by hand on the target."""
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        n = 0
        while not stop.is_set():
            n += 1
            with conn.transaction():
                conn.execute("INSERT INTO items VALUES (%s, 'new', %s)", (100000 + n, n))
                conn.execute("UPDATE items SET qty = qty + 1 WHERE id = %s", (2001 + n % 1000,))
                conn.execute("INSERT INTO log VALUES (%s, 'event')", (n,))
            time.sleep(0.005)


@contextmanager
def _following_while_writing(
    source_dsn: str, target_dsn: str, tmp_path
) -> Iterator[tuple[ReplicationSettings, Follower]]:
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, name text, qty int)")
        conn.execute(
            "INSERT INTO items SELECT g, 'item ' || g, g % 7 FROM generate_series(1, 5000) g"
        )
        conn.execute("CREATE TABLE log (n int, what text)")
        conn.execute("ALTER TABLE log REPLICA IDENTITY FULL")
        conn.execute("ANALYZE items")
    settings = settings_for(source_dsn, target_dsn, tmp_path, "verify", tables=(ITEMS, LOG))
    pipeline.take_snapshot(settings, None)
    with following_while(settings, _writes) as (follower, _):
        yield settings, follower


def test_verify_under_writes_names_hand_edited_chunks_and_keys_and_repair_fixes_only_them(
    source_dsn, target_dsn, tmp_path
):
    with _following_while_writing(source_dsn, target_dsn, tmp_path) as (settings, follower):
        first = compare_online(settings, [ITEMS, LOG], "verify test", chunk_rows=500)
        # Both sides at one point while writes went on: no lag reported as a difference.
        assert [(c.table, c.equal) for c in first.tables] == [(ITEMS, True), (LOG, True)]
        items, log = first.tables
        assert items.chunks >= 8 and items.source_rows >= 5000
        assert items.plan is not None and items.plan.text_hash  # one machine: hashes alike
        assert items.differing == () and log.source_rows > 0
        assert first.pair.made_way_by is not None  # the follow made way, and went on
        ranges_before = follower.summary.ranges

        with psycopg.connect(target_dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM items WHERE id = 10")
            conn.execute("UPDATE items SET name = 'edited' WHERE id = 1500")
            conn.execute("INSERT INTO items VALUES (4999999, 'stray', 0)")
            conn.execute("DELETE FROM log WHERE n = 3")  # no key: a chunk by hash
        second = compare_online(settings, [ITEMS, LOG], "verify test", chunk_rows=500)
        items, log = second.tables
        assert not items.equal and not log.equal
        assert second.point > first.point
        keys = {(k.key, k.kind) for chunk in items.differing for k in chunk.keys}
        assert keys == {("(10)", "missing"), ("(1500)", "changed"), ("(4999999)", "extra")}
        # Three rows in at most three chunks of about 500 rows: the rest compared equal.
        assert 1 <= len(items.differing) <= 3 < items.chunks
        (holding_10,) = [c for c in items.differing if ("(10)", "missing") in _listed(c)]
        assert _holds(holding_10.where, 10), holding_10.where  # named by its key range
        assert len(log.differing) == 1 and "md5 starts with" in log.differing[0].where
        deadline = time.monotonic() + 30
        while follower.summary.ranges <= ranges_before:
            assert time.monotonic() < deadline, "the follow did not go on after verify"
            time.sleep(0.1)

        # The differing chunks replaced while writes go on; the follow goes on after it.
        repaired = repair_chunks(settings, second.tables, "verify test")
        assert repaired.point > second.point and repaired.made_way_by is not None
        assert {c.table for c in repaired.chunks} == {ITEMS, LOG}
        assert len(repaired.chunks) == len(items.differing) + len(log.differing)
        ranges_repaired = follower.summary.ranges
        third = compare_online(settings, [ITEMS, LOG], "verify test", chunk_rows=500)
        assert [(c.table, c.equal) for c in third.tables] == [(ITEMS, True), (LOG, True)]
        deadline = time.monotonic() + 30
        while follower.summary.ranges <= ranges_repaired:
            assert time.monotonic() < deadline, "the follow did not go on after the repair"
            time.sleep(0.1)
    catch_up(settings)
    assert equal_tables(settings) == [("public.items", True), ("public.log", True)]


def _listed(chunk) -> set[tuple[str, str]]:
    return {(k.key, k.kind) for k in chunk.keys}


def _holds(where: str, key: int) -> bool:
    """Whether a keyed chunk's description (``id < '487'``, ``'487' <= id < '990'``,
    ``id >= '990'``) covers ``key``."""
    low = re.search(r"'(-?\d+)' <= id|id >= '(-?\d+)'", where)
    high = re.search(r"id < '(-?\d+)'", where)
    above = low is None or key >= int(low.group(1) or low.group(2))
    return above and (high is None or key < int(high.group(1)))


def test_a_chunk_whose_binary_form_differs_on_the_target_is_repaired_in_text(
    source_dsn, target_dsn, tmp_path
):
    """int4 on the source, int8 on the target (a target made by hand): the chunk's binary copy
    fails there, its transaction is rolled back, and the chunk is replaced in text format."""
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE widened (id int PRIMARY KEY, qty int4)")
        conn.execute("INSERT INTO widened SELECT g, g FROM generate_series(1, 3000) g")
        conn.execute("ANALYZE widened")
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE widened (id int PRIMARY KEY, qty int8)")
    widened = TableName("public", "widened")
    settings = settings_for(source_dsn, target_dsn, tmp_path, "widened", tables=(widened,))
    pipeline.take_snapshot(settings, None)
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute("UPDATE widened SET qty = -1 WHERE id IN (7, 2500)")
    found = compare_online(settings, [widened], "verify test", chunk_rows=500)
    (table,) = found.tables
    assert len(table.differing) == 2 and table.chunks >= 4
    repaired = repair_chunks(settings, found.tables, "verify test")
    assert [c.copied for c in repaired.chunks] == [c.deleted for c in repaired.chunks]
    again = compare_online(settings, [widened], "verify test", chunk_rows=500)
    assert [t.equal for t in again.tables] == [True]


def test_a_partitioned_table_is_compared_and_repaired_through_its_partitions(
    source_dsn, target_dsn, tmp_path
):
    """A partitioned table holds no rows of its own: its partitions' rows are compared (a
    hand edit in one partition is found) and repaired through the root."""
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE parted (id int PRIMARY KEY, v text) PARTITION BY RANGE (id)")
        conn.execute("CREATE TABLE parted_low PARTITION OF parted FOR VALUES FROM (0) TO (2000)")
        conn.execute(
            "CREATE TABLE parted_high PARTITION OF parted FOR VALUES FROM (2000) TO (9000)"
        )
        conn.execute("INSERT INTO parted SELECT g, 'v' || g FROM generate_series(1, 4000) g")
        conn.execute("ANALYZE parted")
    parted = TableName("public", "parted")
    settings = settings_for(source_dsn, target_dsn, tmp_path, "parted", tables=(parted,))
    pipeline.take_snapshot(settings, None)
    found = compare_online(settings, [parted], "verify test", chunk_rows=500)
    (table,) = found.tables
    assert table.equal and table.source_rows == table.target_rows == 4000
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute("UPDATE parted SET v = 'edited' WHERE id IN (7, 3500)")
    found = compare_online(settings, [parted], "verify test", chunk_rows=500)
    (table,) = found.tables
    assert not table.equal and len(table.differing) == 2
    keys = {k.key for chunk in table.differing for k in chunk.keys}
    assert keys == {"(7)", "(3500)"}
    repaired = repair_chunks(settings, found.tables, "verify test")
    assert sum(c.copied for c in repaired.chunks) == sum(c.deleted for c in repaired.chunks) > 0
    again = compare_online(settings, [parted], "verify test", chunk_rows=500)
    assert [(t.equal, t.target_rows) for t in again.tables] == [(True, 4000)]


def test_a_table_read_in_many_parts_sums_to_the_same_compare_and_says_how_far_it_is(
    source_dsn, target_dsn, tmp_path, monkeypatch
):
    """Each side's table read in block ranges of 3 blocks (about a dozen parts a side, each
    side cut on its own pages): the chunks' sums add up to the same answer, hand edits are
    found by key, and the progress ends at 100%."""
    monkeypatch.setattr(chunks, "PART_BLOCKS", 3)
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE parts (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO parts SELECT g, repeat('p', 40) FROM generate_series(1, 3000) g")
        conn.execute("ANALYZE parts")
    table = TableName("public", "parts")
    settings = settings_for(source_dsn, target_dsn, tmp_path, "parts", tables=(table,))
    pipeline.take_snapshot(settings, None)
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute("UPDATE parts SET v = 'moved' WHERE id = 11")  # a new version, elsewhere
        conn.execute("DELETE FROM parts WHERE id = 2999")
        (pages,) = conn.execute("SELECT pg_relation_size('parts') / 8192").fetchone()
    assert pages > 3 * 8
    said = []
    found = compare_online(settings, [table], "verify test", chunk_rows=500, progressed=said.append)
    (compared,) = found.tables
    keys = {(k.key, k.kind) for chunk in compared.differing for k in chunk.keys}
    assert keys == {("(11)", "changed"), ("(2999)", "missing")}
    assert compared.source_rows == 3000 and compared.target_rows == 2999
    assert said and said[-1].done_bytes == said[-1].total_bytes > 0
    assert "compared 100%" in said[-1].line()
