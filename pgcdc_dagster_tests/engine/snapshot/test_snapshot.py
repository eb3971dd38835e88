"""The base snapshot against real clusters and a real local Spark: schema, rows, consistency with
the slot, the populated-target guard, the replication origin and sequences."""

from __future__ import annotations

import itertools
import json
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest

from pgcdc_dagster.engine.apply.sequences import sync_sequences
from pgcdc_dagster.engine.connect import libpq_tool_environment
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster.engine.snapshot import (
    SnapshotError,
    TableRange,
    TargetNotEmptyError,
    copy_schema_post_data,
    copy_schema_pre_data,
    copy_tables,
    merge_ranges,
    plan_table_ranges,
    snapshot_export_path,
    take_base_snapshot,
)
from pgcdc_dagster.engine.snapshot.continued import gaps, outside
from pgcdc_dagster.engine.source.slot import create_slot_with_snapshot
from pgcdc_dagster_tests.support.pg import run_sql
from pgcdc_dagster_tests.support.procs import descendants

ODD = TableName("Odd Schema", "Mixed Case")
KEYWORD = TableName("public", "select")
BIG = TableName("public", "big")


def rows_of(dsn: str, table: TableName, order: str = "1") -> list[str]:
    """Every row as PostgreSQL's own text form, so types compare exactly as stored."""
    with psycopg.connect(dsn) as conn:
        query = psycopg.sql.SQL("SELECT t::text FROM {} AS t ORDER BY {}").format(
            table.sql, psycopg.sql.SQL(order)
        )
        return [r[0] for r in conn.execute(query).fetchall()]


def origin_progress(dsn: str, name: str) -> Lsn | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT pg_replication_origin_progress(%s, false)::text", (name,)
        ).fetchone()
    return None if row is None or row[0] is None else Lsn(row[0])


def loaded_frozen(frozen: int, pages: int) -> bool:
    """Whether a table of ``pages`` pages with ``frozen`` all-frozen ones was loaded by COPY
    FREEZE: every page on PostgreSQL 15; on 18 COPY FREEZE leaves a few to the next VACUUM
    (seen: 30 of 360, 1 of 34), against none without FREEZE."""
    return pages > 0 and frozen >= 0.9 * pages


def frozen_pages(dsn: str, table: TableName) -> tuple[int, int]:
    """(pages marked all-frozen in the visibility map, pages of the table's heap)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_visibility")
        row = conn.execute(
            "SELECT (pg_visibility_map_summary(%s::regclass)).all_frozen, "
            "pg_relation_size(%s::regclass) / current_setting('block_size')::int",
            (str(table), str(table)),
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def make_odd_tables(dsn: str) -> None:
    run_sql(
        dsn,
        'CREATE SCHEMA "Odd Schema"',
        """CREATE TYPE "Odd Schema".mood AS ENUM ('sad', 'ok', 'happy')""",
        "CREATE DOMAIN public.posint AS integer CHECK (VALUE > 0)",
        """
        CREATE TABLE "Odd Schema"."Mixed Case" (
            id serial PRIMARY KEY,
            "Mood" "Odd Schema".mood,
            moods "Odd Schema".mood[],
            "my col" text,
            big_text text,
            n posint,
            doubled integer GENERATED ALWAYS AS (id * 2) STORED
        )""",
        """
        CREATE TABLE public."select" (
            id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            "from" text,
            "order" numeric,
            at timestamptz
        )""",
        """CREATE INDEX "select lower from" ON public."select" (lower("from"))""",
    )
    run_sql(
        dsn,
        """
        INSERT INTO "Odd Schema"."Mixed Case" ("Mood", moods, "my col", big_text, n)
        SELECT (ARRAY['sad','ok','happy'])[1 + i % 3]::"Odd Schema".mood,
               CASE WHEN i % 4 = 0 THEN NULL ELSE ARRAY['ok','sad']::"Odd Schema".mood[] END,
               CASE WHEN i % 5 = 0 THEN NULL
                    ELSE 'zeile ' || i || ' — 日本語 ✓ 🐘 "quoted", comma' || E'\\t' || 'tab' END,
               CASE WHEN i % 50 = 0
                    THEN (SELECT string_agg(md5(i::text || g::text), '')
                          FROM generate_series(1, 4000) g)
               END,
               CASE WHEN i % 7 = 0 THEN NULL ELSE i END
        FROM generate_series(1, 500) i
        """,
        """INSERT INTO public."select" ("from", "order", at)
           SELECT CASE WHEN i % 3 = 0 THEN NULL ELSE 'line' || E'\\n' || i END,
                  i / 7.0, '2024-01-01 00:00+00'::timestamptz + i * interval '1 minute'
           FROM generate_series(1, 300) i""",
        'INSERT INTO public."select" ("from") VALUES (\'\')',
    )


@pytest.mark.parametrize("bundled", [True, False])
def test_odd_identifiers_types_and_toast_arrive_exactly(
    source_dsn: str, target_dsn: str, spark: Any, bundled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both small tables in one bundle (text format), or each through a pair of its own."""
    from pgcdc_dagster.engine.snapshot import copy as copy_module

    if not bundled:
        monkeypatch.setattr(copy_module, "BUNDLE_MAX_ROWS", 0)
    make_odd_tables(source_dsn)

    result = take_base_snapshot(
        source_dsn, target_dsn, "snap_odd", "pub_odd", [ODD, KEYWORD], spark=spark
    )

    assert {t.table: t.rows for t in result.tables} == {ODD: 500, KEYWORD: 301}
    for table in (ODD, KEYWORD):
        assert rows_of(target_dsn, table) == rows_of(source_dsn, table)
    with psycopg.connect(target_dsn) as conn:
        # The toasted values really are large, the generated column was computed by the target.
        assert conn.execute(
            'SELECT max(length(big_text)), sum(doubled) FROM "Odd Schema"."Mixed Case"'
        ).fetchone() == (128000, 500 * 501)
        indexes = {r[0] for r in conn.execute("SELECT indexname FROM pg_indexes").fetchall()}
        assert {"Mixed Case_pkey", "select_pkey", "select lower from"} <= indexes
        with pytest.raises(psycopg.errors.CheckViolation):  # the domain came along
            conn.execute('INSERT INTO "Odd Schema"."Mixed Case" (n) VALUES (-1)')
    with psycopg.connect(source_dsn) as conn:
        slot_lsn = conn.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            ("snap_odd",),
        ).fetchone()
    assert slot_lsn is not None and Lsn(slot_lsn[0]) == result.consistent_point
    assert origin_progress(target_dsn, "pgcdc_snap_odd") == result.consistent_point
    assert result.sequences['"Odd Schema"."Mixed Case_id_seq"'] == 500
    if bundled:
        assert all(t.bundled_with == 1 and not t.frozen for t in result.tables)
        return
    # Both tables were created by this snapshot and copied whole: loaded frozen, so the target's
    # first VACUUM and the key builds find every page all-visible, all-frozen.
    assert all(t.frozen and t.bundled_with == 0 for t in result.tables)
    frozen, pages = frozen_pages(target_dsn, ODD)
    assert loaded_frozen(frozen, pages)
    # The snapshot says how it loaded, against the target's own settings.
    with psycopg.connect(target_dsn) as conn:
        level, work_mem = conn.execute(
            "SELECT current_setting('wal_level'), current_setting('maintenance_work_mem')"
        ).fetchone()  # type: ignore[misc]
    assert result.bulk_load["copy"].endswith("2 of 2 table(s) loaded frozen")
    assert result.bulk_load["wal"] == f"every row (wal_level {level})"
    assert f"maintenance_work_mem {work_mem}," in result.bulk_load["keys"]
    assert result.keys_seconds == result.post_data.seconds > 0


