"""Assets: source tables → base snapshot → decoded changes (per LSN range) → target tables.

Each body is a call into :mod:`pgcdc_dagster.engine.control.pipeline` plus metadata; the engine owns
every decision about LSNs. Engine errors that a user must act on become ``Failure``s whose text is
the engine's message (it names the problem and the fix, and never a connection string).
"""

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetSpec,
    Config,
    MaterializeResult,
    asset,
    multi_asset,
)

from ..engine.apply.results import ApplyStatus
from ..engine.catalog import ColumnInfo
from ..engine.compare import verify
from ..engine.control import head_start, pipeline
from ..engine.control.range_lock import take_over
from ..engine.identifiers import TableName
from ..engine.lsn import LsnRange
from .checks import consistency_result
from .failures import ENGINE_ERRORS, as_failure
from .following import follow_events, new_follower
from .keys import (
    BASE_SNAPSHOT_KEY,
    CUTOVER_KEY,
    DECODED_CHANGES_KEY,
    SLOT_KEY,
    source_key,
    target_key,
)
from .metadata import (
    apply_metadata,
    comparison_metadata,
    receive_metadata,
    snapshot_metadata,
    table_metadata,
    text,
)
from .partitions import lsn_ranges
from .progress_log import logged
from .range_events import NO_GAP, no_gap
from .resources import PgcdcResource, RangeLockResource, SparkResource
from .row_counts import TargetRowCounts
from .run_liveness import lock_holder_name

REPLICATION_GROUP = "replication"


class SnapshotConfig(Config):
    resnapshot: bool = False
    """Required when target tables already hold rows: truncates them and re-creates the slot."""


class CutoverConfig(Config):
    endpos: str = "current"
    """``current`` (the source's flushed WAL position now) or an LSN ``X/Y``."""


def build_assets(
    tables: Sequence[TableName],
    load_error: str | None,
    columns: Mapping[TableName, list[ColumnInfo]] | None = None,
    databases: tuple[str | None, str | None] = (None, None),
) -> list[Any]:
    """Every asset of the project for the resolved table list (``columns``: the source's
    columns when they could be read at load time, shown as each table's column schema;
    ``databases``: the source's and the target's ``host:port/dbname``, naming their tables)."""
    columns = columns or {}
    source_specs = [
        AssetSpec(
            source_key(t),
            group_name="source",
            kinds={"postgres"},
            description=f"Source table {t} (replicated through the publication).",
            metadata=table_metadata(t, columns.get(t), databases[0]),
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
        # The command that started this run may have started the snapshot already (its head
        # start, with the same options, under the lock it lends this run).
        adopted = head_start.adopt("snapshot", settings.slot)
        started = adopted if isinstance(adopted, head_start.Background) else None
        try:
            with logged(context):
                holder = lock_holder_name(context.run.run_id)
                if started is not None:
                    take_over(settings.target_dsn, settings.slot, holder)
                    result = started.result()
                else:
                    result = pipeline.take_snapshot(
                        settings,
                        lambda: spark.spark_session,
                        resnapshot=config.resnapshot,
                        lock_holder=holder,
                        notify=context.log.warning,
                    )
        except ENGINE_ERRORS as exc:
            raise as_failure(exc) from None
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
        range_lock: RangeLockResource,
    ) -> MaterializeResult:
        settings = pgcdc.settings()
        rng = LsnRange.from_partition_key(context.partition_key)
        try:
            result = pipeline.receive_range(settings, rng)
            lag = _lag(settings)
            uri = pipeline.store_of(settings).range_uri(rng)
        except ENGINE_ERRORS as exc:
            raise as_failure(exc) from None
        if result.already_stored:
            context.log.info(
                f"range {rng.partition_key} was already stored: nothing received again"
            )
        return MaterializeResult(metadata=receive_metadata(result, lag, uri))

    assets: list[Any] = [*source_specs, slot_spec, base_snapshot, decoded_changes]
    if tables:
        assets += [_target_tables(tables, columns, databases[1]), _cutover(tables)]
    return assets


def _target_tables(
    tables: Sequence[TableName],
    columns: Mapping[TableName, list[ColumnInfo]],
    database: str | None,
) -> Any:
    specs = [
        AssetSpec(
            target_key(t),
            group_name="target",
            deps=[DECODED_CHANGES_KEY],
            kinds={"postgres"},
            description=f"Target table {t}: the source's rows, applied range by range.",
            metadata=table_metadata(t, columns.get(t), database),
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
                NO_GAP,
                asset=spec.key,
                blocking=True,
                description="The target origin's progress equals the last commit stored up to "
                "this range: no range was skipped or half applied (one outcome for every "
                "table: they are applied together). Blocking: a failure stops the run.",
            )
            for spec in specs
        ],
    )
    def apply_to_target(
        context: AssetExecutionContext,
        pgcdc: PgcdcResource,
        spark: SparkResource,
        range_lock: RangeLockResource,
    ) -> Iterator[Any]:
        """All tables of a range in one target transaction: they cannot be applied apart."""
        settings = pgcdc.settings(spark)
        rng = LsnRange.from_partition_key(context.partition_key)
        try:
            pipeline.follow_timeline(settings)  # a range stored before a failover: checked
            pipeline.check_range_order(pipeline.store_of(settings), rng)
            received = pipeline.stored_range(settings, rng).manifest.result
            applied = pipeline.apply_stored_range(settings, rng, spark=lambda: spark.spark_session)
            gap = no_gap(
                settings, rng, already_applied=applied.status == ApplyStatus.ALREADY_APPLIED
            )
            rows = TargetRowCounts(context.instance, settings, tables).after(applied)
            reshaped = pipeline.reshaped_columns(settings, applied)
        except ENGINE_ERRORS as exc:
            raise as_failure(exc) from None
        context.log.info(
            f"range {rng.partition_key}: {applied.status}, replay_lsn {applied.replay_lsn}"
        )
        for line in applied.schema_changes:  # the source's DDL, followed on the target
            context.log.info(f"range {rng.partition_key}: {line}")
        for line in applied.warnings:
            context.log.warning(line)
        for table in tables:
            yield MaterializeResult(
                asset_key=target_key(table),
                metadata=apply_metadata(
                    table, received, applied, rows.get(table), reshaped.get(table)
                ),
            )
        for table in tables:
            yield gap.result(target_key(table))

    return apply_to_target


