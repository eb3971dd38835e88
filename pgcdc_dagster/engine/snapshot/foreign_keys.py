"""Foreign keys between tables copied at different points: ``NOT VALID`` until the cutover.

The base snapshot copies every table in one exported snapshot, so its post-data creates the
foreign keys between them valid. A table added later (:mod:`.added`) is copied as of a later
point ``X`` than the target's other tables, which stand at the replication origin: its rows may
reference rows the target has yet to receive (a customer created since), and the target's rows
may reference rows of it the source deleted meanwhile. A key created valid then fails, and
would fail the add every time: the apply refuses while an add is unfinished, so the target
would never receive the missing rows. So the add creates those keys, both ways,
``NOT VALID`` (:func:`add_not_valid`): enforced for every new write, the old rows not checked.
The apply is not slowed (it writes with ``session_replication_role = replica``, as for any key).

Once caught up, at the cutover, the target holds what the source did, and :func:`complete`
validates each key the source holds valid and the target does not, and creates those the
target still lacks between replicated tables (a partitioned table's, which PostgreSQL 15 cannot
create ``NOT VALID``). Nothing is recorded: the two catalogs say what is left to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..connect import connect
from ..errors import PgcdcError, server_message
from ..identifiers import TableName
from .common import resolve_oids

_SOURCE_KEYS = """
SELECT ns.nspname, s.relname, k.conname, pg_get_constraintdef(k.oid), s.relkind = 'p',
       k.convalidated, nr.nspname, r.relname
FROM pg_constraint k
JOIN pg_class s ON s.oid = k.conrelid
JOIN pg_namespace ns ON ns.oid = s.relnamespace
JOIN pg_class r ON r.oid = k.confrelid
JOIN pg_namespace nr ON nr.oid = r.relnamespace
WHERE k.contype = 'f' AND k.conparentid = 0
  AND (k.conrelid = ANY(%(oids)s::oid[]) OR k.confrelid = ANY(%(oids)s::oid[]))
ORDER BY 1, 2, 3
"""
"""The foreign keys on or to the given tables (a partition's clone of its parent's key
excluded: creating the parent's creates it), each with its definition (the referenced table
qualified: read with an empty ``search_path``)."""

_TARGET_KEYS = """
SELECT n.nspname, c.relname, k.conname, k.convalidated
FROM pg_constraint k
JOIN pg_class c ON c.oid = k.conrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE k.contype = 'f' AND k.conparentid = 0
"""


class ForeignKeyError(PgcdcError):
    """A foreign key the source holds does not hold on the target at the cutover."""


@dataclass(frozen=True)
class _Key:
    table: TableName
    name: str
    definition: str
    partitioned: bool
    valid: bool
    references: TableName

    def __str__(self) -> str:
        return f"{self.name} on {self.table}"


@dataclass(frozen=True)
class AddedKeys:
    """What :func:`add_not_valid` did."""

    not_valid: tuple[str, ...]
    """Created ``NOT VALID``, validated by the cutover."""
    skipped: tuple[str, ...]
    """Not created, each with why (and when it will be)."""


def _keys(source_dsn: str, tables: Sequence[TableName]) -> list[_Key]:
    with connect(source_dsn, role="source", autocommit=True) as src:
        oids = list(resolve_oids(src, tables).values())
        src.execute("SELECT set_config('search_path', '', false)")
        rows = src.execute(_SOURCE_KEYS, {"oids": oids}).fetchall()
    return [
        _Key(TableName(s, t), name, definition, partitioned, valid, TableName(rs, rt))
        for s, t, name, definition, partitioned, valid, rs, rt in rows
    ]


def _on_target(tgt: psycopg.Connection[Any]) -> dict[tuple[TableName, str], bool]:
    """Every foreign key on the target: whether it is valid."""
    return {
        (TableName(s, t), name): valid for s, t, name, valid in tgt.execute(_TARGET_KEYS).fetchall()
    }


def not_valid_foreign_keys(target_dsn: str) -> list[str]:
    """The target's foreign keys ``NOT VALID`` (an added table's, until the cutover)."""
    with connect(target_dsn, role="target", autocommit=True, connect_timeout=5) as tgt:
        keys = _on_target(tgt)
    return [f"{name} on {table}" for (table, name), valid in keys.items() if not valid]


def _add(tgt: psycopg.Connection[Any], key: _Key, not_valid: bool) -> None:
    definition = key.definition.removesuffix(" NOT VALID")
    tgt.execute(
        sql.SQL("ALTER TABLE {} ADD CONSTRAINT {} {}{}").format(
            key.table.sql,
            sql.Identifier(key.name),
            sql.SQL(definition),  # the source's own text of the definition
            sql.SQL(" NOT VALID" if not_valid or not key.valid else ""),
        )
    )


def add_not_valid(
    source_dsn: str,
    target_dsn: str,
    added: Sequence[TableName],
    replicated: Sequence[TableName],
) -> AddedKeys:
    """Create ``NOT VALID`` on the target the source's foreign keys from or to the ``added``
    tables whose other end is one of them or of ``replicated`` (see the module docstring),
    in one transaction. A key to a table not replicated is skipped, as the base snapshot
    skips it; a partitioned table's is left to the cutover."""
    present = {*added, *replicated}
    created, skipped = [], []
    with connect(target_dsn, role="target") as tgt:
        existing = _on_target(tgt)
        for key in _keys(source_dsn, added):
            if (key.table, key.name) in existing:
                continue
            if key.table not in present or key.references not in present:
                other = key.references if key.table in added else key.table
                skipped.append(f"{key}: {other} is not replicated (add it to keep the key)")
            elif key.partitioned:
                skipped.append(f"{key}: on a partitioned table, created by pgcdc cutover")
            else:
                _add(tgt, key, not_valid=True)
                created.append(str(key))
        tgt.commit()
    return AddedKeys(tuple(created), tuple(skipped))


