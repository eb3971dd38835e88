"""Repairing the chunks an online verify found different (:func:`~.verify.compare_online`):
each made equal to the source without copying the rest of its table, while the replication
goes on around it.

Why it is exactly once:

1. The repair takes a consistent pair at a new point ``C2`` and keeps the range until it ends
   (:func:`~.consistent_pair.consistent_pair` with ``hold_range``). No apply runs meanwhile, so
   the target stands at ``C2``: every transaction committed before ``C2`` is applied, none
   after it, and its origin says so. The source snapshot at ``C2`` holds the same
   transactions.
2. Each differing chunk is replaced in one target transaction of its own (as many at once as
   the machine has cores; the chunks are disjoint key ranges): its rows deleted,
   then the source's rows of that chunk as of ``C2`` copied in, written as the apply writes
   (``session_replication_role = replica``: no triggers, no foreign-key checks). The chunk
   then holds what a replica at ``C2`` holds. The origin is not moved: it says ``C2`` already.
3. The range is released, and the follow (or the next catch-up) applies the transactions
   committed after ``C2``, from the slot, as it would have anyway: none is in the copy (the
   snapshot predates them), and none was applied before (the target stood at ``C2``), so each
   lands once. Those before ``C2`` are in the copy and in the rest of the target, and nothing
   applies them again (the origin is past them).

Crash anywhere: a chunk's transaction commits whole or not at all, so a chunk not replaced
still differs, and the next verify finds it and the next repair replaces it; the temporary slot
and the snapshots go with their sessions.

A table where at least :data:`WHOLE_TABLE_SHARE` of the chunks differ is replaced whole
instead, in one transaction (``TRUNCATE``, its indexes set aside, the source's rows at ``C2``
copied in, its indexes built again: :mod:`..apply.indexes_aside`): the same argument with the
whole table as the chunk. Why: a chunk's rows are deleted through the
key's index and copied into a table whose dead rows and index keep growing, so past that share
the whole table is the cheaper repair (``benchmarks/recover.py``, spread changes). A table
another table's foreign key references is always repaired by chunks (``TRUNCATE`` refuses it);
readers of a table replaced whole wait for its transaction (``TRUNCATE`` takes its lock), where
a chunk holds only its own rows.

What it costs: the follow stands still while the chunks copy, each of about
:data:`~.verify.DEFAULT_CHUNK_ROWS` rows. Holding back each chunk's changes in every apply
instead (copying without the range, as an added table is) would not pause the follow; it is
not built.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from psycopg import sql

from ..apply.indexes_aside import build_again, set_aside
from ..connect import connect
from ..failpoints import failpoint
from ..identifiers import TableName
from ..lsn import Lsn
from ..progress import SnapshotProgress, active, publish
from ..published_columns import row_filter_sql
from ..settings import ReplicationSettings
from ..snapshot.common import snapshot_transaction
from ..snapshot.copy import BINARY_MISMATCH, stream_copy_out
from .chunks import ChunkPlan, chunk_filter, rows_of
from .consistent_pair import consistent_pair
from .verify import COMPARABLE_SESSION, ChunkDifference, TableComparison


@dataclass(frozen=True)
class RepairedChunk:
    table: TableName
    where: str
    deleted: int
    """Rows of the chunk the target held."""
    copied: int
    """Rows of the chunk the source holds at the repair's point, copied in their place."""
    chunks: int = 1
    """How many differing chunks this stands for: more than one for a table replaced whole."""


@dataclass(frozen=True)
class RepairResult:
    point: Lsn
    """``C2``: the point the chunks were copied at."""
    chunks: tuple[RepairedChunk, ...]
    seconds: float
    made_way_by: str | None


_GENERATED = """
SELECT a.attname FROM pg_attribute a
WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated <> ''
"""


def generated_columns(conn: Any, table: TableName) -> set[str]:
    """``table``'s generated columns on ``conn``'s side: a copy into it must leave them out."""
    return {str(r[0]) for r in conn.execute(_GENERATED, (table.sql.as_string(conn),))}


def repair_chunks(
    settings: ReplicationSettings,
    found: Sequence[TableComparison],
    holder: str,
    *,
    wait_s: float = 120.0,
    spark: Any = None,
) -> RepairResult:
    """Replace, on the target, every differing chunk of ``found`` (a :func:`compare_online`'s
    comparisons) with the source's rows of it (see the module docstring). A table missing on the
    target is not repaired here (``pgcdc add-table`` copies it)."""
    started = time.monotonic()
    todo = [
        (comparison, difference)
        for comparison in found
        if comparison.plan is not None and comparison.missing_on is None
        for difference in comparison.differing
    ]
    with consistent_pair(settings, holder, wait_s=wait_s, spark=spark, hold_range=True) as pair:
        repaired = replace_chunks(settings, pair.source_snapshot, todo)
    return RepairResult(pair.point, tuple(repaired), time.monotonic() - started, pair.made_way_by)


