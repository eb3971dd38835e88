"""``pgcdc_dagster.definitions:defs``: the code location loaded by ``workspace.yaml``.

The replicated table list decides which assets exist, so it is resolved once, when the code
location initialises (from ``PGCDC_TABLES``, else the publication, else every user table of the
source), and cached in the definitions' reconstruction metadata: run workers and the daemon
rebuild the same graph without querying the source again. If the source cannot be reached at
load time the location still loads, without per-table assets, and says why in the base
snapshot's description and the sensor's skip reason.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from typing import Any

import psycopg
from dagster import (
    AssetSelection,
    BetaWarning,
    Definitions,
    PreviewWarning,
    define_asset_job,
    definitions,
    in_process_executor,
    map_asset_specs,
)
from dagster._core.definitions.definitions_load_context import (
    DefinitionsLoadContext,
    DefinitionsLoadType,
)

from .defs.assets import (
    BASE_SNAPSHOT_KEY,
    CUTOVER_KEY,
    DECODED_CHANGES_KEY,
    build_assets,
    target_key,
)
from .defs.checks import (
    build_consistency_check,
    build_slot_health,
    replicated_tables,
    slot_survives_failover,
    store_retention,
)
from .defs.jobs import (
    RECOVER_JOB,
    build_add_tables_job,
    build_finish_job,
    build_follow_job,
    build_prune_job,
    build_recover_job,
    build_repair_job,
)
from .defs.metadata import database_of
from .defs.resources import default_resources
from .defs.run_liveness import RANGE_LOCK_TAG
from .defs.sensors import CATCHUP_JOB, build_slot_sensor, sensor_job
from .engine.catalog import ColumnInfo, table_columns
from .engine.connect import ConnectError, connect
from .engine.identifiers import TableName
from .engine.settings import ReplicationSettings

TABLES_METADATA_KEY = "pgcdc/tables"


def resolve_tables(env: Mapping[str, str]) -> tuple[list[TableName], str | None]:
    """The replicated tables and, when they cannot be known, why."""
    settings = ReplicationSettings.from_env(env, require_servers=False)
    if settings.tables:
        return list(settings.tables), None
    if not settings.source_dsn:
        return [], "PGCDC_SOURCE_DSN is not set"
    from .engine.source.preflight import user_tables
    from .engine.source.publication import PublicationError, publication_tables

    try:
        with connect(
            settings.source_dsn, role="source", autocommit=True, connect_timeout=5
        ) as conn:
            try:
                return publication_tables(conn, settings.publication), None
            except PublicationError:
                return list(user_tables(conn)), None
    except ConnectError as exc:
        return [], str(exc)


def resolve_columns(
    env: Mapping[str, str], tables: list[TableName]
) -> dict[TableName, list[ColumnInfo]]:
    """The source's columns of ``tables``, for their column schema in the UI; empty when the
    source cannot be read now (the assets load without it)."""
    settings = ReplicationSettings.from_env(env, require_servers=False)
    if not settings.source_dsn or not tables:
        return {}
    try:
        with connect(
            settings.source_dsn, role="source", autocommit=True, connect_timeout=5
        ) as conn:
            return table_columns(conn, tables)
    except (ConnectError, psycopg.Error):
        return {}


def range_run_max_runtime_s(range_max_bytes: int) -> int:
    """``dagster/max_runtime`` of a per-range run: run monitoring fails a range run that takes
    longer. Ten minutes of fixed allowance, plus the range cap at a pessimistic 256 KiB/s (a
    256 MiB range: 1,624 s), far below what the benchmarks measure (``benchmarks/HISTORY.md``)."""
    return 600 + range_max_bytes // (256 * 1024)


# Dagster re-creates a sensor that targets several jobs when it attaches the resources to them
# (``SensorDefinition.with_updated_jobs``), passing ``owners`` along, which warns that the
# parameter is in beta though this project never sets it: the slot sensor targets its main job
# and ``recover``, so every load of the code location, and every command, would print it.
warnings.filterwarnings(
    "ignore",
    message=r"Parameter `owners` of initializer `SensorDefinition.__init__` is currently in beta",
    category=BetaWarning,
)


def build_definitions(
    tables: list[TableName],
    load_error: str | None,
    settings: ReplicationSettings | None = None,
    columns: Mapping[TableName, list[ColumnInfo]] | None = None,
) -> Definitions:
    settings = settings or ReplicationSettings.from_env(require_servers=False)
    slot_health = build_slot_health(settings.retained_wal_limit)
    databases = (database_of(settings.source_dsn), database_of(settings.target_dsn))
    assets = build_assets(tables, load_error, columns, databases)
    if settings.owners:
        assets = list(
            map_asset_specs(lambda spec: spec.replace_attributes(owners=settings.owners), assets)
        )
    consistency = build_consistency_check(tables) if tables else None
    catchup_selection = AssetSelection.assets(DECODED_CHANGES_KEY) | AssetSelection.assets(
        *[target_key(t) for t in tables]
    )
    if consistency is not None:
        # It compares whole tables and only holds at a quiescent endpos: it runs at cutover and
        # in the verify job, never with each range.
        catchup_selection = catchup_selection - AssetSelection.checks(consistency)
    catchup = define_asset_job(
        CATCHUP_JOB,
        selection=catchup_selection,
        executor_def=in_process_executor,
        tags={
            RANGE_LOCK_TAG: "catchup",
            "dagster/max_runtime": str(range_run_max_runtime_s(settings.range_max_bytes)),
        },
        description="Receive one LSN range into the output store and apply it to the target.",
    )
    jobs = [
        catchup,
        define_asset_job(
            "snapshot",
            selection=AssetSelection.assets(BASE_SNAPSHOT_KEY),
            executor_def=in_process_executor,
            tags={RANGE_LOCK_TAG: "snapshot"},
            description="Take the base snapshot (initial copy) of the source.",
        ),
        *op_jobs(tables),
        define_asset_job(
            "slot_health",
            selection=AssetSelection.checks(
                slot_health, store_retention, replicated_tables, slot_survives_failover
            ),
            description="Check the replication slot's health, the output store's retention, "
            "that the replicated and published tables agree, and that the slot survives a "
            "failover of the source.",
        ),
    ]
    checks: list[Any] = [slot_health, store_retention, replicated_tables, slot_survives_failover]
    if consistency is not None:
        checks.append(consistency)
        jobs.append(
            define_asset_job(
                "verify",
                selection=AssetSelection.checks(consistency),
                description="Compare every target table with the source, both at one consistent "
                "point while the replication goes on, chunk by chunk.",
            )
        )
        jobs.append(
            define_asset_job(
                "cutover_job",
                selection=AssetSelection.assets(CUTOVER_KEY),
                executor_def=in_process_executor,
                tags={RANGE_LOCK_TAG: "cutover"},
                description="Catch up to endpos, sync sequences, verify every table.",
            )
        )
    return Definitions(
        assets=assets,
        asset_checks=checks,
        jobs=jobs,
        sensors=[
            build_slot_sensor(
                settings.sensor_interval,
                settings.dead_run_grace,
                settings.mode,
                [j for j in jobs if j.name in (sensor_job(settings.mode), RECOVER_JOB)],
            )
        ],
        resources=default_resources(settings),
    )


def op_jobs(tables: list[TableName]) -> list[Any]:
    """The location's op jobs: they need the table list, not the asset graph."""
    return [
        build_follow_job(tables),
        build_prune_job(),
        build_add_tables_job(),
        build_add_tables_job(resync=True),
        build_finish_job(),
        build_repair_job(),
        build_recover_job(),
    ]


