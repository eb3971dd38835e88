"""Scheduling the copy tasks on Spark: an RDD on a classic session, a Python UDF over
``spark.range`` on Spark Connect (which has no ``sparkContext``)."""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import psycopg

from ..connect import connect
from ..errors import PgcdcError
from ..failpoints import failpoint
from ..identifiers import TableName
from ..lsn import Lsn
from ..published_columns import PublishedShape
from ..spark.executors import SparkApp, check_executors, redact_all, spark_app, task_error_line
from .common import (
    COLUMNS,
    DEFAULT_DRIVER_MAX_ROWS,
    DEFAULT_ROWS_PER_TASK,
    CopyFormat,
    CopyRecord,
    CopyTask,
    RangeCopyResult,
    SnapshotError,
    TableCopyResult,
    TableRange,
    resolve_oids,
    snapshot_transaction,
    tables_for_spark,
)
from .continued import outside
from .copy import (
    bundle_tasks,
    copy_bundle,
    copy_range,
    merge_ranges,
    piped_copy_available,
    plan_table_ranges,
)
from .export import publish_export, snapshot_export_path

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def run_group(group: Sequence[CopyTask]) -> list[RangeCopyResult]:
    """The tasks Spark gave one partition, one after the other (this is how ``parallelism``
    bounds the number of simultaneous copies)."""
    return [copy_range(task) for task in group]


def run_group_row(groups: Sequence[Sequence[CopyTask]], index: int) -> list[dict[str, Any]]:
    """Python-UDF form of :func:`run_group` for Spark Connect sessions (no RDD API there)."""
    return [
        {
            "schema": r.table.schema,
            "name": r.table.name,
            "start_block": r.start_block,
            "rows": r.rows,
            "bytes": r.bytes,
            "seconds": r.seconds,
            "copy_format": r.copy_format,
            "parquet_file": r.parquet_file,
        }
        for r in run_group(groups[index])
    ]


# ─── scheduling on Spark ──────────────────────────────────────────────────────────────────────


def _groups(tasks: Sequence[CopyTask], parallelism: int | None) -> list[list[CopyTask]]:
    """One group per Spark partition, largest tasks first; with ``parallelism`` below the task
    count, tasks are dealt greedily to the least-loaded of ``parallelism`` groups."""
    ordered = sorted(tasks, key=lambda t: t.range.estimated_rows, reverse=True)
    if parallelism is None or parallelism >= len(ordered):
        return [[t] for t in ordered]
    groups: list[list[CopyTask]] = [[] for _ in range(max(1, parallelism))]
    loads = [0] * len(groups)
    for task in ordered:
        i = loads.index(min(loads))
        groups[i].append(task)
        loads[i] += max(1, task.range.estimated_rows)
    return groups


