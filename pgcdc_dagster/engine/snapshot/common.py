"""What the snapshot's parts share: errors, tasks and results, the snapshot transaction,
running a libpq tool."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from psycopg import errors, sql

from ..connect import ConnectError, describe_dsn, libpq_tool_environment, redact
from ..errors import PgcdcError, server_message
from ..identifiers import TableName
from ..lsn import Lsn
from ..published_columns import PublishedShape
from ..settings import SNAPSHOT_RANGE_ROWS, SPARK_TABLE_ROWS
from ..spark.executors import SparkApp

DEFAULT_ROWS_PER_TASK = SNAPSHOT_RANGE_ROWS

CopyFormat = Literal["binary", "text", "csv"]
SNAPSHOT_MANIFEST = "_SNAPSHOT.json"
EXPORT_FORMAT_VERSION = 1


class SnapshotError(PgcdcError):
    """The base snapshot could not be taken; the message names the object and the fix."""


class TargetNotEmptyError(SnapshotError):
    """The target already holds rows in tables the base snapshot would copy into."""


# ─── results ────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class TableRange:
    """One unit of copy work: the rows of ``source`` whose ctid lies in
    ``[start_block, end_block)`` (``None`` = unbounded), written into ``table`` on the target.

    ``source`` differs from ``table`` only for a leaf partition of a partitioned ``table``: ctids
    exist per leaf, and writing through the root lets the target route rows to its own
    partitions. The last range of a relation is always open-ended, so rows on pages added after
    planning (by a HOT chain, say) are never missed.
    """

    table: TableName
    source: TableName
    columns: tuple[str, ...]
    start_block: int | None
    end_block: int | None
    estimated_rows: int
    row_filter: str | None = None
    """The publication's row filter of ``table`` (:class:`~..source.publication.PublishedShape`):
    only the rows it passes are copied, as only their changes are streamed."""
    filenode: int | None = None
    """``source``'s ``relfilenode`` in the snapshot the range was planned in, recorded with the
    range (:mod:`.copied_ranges`): a resume keeps block ranges only of a relation not rewritten
    since (:mod:`.continued`)."""


@dataclass(frozen=True)
class CopyRecord:
    """Whose copy a range belongs to, recorded with its rows on the target
    (:mod:`.copied_ranges`): the slot and its consistent point (text form, so a copy task stays
    plain and picklable)."""

    slot: str
    consistent_point: str


@dataclass(frozen=True)
class CopyTask:
    """What a Spark task needs to copy one :class:`TableRange`: plain, picklable values only.

    The connection strings are excluded from ``repr`` so a task that ends up in a log or a
    Spark error message does not carry a password with it.
    """

    range: TableRange
    source_dsn: str = field(repr=False)
    target_dsn: str = field(repr=False)
    snapshot_name: str | None
    copy_format: CopyFormat = "binary"
    export_dir: str | None = None
    """When set, the rows are also written as Parquet into this folder (CSV is then the wire
    format, teed into the Parquet writer)."""
    column_types: tuple[str, ...] = ()
    freeze: bool = False
    """Load the range frozen: ``TRUNCATE ONLY`` the target table, then ``COPY ... (FREEZE)``,
    in one transaction. Only for a range that is its whole table, written into a plain table
    this snapshot created (empty, no foreign keys or triggers yet, nobody else writing it): the
    truncate would otherwise take others' rows or fail. Why: the rows arrive frozen with their
    hint bits set and their pages all-visible, so the key builds after the copy read them
    without a commit-log lookup or a write-back of every page, and the target's first VACUUM
    has nothing to do (see ``benchmarks/HISTORY.md``, ``benchmarks/snapshot.py --methods ...``,
    the frozen load). Rows loaded frozen are visible to snapshots
    older than their load, which no one holds on a table the snapshot is creating."""
    record: CopyRecord | None = None
    """A base snapshot's: the range is recorded as copied in its own target transaction
    (:func:`~.copied_ranges.record_statement`), so a killed snapshot resumes from it."""


@dataclass(frozen=True)
class RangeCopyResult:
    """What one task copied. ``copy_format`` is the format that worked (after any fallback)."""

    table: TableName
    start_block: int | None
    rows: int
    bytes: int | None
    """Wire bytes of this task; ``None`` for a table copied in a bundle (see ``bundled_with``):
    one stream carries every table of the bundle, so no table's own bytes are known."""
    seconds: float | None
    """This task's duration; ``None`` in a bundle, as ``bytes``."""
    copy_format: str
    parquet_file: str | None = None
    bundled_with: int = 0
    """How many other tables were copied in the same bundle (:func:`~.copy.copy_bundle`): one
    pair of ``psql`` processes, one snapshot import and one target transaction for all."""


