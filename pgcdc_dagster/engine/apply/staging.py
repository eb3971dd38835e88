"""Staging tables: where a range's net rows wait on the target before the set-based merge.

Three kinds, one layout (column ``c<j>`` typed like the target's column ``j``, ``u<j>`` keep
flags, ``f<j>``/``k<j>`` identity values, ``o<j>``/``m<j>`` old values of a table without
identity), so the merge SQL of :mod:`.transaction` reads any of them:

* **inline** rows (:func:`inline_stage`): a subquery that unnests one text-array literal per
  column, for a table whose net rows are few (:data:`INLINE_MAX_VALUES`) and which the merge
  only reads. A temporary table costs its catalog rows, a COPY and a drop at COMMIT, on the
  server and in this process, whatever its size: with hundreds of tables changed a little
  each, those fixed costs are most of a range's staging (see ``benchmarks/HISTORY.md``,
  ``benchmarks/many_tables.py`` and "Many tables");

* **temporary** tables (``ON COMMIT DROP``) filled by the driver inside the apply transaction,
  for ranges compacted in this process: a table's net rows past that size, those the merge
  updates in place (moved rows whose unsent values come from their origin key), and the
  ordered replay of a table without identity;
* **shared** tables, ordinary ``UNLOGGED`` tables in schema :data:`SCHEMA`, filled by Spark's
  workers before the apply transaction (:mod:`.spark_staging`): they must be visible to every
  worker's session. They hold no progress of their own: the apply transaction reads them and
  drops them, and its COMMIT carries the origin advance, so a crash before it leaves only
  tables that the next apply of the same origin drops first (:func:`drop_shared`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
from psycopg import sql

from ..compaction import TableRelation
from ..errors import ApplyError, server_reason
from ..identifiers import TableName

SCHEMA = "pgcdc_staging"
"""The target schema of shared staging tables (created on first use, never replicated)."""

PARTITION_COLUMN = "p"
"""Shared tables only: the Spark partition that wrote the row, so a retried task can replace
exactly its own rows."""

_COPY_BATCH_ROWS = 65_536

INLINE_MAX_VALUES = 2_000
"""Net rows of a table with at most this many values (rows times staged columns) are staged
inline (:func:`inline_stage`) rather than in a temporary table. Inline wins for a table's few
rows; past a few thousand values the server's parsing of the literals costs more than a COPY.
The staging and merge times per table size are in ``benchmarks/HISTORY.md``,
``benchmarks/many_tables.py`` (inline against temporary tables)."""


def typed_as(rel: TableRelation, position: int, alias: str) -> sql.Composable:
    """A staging column typed like the target column at ``position`` of the relation (read
    from the target table aliased ``t``)."""
    return sql.SQL("t.{} AS {}").format(sql.Identifier(rel.names[position]), sql.Identifier(alias))


def flag(alias: str) -> sql.Composable:
    return sql.SQL("false AS {}").format(sql.Identifier(alias))


def inline_stage(rows: pa.Table, types: Sequence[sql.Composable]) -> sql.Composed:
    """``rows`` as a subquery that the merge reads as it reads their staging table: the same
    column names, each column its values' text as one ``text[]`` literal, unnested side by side
    and cast to ``types`` (the target column's type without its modifier, or ``boolean`` for a
    flag).

    What must hold: the values are what COPY would have read. The cast from text runs the
    type's input function, as COPY does; the modifier (a length, a precision) is left to the
    assignment into the target's column, which enforces it as COPY into a column so typed
    would (an explicit cast to ``varchar(10)`` would truncate instead). NULL stays NULL (an
    unquoted NULL element); any other text, ``'NULL'`` included, is quoted by
    :class:`psycopg.sql.Literal`."""
    names = [sql.Identifier(name) for name in rows.column_names]
    arrays = [
        sql.SQL("{}::text[]").format(sql.Literal(pc.cast(column, pa.string()).to_pylist()))
        for column in rows.columns
    ]
    casts = [
        sql.SQL("v.{n}::{t} AS {n}").format(n=n, t=t) for n, t in zip(names, types, strict=True)
    ]
    return sql.SQL("(SELECT {} FROM unnest({}) AS v({}))").format(
        sql.SQL(", ").join(casts), sql.SQL(", ").join(arrays), sql.SQL(", ").join(names)
    )


def inline_fits(rows: pa.Table) -> bool:
    return rows.num_rows * rows.num_columns <= INLINE_MAX_VALUES


def create_stage(
    conn: psycopg.Connection[Any],
    name: sql.Identifier,
    table: TableName,
    columns: Sequence[sql.Composable],
    *,
    shared: bool = False,
) -> None:
    """A staging table with ``columns`` (read from ``table`` aliased ``t``): temporary and
    dropped with the transaction, or ``shared`` (unlogged, the partition column first)."""
    if shared:
        head = sql.SQL("CREATE UNLOGGED TABLE {} AS SELECT 0::int4 AS {}, ").format(
            name, sql.Identifier(PARTITION_COLUMN)
        )
    else:
        head = sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT ").format(name)
    conn.execute(
        head + sql.SQL("{} FROM {} t WITH NO DATA").format(sql.SQL(", ").join(columns), table.sql)
    )


def shared_prefix(origin_name: str) -> str:
    """Shared tables of one origin start with this (short: identifiers stop at 63 bytes)."""
    return "s_" + hashlib.sha1(origin_name.encode()).hexdigest()[:10] + "_"


def shared_name(origin_name: str, index: int, kind: str) -> sql.Identifier:
    return sql.Identifier(SCHEMA, f"{shared_prefix(origin_name)}{index}_{kind}")


def shared_tables(conn: psycopg.Connection[Any], origin_name: str) -> list[sql.Identifier]:
    """The shared staging tables of ``origin_name`` on the target, left by any earlier apply."""
    rows = conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relkind = 'r' AND starts_with(c.relname, %s) ORDER BY 1",
        (SCHEMA, shared_prefix(origin_name)),
    ).fetchall()
    return [sql.Identifier(SCHEMA, name) for (name,) in rows]


def drop_shared(conn: psycopg.Connection[Any], origin_name: str) -> int:
    """Drop every shared staging table of ``origin_name``; how many there were."""
    tables = shared_tables(conn, origin_name)
    if tables:
        conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(sql.SQL(", ").join(tables)))
    return len(tables)


def copy_into(conn: psycopg.Connection[Any], name: sql.Composable, rows: pa.Table) -> int:
    """Bulk COPY of ``rows`` (columns named as the table's) in CSV; the rows written. Arrow
    quotes every string, so an empty string is ``""`` and NULL is an empty unquoted field,
    exactly the distinction COPY's CSV format makes. Errors are the server's, unchanged."""
    statement = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
        name, sql.SQL(", ").join(sql.Identifier(c) for c in rows.column_names)
    )
    options = pacsv.WriteOptions(include_header=False)
    cursor = conn.cursor()
    with cursor.copy(statement) as copy:
        for batch in rows.to_batches(max_chunksize=_COPY_BATCH_ROWS):
            sink = pa.BufferOutputStream()
            pacsv.write_csv(batch, sink, options)
            copy.write(sink.getvalue())
    return cursor.rowcount


def copy_rows(
    conn: psycopg.Connection[Any], name: sql.Identifier, rows: pa.Table, table: TableName
) -> None:
    """:func:`copy_into` a staging table of ``table``: a failure there can only be a value
    the target's column type does not take, and is named so."""
    try:
        copy_into(conn, name, rows)
    except psycopg.Error as exc:
        if conn.broken:
            raise  # the server went away, not the values: the caller's server_errors says so
        reason = server_reason(
            exc,
            otherwise="the range's values do not fit the target's column types: compare the "
            "table's definition on both sides",
        )
        raise ApplyError(
            f"staging the changes of table {table} failed ({exc.diag.context or 'COPY'}): {reason}"
        ) from exc
