"""A target table's indexes set aside while it is loaded whole, and built again after.

Why: a table loaded into its indexes maintains each of them row by row, through the index's
pages and their WAL; building them after the rows costs a sort, and the load plus the build
takes far less time than a load into the key (``benchmarks/recover.py``; figures in
``benchmarks/HISTORY.md``, "The repair: chunks or the whole table").
The snapshot gets this from the order of pg_dump's sections; a table replaced whole by a repair
(:mod:`..compare.repair`) already has its indexes, so it sets them aside here.

What must hold: the caller's transaction has the table locked ``ACCESS EXCLUSIVE`` and truncated,
and commits or rolls back the whole: the indexes are dropped and built again inside it, so a
crash anywhere leaves the table as it was, indexes and all. No other table's foreign key
references it: ``TRUNCATE`` refused it then, before anything here. :func:`set_aside` returns
``None`` where an index could not be built again the same from its definition (a partitioned
table, whose indexes have one per partition; an index in a tablespace of its own). What
comes back is each index's definition and name (``pg_get_indexdef``, the constraint's
``pg_get_constraintdef`` for a key, a unique or an exclusion constraint), the replica identity
index, the clustered index, the comments and the columns' statistics targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..identifiers import TableName

_SHAPE = """
SELECT c.relkind::text,
       EXISTS (SELECT 1 FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
               WHERE i.indrelid = c.oid AND ic.reltablespace <> 0)
FROM pg_class c WHERE c.oid = %s::regclass
"""

_INDEXES = """
SELECT ic.relname, pg_get_indexdef(i.indexrelid), k.conname, pg_get_constraintdef(k.oid),
       i.indisreplident, i.indisclustered,
       coalesce(obj_description(k.oid, 'pg_constraint'), obj_description(i.indexrelid, 'pg_class')),
       (SELECT coalesce(array_agg(a.attnum::int ORDER BY a.attnum), '{}')
        FROM pg_attribute a WHERE a.attrelid = i.indexrelid AND a.attstattarget > 0),
       (SELECT coalesce(array_agg(a.attstattarget::int ORDER BY a.attnum), '{}')
        FROM pg_attribute a WHERE a.attrelid = i.indexrelid AND a.attstattarget > 0)
FROM pg_index i
JOIN pg_class ic ON ic.oid = i.indexrelid
LEFT JOIN pg_constraint k
  ON k.conindid = i.indexrelid AND k.conrelid = i.indrelid AND k.contype IN ('p', 'u', 'x')
WHERE i.indrelid = %s::regclass
ORDER BY k.contype = 'p' DESC NULLS LAST, i.indexrelid
"""


@dataclass(frozen=True)
class _Index:
    name: str
    definition: str
    constraint: str | None
    constraint_definition: str | None
    replica_identity: bool
    clustered: bool
    comment: str | None
    statistics: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class SetAside:
    """The indexes :func:`set_aside` dropped, to :func:`build_again` in the same transaction."""

    table: TableName
    indexes: tuple[_Index, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(index.name for index in self.indexes)


def set_aside(conn: psycopg.Connection[Any], table: TableName) -> SetAside | None:
    """Drop ``table``'s indexes in ``conn``'s transaction, returning what builds them again; or
    ``None`` (nothing dropped) where they could not be built again the same (see the module
    docstring)."""
    name = table.sql.as_string(conn)
    shape = conn.execute(_SHAPE, (name,)).fetchone()
    if shape is None or shape[0] != "r" or shape[1]:
        return None
    indexes = tuple(
        _Index(r[0], r[1], r[2], r[3], r[4], r[5], r[6], tuple(zip(r[7], r[8], strict=True)))
        for r in conn.execute(_INDEXES, (name,))
    )
    for index in indexes:
        if index.constraint is not None:
            conn.execute(
                sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(
                    table.sql, sql.Identifier(index.constraint)
                )
            )
        else:
            conn.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(table.schema, index.name)))
    return SetAside(table, indexes)


def build_again(conn: psycopg.Connection[Any], aside: SetAside) -> None:
    """Build the indexes :func:`set_aside` dropped, as they were, in ``conn``'s transaction."""
    table = aside.table.sql
    for index in aside.indexes:
        qualified = sql.Identifier(aside.table.schema, index.name)
        if index.constraint is not None and index.constraint_definition is not None:
            conn.execute(
                sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} {}").format(
                    table, sql.Identifier(index.constraint), sql.SQL(index.constraint_definition)
                )
            )
            if index.comment is not None:
                conn.execute(
                    sql.SQL("COMMENT ON CONSTRAINT {} ON {} IS {}").format(
                        sql.Identifier(index.constraint), table, sql.Literal(index.comment)
                    )
                )
        else:
            conn.execute(sql.SQL(index.definition))
            if index.comment is not None:
                conn.execute(
                    sql.SQL("COMMENT ON INDEX {} IS {}").format(
                        qualified, sql.Literal(index.comment)
                    )
                )
        for column, target in index.statistics:
            conn.execute(
                sql.SQL("ALTER INDEX {} ALTER COLUMN {} SET STATISTICS {}").format(
                    qualified, sql.Literal(column), sql.Literal(target)
                )
            )
        if index.replica_identity:
            conn.execute(
                sql.SQL("ALTER TABLE {} REPLICA IDENTITY USING INDEX {}").format(
                    table, sql.Identifier(index.name)
                )
            )
        if index.clustered:
            conn.execute(
                sql.SQL("ALTER TABLE {} CLUSTER ON {}").format(table, sql.Identifier(index.name))
            )
