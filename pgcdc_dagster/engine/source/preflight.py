"""Source checks that must pass before a replication slot is created.

A slot created on a source that cannot replicate is worse than none: it retains WAL from the
moment it exists, and the problem (a table without a replica identity, a role that cannot read
a table) shows up only later, mid-copy or as UPDATEs the source itself refuses. So every problem
is found up front, from the catalogs, and reported in one :class:`PreflightError` with one line
per problem, each naming the object, what is wrong and the statement that fixes it.

Which tables are "the tables" is decided here, once, for the whole pipeline:

- ``None`` means every user table, with the meaning PostgreSQL gives ``FOR ALL TABLES``:
  ordinary and partitioned tables outside ``pg_catalog``, ``information_schema`` and the TOAST
  schemas, that are permanent (temporary and UNLOGGED tables never reach the WAL, so they cannot
  be replicated and are left out), and that are not partitions: a partition's rows are copied and
  its changes published through its root.
- An explicit list is taken as given (each table must exist, be a table and be permanent), except
  that a partition whose ancestor is also listed is dropped from the result: the ancestor already
  covers it, and with ``publish_via_partition_root`` its changes arrive under the root's name, so
  keeping it would copy its rows twice. A partition listed without any ancestor stays and is
  replicated as a table of its own.

The result is sorted (by schema, then name) so that every consumer sees the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from ..errors import PgcdcError
from ..identifiers import TableName, quote_if_needed

__all__ = ["PreflightError", "check_source", "user_tables"]


class PreflightError(PgcdcError):
    """The source cannot be replicated as configured. ``problems`` holds one line per problem,
    each with its fix; the message is a summary line followed by those lines."""

    def __init__(self, database: str, problems: Sequence[str]) -> None:
        self.problems = list(problems)
        count = f"{len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}"
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(
            f"source database {database} is not ready for logical replication ({count}):\n{lines}"
        )


def user_tables(conn: psycopg.Connection[Any]) -> list[TableName]:
    """Every user table the pipeline replicates when no table list is given (see the module
    docstring for the rule), sorted."""
    with conn.transaction():
        rows = conn.execute(
            """
            SELECT n.nspname, c.relname
            FROM pg_class c
            JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE c.relkind IN ('r', 'p')
              AND c.relpersistence = 'p'
              AND NOT c.relispartition
              AND n.nspname NOT IN ('pg_catalog', 'information_schema')
              AND n.nspname NOT LIKE 'pg\\_toast%'
            """
        ).fetchall()
    return sorted(TableName(schema, name) for schema, name in rows)


def check_source(
    conn: psycopg.Connection[Any],
    tables: Sequence[TableName] | None,
    *,
    free_slots_needed: int = 1,
) -> list[TableName]:
    """Resolve the table list and check that the source can replicate it through a new slot.

    ``conn`` must log in as the role the pipeline will use (privileges are checked for the
    session user). Returns the resolved, sorted table list; raises :class:`PreflightError`
    listing every problem found: server settings and the role first, then requested names that
    are not replicable tables, then privileges and replica identities table by table.
    """
    with conn.transaction():
        problems = _server_problems(conn, free_slots_needed)
        ids, name_problems = _resolve_tables(conn, tables)
        resolved = sorted(ids)
        problems += name_problems
        problems += _table_problems(conn, resolved, ids)
    if problems:
        raise PreflightError(conn.info.dbname, problems)
    return resolved


_SERVER_FACTS = """
SELECT current_setting('wal_level'),
       current_setting('max_replication_slots')::int,
       (SELECT count(*) FROM pg_replication_slots),
       (SELECT string_agg(
                   slot_name || CASE WHEN active THEN ' (active)' ELSE ' (inactive)' END,
                   ', ' ORDER BY slot_name)
        FROM pg_replication_slots),
       current_setting('max_wal_senders')::int,
       (SELECT count(*) FROM pg_stat_get_wal_senders()),
       session_user,
       r.rolsuper,
       r.rolreplication
