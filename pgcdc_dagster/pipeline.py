"""The replication stages as plain functions: snapshot, plan, receive, apply, verify, status.

Like pgcopydb's commands, each stage can run on its own (from an asset, the sensor, the CLI or
a test) and finds its position in the three durable places that own progress: the source slot
(what has been stored), the output store (what each range holds, and where the current chain
of ranges begins), the target's replication origin (what has been applied). Nothing here keeps
state of its own, and nothing here knows Dagster.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg import sql

from .config import ReplicationSettings
from .connect import connect
from .identifiers import TableName
from .lsn import Lsn, LsnRange
from .receive import ReceiveResult, receive
from .slot import SlotInfo, current_flush_lsn, read_slot
from .store import OutputStore, StoredRange

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from .apply import ApplyResult
    from .snapshot import BaseSnapshotResult


T = TypeVar("T")
SparkProvider = Any
"""A SparkSession, a callable returning one (started lazily), or ``None`` (in-process only)."""


class RangeOrderError(RuntimeError):
    """A range was asked for out of order: running it would lose or repeat changes."""


class RangeBusyError(RuntimeError):
    """Another catch-up of the same slot holds the range lock."""


def store_of(settings: ReplicationSettings) -> OutputStore:
    return OutputStore(settings.store_path)


# -- snapshot ---------------------------------------------------------------------------------


def take_snapshot(
    settings: ReplicationSettings, spark: SparkSession, *, resnapshot: bool = False
) -> BaseSnapshotResult:
    """Base snapshot, then a new chain of ranges in the store at its consistent point."""
    from .snapshot import take_base_snapshot

    result = take_base_snapshot(
        settings.source_dsn,
        settings.target_dsn,
        settings.slot,
        settings.publication,
        settings.tables,
        spark=spark,
        resnapshot=resnapshot,
        export_store=settings.store_path if settings.snapshot_parquet else None,
    )
    store_of(settings).record_chain(settings.slot, result.consistent_point, result.snapshot_name)
    return result


# -- positions and planning -------------------------------------------------------------------


@dataclass(frozen=True)
class SourcePositions:
    slot: SlotInfo
    flush_lsn: Lsn

    @property
    def lag_bytes(self) -> int:
        confirmed = self.slot.confirmed_flush_lsn or self.flush_lsn
        return max(0, self.flush_lsn - confirmed)


def source_positions(settings: ReplicationSettings, *, timeout_s: int = 5) -> SourcePositions:
    """The slot and the source's flushed WAL position, bounded in time (the sensor calls it)."""
    with connect(settings.source_dsn, role="source", connect_timeout=timeout_s) as conn:
        conn.execute(f"SET statement_timeout = '{int(timeout_s)}s'")
        slot = read_slot(conn, settings.slot)
        flush = current_flush_lsn(conn)
    return SourcePositions(slot, flush)


def plan_next_range(
    consistent_point: Lsn, last_end: Lsn | None, flush: Lsn, max_bytes: int
) -> LsnRange | None:
    """The next range after ``last_end`` (or from the consistent point), capped in bytes.

    Ranges registered before the current consistent point belong to an earlier snapshot and
    are ignored: the chain restarts there. ``None`` when there is no new WAL.
    """
    start = consistent_point if last_end is None or last_end < consistent_point else last_end
    if flush <= start:
        return None
    return LsnRange(start, min(int(flush), int(start) + max_bytes))


def check_range_order(store: OutputStore, rng: LsnRange) -> None:
    """A range may run only right after the last stored range of the chain (or first)."""
    consistent_point = store.consistent_point()
    if rng.start < consistent_point:
        raise RangeOrderError(
            f"range {rng.key} starts at {rng.start}, before the current base snapshot's "
            f"consistent point {consistent_point}: it belongs to an earlier snapshot and is kept "
            "as history only; it is never re-applied"
        )
    if store.get(rng) is not None:
        return  # re-running a stored range: receive and apply are both idempotent
    chain = store.chain_ranges()
    expected = chain[-1].end if chain else consistent_point
    if rng.start != expected:
        missing = f"{expected} to {rng.start}" if rng.start > expected else f"from {expected}"
        raise RangeOrderError(
            f"range {rng.key} cannot run yet: the chain of stored ranges ends at {expected}, "
            f"so the range {missing} must be received and applied first (ranges run in LSN "
            "order, each starting where the previous one ended)"
        )


