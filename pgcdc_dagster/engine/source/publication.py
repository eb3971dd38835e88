"""The publication: which tables' changes pgoutput sends through the slot.

A new publication lists its tables explicitly and publishes partitioned tables through their
root (see :func:`ensure_publication`); an existing one is only ever extended. Its errors are
:class:`PublicationError`, a kind of :class:`~pgcdc_dagster.engine.source.slot.SlotError`: what the
slot streams is the publication's answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import errors, sql

from ..errors import server_message
from ..identifiers import TableName, quote_if_needed
from .preflight import user_tables
from .slot import SlotError
from .standby import writes_on_primary


class PublicationError(SlotError):
    """The publication is missing, publishes too little, or cannot be changed by this role."""


def publication_tables(conn: psycopg.Connection[Any], name: str) -> list[TableName]:
    """The tables whose changes ``name`` publishes, sorted; partitions published through their
    root (``publish_via_partition_root``) appear as the root only."""
    with conn.transaction():
        exists = conn.execute("SELECT 1 FROM pg_publication WHERE pubname = %s", (name,))
        if exists.fetchone() is None:
            raise PublicationError(
                f"publication {name} does not exist in database {conn.info.dbname}: create it "
                "with ensure_publication (run pgcdc snapshot)"
            )
        rows = conn.execute(
            "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = %s", (name,)
        ).fetchall()
    return sorted(TableName(schema, table) for schema, table in rows)


def ensure_publication(
    conn: psycopg.Connection[Any], name: str, tables: Sequence[TableName] | None
) -> list[TableName]:
    """Make publication ``name`` publish at least ``tables`` (``None``: every user table, as
    :func:`pgcdc_dagster.engine.source.preflight.user_tables` resolves them) and return what it
    publishes.

    A new publication lists its tables explicitly (``FOR TABLE``), even for ``None``: the set of
    published tables then equals the set the base snapshot copies, and a table created later is
    not silently half-replicated (its changes streamed, its existing rows never copied).
    ``publish_via_partition_root`` is on, so a partitioned table's changes arrive under the
    root's name whatever partition they land in. An existing publication is only ever extended:
    missing tables are added, nothing is removed.
    """
    with conn.transaction():
        wanted = sorted(set(tables)) if tables is not None else user_tables(conn)
        row = conn.execute(
            "SELECT puballtables, pubviaroot, pubinsert AND pubupdate AND pubdelete "
            "FROM pg_publication WHERE pubname = %s",
            (name,),
        ).fetchone()
        if row is None:
            statement = sql.SQL("CREATE PUBLICATION {}").format(sql.Identifier(name))
            if wanted:
                statement += sql.SQL(" FOR TABLE {}").format(
                    sql.SQL(", ").join(table.sql for table in wanted)
                )
            statement += sql.SQL(" WITH (publish_via_partition_root = true)")
            _run_publication_ddl(conn, name, statement)
        else:
            all_tables, via_root, publishes_all_kinds = row
            if not publishes_all_kinds:
                raise PublicationError(
                    f"publication {name} does not publish every kind of change, so the target "
                    f"would drift: run ALTER PUBLICATION {quote_if_needed(name)} "
                    "SET (publish = 'insert, update, delete, truncate')"
                )
            if not via_root:
                _run_publication_ddl(
                    conn,
                    name,
                    sql.SQL("ALTER PUBLICATION {} SET (publish_via_partition_root = true)").format(
                        sql.Identifier(name)
                    ),
                )
            missing = [] if all_tables else _uncovered(conn, name, wanted)
            if missing:
                _run_publication_ddl(
                    conn,
                    name,
                    sql.SQL("ALTER PUBLICATION {} ADD TABLE {}").format(
                        sql.Identifier(name), sql.SQL(", ").join(table.sql for table in missing)
                    ),
                )
        return publication_tables(conn, name)


def _uncovered(
    conn: psycopg.Connection[Any], name: str, wanted: Sequence[TableName]
) -> list[TableName]:
    """The tables of ``wanted`` whose changes ``name`` does not publish, neither directly nor
    through a published ancestor (partition root)."""
    if not wanted:
        return []
    rows = conn.execute(
        """
        SELECT w.schema, w.name
        FROM unnest(%s::text[], %s::text[]) AS w(schema, name)
        WHERE NOT EXISTS (
            SELECT 1
            FROM pg_class wc
            JOIN pg_namespace wn ON wn.oid = wc.relnamespace
            CROSS JOIN LATERAL (
                SELECT wc.oid UNION SELECT relid FROM pg_partition_ancestors(wc.oid)
            ) AS a(relid)
            JOIN pg_class c ON c.oid = a.relid
            JOIN pg_namespace n ON n.oid = c.relnamespace
            JOIN pg_publication_tables p
              ON p.pubname = %s AND p.schemaname = n.nspname AND p.tablename = c.relname
            WHERE wn.nspname = w.schema AND wc.relname = w.name)
        """,
        ([t.schema for t in wanted], [t.name for t in wanted], name),
    ).fetchall()
    return sorted(TableName(schema, table) for schema, table in rows)


def _run_publication_ddl(conn: psycopg.Connection[Any], name: str, statement: sql.Composed) -> None:
    """Run ``statement`` where it can run: on the source, or on its primary when the source is
    a hot standby (which then replays it before this returns, see :mod:`.standby`)."""
    try:
        with writes_on_primary(conn) as writer, writer.transaction():
            writer.execute(statement)
    except errors.InsufficientPrivilege as exc:
        raise PublicationError(
            f"cannot set up publication {name}: {server_message(exc)}: the source role must own "
            "the published tables and may create in the database; run as the tables' owner, or "
            f"have an administrator run: {statement.as_string(conn)}"
        ) from None
    except errors.UndefinedTable as exc:
        raise PublicationError(
            f"cannot set up publication {name}: {server_message(exc)}: check the table list "
            "(run the source preflight check, which names every missing table)"
        ) from None
