"""A recovery's fast path: the rows that changed since the target's applied position, found by
their ``xmin`` and copied again, and the keys deleted meanwhile, found by a compare of keys
only. No row's text is hashed; each side's table is read once for the changed rows (the
source) and once for its keys (both sides).

The setting (:mod:`.recover`): the target stands still at its origin's ``L``, holding every
replicated table as the source held it at ``L`` (``C_applied``: every transaction whose COMMIT
ends at or before ``L``, none after). A new slot's exported snapshot sees the source at ``C2``.
The latest bound ``(W, X)`` with ``W <= L`` (:mod:`..apply.xid_bounds`) says: every
transaction that committed after ``L`` has a transaction id not older than ``X``.

Why every row that differs between ``C_applied`` and ``C2`` is either copied or deleted here,
for a table with a primary key:

1. A row version visible at ``C2`` whose ``xmin`` committed at or before ``L`` was visible at
   ``C_applied`` too: it was committed then, and no transaction committed before ``C2``
   deleted or updated it (it would not be visible at ``C2``), so none before ``L`` did. The
   target holds it as it is.
2. Every other row version visible at ``C2`` was written by a transaction that committed after
   ``L``: its ``xmin`` is not older than ``X``, whatever it did. That covers an insert, the new
   version an update writes (a ``HOT`` one or not, one that changes nothing, an ``ON CONFLICT
   DO UPDATE``), a row moved to another partition (a delete and an insert under one
   transaction: the table is read with its partitions), the rows inserted after a
   ``TRUNCATE``, and a transaction that began before ``L`` and committed after it (it was
   still running when the bound was read, so its id is not older than ``X``). A subtransaction
   writes its own id as ``xmin``, younger than its parent's, itself not older than ``X``. A
   table rewritten by ``ALTER TABLE`` carries the rewriting transaction's id; ``VACUUM FULL``,
   ``CLUSTER`` and freezing keep each row's ``xmin`` (PostgreSQL keeps the raw ``xmin`` of a
   frozen row since 9.4; checked by the tests). These rows are copied again: each one's key
   deleted on the target and the source's row inserted, in one target transaction per part of
   the source's table (:func:`copy_changed`). Rows changed between ``W`` and ``L`` are copied
   too, and change nothing.
3. After 1 and 2, every key the source holds at ``C2`` is on the target with the source's row.
   What is left are keys the target holds and the source does not: rows deleted after ``L``
   (a ``DELETE``, a ``TRUNCATE``, the old key of an update that changed the key, a row the
   publication's row filter no longer passes). Both sides' keys are compared, per bucket of a
   hash of the key (count and a sum of the hashes, no row text), and in the buckets that
   differ the target's keys the source lacks are deleted (:func:`delete_gone_keys`). A bucket
   where the source holds a key the target lacks breaks the premise (the target was changed
   by hand): that table goes to the fallback.

The comparison of an ``xmin`` with ``X`` is by age (``age(xmin) <= age(X)``), which is exact
for the ids within 2^31 of the next one: a bound older than ``autovacuum_freeze_max_age`` is
not used. Every row the fast path must find has an id between ``X`` and the next one, so
within that distance. A row frozen long ago keeps its raw ``xmin``, whose age may wrap and
look young: it is copied again, which changes nothing. A row frozen before PostgreSQL 9.4
shows ``xmin`` 2, whose age is the largest: old, as it is.

After a promotion (a PostgreSQL 15 or 16 source's failover loses the slot), the bound still
serves where the target is not ahead of the new timeline's switch point ``S`` (``L <= S``;
:func:`~..control.failover.forked` says otherwise, and a fork's rows differ on the target, which
no ``xmin`` on the source shows) and the bound's ``W`` is at or before where its timeline ends
in the present one's history. The transactions the target lacks then either committed on the
shared history between ``L`` and ``S`` (the argument above holds there as it did on the old
primary), or on the new timeline with ids the promoted standby assigned from its next id,
which replay moved past every id that had ended before the bound was read (each one wrote
its commit or abort record before ``W <= S``): not older than ``X`` either.

Where this cannot be trusted, the table goes to the chunk compare (:mod:`.verify`, every row
hashed) and each case is named: a table without a primary key, a table being added
(``pgcdc add-table``: its copy is not the source at ``L``), no bound recorded at or before
``L``, a bound of another source or from past where its timeline joins the present one, a
target ahead of the switch point (a fork), a bound older than ``autovacuum_freeze_max_age``.

Crash anywhere: each part's copy and each bucket's deletes commit whole or not at all, under a
chain that says ``recovering``; a recovery started again with a new slot at ``C3`` and the
same ``L`` copies every row changed since ``L`` again (those copied at ``C2`` included) and
deletes what ``C3`` lacks, so it converges whatever the killed one did.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..apply.xid_bounds import XidBound, read_bound
from ..connect import connect
from ..failpoints import failpoint
from ..identifiers import TableName
from ..published_columns import row_filter_sql
from ..settings import ReplicationSettings
from ..snapshot.common import snapshot_transaction
from ..snapshot.copy import BINARY_MISMATCH, stream_copy_out
from ..source.timeline import switch_point
from .chunks import PART_BLOCKS, ScanPart, rows_of, scan_parts
from .consistent_pair import export_snapshot
from .repair import generated_columns
from .verify import COMPARABLE_SESSION


@dataclass(frozen=True)
class KeyedTable:
    """A table the fast path takes: its published columns, its key, the publication's row
    filter (the source side reads only the rows it passes)."""

    table: TableName
    columns: tuple[str, ...]
    key: tuple[str, ...]
    row_filter: str | None = None
    integer_key: bool = False
    """Every key column an integer (on the source): its keys are hashed as integers, with no
    text (the cheapest hash; ``benchmarks/recover.py``)."""


@dataclass
class TableChanges:
    """What the fast path did to one table."""

    table: TableName
    rows_copied: int = 0
    bytes_copied: int = 0
    keys_deleted: int = 0
    buckets: int = 0
    differing_buckets: int = 0
    fallback: str | None = None
    """Why the table went to the chunk compare after all (a key the target lacks)."""


_FREEZE_MAX_AGE = "SELECT current_setting('autovacuum_freeze_max_age')::bigint"


def bound_unusable(
    src: psycopg.Connection[Any], bound: XidBound | None, source_dsn: str | None = None
) -> str | None:
    """Why ``bound`` cannot serve the source ``src`` is connected to now, in a few words;
    ``None``: it can. A bound of an earlier timeline serves where its ``W`` is at or before
    that timeline's switch point in the present one's history (``source_dsn`` is asked for
    it, on a replication connection; see the module docstring)."""
    if bound is None:
        return "no transaction-id bound recorded at or before the target's position"
    now = read_bound(src)  # the source's identity and timeline now, as a bound says them
    if now is None:
        return "the source is a standby"
    if now.system_id != bound.system_id:
        return "the bound was read on another source (its system identifier differs)"
    if now.timeline != bound.timeline:
        ended = None
        if source_dsn is not None:
            with connect(source_dsn, role="source", replication=True) as conn:
                ended = switch_point(conn, now.timeline, bound.timeline)
        if ended is None or bound.wal > ended:
            return (
                f"the bound was read on timeline {bound.timeline} at {bound.wal}, which is not "
                f"in the history of the source's timeline {now.timeline}"
            )
    limit = src.execute(_FREEZE_MAX_AGE).fetchone()
    assert limit is not None
    age = now.next_xid - bound.oldest_xid
    if age >= int(limit[0]):
        return f"the bound is {age:,} transactions old, past autovacuum_freeze_max_age"
    return None


def changed_filter(conn: psycopg.Connection[Any], bound: XidBound) -> sql.Composable:
    """The rows written by a transaction not older than the bound's ``X`` (see the module
    docstring), for a read in ``conn``'s transaction: ``age`` counts from an id that is stable
    within a transaction, so the bound's age is read once here and each row's compared with
    that number (``age`` is stable, never folded into a constant: the planner would call it
    again for every row)."""
    row = conn.execute("SELECT age(%s::text::xid)", (str(bound.oldest_xid % 2**32),)).fetchone()
    assert row is not None
    return sql.SQL("age(xmin) <= {}").format(sql.Literal(int(row[0])))


@contextmanager
def _source_in(settings: ReplicationSettings, snapshot: str) -> Iterator[psycopg.Connection[Any]]:
    with connect(settings.source_dsn, role="source", autocommit=True) as src:
        src.execute(COMPARABLE_SESSION)
        with snapshot_transaction(src, snapshot):
            yield src


def _listed(names: Sequence[str]) -> sql.Composable:
    return sql.SQL(", ").join(sql.Identifier(n) for n in names)


def _key_match(key: Sequence[str], left: str, right: str) -> sql.Composable:
    return sql.SQL(" AND ").join(
        sql.SQL("{} = {}").format(sql.Identifier(left, k), sql.Identifier(right, k)) for k in key
    )


@dataclass(frozen=True)
class Copied:
    """One part's copy: rows and bytes, and what it changed in the target's key totals."""

    rows: int
    bytes: int
    delta: tuple[int, int]
    """Keys added, and the sum of their hashes added (:func:`key_sums`)."""


def copy_changed(
    settings: ReplicationSettings,
    source_snapshot: str,
    keyed: KeyedTable,
    bound: XidBound,
    part: ScanPart,
    text_hash: bool,
) -> Copied:
    """The rows of one part of the source's table written since the bound, copied again: in
    one target transaction, each one's key deleted and the source's row inserted (as the apply
    writes: no triggers, no foreign-key checks). Binary ``COPY``, or text where a type's binary
    form does not cross."""
    try:
        return _copy_once(settings, source_snapshot, keyed, bound, part, text_hash, "binary")
    except BINARY_MISMATCH:
        return _copy_once(settings, source_snapshot, keyed, bound, part, text_hash, "text")


def _copy_once(
    settings: ReplicationSettings,
    source_snapshot: str,
    keyed: KeyedTable,
    bound: XidBound,
    part: ScanPart,
    text_hash: bool,
    copy_format: str,
) -> Copied:
    table = keyed.table
    with (
        _source_in(settings, source_snapshot) as src,
        connect(settings.target_dsn, role="target") as tgt,
    ):
        generated = generated_columns(tgt, table)
        columns = [c for c in keyed.columns if c not in generated]
        tgt.execute(COMPARABLE_SESSION)
        tgt.execute("SET LOCAL session_replication_role = replica")
        staged = sql.Identifier("pgcdc_changed_rows")
        tgt.execute(
            sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {} FROM {} WITH NO DATA").format(
                staged, _listed(columns), table.sql
            )
        )
        conditions = [changed_filter(src, bound)]
        if keyed.row_filter:
            conditions.append(row_filter_sql(keyed.row_filter))
        if (within := part.within()) is not None:
            conditions.append(within)
        options = sql.SQL(" (FORMAT {})").format(sql.SQL(copy_format))
        select = sql.SQL("COPY (SELECT {} FROM {} WHERE {}) TO STDOUT{}").format(
            _listed(columns),
            rows_of(src, table),
            sql.SQL(" AND ").join(sql.SQL("({})").format(c) for c in conditions),
            options,
        )
        sent = 0
        with tgt.cursor().copy(
            sql.SQL("COPY {} ({}) FROM STDIN{}").format(staged, _listed(columns), options)
        ) as into:

            def write(data: bytearray) -> None:
                nonlocal sent
                sent += len(data)
                into.write(data)

            copied = stream_copy_out(src, select, write)
        delta = (0, 0)
        if copied:
            # What this changes in the target's key totals: the keys copied in, less the keys
            # their rows replace (see recover_changed).
            totals = sql.SQL("SELECT count(*), coalesce(sum(h), 0) FROM ({}) keys")
            added = tgt.execute(
                totals.format(
                    sql.SQL("SELECT {} AS h FROM {} s").format(
                        _key_hash(keyed, text_hash, "s"), staged
                    )
                )
            ).fetchone()
            replaced = tgt.execute(
                sql.SQL(
                    "WITH gone AS (DELETE FROM {} t USING {} s WHERE {} RETURNING {} AS h) "
                ).format(
                    rows_of(tgt, table),
                    staged,
                    _key_match(keyed.key, "t", "s"),
                    _key_hash(keyed, text_hash, "t"),
                )
                + totals.format(sql.SQL("SELECT h FROM gone"))
            ).fetchone()
            assert added is not None and replaced is not None
            delta = (int(added[0]) - int(replaced[0]), int(added[1]) - int(replaced[1]))
            tgt.execute(
                sql.SQL("INSERT INTO {} ({}) SELECT {} FROM {}").format(
                    table.sql, _listed(columns), _listed(columns), staged
                )
            )
        failpoint("recover.changed_in_transaction")
        tgt.commit()
    return Copied(copied, sent, delta)


SIDES = ("source", "target")
KEY_BUCKET_ROWS = 100_000
"""About this many keys in a bucket of the key compare: a bucket that differs has its keys
read again on both sides."""
MAX_BUCKETS = 4096


def buckets_for(rows: int) -> int:
    """How many buckets the keys of a table of ``rows`` rows are spread over: a power of two
    (the same on both sides, whatever either estimates, since the source's estimate decides)."""
    wanted = max(1, math.ceil(rows / KEY_BUCKET_ROWS))
    return min(MAX_BUCKETS, 1 << (wanted - 1).bit_length())


def _key_hash(keyed: KeyedTable, text_hash: bool, alias: str | None = None) -> sql.Composable:
    """A 64-bit hash of a row's key, computed alike on both sides: of integer keys, each
    column's ``hashint8extended`` (seeded by its position, xor-ed); else ``hashtextextended``
    of the key's text where both servers hash text alike, else 60 bits of its md5. ``alias``:
    the relation whose columns it reads, where more than one is in scope."""
    names = [sql.Identifier(alias, k) if alias else sql.Identifier(k) for k in keyed.key]
    if keyed.integer_key:
        return sql.SQL(" # ").join(
            sql.SQL("hashint8extended({}::int8, {})").format(name, sql.Literal(i))
            for i, name in enumerate(names)
        )
    row = sql.SQL("ROW({})::text").format(sql.SQL(", ").join(names))
    if text_hash:
        return sql.SQL("hashtextextended({}, 0)").format(row)
    return sql.SQL("('x' || substr(md5(convert_to({}, 'UTF8')), 1, 15))::bit(60)::bigint").format(
        row
    )


def _bucket(keyed: KeyedTable, text_hash: bool, buckets: int) -> sql.Composable:
    return sql.SQL("(({}) & {})").format(_key_hash(keyed, text_hash), sql.Literal(buckets - 1))


KeySums = dict[int, tuple[int, int]]


def key_sums(
    conn: psycopg.Connection[Any],
    keyed: KeyedTable,
    buckets: int,
    *,
    source: bool,
    text_hash: bool,
) -> KeySums:
    """Per bucket: the keys' count and the sum of their hashes, in ``conn``'s snapshot (the
    source side only the rows the row filter passes). One bucket is the table's totals, read
    without grouping (the cheaper read, first: most recoveries find no key deleted)."""
    where = (
        sql.SQL(" WHERE ") + row_filter_sql(keyed.row_filter)
        if source and keyed.row_filter
        else sql.SQL("")
    )
    # No subquery: one computing the hash once costs more than the hash twice
    # (benchmarks/README.md, "A lost slot", where the fast path's time goes).
    hashed = _key_hash(keyed, text_hash)
    table = rows_of(conn, keyed.table)
    if buckets == 1:
        query = sql.SQL("SELECT 0, count(*), coalesce(sum({}), 0) FROM {}{}").format(
            hashed, table, where
        )
    else:
        query = sql.SQL(
            "SELECT ({h}) & {mask}, count(*), coalesce(sum({h}), 0) FROM {t}{w} GROUP BY 1"
        ).format(h=hashed, mask=sql.Literal(buckets - 1), t=table, w=where)
    return {int(b): (int(n), int(s)) for b, n, s in conn.execute(query).fetchall() if int(n) > 0}


def delete_gone_keys(
    settings: ReplicationSettings,
    source_snapshot: str,
    keyed: KeyedTable,
    buckets: int,
    differing: Sequence[int],
    text_hash: bool,
) -> tuple[int, int]:
    """In one target transaction: the source's keys of the ``differing`` buckets staged, the
    target's keys of those buckets that the source lacks deleted. Returns the keys deleted and
    the keys the source holds that the target lacks (more than 0: nothing is deleted, and the
    table goes to the fallback)."""
    table = keyed.table
    bucket = _bucket(keyed, text_hash, buckets)
    chosen = sql.SQL("{} = ANY({})").format(bucket, sql.Literal(list(differing)))
    with (
        _source_in(settings, source_snapshot) as src,
        connect(settings.target_dsn, role="target") as tgt,
    ):
        tgt.execute(COMPARABLE_SESSION)
        tgt.execute("SET LOCAL session_replication_role = replica")
        staged = sql.Identifier("pgcdc_source_keys")
        tgt.execute(
            sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {} FROM {} WITH NO DATA").format(
                staged, _listed(keyed.key), table.sql
            )
        )
        conditions = [chosen]
        if keyed.row_filter:
            conditions.append(row_filter_sql(keyed.row_filter))
        select = sql.SQL("COPY (SELECT {} FROM {} WHERE {}) TO STDOUT").format(
            _listed(keyed.key),
            rows_of(src, table),
            sql.SQL(" AND ").join(sql.SQL("({})").format(c) for c in conditions),
        )
        with tgt.cursor().copy(
            sql.SQL("COPY {} ({}) FROM STDIN").format(staged, _listed(keyed.key))
        ) as into:
            stream_copy_out(src, select, into.write)
        tgt.execute(sql.SQL("ANALYZE {}").format(staged))
        lacking = tgt.execute(
            sql.SQL(
                "SELECT count(*) FROM {} s WHERE NOT EXISTS (SELECT FROM {} t WHERE {})"
            ).format(staged, rows_of(tgt, table), _key_match(keyed.key, "t", "s"))
        ).fetchone()
        missing = int(lacking[0]) if lacking else 0
        if missing:
            tgt.rollback()
            return 0, missing
        deleted = tgt.execute(
            sql.SQL("DELETE FROM {} t WHERE {} AND NOT EXISTS (SELECT FROM {} s WHERE {})").format(
                rows_of(tgt, table),
                chosen,  # its columns unqualified: the target's row, the only one in scope
                staged,
                _key_match(keyed.key, "t", "s"),
            )
        ).rowcount
        failpoint("recover.deleted_in_transaction")
        tgt.commit()
    return max(deleted, 0), 0


