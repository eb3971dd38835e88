"""Catalog reads the UI's figures come from: exact row counts, bounded in time."""

from __future__ import annotations

import psycopg

from pgcdc_dagster.engine.catalog import count_rows
from pgcdc_dagster.engine.connect import connect
from pgcdc_dagster.engine.identifiers import TableName


def test_row_counts_are_exact_or_unknown_past_the_limit_and_leave_the_session_as_it_was(
    target_dsn: str,
) -> None:
    """A table that cannot be counted in time (here: locked by another session) is ``None``;
    the tables after it are still counted, and the session's own ``statement_timeout`` is
    back once the counts are done."""
    tables = [TableName("public", name) for name in ("a", "locked", "Odd Name")]
    with psycopg.connect(target_dsn, autocommit=True) as setup:
        for i, table in enumerate(tables):
            setup.execute(f"CREATE TABLE {table.sql.as_string(setup)} (id int)")
            setup.execute(
                f"INSERT INTO {table.sql.as_string(setup)} SELECT generate_series(1, {i + 2})"
            )
    with psycopg.connect(target_dsn) as blocker:
        blocker.execute("LOCK TABLE locked IN ACCESS EXCLUSIVE MODE")
        with connect(f"{target_dsn} options='-c statement_timeout=4321'", autocommit=True) as conn:
            counts = count_rows(conn, tables, timeout_s=0.2)
            (timeout,) = conn.execute("SELECT current_setting('statement_timeout')").fetchone()
        blocker.rollback()
    assert counts == {tables[0]: 2, tables[1]: None, tables[2]: 4}
    assert timeout == "4321ms"
