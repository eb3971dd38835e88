"""Taking the base snapshot: guards, publication, slot with exported snapshot, schema, rows,
keys, sequences and the target's replication origin, in that order."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors, sql

from ..apply.ddl import record_copied
from ..apply.origin import check_origin_rights, check_room_for, drop_origin, set_origin
from ..apply.sequences import sync_sequences
from ..apply.xid_bounds import read_bound_of, record_bound_at
from ..connect import connect
from ..errors import server_message
from ..failpoints import armed, failpoint
from ..identifiers import TableName, origin_name
from ..lsn import Lsn
from ..postgres_installs import release
from ..progress import CopyWatcher
from ..published_columns import PublishedShape, published_shapes
from ..spark.executors import check_executors
from . import copied_ranges
from .common import (
    DEFAULT_DRIVER_MAX_ROWS,
    DEFAULT_ROWS_PER_TASK,
    RESOLVE_TABLES,
    BaseSnapshotResult,
    CopyFormat,
    CopyRecord,
    SchemaRestoreResult,
    SnapshotError,
    TableCopyResult,
    TargetNotEmptyError,
    bulk_load_facts,
    snapshot_transaction,
    tables_for_spark,
)
from .copy import plan_table_ranges
from .scheduling import copy_tables
from .schema import copy_schema_post_data, copy_schema_pre_data

# ─── orchestration ────────────────────────────────────────────────────────────────────────────

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def populated_tables(
    conn: psycopg.Connection[Any], tables: Sequence[TableName]
) -> tuple[list[TableName], list[TableName]]:
    """The tables of ``tables`` that exist on the target, and those of them holding rows."""
    rows = conn.execute(
        RESOLVE_TABLES, ([t.schema for t in tables], [t.name for t in tables])
    ).fetchall()
    existing = [TableName(s, n) for s, n, oid, _ in rows if oid is not None]
    if not existing:
        return [], []
    probe = sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT {} WHERE EXISTS (SELECT FROM {})").format(sql.Literal(i), t.sql)
        for i, t in enumerate(existing)
    )
    populated = [existing[int(i)] for (i,) in conn.execute(probe).fetchall()]
    return existing, populated


def _reset_target(target_dsn: str, existing: Sequence[TableName], origin: str) -> None:
    with connect(target_dsn, role="target") as tgt:
        if existing:
            try:
                tgt.execute(
                    sql.SQL("TRUNCATE {}").format(sql.SQL(", ").join(t.sql for t in existing))
                )
            except errors.FeatureNotSupported as exc:
                raise SnapshotError(
                    f"cannot truncate the target tables for --resnapshot: "
                    f"{server_message(exc)}: other target tables "
                    "reference them by foreign key; add those tables to the replicated set or "
                    "drop the foreign keys"
                ) from None
        drop_origin(tgt, origin)
        tgt.commit()


_KEY_COLUMNS = """
SELECT u.rel, a.attname
FROM unnest(%s::text[], %s::text[]) AS u(rel, col)
JOIN pg_index i ON i.indrelid = u.rel::regclass AND i.indisprimary
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey) AND a.attname = u.col
"""
"""Of the given (table, column) pairs, those in their table's primary key."""

_STRICT_COLUMNS = """
SELECT u.rel, a.attname
FROM unnest(%s::text[], %s::text[]) AS u(rel, col)
JOIN pg_attribute a ON a.attrelid = u.rel::regclass AND a.attname = u.col
WHERE a.attnotnull AND NOT a.atthasdef
"""
"""Of the given (table, column) pairs, those ``NOT NULL`` without a default."""


def _left_out_where(
    conn: psycopg.Connection[Any], query: str, shapes: Mapping[TableName, PublishedShape]
) -> list[tuple[TableName, str]]:
    """The columns the publication leaves out that ``query`` (over ``(table, column)`` pairs
    given as two arrays) returns: one statement for every table, not one a table."""
    names = {t.sql.as_string(conn): t for t, s in shapes.items() if s.unpublished}
    pairs = [(rel, col) for rel, t in names.items() for col in shapes[t].unpublished]
    if not pairs:
        return []
    rels, cols = zip(*pairs, strict=True)
    rows = conn.execute(query, (list(rels), list(cols))).fetchall()
    return [(names[rel], col) for rel, col in rows]


