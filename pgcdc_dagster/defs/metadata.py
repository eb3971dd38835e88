"""Engine results as Dagster metadata: one place, so assets, the follow job, cutover and the CLI
agree.

Dagster's standard keys are used where they exist, so the UI renders them natively:
``dagster/row_count`` (target tables after each apply, the base snapshot),
``dagster/partition_row_count`` (the changes of a range), ``dagster/column_schema`` and
``dagster/table_name`` (source and target tables), ``dagster/uri`` (a range's folder in the
store). LSNs are text in ``X/Y`` form: they overflow the UI's 32-bit integers. No field here
ever carries a connection string.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from dagster import MetadataValue, TableColumn, TableColumnConstraints, TableRecord, TableSchema

if TYPE_CHECKING:
    from ..engine.apply.results import ApplyResult
    from ..engine.catalog import ColumnInfo
    from ..engine.compare.verify import TableComparison
    from ..engine.control.finish import FinishResult
    from ..engine.identifiers import TableName
    from ..engine.published_columns import PublishedShape
    from ..engine.snapshot import AddedTablesResult, BaseSnapshotResult, TableCopyResult
    from ..engine.spark.executors import SparkApp
    from ..engine.store.output_store import RangeResult
    from ..engine.store.retention import PruneResult

_INT32 = 2**31 - 1


def number(value: int) -> Any:
    """An int the UI can show: 32-bit ints as ints, larger ones as text."""
    return (
        MetadataValue.int(value) if -_INT32 <= value <= _INT32 else MetadataValue.text(str(value))
    )


def text(value: object) -> MetadataValue:
    return MetadataValue.text("" if value is None else str(value))


ROW_COUNT = "dagster/row_count"
CONSISTENT_POINT = "consistent_point"
"""A copy's consistent point: the snapshot's rows per table are exact there."""
COPIED_TABLES = "tables"
"""A copy's per-table table (:func:`copied_tables`)."""
PARTITION_ROW_COUNT = "dagster/partition_row_count"
COLUMN_SCHEMA = "dagster/column_schema"
TABLE_NAME = "dagster/table_name"
URI = "dagster/uri"
APPLIED_THROUGH = "pgcdc/applied_through"
"""The origin's progress a target table's ``dagster/row_count`` is exact at."""


def table_metadata(
    table: TableName, columns: list[ColumnInfo] | None, database: str | None = None
) -> dict[str, Any]:
    """A table's name and, when known, its columns, as Dagster's standard metadata.

    ``database``: where the table lives (:func:`database_of`). Dagster takes two assets with
    the same ``dagster/table_name`` for the same storage ("linked assets"), so the source's
    and the target's copy of a table are named with their own server and database."""
    name = str(table) if database is None else f"{database}.{table}"
    return {TABLE_NAME: name, **column_schema(columns)}


def column_schema(columns: list[ColumnInfo] | None) -> dict[str, Any]:
    """``dagster/column_schema`` of a table's columns (nothing when they are not known)."""
    if not columns:
        return {}
    return {
        COLUMN_SCHEMA: MetadataValue.table_schema(
            TableSchema(
                columns=[
                    TableColumn(
                        c.name,
                        c.type_sql,
                        constraints=TableColumnConstraints(nullable=not c.not_null, unique=c.key),
                    )
                    for c in columns
                ]
            )
        )
    }


def database_of(dsn: str | None) -> str | None:
    """``host:port/dbname`` of a connection string, for naming its tables: never the user or
    the password. ``None`` when there is no connection string."""
    if not dsn:
        return None
    from psycopg.conninfo import conninfo_to_dict

    try:
        info = conninfo_to_dict(dsn)
    except Exception:  # psycopg.ProgrammingError: not a connection string; say nothing of it
        return None
    host = str(info.get("host") or info.get("hostaddr") or "localhost")
    port = str(info.get("port") or "5432")
    return f"{host}:{port}/{info.get('dbname') or info.get('user') or ''}"


def watermarks(result: RangeResult) -> dict[str, Any]:
    """Where a range starts and ends and how its end fell: on every partition of the range."""
    return {
        "start_lsn": text(result.start_lsn),
        "endpos": text(result.endpos),
        "transform_lsn": text(result.transform_lsn or "none (no transaction in range)"),
        # An id, not a quantity: text, so the UI draws no plot of it.
        "last_xid": text(result.last_xid if result.last_xid is not None else "none"),
        "endpos_outcome": text(result.endpos_outcome),
    }