def make_big_with_holes(
    source_dsn: str, target_dsn: str, rows: int, rows_per_task: int
) -> list[TableRange]:
    """``big`` on the source with holes and moved row versions (so ranges hold unequal,
    non-contiguous rows), created empty on the target; returns its planned ranges."""
    run_sql(
        source_dsn,
        "CREATE TABLE big (id int PRIMARY KEY, payload text, flag boolean)",
        "INSERT INTO big SELECT i, repeat(md5(i::text), 2), i % 2 = 0 "
        f"FROM generate_series(1, {rows}) i",
        "DELETE FROM big WHERE id % 10 = 3",
        "UPDATE big SET payload = 'moved' WHERE id % 100 = 7",
        "ANALYZE big",
    )
    copy_schema_pre_data(source_dsn, target_dsn, [BIG], None)
    with psycopg.connect(source_dsn) as conn:
        return plan_table_ranges(conn, [BIG], None, target_rows_per_task=rows_per_task)


def test_large_table_split_into_ctid_ranges_copies_every_row_once(
    source_dsn: str, target_dsn: str, spark: Any
) -> None:
    ranges = make_big_with_holes(source_dsn, target_dsn, 40000, rows_per_task=5000)
    assert len(ranges) >= 5
    assert ranges[0].start_block is None and ranges[-1].end_block is None
    for before, after in itertools.pairwise(ranges):
        assert before.end_block == after.start_block

    # Two partitions for seven-plus tasks: the parallelism cap groups tasks per Spark task.
    results = copy_tables(
        spark,
        source_dsn,
        target_dsn,
        None,
        [BIG],
        parallelism=2,
        target_rows_per_task=5000,
        driver_max_rows=0,
    )

    assert results[0].copied_by == "spark"
    assert results[0].rows == 36000 and results[0].tasks == len(ranges)
    assert results[0].copy_formats == ("binary",)
    assert rows_of(target_dsn, BIG) == rows_of(source_dsn, BIG)


@pytest.mark.parametrize(("parallelism", "tasks"), [(1, 1), (2, 2)])
def test_driver_copies_in_as_many_ranges_as_it_has_workers(
    source_dsn: str, target_dsn: str, parallelism: int, tasks: int
) -> None:
    """The plan cuts ``big`` into many ranges; the driver joins neighbours back into one range
    per worker (a range costs a psql pair and a snapshot import), and still copies every row
    exactly once, holes and moved row versions included.

    ``big`` is new on the target: copied as one range it is loaded frozen (truncated and
    ``COPY ... FREEZE`` in one transaction); copied as two, never (a truncate would take the
    other range's rows)."""
    planned = make_big_with_holes(source_dsn, target_dsn, 30000, rows_per_task=3000)
    assert len(planned) >= 8

    results = copy_tables(
        None, source_dsn, target_dsn, None, [BIG], parallelism=parallelism,
        target_rows_per_task=3000, new_tables=[BIG],
    )  # fmt: skip

    assert results[0].copied_by == "driver" and results[0].tasks == tasks
    assert results[0].rows == 27000
    assert rows_of(target_dsn, BIG) == rows_of(source_dsn, BIG)
    frozen, pages = frozen_pages(target_dsn, BIG)
    assert results[0].frozen == (tasks == 1)
    assert loaded_frozen(frozen, pages) if tasks == 1 else (frozen == 0 and pages > 0)


def test_merged_ranges_tile_each_relation() -> None:
    columns = ("id",)
    t, leaf_a, leaf_b = (TableName("public", n) for n in ("t", "t_a", "t_b"))
    ranges = [
        TableRange(t, leaf_a, columns, None, 10, 100),
        TableRange(t, leaf_a, columns, 10, 20, 100),
        TableRange(t, leaf_a, columns, 20, None, 100),
        TableRange(t, leaf_b, columns, None, 5, 50),
        TableRange(t, leaf_b, columns, 5, None, 50),
    ]

    assert merge_ranges(ranges, 10**9) == [
        TableRange(t, leaf_a, columns, None, None, 300),
        TableRange(t, leaf_b, columns, None, None, 100),
    ]
    assert merge_ranges(ranges, 150) == [
        TableRange(t, leaf_a, columns, None, 20, 200),
        TableRange(t, leaf_a, columns, 20, None, 100),
        TableRange(t, leaf_b, columns, None, None, 100),
    ]
    assert merge_ranges(ranges, 1) == ranges


