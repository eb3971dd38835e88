"""The ops jobs: ``follow`` (one long-lived run that receives and applies continuously),
``prune`` (the store's retention, on demand), ``add_tables`` (tables added to a running
replication, ``pgcdc add-table``), ``finish`` (the replication ended, ``pgcdc finish``) and
``repair`` (the chunks an online verify finds different replaced, ``pgcdc verify --repair``).

``pgcdc follow`` runs it until stopped, ``pgcdc catchup --endpos L`` runs it up to ``L``, and the
slot sensor in ``follow`` mode keeps one alive. The run holds the range lock for its whole life
(through :class:`~pgcdc_dagster.defs.resources.RangeLockResource`); every range it takes is
registered as an ``lsn_ranges`` partition and materialised from inside the run as it is applied
(:mod:`.following`), so the UI's partitions and lineage look the same whichever way a range was
taken. Terminating the run from the UI (or SIGINT/SIGTERM to ``pgcdc``) stops it at a range
boundary.

Every apply already prunes what ``PGCDC_STORE_RETENTION`` lets go, every few minutes at most
(:mod:`pgcdc_dagster.engine.store.retention`); ``prune`` (``pgcdc prune``) does it now, with another
retention if given, or shows what it would remove, and drops the removed ranges' partitions.
It needs no range lock: the store's chain lock orders it with any other prune or snapshot.
"""

from collections.abc import Iterator, Sequence
from typing import Any

from dagster import (
    AssetCheckEvaluation,
    AssetObservation,
    Config,
    Failure,
    JobDefinition,
    MetadataValue,
    OpExecutionContext,
    in_process_executor,
    job,
    op,
)

from ..engine.compare import verify
from ..engine.compare.recover import RecoverHeadStart, recover
from ..engine.compare.repair import RepairedChunk, repair_chunks, repaired_tables
from ..engine.control import head_start, pipeline
from ..engine.control.range_lock import take_over
from ..engine.identifiers import TableName
from ..engine.settings import parse_duration
from ..engine.store.retention import prune
from .checks import consistency_result
from .failures import ENGINE_ERRORS, as_failure
from .following import follow_events, new_follower
from .instance import keep_storage_connections
from .keys import BASE_SNAPSHOT_KEY, DECODED_CHANGES_KEY, SLOT_KEY, target_key
from .metadata import added_metadata, finish_metadata, number, prune_metadata, text
from .progress_log import logged
from .range_events import trim_partitions
from .resources import PgcdcResource, RangeLockResource, SparkResource
from .run_liveness import RANGE_LOCK_TAG, lock_holder_name

FOLLOW_JOB = "follow"
PRUNE_JOB = "prune"
ADD_TABLES_JOB = "add_tables"
RESYNC_TABLES_JOB = "resync_tables"
FINISH_JOB = "finish"
REPAIR_JOB = "repair"
RECOVER_JOB = "recover"
OP_JOBS = (
    FOLLOW_JOB,
    PRUNE_JOB,
    ADD_TABLES_JOB,
    RESYNC_TABLES_JOB,
    FINISH_JOB,
    REPAIR_JOB,
    RECOVER_JOB,
)
"""The jobs built here: ops, which need the table list and not the asset graph."""
NO_ENDPOS = "none"


class FollowConfig(Config):
    endpos: str = NO_ENDPOS
    """Where to stop: ``none`` (follow until stopped), ``current`` (the source's flushed WAL
    when the run starts) or an LSN ``X/Y``."""


def build_follow_job(tables: Sequence[TableName]) -> JobDefinition:
    @op(
        name="follow_stream",
        out={},  # it yields events only
        description="Receive and apply ranges continuously, until endpos or a stop.",
    )
    def follow_stream(
        context: OpExecutionContext,
        config: FollowConfig,
        pgcdc: PgcdcResource,
        spark: SparkResource,
        range_lock: RangeLockResource,
    ) -> Iterator[Any]:
        settings = pgcdc.settings(spark)
        keep_storage_connections(context.instance)  # a long run writes events every range
        try:
            endpos = None if config.endpos.strip().lower() == NO_ENDPOS else config.endpos
            follower = new_follower(settings, endpos, spark, range_lock.held())
            yield from follow_events(context, settings, tables, follower)
        except ENGINE_ERRORS as exc:
            raise as_failure(exc) from None

    @job(
        name=FOLLOW_JOB,
        executor_def=in_process_executor,
        tags={RANGE_LOCK_TAG: "follow"},
        description="Follow the source: receive and apply continuously in one run, every "
        "range a partition; up to an endpos or until stopped.",
    )
    def follow() -> None:
        follow_stream()

    return follow