def receive_metadata(
    result: RangeResult, lag_bytes: int | None, uri: str | None = None
) -> dict[str, Any]:
    """A ``decoded_changes`` partition: the watermarks and what the range holds."""
    meta: dict[str, Any] = {
        PARTITION_ROW_COUNT: number(result.changes),
        **watermarks(result),
        "safe_point": text(result.safe_point),
        "transactions": number(result.transactions),
        "changes": number(result.changes),
        "inserts": number(result.inserts),
        "updates": number(result.updates),
        "deletes": number(result.deletes),
        # Rare events, not a series worth a plot: text, so the UI draws none.
        "truncates": text(result.truncates),
        "deferred_transactions": text(len(result.straddlers)),
        "bytes": number(result.bytes),
        "seconds": MetadataValue.float(float(result.seconds)),
        "already_stored": MetadataValue.bool(result.already_stored),
    }
    if lag_bytes is not None:
        meta["source_lag_bytes"] = number(lag_bytes)
    if uri is not None:
        meta[URI] = MetadataValue.path(uri)
    return meta


def apply_metadata(
    table: TableName,
    received: RangeResult,
    applied: ApplyResult,
    row_count: int | None = None,
    columns: list[ColumnInfo] | None = None,
) -> dict[str, Any]:
    """A target table's partition: the range's watermarks, what the apply did to this table,
    and (when known exactly) how many rows the table holds afterwards.

    Not what the range holds as a whole (its transactions, changes by kind, bytes, receive
    time, the source's lag): that is the ``decoded_changes`` partition's, said once. Every
    materialisation is serialised and written about three times by Dagster's storage, and a
    range records one per replicated table, so every field here costs each event time (see
    ``benchmarks/HISTORY.md``, ``benchmarks/many_tables.py``)."""
    counts = applied.tables.get(str(table))
    meta = {
        PARTITION_ROW_COUNT: number(counts.changes if counts else 0),
        **watermarks(received),
        "replay_lsn": text(applied.replay_lsn or "none"),
        "apply_status": text(applied.status),
        "table_changes": number(counts.changes if counts else 0),
        "table_inserted": number(counts.inserted if counts else 0),
        "table_updated": number(counts.updated if counts else 0),
        "table_deleted": number(counts.deleted if counts else 0),
        # updates and deletes whose row the target did not have: a diverged target
        "table_missing": number(counts.missing if counts else 0),
        "table_truncated": MetadataValue.bool(bool(counts and counts.truncated)),
        "staging_seconds": MetadataValue.float(float(applied.staging_seconds)),
        "staged_by": text(applied.staged_by),
        "apply_seconds": MetadataValue.float(float(applied.apply_seconds)),
        **spark_metadata(applied.spark_app),
    }
    if applied.spark_app is not None:
        meta["spark_tasks"] = number(applied.spark_tasks)
    # The source's DDL the apply followed (or the copy it made for it), with the table's new
    # columns: the UI shows when the table's shape changed.
    steps = [line for line in applied.schema_changes if line.startswith(f"{table}: ")]
    if steps:
        meta["schema_changes"] = text("\n".join(steps))
    meta.update(column_schema(columns))
    if str(table) in applied.in_commit_order:
        meta["applied_in_commit_order"] = MetadataValue.bool(True)
    if row_count is not None:
        meta[ROW_COUNT] = number(row_count)
        meta[APPLIED_THROUGH] = text(applied.replay_lsn)
    return meta


def table_of(rows: list[dict[str, Any]], columns: dict[str, str]) -> MetadataValue:
    """A metadata table: ``columns`` maps each column to its Dagster type name."""
    schema = TableSchema(columns=[TableColumn(name, kind) for name, kind in columns.items()])
    return MetadataValue.table([TableRecord(row) for row in rows], schema=schema)