# -- catch-up of one range --------------------------------------------------------------------


@contextlib.contextmanager
def range_lock(settings: ReplicationSettings) -> Iterator[None]:
    """One catch-up per slot at a time, whoever starts it (sensor run, CLI, cutover).

    A session advisory lock on the target: released by the server if the holder dies, so a
    killed run never leaves it taken.
    """
    key = zlib.crc32(f"pgcdc:{settings.slot}".encode()) - 2**31
    with connect(settings.target_dsn, role="target", autocommit=True) as conn:
        (taken,) = conn.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone()  # type: ignore[misc]
        if not taken:
            raise RangeBusyError(
                f"another catch-up of slot {settings.slot} is running: wait for it to finish; "
                "ranges of one slot run one at a time"
            )
        try:
            yield
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (key,))


def receive_range(settings: ReplicationSettings, rng: LsnRange) -> ReceiveResult:
    store = store_of(settings)
    check_range_order(store, rng)
    return receive(
        settings.source_dsn, settings.slot, settings.publication, store, rng.start, rng.end
    )


def stored_range(settings: ReplicationSettings, rng: LsnRange) -> StoredRange:
    stored = store_of(settings).get(rng)
    if stored is None:
        raise RangeOrderError(
            f"range {rng.key} is not in the output store {settings.store_path}: receive it "
            "(materialise decoded_changes for that partition) before applying it"
        )
    return stored


def apply_stored_range(
    settings: ReplicationSettings, rng: LsnRange, spark: SparkProvider = None
) -> ApplyResult:
    """Apply a stored range. Spark is started (through ``spark``, a session or a callable that
    returns one) only for ranges large enough to be worth a Spark job."""
    from .apply import apply_range
    from .compaction import DEFAULT_SPARK_MIN_CHANGES

    stored = stored_range(settings, rng)
    session = None
    if spark is not None and stored.manifest["result"]["changes"] >= DEFAULT_SPARK_MIN_CHANGES:
        session = spark() if callable(spark) else spark
    return apply_range(
        settings.target_dsn, stored, settings.origin, spark=session, store=store_of(settings)
    )


def origin_progress(settings: ReplicationSettings) -> Lsn | None:
    """What the target has applied: the replication origin's durable progress."""
    with connect(settings.target_dsn, role="target", autocommit=True) as conn:
        row = conn.execute(
            "SELECT pg_replication_origin_progress(%s, true)::text "
            "WHERE EXISTS (SELECT FROM pg_replication_origin WHERE roname = %s)",
            (settings.origin, settings.origin),
        ).fetchone()
    return None if row is None or row[0] is None else Lsn.parse(row[0])


# -- verification -----------------------------------------------------------------------------


@dataclass(frozen=True)
class TableComparison:
    table: TableName
    source_rows: int
    target_rows: int
    source_hash: str
    target_hash: str

    @property
    def equal(self) -> bool:
        return self.source_rows == self.target_rows and self.source_hash == self.target_hash


_COMPARABLE_SESSION = (
    "SET TimeZone = 'UTC'; SET DateStyle = 'ISO, YMD'; SET IntervalStyle = 'postgres'; "
    "SET extra_float_digits = 3; SET bytea_output = 'hex'"
)


def _table_fingerprint(
    conn: psycopg.Connection[Any], table: TableName, columns: list[str]
) -> tuple[int, str]:
    """Row count and the md5 of the sorted per-row md5s: duplicates count, order does not."""
    row = sql.SQL("ROW({})").format(sql.SQL(", ").join(sql.Identifier(c) for c in columns))
    query = sql.SQL(
        "SELECT count(*), coalesce(md5(string_agg(h, '' ORDER BY h COLLATE \"C\")), '') "
        "FROM (SELECT md5({row}::text) AS h FROM {table}) rows"
    ).format(row=row, table=table.sql)
    count, digest = conn.execute(query).fetchone()  # type: ignore[misc]
    return int(count), str(digest)


