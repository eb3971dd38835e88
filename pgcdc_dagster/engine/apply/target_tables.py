"""The target's replicated tables as an apply needs them: columns, types, and the unique keys
that can stand in for a missing replica identity (read in the apply's own transaction)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from ..compaction import TableRelation
from ..errors import ApplyError
from ..identifiers import TableName
from .ddl import ResyncNeeded


@dataclass(frozen=True)
class TargetColumn:
    name: str
    type_oid: int
    typmod: int
    type_sql: str
    """``format_type`` of the column on the target."""
    type_name_sql: str
    """The same without the type modifier (``format_type(type, -1)``: ``"bit"``, not ``bit``,
    which a cast reads as ``bit(1)``): what inline staging casts the column's values to."""
    generated: bool
    has_equality: bool
    identity_always: bool
    """``GENERATED ALWAYS AS IDENTITY``: an UPDATE may not set it (see :func:`_writable`)."""


@dataclass(frozen=True)
class TargetTable:
    table: TableName
    columns: Mapping[str, TargetColumn]
    primary_key: tuple[str, ...]
    unique_keys: tuple[frozenset[str], ...]
    partitioned: bool = False
    """A partitioned table: its rows live in partitions, where a ``ctid`` is unique only
    together with the ``tableoid``, and an ``INSERT`` routed to one cannot return ``xmax``."""


_TARGET_COLUMNS = """
SELECT n.nspname, c.relname, a.attname, a.atttypid::int8, a.atttypmod,
       format_type(a.atttypid, a.atttypmod), format_type(a.atttypid, -1),
       a.attgenerated <> '',
       EXISTS (SELECT FROM pg_operator o WHERE o.oprname = '=' AND o.oprleft = a.atttypid
               AND o.oprright = a.atttypid),
       a.attidentity = 'a',
       COALESCE(array_position(pk.conkey, a.attnum), 0),
       c.relkind = 'p'
FROM unnest(%s::text[], %s::text[]) AS want(nspname, relname)
JOIN pg_namespace n ON n.nspname = want.nspname
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = want.relname
     AND c.relkind IN ('r', 'p')
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_constraint pk ON pk.conrelid = c.oid AND pk.contype = 'p'
ORDER BY n.nspname, c.relname, a.attnum
"""


_TARGET_UNIQUE_KEYS = """
SELECT n.nspname, c.relname,
       array(SELECT a.attname FROM pg_attribute a
             WHERE a.attrelid = c.oid AND a.attnum = ANY(i.indkey))
FROM unnest(%s::text[], %s::text[]) AS want(nspname, relname)
JOIN pg_namespace n ON n.nspname = want.nspname
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = want.relname
JOIN pg_index i ON i.indrelid = c.oid AND i.indisunique AND i.indpred IS NULL
     AND i.indexprs IS NULL AND i.indisvalid AND i.indimmediate
"""


def read_target_tables(
    conn: psycopg.Connection[Any], tables: Sequence[TableName], *, auto_add: bool = False
) -> dict[TableName, TargetTable]:
    """The target's columns, primary key and plain unique keys of ``tables`` (two queries,
    sent together: one round trip for every range applied).

    A table missing on the target is an error: creating tables is the base snapshot's job, or
    an add's (``auto_add``: :class:`~.ddl.ResyncNeeded`, whose copy adds it).
    """
    params = ([t.schema for t in tables], [t.name for t in tables])
    columns: dict[TableName, dict[str, TargetColumn]] = {t: {} for t in tables}
    found: set[TableName] = set()
    pk: dict[TableName, list[tuple[int, str]]] = {t: [] for t in tables}
    partitioned: set[TableName] = set()
    with conn.pipeline():
        described = conn.execute(_TARGET_COLUMNS, params)
        keyed = conn.execute(_TARGET_UNIQUE_KEYS, params)
    for row in described.fetchall():
        schema, rel, name, oid, typmod, type_sql, type_name_sql, generated, eq, always = row[:10]
        pk_pos, is_partitioned = row[10:]
        table = TableName(schema, rel)
        found.add(table)
        if is_partitioned:
            partitioned.add(table)
        columns[table][name] = TargetColumn(
            name, int(oid), int(typmod), type_sql, type_name_sql, generated, eq, always
        )
        if pk_pos:
            pk[table].append((int(pk_pos), name))
    missing = [str(t) for t in tables if t not in found]
    if missing and auto_add:
        raise ResyncNeeded(
            {
                t: "it is not on the target: created on the source (or published) after the "
                "base snapshot, it is added (PGCDC_AUTO_ADD=on)"
                for t in tables
                if t not in found
            }
        )
    if missing:
        raise ApplyError(
            f"table(s) {', '.join(missing)} of the range do not exist on the target: the "
            "publication sends them, but the base snapshot did not copy them. Added to the "
            f"publication later: run pgcdc add-table {' '.join(missing)}, which copies their "
            "rows as of now and has the apply take their changes from there; renamed on the "
            "source: rename them on the target too"
        )
    unique: dict[TableName, list[frozenset[str]]] = {t: [] for t in tables}
    for schema, rel, names in keyed.fetchall():
        unique[TableName(schema, rel)].append(frozenset(names))
    return {
        t: TargetTable(
            t,
            columns[t],
            tuple(name for _, name in sorted(pk[t])),
            tuple(unique[t]),
            t in partitioned,
        )
        for t in tables
    }


def identity_on_target(relation: TableRelation, target: TargetTable) -> TableRelation:
    """Collapse a REPLICA IDENTITY FULL table by the target's primary key when it has one; a
    key-identified table needs a unique index on its identity for ON CONFLICT."""
    if relation.replica_identity == "f":
        if target.primary_key and set(target.primary_key) <= set(relation.names):
            return relation.with_identity(target.primary_key)
        return relation
    if relation.identity and frozenset(relation.identity) not in target.unique_keys:
        cols = ", ".join(relation.identity)
        raise ApplyError(
            f"table {relation.table} on the target has no unique index on ({cols}), the "
            f"source's replica identity: create it (ALTER TABLE {relation.table} ADD PRIMARY KEY "
            f"({cols}), or a UNIQUE index) so rows can be matched"
        )
    return relation
