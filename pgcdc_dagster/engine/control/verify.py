"""Verification: is every target table equal to its source table?

Per table, the row count and the md5 of the sorted per-row md5s, computed by each server over
the source's columns, in sessions that print values the same way (UTC, ISO dates, full float
digits, hex bytea), over each row's text in UTF-8 whatever the database's encoding (``md5`` of
text hashes the database's bytes: a LATIN1 target equal to its UTF-8 source hashed differently).
Duplicates count, row order does not. Meaningful at a quiescent endpos that
the target has reached (cutover, ``pgcdc verify``), not while the source is being written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..catalog import table_columns
from ..connect import connect
from ..identifiers import TableName
from ..published_columns import published_shapes, row_filter_sql
from ..settings import ReplicationSettings


@dataclass(frozen=True)
class TableComparison:
    table: TableName
    source_rows: int
    target_rows: int
    source_hash: str
    target_hash: str
    missing_on: str | None = None
    """``target`` when the table does not exist there (a table the publication sends that
    was never copied: added to it after the base snapshot)."""

    @property
    def equal(self) -> bool:
        return (
            self.missing_on is None
            and self.source_rows == self.target_rows
            and self.source_hash == self.target_hash
        )


_COMPARABLE_SESSION = (
    "SET TimeZone = 'UTC'; SET DateStyle = 'ISO, YMD'; SET IntervalStyle = 'postgres'; "
    "SET extra_float_digits = 3; SET bytea_output = 'hex'"
)


def _table_fingerprint(
    conn: psycopg.Connection[Any],
    table: TableName,
    columns: list[str],
    row_filter: str | None = None,
) -> tuple[int, str]:
    """Row count and the md5 of the sorted per-row md5s: duplicates count, order does not.
    ``row_filter``: only the rows the publication's filter passes."""
    row = sql.SQL("ROW({})").format(sql.SQL(", ").join(sql.Identifier(c) for c in columns))
    where = sql.SQL("") if row_filter is None else sql.SQL(" WHERE ") + row_filter_sql(row_filter)
    query = sql.SQL(
        "SELECT count(*), coalesce(md5(string_agg(h, '' ORDER BY h COLLATE \"C\")), '') "
        "FROM (SELECT md5(convert_to({row}::text, 'UTF8')) AS h FROM {table}{where}) rows"
    ).format(row=row, table=table.sql, where=where)
    count, digest = conn.execute(query).fetchone()  # type: ignore[misc]
    return int(count), str(digest)


def compare_tables(
    settings: ReplicationSettings, tables: Sequence[TableName]
) -> list[TableComparison]:
    """Per table: rows and a content hash on both sides, over the source's columns. A table
    the publication narrows (:mod:`..published_columns`) is compared as it is published: its source
    rows that pass the row filter, over the columns the column list sends."""
    results = []
    with (
        connect(settings.source_dsn, role="source", autocommit=True) as src,
        connect(settings.target_dsn, role="target", autocommit=True) as tgt,
    ):
        for conn in (src, tgt):
            conn.execute(_COMPARABLE_SESSION)
        source_columns = table_columns(src, tables)
        on_target = set(table_columns(tgt, tables))
        shapes = published_shapes(src, settings.publication, tables)
        for table in tables:
            shape = shapes.get(table)
            left_out = set(shape.unpublished) if shape else set()
            columns = [c.name for c in source_columns.get(table, []) if c.name not in left_out]
            row_filter = shape.row_filter if shape else None
            s_rows, s_hash = _table_fingerprint(src, table, columns, row_filter)
            if table not in on_target:
                results.append(TableComparison(table, s_rows, 0, s_hash, "", "target"))
                continue
            t_rows, t_hash = _table_fingerprint(tgt, table, columns)
            results.append(TableComparison(table, s_rows, t_rows, s_hash, t_hash))
    return results
