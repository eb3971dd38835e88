"""Dagster's storage connections are kept for the process, and a dropped one is replaced."""

from __future__ import annotations

from typing import Any

import psycopg
from dagster import AssetKey, AssetMaterialization, DagsterInstance
from dagster._core.instance.ref import InstanceRef

from pgcdc_dagster.defs.instance import keep_storage_connections

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

        # The server drops them (a restart, an idle timeout): the next use reconnects.
        for pid in kept:
            admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))
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
