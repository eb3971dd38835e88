"""What a server's catalog says about the replicated tables: columns and row counts.

Read-only descriptions for people (the column schema and row counts the UI shows) and for the
comparison of :mod:`.compare.verify`; the apply reads the richer description it needs itself
(:func:`~pgcdc_dagster.engine.apply.transaction.read_target_tables`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import errors, sql

from .identifiers import TableName

RECORDS_SCHEMA = "pgcdc_ddl"
"""The target's schema of pgcdc's own records: the source's columns (:mod:`.apply.ddl`), the
base snapshot's copied ranges (:mod:`.snapshot.copied_ranges`), the transaction-id bounds
(:mod:`.apply.xid_bounds`). Each table is made by the first write that needs it."""


def records_table(name: str) -> sql.Identifier:
    """The record table ``name`` in :data:`RECORDS_SCHEMA`."""
    return sql.Identifier(RECORDS_SCHEMA, name)


def ensure_records_schema(conn: psycopg.Connection[Any]) -> None:
    """Create :data:`RECORDS_SCHEMA` if it is not there (in the caller's transaction)."""
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(RECORDS_SCHEMA)))


def records_table_exists(conn: psycopg.Connection[Any], name: str) -> bool:
    """Whether the record table ``name`` exists yet in ``conn``'s database (a reader finds
    none before the first write that needs it)."""
    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (f"{RECORDS_SCHEMA}.{name}",)
    ).fetchone()
    return bool(row and row[0])


ASSUMED_VARLENA_WIDTH = 32
"""Bytes assumed for a variable-width value where no statistics say better."""
TUPLE_OVERHEAD = 24 + 4  # heap tuple header + line pointer


def rows_per_block(
    reltuples: float, relpages: int, block_size: int, typlens: Sequence[int]
) -> float:
    """How many rows a table's block holds: ``reltuples / relpages`` when the table was ever
    analysed or vacuumed, else its column widths (``typlens``, ``-1``/``-2`` for a variable
    width) filling 90 % of each block. An estimate for balancing work and for people's
    progress, never for deciding what is copied; one place for the snapshot's planner and its
    progress display."""
    if reltuples > 0 and relpages > 0:
        return reltuples / relpages
    width = sum(t if t > 0 else ASSUMED_VARLENA_WIDTH for t in typlens)
    return max(1.0, 0.9 * block_size / (width + TUPLE_OVERHEAD))


@dataclass(frozen=True)
class ColumnInfo:
    name: str
    type_sql: str
    """``format_type`` of the column: ``numeric(12,2)``, ``text[]``, ..."""
    not_null: bool
    key: bool
    """Part of the primary key."""


_COLUMNS = """
SELECT n.nspname, c.relname, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
       COALESCE(a.attnum = ANY(pk.conkey), false)
FROM unnest(%s::text[], %s::text[]) AS want(nspname, relname)
JOIN pg_namespace n ON n.nspname = want.nspname
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = want.relname
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_constraint pk ON pk.conrelid = c.oid AND pk.contype = 'p'
ORDER BY n.nspname, c.relname, a.attnum
"""


def table_columns(
    conn: psycopg.Connection[Any], tables: Sequence[TableName]
) -> dict[TableName, list[ColumnInfo]]:
    """The columns of every table that exists, in column order (missing tables are absent)."""
    columns: dict[TableName, list[ColumnInfo]] = {}
    rows = conn.execute(_COLUMNS, ([t.schema for t in tables], [t.name for t in tables])).fetchall()
    for schema, rel, name, type_sql, not_null, key in rows:
        columns.setdefault(TableName(schema, rel), []).append(
            ColumnInfo(name, type_sql, bool(not_null), bool(key))
        )
    return columns


def estimated_rows(
    conn: psycopg.Connection[Any], tables: Sequence[TableName]
) -> dict[TableName, int | None]:
    """The planner's estimate of each table's rows (``pg_class.reltuples``, as the last
    ANALYZE or autovacuum left it; ``None`` for a table never analysed, or gone): one query
    for all of them that reads no table, so it may be asked of a busy source."""
    rows = conn.execute(
        """
        SELECT t.ord, c.reltuples
        FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS t(schema_name, table_name, ord)
        LEFT JOIN pg_namespace n ON n.nspname = t.schema_name
        LEFT JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = t.table_name
        """,
        ([t.schema for t in tables], [t.name for t in tables]),
    ).fetchall()
    estimates: dict[TableName, int | None] = {}
    for ord_, reltuples in rows:
        estimate = None if reltuples is None or reltuples < 0 else int(reltuples)
        estimates[tables[ord_ - 1]] = estimate
    return estimates


def count_rows(
    conn: psycopg.Connection[Any], tables: Sequence[TableName], timeout_s: float
) -> dict[TableName, int | None]:
    """Exact row counts, each bounded by ``timeout_s`` (``None`` for a table that takes longer:
    a count for the UI must never hold up replication).

    ``conn`` is in autocommit: each count is one statement and one round trip under the
    session's ``statement_timeout``, set for the counts and put back after them (a
    transaction with ``SET LOCAL`` around each count takes four round trips a table, which
    adds up with hundreds of small tables; see ``benchmarks/HISTORY.md``, "Many tables")."""
    counts: dict[TableName, int | None] = {}
    (before,) = conn.execute("SELECT current_setting('statement_timeout')").fetchone()  # type: ignore[misc]
    conn.execute(
        "SELECT set_config('statement_timeout', %s, false)", (f"{int(timeout_s * 1000)}ms",)
    )
    try:
        for table in tables:
            try:
                row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.sql)).fetchone()
                counts[table] = int(row[0]) if row else None
            except errors.QueryCanceled:
                counts[table] = None
    finally:
        if not conn.closed:
            conn.execute("SELECT set_config('statement_timeout', %s, false)", (before,))
    return counts
