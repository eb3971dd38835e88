"""Dagster's storage connections are kept for the process, and a dropped one is replaced."""

from __future__ import annotations

import logging
import time
from typing import Any

import psycopg
import psycopg2
import psycopg2.errors
import pytest
from dagster import AssetKey, AssetMaterialization, DagsterInstance
from dagster._core.instance.ref import InstanceRef

from pgcdc_dagster.defs.instance import PING_IDLE_S, keep_storage_connections

WRITES = 30


def _sessions(admin: psycopg.Connection[Any], database: str) -> int:
    """Sessions that ended on ``database`` (counted when a backend exits)."""
    admin.execute("SELECT pg_stat_clear_snapshot()")
    row = admin.execute(
        "SELECT sessions FROM pg_stat_database WHERE datname = %s", (database,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def _backends(admin: psycopg.Connection[Any], database: str) -> list[int]:
    rows = admin.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
        (database,),
    ).fetchall()
    return [int(pid) for (pid,) in rows]


def test_storage_connections_are_kept_and_a_dropped_one_is_replaced(
    target_cluster, target_dsn, tmp_path
) -> None:
    database = psycopg.conninfo.conninfo_to_dict(target_dsn)["dbname"]
    url = f"postgresql+psycopg2://postgres@127.0.0.1:{target_cluster.port}/{database}"
    ref = InstanceRef.from_dir(
        str(tmp_path), overrides={"storage": {"postgres": {"postgres_url": url}}}
    )
    with (
        DagsterInstance.from_ref(ref) as instance,
        psycopg.connect(target_cluster.dsn(), autocommit=True) as admin,
    ):
        keep_storage_connections(instance)
        keep_storage_connections(instance)  # idempotent
        before = _sessions(admin, str(database))
        for i in range(WRITES):
            instance.report_runless_asset_event(AssetMaterialization(f"kept_{i % 3}"))
            instance.get_runs(limit=1)
        # Unpooled, every write and read above would have started and ended a backend.
        assert _sessions(admin, str(database)) - before <= 3
        kept = _backends(admin, str(database))
        assert 1 <= len(kept) <= 3
        # Their commits do not wait for the disk (the events are a view, not progress).
        assert _synchronous_commit(instance) == "off"

        # The server drops them (a restart, an idle timeout) while they sit in the pool: the
        # next use reconnects.
        for pid in kept:
            admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
        time.sleep(PING_IDLE_S)
        instance.report_runless_asset_event(AssetMaterialization("after_drop"))
        assert instance.get_latest_materialization_event(AssetKey("after_drop")) is not None
        assert not set(_backends(admin, str(database))) & set(kept)
        assert _synchronous_commit(instance) == "off"  # so do the new ones


def _synchronous_commit(instance: DagsterInstance) -> str:
    """The setting on the connections Dagster's event log writes through."""
    storage: Any = instance.event_log_storage
    with storage.index_connection() as conn:
        return str(conn.exec_driver_sql("SHOW synchronous_commit").scalar())


def test_a_storage_a_killed_command_left_half_created_is_completed(
    target_cluster, target_dsn, tmp_path
) -> None:
    """dagster-postgres creates its tables one autocommit statement after the other, and only
    when its first table is missing: tables dropped after a full creation stand for a first
    command killed in the middle of it. The next instance creates them again, keeping the rest,
    and its runs and events can be read and recorded."""
    from dagster import RunsFilter

    from pgcdc_dagster.defs.instance import complete_storage_schema

    database = psycopg.conninfo.conninfo_to_dict(target_dsn)["dbname"]
    url = f"postgresql+psycopg2://postgres@127.0.0.1:{target_cluster.port}/{database}"
    ref = InstanceRef.from_dir(
        str(tmp_path), overrides={"storage": {"postgres": {"postgres_url": url}}}
    )
    with DagsterInstance.from_ref(ref) as instance:
        instance.report_runless_asset_event(AssetMaterialization("before"))
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE run_tags")
        conn.execute("DROP TABLE asset_keys")
    with DagsterInstance.from_ref(ref) as instance:
        complete_storage_schema(instance)
        assert instance.get_runs(filters=RunsFilter(tags={"a": "b"})) == []
        instance.report_runless_asset_event(AssetMaterialization("after"))
        assert instance.get_latest_materialization_event(AssetKey("after")) is not None
        complete_storage_schema(instance)  # nothing missing: nothing done
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        tables = {r for (r,) in conn.execute("SELECT tablename FROM pg_tables")}
    assert {"run_tags", "asset_keys", "runs", "event_logs"} <= tables


def test_a_connection_the_storage_dropped_is_given_back_without_a_traceback(
    target_cluster, target_dsn, caplog
) -> None:
    """A storage that goes away under a connection in use makes SQLAlchemy's pool fail to
    reset it when it is given back, and log that with a traceback: in a process of ours the
    outage is said in one line, so that record is dropped; any other failed reset still
    shows."""
    import sqlalchemy

    from pgcdc_dagster.defs.storage_outage import (
        POOL_LOGGERS,
        QuietLostResets,
        quiet_storage_retries,
    )

    database = psycopg.conninfo.conninfo_to_dict(target_dsn)["dbname"]
    url = f"postgresql+psycopg2://postgres@127.0.0.1:{target_cluster.port}/{database}"
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.QueuePool)

    def give_back_a_dropped_connection() -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="sqlalchemy.pool"):
            connection = engine.raw_connection()
            cursor = connection.cursor()
            cursor.execute("BEGIN; SELECT pg_backend_pid()")
            (pid,) = cursor.fetchone()
            with psycopg.connect(target_dsn, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
            connection.close()  # the pool rolls back: the server is gone
        return [r.getMessage() for r in caplog.records if r.name in POOL_LOGGERS]

    pool, root = logging.getLogger("sqlalchemy.pool.impl.QueuePool"), logging.getLogger()
    kept = list(pool.filters), list(root.filters)
    # Another test of this process may have installed it (any Dagster instance of ours does).
    pool.filters[:] = [f for f in kept[0] if not isinstance(f, QuietLostResets)]
    try:
        assert give_back_a_dropped_connection() == ["Exception during reset or similar"]
        quiet_storage_retries()
        assert give_back_a_dropped_connection() == []
    finally:
        pool.filters[:], root.filters[:] = kept
        engine.dispose()


def test_the_pool_giving_up_on_a_checkout_is_the_storage_away_and_a_bad_statement_is_not(
    target_cluster, target_dsn
) -> None:
    """What a storage write may raise, read by the follow's ride (which retries an outage and
    fails the run on anything else): a server gone, the pool's exhausted reconnection at
    checkout (SQLAlchemy's ``This connection is closed``), the driver's own error on a kept
    connection the server dropped (unwrapped: Dagster writes some events on the DB-API
    connection) are the storage away; a statement's own error, and the same class of error for
    a program's mistake, are not."""
    import sqlalchemy
    from sqlalchemy import exc

    from pgcdc_dagster.defs.storage_outage import storage_unreachable

    database = psycopg.conninfo.conninfo_to_dict(target_dsn)["dbname"]
    engine = sqlalchemy.create_engine(
        f"postgresql+psycopg2://postgres@127.0.0.1:{target_cluster.port}/{database}"
    )
    gone = sqlalchemy.create_engine("postgresql+psycopg2://postgres@127.0.0.1:1/postgres")
    try:
        with engine.connect() as conn:
            try:
                conn.exec_driver_sql("SELECT * FROM no_such_table")
            except exc.ProgrammingError as bad_statement:
                assert not storage_unreachable(bad_statement)
            else:
                raise AssertionError("the statement did not fail")
        dropped = engine.raw_connection()
        try:
            cursor = dropped.cursor()
            cursor.execute("SELECT pg_backend_pid()")
            (pid,) = cursor.fetchone()
            with psycopg.connect(target_dsn, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
            with pytest.raises(psycopg2.OperationalError) as raw:
                cursor.execute("SELECT 1")
            assert storage_unreachable(raw.value)
            with pytest.raises(psycopg2.errors.UndefinedTable) as raw_bad:
                engine.raw_connection().cursor().execute("SELECT * FROM no_such_table")
            assert not storage_unreachable(raw_bad.value)
        finally:
            dropped.invalidate()
        try:
            gone.connect()
        except exc.OperationalError as refused:
            assert storage_unreachable(refused)
        else:
            raise AssertionError("a connection to port 1 was accepted")
    finally:
        engine.dispose()
        gone.dispose()
    assert storage_unreachable(exc.InvalidRequestError("This connection is closed"))
    assert not storage_unreachable(exc.ResourceClosedError("This result object is closed."))
    assert not storage_unreachable(exc.InvalidRequestError("A value is required"))
