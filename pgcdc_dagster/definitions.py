"""``pgcdc_dagster.definitions:defs``: the code location loaded by ``workspace.yaml``.

The replicated table list decides which assets exist, so it is resolved once, when the code
location initialises (from ``PGCDC_TABLES``, else the publication, else every user table of the
source), and cached in the definitions' reconstruction metadata: run workers and the daemon
rebuild the same graph without querying the source again. If the source cannot be reached at
load time the location still loads, without per-table assets, and says why in the base
snapshot's description and the sensor's skip reason.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from dagster import (
    AssetSelection,
    Definitions,
    PreviewWarning,
    define_asset_job,
    definitions,
    in_process_executor,
)
from dagster._core.definitions.definitions_load_context import (
    DefinitionsLoadContext,
    DefinitionsLoadType,
)

from .assets import (
    BASE_SNAPSHOT_KEY,
    CUTOVER_KEY,
    DECODED_CHANGES_KEY,
    build_assets,
    target_key,
)
from .checks import build_consistency_check, slot_health
from .config import ENV_SOURCE_DSN, ENV_TABLES, parse_tables
from .connect import ConnectError, connect
from .identifiers import TableName
from .resources import default_resources
from .sensors import CATCHUP_JOB, CATCHUP_TAG, build_slot_sensor

TABLES_METADATA_KEY = "pgcdc/tables"


def resolve_tables(env: dict[str, str]) -> tuple[list[TableName], str | None]:
    """The replicated tables and, when they cannot be known, why."""
    listed = parse_tables(env.get(ENV_TABLES))
    if listed:
        return list(listed), None
    dsn = env.get(ENV_SOURCE_DSN)
    if not dsn:
        return [], f"{ENV_SOURCE_DSN} is not set"
    from .config import DEFAULT_PUBLICATION, ENV_PUBLICATION
    from .preflight import user_tables
    from .slot import SlotError, publication_tables

    try:
        with connect(dsn, role="source", autocommit=True, connect_timeout=5) as conn:
            try:
                return publication_tables(
                    conn, env.get(ENV_PUBLICATION) or DEFAULT_PUBLICATION
                ), None
            except SlotError:
                return list(user_tables(conn)), None
    except ConnectError as exc:
        return [], str(exc)


def build_definitions(tables: list[TableName], load_error: str | None) -> Definitions:
    assets = build_assets(tables, load_error)
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
        tags={CATCHUP_TAG: "true"},
        description="Receive one LSN range into the output store and apply it to the target.",
    )
    jobs = [
        catchup,
        define_asset_job(
            "snapshot",
            selection=AssetSelection.assets(BASE_SNAPSHOT_KEY),
            executor_def=in_process_executor,
            description="Take the base snapshot (initial copy) of the source.",
        ),
        define_asset_job(
            "slot_health",
            selection=AssetSelection.checks(slot_health),
            description="Check the replication slot's health.",
        ),
    ]
    checks: list[Any] = [slot_health]
    if consistency is not None:
        checks.append(consistency)
        jobs.append(
            define_asset_job(
                "verify",
                selection=AssetSelection.checks(consistency),
                description="Compare every target table with the source (rows, content hash).",
            )
        )
        jobs.append(
            define_asset_job(
                "cutover_job",
                selection=AssetSelection.assets(CUTOVER_KEY),
                executor_def=in_process_executor,
                tags={CATCHUP_TAG: "cutover"},
                description="Catch up to endpos, sync sequences, verify every table.",
            )
        )
    return Definitions(
        assets=assets,
        asset_checks=checks,
        jobs=jobs,
        sensors=[build_slot_sensor()],
        resources=default_resources(dict(os.environ)),
    )


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
    else:
        tables, error = resolve_tables(dict(os.environ))
    payload = {"tables": [[t.schema, t.name] for t in tables], "error": error}
    with warnings.catch_warnings():
        # Reconstruction metadata is Dagster's documented way to cache load-time state; it is
        # marked preview, which would warn on every load of the code location.
        warnings.simplefilter("ignore", category=PreviewWarning)
        return build_definitions(tables, error).with_reconstruction_metadata(
            {TABLES_METADATA_KEY: json.dumps(payload)}
        )