def _run_on_spark(
    spark: SparkSession, groups: list[list[CopyTask]], scheduler: str
) -> list[RangeCopyResult]:
    from ..spark.executors import is_connect_session

    use_rdd = scheduler == "rdd" or (scheduler == "auto" and not is_connect_session(spark))
    if use_rdd:
        sc = spark.sparkContext
        sc.setJobDescription("pgcdc base snapshot: copy table ranges")
        return list(sc.parallelize(groups, len(groups)).flatMap(run_group).collect())
    # Spark Connect has no sparkContext: one row per group, each row handled by a
    # nondeterministic Python UDF (so the optimizer never runs it twice or drops it).
    from pyspark.sql import functions as F
    from pyspark.sql.types import (
        ArrayType,
        DoubleType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    result_type = ArrayType(
        StructType(
            [
                StructField("schema", StringType()),
                StructField("name", StringType()),
                StructField("start_block", LongType()),
                StructField("rows", LongType()),
                StructField("bytes", LongType()),
                StructField("seconds", DoubleType()),
                StructField("copy_format", StringType()),
                StructField("parquet_file", StringType()),
            ]
        )
    )
    with warnings.catch_warnings():
        # pyspark tries to read a pandas-UDF kind off the type hints; this is a plain UDF.
        warnings.simplefilter("ignore", UserWarning)
        run = F.udf(
            functools.partial(run_group_row, groups), result_type, useArrow=False
        ).asNondeterministic()
    frame = spark.range(len(groups), numPartitions=len(groups)).select(run("id").alias("r"))
    results = []
    for row in frame.collect():
        for r in row["r"]:
            results.append(
                RangeCopyResult(
                    table=TableName(r["schema"], r["name"]),
                    start_block=r["start_block"],
                    rows=r["rows"],
                    bytes=r["bytes"],
                    seconds=r["seconds"],
                    copy_format=r["copy_format"],
                    parquet_file=r["parquet_file"],
                )
            )
    return results


def copy_tables(
    spark: SparkSession | Callable[[], SparkSession] | None,
    source_dsn: str,
    target_dsn: str,
    snapshot_name: str | None,
    tables: Sequence[TableName],
    *,
    parallelism: int | None = None,
    target_rows_per_task: int = DEFAULT_ROWS_PER_TASK,
    fine_ranges: bool = False,
    copy_format: CopyFormat = "binary",
    export_store: str | os.PathLike[str] | None = None,
    consistent_point: Lsn | None = None,
    scheduler: Literal["auto", "rdd", "dataframe"] = "auto",
    driver_max_rows: int = DEFAULT_DRIVER_MAX_ROWS,
    new_tables: Collection[TableName] = (),
    shapes: Mapping[TableName, PublishedShape] | None = None,
    waiting: Callable[[str], None] | None = None,
    record: CopyRecord | None = None,
    kept_blocks: Mapping[TableName, Sequence[tuple[int, int | None]]] | None = None,
) -> list[TableCopyResult]:
    """Copy the rows of ``tables`` as of ``snapshot_name`` into the same-named target tables.

    Who copies: a table estimated at or below ``driver_max_rows`` rows is copied by this
    process (threads, one task per ctid range, as many at once as ``parallelism`` or the CPU
    count; small whole tables in bundles, see :func:`~.copy.copy_bundle`), and the rest by
    Spark. When some table needs Spark, no copy starts before its session is up and its
    executors passed :func:`~..spark.executors.check_executors` (``spark`` may be a callable
    that returns the session: it is called only then, and the caller may have started it in
    the background); then the driver's copies run beside Spark's. Without any large table
    Spark is never asked for. ``spark=None`` copies everything from the driver.
    A copy task is the same function in both places, so both copy exactly the same rows.

    Spark runs one task per ctid range (:func:`plan_table_ranges`); ``parallelism`` caps how
    many run at once (each holds one source and one target connection), otherwise Spark's
    cores are the cap. The snapshot must stay importable until this returns. ``snapshot_name``
    ``None`` lets every task read the latest data: consistent per range only, for sources that
    nobody writes to.

    ``export_store`` also writes each table as Parquet under
    :func:`snapshot_export_path`, stamped with ``consistent_point`` in ``_SNAPSHOT.json``
    (written last: a folder without it is incomplete). The copy then uses CSV on the wire so the
    same bytes feed the target and the Parquet writer; the folder must be reachable by every
    Spark worker. It is off by default because it is not cheap: it adds more to the copy time
    than its 30 % budget (see ``benchmarks/HISTORY.md``, "The snapshot's Parquet export").

    ``new_tables``: the tables this snapshot created on the target (empty, with no keys,
    foreign keys or triggers yet). A range that is the whole of such a plain table is loaded
    frozen (:attr:`~.common.CopyTask.freeze`): on a machine where the driver copies with one
    worker, that is every table but a partitioned one.

    ``shapes``: what the publication sends of the tables it narrows (only that is copied, see
    :func:`~.copy.plan_table_ranges`).

    ``record``: a base snapshot's; each range is recorded as copied in its own target
    transaction (:mod:`.copied_ranges`), which a resume reads.

    ``fine_ranges``: the driver copies ranges of ``target_rows_per_task`` rows too, not one
    per worker: a snapshot killed in a big table then loses at most one range per worker
    (``PGCDC_SNAPSHOT_RANGE_ROWS``).

    ``kept_blocks``: tables a killed snapshot copied in part, with the block ranges it copied,
    which are left out here (:mod:`.continued`: a resume continues such a table).

    ``waiting`` is told what the copy waits for before rows flow (Spark's start and the check
    of its executors), and ``""`` once they flow.

    ``scheduler``: ``rdd`` (classic sessions), ``dataframe`` (a plain Python UDF over
    ``spark.range``, one row per group of tasks: the only way on Spark Connect, which has no
    ``sparkContext``), ``auto`` picks by session kind. Both are tested: the ``dataframe`` path
    on a classic session and against a local Spark Connect server (``test_spark_connect``).
    """
    if export_store is not None and consistent_point is None:
        raise ValueError("export_store needs the consistent_point to stamp the export with")
    if not tables:
        return []
    with connect(source_dsn, role="source", autocommit=True) as src:
        ranges = plan_table_ranges(src, tables, snapshot_name, target_rows_per_task, shapes)
        if kept_blocks:
            ranges = [
                part
                for rng in ranges
                for part in (
                    outside(rng, kept_blocks[rng.table]) if rng.table in kept_blocks else [rng]
                )
            ]
        column_types = _column_type_names(src, tables, snapshot_name)
    staging: Path | None = None
    if export_store is not None:
        staging = Path(export_store) / "snapshot" / f".tmp-{uuid.uuid4().hex}"
        for table in tables:
            (staging / snapshot_export_path(export_store, table).name).mkdir(parents=True)
    for_spark = set() if spark is None else tables_for_spark(ranges, driver_max_rows)
    driver_ranges = [r for r in ranges if r.table not in for_spark]
    workers = _driver_workers(len(driver_ranges), parallelism)
    driver_rows = sum(r.estimated_rows for r in driver_ranges)
    # The driver cuts no finer than its workers need: one range per table with one worker
    # (unless asked for ``fine_ranges``: as planned).
    if not fine_ranges:
        driver_ranges = merge_ranges(
            driver_ranges, max(target_rows_per_task, math.ceil(driver_rows / workers))
        )

    new = set(new_tables)

    def make_task(rng: TableRange) -> CopyTask:
        return CopyTask(
            range=rng,
            source_dsn=source_dsn,
            target_dsn=target_dsn,
            snapshot_name=snapshot_name,
            copy_format=copy_format,
            export_dir=(
                None
                if staging is None or export_store is None
                else str(staging / snapshot_export_path(export_store, rng.table).name)
            ),
            column_types=tuple(column_types[rng.table][c] for c in rng.columns),
            freeze=_whole_new_table(rng, new),
            record=record,
        )

    driver_tasks = [make_task(r) for r in driver_ranges]
    spark_tasks = [make_task(r) for r in ranges if r.table in for_spark]
    bundles, alone = bundle_tasks(driver_tasks)
    bundled = [t for bundle in bundles for t in bundle]
    frozen = {t.range.table for t in (*bundled, *alone, *spark_tasks) if t.freeze}
    app: SparkApp | None = None
    try:
        session = None
        if spark_tasks:
            # The executors are checked before the first row moves, the driver's included:
            # a cluster that cannot run the tasks then leaves nothing half-copied.
            if waiting is not None:
                waiting(
                    f"waiting for Spark and the check of its executors ({len(spark_tasks)} "
                    f"Spark task(s) for {len(for_spark)} table(s))"
                )
            session = spark() if callable(spark) else spark
            assert session is not None
            check_executors(session, {"source": source_dsn, "target": target_dsn})
            app = spark_app(session)
            if waiting is not None:
                waiting("")
        streams = _driver_streams(len(bundles) + len(alone), workers, parallelism)
        with _driver_pool(driver_tasks, streams) as pool:
            futures = [pool.submit(_bundle, bundle) for bundle in bundles]
            futures += [pool.submit(_one, task) for task in alone]
            results = []
            if session is not None:
                results += _run_on_spark(session, _groups(spark_tasks, parallelism), scheduler)
            results += [r for future in futures for r in future.result()]
    except Exception as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, PgcdcError):
            raise
        message = redact_all(task_error_line(exc), (source_dsn, target_dsn))
        raise SnapshotError(f"the table copy failed in a copy task: {message}") from exc
    by_table: dict[TableName, list[RangeCopyResult]] = {t: [] for t in tables}
    for result in results:
        by_table.setdefault(result.table, []).append(result)
    summary = [
        TableCopyResult(
            table=table,
            rows=sum(r.rows for r in parts),
            # None: a bundle's table, whose bytes and seconds are not its own to measure
            bytes=None if any(r.bytes is None for r in parts) else sum(r.bytes or 0 for r in parts),
            seconds=(
                None
                if any(r.seconds is None for r in parts)
                else sum(r.seconds or 0.0 for r in parts)
            ),
            tasks=len(parts),
            copy_formats=tuple(sorted({r.copy_format for r in parts})),
            copied_by="spark" if table in for_spark else "driver",
            spark_app=app if table in for_spark else None,
            frozen=table in frozen,
            bundled_with=max((r.bundled_with for r in parts), default=0),
        )
        for table, parts in by_table.items()
    ]
    if staging is not None and export_store is not None and consistent_point is not None:
        publish_export(
            export_store,
            staging,
            summary,
            by_table,
            ranges,
            column_types,
            snapshot_name,
            consistent_point,
        )
    return summary


