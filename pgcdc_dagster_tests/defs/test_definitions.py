"""The Dagster skin: definitions load, the asset graph's lineage, a missing source at load."""

from __future__ import annotations

from dagster import AssetKey, Definitions

from pgcdc_dagster.definitions import build_definitions, resolve_tables
from pgcdc_dagster.engine.catalog import ColumnInfo
from pgcdc_dagster.engine.identifiers import TableName

TABLES = [TableName("public", "orders"), TableName("Odd Schema", "select")]


def graph_snapshot(defs: Definitions) -> dict[str, list[str]]:
    graph = defs.resolve_asset_graph()
    return {
        key.to_user_string(): sorted(k.to_user_string() for k in graph.get(key).parent_keys)
        for key in sorted(graph.get_all_asset_keys(), key=lambda k: k.to_user_string())
    }


def test_definitions_load_and_lineage_is_source_snapshot_changes_target():
    defs = build_definitions(TABLES, None)
    Definitions.validate_loadable(defs)
    odd = "Odd_Schema_184896e9/select"
    assert graph_snapshot(defs) == {
        "base_snapshot": [f"source/{odd}", "source/public/orders"],
        "cutover": [f"target/{odd}", "target/public/orders"],
        "decoded_changes": ["base_snapshot", "replication_slot"],
        "replication_slot": [f"source/{odd}", "source/public/orders"],
        f"source/{odd}": [],
        "source/public/orders": [],
        f"target/{odd}": ["decoded_changes"],
        "target/public/orders": ["decoded_changes"],
    }
    graph = defs.resolve_asset_graph()
    partitioned = {
        k.to_user_string()
        for k in graph.get_all_asset_keys()
        if graph.get(k).partitions_def is not None
    }
    assert partitioned == {"decoded_changes", f"target/{odd}", "target/public/orders"}
    assert {j.name for j in defs.resolve_all_job_defs()} >= {
        "catchup",
        "snapshot",
        "cutover_job",
        "verify",
        "slot_health",
        "prune",
    }
    assert defs.resolve_sensor_def("slot_progress_sensor") is not None


def test_target_tables_cannot_be_applied_apart():
    defs = build_definitions(TABLES, None)
    node = defs.resolve_asset_graph().get(AssetKey(["target", "public", "orders"]))
    assert not node.assets_def.can_subset


def test_unreachable_source_at_load_keeps_the_location_loadable_and_says_why():
    dsn = "host=127.0.0.1 port=1 user=nobody password=s3cret-at-load dbname=x connect_timeout=1"
    tables, error = resolve_tables({"PGCDC_SOURCE_DSN": dsn})
    assert tables == [] and error is not None
    assert "s3cret-at-load" not in error
    assert "cannot connect to the source PostgreSQL" in error
    defs = build_definitions(tables, error)
    Definitions.validate_loadable(defs)
    snapshot = defs.resolve_asset_graph().get(AssetKey("base_snapshot"))
    assert "Table list unavailable" in (snapshot.description or "")


def test_table_list_from_environment_needs_no_source():
    tables, error = resolve_tables({"PGCDC_TABLES": 'public.orders, "Odd Schema"."select"'})
    assert error is None
    assert tables == sorted(TABLES)


def test_source_and_target_tables_carry_their_name_and_column_schema():
    columns = {
        TABLES[0]: [
            ColumnInfo("id", "integer", True, True),
            ColumnInfo("note", "text", False, False),
        ]
    }
    defs = build_definitions(TABLES, None, columns=columns)
    graph = defs.resolve_asset_graph()
    for key in (AssetKey(["source", "public", "orders"]), AssetKey(["target", "public", "orders"])):
        meta = graph.get(key).metadata
        assert meta["dagster/table_name"] == "public.orders"
        schema = meta["dagster/column_schema"].schema
        assert [(c.name, c.type, c.constraints.nullable) for c in schema.columns] == [
            ("id", "integer", False),
            ("note", "text", True),
        ]
    odd = graph.get(AssetKey(["source", "Odd_Schema_184896e9", "select"])).metadata
    assert odd["dagster/table_name"] == '"Odd Schema"."select"'
    assert (
        "dagster/column_schema" not in odd
    )  # columns not known: no schema rather than a wrong one


def test_source_and_target_tables_are_named_with_their_own_database():
    """Dagster links assets of one ``dagster/table_name`` as the same storage: a table's source
    and target copies are named with their server and database (never a user or password)."""
    from pgcdc_dagster.engine.settings import ReplicationSettings

    settings = ReplicationSettings(
        source_dsn="host=10.0.0.1 port=5432 dbname=app user=u password=secret-pw",
        target_dsn="postgresql://u:secret-pw@10.0.0.2:6432/app",
    )
    graph = build_definitions(TABLES, None, settings=settings).resolve_asset_graph()
    source = graph.get(AssetKey(["source", "public", "orders"])).metadata
    target = graph.get(AssetKey(["target", "public", "orders"])).metadata
    assert source["dagster/table_name"] == "10.0.0.1:5432/app.public.orders"
    assert target["dagster/table_name"] == "10.0.0.2:6432/app.public.orders"
    assert "secret-pw" not in str(source) + str(target)