def test_the_blocks_a_continued_table_copies_are_exactly_those_its_kept_ranges_leave_out() -> None:
    """A resume continues a table from the ranges a killed snapshot copied (``continued``): the
    other blocks, cut from the new plan, must tile what the kept ranges leave out, no more."""
    t = TableName("public", "t")
    assert gaps([(10, 20), (30, None)]) == [(0, 10), (20, 30)]
    assert gaps([(0, 10), (10, 20)]) == [(20, None)]
    assert gaps([(5, 8)]) == [(0, 5), (8, None)]
    planned = [
        TableRange(t, t, ("id",), None, 15, 150),
        TableRange(t, t, ("id",), 15, None, 100),
    ]
    parts = [p for rng in planned for p in outside(rng, [(10, 20), (30, 40)])]
    assert [(p.start_block, p.end_block) for p in parts] == [(None, 10), (20, 30), (40, None)]
    assert parts[0].estimated_rows == 100  # 10 of its 15 blocks


def test_dataframe_scheduler_for_spark_connect_copies_the_same(
    source_dsn: str, target_dsn: str, spark: Any
) -> None:
    run_sql(
        source_dsn,
        "CREATE TABLE big (id int PRIMARY KEY, payload text)",
        "INSERT INTO big SELECT i, md5(i::text) FROM generate_series(1, 20000) i",
    )
    copy_schema_pre_data(source_dsn, target_dsn, [BIG], None)

    results = copy_tables(
        spark,
        source_dsn,
        target_dsn,
        None,
        [BIG],
        target_rows_per_task=4000,
        scheduler="dataframe",
        driver_max_rows=0,
    )

    assert results[0].rows == 20000 and results[0].tasks > 1
    assert rows_of(target_dsn, BIG) == rows_of(source_dsn, BIG)


SMALL = TableName("public", "small")


def test_copy_sees_only_the_exported_snapshot_while_a_writer_runs(
    source_dsn: str, target_dsn: str, spark: Any
) -> None:
    """A tiny table copied by the driver and a large one by Spark, both written to during the
    copy: each holds exactly the rows of the exported snapshot."""
    run_sql(
        source_dsn,
        "CREATE TABLE big (id int PRIMARY KEY, v text NOT NULL)",
        "INSERT INTO big SELECT i, 'before' FROM generate_series(1, 30000) i",
        "CREATE TABLE small (id int PRIMARY KEY, n int NOT NULL)",
        "INSERT INTO small SELECT i, 0 FROM generate_series(1, 200) i",
        "ANALYZE big",
        "ANALYZE small",
    )
    copy_schema_pre_data(source_dsn, target_dsn, [BIG, SMALL], None)
    may_write = threading.Event()
    may_write.set()
    idle = threading.Event()
    stop = threading.Event()
    commits: list[float] = []

    def writer() -> None:
        with psycopg.connect(source_dsn, autocommit=True) as conn:
            next_id = 30001
            while not stop.is_set():
                if not may_write.is_set():
                    idle.set()
                    may_write.wait()
                    continue
                with conn.transaction():
                    conn.execute("INSERT INTO big VALUES (%s, 'new')", (next_id,))
                    conn.execute(
                        "UPDATE big SET v = 'changed' WHERE id = %s", (next_id % 30000 + 1,)
                    )
                    conn.execute("DELETE FROM big WHERE id = %s", ((next_id * 7) % 30000 + 1,))
                    conn.execute("UPDATE small SET n = n + 1 WHERE id = %s", (next_id % 200 + 1,))
                    conn.execute("INSERT INTO small VALUES (%s, -1)", (next_id + 1000,))
                commits.append(time.monotonic())
                next_id += 1

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)
        # Pause the writer only around slot creation, so "in the snapshot" is exactly
        # "committed before the pause"; it writes again during the whole copy.
        may_write.clear()
        idle.wait(10)
        with create_slot_with_snapshot(source_dsn, "snap_writer") as exported:
            expected = rows_of(source_dsn, BIG)
            expected_small = rows_of(source_dsn, SMALL)
            may_write.set()
            copy_started = time.monotonic()
            results = copy_tables(
                spark,
                source_dsn,
                target_dsn,
                exported.slot.snapshot_name,
                [BIG, SMALL],
                target_rows_per_task=5000,
                # small's estimate grows with the pages the writer's updates add before the
                # plan (200 rows a page): far from this, big's 30,000 rows far above it.
                driver_max_rows=5000,
            )
            copy_ended = time.monotonic()
    finally:
        stop.set()
        may_write.set()
        thread.join(10)

    during_copy = [t for t in commits if copy_started <= t <= copy_ended]
    assert len(during_copy) > 10, "the writer must really have written during the copy"
    by_table = {r.table: r for r in results}
    assert by_table[BIG].tasks > 1 and by_table[BIG].copied_by == "spark"
    assert by_table[SMALL].copied_by == "driver"
    assert rows_of(target_dsn, BIG) == expected
    assert rows_of(source_dsn, BIG) != expected
    assert rows_of(target_dsn, SMALL) == expected_small
    assert rows_of(source_dsn, SMALL) != expected_small


def test_populated_target_is_refused_and_resnapshot_starts_over(
    source_dsn: str, target_dsn: str, spark: Any
) -> None:
    run_sql(
        source_dsn,
        "CREATE TABLE big (id int PRIMARY KEY, v text)",
        "INSERT INTO big SELECT i, 'first' FROM generate_series(1, 1000) i",
    )
    run_sql(
        target_dsn, "CREATE TABLE big (id int PRIMARY KEY, v text)", "INSERT INTO big VALUES (0)"
    )

    with pytest.raises(TargetNotEmptyError, match=r"public\.big.*--resnapshot"):
        take_base_snapshot(source_dsn, target_dsn, "snap_guard", "pub_guard", [BIG], spark=spark)
    with psycopg.connect(source_dsn) as conn:  # refused before anything was created
        assert conn.execute("SELECT count(*) FROM pg_replication_slots").fetchone() == (0,)

    first = take_base_snapshot(
        source_dsn, target_dsn, "snap_guard", "pub_guard", [BIG], spark=spark, resnapshot=True
    )
    assert rows_of(target_dsn, BIG) == rows_of(source_dsn, BIG)
    with pytest.raises(TargetNotEmptyError):
        take_base_snapshot(source_dsn, target_dsn, "snap_guard", "pub_guard", [BIG], spark=spark)

    run_sql(
        source_dsn, "UPDATE big SET v = 'second' WHERE id <= 10", "DELETE FROM big WHERE id > 900"
    )
    second = take_base_snapshot(
        source_dsn, target_dsn, "snap_guard", "pub_guard", [BIG], spark=spark, resnapshot=True
    )

    assert second.tables[0].rows == 900
    assert rows_of(target_dsn, BIG) == rows_of(source_dsn, BIG)
    assert second.consistent_point > first.consistent_point
    assert origin_progress(target_dsn, "pgcdc_snap_guard") == second.consistent_point
    assert second.pre_data.created == ()  # the truncated table was kept, not re-created
    # A table the snapshot did not create is never truncated by the copy, so never loaded frozen.
    assert not first.tables[0].frozen and not second.tables[0].frozen
    assert second.post_data.created == ()