def _one(task: CopyTask) -> list[RangeCopyResult]:
    copied = [copy_range(task)]
    failpoint("snapshot.range_copied")
    return copied


def _bundle(tasks: Sequence[CopyTask]) -> list[RangeCopyResult]:
    copied = copy_bundle(tasks)
    failpoint("snapshot.range_copied")
    return copied


def _whole_new_table(rng: TableRange, new: set[TableName]) -> bool:
    """Whether ``rng`` may be loaded frozen: all of a table this snapshot created, read from
    that same relation (a leaf of a partitioned table is written through its root, which
    ``COPY ... (FREEZE)`` refuses), so its truncate can only ever meet an empty table that
    no other task writes."""
    return (
        rng.table in new
        and rng.source == rng.table
        and rng.start_block is None
        and rng.end_block is None
    )


DRIVER_PROCESSES_MIN_ROWS = 2_000_000
"""Below this many rows in all, the driver's copies run on threads; above, on processes: below
it, starting the processes costs more than they gain (see ``benchmarks/HISTORY.md``, "The
driver's copy processes")."""


def _driver_workers(tasks: int, parallelism: int | None) -> int:
    """How many copy tasks the driver runs at once.

    With ``psql`` at hand (the usual case) a copy is two ``psql`` processes piped into each
    other (:func:`~.copy.copy_range`), as many at once as half the cores: each keeps two server
    backends busy, so on 2 cores one stream is about as fast as two, with half the contention
    (see ``benchmarks/HISTORY.md``, ``benchmarks/snapshot.py --methods ...``, one stream
    against two). Without it the copy calls into Python once per row, one per core."""
    cores = os.cpu_count() or 1
    default = max(1, cores // 2) if piped_copy_available() else cores
    return max(1, min(tasks or 1, parallelism or default))


def _driver_streams(tasks: int, workers: int, parallelism: int | None) -> int:
    """How many of the driver's tasks (ranges, bundles) copy at once: ``workers``
    (:func:`_driver_workers`, which also decides how finely a table is cut), or, by default, as
    many as the cores when there are tasks for them.

    Why more streams than a table is cut for: a table is cut only as finely as half the cores,
    so a big table stays whole and loads frozen, and its one stream is about as fast as two
    halves on 2 cores. Different tables copied at once are another matter: one stream leaves a
    core idle between its two backends, and two tables of 1M rows each copy about a fifth
    faster two at a time than one after the other, as native logical replication's table
    syncs do (``benchmarks/snapshot_resume.py``'s tables, ``benchmarks/HISTORY.md``)."""
    if parallelism is not None:
        return max(1, min(tasks or 1, parallelism))
    return max(1, min(tasks or 1, max(workers, os.cpu_count() or 1)))


def _driver_pool(tasks: Sequence[CopyTask], workers: int) -> Executor:
    """Where the driver's copy tasks run: threads when they copy through ``psql``, since this
    process only starts the pair and waits then.

    Without ``psql`` threads would share one core through the GIL (``PQgetCopyData`` returns
    one row at a time): past :data:`DRIVER_PROCESSES_MIN_ROWS` the tasks run on spawned
    processes (this process may hold threads: no fork), which cost their start-up (see
    ``benchmarks/HISTORY.md``, "The driver's copy processes").
    """
    if piped_copy_available():
        return ThreadPoolExecutor(workers, thread_name_prefix="pgcdc-driver-copy")
    if sum(t.range.estimated_rows for t in tasks) < DRIVER_PROCESSES_MIN_ROWS:
        return ThreadPoolExecutor(workers, thread_name_prefix="pgcdc-driver-copy")
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    # Start every worker now, before the copies compete with them for the CPU: a worker
    # spawned while the first copies run is slow to take its first task (see
    # benchmarks/HISTORY.md, "The driver's copy processes").
    list(pool.map(time.sleep, [0.2] * workers))
    return pool


def _column_type_names(
    conn: psycopg.Connection[Any], tables: Sequence[TableName], snapshot_name: str | None
) -> dict[TableName, dict[str, str]]:
    with snapshot_transaction(conn, snapshot_name):
        oids = resolve_oids(conn, tables)
        rows = conn.execute(COLUMNS, (list(oids.values()),)).fetchall()
    by_oid = {oid: table for table, oid in oids.items()}
    types: dict[TableName, dict[str, str]] = {t: {} for t in tables}
    for relid, name, _, typname, _ in rows:
        types[by_oid[int(relid)]][name] = typname
    return types
