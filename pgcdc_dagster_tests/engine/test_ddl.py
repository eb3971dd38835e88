"""The source's DDL on a replicated table: followed on the target by itself, or refused with
one line and nothing applied; never a target silently different (:mod:`~pgcdc_dagster.engine.ddl`).

Every case runs as a user meets it: a base snapshot, DDL and changes on the source, then a
catch-up; the target's rows and column definitions are then compared with the source's."""

from __future__ import annotations

import psycopg
import pytest

from pgcdc_dagster.engine import pipeline
from pgcdc_dagster.engine.ddl import ResyncNeeded, SchemaDriftError
from pgcdc_dagster_tests.replication import catch_up, settings_for

KEYED = "CREATE TABLE t (id int PRIMARY KEY, v int, s text)"
UNKEYED = "CREATE TABLE t (id int, v int, s text); ALTER TABLE t REPLICA IDENTITY FULL"
ROWS = "INSERT INTO t SELECT g, g, 'row ' || g FROM generate_series(1, 5) g"


def _run(dsn: str, *statements: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def shape(dsn: str, table: str = "t") -> list[tuple]:
    """The table's columns as a user sees them: name, type, NOT NULL, default."""
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT attname, format_type(atttypid, atttypmod), attnotnull, "
            "pg_get_expr(adbin, adrelid) FROM pg_attribute LEFT JOIN pg_attrdef "
            "ON adrelid = attrelid AND adnum = attnum "
            "WHERE attrelid = %s::regclass AND attnum > 0 AND NOT attisdropped ORDER BY attnum",
            (table,),
        ).fetchall()


def rows(dsn: str, table: str = "t") -> list[tuple]:
    with psycopg.connect(dsn) as conn:
        return sorted(
            conn.execute(f"SELECT row_to_json(x)::text FROM {table} x").fetchall()
        )


def assert_same(source_dsn: str, target_dsn: str, table: str = "t") -> None:
    assert shape(target_dsn, table) == shape(source_dsn, table)
    assert rows(target_dsn, table) == rows(source_dsn, table)


@pytest.fixture(params=["keyed", "unkeyed"])
def replicated(request, source_dsn, target_dsn, tmp_path, spark):
    """A table ``t`` copied by a base snapshot (with or without a primary key); returns its
    settings."""
    _run(source_dsn, KEYED if request.param == "keyed" else UNKEYED, ROWS)
    settings = settings_for(source_dsn, target_dsn, tmp_path, "ddl")
    pipeline.take_snapshot(settings, spark)
    return settings


def test_add_column_with_a_constant_default_gives_existing_rows_the_source_value(
    replicated, source_dsn, target_dsn
):
    _run(
        source_dsn,
        "INSERT INTO t VALUES (6, 6, 'before the column')",
        "ALTER TABLE t ADD COLUMN c text DEFAULT 'dflt'",
        "UPDATE t SET v = v + 100 WHERE id = 1",
        "INSERT INTO t VALUES (7, 7, 'after', 'own')",
    )
    steps = catch_up(replicated)
    assert_same(source_dsn, target_dsn)
    changes = [line for _, applied in steps for line in applied.schema_changes]
    assert changes == ["public.t: column c text added, existing rows 'dflt'"]