def test_a_target_without_room_for_the_origin_is_refused_before_anything_changes(
    source_dsn: str, target_dsn: str, spark: Any
) -> None:
    """The origin is set only after the whole copy: a target whose origin state slots
    (``max_replication_slots``; ``max_active_replication_origins`` from PostgreSQL 18) are all
    held by other origins must be refused up front, not after hours of copying."""
    from pgcdc_dagster.engine.apply.origin import origin_slots_setting
    from pgcdc_dagster.engine.errors import OriginError

    run_sql(source_dsn, "CREATE TABLE big (id int PRIMARY KEY)", "INSERT INTO big VALUES (1)")
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        setting = origin_slots_setting(conn.info.server_version)
        row = conn.execute(
            "SELECT count(*), current_setting(%s)::int FROM pg_replication_origin_status",
            (setting,),
        ).fetchone()
        assert row is not None
        fillers = [f"filler_{i}" for i in range(row[1] - row[0])]
        for name in fillers:
            conn.execute("SELECT pg_replication_origin_create(%s)", (name,))
            conn.execute("SELECT pg_replication_origin_advance(%s, '0/1')", (name,))
    try:
        with pytest.raises(OriginError, match=rf"no room for replication origin.*{setting}"):
            take_base_snapshot(source_dsn, target_dsn, "snap_room", "pub_room", [BIG], spark=spark)
        with psycopg.connect(source_dsn) as conn:
            assert conn.execute("SELECT count(*) FROM pg_replication_slots").fetchone() == (0,)
        with psycopg.connect(target_dsn) as conn:
            assert conn.execute("SELECT to_regclass('public.big')").fetchone() == (None,)
    finally:
        with psycopg.connect(target_dsn, autocommit=True) as conn:
            for name in fillers:
                conn.execute("SELECT pg_replication_origin_drop(%s)", (name,))


def test_failed_copy_drops_the_new_slot(source_dsn: str, target_dsn: str, spark: Any) -> None:
    run_sql(
        source_dsn,
        "CREATE TABLE big (id int PRIMARY KEY, v text)",
        "INSERT INTO big SELECT i, 'x' FROM generate_series(1, 100) i",
    )
    # An empty target table that cannot take the rows: the copy fails mid-snapshot.
    run_sql(target_dsn, "CREATE TABLE big (id int PRIMARY KEY, v text CHECK (v <> 'x'))")

    with pytest.raises(SnapshotError, match="big"):
        take_base_snapshot(source_dsn, target_dsn, "snap_fail", "pub_fail", [BIG], spark=spark)

    with psycopg.connect(source_dsn) as conn:
        assert conn.execute("SELECT count(*) FROM pg_replication_slots").fetchone() == (0,)


def test_binary_copy_falls_back_to_text_when_target_types_differ(
    source_dsn: str, target_dsn: str, spark: Any
) -> None:
    run_sql(
        source_dsn,
        "CREATE TABLE big (id int PRIMARY KEY, amount int4)",
        "INSERT INTO big SELECT i, i * 3 FROM generate_series(1, 2000) i",
    )
    # int4 on the source, int8 on the target: the binary forms differ, the text forms do not.
    run_sql(target_dsn, "CREATE TABLE big (id int PRIMARY KEY, amount int8)")

    results = copy_tables(spark, source_dsn, target_dsn, None, [BIG])

    assert results[0].copy_formats == ("text",)
    assert rows_of(target_dsn, BIG) == rows_of(source_dsn, BIG)


def test_foreign_keys_to_tables_not_on_the_target_are_skipped(
    source_dsn: str, target_dsn: str
) -> None:
    run_sql(
        source_dsn,
        "CREATE TABLE parent (id int PRIMARY KEY)",
        "CREATE TABLE lookup (id int PRIMARY KEY)",
        "CREATE TABLE child (id int PRIMARY KEY, parent_id int REFERENCES parent, "
        "lookup_id int REFERENCES lookup)",
    )
    tables = [TableName("public", "child"), TableName("public", "parent")]
    copy_schema_pre_data(source_dsn, target_dsn, tables, None)

    post = copy_schema_post_data(source_dsn, target_dsn, tables)

    assert any("child_parent_id_fkey" in c for c in post.created)
    assert len(post.skipped) == 1 and "lookup" in post.skipped[0]
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute("SELECT to_regclass('public.lookup')").fetchone() == (None,)


def test_partitioned_table_is_copied_leaf_by_leaf_through_its_root(
    source_dsn: str, target_dsn: str, spark: Any
) -> None:
    run_sql(
        source_dsn,
        "CREATE TABLE events (id int, day date, PRIMARY KEY (id, day)) PARTITION BY RANGE (day)",
        "CREATE TABLE events_a PARTITION OF events "
        "FOR VALUES FROM ('2024-01-01') TO ('2024-02-01')",
        "CREATE TABLE events_b PARTITION OF events "
        "FOR VALUES FROM ('2024-02-01') TO ('2024-03-01')",
        "INSERT INTO events SELECT i, '2024-01-01'::date + i % 59 FROM generate_series(1, 3000) i",
    )
    events = TableName("public", "events")

    result = take_base_snapshot(
        source_dsn, target_dsn, "snap_parts", "pub_parts", [events], spark=spark
    )

    assert result.tables[0].rows == 3000 and result.tables[0].tasks == 2
    assert not result.tables[0].frozen  # written through the root: COPY FREEZE refuses that
    assert rows_of(target_dsn, events, "t.id") == rows_of(source_dsn, events, "t.id")
    assert rows_of(target_dsn, TableName("public", "events_b"), "t.id") == rows_of(
        source_dsn, TableName("public", "events_b"), "t.id"
    )


