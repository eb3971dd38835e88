"""Verification: is every target table equal to its source table?

Per table, the row count and the md5 of the sorted per-row md5s, computed by each server over
the source's columns, in sessions that print values the same way (UTC, ISO dates, full float
digits, hex bytea), over each row's text in UTF-8 whatever the database's encoding (``md5`` of
text hashes the database's bytes: a LATIN1 target equal to its UTF-8 source hashed differently).
Duplicates count, row order does not.

Two ways: :func:`compare_tables` reads each side as it stands, meaningful at a quiescent endpos
the target has reached (the cutover); :func:`compare_online` (``pgcdc verify``) compares a
source and a target snapshot taken at one consistent point while the replication goes on
(:mod:`.consistent_pair`), chunk by chunk (:mod:`.chunks`), and names the differing chunks and
keys.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from ..catalog import table_columns
from ..connect import connect
from ..identifiers import TableName
from ..lsn import Lsn
from ..progress import SnapshotProgress, TableProgress, active, publish
from ..published_columns import published_shapes, row_filter_sql
from ..settings import ReplicationSettings
from ..snapshot.common import snapshot_transaction
from .chunks import (
    ChunkPlan,
    KeyDifference,
    ScanPart,
    Sums,
    add_sums,
    chunk_sums,
    differing_chunks,
    differing_keys,
    digest,
    plan_chunks,
    rows_of,
    same_text_hash,
    scan_parts,
)
from .consistent_pair import ConsistentPair, consistent_pair


@dataclass(frozen=True)
class ChunkDifference:
    """One chunk that differs (see :mod:`.chunks`): where it lies, its rows on each side, and
    up to :data:`KEYS_LISTED` of its keys whose rows differ."""

    where: str
    source_rows: int
    target_rows: int
    keys: tuple[KeyDifference, ...] = ()
    chunk: Any = None
    """The chunk's id in its table's :class:`~.chunks.ChunkPlan` (what a repair replaces)."""


@dataclass(frozen=True)
class TableComparison:
    table: TableName
    source_rows: int
    target_rows: int
    source_hash: str
    target_hash: str
    missing_on: str | None = None
    """``target`` when the table does not exist there (a table the publication sends that
    was never copied: added to it after the base snapshot)."""
    chunks: int = 1
    """How many chunks were compared (:func:`compare_online`)."""
    differing: tuple[ChunkDifference, ...] = ()
    """The chunks that differ (:func:`compare_online`)."""
    plan: ChunkPlan | None = field(default=None, compare=False, repr=False)
    """How the table was cut (:func:`compare_online`)."""

    @property
    def equal(self) -> bool:
        return (
            self.missing_on is None
            and self.source_rows == self.target_rows
            and self.source_hash == self.target_hash
        )


COMPARABLE_SESSION = (
    "SET TimeZone = 'UTC'; SET DateStyle = 'ISO, YMD'; SET IntervalStyle = 'postgres'; "
    "SET extra_float_digits = 3; SET bytea_output = 'hex'"
)


def _table_fingerprint(
    conn: psycopg.Connection[Any],
    table: TableName,
    columns: list[str],
    row_filter: str | None = None,
) -> tuple[int, str]:
    """Row count and the md5 of the sorted per-row md5s: duplicates count, order does not.
    ``row_filter``: only the rows the publication's filter passes."""
    row = sql.SQL("ROW({})").format(sql.SQL(", ").join(sql.Identifier(c) for c in columns))
    where = sql.SQL("") if row_filter is None else sql.SQL(" WHERE ") + row_filter_sql(row_filter)
    query = sql.SQL(
        "SELECT count(*), coalesce(md5(string_agg(h, '' ORDER BY h COLLATE \"C\")), '') "
        "FROM (SELECT md5(convert_to({row}::text, 'UTF8')) AS h FROM {table}{where}) rows"
    ).format(row=row, table=table.sql, where=where)
    count, digest = conn.execute(query).fetchone()  # type: ignore[misc]
    return int(count), str(digest)


def compare_tables(
    settings: ReplicationSettings, tables: Sequence[TableName]
) -> list[TableComparison]:
    """Per table: rows and a content hash on both sides, over the source's columns. A table
    the publication narrows (:mod:`..published_columns`) is compared as it is published: its source
    rows that pass the row filter, over the columns the column list sends."""
    results = []
    with (
        connect(settings.source_dsn, role="source", autocommit=True) as src,
        connect(settings.target_dsn, role="target", autocommit=True) as tgt,
    ):
        for conn in (src, tgt):
            conn.execute(COMPARABLE_SESSION)
        source_columns = table_columns(src, tables)
        on_target = set(table_columns(tgt, tables))
        shapes = published_shapes(src, settings.publication, tables)
        for table in tables:
            shape = shapes.get(table)
            left_out = set(shape.unpublished) if shape else set()
            columns = [c.name for c in source_columns.get(table, []) if c.name not in left_out]
            row_filter = shape.row_filter if shape else None
            s_rows, s_hash = _table_fingerprint(src, table, columns, row_filter)
            if table not in on_target:
                results.append(TableComparison(table, s_rows, 0, s_hash, "", "target"))
                continue
            t_rows, t_hash = _table_fingerprint(tgt, table, columns)
            results.append(TableComparison(table, s_rows, t_rows, s_hash, t_hash))
    return results


