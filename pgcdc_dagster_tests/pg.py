"""Small SQL helpers shared by tests (the clusters themselves come from conftest fixtures)."""

import psycopg

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