DEFAULT_DRIVER_MAX_ROWS = SPARK_TABLE_ROWS
"""Tables estimated at or below this many rows are copied by the driver, not by Spark: see
:func:`~pgcdc_dagster.engine.snapshot.scheduling.copy_tables` (one threshold with the settings'
:data:`~pgcdc_dagster.engine.settings.SPARK_TABLE_ROWS`)."""


def tables_for_spark(ranges: Sequence[TableRange], driver_max_rows: int) -> set[TableName]:
    """The tables estimated (over all their ranges) above ``driver_max_rows``: Spark's."""
    estimated: dict[TableName, int] = {}
    for rng in ranges:
        estimated[rng.table] = estimated.get(rng.table, 0) + rng.estimated_rows
    return {table for table, rows in estimated.items() if rows > driver_max_rows}


@dataclass(frozen=True)
class TableCopyResult:
    """One table's copy: rows and wire bytes summed over its ranges; ``seconds`` is the sum of
    the task durations (busy time, not wall time: ranges run in parallel)."""

    table: TableName
    rows: int
    bytes: int | None
    """``None`` when the table was copied in a bundle (:attr:`RangeCopyResult.bytes`)."""
    seconds: float | None
    tasks: int = 1
    copy_formats: tuple[str, ...] = ()
    copied_by: str = "spark"
    """``driver`` (a small table, copied by this process), ``spark``, or ``kept`` (copied whole
    by an earlier attempt of a resumed snapshot, :mod:`.resume`)."""
    spark_app: SparkApp | None = None
    """The Spark application whose tasks copied it (``copied_by`` ``spark``)."""
    frozen: bool = False
    """Loaded frozen (see :attr:`CopyTask.freeze`): its rows need no hint bits or freezing."""
    bundled_with: int = 0
    """See :attr:`RangeCopyResult.bundled_with`."""
    kept_rows: int | None = None
    """Of a table a resume continued (:mod:`.continued`): the rows the killed attempt copied
    and this one kept (``rows`` counts only what this one copied)."""


def spark_app_of(tables: Sequence[TableCopyResult]) -> SparkApp | None:
    """The Spark application that copied some of ``tables``, if Spark copied any."""
    return next((t.spark_app for t in tables if t.spark_app is not None), None)


@dataclass(frozen=True)
class SchemaRestoreResult:
    """What a schema section did on the target, by object identity (``pg_identify_object``)."""

    section: str
    created: tuple[str, ...]
    already_present: tuple[str, ...]
    skipped: tuple[str, ...]
    """Objects deliberately not created, with the reason (a foreign key to a missing table)."""
    seconds: float
    tools: str = ""
    """The ``pg_dump`` that wrote the section, with its version and where it was found (see
    :mod:`~pgcdc_dagster.engine.postgres_installs`)."""


@dataclass(frozen=True)
class BaseSnapshotResult:
    slot_name: str
    snapshot_name: str
    consistent_point: Lsn
    origin_name: str
    publication: str
    tables: tuple[TableCopyResult, ...]
    pre_data: SchemaRestoreResult
    post_data: SchemaRestoreResult
    sequences: dict[str, int]
    seconds: float
    copy_seconds: float
    export_path: str | None = None
    shapes: Mapping[TableName, PublishedShape] = field(default_factory=dict)
    """The tables the publication narrows, with what it sends of each: what was copied."""
    not_null_dropped: tuple[str, ...] = ()
    """``table.column``: columns left out by a column list whose ``NOT NULL`` (without a
    default) was dropped on the target, which could otherwise store no row."""
    source_version: str = ""
    target_version: str = ""
    """The servers' releases (``15.20``): a snapshot may cross majors, either way."""
    bulk_load: Mapping[str, str] = field(default_factory=dict)
    """What the load took of what the target allows (:func:`bulk_load_facts`)."""

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables)

    @property
    def keys_seconds(self) -> float:
        """The keys' and indexes' build, after the rows (the post-data section)."""
        return self.post_data.seconds

    @property
    def spark_app(self) -> SparkApp | None:
        return spark_app_of(self.tables)


_BULK_LOAD_SETTINGS = """
SELECT current_setting('wal_level'), current_setting('maintenance_work_mem'),
       current_setting('max_parallel_maintenance_workers')
"""