def test_parquet_export_is_stamped_with_the_consistent_point(
    source_dsn: str, target_dsn: str, spark: Any, tmp_path: Path
) -> None:
    make_odd_tables(source_dsn)

    result = take_base_snapshot(
        source_dsn,
        target_dsn,
        "snap_export",
        "pub_export",
        [ODD, KEYWORD],
        spark=spark,
        export_store=tmp_path,
        target_rows_per_task=100,
    )

    folder = snapshot_export_path(tmp_path, ODD)
    assert folder.name == "Odd%20Schema.Mixed%20Case"
    manifest = json.loads((folder / "_SNAPSHOT.json").read_text())
    assert Lsn(manifest["consistent_point"]) == result.consistent_point
    assert manifest["rows"] == 500
    exported = pq.read_table([folder / f for f in manifest["files"]]).sort_by("id")
    with psycopg.connect(source_dsn) as conn:
        source = conn.execute(
            'SELECT id, "Mood"::text, "my col", n FROM "Odd Schema"."Mixed Case" ORDER BY id'
        ).fetchall()
    assert exported.select(["id", "Mood", "my col", "n"]).to_pylist() == [
        {"id": i, "Mood": m, "my col": c, "n": n} for i, m, c, n in source
    ]
    keyword = pq.read_table(snapshot_export_path(tmp_path, KEYWORD))
    assert keyword.num_rows == 301 and "" in keyword.column("from").to_pylist()
    assert rows_of(target_dsn, KEYWORD) == rows_of(source_dsn, KEYWORD)


def test_sync_sequences_copies_positions(source_dsn: str, target_dsn: str) -> None:
    sequences = (
        "CREATE SEQUENCE used_seq",
        "CREATE SEQUENCE fresh_seq START 100",
        'CREATE SEQUENCE "Odd Seq" INCREMENT 5',
    )
    run_sql(source_dsn, *sequences)
    run_sql(target_dsn, *sequences, "SELECT setval('fresh_seq', 555)")
    run_sql(
        source_dsn,
        "SELECT nextval('used_seq') FROM generate_series(1, 42)",
        """SELECT nextval('"Odd Seq"'), nextval('"Odd Seq"')""",
        "CREATE SEQUENCE source_only_seq",
    )

    synced = sync_sequences(source_dsn, target_dsn)

    assert synced == {"public.used_seq": 42, "public.fresh_seq": 100, 'public."Odd Seq"': 6}
    with psycopg.connect(target_dsn) as conn:
        assert conn.execute(
            """SELECT nextval('used_seq'), nextval('fresh_seq'), nextval('"Odd Seq"')"""
        ).fetchone() == (43, 100, 11)


def test_libpq_tool_environment_keeps_the_password_off_the_command_line() -> None:
    env, argv = libpq_tool_environment(
        "host=db.example port=5433 dbname='my db' user=u password='p w' keepalives=1"
    )

    assert env["PGPASSWORD"] == "p w" and env["PGDATABASE"] == "my db"
    assert not any("p w" in arg for arg in argv)
    assert argv == ["--dbname=keepalives=1 dbname='my db'"]


def test_the_piped_copy_commits_a_range_whole_or_not_at_all(source_dsn: str, target_dsn: str):
    """The copy through two ``psql`` processes: a range arrives whole; a source side that
    fails (here: a snapshot that cannot be imported) leaves nothing on the target and hands
    the range back to the in-process copy, which names the problem."""
    from pgcdc_dagster.engine.snapshot.common import CopyTask, TableRange
    from pgcdc_dagster.engine.snapshot.copy import _copy_piped, copy_range, piped_copy_available

    assert piped_copy_available()  # psql is part of what CI installs
    run_sql(
        source_dsn,
        "CREATE TABLE piped (id int PRIMARY KEY, note text)",
        "INSERT INTO piped SELECT i, repeat('x', i % 50) FROM generate_series(1, 30000) i",
    )
    run_sql(target_dsn, "CREATE TABLE piped (id int PRIMARY KEY, note text)")
    table = TableName("public", "piped")
    rng = TableRange(table, table, ("id", "note"), None, None, 30000)

    bogus = CopyTask(rng, source_dsn, target_dsn, snapshot_name="00000003-0000001B-1")
    assert _copy_piped(bogus, "binary") is None
    assert rows_of(target_dsn, table) == []
    with pytest.raises(SnapshotError, match="snapshot"):
        copy_range(bogus)
    assert rows_of(target_dsn, table) == []

    result = _copy_piped(CopyTask(rng, source_dsn, target_dsn, None), "binary")
    assert result is not None and result[0] == 30000
    # bytes come from the source side's /proc/<pid>/io, where the kernel offers it
    assert result[1] > 30000 * 4 if Path("/proc/self/io").is_file() else result[1] == 0
    assert rows_of(target_dsn, table) == rows_of(source_dsn, table)


def _piped_task(source_dsn: str, target_dsn: str, rows: int) -> Any:
    """A one-range copy task of a ``piped`` table long enough to be caught mid-COPY."""
    from pgcdc_dagster.engine.snapshot.common import CopyTask, TableRange

    ddl = "CREATE TABLE piped (id int PRIMARY KEY, note text)"
    run_sql(
        source_dsn,
        ddl,
        f"INSERT INTO piped SELECT i, repeat(md5(i::text), 3) FROM generate_series(1, {rows}) i",
    )
    run_sql(target_dsn, ddl)
    table = TableName("public", "piped")
    return CopyTask(
        TableRange(table, table, ("id", "note"), None, None, rows), source_dsn, target_dsn, None
    )


def test_the_in_process_copy_loads_a_new_table_frozen_too(source_dsn: str, target_dsn: str):
    """The libpq path (no ``psql``, or a binary mismatch) truncates and loads frozen in its
    own transaction, as the piped path does."""
    from dataclasses import replace

    from pgcdc_dagster.engine.snapshot.copy import _copy_once

    task = replace(_piped_task(source_dsn, target_dsn, 2000), freeze=True)

    rows, _, _ = _copy_once(task, "binary")

    assert rows == 2000
    assert rows_of(target_dsn, task.range.table) == rows_of(source_dsn, task.range.table)
    frozen, pages = frozen_pages(target_dsn, task.range.table)
    assert loaded_frozen(frozen, pages)