@dataclass(frozen=True)
class FastPathProgress:
    step: str
    done: int
    total: int
    rows: int
    seconds: float

    def line(self) -> str:
        return (
            f"{self.step}: {self.done}/{self.total}, {self.rows:,} row(s) copied, "
            f"{self.seconds:.1f} s"
        )


def recover_changed(
    settings: ReplicationSettings,
    source_snapshot: str,
    tables: Sequence[KeyedTable],
    bound: XidBound,
    *,
    text_hash: bool,
    workers: int,
    say: Callable[[str], None] = lambda _line: None,
) -> list[TableChanges]:
    """The fast path for ``tables`` (see the module docstring): the changed rows of every part
    of every table copied on ``workers`` threads, then each table's keys compared on both
    sides and the keys the source lacks deleted. The target stands still meanwhile (the
    caller holds the range)."""
    started = time.monotonic()
    results = {k.table: TableChanges(k.table) for k in tables}
    with connect(settings.source_dsn, role="source", autocommit=True) as src:
        parts = {k.table: _parts(src, k.table, workers) for k in tables}
        estimates = {k.table: _estimate(src, k.table) for k in tables}
    jobs = [(k, part) for k in tables for part in parts[k.table]]

    def copy_one(job: tuple[KeyedTable, ScanPart]) -> tuple[KeyedTable, Copied]:
        keyed, part = job
        return keyed, copy_changed(settings, source_snapshot, keyed, bound, part, text_hash)

    def sums_of(keyed: KeyedTable, side: str, buckets: int, snapshot: str | None) -> KeySums:
        dsn = settings.source_dsn if side == "source" else settings.target_dsn
        with connect(dsn, role=side, autocommit=True) as conn:
            conn.execute(COMPARABLE_SESSION)
            with snapshot_transaction(conn, snapshot):
                return key_sums(conn, keyed, buckets, source=side == "source", text_hash=text_hash)

    with (
        connect(settings.target_dsn, role="target", autocommit=True) as before,
        snapshot_transaction(before, None),
        ThreadPoolExecutor(max(1, workers), thread_name_prefix="pgcdc-recover") as pool,
        ThreadPoolExecutor(2, thread_name_prefix="pgcdc-recover-keys") as keys,
    ):
        # Both sides' key totals are read alongside the copies (a pool of their own: the
        # copies wait for none), the target's as it stood before them (a snapshot taken
        # first), then moved by what each copy changed: a second read of the target after the
        # copies would wait for them all.
        kept = export_snapshot(before)
        source_totals = {k: keys.submit(sums_of, k, "source", 1, source_snapshot) for k in tables}
        target_totals = {k: keys.submit(sums_of, k, "target", 1, kept) for k in tables}
        moved: dict[KeyedTable, tuple[int, int]] = {k: (0, 0) for k in tables}
        copied = 0
        for done, (keyed, part) in enumerate(pool.map(copy_one, jobs), 1):
            result = results[keyed.table]
            result.rows_copied += part.rows
            result.bytes_copied += part.bytes
            moved[keyed] = (moved[keyed][0] + part.delta[0], moved[keyed][1] + part.delta[1])
            copied += part.rows
            failpoint("recover.after_changed")
            say(
                FastPathProgress(
                    "changed rows", done, len(jobs), copied, time.monotonic() - started
                ).line()
            )
        unequal = [
            k
            for k in tables
            if source_totals[k].result() != _moved(target_totals[k].result(), moved[k])
        ]
        say(
            f"compared the key totals of {len(tables)} table(s) in "
            f"{time.monotonic() - started:.1f} s: {len(unequal)} differ"
        )
        # Where the totals differ, the keys per bucket, then the buckets that differ.
        cuts = [(k, side, buckets_for(estimates[k.table])) for k in unequal for side in SIDES]
        snapshots = {"source": source_snapshot, "target": None}  # the target after the copies
        sums = dict(
            zip(
                [(k, side) for k, side, _ in cuts],
                pool.map(lambda c: sums_of(c[0], c[1], c[2], snapshots[c[1]]), cuts),
                strict=True,
            )
        )
    for keyed in tables:
        result = results[keyed.table]
        result.buckets = 1
        if keyed not in unequal:
            continue
        buckets = buckets_for(estimates[keyed.table])
        ours, theirs = sums[(keyed, "source")], sums[(keyed, "target")]
        differing = sorted(b for b in ours.keys() | theirs.keys() if ours.get(b) != theirs.get(b))
        result.buckets, result.differing_buckets = buckets, len(differing)
        deleted, missing = delete_gone_keys(
            settings, source_snapshot, keyed, buckets, differing, text_hash
        )
        if missing:
            result.fallback = (
                f"{missing} key(s) of the source missing on the target outside the rows "
                "changed since its position (the target was written to)"
            )
            continue
        result.keys_deleted = deleted
        failpoint("recover.after_deleted")
        say(f"{keyed.table}: {deleted} deleted key(s) removed from {len(differing)} bucket(s)")
    return [results[k.table] for k in tables]


