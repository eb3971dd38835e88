"""Assets: source tables → base snapshot → decoded changes (per LSN range) → target tables.

Each body is a call into :mod:`pgcdc_dagster.pipeline` plus metadata; the engine owns every
decision about LSNs. Engine errors that a user must act on become ``Failure``s whose text is
the engine's message (it names the problem and the fix, and never a connection string).
"""

import re
import zlib
from collections.abc import Iterator, Sequence
from typing import Any

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetKey,
    AssetMaterialization,
    AssetSpec,
    Config,
    Failure,
    MaterializeResult,
    asset,
    multi_asset,
)

from . import pipeline
from .asset_metadata import apply_metadata, comparison_metadata, receive_metadata, snapshot_metadata
from .connect import ConnectError
from .identifiers import TableName
from .lsn import LsnRange
from .partitions import LSN_RANGES, lsn_ranges, registered_ranges
from .receive import ReceiveError, ReceiveResult
from .resources import PgcdcResource, SparkResource
from .slot import SlotError
from .store import StoreError

REPLICATION_GROUP = "replication"
SLOT_KEY = AssetKey("replication_slot")
BASE_SNAPSHOT_KEY = AssetKey("base_snapshot")
DECODED_CHANGES_KEY = AssetKey("decoded_changes")
CUTOVER_KEY = AssetKey("cutover")

_KEY_PART = re.compile(r"[A-Za-z0-9_]+")
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_]")

ENGINE_ERRORS: tuple[type[Exception], ...] = (
    pipeline.RangeOrderError,
    pipeline.RangeBusyError,
    ReceiveError,
    SlotError,
    StoreError,
    ConnectError,
)


def key_part(name: str) -> str:
    """A SQL name as an asset-key part. Dagster allows ``[A-Za-z0-9_]`` only: other names are
    folded to that set, with a short hash of the real name so two names never collide (the
    real name is in each asset's description)."""
    if name and _KEY_PART.fullmatch(name):
        return name
    return f"{_KEY_UNSAFE.sub('_', name)}_{zlib.crc32(name.encode()):08x}"


def source_key(table: TableName) -> AssetKey:
    return AssetKey(["source", key_part(table.schema), key_part(table.name)])


def target_key(table: TableName) -> AssetKey:
    return AssetKey(["target", key_part(table.schema), key_part(table.name)])


def as_failure(exc: Exception) -> Failure:
    return Failure(description=str(exc), metadata={"error": type(exc).__name__})


class SnapshotConfig(Config):
    resnapshot: bool = False
    """Required when target tables already hold rows: truncates them and re-creates the slot."""


class CutoverConfig(Config):
    endpos: str = "current"
    """``current`` (the source's flushed WAL position now) or an LSN ``X/Y``."""


def build_assets(tables: Sequence[TableName], load_error: str | None) -> list[Any]:
    """Every asset of the project for the resolved table list."""
    source_specs = [
        AssetSpec(
            source_key(t),
            group_name="source",
            kinds={"postgres"},
            description=f"Source table {t} (replicated through the publication).",
        )
        for t in tables
    ]
    slot_spec = AssetSpec(
        SLOT_KEY,
        group_name=REPLICATION_GROUP,
        deps=[s.key for s in source_specs],
        kinds={"postgres"},
        description="The source's logical replication slot (pgoutput). The slot sensor reports "
        "its lag and retained WAL as observations.",
    )
    snapshot_description = (
        "A consistent copy of the source tables taken at the slot's exported snapshot, then "
        "the target's replication origin set to the slot's consistent point."
    )
    if load_error:
        snapshot_description += f"\n\nTable list unavailable when definitions loaded: {load_error}"

    @asset(
        key=BASE_SNAPSHOT_KEY,
        group_name=REPLICATION_GROUP,
        deps=[s.key for s in source_specs],
        kinds={"postgres", "spark"},
        description=snapshot_description,
    )
    def base_snapshot(
        context: AssetExecutionContext,
        config: SnapshotConfig,
        pgcdc: PgcdcResource,
        spark: SparkResource,
    ) -> MaterializeResult:
        settings = pgcdc.settings(spark)
        try:
            result = pipeline.take_snapshot(
                settings, spark.spark_session, resnapshot=config.resnapshot
            )
        except Exception as exc:
            if _is_engine_error(exc):
                raise as_failure(exc) from None
            raise
        context.log.info(
            f"base snapshot of {len(result.tables)} tables ({result.rows} rows) at consistent "
            f"point {result.consistent_point}"
        )
        return MaterializeResult(metadata=snapshot_metadata(result))

    @asset(
        key=DECODED_CHANGES_KEY,
        group_name=REPLICATION_GROUP,
        partitions_def=lsn_ranges,
        deps=[BASE_SNAPSHOT_KEY, SLOT_KEY],
        kinds={"parquet"},
        description="The decoded change stream: whole transactions whose COMMIT ends in the "
        "partition's LSN range, as Parquet in the output store.",
    )
    def decoded_changes(
        context: AssetExecutionContext,
        pgcdc: PgcdcResource,
    ) -> MaterializeResult:
        settings = pgcdc.settings()
        rng = LsnRange.from_key(context.partition_key)
        try:
            with pipeline.range_lock(settings):
                result = pipeline.receive_range(settings, rng)
            lag = _lag(settings)
        except ENGINE_ERRORS as exc:
            raise as_failure(exc) from None
        if result.already_stored:
            context.log.info(f"range {rng.key} was already stored: nothing received again")
        return MaterializeResult(metadata=receive_metadata(result, lag))

    assets: list[Any] = [*source_specs, slot_spec, base_snapshot, decoded_changes]
    if tables:
        assets += [_target_tables(tables), _cutover(tables)]
    return assets