def _read_shapes(
    source_dsn: str, publication: str, tables: Sequence[TableName], snapshot_name: str
) -> dict[TableName, PublishedShape]:
    """What ``publication`` sends of the tables it narrows, as of the exported snapshot; a
    :class:`SnapshotError` when its column list leaves out a column of a table's primary key
    (possible when the replica identity is another unique index): the target's key could
    hold no copied row."""
    with (
        connect(source_dsn, role="source", autocommit=True) as src,
        snapshot_transaction(src, snapshot_name),
    ):
        shapes = published_shapes(src, publication, tables)
        keys = _left_out_where(src, _KEY_COLUMNS, shapes)
    if keys:
        table, column = keys[0]
        raise _key_left_out(table, column, "it is in the table's primary key")
    return shapes


def _key_left_out(table: TableName, column: str, why: str) -> SnapshotError:
    return SnapshotError(
        f"the publication's column list of {table} leaves out {column}, which the target "
        f"cannot leave empty ({why}): add {column} to the column list (ALTER PUBLICATION ... "
        "SET TABLE ...), then take the snapshot again"
    )


def _let_unpublished_be_empty(
    target_dsn: str, shapes: Mapping[TableName, PublishedShape]
) -> list[str]:
    """Drop ``NOT NULL`` on the target from the columns a column list leaves out that have no
    default: they never receive a value, so every row would be refused (by the copy, and by
    every insert after it). Returns ``table.column`` of each one changed. In a table that was
    there before the snapshot too: a redo after a crash finds the tables the killed snapshot
    made, and a table that can hold no row is no one's intent."""
    if not any(s.unpublished for s in shapes.values()):
        return []
    with connect(target_dsn, role="target") as tgt:
        strict = _left_out_where(tgt, _STRICT_COLUMNS, shapes)
        for table, column in strict:
            try:
                tgt.execute(
                    sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP NOT NULL").format(
                        table.sql, sql.Identifier(column)
                    )
                )
            except errors.InvalidTableDefinition as exc:  # a key of the target's own
                raise _key_left_out(table, column, server_message(exc)) from None
        tgt.commit()
    return [f"{table}.{column}" for table, column in strict]


@dataclass(frozen=True)
class PublishedSchema:
    """What is in place on the target before tables' rows are copied as the publication sends
    them (:func:`prepare_published`)."""

    shapes: dict[TableName, PublishedShape]
    pre_data: SchemaRestoreResult
    not_null_dropped: tuple[str, ...]


def prepare_published(
    source_dsn: str,
    target_dsn: str,
    publication: str,
    tables: Sequence[TableName],
    snapshot_name: str,
) -> PublishedSchema:
    """In the exported snapshot ``snapshot_name``: what ``publication`` sends of ``tables``
    (refused when it leaves out a key column), their schema created on the target (pre-data),
    and the columns it leaves out let be empty there. The base snapshot and a table added
    later both do this before their copy (:func:`~.scheduling.copy_tables` with ``shapes``)."""
    shapes = _read_shapes(source_dsn, publication, tables, snapshot_name)
    pre_data = copy_schema_pre_data(source_dsn, target_dsn, tables, snapshot_name)
    loosened = _let_unpublished_be_empty(target_dsn, shapes)
    _record_columns(source_dsn, target_dsn, tables, snapshot_name)
    return PublishedSchema(shapes, pre_data, tuple(loosened))


def _record_columns(
    source_dsn: str, target_dsn: str, tables: Sequence[TableName], snapshot_name: str
) -> None:
    """Record on the target which source column each of ``tables``' columns is, as of the
    exported snapshot (:func:`~..apply.ddl.record_copied`): later DDL is followed by it."""
    with (
        connect(source_dsn, role="source", autocommit=True) as src,
        snapshot_transaction(src, snapshot_name),
        connect(target_dsn, role="target") as tgt,
    ):
        record_copied(src, tgt, tables)
        tgt.commit()


def copy_published(
    spark: SparkSession | Callable[[], SparkSession],
    source_dsn: str,
    target_dsn: str,
    publication: str,
    tables: Sequence[TableName],
    snapshot_name: str,
    progress: CopyWatcher,
    *,
    existing: Collection[TableName],
    **copy_options: Any,
) -> tuple[PublishedSchema, list[TableCopyResult], float]:
    """What a base snapshot and an add both do in their exported snapshot ``snapshot_name``:
    the published schema of ``tables`` created on the target (:func:`prepare_published`; those
    not in ``existing`` are new), then their rows copied (:func:`~.scheduling.copy_tables`,
    with ``copy_options``) while ``progress`` publishes how far it is. Returns the schema, the
    copies and the copy's seconds."""
    progress.phase("schema")
    schema = prepare_published(source_dsn, target_dsn, publication, tables, snapshot_name)
    started = time.perf_counter()
    with progress:
        copies = copy_tables(
            spark,
            source_dsn,
            target_dsn,
            snapshot_name,
            tables,
            new_tables=set(tables).difference(existing),
            shapes=schema.shapes,
            waiting=progress.waiting,
            **copy_options,
        )
    return schema, copies, time.perf_counter() - started