def _parts(conn: psycopg.Connection[Any], table: TableName, workers: int) -> list[ScanPart]:
    """``table`` cut into at most ``workers`` parts of whole :data:`~.chunks.PART_BLOCKS`:
    enough to keep every worker busy, each part paying its sessions and its transaction once
    (``benchmarks/HISTORY.md``, recover by the rows changed)."""
    parts = scan_parts(conn, table)
    if len(parts) <= workers:
        return parts
    return scan_parts(conn, table, math.ceil(len(parts) / workers) * PART_BLOCKS)


def _moved(totals: KeySums, delta: tuple[int, int]) -> KeySums:
    """A table's key totals (one bucket) moved by ``delta``."""
    rows, hashes = totals.get(0, (0, 0))
    rows, hashes = rows + delta[0], hashes + delta[1]
    return {0: (rows, hashes)} if rows else {}


def _estimate(conn: psycopg.Connection[Any], table: TableName) -> int:
    """The source's estimate of ``table``'s rows (its partitions' for a partitioned one)."""
    row = conn.execute(
        "SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::bigint FROM pg_class c "
        "WHERE c.oid = %(t)s::regclass OR c.oid IN "
        "(SELECT relid FROM pg_partition_tree(%(t)s::regclass))",
        {"t": table.sql.as_string(conn)},
    ).fetchone()
    return int(row[0]) if row else 0
