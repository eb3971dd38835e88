"""Small SQL helpers shared by tests (the clusters themselves come from conftest fixtures)."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from pgcdc_dagster.engine.lsn import Lsn


def run_sql(dsn: str, *statements: str) -> None:
    """Run statements one by one, each in its own transaction (autocommit)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def flush_lsn(server: str | psycopg.Connection[Any]) -> Lsn:
    """The server's flushed WAL position: what logical decoding can read up to (``server``: a
    DSN, or a connection already open to it)."""
    if isinstance(server, psycopg.Connection):
        return Lsn(server.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
    with psycopg.connect(server) as conn:
        return flush_lsn(conn)


def set_for_database(dsn: str, **settings: str) -> None:
    """``ALTER DATABASE ... SET`` each of ``settings`` on ``dsn``'s database: what every later
    session there starts with (a database set up for its applications)."""
    name = conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        for setting, value in settings.items():
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                    sql.Identifier(name), sql.Identifier(setting), sql.Literal(value)
                )
            )