def _watch_copy_progress(target_dsn: str, stop: threading.Event) -> None:
    """Fire the ``snapshot.copying`` failpoint once rows are flowing into the target (a test
    kills the snapshot in the middle of its copy)."""
    with connect(target_dsn, role="target", autocommit=True) as conn:
        while not stop.wait(0.05):
            (rows,) = conn.execute(  # type: ignore[misc]
                "SELECT coalesce(sum(tuples_processed), 0) FROM pg_stat_progress_copy "
                "WHERE datname = current_database() AND command = 'COPY FROM'"
            ).fetchone()
            if rows > 0:
                failpoint("snapshot.copying")
                return


def start_spark_if_needed(
    src: psycopg.Connection[Any],
    tables: Sequence[TableName],
    spark: SparkSession | Callable[[], SparkSession],
    driver_max_rows: int,
    servers: Mapping[str, str],
) -> SparkSession | Callable[[], SparkSession]:
    """When ``spark`` is a callable and some table is too big for the driver, call it now on a
    background thread, and check its executors against ``servers`` there too
    (:func:`~..spark.executors.check_executors`); return what :func:`copy_tables` should call
    for the session. Both overlap the slot's creation and the schema's."""
    if not callable(spark):
        return spark
    if not tables_for_spark(plan_table_ranges(src, tables, None), driver_max_rows):
        return spark
    provider = spark

    def ready() -> SparkSession:
        session = provider()
        check_executors(session, servers)
        return session

    starting = ThreadPoolExecutor(1, thread_name_prefix="pgcdc-spark-start").submit(ready)
    return starting.result