def _target_tables(tables: Sequence[TableName]) -> Any:
    specs = [
        AssetSpec(
            target_key(t),
            group_name="target",
            deps=[DECODED_CHANGES_KEY],
            kinds={"postgres"},
            description=f"Target table {t}: the source's rows, applied range by range.",
        )
        for t in tables
    ]

    @multi_asset(
        name="apply_to_target",
        specs=specs,
        partitions_def=lsn_ranges,
        can_subset=False,
        check_specs=[
            AssetCheckSpec(
                "no_gap",
                asset=specs[0].key,
                description="The target origin's progress equals the last applied range's "
                "transform_lsn: no range was skipped or half applied.",
            )
        ],
    )
    def apply_to_target(
        context: AssetExecutionContext,
        pgcdc: PgcdcResource,
        spark: SparkResource,
    ) -> Iterator[Any]:
        """All tables of a range in one target transaction: they cannot be applied apart."""
        settings = pgcdc.settings(spark)
        rng = LsnRange.from_key(context.partition_key)
        try:
            with pipeline.range_lock(settings):
                pipeline.check_range_order(pipeline.store_of(settings), rng)
                received = ReceiveResult.from_manifest(
                    pipeline.stored_range(settings, rng).manifest
                )
                applied = pipeline.apply_stored_range(
                    settings, rng, spark=lambda: spark.spark_session
                )
            lag = _lag(settings)
        except Exception as exc:
            if _is_engine_error(exc):
                raise as_failure(exc) from None
            raise
        context.log.info(f"range {rng.key}: {applied.status}, replay_lsn {applied.replay_lsn}")
        for table in tables:
            yield MaterializeResult(
                asset_key=target_key(table),
                metadata=apply_metadata(table, received, applied, lag),
            )
        yield _no_gap_check(settings, specs[0].key)

    return apply_to_target


def _no_gap_check(settings: pipeline.ReplicationSettings, key: AssetKey) -> AssetCheckResult:
    expected = pipeline.expected_origin_progress(settings)
    actual = pipeline.origin_progress(settings)
    passed = expected is None or actual == expected
    return AssetCheckResult(
        asset_key=key,
        check_name="no_gap",
        passed=passed,
        severity=AssetCheckSeverity.ERROR,
        metadata={
            "origin_progress": str(actual),
            "last_applied_transform_lsn": str(expected),
        },
        description=None
        if passed
        else "the target's replication origin does not match the last stored range: a range "
        "was skipped or applied elsewhere; run 'pgcdc status' and re-run the missing range",
    )


def _cutover(tables: Sequence[TableName]) -> Any:
    @asset(
        key=CUTOVER_KEY,
        group_name=REPLICATION_GROUP,
        deps=[target_key(t) for t in tables],
        kinds={"postgres"},
        description="Migration cutover: catch up to an endpos (default: the source's flushed "
        "WAL now), copy sequence values, verify every table against the source.",
        check_specs=[
            AssetCheckSpec(
                "data_consistency",
                asset=CUTOVER_KEY,
                description="Per table, row count and a content hash equal on source and target.",
            )
        ],
    )
    def cutover(
        context: AssetExecutionContext,
        config: CutoverConfig,
        pgcdc: PgcdcResource,
        spark: SparkResource,
    ) -> Iterator[Any]:
        from .snapshot import sync_sequences

        settings = pgcdc.settings(spark)
        try:
            target_lsn = pipeline.resolve_endpos(settings, config.endpos)
            steps = list(
                pipeline.catch_up(
                    settings,
                    target_lsn,
                    registered=registered_ranges(context.instance),
                    register=lambda key: context.instance.add_dynamic_partitions(LSN_RANGES, [key]),
                    run_range=lambda rng: pipeline.run_range_in_process(
                        settings, rng, lambda: spark.spark_session
                    ),
                )
            )
            sequences = sync_sequences(settings.source_dsn, settings.target_dsn)
            comparisons = pipeline.compare_tables(settings, tables)
        except Exception as exc:
            if _is_engine_error(exc):
                raise as_failure(exc) from None
            raise
        lag = _lag(settings)
        for received, applied in steps:
            context.log_event(
                AssetMaterialization(
                    DECODED_CHANGES_KEY,
                    partition=received.range_key,
                    metadata=receive_metadata(received, lag),
                )
            )
            for table in tables:
                context.log_event(
                    AssetMaterialization(
                        target_key(table),
                        partition=received.range_key,
                        metadata=apply_metadata(table, received, applied, lag),
                    )
                )
        last = steps[-1][0] if steps else None
        differing = [str(c.table) for c in comparisons if not c.equal]
        yield MaterializeResult(
            metadata={
                "endpos": str(target_lsn),
                "endpos_outcome": last.endpos_outcome if last else "empty",
                "ranges": len(steps),
                "sequences_synced": len(sequences),
                **comparison_metadata(comparisons),
            }
        )
        yield AssetCheckResult(
            check_name="data_consistency",
            passed=not differing,
            severity=AssetCheckSeverity.ERROR,
            metadata=comparison_metadata(comparisons),
            description=None
            if not differing
            else f"tables differ between source and target: {', '.join(differing)}",
        )

    return cutover


def _lag(settings: pipeline.ReplicationSettings) -> int | None:
    try:
        return pipeline.source_positions(settings, timeout_s=3).lag_bytes
    except ENGINE_ERRORS:
        return None


def _is_engine_error(exc: Exception) -> bool:
    from .apply import ApplyError
    from .preflight import PreflightError
    from .snapshot import SnapshotError

    return isinstance(exc, (*ENGINE_ERRORS, ApplyError, SnapshotError, PreflightError))
