"""Copy planning and the copy task: tables cut into ctid block ranges, each range streamed
from ``COPY ... TO STDOUT`` in the exported snapshot into ``COPY ... FROM STDIN`` on the
target, in one target transaction."""

from __future__ import annotations

import collections
import math
import os
import re
import select
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import psycopg
from psycopg import errors, pq, sql

from ..catalog import rows_per_block
from ..connect import connect, libpq_tool_environment
from ..errors import server_reason
from ..failpoints import failpoint
from ..identifiers import TableName
from ..postgres_installs import ToolsError, libpq_tool
from ..published_columns import PublishedShape, row_filter_sql
from ..spark.executors import task_log
from .common import (
    COLUMNS,
    DEFAULT_ROWS_PER_TASK,
    CopyTask,
    RangeCopyResult,
    SnapshotError,
    TableRange,
    resolve_oids,
    snapshot_transaction,
)
from .copied_ranges import record_statement
from .export import write_parquet

# ─── planning ─────────────────────────────────────────────────────────────────────────────────

_RELATIONS = """
SELECT u.position, leaf.oid, ln.nspname, leaf.relname, leaf.relkind,
       leaf.relpages, leaf.reltuples, leaf.relfilenode::int8,
       pg_relation_size(leaf.oid) / current_setting('block_size')::bigint,
       current_setting('block_size')::int
FROM unnest(%s::oid[]) WITH ORDINALITY AS u(root, position)
JOIN pg_class root ON root.oid = u.root
CROSS JOIN LATERAL (
    SELECT root.oid WHERE root.relkind <> 'p'
    UNION ALL
    SELECT t.relid FROM pg_partition_tree(root.oid) t WHERE t.isleaf AND root.relkind = 'p'
) AS l(oid)
JOIN pg_class leaf ON leaf.oid = l.oid
JOIN pg_namespace ln ON ln.oid = leaf.relnamespace
ORDER BY u.position, leaf.oid
"""


def plan_table_ranges(
    conn: psycopg.Connection[Any],
    tables: Sequence[TableName],
    snapshot_name: str | None,
    target_rows_per_task: int = DEFAULT_ROWS_PER_TASK,
    shapes: Mapping[TableName, PublishedShape] | None = None,
) -> list[TableRange]:
    """Cut every table into ctid block ranges of about ``target_rows_per_task`` rows each.

    Rows per block come from the planner statistics (``reltuples / relpages``) and, for a table
    never analysed, from the column widths; the block count is the relation's current size.
    Estimates only decide the balance of the tasks, never which rows are copied: the ranges
    tile ``[0, ∞)`` without gap or overlap, so every row visible in the snapshot is copied once.
    A partitioned table is planned leaf by leaf. Generated columns are left out of ``columns``
    (the target computes them). ``shapes``: what the publication sends of the tables it
    narrows (:func:`~..source.publication.published_shapes`): only those columns, and only the rows
    its filter passes (a leaf by its root's filter, as the stream sends them through the root).
    ``conn`` must not be inside a transaction.
    """
    if target_rows_per_task < 1:
        raise ValueError("target_rows_per_task must be at least 1")
    with snapshot_transaction(conn, snapshot_name):
        oids = resolve_oids(conn, tables)
        relations = conn.execute(_RELATIONS, (list(oids.values()),)).fetchall()
        column_rows = conn.execute(COLUMNS, (list(oids.values()),)).fetchall()
    columns: dict[int, list[tuple[str, str, str, int]]] = {}
    for relid, name, type_text, typname, typlen in column_rows:
        columns.setdefault(int(relid), []).append((name, type_text, typname, int(typlen)))
    roots = list(oids.items())
    ranges: list[TableRange] = []
    for row in relations:
        position, _, schema, name, relkind, relpages, reltuples, filenode, blocks, block_size = row
        table, root_oid = roots[int(position) - 1]
        if relkind not in ("r", "m"):
            raise SnapshotError(
                f"{TableName(schema, name)} is a relation of kind {relkind!r}, not a table: "
                "only tables (and partitioned tables) can be copied"
            )
        cols = columns.get(root_oid, [])
        per_block = rows_per_block(reltuples, relpages, block_size, [c[3] for c in cols])
        estimated = int(blocks * per_block)
        pieces = min(int(blocks), math.ceil(estimated / target_rows_per_task))
        source = TableName(schema, name)
        shape = (shapes or {}).get(table)
        column_names = tuple(c[0] for c in cols) if shape is None else shape.columns
        row_filter = None if shape is None else shape.row_filter
        if pieces <= 1:
            ranges.append(
                TableRange(
                    table, source, column_names, None, None, estimated, row_filter, int(filenode)
                )
            )
            continue
        step = math.ceil(blocks / pieces)
        starts = list(range(0, int(blocks), step))
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else None
            span = (end if end is not None else blocks) - start
            ranges.append(
                TableRange(
                    table,
                    source,
                    column_names,
                    start if i else None,
                    end,
                    int(span * per_block),
                    row_filter,
                    int(filenode),
                )
            )
    return ranges


