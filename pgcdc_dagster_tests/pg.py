"""Small SQL helpers shared by tests (the clusters themselves come from conftest fixtures)."""

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from pgcdc_dagster.engine.lsn import Lsn


def run_sql(dsn: str, *statements: str) -> None:
    """Run statements one by one, each in its own transaction (autocommit)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement)


def flush_lsn(dsn: str) -> Lsn:
    """The server's flushed WAL position: what logical decoding can read up to."""
    with psycopg.connect(dsn) as conn:
        return Lsn(conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])


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