FROM pg_roles r
WHERE r.rolname = session_user
"""


def _server_problems(conn: psycopg.Connection[Any], free_slots_needed: int) -> list[str]:
    row = conn.execute(_SERVER_FACTS).fetchone()
    assert row is not None, "session_user is always a role"
    wal_level, max_slots, used_slots, slot_names, max_senders, used_senders = row[:6]
    role, is_superuser, has_replication = row[6:]
    problems: list[str] = []
    if wal_level != "logical":
        problems.append(
            f"wal_level is {wal_level}, not logical, so the WAL lacks what logical decoding "
            "needs: run ALTER SYSTEM SET wal_level = logical on the source and restart it"
        )
    if max_slots - used_slots < free_slots_needed:
        problems.append(
            f"no free replication slot: max_replication_slots = {max_slots} and {used_slots} "
            f"in use ({slot_names or 'none'}), {free_slots_needed} needed: drop an unused slot "
            "(SELECT pg_drop_replication_slot('<name>')) or run ALTER SYSTEM SET "
            f"max_replication_slots = {used_slots + free_slots_needed} and restart the source"
        )
    if max_senders - used_senders < 1:
        problems.append(
            f"no free wal sender: max_wal_senders = {max_senders} and {used_senders} running; "
            "creating the slot with its snapshot needs a replication connection: stop an unused "
            f"replication client or run ALTER SYSTEM SET max_wal_senders = {used_senders + 1} "
            "and restart the source"
        )
    if not (is_superuser or has_replication):
        problems.append(
            f"role {quote_if_needed(role)} has neither the REPLICATION attribute nor superuser, "
            "so it can neither create nor read a replication slot: run ALTER ROLE "
            f"{quote_if_needed(role)} REPLICATION (as a superuser)"
        )
    return problems


_KIND_NAMES = {
    "v": "view",
    "m": "materialized view",
    "f": "foreign table",
    "S": "sequence",
    "i": "index",
    "I": "partitioned index",
    "c": "composite type",
    "t": "TOAST table",
}

_LOOKUP_TABLES = """
SELECT w.schema, w.name, c.oid, c.relkind, c.relpersistence,
       CASE WHEN c.relispartition
            THEN ARRAY(SELECT a.relid FROM pg_partition_ancestors(c.oid) AS a(relid)
                       WHERE a.relid <> c.oid)
            ELSE '{}' END::oid[]
FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS w(schema, name, position)
LEFT JOIN (pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace)
       ON n.nspname = w.schema AND c.relname = w.name
ORDER BY w.position
"""


def _resolve_tables(
    conn: psycopg.Connection[Any], tables: Sequence[TableName] | None
) -> tuple[dict[TableName, int], list[str]]:
    """The resolved tables with their oids, and the problems of the requested names (in name
    order, as the lookup returns them)."""
    requested = user_tables(conn) if tables is None else sorted(set(tables))
    rows = conn.execute(
        _LOOKUP_TABLES, ([t.schema for t in requested], [t.name for t in requested])
    ).fetchall()
    problems: list[str] = []
    found: dict[TableName, tuple[int, list[int]]] = {}
    for schema, name, oid, kind, persistence, ancestors in rows:
        table = TableName(schema, name)
        kind_name = _KIND_NAMES.get(kind, f"relation of kind {kind}")
        if oid is None:
            problems.append(
                f"table {table} does not exist: check the name (unquoted names fold to lower "
                'case; write mixed-case names in double quotes, as in "Schema"."Table")'
            )
        elif kind not in ("r", "p"):
            problems.append(
                f"{table} is a {kind_name}, not a table: logical replication carries only "
                "ordinary and partitioned tables; remove it from the table list"
            )
        elif persistence == "t":
            problems.append(
                f"table {table} is temporary, so its changes never reach the WAL: remove it "
                "from the table list"
            )
        elif persistence == "u":
            problems.append(
                f"table {table} is UNLOGGED, so its changes never reach the WAL: run ALTER TABLE "
                f"{table} SET LOGGED, or remove it from the table list"
            )
        else:
            found[table] = (oid, ancestors)
    listed = {oid for oid, _ in found.values()}
    ids = {
        table: oid
        for table, (oid, ancestors) in found.items()
        if not listed.intersection(ancestors)
    }
    return ids, problems


_TABLE_FACTS = """
SELECT t.relid,
       has_schema_privilege(session_user, c.relnamespace, 'USAGE'),
       has_table_privilege(session_user, t.relid, 'SELECT'),
       EXISTS (SELECT 1 FROM pg_attribute a
               WHERE a.attrelid = t.relid AND a.attnum > 0 AND NOT a.attisdropped),
       ln.nspname, l.relname, l.relreplident,
       EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = l.oid AND i.indisprimary),
       EXISTS (SELECT 1 FROM pg_index i
               WHERE i.indrelid = l.oid AND i.indisprimary
                 AND i.indisvalid AND i.indisunique AND i.indimmediate AND i.indpred IS NULL),
       EXISTS (SELECT 1 FROM pg_index i
               WHERE i.indrelid = l.oid AND i.indisreplident
                 AND i.indisvalid AND i.indisunique AND i.indimmediate AND i.indpred IS NULL),
       l.oid IS NOT NULL AND row_security_active(l.oid)