def test_every_setting_reaches_the_runs_through_the_resources():
    """A run rebuilds its settings from the resources: a setting they do not carry would be
    silently back at its default inside every Dagster run."""
    from pgcdc_dagster.defs.resources import default_resources
    from pgcdc_dagster.engine.settings import ReplicationSettings

    changed = ReplicationSettings(
        source_dsn="host=a",
        target_dsn="host=b",
        slot="s1",
        publication="p1",
        tables="public.t1,public.t2",
        store="/tmp/st",
        range_max_bytes=12345,
        snapshot_parquet=True,
        snapshot_driver_rows=7,
        follow_cut_ms=50,
        follow_range_bytes=4096,
        follow_idle_s=2.5,
        spark_min_changes=11,
        sensor_interval=9,
        dead_run_grace=3.0,
        retained_wal_limit=99,
        mode="follow",
        store_retention=123.0,
        follow_table_events="changed",
        follow_retry=42.0,
    )
    resources = default_resources(changed)
    rebuilt = resources["pgcdc"].settings(resources["spark"])
    # Read when the definitions are built (sensor, checks), not inside runs:
    definitions_time = {"sensor_interval", "dead_run_grace", "retained_wal_limit", "mode"}
    # Secrets: the resources hold EnvVar references, resolved only inside the run.
    secrets = {"source_dsn", "target_dsn"}
    for name in ReplicationSettings.model_fields:
        if name not in definitions_time | secrets:
            assert getattr(rebuilt, name) == getattr(changed, name), name


def test_owners_are_on_every_asset_and_a_wrong_one_is_named():
    """``PGCDC_OWNERS`` puts the same owners on every asset, as Dagster shows them; an owner
    that is neither an email address nor ``team:name`` is refused in one line naming it."""
    import pytest

    from pgcdc_dagster.engine.settings import ReplicationSettings, SettingsError

    settings = ReplicationSettings.from_env(
        {"PGCDC_OWNERS": "team:data-platform, alice@example.com"}, require_servers=False
    )
    graph = build_definitions(TABLES, None, settings=settings).resolve_asset_graph()
    owners = {key.to_user_string(): graph.get(key).owners for key in graph.get_all_asset_keys()}
    assert len(owners) == 8
    assert set(map(tuple, owners.values())) == {("team:data-platform", "alice@example.com")}
    with pytest.raises(SettingsError, match=r"PGCDC_OWNERS='alice': .* nor team:name"):
        ReplicationSettings.from_env({"PGCDC_OWNERS": "alice"}, require_servers=False)


LOAD_TIME_SETTINGS = {"owners", "sensor_interval", "dead_run_grace", "mode"}
"""Settings the definitions read once, as they load (the sensor's, the assets' owners): every
other one must reach a run, whose engine reads its settings from the ``pgcdc`` resource."""


def test_every_setting_a_run_reads_reaches_it_through_the_resource(monkeypatch):
    from dagster import build_resources

    from pgcdc_dagster.defs.resources import default_resources
    from pgcdc_dagster.engine.settings import ReplicationSettings

    monkeypatch.setenv("PGCDC_SOURCE_DSN", "host=source dbname=s")
    monkeypatch.setenv("PGCDC_TARGET_DSN", "host=target dbname=t")
    changed = {
        "PGCDC_DDL": "strict",
        "PGCDC_AUTO_ADD": "on",
        "PGCDC_AUTO_RECOVER": "on",
        "PGCDC_DROPPED_COLUMNS": "keep",
        "PGCDC_DECODING_WORK_MEM": "65536",
        "PGCDC_RETAINED_WAL_LIMIT": "123456789",
        "PGCDC_MEMORY_LIMIT": "987654321",
        "PGCDC_FOLLOW_READ": "peek",
        "PGCDC_SLOT": "other_slot",
    }
    for name, value in changed.items():
        monkeypatch.setenv(name, value)
    settings = ReplicationSettings.from_env()
    with build_resources({"pgcdc": default_resources(settings)["pgcdc"]}) as resources:
        in_run = resources.pgcdc.settings()
    fields = set(ReplicationSettings.model_fields) - LOAD_TIME_SETTINGS
    assert {f: getattr(in_run, f) for f in fields} == {f: getattr(settings, f) for f in fields}
    assert in_run.ddl == "strict" and in_run.auto_recover and in_run.decoding_work_mem == 65536
