"""The one line a command prints for a failed run (:func:`pgcdc_dagster.runner.failure_text`'s
choice among the recorded chain of errors)."""

from __future__ import annotations

from dagster._utils.error import SerializableErrorInfo

from pgcdc_dagster.runner import _error_line

REFUSED = (
    'connection to server at "127.0.0.1", port 5433 failed: Connection refused\n'
    "\tIs the server running on that host and accepting TCP/IP connections?\n"
)


def _error(cls_name: str, message: str, cause: SerializableErrorInfo | None = None):
    return SerializableErrorInfo(message, [], cls_name, cause)


def test_dagster_storage_given_up_is_named_with_its_fix_and_no_secret(monkeypatch):
    monkeypatch.setenv(
        "DAGSTER_POSTGRES_URL", "postgresql+psycopg2://dagster:s3cret@127.0.0.1:5433/dagster"
    )
    error = _error(
        "DagsterPostgresException",
        "dagster_postgres.utils.DagsterPostgresException: too many retries for DB connection",
        _error("OperationalError", REFUSED),
    )
    line = _error_line(error)
    assert line is not None
    assert line.startswith(
        "Dagster's storage (postgresql at 127.0.0.1:5433/dagster, DAGSTER_POSTGRES_URL) cannot "
        "be reached: Connection refused. Start it or fix DAGSTER_POSTGRES_URL"
    ), line
    assert "s3cret" not in line


def test_our_error_is_shown_as_it_says_and_a_server_error_with_its_hint():
    ours = _error(
        "ApplyError",
        "pgcdc_dagster.engine.errors.ApplyError: replication slot s does not exist; "
        "run pgcdc snapshot",
    )
    assert _error_line(_error("Failure", "wrapped", ours)) == (
        "replication slot s does not exist; run pgcdc snapshot"
    )
    server = _error("UndefinedTable", 'relation "t" does not exist\nHINT:  create it')
    assert _error_line(server) == 'relation "t" does not exist (HINT:  create it)'