def _cutover(tables: Sequence[TableName]) -> Any:
    @asset(
        key=CUTOVER_KEY,
        # A group of its own, after the targets: the lineage reads left to right, source,
        # replication, target, cutover (in the replication group its edges looped back).
        group_name="cutover",
        deps=[target_key(t) for t in tables],
        kinds={"postgres"},
        description="Migration cutover: catch up to an endpos (default: the source's flushed "
        "WAL now), copy sequence values, verify every table against the source, then validate "
        "the foreign keys an added table's copy created NOT VALID.",
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
        range_lock: RangeLockResource,
    ) -> Iterator[Any]:
        from ..engine.apply.sequences import sync_sequences
        from ..engine.snapshot.foreign_keys import complete

        settings = pgcdc.settings(spark)
        try:
            # Under the run's lock: a cutover run by pgcdc cutover holds the session it asked
            # for the range on, which its own follower must not make way for.
            pipeline.refuse_while_adding(settings)
            follower = new_follower(settings, config.endpos, spark, range_lock.held())
            target_lsn = follower.endpos
            for event in follow_events(context, settings, tables, follower):
                context.log_event(event)
            # The applies' commits on disk (they do not wait for it, PGCDC_APPLY_SYNCHRONOUS_
            # COMMIT): the target takes the writes next.
            pipeline.origin_progress(settings, durable=True)
            sequences = sync_sequences(settings.source_dsn, settings.target_dsn)
            comparisons = verify.compare_tables(settings, tables)
            pipeline.refuse_while_adding(settings)  # an add begun meanwhile: held back too
            # Caught up: the keys an add created NOT VALID hold now, unless a table differs.
            if all(c.equal for c in comparisons):
                foreign_keys = complete(settings.source_dsn, settings.target_dsn, tables)
            else:
                foreign_keys = []
        except ENGINE_ERRORS as exc:
            raise as_failure(exc) from None
        # Each table's own check too: the tables were materialised by this run's follow just
        # before, so the UI shows these results as the tables' current state.
        for comparison in comparisons:
            context.log_event(AssetCheckEvaluation(**consistency_result(comparison)))
        last = follower.summary.last
        differing = [str(c.table) for c in comparisons if not c.equal]
        yield MaterializeResult(
            metadata={
                "endpos": str(target_lsn),
                "endpos_outcome": str(last.endpos_outcome) if last else "empty",
                "ranges": follower.summary.ranges,
                "sequences_synced": len(sequences),
                "foreign_keys_completed": text("; ".join(foreign_keys) or "none"),
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