DEFAULT_CHUNK_ROWS = 100_000
"""About this many rows in a chunk of a keyed table (:mod:`.chunks`)."""
KEYS_LISTED = 20
"""At most this many differing keys are named per differing chunk."""
CHUNKS_DETAILED = 10
"""At most this many differing chunks of a table have their keys listed."""


@dataclass(frozen=True)
class OnlineComparison:
    pair: ConsistentPair | None
    """``None``: a table is missing on the target, so both sides were read as they stand
    (:func:`compare_online`)."""
    tables: list[TableComparison]
    seconds: float

    @property
    def point(self) -> Lsn | None:
        return None if self.pair is None else self.pair.point

    @property
    def made_way_by(self) -> str | None:
        return None if self.pair is None else self.pair.made_way_by


def compare_online(
    settings: ReplicationSettings,
    tables: Sequence[TableName],
    holder: str,
    *,
    wait_s: float = 120.0,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    workers: int | None = None,
    spark: Any = None,
    caught_up: Callable[[int], None] | None = None,
    progressed: Callable[[CompareProgress], None] | None = None,
) -> OnlineComparison:
    """Compare ``tables`` while the replication goes on: both sides at one consistent point
    (:func:`~.consistent_pair.consistent_pair`: the range is held only while the point is
    taken), then chunk by chunk (:func:`compare_pair`). A table the
    publication narrows is compared as it is published, as :func:`compare_tables` does. With a
    table missing on the target (published later, never copied) the target cannot be caught
    up to a point, so every table is compared as the sides stand (:func:`compare_tables`),
    and the result has no ``pair``."""
    started = time.monotonic()
    with connect(settings.target_dsn, role="target", autocommit=True) as tgt:
        if set(tables) - set(table_columns(tgt, tables)):
            # The catch-up to a point cannot pass a change of a table the target lacks (the
            # apply refuses it, naming pgcdc add-table): compared as they stand, as before.
            return OnlineComparison(
                None, compare_tables(settings, tables), time.monotonic() - started
            )
    with consistent_pair(settings, holder, wait_s=wait_s, spark=spark, caught_up=caught_up) as pair:
        results = compare_pair(
            settings, pair, tables, chunk_rows=chunk_rows, workers=workers, progressed=progressed
        )
    return OnlineComparison(pair, results, time.monotonic() - started)


def compare_pair(
    settings: ReplicationSettings,
    pair: ConsistentPair,
    tables: Sequence[TableName],
    *,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    workers: int | None = None,
    progressed: Callable[[CompareProgress], None] | None = None,
    work: str = "verify",
) -> list[TableComparison]:
    """Compare ``tables`` between the pair's two snapshots, chunk by chunk (:mod:`.chunks`) on
    ``workers`` threads (default: the CPU count), each in sessions of its own that import the
    snapshots, each side's table read in parts (:func:`~.chunks.scan_parts`) whose sums add
    up. The pair is held by the caller: :func:`compare_online`, or a recovery
    (:mod:`.recover`), whose target stands still. ``progressed`` is told how far the reading
    is, at most every :data:`PROGRESS_EVERY_S` seconds and once at its end, and so is a command's
    display (:mod:`..progress`, as ``work``'s ``compare`` phase)."""
    workers = max(1, workers or os.cpu_count() or 1)

    def on(side: str, work: Callable[[psycopg.Connection[Any]], Any]) -> Any:
        with _in_snapshot(settings, pair, side) as conn:
            return work(conn)

    source_columns, shapes = on(
        "source",
        lambda src: (
            table_columns(src, tables),
            published_shapes(src, settings.publication, tables),
        ),
    )
    on_target = set(on("target", lambda tgt: table_columns(tgt, tables)))
    text_hash = on("source", lambda src: on("target", lambda tgt: same_text_hash(src, tgt)))
    present = [t for t in tables if t in on_target and t in source_columns]

    def plan(table: TableName) -> ChunkPlan:
        shape = shapes.get(table)
        left_out = set(shape.unpublished) if shape else set()
        columns = [c.name for c in source_columns[table] if c.name not in left_out]
        row_filter = shape.row_filter if shape else None
        return on(
            "source",
            lambda src: plan_chunks(
                src, table, columns, chunk_rows, row_filter, text_hash=text_hash
            ),
        )

    sides = ("source", "target")

    def parts_of(table: TableName, side: str) -> list[ScanPart]:
        return on(side, lambda conn: scan_parts(conn, table))

    def part_sums(table: TableName, side: str, part: ScanPart) -> tuple[int, Sums]:
        found = on(
            side, lambda conn: chunk_sums(conn, plans[table], source=side == "source", part=part)
        )
        return part.bytes, found

    started = time.monotonic()
    with ThreadPoolExecutor(workers, thread_name_prefix="pgcdc-verify") as pool:
        plans = dict(zip(present, pool.map(plan, present), strict=True))
        cuts = [(t, side) for t in present for side in sides]
        parts = dict(zip(cuts, pool.map(lambda cut: parts_of(*cut), cuts), strict=True))
        sums: dict[tuple[TableName, str], Sums] = {cut: {} for cut in cuts}
        futures = {
            pool.submit(part_sums, table, side, part): (table, side)
            for (table, side), cut_parts in parts.items()
            for part in cut_parts
        }
        progress = CompareProgress(0, sum(p.bytes for ps in parts.values() for p in ps), 0.0)
        reported = started
        for future in as_completed(futures):
            done, found = future.result()
            add_sums(sums[futures[future]], found)
            progress = CompareProgress(
                progress.done_bytes + done, progress.total_bytes, time.monotonic() - started
            )
            if time.monotonic() - reported >= PROGRESS_EVERY_S:
                reported = time.monotonic()
                _report(progress, progressed, work)
        _report(progress, progressed, work)
    results = []
    for table in tables:
        if table not in present:
            count = functools.partial(_count, table=table)
            rows = on("source", count) if table in source_columns else 0
            results.append(TableComparison(table, rows, 0, "", "", "target"))
            continue
        ours, theirs = sums[(table, "source")], sums[(table, "target")]
        results.append(
            TableComparison(
                table,
                sum(n for n, _, _ in ours.values()),
                sum(n for n, _, _ in theirs.values()),
                digest(ours),
                digest(theirs),
                chunks=plans[table].chunks,
                differing=_differences(settings, pair, plans[table], ours, theirs),
                plan=plans[table],
            )
        )
    return results