_INCOMING = """
SELECT n.nspname, c.relname, k.conname
FROM pg_constraint k
JOIN pg_class c ON c.oid = k.conrelid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE k.contype = 'f' AND k.conparentid = 0 AND k.confrelid = ANY(%(oids)s::oid[])
  AND NOT k.conrelid = ANY(%(oids)s::oid[])
"""


def drop_incoming(tgt: psycopg.Connection[Any], tables: Sequence[TableName]) -> None:
    """Drop the target's foreign keys from other tables to ``tables`` (in ``tgt``'s
    transaction): an add killed after :func:`add_not_valid` left them, and the add that
    copies the tables again must empty them first, which they forbid. It creates them again."""
    oids = list(resolve_oids(tgt, tables).values())
    for schema, table, name in tgt.execute(_INCOMING, {"oids": oids}).fetchall():
        tgt.execute(
            sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(
                TableName(schema, table).sql, sql.Identifier(name)
            )
        )


def complete(source_dsn: str, target_dsn: str, tables: Sequence[TableName]) -> list[str]:
    """At the cutover, caught up: validate each foreign key between ``tables`` that the source
    holds valid and the target ``NOT VALID``, and create those the target lacks; what was
    done, one entry a key. Each in a transaction of its own, so a key that does not hold is
    named (a :class:`ForeignKeyError`) without undoing the others."""
    done = []
    wanted = set(tables)
    with connect(target_dsn, role="target", autocommit=True) as tgt:
        existing = _on_target(tgt)
        for key in _keys(source_dsn, tables):
            if key.table not in wanted or key.references not in wanted:
                continue
            valid = existing.get((key.table, key.name))
            try:
                if valid is None:
                    _add(tgt, key, not_valid=False)
                    done.append(f"{key}: created")
                elif key.valid and not valid:
                    tgt.execute(
                        sql.SQL("ALTER TABLE {} VALIDATE CONSTRAINT {}").format(
                            key.table.sql, sql.Identifier(key.name)
                        )
                    )
                    done.append(f"{key}: validated")
            except psycopg.errors.ForeignKeyViolation as exc:
                raise ForeignKeyError(
                    f"foreign key {key} does not hold on the target: {server_message(exc)}: "
                    "the target differs from the source (pgcdc verify names the tables)"
                ) from None
    return done