class PruneConfig(Config):
    retention: str = ""
    """Remove applied ranges stored longer ago than this (``7d``, ``12h``, ``0``: every
    applied range but the last); empty: ``PGCDC_STORE_RETENTION``."""
    dry_run: bool = False
    """Say what would be removed, remove nothing."""


def build_prune_job() -> JobDefinition:
    @op(
        name="prune_store",
        out={},  # it yields its observation only
        description="Remove the applied ranges older than the retention from the output store "
        "(the last applied one stays), and their lsn_ranges partitions.",
    )
    def prune_store(
        context: OpExecutionContext, config: PruneConfig, pgcdc: PgcdcResource
    ) -> Iterator[Any]:
        settings = pgcdc.settings()
        try:
            retention_s = (
                parse_duration(config.retention) if config.retention else settings.store_retention
            )
        except ValueError as exc:
            raise Failure(description=f"retention: {exc}") from None
        if retention_s is None:
            raise Failure(
                description="the retention is forever (PGCDC_STORE_RETENTION=forever): nothing "
                "is pruned; give one (pgcdc prune --retention 7d)"
            )
        try:
            origin = pipeline.origin_progress(settings, durable=True)
            result = prune(pipeline.store_of(settings), origin, retention_s, dry_run=config.dry_run)
        except ENGINE_ERRORS as exc:
            raise as_failure(exc) from None
        if result.skipped:
            raise Failure(description=f"nothing pruned: {result.skipped}")
        dropped = [] if config.dry_run else trim_partitions(context.instance, settings)
        metadata = prune_metadata(result, retention_s, origin, config.dry_run, len(dropped))
        yield AssetObservation(
            DECODED_CHANGES_KEY, description="the store's retention", metadata=metadata
        )
        verb = "would remove" if config.dry_run else "removed"
        context.log.info(
            f"prune {verb} {len(result.removed)} applied range(s) and "
            f"{len(result.history)} of earlier snapshots, {result.bytes} bytes; the chain's "
            f"stored ranges begin at {result.pruned_through or 'its consistent point'}"
        )

    @job(
        name=PRUNE_JOB,
        executor_def=in_process_executor,
        description="Apply the output store's retention now: remove applied ranges older than "
        "it, and their partitions.",
    )
    def prune_job() -> None:
        prune_store()

    return prune_job


class AddTablesConfig(Config):
    tables: list[str]
    """The tables to add, each ``schema.table`` (``table`` alone: in ``public``)."""
    wait_s: float = 120.0
    """How long to wait for the range: for a follow holding it to make way, or for another
    catch-up (a snapshot, a per-range run) to end."""


def build_add_tables_job(resync: bool = False) -> JobDefinition:
    """``add_tables`` (``pgcdc add-table``), or with ``resync`` ``resync_tables`` (``pgcdc
    resync``): replicated tables dropped on the target and copied again the same way."""

    @op(
        name="copy_resynced_tables" if resync else "copy_added_tables",
        out={},  # it yields its observation only
        description=(
            "Copy replicated tables again while replication goes on: each dropped on the "
            "target, copied as of a consistent point of its own, its changes taken from there."
            if resync
            else "Add tables to the running replication: the publication extended, each "
            "copied as of a consistent point of its own, and the apply told to take their "
            "changes from there."
        ),
    )
    def copy_added_tables(
        context: OpExecutionContext,
        config: AddTablesConfig,
        pgcdc: PgcdcResource,
        spark: SparkResource,
    ) -> Iterator[Any]:
        settings = pgcdc.settings(spark)
        try:
            tables = [TableName.parse(name) for name in config.tables]
            with logged(context):
                result = pipeline.add_tables(
                    settings,
                    tables,
                    lambda: spark.spark_session,
                    lock_holder=lock_holder_name(context.run.run_id),
                    wait_s=config.wait_s,
                    resync=resync,
                )
        except (*ENGINE_ERRORS, ValueError) as exc:
            raise as_failure(exc) from None
        yield AssetObservation(
            BASE_SNAPSHOT_KEY,
            description="tables copied again" if resync else "tables added to the replication",
            metadata=added_metadata(result),
        )
        if result.held_back_on_driver:
            context.log.warning(
                f"{result.held_back_on_driver} held-back range(s) staged on the driver: "
                f"{result.held_back_on_driver_why} (PGCDC_SPARK_STAGING=required stops instead)"
            )
        context.log.info(
            f"{'resynced' if resync else 'added'} "
            f"{', '.join(str(t.table) for t in result.tables)} ({result.rows} rows) at "
            f"consistent point {result.consistent_point}: their changes past it are applied"
        )

    @job(
        name=RESYNC_TABLES_JOB if resync else ADD_TABLES_JOB,
        executor_def=in_process_executor,
        description="Copy replicated tables again while replication goes on (pgcdc resync)."
        if resync
        else "Add tables to the running replication (pgcdc add-table).",
    )
    def add_tables_job() -> None:
        copy_added_tables()

    return add_tables_job