def test_progress_readings_do_not_wait_for_a_frozen_load(source_dsn: str, target_dsn: str):
    """A frozen load holds its truncate's lock until it commits: the progress reading must not
    queue behind it (``pg_table_size`` would), or the progress display would freeze for the
    whole copy of the table."""
    from pgcdc_dagster.engine.progress import CopyWatcher, listening

    run_sql(
        source_dsn, "CREATE TABLE big (id int)", "INSERT INTO big SELECT generate_series(1, 100)"
    )
    run_sql(source_dsn, "ANALYZE big")
    run_sql(target_dsn, "CREATE TABLE big (id int)")
    with listening(lambda progress: None), psycopg.connect(target_dsn) as loading:
        watcher = CopyWatcher(source_dsn, target_dsn, [BIG], time.monotonic())
        loading.execute("TRUNCATE ONLY big")  # held, as a frozen load holds it
        started = time.monotonic()

        reading = watcher._measure("copy")

        assert time.monotonic() - started < 2
        (table,) = reading.tables
        assert table.estimated_rows == 100 and table.rows == 0 and table.bytes == 0


def _wait_for_copy_rows(target_dsn: str) -> None:
    """Until the target's COPY has taken rows (the copy is under way)."""
    deadline = time.monotonic() + 30
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            (n,) = conn.execute(  # type: ignore[misc]
                "SELECT coalesce(sum(tuples_processed), 0) FROM pg_stat_progress_copy "
                "WHERE datname = current_database()"
            ).fetchone()
            if n > 0:
                return
            time.sleep(0.01)
    raise AssertionError("the target's COPY never started")