def _narrowed(
    shapes: Mapping[TableName, PublishedShape], table: TableName
) -> dict[str, str | None]:
    """How the publication narrows ``table`` (only that was copied, as only that streams)."""
    shape = shapes.get(table)
    if shape is None:
        return {"row_filter": None, "columns_left_out": None}
    return {"row_filter": shape.row_filter, "columns_left_out": ", ".join(shape.unpublished)}


def copied_tables(
    tables: Sequence[TableCopyResult], shapes: Mapping[TableName, PublishedShape]
) -> MetadataValue:
    """A copy's per-table table: rows, bytes and seconds, how each was loaded, the rows a
    continued table kept from a killed attempt, and what its publication leaves out."""
    return table_of(
        [
            {
                "table": str(t.table),
                "rows": t.rows,
                "bytes": t.bytes,
                "seconds": None if t.seconds is None else round(float(t.seconds), 3),
                "copied_by": t.copied_by,
                "tasks": t.tasks,
                "frozen": t.frozen,
                "bundled_with": t.bundled_with,
                "kept_rows": t.kept_rows,
                **_narrowed(shapes, t.table),
            }
            for t in tables
        ],
        {
            "table": "string",
            "rows": "int",
            "bytes": "int",
            "seconds": "float",
            "copied_by": "string",
            "tasks": "int",
            "frozen": "bool",
            "bundled_with": "int",
            "kept_rows": "int",
            "row_filter": "string",
            "columns_left_out": "string",
        },
    )


def spark_metadata(app: SparkApp | None) -> dict[str, Any]:
    """Where the Spark application that did the work is: its id, and its UI as a link the
    run's page opens (none where the UI is off, as for a local session)."""
    if app is None:
        return {}
    meta: dict[str, Any] = {"spark_application_id": text(app.application_id or "unknown")}
    if app.ui_url:
        meta["spark_ui"] = MetadataValue.url(app.ui_url)
    if app.master:
        meta["spark_master"] = text(app.master)
    if app.executors:
        meta["spark_executors"] = text(app.executors)
    return meta


def _loosened(not_null_dropped: Sequence[str]) -> dict[str, Any]:
    if not not_null_dropped:
        return {}
    return {"not_null_dropped": text(", ".join(not_null_dropped))}


def snapshot_metadata(result: BaseSnapshotResult) -> dict[str, Any]:
    return {
        **_loosened(result.not_null_dropped),
        "slot": text(result.slot_name),
        "snapshot_name": text(result.snapshot_name),
        CONSISTENT_POINT: text(result.consistent_point),
        "origin": text(result.origin_name),
        "source_version": text(result.source_version),
        "target_version": text(result.target_version),
        "schema_tools": text(result.pre_data.tools),
        COPIED_TABLES: copied_tables(result.tables, result.shapes),
        ROW_COUNT: number(result.rows),
        "rows": number(result.rows),
        "seconds": MetadataValue.float(round(float(result.seconds), 3)),
        "copy_seconds": MetadataValue.float(round(float(result.copy_seconds), 3)),
        "keys_seconds": MetadataValue.float(round(float(result.keys_seconds), 3)),
        "bulk_load": MetadataValue.json(dict(result.bulk_load)),
        **spark_metadata(result.spark_app),
    }


def added_metadata(result: AddedTablesResult) -> dict[str, Any]:
    """Tables added to the replication: their copy, the consistent point it stands at (their
    changes at or before it are skipped by the apply), their changes the applies held back
    while it ran (applied after it), and the foreign keys created ``NOT VALID`` (validated by
    the cutover) or not at all, with why."""
    return {
        **_loosened(result.not_null_dropped),
        "added_tables": text(", ".join(str(t.table) for t in result.tables)),
        "consistent_point": text(result.consistent_point),
        "tables": copied_tables(result.tables, result.shapes),
        "rows": number(result.rows),
        "held_back_changes": number(result.held_back),
        "held_back_with_range": number(result.held_back_with_range),
        "held_back_passes": number(result.held_back_passes),
        "held_back_ranges_on_spark": number(result.held_back_on_spark),
        "held_back_staged_on_driver": number(result.held_back_on_driver),
        "held_back_staged_on_driver_why": text(result.held_back_on_driver_why or "none"),
        "held_back_transactions": number(result.held_back_transactions),
        "held_back_seconds": MetadataValue.float(round(float(result.held_back_seconds), 3)),
        **spark_metadata(result.spark_app),
        "foreign_keys_not_valid": text("; ".join(result.foreign_keys.not_valid) or "none"),
        "foreign_keys_skipped": text("; ".join(result.foreign_keys.skipped) or "none"),
        "seconds": MetadataValue.float(round(float(result.seconds), 3)),
    }