class FinishConfig(Config):
    abandon: bool = False
    """End even though the target lacks changes the source published (they are lost)."""
    wait_s: float = 120.0
    """How long to wait for the range: for a follow holding it to make way, or for another
    catch-up to end."""


def build_finish_job() -> JobDefinition:
    @op(
        name="end_replication",
        out={},  # it yields its observation only
        description="End the replication: record it finished, drop the source's slot (it "
        "retains WAL for as long as it exists) and the target's replication origin.",
    )
    def end_replication(
        context: OpExecutionContext, config: FinishConfig, pgcdc: PgcdcResource
    ) -> Iterator[Any]:
        from ..engine.control.finish import finish

        settings = pgcdc.settings()
        try:
            with logged(context):
                result = finish(
                    settings,
                    lock_holder_name(context.run.run_id),
                    config.wait_s,
                    abandon=config.abandon,
                )
        except ENGINE_ERRORS as exc:
            raise as_failure(exc) from None
        yield AssetObservation(
            SLOT_KEY, description="the replication ended", metadata=finish_metadata(result)
        )
        context.log.info(
            f"replication of slot {settings.slot} finished at {result.finished_at}: slot "
            f"{'dropped' if result.slot_dropped else 'already gone'}, origin "
            f"{'dropped' if result.origin_dropped else 'already gone'}"
        )

    @job(
        name=FINISH_JOB,
        executor_def=in_process_executor,
        description="End the replication (pgcdc finish): the slot and the origin dropped.",
    )
    def finish_job() -> None:
        end_replication()

    return finish_job


class RepairConfig(Config):
    wait_s: float = 120.0
    """How long to wait for the range: for a follow holding it to make way, or for another
    catch-up (a snapshot, a per-range run) to end."""


def build_repair_job() -> JobDefinition:
    @op(
        name="repair_chunks",
        out={},  # it records observations and check evaluations only
        description="Compare every replicated table at one consistent point, replace the "
        "differing chunks on the target with the source's rows, and compare those tables again.",
    )
    def repair_op(
        context: OpExecutionContext, config: RepairConfig, pgcdc: PgcdcResource
    ) -> Iterator[Any]:
        settings = pgcdc.settings()
        holder = lock_holder_name(context.run.run_id)
        options: dict[str, Any] = {"wait_s": config.wait_s, "spark": settings.spark_session}
        try:
            tables = pipeline.replicated_tables(settings)
            found = verify.compare_online(
                settings,
                tables,
                holder,
                progressed=lambda progress: context.log.info(progress.line()),
                **options,
            )
            # Chunks only where an online compare cut the table (a table missing on the
            # target has none: pgcdc add-table copies it).
            repairable = [c for c in found.tables if not c.equal and c.plan is not None]
            repaired = (
                repair_chunks(settings, repairable, holder, **options) if repairable else None
            )
            again = repaired_tables(repaired.chunks) if repaired is not None else []
            after = verify.compare_online(settings, again, holder, **options) if again else None
        except ENGINE_ERRORS as exc:
            raise as_failure(exc) from None
        final = {c.table: c for c in found.tables}
        final.update({c.table: c for c in (after.tables if after else [])})
        if repaired is not None:
            yield from _repaired_events(context, repaired.point, repaired.chunks)
        for comparison in final.values():
            yield AssetCheckEvaluation(**consistency_result(comparison))

    @job(
        name=REPAIR_JOB,
        executor_def=in_process_executor,
        description="Verify every table online and replace the chunks that differ with the "
        "source's rows, while the replication goes on (a follow makes way meanwhile).",
    )
    def repair_job() -> None:
        repair_op()

    return repair_job


def _repaired_events(
    context: OpExecutionContext, point: Any, repaired: Sequence[RepairedChunk]
) -> Iterator[AssetObservation]:
    """An observation, and a log line, per table whose chunks were replaced at ``point``."""
    for table in repaired_tables(repaired):
        chunks = [c for c in repaired if c.table == table]
        yield AssetObservation(
            target_key(table),
            description="chunks repaired: replaced with the source's rows",
            metadata={
                "repaired_at": text(point),
                "chunks_repaired": number(sum(c.chunks for c in chunks)),
                "rows_deleted": number(sum(c.deleted for c in chunks)),
                "rows_copied": number(sum(c.copied for c in chunks)),
                "chunk_list": text("; ".join(c.where for c in chunks)),
            },
        )
        context.log.info(
            f"{table}: {sum(c.chunks for c in chunks)} chunk(s) replaced at {point}, "
            f"{sum(c.deleted for c in chunks)} row(s) deleted, "
            f"{sum(c.copied for c in chunks)} copied"
        )