WHOLE_TABLE_SHARE = 0.5
"""A table with at least this share of its chunks differing is replaced whole (see the module
docstring). A chunk's rows are deleted through the key's index and the new ones go into a
table whose dead rows and index grow, so the whole table is the cheaper repair from about half
of its chunks on (``benchmarks/recover.py``; ``benchmarks/HISTORY.md``, "The repair: chunks or
the whole table"); below that the chunks' path, which locks only the chunk, is kept."""

_REFERENCED = """
SELECT EXISTS (
    SELECT FROM pg_constraint
    WHERE contype = 'f' AND confrelid IN (
        SELECT %(table)s::regclass UNION ALL SELECT relid FROM pg_partition_tree(%(table)s)
    )
)
"""
"""Whether a foreign key references the table or one of its partitions (``TRUNCATE`` refuses
either; ``pg_partition_tree`` lists nothing for a table that is not partitioned)."""

Job = tuple[TableComparison, ChunkDifference | None]
"""A chunk to replace, or (``None``) the whole table."""


def _jobs(
    settings: ReplicationSettings,
    todo: Sequence[tuple[TableComparison, ChunkDifference]],
    differing: Counter[TableName],
) -> list[Job]:
    """``todo`` with every table that qualifies (:data:`WHOLE_TABLE_SHARE` of its chunks in
    ``differing``, more than one, and no foreign key references it) as one job of its own, in
    place of its chunks."""
    chunks = {comparison.table: comparison.chunks for comparison, _ in todo}
    candidates = [
        table
        for table, count in differing.items()
        if count >= 2 and count >= WHOLE_TABLE_SHARE * chunks[table]
    ]
    whole: set[TableName] = set()
    if candidates:
        with connect(settings.target_dsn, role="target", autocommit=True) as tgt:
            for table in candidates:
                row = tgt.execute(_REFERENCED, {"table": table.sql.as_string(tgt)}).fetchone()
                if row is not None and not row[0]:
                    whole.add(table)
    jobs: list[Job] = []
    placed: set[TableName] = set()
    for comparison, difference in todo:
        if comparison.table not in whole:
            jobs.append((comparison, difference))
        elif comparison.table not in placed:
            placed.add(comparison.table)
            jobs.append((comparison, None))
    return jobs


def replace_chunks(
    settings: ReplicationSettings,
    source_snapshot: str,
    todo: Sequence[tuple[TableComparison, ChunkDifference]],
    *,
    workers: int | None = None,
    replaced: Callable[[int, RepairedChunk], None] | None = None,
    work: str = "verify",
) -> list[RepairedChunk]:
    """Replace each chunk of ``todo`` (:func:`replace_chunk`), or a table whole where most of
    it differs (:data:`WHOLE_TABLE_SHARE`), on ``workers`` threads (default: the CPU count):
    chunks are disjoint key ranges, each replaced in a transaction of its own, so they need no
    order, and one chunk's copy is one core's work on each side. ``replaced`` is told each one
    as it is done, with how many are (in this thread); a table replaced whole is one, its
    ``where`` saying so. Progress (chunks replaced, rows copied, the time left) is published
    as ``work``'s ``repair`` phase as each one ends (:class:`_RepairProgress`)."""

    def one(job: Job) -> RepairedChunk:
        comparison, difference = job
        assert comparison.plan is not None
        chunk = None if difference is None else difference.chunk
        deleted, copied = replace_chunk(settings, source_snapshot, comparison.plan, chunk)
        if difference is None:
            count = differing[comparison.table]
            where = f"the whole table ({count} of {comparison.chunks} chunks differed)"
            return RepairedChunk(comparison.table, where, deleted, copied, count)
        return RepairedChunk(comparison.table, difference.where, deleted, copied)

    differing = Counter(comparison.table for comparison, _ in todo)
    jobs = _jobs(settings, todo, differing) if todo else []
    done: list[RepairedChunk] = []
    progress = _RepairProgress(work, len(todo), [str(c.table) for c, d in jobs if d is None])
    count = max(1, min(len(jobs), workers or os.cpu_count() or 1))
    with ThreadPoolExecutor(count, thread_name_prefix="pgcdc-repair") as pool:
        for chunk in pool.map(one, jobs):
            done.append(chunk)
            progress.add(chunk)
            if replaced is not None:
                replaced(len(done), chunk)
    return done


