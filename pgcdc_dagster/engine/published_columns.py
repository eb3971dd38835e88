"""What a publication sends of a table: PostgreSQL 15's column lists and row filters.

Native logical replication's initial sync copies a narrowed table as its publication sends it;
so does the base snapshot (:mod:`.snapshot`), and a comparison of source and target
(:mod:`.compare.verify`) compares just that. Kept apart from :mod:`.source.publication` (which sets
the publication up) because copy tasks, on Spark executors too, need only this.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from .identifiers import TableName


@dataclass(frozen=True)
class PublishedShape:
    """What a publication sends of a table that it narrows (PostgreSQL 15+): a column list,
    a row filter, or both. The change stream carries only this: an UPDATE whose row leaves the
    filter arrives as a DELETE, one whose row enters it as an INSERT, a column left out never
    arrives. So the snapshot copies only this too, as native replication's initial sync does,
    and a comparison of source and target compares only this."""

    columns: tuple[str, ...]
    """The published columns, in the table's order (generated columns never are)."""
    unpublished: tuple[str, ...]
    """The table's stored columns the column list leaves out: on the target they stay, empty
    (NULL, or their default), and the apply never writes them."""
    row_filter: str | None
    """The filter, as the server prints it (``pg_get_expr``): built-in operators and
    immutable built-in functions over the table's own columns only (the server refuses
    anything else in a publication's WHERE), so it reads the same in any session."""


_SHAPES = """
SELECT n.nspname, c.relname,
       array(SELECT a.attname FROM pg_attribute a
             WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
               AND a.attgenerated = '' ORDER BY a.attnum)::text[],
       p.attnames::text[], p.rowfilter
FROM unnest(%s::text[], %s::text[]) AS w(schema, name)
JOIN pg_namespace n ON n.nspname = w.schema
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = w.name
JOIN pg_publication_tables p
  ON p.pubname = %s AND p.schemaname = n.nspname AND p.tablename = c.relname
"""

FIRST_SHAPING_VERSION = 150000
"""Column lists and row filters came with PostgreSQL 15; before, a publication sends every
column of every row."""


def published_shapes(
    conn: psycopg.Connection[Any], name: str, tables: Sequence[TableName], *, whole: bool = False
) -> dict[TableName, PublishedShape]:
    """The tables of ``tables`` that publication ``name`` narrows, with what it sends of each
    (a table it sends whole is absent, unless ``whole``; one it does not send always is). Read
    it in the snapshot that is copied (the exported one): the slot decodes each change with
    the publication as it stood at that change, and the copy must stand where the stream
    begins."""
    if conn.info.server_version < FIRST_SHAPING_VERSION or not tables:
        return {}
    rows = conn.execute(
        _SHAPES, ([t.schema for t in tables], [t.name for t in tables], name)
    ).fetchall()
    shapes: dict[TableName, PublishedShape] = {}
    for schema, table, stored, published, row_filter in rows:
        sent = set(published or stored)
        unpublished = tuple(c for c in stored if c not in sent)
        if unpublished or row_filter is not None or whole:
            columns = tuple(c for c in stored if c in sent)
            shapes[TableName(schema, table)] = PublishedShape(columns, unpublished, row_filter)
    return shapes


def unpublished_columns(
    shapes: Mapping[TableName, PublishedShape],
) -> dict[TableName, tuple[str, ...]]:
    """Per table ``shapes`` narrow by a column list, the columns it leaves out (what the
    store's chain keeps, and an apply of the table's changes must know)."""
    return {t: shape.unpublished for t, shape in shapes.items() if shape.unpublished}


def row_filters(
    tables: Sequence[TableName], shapes: Mapping[TableName, PublishedShape]
) -> dict[TableName, str | None]:
    """Each of ``tables``' row filter in ``shapes`` (``None``: none)."""
    return {t: shape.row_filter if (shape := shapes.get(t)) else None for t in tables}


def row_filter_sql(row_filter: str) -> sql.Composed:
    """A publication's row filter as a condition to AND into a ``WHERE``: the server's own
    text, which names only the table's columns and built-ins (see
    :attr:`PublishedShape.row_filter`)."""
    return sql.SQL("({})").format(sql.SQL(row_filter))