FROM unnest(%s::oid[]) AS t(relid)
JOIN pg_class c ON c.oid = t.relid
LEFT JOIN LATERAL (
    SELECT p.relid FROM pg_partition_tree(t.relid) AS p WHERE p.isleaf
    UNION
    SELECT t.relid
) AS leaf ON true
LEFT JOIN pg_class l ON l.oid = leaf.relid
LEFT JOIN pg_namespace ln ON ln.oid = l.relnamespace
ORDER BY ln.nspname, l.relname
"""


@dataclass(frozen=True)
class _Leaf:
    """A table whose replica identity is checked: one that holds rows (a plain table or a leaf
    partition), because the source checks it on the table an UPDATE or DELETE actually
    touches; and a partitioned table itself, whose identity says which columns of its
    partitions' old rows are sent (their changes are published as its own, through
    ``publish_via_partition_root``: with leaves in REPLICA IDENTITY FULL under a root without a
    key, a DELETE arrived with no column to find its row by, and was counted missing)."""

    table: TableName
    replica_identity: str
    has_primary_key: bool
    usable_primary_key: bool
    usable_identity_index: bool
    row_security: bool
    """Row-level security applies to the session's role here: its reads see only the rows
    a policy lets through."""


def _table_problems(
    conn: psycopg.Connection[Any], resolved: list[TableName], ids: dict[TableName, int]
) -> list[str]:
    rows = conn.execute(_TABLE_FACTS, ([ids[t] for t in resolved],)).fetchall()
    by_oid = {oid: table for table, oid in ids.items()}
    session = conn.execute("SELECT session_user").fetchone()
    assert session is not None
    role = quote_if_needed(session[0])
    no_usage: set[str] = set()
    no_select: set[TableName] = set()
    no_columns: set[TableName] = set()
    leaves: dict[TableName, list[_Leaf]] = {t: [] for t in resolved}
    for oid, schema_usage, can_select, has_columns, leaf_schema, leaf_name, *identity in rows:
        table = by_oid[oid]
        if not schema_usage:
            no_usage.add(table.schema)
        if not can_select:
            no_select.add(table)
        if not has_columns:
            no_columns.add(table)
        if leaf_name is not None:
            leaves[table].append(_Leaf(TableName(leaf_schema, leaf_name), *identity))
    problems = [
        f"role {role} lacks USAGE on schema {quote_if_needed(schema)}, so it cannot read the "
        f"tables in it: run GRANT USAGE ON SCHEMA {quote_if_needed(schema)} TO {role}"
        for schema in sorted(no_usage)
    ]
    for table in resolved:
        if table in no_select:
            problems.append(
                f"role {role} lacks SELECT on table {table}, so the base snapshot cannot copy "
                f"it: run GRANT SELECT ON {table} TO {role}"
            )
        if table in no_columns:
            problems.append(
                f"table {table} has no columns, so there is nothing of it to copy or apply "
                "but a count of empty rows: leave it out of PGCDC_TABLES, or give it a column"
            )
        for leaf in leaves[table]:
            problem = _identity_problem(leaf, root=table)
            if problem:
                problems.append(problem)
            if leaf.row_security:
                problems.append(_row_security_problem(leaf, root=table, role=role))
    return problems


def _row_security_problem(leaf: _Leaf, *, root: TableName, role: str) -> str:
    """Row-level security would have the base snapshot copy only the rows ``role`` may see,
    while the change stream (which no policy filters) carries them all: a target that differs
    from the source without a word. Every session refuses such reads (``row_security=off``,
    :data:`~..connect.SESSION_SETTINGS`); this names the fix before anything starts."""
    name = _leaf_name(leaf, root)
    return (
        f"row-level security applies to role {role} on table {name}, so the base snapshot "
        f"would copy only the rows its policies let through: run ALTER ROLE {role} BYPASSRLS "
        "(as a superuser), or replicate as the table's owner without FORCE ROW LEVEL SECURITY"
    )


def _leaf_name(leaf: _Leaf, root: TableName) -> str:
    return str(leaf.table) if leaf.table == root else f"{leaf.table} (a partition of {root})"


def _identity_problem(leaf: _Leaf, *, root: TableName) -> str | None:
    """Why UPDATEs and DELETEs of ``leaf`` could not be replicated, or ``None`` if they can.

    Without a replica identity the source logs no old key for them, so the target cannot tell
    which row changed; once the table is published the source even refuses such statements.
    """
    name = _leaf_name(leaf, root)
    fix = f"run ALTER TABLE {leaf.table} REPLICA IDENTITY FULL"
    consequence = "so its UPDATEs and DELETEs cannot be replicated"
    if leaf.replica_identity == "d" and not leaf.usable_primary_key:
        why = (
            "a primary key PostgreSQL cannot use as replica identity (deferrable or invalid)"
            if leaf.has_primary_key
            else "no primary key"
        )
        return f"table {name} has {why} and REPLICA IDENTITY DEFAULT, {consequence}: {fix}"
    if leaf.replica_identity == "n":
        if leaf.usable_primary_key:
            fix = f"run ALTER TABLE {leaf.table} REPLICA IDENTITY DEFAULT (its primary key)"
        return f"table {name} has REPLICA IDENTITY NOTHING, {consequence}: {fix}"
    if leaf.replica_identity == "i" and not leaf.usable_identity_index:
        return (
            f"table {name} has REPLICA IDENTITY USING INDEX but that index is gone or not "
            f"usable (it must be valid, unique, immediate and not partial), {consequence}: "
            f"{fix}, or USING INDEX a valid unique index"
        )
    return None