def bulk_load_facts(
    conn: psycopg.Connection[Any], tables: Sequence[TableCopyResult]
) -> dict[str, str]:
    """How the rows and keys were loaded, against what the target allows; nothing here changes
    a server's configuration.

    * ``copy``: binary ``COPY`` (text for a type without binary I/O), each range in one
      transaction that commits asynchronously (``synchronous_commit = off``, the session's
      own), and how many tables were loaded frozen (created by this snapshot: ``TRUNCATE``
      then ``COPY ... (FREEZE)`` in one transaction, :attr:`CopyTask.freeze`).
    * ``wal``: with ``wal_level = minimal`` PostgreSQL writes no WAL for such a frozen load (the
      file is new in its transaction); above it every row is WAL-logged, as the target's
      standbys and decoding need.
    * ``keys``: the target's own ``maintenance_work_mem`` and
      ``max_parallel_maintenance_workers``, which the key builds use as they stand. Raising
      them changed nothing measurable at pgbench scale 100 (``benchmarks/bulk_load.py``; the
      figures in ``benchmarks/HISTORY.md``), so the snapshot leaves them.
    """
    wal_level, work_mem, workers = conn.execute(_BULK_LOAD_SETTINGS).fetchone()  # type: ignore[misc]
    frozen = sum(1 for t in tables if t.frozen)
    formats = sorted({f for t in tables for f in t.copy_formats}) or ["binary"]
    return {
        "copy": (
            f"{'/'.join(formats)} COPY, synchronous_commit off; {frozen} of {len(tables)} "
            "table(s) loaded frozen"
        ),
        "wal": (
            "none for the tables loaded frozen (wal_level minimal)"
            if wal_level == "minimal"
            else f"every row (wal_level {wal_level})"
        ),
        "keys": (
            f"maintenance_work_mem {work_mem}, max_parallel_maintenance_workers {workers} "
            "(the target's own)"
        ),
    }


def run_tool(argv: Sequence[str], dsn: str, *, role: str, what: str) -> str:
    """Run a libpq tool against ``dsn``; its stdout, or :class:`SnapshotError` with redacted
    stderr."""
    try:
        env, extra = libpq_tool_environment(dsn)
    except ConnectError as exc:
        raise SnapshotError(str(exc)) from None
    done = subprocess.run(
        [*argv, *extra],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        message = redact(done.stderr.strip(), dsn) or f"exit status {done.returncode}"
        raise SnapshotError(f"{what} on the {role} {describe_dsn(dsn)} failed: {message}")
    return done.stdout


def dump_pattern(schema: str, name: str | None = None) -> str:
    """A pg_dump ``-t``/``-n`` pattern matching exactly this name: inside double quotes the
    pattern characters ``* ? .`` and regular-expression characters are literal."""
    parts = [schema] if name is None else [schema, name]
    return ".".join('"' + part.replace('"', '""') + '"' for part in parts)


# ─── snapshot transactions ───────────────────────────────────────────────────────────────────


@contextlib.contextmanager
def snapshot_transaction(
    conn: psycopg.Connection[Any], snapshot_name: str | None
) -> Iterator[psycopg.Connection[Any]]:
    """A REPEATABLE READ READ ONLY transaction that sees ``snapshot_name`` (or, without one, a
    snapshot of its own). ``SET TRANSACTION SNAPSHOT`` must be the transaction's first statement,
    which is why this owns the BEGIN."""
    saved = (conn.isolation_level, conn.read_only)
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.read_only = True
    try:
        with conn.transaction():
            if snapshot_name is not None:
                try:
                    conn.execute(
                        sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name))
                    )
                except (errors.UndefinedObject, errors.InvalidParameterValue) as exc:
                    raise SnapshotError(
                        f"cannot import snapshot {snapshot_name}: "
                        f"{server_message(exc)}: the exporting "
                        "replication connection must stay open and idle until every copy "
                        "connection has imported it; take the base snapshot again"
                    ) from None
            yield conn
    finally:
        if not conn.closed:  # a failed COPY closes its connection (see stream_copy_out)
            conn.isolation_level, conn.read_only = saved


RESOLVE_TABLES = """
SELECT u.schema, u.name, c.oid, c.relkind
FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS u(schema, name, position)
LEFT JOIN pg_namespace n ON n.nspname = u.schema
LEFT JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = u.name
ORDER BY u.position
"""


COLUMNS = """
SELECT a.attrelid, a.attname, format_type(a.atttypid, a.atttypmod),
       coalesce(base.typname, t.typname), t.typlen
FROM pg_attribute a
JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_type base ON base.oid = t.typbasetype  -- a domain is exported as its base type
WHERE a.attrelid = ANY(%s::oid[]) AND a.attnum > 0 AND NOT a.attisdropped
  AND a.attgenerated = ''
ORDER BY a.attrelid, a.attnum
"""


def resolve_oids(
    conn: psycopg.Connection[Any], tables: Sequence[TableName]
) -> dict[TableName, int]:
    rows = conn.execute(
        RESOLVE_TABLES, ([t.schema for t in tables], [t.name for t in tables])
    ).fetchall()
    missing = [str(TableName(s, n)) for s, n, oid, _ in rows if oid is None]
    if missing:
        raise SnapshotError(
            f"table(s) {', '.join(missing)} do not exist on the source: check the table list"
        )
    return {TableName(s, n): int(oid) for s, n, oid, _ in rows}
