"""A big range compacted and staged by this process in bounded memory, partition by partition.

Data flow::

    before the apply's transaction (nothing on the target):
    stored range ──batches──▶ Router (pass 1: moved keys; pass 2: route) ──▶ one Arrow file per
    (Parquet)                 (:mod:`..compaction.partitions`)                (table, partition)
                                                                                   │
    inside it (BEGIN; TRUNCATEs first):                                            │ one at a time
    target table ◀── COPY of new keys' rows ◀┬── compact_table ◀──────────────────┘
    temp staging ◀── COPY of the rest ◀──────┘   (the next partition is read and compacted in
    tables ──▶ the set-based merge, the origin,   a thread while this one is COPYed)
               COMMIT (:mod:`.transaction`)

Why: compacting a range whole holds all of its changes, and several times that while the
kernel sorts and gathers them (``benchmarks/HISTORY.md``, big_transaction): a backfill of tens
of millions of rows would not fit a machine, and a follower the OOM killer ends meets the same
transaction again on restart. Here at most two partitions are in memory (the one compacted and
the one COPYed), each about ``partition_changes`` changes, whatever the range's size; the rest
waits on disk, next to the store. Rows, merge and the origin's advance stay one target
transaction (:func:`~.apply.apply_range`).

What must hold: every change of a key lands in one partition, so each partition's net rows are
the kernel's over the whole range (the routing rules, :mod:`..compaction.partitions`); the range's
TRUNCATEs run before any partition is staged (rows of new keys go straight into the table);
nothing is durable before the COMMIT (temporary tables, the transaction's own rows), so a kill
anywhere leaves the target at the previous range; and the scratch folder is this apply's alone
(the range lock makes it the only apply of the origin): a killed apply's is removed by the next
one's routing, and the files stay until the COMMIT for a retry of the transaction.
"""

from __future__ import annotations

import concurrent.futures
import shutil
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc

from ..compaction import NetChanges, TableRelation, compact_table
from ..compaction.kernel import KERNEL_COLUMNS
from ..compaction.partitions import Router
from ..failpoints import failpoint
from ..identifiers import TableName
from ..store.output_store import CHANGE_SCHEMA, StoredRange
from .shared_staging import (
    SharedStage,
    create_temporary_tables,
    stage_partition,
    summarise,
    summary_rows,
)

SCRATCH = ".apply-scratch"
"""The folder, in the store's root, where a partitioned apply's partitions wait on disk."""
_LEARN_COLUMNS = (
    "commit_end_lsn",
    "action",
    "relation_version",
    "key",
    "new_row",
    "unchanged_toast",
)


@dataclass
class Routed:
    """A range's changes routed into partition files (:func:`route_range`), waiting for the
    apply's transaction to compact and stage them (:func:`stage_routed`)."""

    tables: list[TableName]
    relations: Mapping[TableName, TableRelation]
    parts: int
    files: dict[tuple[int, int], Path]
    truncated: dict[TableName, int]
    """Tables the range truncates (after what the apply skips), with the last TRUNCATE's
    flags: truncated first, before any partition is staged."""
    scratch: Path

    def remove(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def partitions_for(changes: int, partition_changes: int) -> int:
    """How many key-hash partitions a range of ``changes`` is cut into, so that each holds
    about ``partition_changes`` (one: the range is compacted whole, in memory)."""
    return max(1, -(-changes // max(1, partition_changes)))


def route_range(
    stored: StoredRange,
    relations: Mapping[TableName, TableRelation],
    *,
    parts: int,
    after_lsn: int | None = None,
    floors: Mapping[TableName, int] | None = None,
) -> Routed:
    """Route ``stored``'s changes of ``relations`` into ``parts`` key-hash partitions on disk,
    before the apply's transaction (nothing is written on the target)."""
    scratch = stored.store_root / SCRATCH
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        router = Router(relations, parts, after_lsn=after_lsn, floors=floors)
        if _has_updates(stored):
            for batch in stored.iter_batches(_LEARN_COLUMNS):
                router.learn(batch)
        files = _route(stored, router, scratch)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    truncated = {router.tables[t]: flags for t, flags in router.truncated.items()}
    return Routed(router.tables, relations, parts, files, truncated, scratch)


def stage_routed(
    conn: psycopg.Connection[Any], routed: Routed, *, skip: Collection[TableName] = ()
) -> dict[TableName, SharedStage]:
    """Inside the apply's transaction (its TRUNCATEs done): compact every partition of
    ``routed`` alone and stage its net rows in temporary tables, rows of new keys straight into
    the target (:func:`~.shared_staging.stage_partition`), one partition at a time, the next
    read and compacted while this one is COPYed. ``skip``: tables applied otherwise (in commit
    order, after their net rows were refused). The files stay, for a retry of the
    transaction."""
    relations = {t: rel for t, rel in routed.relations.items() if t not in skip}
    tables = routed.tables
    names = create_temporary_tables(conn, relations)
    groups = iter(sorted((g, p) for g, p in routed.files.items() if tables[g[0]] in relations))
    summaries = []

    def compact(group: tuple[tuple[int, int], Path]) -> tuple[int, int, NetChanges]:
        (t, pid), path = group
        return t, pid, compact_table(_read(path), relations[tables[t]])

    with concurrent.futures.ThreadPoolExecutor(1, "pgcdc-compact") as pool:
        ahead = [pool.submit(compact, g) for g in _take(groups, 1)]
        while ahead:
            t, pid, net = ahead.pop(0).result()
            ahead += [pool.submit(compact, g) for g in _take(groups, 1)]
            summaries.append(stage_partition(conn, net, names[tables[t]], t, pid, shared=False))
            del net
            failpoint("apply.staging")
    return summarise(summary_rows(summaries), tables, routed.relations, names)


def _has_updates(stored: StoredRange) -> bool:
    """Whether the range holds any UPDATE (only those can move a key): the action column alone
    is read, a small fraction of the range."""
    return any(
        pc.any(pc.equal(batch.column("action"), "U")).as_py()
        for batch in stored.iter_batches(("action",), batch_rows=1_048_576)
    )


def _route(stored: StoredRange, router: Router, scratch: Path) -> dict[tuple[int, int], Path]:
    """Second pass: every batch's groups appended to their (table, partition) file."""
    schema = pa.schema([CHANGE_SCHEMA.field(name) for name in KERNEL_COLUMNS])
    writers: dict[tuple[int, int], pa.ipc.RecordBatchFileWriter] = {}
    files: dict[tuple[int, int], Path] = {}
    try:
        for batch in stored.iter_batches(KERNEL_COLUMNS):
            for t, pid, rows in router.route(batch):
                writer = writers.get((t, pid))
                if writer is None:
                    path = files[(t, pid)] = scratch / f"{t}-{pid}.arrow"
                    writer = writers[(t, pid)] = pa.ipc.new_file(str(path), schema)
                writer.write_table(rows)
    finally:
        for writer in writers.values():
            writer.close()
    return files


def _read(path: Path) -> pa.Table:
    with pa.OSFile(str(path), "rb") as source:
        return pa.ipc.open_file(source).read_all()


def _take(items: Iterator[Any], count: int) -> list[Any]:
    out = []
    for _ in range(count):
        try:
            out.append(next(items))
        except StopIteration:
            break
    return out