def finish_metadata(result: FinishResult) -> dict[str, Any]:
    """The replication's end: where the target stood, what was dropped, what was left."""
    return {
        "finished_at": text(result.finished_at),
        "slot_dropped": MetadataValue.bool(result.slot_dropped),
        "origin_dropped": MetadataValue.bool(result.origin_dropped),
        "publication_kept": text(result.publication),
    }


def differs(comparison: TableComparison) -> str:
    """One line on how a table differs between source and target, with the fix when known."""
    if comparison.missing_on == "target":
        return (
            f"{comparison.table} does not exist on the target (the publication sends it, the "
            f"base snapshot did not copy it): pgcdc add-table {comparison.table} copies it"
        )
    where = ""
    if comparison.differing:
        first = comparison.differing[0]
        keys = ", ".join(f"{k.key} {k.kind}" for k in first.keys)
        where = (
            f"; {len(comparison.differing)} of {comparison.chunks} chunk(s) differ, the first "
            f"where {first.where}" + (f" (keys {keys})" if keys else "")
        )
    return (
        f"{comparison.table} differs: source {comparison.source_rows} rows, target "
        f"{comparison.target_rows} rows{where or ' (or same count, different content)'}"
    )


def chunk_lines(comparison: TableComparison) -> list[str]:
    """One line per differing chunk: where it lies, its rows on each side, its keys."""
    return [
        f"{chunk.where}: source {chunk.source_rows} rows, target {chunk.target_rows}"
        + (f"; keys {', '.join(f'{k.key} {k.kind}' for k in chunk.keys)}" if chunk.keys else "")
        for chunk in comparison.differing
    ]


def no_longer_published(table: TableName) -> str:
    """One line on a replicated table the publication no longer sends, with the fix."""
    return (
        f"{table}: replicated, but the publication no longer sends it (dropped and created "
        "again on the source, or dropped from the publication), so its target copy is no "
        f"longer kept in sync: empty it on the target and run pgcdc add-table {table}, or drop "
        "it on the target"
    )


def comparison_metadata(comparisons: list[TableComparison]) -> dict[str, Any]:
    differing = [str(c.table) for c in comparisons if not c.equal]
    tables = table_of(
        [
            {
                "table": str(c.table),
                "source_rows": c.source_rows,
                "target_rows": c.target_rows,
                "equal": c.equal,
                "missing_on": c.missing_on,
            }
            for c in comparisons
        ],
        {
            "table": "string",
            "source_rows": "int",
            "target_rows": "int",
            "equal": "bool",
            "missing_on": "string",
        },
    )
    meta: dict[str, Any] = {
        "tables": tables,
        "differing_tables": text(", ".join(differing) or "none"),
    }
    if len(comparisons) == 1:
        (one,) = comparisons
        meta["chunks"] = number(one.chunks)
        meta["differing_chunks"] = number(len(one.differing))
        if one.differing:
            meta["differing_chunk_list"] = MetadataValue.md(
                "\n".join(f"- {line}" for line in chunk_lines(one))
            )
    return meta


def prune_metadata(
    result: PruneResult,
    retention_s: float,
    origin: Any,
    dry_run: bool,
    partitions_dropped: int,
) -> dict[str, Any]:
    """What a prune of the store's retention did (or, dry, would do)."""
    return {
        "dry_run": dry_run,
        "retention_s": retention_s,
        "origin_progress": text(origin),
        "ranges_removed": len(result.removed),
        "history_ranges_removed": len(result.history),
        "bytes_removed": number(result.bytes),
        "first_removed": result.removed[0].partition_key if result.removed else "",
        "last_removed": result.removed[-1].partition_key if result.removed else "",
        "pruned_through": text(result.pruned_through),
        "oldest_kept": result.kept.partition_key if result.kept else "",
        "partitions_dropped": partitions_dropped,
        "seconds": result.seconds,
    }