def merge_ranges(ranges: Sequence[TableRange], rows_per_task: int) -> list[TableRange]:
    """Join neighbouring ranges of the same relation until each holds about ``rows_per_task``
    estimated rows: fewer, longer copies when there are fewer workers than ranges.

    Why: every range costs a pair of ``psql`` processes, two backends, a snapshot import and
    the refill of the pipe, so one worker copies a big table faster as one range than as ten
    (see ``benchmarks/HISTORY.md``, "The snapshot's copy: its ranges and the path of its
    rows"). Joining
    ``[a, b)`` and ``[b, c)`` gives ``[a, c)``, so the merged ranges still tile each relation
    without gap or overlap, and the last one stays open-ended.
    """
    merged: list[TableRange] = []
    for rng in ranges:
        last = merged[-1] if merged else None
        if (
            last is not None
            and (last.table, last.source) == (rng.table, rng.source)
            and last.end_block is not None
            and last.end_block == rng.start_block
            and last.estimated_rows < rows_per_task
        ):
            merged[-1] = replace(
                last,
                end_block=rng.end_block,
                estimated_rows=last.estimated_rows + rng.estimated_rows,
            )
        else:
            merged.append(rng)
    return merged


# ─── the copy task (runs on Spark workers) ──────────────────────────────────────────────────


