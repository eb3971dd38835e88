"""Every session the engine opens runs without JIT, and keeps the options it was given."""

from __future__ import annotations

import pytest

from pgcdc_dagster.engine.connect import connect


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