def take_base_snapshot(
    source_dsn: str,
    target_dsn: str,
    slot_name: str,
    publication: str,
    tables: Sequence[TableName] | None,
    *,
    spark: SparkSession | Callable[[], SparkSession],
    resnapshot: bool = False,
    parallelism: int | None = None,
    target_rows_per_task: int = DEFAULT_ROWS_PER_TASK,
    fine_ranges: bool = False,
    copy_format: CopyFormat = "binary",
    export_store: str | os.PathLike[str] | None = None,
    sync_sequence_values: bool = True,
    begin: Callable[[], None] | None = None,
    slot_created: Callable[[Lsn, str], None] | None = None,
    driver_max_rows: int = DEFAULT_DRIVER_MAX_ROWS,
    slot_failover: str = "off",
) -> BaseSnapshotResult:
    """Take the base snapshot: publication, slot with exported snapshot, schema, rows, keys,
    and the target's replication origin at the slot's consistent point. ``slot_failover``:
    ``PGCDC_SLOT_FAILOVER``, whether the slot is a failover slot
    (:func:`~..source.slot.failover_wanted`).

    Refuses to copy into target tables that already hold rows (the copy would duplicate them)
    unless ``resnapshot``, which first drops the slot, truncates the target tables and drops the
    origin: a clean restart.

    Each range copied is recorded with its rows on the target (:mod:`.copied_ranges`), keyed
    by the slot and its consistent point, which ``slot_created`` is told (with the exported
    snapshot's name) before any row is copied. If anything fails after the slot was created,
    the slot is kept when some range was copied, for the next attempt to resume from
    (:mod:`.resume`), and dropped otherwise (it would retain WAL for a snapshot nobody can
    finish).

    ``spark`` may be a callable that returns the session. It is called only when a table is
    estimated above ``driver_max_rows`` (smaller tables are copied by this process, see
    :func:`copy_tables`), and then at once, on a background thread: Spark's start-up and the
    check of its executors (seconds) overlap the slot, the exported snapshot and the schema
    copy; the rows wait for the check, so a cluster that cannot run the tasks copies none.
    ``begin`` is called once the guards passed and before anything changes (the
    pipeline records there that a snapshot is under way, see :func:`pipeline.take_snapshot`).
    """
    from ..source.preflight import check_source
    from ..source.publication import ensure_publication
    from ..source.slot import create_slot_with_snapshot, drop_slot, failover_wanted
    from ..source.standby import in_recovery

    started = time.perf_counter()
    origin = origin_name(slot_name)
    with connect(source_dsn, role="source", autocommit=True) as src:
        slot_exists = (
            src.execute(
                "SELECT FROM pg_replication_slots WHERE slot_name = %s", (slot_name,)
            ).fetchone()
            is not None
        )
        resolved = check_source(src, tables, free_slots_needed=0 if slot_exists else 1)
        source_version = release(src.info.server_version)
        # Refused before anything is written (the publication), not at the slot's creation.
        failover_wanted(slot_failover, src.info.server_version, standby=in_recovery(src))
    with connect(target_dsn, role="target", autocommit=True) as tgt:
        target_version = release(tgt.info.server_version)
        existing, populated = populated_tables(tgt, resolved)
        check_origin_rights(tgt)
        check_room_for(tgt, origin)
    if populated and not resnapshot:
        names = ", ".join(str(t) for t in populated)
        raise TargetNotEmptyError(
            f"target table(s) {names} already hold rows: a base snapshot would duplicate them; "
            "rerun with --resnapshot to truncate them (and drop the replication slot "
            f"{slot_name} and origin {origin}) and copy everything again"
        )
    if slot_exists and not resnapshot:
        raise SnapshotError(
            f"replication slot {slot_name} already exists on the source: it belongs to an "
            "earlier base snapshot; keep replicating from it, or start over with "
            "--resnapshot (drops the slot, truncates the target tables)"
        )
    if begin is not None:
        begin()
    failpoint("snapshot.after_marker")
    if resnapshot:
        with connect(source_dsn, role="source", autocommit=True) as src:
            drop_slot(src, slot_name, missing_ok=True, wait_seconds=15)
        _reset_target(target_dsn, existing, origin)

    with connect(source_dsn, role="source", autocommit=True) as src:
        ensure_publication(src, publication, resolved)
        spark = start_spark_if_needed(
            src, resolved, spark, driver_max_rows, {"source": source_dsn, "target": target_dsn}
        )

    with connect(target_dsn, role="target") as tgt:
        copied_ranges.forget(tgt, slot_name)  # an earlier attempt's: this one starts afresh
        copied_ranges.ensure_table(tgt)
        tgt.commit()
    bound = read_bound_of(source_dsn)  # before the slot: its W is at or before the point
    exported = create_slot_with_snapshot(source_dsn, slot_name, failover=slot_failover)
    slot = exported.slot
    watch_stop = threading.Event()
    try:
        if slot_created is not None:
            slot_created(slot.consistent_point, slot.snapshot_name)
        failpoint("snapshot.after_slot")
        progress = CopyWatcher(
            source_dsn, target_dsn, resolved, time.monotonic() - (time.perf_counter() - started)
        )
        with exported:
            if armed("snapshot.copying"):  # fires once rows flow: not before the copy
                threading.Thread(
                    target=_watch_copy_progress, args=(target_dsn, watch_stop), daemon=True
                ).start()
            schema, copies, copy_seconds = copy_published(
                spark,
                source_dsn,
                target_dsn,
                publication,
                resolved,
                slot.snapshot_name,
                progress,
                existing=existing,
                parallelism=parallelism,
                target_rows_per_task=target_rows_per_task,
                fine_ranges=fine_ranges,
                copy_format=copy_format,
                export_store=export_store,
                consistent_point=slot.consistent_point,
                driver_max_rows=driver_max_rows,
                record=CopyRecord(slot_name, str(slot.consistent_point)),
            )
            watch_stop.set()
        failpoint("snapshot.after_copy")
        progress.phase("keys")
        post_data = copy_schema_post_data(source_dsn, target_dsn, resolved)
        failpoint("snapshot.after_post_data")
        sequences = sync_sequences(source_dsn, target_dsn) if sync_sequence_values else {}
        with connect(target_dsn, role="target", autocommit=True) as tgt:
            bulk_load = bulk_load_facts(tgt, copies)
        set_origin(target_dsn, origin, slot.consistent_point)
        record_bound_at(target_dsn, slot_name, bound, slot.consistent_point)
        failpoint("snapshot.after_origin")
        progress.phase("done")
    except BaseException:
        watch_stop.set()
        exported.close()
        if not copied_ranges.copied_some(target_dsn, slot_name, slot.consistent_point):
            with (
                contextlib.suppress(Exception),
                connect(source_dsn, role="source", autocommit=True) as src,
            ):
                drop_slot(src, slot_name, missing_ok=True)
        raise
    return BaseSnapshotResult(
        slot_name=slot.name,
        snapshot_name=slot.snapshot_name,
        consistent_point=slot.consistent_point,
        origin_name=origin,
        publication=publication,
        tables=tuple(copies),
        pre_data=schema.pre_data,
        post_data=post_data,
        sequences=sequences,
        seconds=time.perf_counter() - started,
        copy_seconds=copy_seconds,
        export_path=None if export_store is None else str(Path(export_store) / "snapshot"),
        shapes=schema.shapes,
        not_null_dropped=schema.not_null_dropped,
        source_version=source_version,
        target_version=target_version,
        bulk_load=bulk_load,
    )