class _RepairProgress:
    """How far a repair is, published as each chunk ends: ``replaced 12/102 chunk(s),
    1,180,000 row(s) copied, ETA 14 s``, naming the tables still being replaced whole (one
    step each, however long its copy). Running totals: a big table has many chunks."""

    def __init__(self, work: str, chunks: int, whole: list[str]) -> None:
        self.work, self.chunks, self.whole = work, chunks, whole
        self.started = time.monotonic()
        self.replaced = self.rows = 0
        self._publish()

    def add(self, chunk: RepairedChunk) -> None:
        self.replaced += chunk.chunks
        self.rows += chunk.copied
        if chunk.chunks > 1:  # a table replaced whole
            self.whole.remove(str(chunk.table))
        self._publish()

    def _publish(self) -> None:
        if not active():
            return
        elapsed = time.monotonic() - self.started
        note = f"replaced {self.replaced}/{self.chunks} chunk(s), {self.rows:,} row(s) copied"
        if 0 < self.replaced < self.chunks:
            note += f", ETA {elapsed / self.replaced * (self.chunks - self.replaced):,.0f} s"
        if self.whole:
            note += f"; replacing whole: {', '.join(self.whole)}"
        publish(SnapshotProgress("repair", elapsed, note=note, work=self.work))


def replace_chunk(
    settings: ReplicationSettings, source_snapshot: str, plan: ChunkPlan, chunk: Any
) -> tuple[int, int]:
    """One chunk (``None``: the whole table), in one target transaction: its rows deleted (the
    whole table truncated), the source's copied in. In binary format, or in text where a
    type's binary form does not cross (the chunk's transaction is then rolled back and done
    again)."""
    try:
        return _replace_once(settings, source_snapshot, plan, chunk, "binary")
    except BINARY_MISMATCH:
        return _replace_once(settings, source_snapshot, plan, chunk, "text")


def _replace_once(
    settings: ReplicationSettings,
    source_snapshot: str,
    plan: ChunkPlan,
    chunk: Any,
    copy_format: str,
) -> tuple[int, int]:
    where = sql.SQL("true") if chunk is None else chunk_filter(plan, chunk)
    with (
        connect(settings.source_dsn, role="source", autocommit=True) as src,
        connect(settings.target_dsn, role="target") as tgt,
    ):
        src.execute(COMPARABLE_SESSION)
        generated = generated_columns(tgt, plan.table)
        tgt.execute(COMPARABLE_SESSION)
        tgt.execute("SET LOCAL session_replication_role = replica")
        columns = sql.SQL(", ").join(sql.Identifier(c) for c in plan.columns if c not in generated)
        aside = None
        if chunk is None:
            deleted = _truncated(tgt, plan.table)
            aside = set_aside(tgt, plan.table)
        else:
            deleted = tgt.execute(
                sql.SQL("DELETE FROM {} WHERE {}").format(rows_of(tgt, plan.table), where)
            ).rowcount
        source_where = (
            where
            if plan.row_filter is None
            else sql.SQL("{} AND {}").format(where, row_filter_sql(plan.row_filter))
        )
        options = sql.SQL(" (FORMAT {})").format(sql.SQL(copy_format))
        select = sql.SQL("COPY (SELECT {} FROM {} WHERE {}) TO STDOUT{}").format(
            columns, rows_of(src, plan.table), source_where, options
        )
        with (
            snapshot_transaction(src, source_snapshot),
            tgt.cursor().copy(
                sql.SQL("COPY {} ({}) FROM STDIN{}").format(plan.table.sql, columns, options)
            ) as into,
        ):
            copied = stream_copy_out(src, select, into.write)
        if aside is not None:
            build_again(tgt, aside)
        failpoint("repair.in_transaction")
        tgt.commit()
    return max(deleted, 0), copied


def _truncated(tgt: Any, table: TableName) -> int:
    """Empty ``table`` in ``tgt``'s transaction, as :func:`~.chunks.rows_of` reads it (its
    partitions too, never an inheritance child: that is a replicated table of its own); returns
    the rows it held, counted under the truncate's lock (a read of the table, a small part of
    copying it)."""
    rows = rows_of(tgt, table)
    tgt.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(rows))
    row = tgt.execute(sql.SQL("SELECT count(*) FROM {}").format(rows)).fetchone()
    tgt.execute(sql.SQL("TRUNCATE {}").format(rows))
    return int(row[0]) if row is not None else 0


def repaired_tables(chunks: Sequence[RepairedChunk]) -> list[TableName]:
    """The tables of the chunks a repair (or a recovery) replaced, each once, in order."""
    return list(dict.fromkeys(chunk.table for chunk in chunks))