PROGRESS_EVERY_S = 2.0
"""How often a compare says how far it is, at most."""


@dataclass(frozen=True)
class CompareProgress:
    """How far a compare's reading is: bytes of both sides' tables read, of all."""

    done_bytes: int
    total_bytes: int
    seconds: float

    def line(self) -> str:
        """``compared 42% (1,130/2,686 MB, 180 MB/s, ETA 9 s)``."""
        share = self.done_bytes / self.total_bytes if self.total_bytes else 1.0
        rate = self.done_bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0
        left = (self.total_bytes - self.done_bytes) / 1e6 / rate if rate > 0 else 0.0
        eta = f", ETA {left:,.0f} s" if self.done_bytes < self.total_bytes else ""
        return (
            f"compared {share:.0%} ({self.done_bytes / 1e6:,.0f}/{self.total_bytes / 1e6:,.0f} "
            f"MB, {rate:,.0f} MB/s{eta})"
        )


def _report(
    progress: CompareProgress, progressed: Callable[[CompareProgress], None] | None, work: str
) -> None:
    if progressed is not None:
        progressed(progress)
    if active():
        both = TableProgress(
            "both sides", bytes=progress.done_bytes, estimated_bytes=progress.total_bytes
        )
        rate = progress.done_bytes / progress.seconds / 1e6 if progress.seconds > 0 else 0.0
        publish(SnapshotProgress("compare", progress.seconds, [both], rate, progress.line(), work))


@contextlib.contextmanager
def _in_snapshot(
    settings: ReplicationSettings, pair: ConsistentPair, side: str
) -> Iterator[psycopg.Connection[Any]]:
    """A session of ``side`` (``source`` or ``target``) in the pair's snapshot of that side,
    printing values as the other side's does."""
    dsn = settings.source_dsn if side == "source" else settings.target_dsn
    snapshot = pair.source_snapshot if side == "source" else pair.target_snapshot
    with connect(dsn, role=side, autocommit=True) as conn:
        conn.execute(COMPARABLE_SESSION)
        with snapshot_transaction(conn, snapshot):
            yield conn


def _count(conn: psycopg.Connection[Any], table: TableName) -> int:
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(rows_of(conn, table))).fetchone()
    return int(row[0]) if row else 0


def _differences(
    settings: ReplicationSettings,
    pair: ConsistentPair,
    plan: ChunkPlan,
    ours: Sums,
    theirs: Sums,
) -> tuple[ChunkDifference, ...]:
    """The differing chunks of one table, the first :data:`CHUNKS_DETAILED` with their keys."""
    found = []
    for index, chunk in enumerate(differing_chunks(ours, theirs)):
        keys: list[KeyDifference] = []
        if index < CHUNKS_DETAILED and plan.key:
            with (
                _in_snapshot(settings, pair, "source") as src,
                _in_snapshot(settings, pair, "target") as tgt,
            ):
                keys = differing_keys(src, tgt, plan, chunk, KEYS_LISTED)
        found.append(
            ChunkDifference(
                plan.describe(chunk),
                ours.get(chunk, (0, 0, 0))[0],
                theirs.get(chunk, (0, 0, 0))[0],
                tuple(keys),
                chunk,
            )
        )
    return tuple(found)