def _select_statement(task: CopyTask, copy_format: str) -> sql.Composed:
    rng = task.range
    columns = sql.SQL(", ").join(sql.Identifier(c) for c in rng.columns)
    conditions: list[sql.Composable] = []
    if rng.start_block is not None:
        conditions.append(sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({rng.start_block},0)")))
    if rng.end_block is not None:
        conditions.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({rng.end_block},0)")))
    if rng.row_filter is not None:  # the server's own text of the publication's filter
        conditions.append(row_filter_sql(rng.row_filter))
    where = sql.SQL(" WHERE ") + sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("")
    return sql.SQL("COPY (SELECT {} FROM ONLY {}{}) TO STDOUT (FORMAT {})").format(
        columns, rng.source.sql, where, sql.SQL(copy_format)
    )


def _insert_statement(task: CopyTask, copy_format: str) -> sql.Composed:
    rng = task.range
    return sql.SQL("COPY {} ({}) FROM STDIN (FORMAT {}{})").format(
        rng.table.sql,
        sql.SQL(", ").join(sql.Identifier(c) for c in rng.columns),
        sql.SQL(copy_format),
        sql.SQL(", FREEZE" if task.freeze else ""),
    )


def _target_preamble(task: CopyTask) -> list[sql.Composed]:
    """What the target's transaction runs before its COPY: for a frozen load, the truncate
    that lets ``COPY ... (FREEZE)`` mark the rows frozen (see :attr:`CopyTask.freeze`)."""
    if not task.freeze:
        return []
    return [sql.SQL("TRUNCATE ONLY {}").format(task.range.table.sql)]


def _target_postamble(task: CopyTask, *, counted: bool = True) -> list[sql.Composed]:
    """What the target's transaction runs after its COPY, before the commit: a base snapshot's
    record of the range (:mod:`.copied_ranges`), one fact with its rows (counted: see
    :func:`~.copied_ranges.record_statement`)."""
    if task.record is None:
        return []
    return [record_statement(task.record, task.range, counted=counted)]


COPY_BATCH_BYTES = 128 * 1024
"""How much COPY data is gathered before one write to the target: PostgreSQL sends one message
per row, and handing each to the target separately costs more than the copy itself."""


def stream_copy_out(
    conn: psycopg.Connection[Any], statement: sql.Composed, sink: Callable[[bytearray], None]
) -> int:
    """Run a ``COPY ... TO STDOUT`` and hand its data to ``sink`` in batches of about
    :data:`COPY_BATCH_BYTES`; returns the row count the server reports.

    This talks to libpq directly: psycopg's ``Copy`` reads one row message per Python-level
    call, much slower than ``psql | psql``; with ``PQgetCopyData`` on what libpq has buffered
    and batched writes it is on par (see ``benchmarks/HISTORY.md``, "The snapshot's copy: its
    ranges and the path of its rows"). It never blocks inside libpq: psycopg's wrappers hold
    Python's GIL through a call, so a blocking read would stop every other thread of the
    process for as long as the server takes to send something (a scan that finds few rows:
    a recovery's parts, a filtered range). It waits on the socket instead, without the GIL.
    If anything fails mid-stream the connection is closed, since it is stuck in COPY state
    and holds nothing worth keeping.
    """
    pgconn = conn.pgconn
    pgconn.send_query(statement.as_bytes(conn))
    first = _next_result(pgconn)
    if first is None or first.status != pq.ExecStatus.COPY_OUT:
        while _next_result(pgconn) is not None:
            pass
        if first is not None and first.status == pq.ExecStatus.FATAL_ERROR:
            raise errors.error_from_result(first, encoding=conn.info.encoding)
        raise SnapshotError(f"COPY TO STDOUT did not start a copy: {statement.as_string(conn)}")
    try:
        batch = bytearray()
        while True:
            size, data = pgconn.get_copy_data(1)  # what is buffered, never waiting
            if size == 0:
                _readable(pgconn)
                pgconn.consume_input()
                continue
            if size < 0:
                break
            batch += data
            if len(batch) >= COPY_BATCH_BYTES:
                sink(batch)
                batch = bytearray()
        if batch:
            sink(batch)
    except BaseException:
        conn.close()
        raise
    rows = 0
    while (result := _next_result(pgconn)) is not None:
        if result.status != pq.ExecStatus.COMMAND_OK:
            raise errors.error_from_result(result, encoding=conn.info.encoding)
        rows = int(result.command_tuples or 0)
    return rows


def _readable(pgconn: Any) -> None:
    """Wait until the server has sent something, with the GIL released (``select``)."""
    select.select([pgconn.socket], [], [])


def _next_result(pgconn: Any) -> Any:
    """``PQgetResult`` once it would not block (see :func:`stream_copy_out`)."""
    pgconn.consume_input()
    while pgconn.is_busy():
        _readable(pgconn)
        pgconn.consume_input()
    return pgconn.get_result()


def _copy_once(task: CopyTask, copy_format: str) -> tuple[int, int, list[bytearray]]:
    """One attempt at a range: the source's COPY data goes to the target unparsed.

    Both sessions speak UTF8 (as every session does, :data:`~..connect.CLIENT_ENCODING`), so
    text values cross unchanged whatever the two databases' encodings. The target session
    commits asynchronously: a crash loses the range, and a crash mid-snapshot means a new
    snapshot anyway.
    """
    kept: list[bytearray] = []
    nbytes = 0
    with (
        connect(task.source_dsn, role="source") as src,
        connect(task.target_dsn, role="target") as tgt,
    ):
        tgt.execute("SET synchronous_commit = off")
        for statement in _target_preamble(task):
            tgt.execute(statement)
        with (
            snapshot_transaction(src, task.snapshot_name),
            tgt.cursor().copy(_insert_statement(task, copy_format)) as inp,
        ):

            def forward(batch: bytearray) -> None:
                nonlocal nbytes
                inp.write(batch)
                nbytes += len(batch)
                if task.export_dir is not None:
                    kept.append(batch)

            rows = stream_copy_out(src, _select_statement(task, copy_format), forward)
        for statement in _target_postamble(task):
            tgt.execute(statement)
        tgt.commit()
    return rows, nbytes, kept


def _psql() -> str | None:
    try:
        return libpq_tool("psql")
    except ToolsError:
        return None


def piped_copy_available() -> bool:
    """Whether :func:`copy_range` copies through ``psql`` here (see :func:`_copy_piped`)."""
    return _psql() is not None


def _ending_with_this_process() -> list[str]:
    """A prefix that makes a command die (SIGKILL) when the thread that started it ends, so a
    killed ``pgcdc`` leaves no copy running; empty without ``setpriv`` (util-linux), when an
    orphaned pair runs to the end of its range and then rolls back (see :func:`_copy_piped`)."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


def _bytes_written(process: subprocess.Popen[bytes]) -> int:
    """What ``process`` wrote (``wchar`` of ``/proc/<pid>/io``): waits for it to exit and reads
    that before it is reaped; 0 where that cannot be read."""
    try:
        os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOWAIT)
        with open(f"/proc/{process.pid}/io") as io:
            fields = dict(line.split(": ", 1) for line in io.read().splitlines())
        return int(fields.get("wchar", 0))
    except (OSError, ValueError, ChildProcessError):
        return 0


def _copy_piped(task: CopyTask, copy_format: str) -> tuple[int, int] | None:
    """One attempt at a range through two ``psql`` processes (:func:`_run_pair`). Returns
    ``(rows, bytes)``, or ``None`` when it cannot be used (no ``psql``) or failed: the caller
    then copies through libpq in this process, which also classifies any error.

    Why no byte goes through this process: the libpq path calls into Python once per row
    (``PQgetCopyData`` returns one row), far more CPU than ``psql | psql``; and a relay
    through a thread of this process waits for the GIL on every read and write whenever
    another thread computes (the command loads Dagster while the head start copies), which
    slows a copy many times over. The figures: ``benchmarks/HISTORY.md``, "The snapshot's copy:
    its ranges and the path of its rows".
    """
    copied = _run_pair(
        [_select_statement(task, copy_format)],
        [*_target_preamble(task), _insert_statement(task, copy_format), *_target_postamble(task)],
        task,
    )
    if copied is None:
        return None
    counts, nbytes = copied
    if not counts:  # committed, so no second attempt: that would copy the range twice
        raise SnapshotError(f"psql copied into {task.range.table} without reporting a row count")
    return counts[-1], nbytes


def _run_pair(
    source_steps: Sequence[sql.Composable | str],
    target_steps: Sequence[sql.Composable | str],
    task: CopyTask,
) -> tuple[list[int], int] | None:
    """Run ``source_steps`` in the exported snapshot (``task``'s) on the source, its standard
    output piped into ``target_steps`` on the target, in one transaction that commits only when
    this process says so. Returns the row counts of the target's COPYs in order and the bytes
    the source side wrote (the COPY data plus its statements, under a KiB), or ``None`` when
    ``psql`` is absent or either side failed (nothing was committed then).

    What must hold: nothing is committed on the target unless the source side sent all its
    data. A ``COPY FROM STDIN`` that reaches the end of its input takes what it got, so the
    target side runs ``BEGIN`` and its steps, then reads its next commands from a pipe of this
    process, which writes ``COMMIT`` there only after the source side exited cleanly; otherwise
    the pipe closes empty and the target side disconnects with its transaction open (the
    server rolls it back). If this process dies, the command pipe ends the same way; with
    ``setpriv`` both sides are also killed at once. SIGKILL tests check each: the source side
    killed mid-stream, this process killed with and without ``setpriv``.
    """
    psql = _psql()
    if psql is None:
        return None
    source_env, source_args = libpq_tool_environment(task.source_dsn)
    target_env, target_args = libpq_tool_environment(task.target_dsn)

    def text(step: sql.Composable | str) -> str:
        return step if isinstance(step, str) else step.as_string(None)

    steps = ["BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY"]
    if task.snapshot_name is not None:
        steps.append(
            sql.SQL("SET TRANSACTION SNAPSHOT {}")
            .format(sql.Literal(task.snapshot_name))
            .as_string(None)
        )
    steps += [*(text(step) for step in source_steps), "COMMIT"]
    base = [*_ending_with_this_process(), psql, "-X", "-v", "ON_ERROR_STOP=1"]
    source = subprocess.Popen(
        [*base, "-q", *source_args, *(arg for step in steps for arg in ("-c", step))],
        env={**os.environ, **source_env},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert source.stdout is not None
    commands, decide = os.pipe()
    try:
        target = subprocess.Popen(
            [*base, *target_args, "-c", "SET synchronous_commit = off", "-c", "BEGIN",
             *(arg for step in target_steps for arg in ("-c", text(step))),
             "-f", f"/dev/fd/{commands}"],
            env={**os.environ, **target_env},
            stdin=source.stdout,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            pass_fds=(commands,),
        )  # fmt: skip
    except BaseException:
        os.close(decide)
        source.kill()
        source.wait()
        raise
    finally:
        os.close(commands)
        source.stdout.close()  # the target side holds it now
    try:
        nbytes = _bytes_written(source)  # waits for the source side to exit, unreaped
        source_ok = source.wait() == 0
        if source_ok:
            failpoint("copy.before_commit")
            os.write(decide, b"COMMIT;\n")
    except OSError:  # BrokenPipeError included: the target side ended early
        source_ok = False
    finally:
        os.close(decide)
    # Both sides have ended here: the target's commands end with COMMIT or without it.
    out = target.communicate()[0].decode(errors="replace")
    if not source_ok or target.returncode != 0:
        return None
    return [int(n) for n in re.findall(r"^COPY (\d+)$", out, re.MULTILINE)], nbytes


# ─── bundles: many small tables through one pair ─────────────────────────────────────────────

BUNDLE_MAX_ROWS = 20_000
"""A whole table estimated at or below this many rows is copied in a bundle with others
(:func:`copy_bundle`), not by a pair of ``psql`` processes of its own."""
BUNDLE_ROWS = 200_000
"""At most about this many estimated rows in one bundle..."""
BUNDLE_TABLES = 100
"""...and at most this many tables (each is two arguments on each side's command line)..."""
BUNDLE_COMMAND_CHARS = 256 * 1024
"""...whose column lists take at most about this many characters: the statements are the
``psql`` processes' arguments, which the kernel bounds (``ARG_MAX``, often 2 MiB in all)."""

_END_OF_DATA = "\\echo '\\\\.'"
"""The source side's line between two tables' data: ``\\.``, where text-format ``COPY FROM
STDIN`` in ``psql`` stops reading (a data line never is that: COPY escapes a backslash)."""


def bundle_tasks(tasks: Sequence[CopyTask]) -> tuple[list[list[CopyTask]], list[CopyTask]]:
    """The tasks to copy in bundles (whole tables of at most :data:`BUNDLE_MAX_ROWS` estimated
    rows, not exported: an export tees each range's own data), grouped, and the others. Fewer
    than two such tasks make no bundle.

    A bundled table is not loaded frozen (:attr:`~.common.CopyTask.freeze`): the truncate that
    freezing needs costs a new file per table, and a small table gains nothing measurable from
    it: bundles of small tables loaded frozen are slower (see ``benchmarks/HISTORY.md``,
    "The snapshot's small tables in bundles")."""
    small = [
        t
        for t in tasks
        if t.export_dir is None
        and t.range.start_block is None
        and t.range.end_block is None
        and t.range.estimated_rows <= BUNDLE_MAX_ROWS
    ]
    if len(small) < 2:
        return [], list(tasks)
    chosen = set(map(id, small))
    bundles: list[list[CopyTask]] = [[]]
    rows = chars = 0
    for task in small:
        width = len(str(task.range.table)) + sum(len(c) + 4 for c in task.range.columns)
        if bundles[-1] and (
            len(bundles[-1]) >= BUNDLE_TABLES
            or rows + task.range.estimated_rows > BUNDLE_ROWS
            or chars + width > BUNDLE_COMMAND_CHARS
        ):
            bundles.append([])
            rows = chars = 0
        bundles[-1].append(replace(task, freeze=False))
        rows += task.range.estimated_rows
        chars += width
    return bundles, [t for t in tasks if id(t) not in chosen]


def _copy_bundle_piped(tasks: Sequence[CopyTask]) -> list[int] | None:
    """The bundle through one pair (:func:`_run_pair`): each table's row count, or ``None``
    when it could not be used or failed (nothing of it committed)."""
    source_steps: list[sql.Composable | str] = []
    target_steps: list[sql.Composable | str] = []
    written = collections.Counter(task.range.table for task in tasks)
    for task in tasks:
        source_steps += [_select_statement(task, "text"), _END_OF_DATA]
        target_steps += [
            *_target_preamble(task),
            _insert_statement(task, "text"),
            *_target_postamble(task, counted=written[task.range.table] == 1),
        ]
    copied = _run_pair(source_steps, target_steps, tasks[0])
    if copied is None:
        return None
    counts, _ = copied
    if len(counts) != len(tasks):  # committed: copying again would duplicate the rows
        raise SnapshotError(
            f"psql copied {len(tasks)} tables in one bundle but reported {len(counts)} row "
            f"counts (from {tasks[0].range.table})"
        )
    return counts


def copy_bundle(tasks: Sequence[CopyTask]) -> list[RangeCopyResult]:
    """Copy the whole tables of ``tasks`` (one snapshot, one target and one source) through one
    pair of ``psql`` processes, in one target transaction: their data in text format, one table
    after the other, each ended by :data:`_END_OF_DATA`.

    Why: a pair of its own costs a table two ``psql`` processes, two server connections and a
    snapshot import, as much as the whole copy of a small table, so a pair per table makes a
    snapshot of hundreds of small tables slower than native logical replication's initial
    sync (see ``benchmarks/HISTORY.md``, ``benchmarks/many_tables.py``).

    Rows are counted per table (each COPY's own count); bytes and seconds are not, since one
    stream carries all its tables (:attr:`RangeCopyResult.bytes`). Without ``psql``,
    or if the bundle fails (nothing of it is committed then), each table is copied on its own,
    which also names the table an error belongs to."""
    counts = _copy_bundle_piped(tasks)
    if counts is None:
        return [copy_range(task) for task in tasks]
    return [
        RangeCopyResult(
            table=task.range.table,
            start_block=None,
            rows=rows,
            bytes=None,
            seconds=None,
            copy_format="text",
            bundled_with=len(tasks) - 1,
        )
        for task, rows in zip(tasks, counts, strict=True)
    ]


BINARY_MISMATCH = (
    errors.UndefinedFunction,  # no binary send/receive function for a type
    errors.InvalidBinaryRepresentation,  # the target reads fewer bytes than were sent
    errors.ProtocolViolation,  # ... or more ("insufficient data left in message")
)
"""What a binary ``COPY`` between two servers fails with when a type's binary form does not
cross (the copy then starts over in text format)."""


def copy_range(task: CopyTask) -> RangeCopyResult:
    """Copy one range in one target transaction; the function every Spark task runs.

    Binary COPY is tried first (no text conversion on either side); a type without binary
    input/output functions, or whose binary form the target reads differently, makes the range
    start over in text format. Nothing is committed on the target unless the whole range is.
    """
    started = time.perf_counter()
    if task.export_dir is not None:
        attempts: tuple[str, ...] = ("csv",)
    elif task.copy_format == "binary":
        attempts = ("binary", "text")
    else:
        attempts = (task.copy_format,)
    rows, nbytes, used = 0, 0, attempts[-1]
    kept: list[bytearray] = []
    piped = _copy_piped(task, attempts[0]) if task.export_dir is None else None
    if piped is not None:
        (rows, nbytes), used, attempts = piped, attempts[0], ()
    for attempt, copy_format in enumerate(attempts):
        try:
            rows, nbytes, kept = _copy_once(task, copy_format)
            used = copy_format
            break
        except BINARY_MISMATCH as exc:
            if attempt + 1 == len(attempts):
                raise _range_error(task, exc) from None
        except psycopg.Error as exc:
            raise _range_error(task, exc) from None
    parquet_file = None
    if task.export_dir is not None:
        parquet_file = write_parquet(task, kept)
    seconds = time.perf_counter() - started
    task_log(
        f"copied {rows:,} rows, {nbytes:,} bytes of {task.range.table} (blocks "
        f"{task.range.start_block or 0} to "
        f"{'the end' if task.range.end_block is None else task.range.end_block}) "
        f"in {seconds:.2f} s"
    )
    return RangeCopyResult(
        table=task.range.table,
        start_block=task.range.start_block,
        rows=rows,
        bytes=nbytes,
        seconds=seconds,
        copy_format=used,
        parquet_file=parquet_file,
    )


def _range_error(task: CopyTask, exc: psycopg.Error) -> SnapshotError:
    rng = task.range
    return SnapshotError(
        f"copying {rng.source} into {rng.table} (blocks {rng.start_block or 0} to "
        f"{'the end' if rng.end_block is None else rng.end_block}) failed: "
        f"{server_reason(exc)}"
    )
