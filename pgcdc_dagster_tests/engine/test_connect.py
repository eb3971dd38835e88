"""Every session the engine opens runs without JIT, with its own timeouts, value formats and
encoding over the database's, and keeps the options it was given."""

from __future__ import annotations

import time

import psycopg
import pytest

from pgcdc_dagster.engine.connect import connect, unavailable
from pgcdc_dagster_tests.support.pg import set_for_database


def _settings(dsn: str) -> tuple[str, str]:
    with connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('jit'), current_setting('statement_timeout')"
        ).fetchone()
    assert row is not None
    return str(row[0]), str(row[1])


def test_sessions_run_without_jit_and_keep_the_options_given(
    source_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PGOPTIONS", raising=False)
    assert _settings(source_dsn) == ("off", "0")
    # The DSN's own options, then PGOPTIONS (which libpq reads only when none is given).
    assert _settings(f"{source_dsn} options='-c statement_timeout=1234'") == ("off", "1234ms")
    monkeypatch.setenv("PGOPTIONS", "-c statement_timeout=4321")
    assert _settings(source_dsn) == ("off", "4321ms")
    assert _settings(f"{source_dsn} options='-c statement_timeout=1234'") == ("off", "1234ms")


def test_sessions_set_their_timeouts_and_value_formats_over_the_database_s(
    source_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PGOPTIONS", raising=False)
    set_for_database(
        source_dsn,
        statement_timeout="50",
        idle_in_transaction_session_timeout="50",
        DateStyle="SQL, DMY",
        extra_float_digits="0",
        client_encoding="LATIN1",
        idle_session_timeout="50",
    )
    show = (
        "SELECT current_setting('statement_timeout'), "
        "current_setting('idle_in_transaction_session_timeout'), current_setting('DateStyle'), "
        "current_setting('extra_float_digits'), current_setting('client_encoding'), "
        "current_setting('idle_session_timeout')"
    )
    for replication, autocommit in ((False, False), (False, True), (True, True)):
        with connect(source_dsn, replication=replication, autocommit=autocommit) as conn:
            time.sleep(0.2)  # idle past the database's idle_session_timeout
            row = conn.execute(show).fetchone()
        assert row == ("0", "0", "ISO, MDY", "3", "UTF8", "0"), replication
    # A timeout the connection string sets itself still holds; the value formats do not move.
    given = "-c statement_timeout=1234 -c DateStyle=SQL -c idle_session_timeout=4321"
    with connect(f"{source_dsn} options='{given}'") as conn:
        row = conn.execute(show).fetchone()
    assert row == ("1234ms", "0", "ISO, MDY", "3", "UTF8", "4321ms")


def test_a_session_ended_by_the_server_is_an_outage_and_a_timeout_or_a_bad_query_is_not(
    source_dsn: str,
) -> None:
    """A follow rides through a server that went away wherever the query was (no step named
    the server); a statement's timeout or its own error still ends it."""
    seen: list[BaseException] = []
    with (
        connect(source_dsn, autocommit=True) as victim,
        connect(source_dsn, autocommit=True) as admin,
    ):
        admin.execute("SELECT pg_terminate_backend(%s)", (victim.info.backend_pid,))
        with pytest.raises(psycopg.OperationalError) as ended:
            victim.execute("SELECT 1")
        seen.append(ended.value)
        with pytest.raises(psycopg.OperationalError) as gone:
            victim.execute("SELECT 1")  # the broken connection, used again
        seen.append(gone.value)
    assert [unavailable(e) for e in seen] == [True, True], [repr(e) for e in seen]
    with connect(source_dsn, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.QueryCanceled) as timed_out:
            conn.execute("SET statement_timeout = 50; SELECT pg_sleep(1)")
        assert not unavailable(timed_out.value)
        with pytest.raises(psycopg.errors.UndefinedTable) as wrong:
            conn.execute("SELECT * FROM no_such_table_here")
        assert not unavailable(wrong.value)