def op_job_definitions() -> Definitions:
    """The location's op jobs with its resources, and nothing else: for a command that runs
    one of them in its own process. The asset graph's specs (three assets a table) and a query
    for the columns cost every ``pgcdc catchup`` time that grows with the tables (see
    ``benchmarks/HISTORY.md``, "Many tables"); the daemon's runs load the
    whole location as the UI shows it."""
    tables, _ = resolve_tables(os.environ)
    settings = ReplicationSettings.from_env(require_servers=False)
    return Definitions(jobs=op_jobs(tables), resources=default_resources(settings))


@definitions
def defs() -> Definitions:
    context = DefinitionsLoadContext.get()
    cached = None
    if context.load_type == DefinitionsLoadType.RECONSTRUCTION:
        cached = context.reconstruction_metadata.get(TABLES_METADATA_KEY)
    if cached is not None:
        payload = json.loads(cached)
        tables = [TableName(s, n) for s, n in payload["tables"]]
        error = payload["error"]
        columns = {
            TableName(s, n): [ColumnInfo(*c) for c in cols]
            for (s, n), cols in zip(payload["tables"], payload["columns"], strict=True)
            if cols
        }
    else:
        tables, error = resolve_tables(os.environ)
        columns = resolve_columns(os.environ, tables)
    payload = {
        "tables": [[t.schema, t.name] for t in tables],
        "columns": [[dataclasses.astuple(c) for c in columns.get(t, [])] for t in tables],
        "error": error,
    }
    with warnings.catch_warnings():
        # Reconstruction metadata is Dagster's documented way to cache load-time state; it is
        # marked preview, which would warn on every load of the code location.
        warnings.simplefilter("ignore", category=PreviewWarning)
        return build_definitions(tables, error, columns=columns).with_reconstruction_metadata(
            {TABLES_METADATA_KEY: json.dumps(payload)}
        )