def _columns(conn: psycopg.Connection[Any], table: TableName) -> list[str]:
    rows = conn.execute(
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
        "AND NOT attisdropped ORDER BY attnum",
        (table.sql.as_string(conn),),
    ).fetchall()
    return [r[0] for r in rows]


def compare_tables(
    settings: ReplicationSettings, tables: Sequence[TableName]
) -> list[TableComparison]:
    """Per table: rows and a content hash on both sides, over the source's columns."""
    results = []
    with (
        connect(settings.source_dsn, role="source", autocommit=True) as src,
        connect(settings.target_dsn, role="target", autocommit=True) as tgt,
    ):
        for conn in (src, tgt):
            conn.execute(_COMPARABLE_SESSION)
        for table in tables:
            columns = _columns(src, table)
            s_rows, s_hash = _table_fingerprint(src, table, columns)
            t_rows, t_hash = _table_fingerprint(tgt, table, columns)
            results.append(TableComparison(table, s_rows, t_rows, s_hash, t_hash))
    return results


def replicated_tables(settings: ReplicationSettings) -> list[TableName]:
    """The tables the publication carries (the source's own answer)."""
    from .slot import publication_tables

    with connect(settings.source_dsn, role="source", autocommit=True) as conn:
        return publication_tables(conn, settings.publication)


def expected_origin_progress(settings: ReplicationSettings) -> Lsn | None:
    """Where the origin must be once every stored range of the chain is applied."""
    store = store_of(settings)
    if store.chain() is None:
        return None
    for rng in reversed(store.chain_ranges()):
        stored = store.get(rng)
        transform = stored.manifest["result"]["transform_lsn"] if stored else None
        if transform:
            return Lsn.parse(transform)
    return store.consistent_point()


def resolve_endpos(settings: ReplicationSettings, endpos: str | Lsn) -> Lsn:
    """``current`` means the source's flushed WAL position now."""
    if isinstance(endpos, str) and endpos.strip().lower() == "current":
        with connect(settings.source_dsn, role="source", autocommit=True) as conn:
            return current_flush_lsn(conn)
    return Lsn(endpos)


def catch_up(
    settings: ReplicationSettings,
    target: Lsn,
    *,
    registered: Sequence[LsnRange],
    register: Callable[[str], None],
    run_range: Callable[[LsnRange], T],
) -> Iterator[T]:
    """Run range after range until the chain of stored ranges reaches ``target``.

    Ranges already registered but not stored run first (someone planned them; the order check
    would refuse any other range at that start); then new ranges are planned from the chain's
    end, capped at ``settings.range_max_bytes``, and registered before they run. ``run_range``
    receives and applies one range (in-process, or as a Dagster run) and its results are
    yielded.
    """
    store = store_of(settings)
    consistent_point = store.consistent_point()
    pending = [r for r in registered if r.start >= consistent_point and store.get(r) is None]
    while True:
        chain = store.chain_ranges()
        chain_end = chain[-1].end if chain else consistent_point
        if chain_end >= target:
            return
        if pending and pending[0].start == chain_end:
            rng = pending.pop(0)
        else:
            planned = plan_next_range(consistent_point, chain_end, target, settings.range_max_bytes)
            if planned is None:
                return
            rng = planned
            register(rng.key)
        yield run_range(rng)
        if store.get(rng) is None:
            raise RangeOrderError(f"range {rng.key} ran but is not in the output store")


def run_range_in_process(
    settings: ReplicationSettings, rng: LsnRange, spark: Any = None
) -> tuple[ReceiveResult, ApplyResult]:
    """Receive and apply one range here, under the range lock."""
    with range_lock(settings):
        received = receive_range(settings, rng)
        applied = apply_stored_range(settings, rng, spark)
    return received, applied