class RecoverConfig(Config):
    wait_s: float = 120.0
    """How long to wait for the range (a follow still holding it makes way)."""
    chunk_rows: int = verify.DEFAULT_CHUNK_ROWS
    """About how many rows a compared chunk holds: a differing chunk is copied whole."""
    every_row: bool = False
    """Compare every row of every table chunk by chunk, not only the rows changed since the
    target's position (for a target that may have been written to)."""


def build_recover_job() -> JobDefinition:
    @op(
        name="recover_slot",
        out={},  # it records observations and check evaluations only
        description="Create a lost slot anew, copy the rows changed since the target's "
        "position and remove the deleted keys (the tables that cannot: compared chunk by chunk, "
        "the differing chunks replaced), and go on from there.",
    )
    def recover_op(
        context: OpExecutionContext, config: RecoverConfig, pgcdc: PgcdcResource
    ) -> Iterator[Any]:
        settings = pgcdc.settings()
        holder = lock_holder_name(context.run.run_id)
        # The command that started this run may have started the recovery already (its head
        # start, with the same options, under the lock it lends this run).
        adopted = head_start.adopt("recover", settings.slot)
        started = adopted if isinstance(adopted, RecoverHeadStart) else None
        try:
            if started is not None:
                take_over(settings.target_dsn, settings.slot, holder)
                try:
                    result = started.result()
                finally:
                    for line in started.said:
                        context.log.info(line)
            else:
                result = recover(
                    settings,
                    holder,
                    wait_s=config.wait_s,
                    chunk_rows=config.chunk_rows,
                    every_row=config.every_row,
                    say=context.log.info,
                )
        except ENGINE_ERRORS as exc:
            raise as_failure(exc) from None
        yield AssetObservation(
            SLOT_KEY,
            description="the lost slot created anew; the rows changed since the target's "
            "position copied, the deleted keys removed, and the tables that path cannot take "
            "compared chunk by chunk",
            metadata={
                "recovered_at": text(result.point),
                "applied_before": text(result.applied_before or "none"),
                "bound": text(result.bound or "none"),
                "rows_changed": number(result.rows_changed),
                "keys_deleted": number(result.keys_deleted),
                "mb_copied": MetadataValue.float(result.mb_copied),
                "changed_seconds": MetadataValue.float(round(result.changed_seconds, 3)),
                "tables_by_fallback": number(len(result.fallback)),
                "compared_every_row": text(
                    "; ".join(f"{table} ({why})" for table, why in result.fallback)
                ),
                "chunks_compared": number(result.chunks_compared),
                "chunks_repaired": number(sum(c.chunks for c in result.repaired)),
                "rows_copied": number(result.rows_copied),
                "compare_seconds": MetadataValue.float(round(result.compare_seconds, 3)),
                "repair_seconds": MetadataValue.float(round(result.repair_seconds, 3)),
                "recover_seconds": MetadataValue.float(round(result.seconds, 3)),
            },
        )
        yield from _repaired_events(context, result.point, result.repaired)
        for changed in result.changed:  # the fast path's tables
            yield AssetObservation(
                target_key(changed.table),
                description="recovered: the rows changed since the target's position copied, "
                "the deleted keys removed",
                metadata={
                    "recovered_at": text(result.point),
                    "rows_changed": number(changed.rows_copied),
                    "keys_deleted": number(changed.keys_deleted),
                    "mb_copied": MetadataValue.float(round(changed.bytes_copied / 1e6, 3)),
                    "key_buckets": number(changed.buckets),
                    "differing_buckets": number(changed.differing_buckets),
                },
            )
        # The tables found equal at the new point pass; a repaired one is not compared again
        # here (a whole-table compare, as long as the recovery's), pgcdc verify does that.
        for comparison in result.tables:
            if comparison.equal:
                yield AssetCheckEvaluation(**consistency_result(comparison))

    @job(
        name=RECOVER_JOB,
        executor_def=in_process_executor,
        # Judged as the range's runs are: a killed recovery is marked failed by the next
        # command or the sensor, and the sensor starts nothing while one is in flight.
        tags={RANGE_LOCK_TAG: "recover"},
        description="Recover a lost slot (pgcdc recover): a new slot, the target compared with "
        "the source at its point, only the differing chunks copied.",
    )
    def recover_job() -> None:
        recover_op()

    return recover_job