def _copies_end(target_dsn: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        while conn.execute(
            "SELECT FROM pg_stat_progress_copy WHERE datname = current_database()"
        ).fetchone():
            assert time.monotonic() < deadline, "a COPY kept running"
            time.sleep(0.05)


def test_the_piped_copy_commits_nothing_when_its_source_side_is_killed_mid_stream(
    source_dsn: str, target_dsn: str
) -> None:
    """SIGKILL of the source ``psql`` while rows flow: the target side has taken rows of an
    unfinished range, but never gets its COMMIT. Text format, because a text COPY takes a cut
    last line as a row (a binary one rejects a cut tuple by itself)."""
    import os
    import signal

    from pgcdc_dagster.engine.snapshot.copy import _copy_piped

    task = _piped_task(source_dsn, target_dsn, 600_000)
    outcome: list[Any] = []
    copier = threading.Thread(target=lambda: outcome.append(_copy_piped(task, "text")))
    copier.start()
    _wait_for_copy_rows(target_dsn)
    sources = [pid for pid, cmd in descendants(os.getpid()).items() if "TO STDOUT" in cmd]
    assert len(sources) == 1
    os.kill(sources[0], signal.SIGKILL)
    copier.join(30)

    assert outcome == [None]  # handed back to the in-process copy
    _copies_end(target_dsn, 10)
    assert rows_of(target_dsn, TableName("public", "piped")) == []


@pytest.mark.parametrize(("setpriv", "freeze"), [(True, False), (False, False), (True, True)])
def test_a_piped_copy_whose_process_is_killed_lands_nothing(
    source_dsn: str, target_dsn: str, setpriv: bool, freeze: bool
) -> None:
    """SIGKILL of the process that runs the pair mid-COPY: its command pipe ends without
    COMMIT. With ``setpriv`` the pair dies with it at once; without, the pair runs to the end
    of its range and the target side rolls back. A frozen load's truncate rolls back with it:
    the table keeps the very file it had."""
    import os
    import signal
    import subprocess
    import sys

    task = _piped_task(source_dsn, target_dsn, 600_000)
    filenode = "SELECT pg_relation_filenode('piped')"
    with psycopg.connect(target_dsn) as conn:
        before = conn.execute(filenode).fetchone()
    script = (
        "import sys\n"
        "from pgcdc_dagster.engine.snapshot import copy\n"
        "from pgcdc_dagster.engine.snapshot.common import CopyTask, TableRange\n"
        "from pgcdc_dagster.engine.identifiers import TableName\n"
        f"{'' if setpriv else 'copy._ending_with_this_process = lambda: []'}\n"
        "t = TableName('public', 'piped')\n"
        "rng = TableRange(t, t, ('id', 'note'), None, None, 0)\n"
        "copy._copy_piped(CopyTask(rng, sys.argv[1], sys.argv[2], None, "
        f"freeze={freeze}), 'binary')\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script, task.source_dsn, task.target_dsn])
    try:
        _wait_for_copy_rows(target_dsn)
        pair = list(descendants(child.pid))
        assert len(pair) == 2
        with psycopg.connect(target_dsn) as conn:  # a frozen load is killed holding its truncate
            truncating = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE relation = 'piped'::regclass "
                "AND mode = 'AccessExclusiveLock' AND granted"
            ).fetchone()
        assert truncating == (int(freeze),)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL
        if setpriv:
            deadline = time.monotonic() + 5
            while any(Path(f"/proc/{pid}").exists() for pid in pair):
                assert time.monotonic() < deadline, "the psql pair outlived its process"
                time.sleep(0.05)
        _copies_end(target_dsn, 30)
        time.sleep(0.5)  # the target side's disconnect, after its COPY ended
        assert rows_of(target_dsn, TableName("public", "piped")) == []
        with psycopg.connect(target_dsn) as conn:
            assert conn.execute(filenode).fetchone() == before
    finally:
        child.kill()
        child.wait()


def _small_tables(dsn: str, count: int) -> list[TableName]:
    """``count`` small tables whose values test the text format: NULLs, tabs, newlines,
    backslashes, a value that reads ``\\.`` (the bundle's end-of-data line), odd names; the
    last one empty."""
    tables = [
        TableName("Odd Schema" if i % 3 == 0 else "public", f"Small {i}") for i in range(count)
    ]
    run_sql(dsn, 'CREATE SCHEMA IF NOT EXISTS "Odd Schema"')
    for i, table in enumerate(tables):
        name = table.sql.as_string(None)
        run_sql(dsn, f"CREATE TABLE {name} (id int PRIMARY KEY, v text, n numeric)")
        if i < count - 1:
            run_sql(
                dsn,
                f"INSERT INTO {name} SELECT g, CASE g % 5 "
                "WHEN 0 THEN NULL WHEN 1 THEN E'tab\\there' WHEN 2 THEN E'line\\nbreak' "
                "WHEN 3 THEN '\\.' ELSE E'back\\\\slash \\\\.' END, g / 3.0 "
                f"FROM generate_series(1, {10 + 7 * i}) g",
            )
    return tables


def test_small_tables_are_copied_in_bundles_exactly_while_a_writer_runs(
    source_dsn: str, target_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small whole tables go through one pair per bundle (here bundles of at most 4 tables):
    every table holds exactly the rows of the exported snapshot while a writer changes them
    all during the copy, and each reports its own row count. They are not loaded frozen
    (a truncate per table costs more than freezing a small table saves)."""
    from pgcdc_dagster.engine.snapshot import copy as copy_module

    monkeypatch.setattr(copy_module, "BUNDLE_TABLES", 4)
    tables = _small_tables(source_dsn, 10)
    copy_schema_pre_data(source_dsn, target_dsn, tables, None)
    stop = threading.Event()
    writes = [0]

    def writer() -> None:
        with psycopg.connect(source_dsn, autocommit=True) as conn:
            while not stop.is_set():
                with conn.transaction():
                    for table in tables:
                        name = table.sql.as_string(None)
                        conn.execute(f"UPDATE {name} SET n = n + 1 WHERE id = 1")
                        conn.execute(
                            f"INSERT INTO {name} SELECT coalesce(max(id), 0) + 1, 'new', 0 "
                            f"FROM {name}"
                        )
                writes[0] += 1

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        while writes[0] < 3:
            time.sleep(0.01)
        with create_slot_with_snapshot(source_dsn, "snap_bundles") as exported:
            with psycopg.connect(source_dsn) as conn:
                conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
                conn.execute(f"SET TRANSACTION SNAPSHOT '{exported.slot.snapshot_name}'")
                expected = {}
                for t in tables:
                    query = psycopg.sql.SQL("SELECT x::text FROM {} x ORDER BY 1").format(t.sql)
                    expected[t] = [r[0] for r in conn.execute(query).fetchall()]
            before = writes[0]
            results = copy_tables(
                None,
                source_dsn,
                target_dsn,
                exported.slot.snapshot_name,
                tables,
                new_tables=tables,
            )
            assert writes[0] > before, "the writer must really have written during the copy"
    finally:
        stop.set()
        thread.join(10)

    by_table = {r.table: r for r in results}
    for table in tables:
        result = by_table[table]
        assert rows_of(target_dsn, table) == expected[table], table
        assert result.rows == len(expected[table])
        assert result.bundled_with in (1, 3)  # bundles of 4, 4 and 2 tables
        assert result.bytes is None and result.seconds is None
        assert not result.frozen and result.copy_formats == ("text",)
    assert sum(1 for r in results if r.bundled_with == 3) == 8
    assert any("\\." in row for row in rows_of(target_dsn, tables[3]))  # the marker, as a value


def test_a_bundle_that_fails_commits_nothing_and_the_error_names_the_table(
    source_dsn: str, target_dsn: str
) -> None:
    """A value the target's column does not take, in the bundle's first table: the bundle's
    one transaction commits nothing of any table, and the tables copied on their own after it
    stop at that table, named."""
    tables = _small_tables(source_dsn, 3)
    copy_schema_pre_data(source_dsn, target_dsn, tables, None)
    run_sql(
        target_dsn, f"ALTER TABLE {tables[0].sql.as_string(None)} ALTER COLUMN v TYPE varchar(3)"
    )

    with pytest.raises(SnapshotError, match=r"Small 0.*value too long"):
        copy_tables(None, source_dsn, target_dsn, None, tables)

    for table in tables:
        assert rows_of(target_dsn, table) == []


def test_a_bundle_whose_source_side_is_killed_mid_stream_commits_no_table(
    source_dsn: str, target_dsn: str
) -> None:
    """SIGKILL of the source ``psql`` of a bundle once its first tables have crossed and its
    last one is streaming: the target side has taken their rows in its one transaction, and
    never gets its COMMIT."""
    import os
    import signal

    from pgcdc_dagster.engine.snapshot.common import CopyTask
    from pgcdc_dagster.engine.snapshot.copy import _copy_bundle_piped

    small = _small_tables(source_dsn, 3)
    last = _piped_task(source_dsn, target_dsn, 600_000)
    copy_schema_pre_data(source_dsn, target_dsn, small, None)
    with psycopg.connect(source_dsn) as conn:
        plan = plan_table_ranges(conn, small, None)
    tasks = [CopyTask(rng, source_dsn, target_dsn, None) for rng in plan] + [last]
    outcome: list[Any] = []
    copier = threading.Thread(target=lambda: outcome.append(_copy_bundle_piped(tasks)))
    copier.start()
    _wait_for_copy_rows(target_dsn)
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        deadline = time.monotonic() + 30
        while (
            conn.execute(  # the small tables have crossed: the big one's COPY is under way
                "SELECT FROM pg_stat_progress_copy WHERE relid = 'piped'::regclass"
            ).fetchone()
            is None
        ):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    sources = [pid for pid, cmd in descendants(os.getpid()).items() if "TO STDOUT" in cmd]
    assert len(sources) == 1
    os.kill(sources[0], signal.SIGKILL)
    copier.join(30)

    assert outcome == [None]
    _copies_end(target_dsn, 10)
    for table in [*small, last.range.table]:
        assert rows_of(target_dsn, table) == []


@pytest.mark.parametrize("plpgsql", ["usable", "absent", "not granted"])
def test_object_lookups_on_the_target_answer_in_one_statement_or_one_by_one(
    target_dsn: str, plpgsql: str
) -> None:
    """Which of the pre-data's objects the target already has: asked in one ``DO`` block, or
    one probe after the other where the target has no PL/pgSQL or the role may not use it;
    the same answers."""
    from pgcdc_dagster.engine.snapshot.schema import _Address, _key, _present_all

    run_sql(
        target_dsn,
        'CREATE SCHEMA "Odd Schema"',
        'CREATE TABLE "Odd Schema"."Mixed Case" (id int PRIMARY KEY)',
        "CREATE FUNCTION public.twice(int) RETURNS int LANGUAGE sql AS 'SELECT $1 * 2'",
    )
    dsn = target_dsn
    if plpgsql == "absent":
        run_sql(target_dsn, "DROP EXTENSION plpgsql")
    elif plpgsql == "not granted":
        run_sql(
            target_dsn,
            "DROP ROLE IF EXISTS pgcdc_no_plpgsql",
            "CREATE ROLE pgcdc_no_plpgsql LOGIN",
            "REVOKE USAGE ON LANGUAGE plpgsql FROM PUBLIC",
            'GRANT USAGE ON SCHEMA "Odd Schema" TO pgcdc_no_plpgsql',
        )
        dsn = f"{target_dsn} user=pgcdc_no_plpgsql"
    addresses = [
        _Address("table", ["Odd Schema", "Mixed Case"], [], "a"),
        _Address("table", ["Odd Schema", "missing"], [], "b"),
        _Address("table", ["No Schema", "x"], [], "c"),
        _Address("table constraint", ["Odd Schema", "Mixed Case", "Mixed Case_pkey"], [], "d"),
        _Address("function", ["public", "twice"], ["integer"], "e"),
        _Address("function", ["public", "twice"], ["text"], "f"),
        _Address("schema", ["Odd Schema"], [], "g"),
        _Address("type", ["public.nope"], [], "h"),
    ]
    with psycopg.connect(dsn, autocommit=True) as conn:
        found = _present_all(conn, addresses)
    assert [found[_key(a)] for a in addresses] == [
        True, False, False, True, True, False, True, False
    ]  # fmt: skip


def test_progress_estimates_a_never_analysed_table_as_the_planner_does(
    source_dsn: str, target_dsn: str
) -> None:
    """A table fresh from a restore has no statistics (``reltuples`` is -1): its row estimate
    comes from its size and the widths of the columns copied (not the generated one), the
    planner's, not 0 (which would show as ``~0 rows``)."""
    from pgcdc_dagster.engine.progress import CopyWatcher, listening

    run_sql(
        source_dsn,
        "CREATE TABLE big (id int, note text, twice int8 GENERATED ALWAYS AS (id * 2) STORED)",
        "INSERT INTO big SELECT i, md5(i::text) FROM generate_series(1, 20000) i",
    )
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        (reltuples,) = conn.execute(  # type: ignore[misc]
            "SELECT reltuples FROM pg_class WHERE oid = 'big'::regclass"
        ).fetchone()
        (planned,) = plan_table_ranges(conn, [BIG], None)
    assert reltuples < 0  # never analysed
    run_sql(target_dsn, "CREATE TABLE big (id int, note text)")
    with listening(lambda progress: None):
        watcher = CopyWatcher(source_dsn, target_dsn, [BIG], time.monotonic())
    assert watcher.estimates[str(BIG)][0] == planned.estimated_rows
    assert 5000 < planned.estimated_rows < 80000


def test_bundles_take_small_whole_tables_within_their_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Which tasks share a bundle: whole tables of at most BUNDLE_MAX_ROWS estimated rows, not
    exported, cut by table count, rows and command-line characters; one alone is no bundle."""
    from dataclasses import replace

    from pgcdc_dagster.engine.snapshot import copy as copy_module
    from pgcdc_dagster.engine.snapshot.common import CopyTask

    def task(name: str, rows: int, columns: int = 1, **blocks: Any) -> CopyTask:
        table = TableName("public", name)
        rng = TableRange(table, table, tuple(f"c{i}" for i in range(columns)), None, None, rows)
        return CopyTask(replace(rng, **blocks), "src", "tgt", None, freeze=True)

    def names(bundles: list[list[CopyTask]]) -> list[list[str]]:
        return [[t.range.table.name for t in b] for b in bundles]

    monkeypatch.setattr(copy_module, "BUNDLE_TABLES", 3)
    monkeypatch.setattr(copy_module, "BUNDLE_ROWS", 1000)
    small = [task(f"s{i}", 100) for i in range(5)]
    big = task("big", copy_module.BUNDLE_MAX_ROWS + 1)
    part = task("part", 10, start_block=0, end_block=8)
    exported = CopyTask(small[0].range, "src", "tgt", None, export_dir="/x")
    bundles, alone = copy_module.bundle_tasks([big, *small, part, exported])
    assert names(bundles) == [["s0", "s1", "s2"], ["s3", "s4"]]
    assert [t.range.table.name for t in alone] == ["big", "part", "s0"]
    assert not any(t.freeze for b in bundles for t in b)

    heavy = [task(f"h{i}", 400) for i in range(4)]
    assert names(copy_module.bundle_tasks(heavy)[0]) == [["h0", "h1"], ["h2", "h3"]]
    monkeypatch.setattr(copy_module, "BUNDLE_COMMAND_CHARS", 1000)
    wide = [task(f"w{i}", 10, columns=100) for i in range(3)]  # about 700 characters each
    assert names(copy_module.bundle_tasks(wide)[0]) == [["w0"], ["w1"], ["w2"]]
    assert copy_module.bundle_tasks([small[0], big]) == ([], [small[0], big])


def test_without_psql_a_bundle_is_copied_table_by_table_in_process(
    source_dsn: str, target_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``psql`` on the machine: the bundle's pair cannot run, and each of its tables is
    copied through libpq in this process instead, every row once."""
    from pgcdc_dagster.engine.snapshot import copy as copy_module

    monkeypatch.setattr(copy_module, "_psql", lambda: None)
    tables = _small_tables(source_dsn, 4)
    copy_schema_pre_data(source_dsn, target_dsn, tables, None)

    results = copy_tables(None, source_dsn, target_dsn, None, tables)

    for table in tables:
        assert rows_of(target_dsn, table) == rows_of(source_dsn, table)
    assert all(r.bundled_with == 0 and r.bytes is not None for r in results)
