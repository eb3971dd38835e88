"""The decoded output store: one Parquet folder per LSN-range partition, plus its manifest.

Layout under the store root::

    changes/<hi>/<mid>/<range key>/part-00000.parquet ...   one row per change, commit order
    changes/<hi>/<mid>/<range key>/_RANGE.json              the manifest: watermarks, counts,
                                                            relations
    _CHAIN.json          where the current chain of ranges begins, and how much was pruned

``<hi>/<mid>`` is the range's start LSN cut to 4 GiB and 16 MiB of WAL (``00000002/24`` for a
range starting at ``2/24F7C000``): a follow stores a range every few hundred milliseconds, and
a week of them is millions of folders. In one folder, every range written would list them all
(to sweep a crashed write's leftovers) and every decision of what to do next would list and
parse them all, each slower as the store grows; in buckets, each walks only the buckets it
needs (:meth:`OutputStore.walk`; see ``benchmarks/store_scale.py`` and
``benchmarks/HISTORY.md``). Ranges stored directly under ``changes/`` (the layout before
buckets) are still read, and leave as the retention removes them.

The manifest is the store's single source of truth for "what each LSN range holds"; a range
exists exactly when its folder (with manifest) exists. A range is written into a hidden
temporary folder, fsynced, and renamed into place in one step, so a crash leaves either no
range or a complete one: never a half partition that looks complete. Readers ignore hidden
folders, and a writer sweeps stale ones of its own range before it starts.

Row values are positional lists of the text the server sent (``new_row``, ``key``); the column
names, types and key flags of each list live in the manifest's ``relations``, indexed by the
row's ``relation_version``. That keeps a range self-describing across DDL (a Relation message
re-sent mid-range becomes a new version) without repeating names in every row.

Why one module: it is the one owner of the store's layout on disk and of every manifest and
chain write (the store's durable facts are written nowhere else), so the invariants above are
kept in one place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import heapq
import json
import os
import shutil
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import PgcdcError
from ..failpoints import failpoint
from ..identifiers import TableName
from ..lsn import Lsn, LsnRange
from ..published_columns import PublishedShape, row_filters, unpublished_columns

MANIFEST = "_RANGE.json"
CHAIN = "_CHAIN.json"
CHAIN_LOCK = ".chain.lock"
PRUNED_PREFIX = ".pruned-"
FORMAT_VERSION = 1

CHANGE_SCHEMA = pa.schema(
    [
        pa.field("commit_end_lsn", pa.int64(), nullable=False),
        pa.field("commit_lsn", pa.int64(), nullable=False),
        pa.field("lsn", pa.int64(), nullable=False),
        pa.field("xid", pa.int64(), nullable=False),
        pa.field("commit_ts", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("seq", pa.int32(), nullable=False),
        pa.field("action", pa.string(), nullable=False),
        pa.field("schema_name", pa.string(), nullable=False),
        pa.field("table_name", pa.string(), nullable=False),
        pa.field("relation_version", pa.int32(), nullable=False),
        pa.field("key", pa.list_(pa.string())),
        pa.field("new_row", pa.list_(pa.string())),
        pa.field("unchanged_toast", pa.list_(pa.string())),
        pa.field("flags", pa.int8(), nullable=False),
    ]
)
"""One row per change.

``action`` is ``I``/``U``/``D``/``T``. ``key`` holds the replica-identity values that find the
row *before* the change (from the old tuple when one was sent, else from the new row): the key
columns, or every column under REPLICA IDENTITY FULL. ``new_row`` is the row after the change
(NULL for deletes and truncates). ``unchanged_toast`` names the columns whose value was not
sent because it did not change. ``flags`` carries TRUNCATE's CASCADE (1) / RESTART IDENTITY (2).
"""


class StoreError(PgcdcError):
    """The output store is missing, unreadable or inconsistent."""


class StoreFullError(StoreError):
    """The store's file system has no room for the range being written; nothing of it was
    stored (its temporary folder goes with the writer), so freeing space and running the
    command again stores it whole."""


_OUT_OF_SPACE = (errno.ENOSPC, errno.EDQUOT)


class EndposOutcome(StrEnum):
    """Where a range's endpos fell relative to the transactions around it."""

    AT_COMMIT_BOUNDARY = "at_commit_boundary"
    BETWEEN_TRANSACTIONS = "between_transactions"
    MID_TRANSACTION = "mid_transaction"
    """A transaction began before endpos and commits after it: deferred, whole, to the next
    range."""
    EMPTY = "empty"
    """No transaction of the range committed: nothing to apply."""


@dataclass
class RangeResult:
    """Watermarks and counts of one received range: the manifest's ``result``."""

    range_key: str
    start_lsn: str
    endpos: str
    endpos_outcome: EndposOutcome
    transform_lsn: str | None
    """End of the last stored COMMIT; ``None`` when the range stored no transaction."""
    safe_point: str
    """Where the slot's confirmed position may be advanced once the range is stored."""
    last_xid: int | None
    last_commit_ts_us: int | None
    transactions: int
    changes: int
    inserts: int = 0
    updates: int = 0
    deletes: int = 0
    truncates: int = 0
    messages: int = 0
    straddlers: list[dict[str, int]] = field(default_factory=list)
    bytes: int = 0
    """Parquet bytes in the store."""
    wire_bytes: int = 0
    seconds: float = 0.0
    already_stored: bool = False
    """Set on the result handed back when the range was found stored (never written)."""


@dataclass(frozen=True)
class RangeManifest:
    """What a stored range holds (``_RANGE.json``): its result, and the relation versions and
    type names its positional row values are read with."""

    result: RangeResult
    relations: list[dict[str, Any]]
    """Per ``relation_version``: relid, schema, table, replica_identity and columns (name,
    type_oid, typmod, key), as pgoutput's Relation message sent them."""
    types: dict[str, str]
    """Names of the non-built-in type oids the relations use."""
    bytes: int = 0
    format_version: int = FORMAT_VERSION
    chain_last_commit: str | None = None
    """End of the last COMMIT stored in the chain up to this range's end (the consistent point
    when none is): where the target's origin stands once the range is applied. Set when the
    range is stored, from its own last COMMIT or else from the range before it, so walking
    back over empty ranges (an idle source stores one every ``follow_idle_s``) takes one step.
    ``None`` when unknown: a range before it stored without it, or not in the current chain."""

    def to_json(self) -> str:
        result = {k: v for k, v in dataclasses.asdict(self.result).items() if k != "already_stored"}
        return json.dumps(
            {
                "result": result,
                "relations": self.relations,
                "types": self.types,
                "bytes": self.bytes,
                "format_version": self.format_version,
                "chain_last_commit": self.chain_last_commit,
            },
            indent=1,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> RangeManifest:
        raw = json.loads(text)
        known = {f.name for f in dataclasses.fields(RangeResult)}
        fields = {k: v for k, v in raw.get("result", {}).items() if k in known}
        fields["endpos_outcome"] = EndposOutcome(fields.get("endpos_outcome", "empty"))
        fields["bytes"] = raw.get("bytes", fields.get("bytes", 0))
        return cls(
            result=RangeResult(**fields),
            relations=list(raw.get("relations", [])),
            types=dict(raw.get("types", {})),
            bytes=int(raw.get("bytes", 0)),
            format_version=int(raw.get("format_version", FORMAT_VERSION)),
            chain_last_commit=raw.get("chain_last_commit"),
        )


SNAPSHOT_IN_PROGRESS = "snapshot_in_progress"
CHAIN_COMPLETE = "complete"
RECOVERING = "recovering"
"""A recovery of a lost slot (:mod:`..compare.recover`) began and has not finished: the chain
keeps its tables, and catch-up refuses until ``pgcdc recover`` ends it at a new point."""


@dataclass(frozen=True)
class Chain:
    """Where the current base snapshot's ranges begin, or that a snapshot is under way, and
    how much of the chain's start was pruned.

    The base snapshot writes ``snapshot_in_progress`` before it touches the slot or the target
    and ``complete`` (with the consistent point) as its very last step: a snapshot killed at any
    point in between leaves a chain that catch-up refuses and the next snapshot redoes.

    A prune (:mod:`.retention`) records ``pruned_through`` *before* it removes a folder: the
    chain's ranges up to there were applied and removed, so the chain now begins there, with
    ``pruned_last_commit`` standing in for the removed ranges' record of their last COMMIT.
    """

    slot: str
    state: str
    consistent_point: Lsn | None = None
    snapshot: str | None = None
    started_at: str | None = None
    pruned_through: Lsn | None = None
    pruned_last_commit: Lsn | None = None
    pruned_at: float | None = None
    """When a prune last looked (Unix time), whether or not it removed anything: prunes are
    spaced by this, across processes."""
    tables: tuple[TableName, ...] = ()
    """The tables the chain replicates: those its base snapshot copied, and those added since
    (``pgcdc add-table``). A table here that the publication no longer sends is no longer
    kept in sync on the target (:func:`~..control.pipeline.no_longer_published`)."""
    unpublished: dict[TableName, tuple[str, ...]] = field(default_factory=dict)
    """Per table, the columns the publication's column list left out when the table was
    copied (:class:`~..published_columns.PublishedShape`): the target keeps them, empty, and the
    apply takes their absence from the stream for that, not for a column dropped on the source."""
    row_filters: dict[TableName, str | None] = field(default_factory=dict)
    """Per table, the publication's row filter when the table was copied (``None``: none).
    A filter changed since leaves the target as the old one made it, as with native
    replication: rows that pass only the new one were never copied, rows that pass only the
    old one stay (:func:`~..control.pipeline.tables_agreement`). A table copied before filters were
    recorded is absent: not compared."""
    adding: tuple[TableName, ...] = ()
    """Tables an add (``pgcdc add-table``) began to copy and has not finished: their rows on
    the target may be partial, so every apply holds their changes back (applying the other
    tables') until their add applies those and records them as added."""
    resyncing: tuple[TableName, ...] = ()
    """Of :attr:`adding`, the tables being copied again (``pgcdc resync``, or an apply that met
    DDL it cannot follow): replicated already, so a catch-up finishes a resync that was killed
    (:func:`~..control.pipeline.apply_stored_range`), where an add waits for ``pgcdc add-table``."""
    synced_from: dict[TableName, Lsn] = field(default_factory=dict)
    """Per table added after the base snapshot, its own copy's consistent point: the copy
    holds its changes committed at or before it, so the apply skips those in the stream."""
    copying_at: Lsn | None = None
    """While a base snapshot is under way (``snapshot_in_progress``), its slot's consistent
    point once the slot exists: the copy records on the target what it finished at that point
    (:mod:`~..snapshot.copied_ranges`), and the next snapshot resumes from there
    (:mod:`~..snapshot.resume`)."""
    finished_at: Lsn | None = None
    """The replication was ended (``pgcdc finish``, :mod:`..control.finish`) with the target's
    origin here: its slot is dropped, and nothing follows it again until a new base snapshot."""
    timeline: int | None = None
    """The source's WAL timeline the chain's positions belong to: the one its base snapshot
    (or recovery) was taken on, moved on by :meth:`OutputStore.record_timeline` once a
    promotion's switch point was dealt with (:mod:`..control.failover`). ``None``: a chain
    recorded before timelines were."""
    system_id: str | None = None
    """The source cluster's ``IDENTIFY_SYSTEM`` identifier when :attr:`timeline` was read."""

    @property
    def complete(self) -> bool:
        return self.state == CHAIN_COMPLETE and self.consistent_point is not None

    @property
    def finished(self) -> str | None:
        """What to say of a replication that was ended (:attr:`finished_at`), with the way
        to start again; ``None`` while it runs."""
        if self.finished_at is None:
            return None
        return (
            f"the replication was finished at {self.finished_at} (pgcdc finish): its slot is "
            "dropped, nothing follows it; pgcdc snapshot --resnapshot starts a new one"
        )

    @property
    def start(self) -> Lsn | None:
        """Where the chain's stored ranges begin: past the pruned ones, else the consistent
        point (``None`` when the snapshot is not complete)."""
        if not self.complete:
            return None
        return self.pruned_through or self.consistent_point


def _put_tables(
    record: dict[str, Any],
    tables: Sequence[TableName],
    unpublished: Mapping[TableName, Sequence[str]],
    row_filters: Mapping[TableName, str | None],
    adding: Sequence[TableName] = (),
    synced_from: Mapping[TableName, Lsn] | None = None,
    resyncing: Sequence[TableName] = (),
) -> None:
    """Write a chain's per-table fields (:attr:`Chain.tables`, :attr:`Chain.unpublished`,
    :attr:`Chain.row_filters`, :attr:`Chain.adding`, :attr:`Chain.synced_from`) into its
    ``record``, each only when it holds something."""
    if tables:
        record["tables"] = [[t.schema, t.name] for t in sorted(tables)]
    if any(unpublished.values()):
        record["unpublished"] = [
            [t.schema, t.name, list(cols)] for t, cols in sorted(unpublished.items()) if cols
        ]
    if row_filters:
        record["row_filters"] = [[t.schema, t.name, f] for t, f in sorted(row_filters.items())]
    if adding:
        record["adding"] = [[t.schema, t.name] for t in sorted(adding)]
    if resyncing:
        record["resyncing"] = [[t.schema, t.name] for t in sorted(resyncing)]
    if synced_from:
        record["synced_from"] = [[t.schema, t.name, str(x)] for t, x in sorted(synced_from.items())]


@dataclass(frozen=True)
class StoredRange:
    range: LsnRange
    path: Path
    manifest: RangeManifest

    @property
    def store_root(self) -> Path:
        """The root of the store the range lies in (in its bucket, or directly under
        ``changes/`` when stored before buckets)."""
        folder = self.path.parent
        if folder.name != "changes":  # a bucket: changes/<hi>/<mid>
            folder = folder.parent.parent
        return folder.parent

    @property
    def transform_lsn(self) -> Lsn | None:
        """End of the range's last COMMIT; ``None`` when it holds no transaction."""
        value = self.manifest.result.transform_lsn
        return None if value is None else Lsn.parse(value)

    @property
    def chain_last_commit(self) -> Lsn | None:
        """See :attr:`RangeManifest.chain_last_commit`."""
        value = self.manifest.chain_last_commit
        return None if value is None else Lsn.parse(value)

    @property
    def last_commit_known(self) -> Lsn | None:
        """The chain's last COMMIT up to this range's end as the range itself knows it: its
        record, else its own last COMMIT; ``None`` when it knows neither (an empty range
        stored without the record)."""
        return self.chain_last_commit or self.transform_lsn

    @property
    def safe_point(self) -> Lsn:
        """Where the slot may be confirmed once this range is stored."""
        return Lsn.parse(self.manifest.result.safe_point)

    @property
    def changes(self) -> int:
        return self.manifest.result.changes

    @property
    def files(self) -> list[Path]:
        return sorted(self.path.glob("part-*.parquet"))

    def read_table(self, columns: Sequence[str] | None = None) -> pa.Table:
        """The range's changes (only ``columns``, when named), typed as :data:`CHANGE_SCHEMA`.

        Read file by file with :class:`pyarrow.parquet.ParquetFile`, not ``pq.read_table``: the
        dataset layer behind the latter imports pandas the first time (a noticeable cost in a
        process that had not, such as a cold command's follower) and adds nothing for files written
        whole with this schema."""
        schema = (
            CHANGE_SCHEMA
            if columns is None
            else pa.schema([CHANGE_SCHEMA.field(name) for name in columns])
        )
        files = self.files
        if not files:
            return schema.empty_table()
        tables = []
        for path in files:
            with pq.ParquetFile(path) as parquet:
                table = parquet.read(columns=schema.names)
            tables.append(table if table.schema.equals(schema) else table.cast(schema))
        return pa.concat_tables(tables)

    def iter_batches(self, columns: Sequence[str], batch_rows: int = 65_536) -> Iterator[pa.Table]:
        """The range's changes (only ``columns``) in batches of at most ``batch_rows``, file by
        file: a range of any size read in bounded memory (:mod:`..apply.partitioned_staging`)."""
        schema = pa.schema([CHANGE_SCHEMA.field(name) for name in columns])
        for path in self.files:
            with pq.ParquetFile(path) as parquet:
                for batch in parquet.iter_batches(batch_size=batch_rows, columns=schema.names):
                    table = pa.Table.from_batches([batch])
                    yield table if table.schema.equals(schema) else table.cast(schema)

    def relation_versions(self) -> set[int]:
        """The relation versions (indexes into the manifest's ``relations``) the range's rows
        use. The manifest may list more: a range cut from a peek starts with every relation
        the peek had seen, and pgoutput sends a partition's own Relation message beside its
        root's when it publishes through the root (under a column list, narrowed like the
        root's), though every change names the root."""
        used: set[int] = set()
        for batch in self.iter_batches(["relation_version"], batch_rows=1_048_576):
            used.update(pc.unique(batch.column("relation_version")).to_pylist())
        return used


MANIFESTS_KEPT = 256
"""Stored ranges an :class:`OutputStore` keeps read (the most recently used): a follow's
receiver writes through one store for as long as it runs, and keeping every range it stored
would grow it with every range, without end; bounded, it stays small (see
``benchmarks/HISTORY.md``, "Figures moved from the README" and "Figures moved from
docstrings")."""
ENDS_SEEN = 4096
"""Range ends a process remembers per store (the latest seen)."""


@dataclass
class _Seen:
    """What this process saw stored of one store's ranges, by end, shared by every
    :class:`OutputStore` on it. A follow stores a range every few hundred milliseconds for as
    long as it runs, so a store may hold hundreds of thousands of ranges: the per-range paths
    (the gap check before an apply, the origin a range must leave) look a range up by its end
    and must not walk the store each time.
    Bounded (:data:`ENDS_SEEN`, the oldest forgotten first): those paths ask for recent ends;
    an end forgotten, or never seen, is found by a walk back (:meth:`OutputStore.walk`)."""

    by_end: dict[Lsn, LsnRange] = field(default_factory=dict)
    """For equal ends (ranges of two chains) the one that starts last."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    """A prune lists the store in a thread of its own while a receiver stores ranges."""

    def stored(self, rng: LsnRange) -> None:
        with self.lock:
            known = self.by_end.pop(rng.end, None)
            self.by_end[rng.end] = rng if known is None or known.start <= rng.start else known
            while len(self.by_end) > ENDS_SEEN:
                del self.by_end[next(iter(self.by_end))]


_SEEN: dict[Path, _Seen] = {}


class OutputStore:
    """A local-filesystem output store rooted at ``root``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.changes_dir = self.root / "changes"
        self.streaming_dir = self.root / "streaming"
        """Where a stream session holds transactions received ahead of their COMMIT
        (:mod:`..source.streamed`): scratch of the one receiver, never a range."""
        self._manifests: OrderedDict[LsnRange, StoredRange] = OrderedDict()
        self._seen = _SEEN.setdefault(self.changes_dir.absolute(), _Seen())

    def bucket_of(self, start: Lsn) -> Path:
        """The folder of the ranges starting in ``start``'s 16 MiB of WAL."""
        hi, mid = bucket_names(start)
        return self.changes_dir / hi / mid

    def scratch_of(self, start: Lsn) -> Path:
        """The folder a writer of a range starting at ``start`` writes in, inside its bucket
        (see :class:`RangeWriter`)."""
        return self.bucket_of(start) / f".tmp-{start.hex16}"

    def drop_scratch(self, start: Lsn) -> None:
        """Remove the scratch folder of the stored range starting at ``start`` if its writer,
        killed after the range's rename and before its own ``rmdir``, left it there, empty: no
        writer of that start comes again to sweep it, and it would keep its bucket from going
        once a prune empties it. One ``rmdir``; a scratch that holds anything is left alone."""
        with contextlib.suppress(OSError):  # none there, or it holds a write
            os.rmdir(self.scratch_of(start))

    def range_path(self, rng: LsnRange) -> Path:
        """Where ``rng`` is stored: in its bucket, or directly under ``changes/`` when it was
        stored before buckets (one more ``stat``, paid by those and by ranges not stored)."""
        path = self.bucket_of(rng.start) / rng.key
        if path.is_dir():
            return path
        flat = self.changes_dir / rng.key
        return flat if flat.is_dir() else path

    def get(self, rng: LsnRange) -> StoredRange | None:
        """The stored range, or ``None``. A stored range never changes, so it is read once."""
        cached = self._manifests.get(rng)
        if cached is not None:
            self._manifests.move_to_end(rng)
            return cached
        path = self.range_path(rng)
        try:
            manifest = RangeManifest.from_json((path / MANIFEST).read_text())
        except FileNotFoundError:
            return None
        return self._keep(StoredRange(rng, path, manifest))

    def holds(self, rng: LsnRange) -> bool:
        """Whether ``rng`` is stored: a ``stat`` or two, whatever the store's size (a folder
        appears only by the atomic rename of a complete one, and a pruned one is renamed away
        first)."""
        return self.range_path(rng).is_dir()

    def _keep(self, stored: StoredRange) -> StoredRange:
        self._manifests[stored.range] = stored
        self._manifests.move_to_end(stored.range)
        while len(self._manifests) > MANIFESTS_KEPT:
            self._manifests.popitem(last=False)
        return stored

    def ranges(self) -> list[LsnRange]:
        """Every stored range, in LSN order: a walk of the whole store, for the few callers
        that need it all (a person's ``pgcdc status``, tests); the others :meth:`walk` as far
        as they need."""
        return list(self.walk())

    def walk(self, start: Lsn | None = None, *, reverse: bool = False) -> Iterator[LsnRange]:
        """Stored ranges in LSN order from ``start`` (those starting at or after it; ``None``:
        from the first), or with ``reverse`` backwards from it (those starting at or before
        it; ``None``: from the last). Lazy: a bucket is listed when the walk reaches it, so a
        walk that stops after a few ranges costs a few small listings, whatever the store
        holds. A folder appears only by the atomic rename of a complete range, so what a
        listing shows is stored."""
        for name in self._names(start, reverse):
            yield LsnRange.from_key(name)

    def _names(self, start: Lsn | None, reverse: bool) -> Iterator[str]:
        """The names of the stored ranges' folders in order (fixed-width hex: they sort as
        their LSNs do), from the first starting at or after ``start``, or at or before it with
        ``reverse``: the ranges directly under ``changes/`` (the layout before buckets) merged
        with those of the buckets, listed as they are reached."""
        bound = None if start is None else start.hex16
        first_hi, first_mid = ("", "") if start is None else bucket_names(start)
        top = _listed(self.changes_dir, reverse)
        flat = [n for n in top if len(n) == RANGE_KEY_LENGTH]
        tree = self._bucket_names([n for n in top if len(n) == 8], first_hi, first_mid, reverse)
        for name in heapq.merge(flat, tree, reverse=reverse):
            if bound is None or (name[:16] <= bound if reverse else name[:16] >= bound):
                yield name

    def _bucket_names(
        self, his: list[str], first_hi: str, first_mid: str, reverse: bool
    ) -> Iterator[str]:
        def before(name: str, first: str) -> bool:  # not yet reached by the walk
            return bool(first) and (name > first if reverse else name < first)

        for hi in his:
            if before(hi, first_hi):
                continue
            for mid in _listed(self.changes_dir / hi, reverse):
                if hi == first_hi and before(mid, first_mid):
                    continue
                yield from _listed(self.changes_dir / hi / mid, reverse)

    def range_ending_at(self, end: Lsn) -> StoredRange | None:
        """The stored range that ends at ``end`` (the one that starts last, if several do)."""
        return next(self.ranges_before(end), None)

    def last_commit_before(self, start: Lsn) -> Lsn | None:
        """The end of the last COMMIT the current chain stores before ``start`` (the
        consistent point when it stores none): where the target's origin stands once every
        range before ``start`` is applied. ``None`` when unknown: no complete chain, ``start``
        before it, or no stored range ends where the walk back needs one.

        One step back in the common case (the range before records it, see
        :attr:`RangeManifest.chain_last_commit`); ranges stored without that record are
        walked back to the last one holding a transaction. The walk stops at the chain's
        pruned start, whose record stands in for the ranges a prune removed."""
        chain = self.chain()
        point = None if chain is None or not chain.complete else chain.consistent_point
        if chain is None or point is None or start < point:
            return None
        if start == point:
            return point
        if start == chain.pruned_through:
            return chain.pruned_last_commit
        for previous in self.ranges_before(start):
            known = previous.last_commit_known
            if known is not None:
                return known
            if previous.range.start <= point:
                return point if previous.range.start == point else None
            if previous.range.start == chain.pruned_through:
                return chain.pruned_last_commit
        return None

    def last_commit_through(self, stored: StoredRange) -> Lsn | None:
        """The end of the last COMMIT the current chain stores up to ``stored``'s end: its
        record, else its own last COMMIT, else :meth:`last_commit_before` its start."""
        known = stored.last_commit_known
        return known if known is not None else self.last_commit_before(stored.range.start)

    def ranges_before(self, end: Lsn) -> Iterator[StoredRange]:
        """The stored range that ends at ``end``, then the one that ends where it starts, and
        so on back, until no stored range ends there. Each step is a range this process saw
        stored, checked by its folder alone, while it knows them; from the first it does not,
        the rest come from one walk back (:meth:`walk`) from there.

        Of ranges ending alike (only ranges of two chains can), the one that starts last is
        taken; the walk back stops at the first range ending before ``end``: in a chain, the
        range before another ends where it starts."""
        walked: Iterator[LsnRange] | None = None
        cursor = end
        while True:
            rng = None if walked is not None else self._seen.by_end.get(cursor)
            if rng is None or not self.holds(rng):
                if walked is None:
                    walked = self.walk(Lsn(cursor - 1), reverse=True) if cursor > 0 else iter(())
                rng = _ending_at(walked, cursor)
            if rng is None or rng.start >= cursor:
                return
            stored = self.get(rng)
            if stored is None:
                return
            yield stored
            cursor = rng.start

    def writer(self, rng: LsnRange) -> RangeWriter:
        return RangeWriter(self, rng)

    # -- the chain: where the current base snapshot's ranges begin ---------------------------

    def begin_snapshot(self, slot: str) -> None:
        """Record, durably, that a base snapshot of ``slot`` is under way: from here until
        :meth:`record_chain`, catch-up refuses to run and the next snapshot redoes this one."""
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        with self.chain_lock():
            self._write_chain({"slot": slot, "state": SNAPSHOT_IN_PROGRESS, "started_at": started})

    def record_copying_at(self, slot: str, consistent_point: Lsn, snapshot_name: str) -> None:
        """Record, durably, that the snapshot under way of ``slot`` created its slot at
        ``consistent_point`` (:attr:`Chain.copying_at`), exporting ``snapshot_name``, before
        any row is copied there."""
        with self.chain_lock() as chain:
            if chain is None or chain.state != SNAPSHOT_IN_PROGRESS or chain.slot != slot:
                raise StoreError(f"no base snapshot of slot {slot} is under way in the store")
            record = {
                "slot": slot,
                "state": SNAPSHOT_IN_PROGRESS,
                "started_at": chain.started_at,
                "copying_at": str(consistent_point),
                "snapshot": snapshot_name,
            }
            self._write_chain(record)

    def begin_recovering(self) -> Chain:
        """Record, durably, that a recovery of the current chain's lost slot is under way
        (:data:`RECOVERING`), keeping everything else the record says: from here until
        :meth:`record_chain` at the recovery's point, catch-up refuses to run and the next
        ``pgcdc recover`` redoes it. Returns the chain as it stood."""
        with self.chain_lock() as chain:
            if chain is None or chain.consistent_point is None:
                raise StoreError(
                    "there is no complete base snapshot in the store: take one (pgcdc snapshot)"
                )
            if chain.state != RECOVERING:
                started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                record = self._record_of(chain)
                record.update(state=RECOVERING, started_at=started)
                self._write_chain(record)
            return chain

    def record_chain(
        self,
        slot: str,
        consistent_point: Lsn,
        snapshot_name: str,
        tables: Sequence[TableName] = (),
        shapes: Mapping[TableName, PublishedShape] | None = None,
        resyncing: Sequence[TableName] = (),
        *,
        timeline: int | None = None,
        system_id: str | None = None,
    ) -> None:
        """Start a new chain of ranges at a base snapshot's consistent point: the snapshot's
        last step, after the target's origin is set. ``timeline`` and ``system_id``: the
        source's when the slot was created (:attr:`Chain.timeline`). ``tables``: those it
        copied; ``shapes``: what the publication sent of those it narrowed then
        (:attr:`Chain.unpublished`, :attr:`Chain.row_filters`). ``resyncing``: of ``tables``,
        those a resumed snapshot still has to copy (:mod:`~..snapshot.resume`), recorded as
        being copied again (:attr:`Chain.adding` and :attr:`Chain.resyncing`): their changes
        are held back until a resync copies them, as of a point of their own.

        Ranges of an earlier chain (before a re-snapshot) stay as history: they end before the
        new consistent point, since a new slot starts at the WAL position of its creation.
        """
        copied = [t for t in tables if t not in set(resyncing)]
        chain = Chain(
            slot,
            CHAIN_COMPLETE,
            consistent_point,
            snapshot_name,
            tables=tuple(tables),
            unpublished=unpublished_columns(shapes or {}),
            row_filters=row_filters(copied, shapes or {}),
            adding=tuple(sorted(resyncing)),
            resyncing=tuple(sorted(resyncing)),
            timeline=timeline,
            system_id=system_id,
        )
        with self.chain_lock():
            self._write_chain(self._record_of(chain))

    def record_timeline(self, timeline: int, system_id: str) -> None:
        """Record that the chain's positions now belong to the source's ``timeline``
        (:attr:`Chain.timeline`), keeping everything else the record says, its state
        included (a recovery under way stays under way)."""
        with self.chain_lock() as chain:
            if chain is None:
                raise StoreError("there is no base snapshot in the store to record a timeline of")
            record = json.loads((self.root / CHAIN).read_text())
            record.update(timeline=timeline, system_id=system_id)
            self._write_chain(record)

    def drop_ranges_after(self, point: Lsn) -> list[LsnRange]:
        """Take out of the store every range that ends past ``point`` (the switch point of a
        promotion: what they hold past it is on no timeline the source knows, and their LSNs
        will name other WAL there), each in one rename (:meth:`hide_range`), and return them.
        Ranges of earlier chains too: they end where later ones begin, so a walk back from the
        last stops at the first range that ends at or before ``point``. Idempotent: a crash
        midway leaves ranges that the next call takes out, and hidden folders that
        :meth:`sweep_removed` deletes."""
        dropped = []
        for rng in self.walk(reverse=True):
            if rng.end <= point:
                break
            dropped.append(rng)
        for rng in dropped:
            hidden = self.hide_range(rng)
            if hidden is not None:
                remove_folder(hidden)
        return dropped

    @contextlib.contextmanager
    def chain_lock(self) -> Iterator[Chain | None]:
        """Hold the store's chain record against other writers, across processes (an advisory
        ``flock``, released by the kernel when a holder dies), and yield it as it stands.

        A prune reads the record, decides and writes it back: without the lock a snapshot
        beginning in between would have its ``snapshot_in_progress`` overwritten with the old
        complete chain, and catch-up would run against a half-made target."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / CHAIN_LOCK, "a+b") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield self.chain()
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def record_pruned(
        self, chain: Chain, through: Lsn | None, last_commit: Lsn | None, at: float
    ) -> None:
        """Record (the caller holds :meth:`chain_lock` and read ``chain`` under it) that the
        current chain's ranges up to ``through`` are pruned, with the last COMMIT they held;
        ``through=None`` records only that a prune looked at ``at``. Never moves backwards."""
        if not chain.complete or chain.consistent_point is None:
            raise StoreError("a prune needs a complete base snapshot in the store")
        before = chain.pruned_through
        if through is None or (before is not None and through <= before):
            through, last_commit = chain.pruned_through, chain.pruned_last_commit
        pruned = dataclasses.replace(
            chain, pruned_through=through, pruned_last_commit=last_commit, pruned_at=at
        )
        self._write_chain(self._record_of(pruned))

    def begin_adding(self, tables: Sequence[TableName], *, resync: bool = False) -> None:
        """Record, durably, that ``tables`` are being added to the current chain
        (:attr:`Chain.adding`; ``resync``: copied again, :attr:`Chain.resyncing`): from here
        until :meth:`record_added`, the applies hold their changes back."""
        with self.chain_lock() as chain:
            complete = self._complete(chain)
            adding = sorted({*complete.adding, *tables})
            resyncing = sorted({*complete.resyncing, *(tables if resync else ())})
            self._write_chain(self._record_of(complete, adding=adding, resyncing=resyncing))

    def record_added(
        self,
        tables: Sequence[TableName],
        consistent_point: Lsn,
        shapes: Mapping[TableName, PublishedShape],
    ) -> None:
        """Record that ``tables`` were copied as of ``consistent_point`` (their own copy's):
        they leave :attr:`Chain.adding` and enter :attr:`Chain.synced_from`, with what their
        publication sent of them then (``shapes``: the columns it left out, its row filter)."""
        with self.chain_lock() as chain:
            complete = self._complete(chain)
            done = set(tables)
            self._write_chain(
                self._record_of(
                    complete,
                    unpublished={
                        **{t: c for t, c in complete.unpublished.items() if t not in done},
                        **unpublished_columns({t: s for t, s in shapes.items() if t in done}),
                    },
                    row_filters={**complete.row_filters, **row_filters(tables, shapes)},
                    tables=sorted({*complete.tables, *done}),
                    adding=[t for t in complete.adding if t not in done],
                    resyncing=[t for t in complete.resyncing if t not in done],
                    synced_from={**complete.synced_from, **dict.fromkeys(done, consistent_point)},
                )
            )

    def record_renamed(self, renamed: Sequence[tuple[TableName, TableName]]) -> None:
        """Record that tables were renamed on the target as on the source (the apply did it,
        :mod:`..apply.ddl`): their per-table fields move to the new names. After a crash between
        the apply's commit and this, the chain keeps a name the target no longer has: never
        reported as a stale copy (it is not on the target), and the new name's filter and
        column list are not compared (as for a table copied before they were recorded)."""
        with self.chain_lock() as chain:
            complete = self._complete(chain)
            new = dict(renamed)

            def moved(tables: Sequence[TableName]) -> list[TableName]:
                return sorted({new.get(t, t) for t in tables})

            def moved_keys(fields: Mapping[TableName, Any]) -> dict[TableName, Any]:
                return {new.get(t, t): v for t, v in fields.items()}

            self._write_chain(
                self._record_of(
                    complete,
                    tables=moved(complete.tables),
                    unpublished=moved_keys(complete.unpublished),
                    row_filters=moved_keys(complete.row_filters),
                    adding=moved(complete.adding),
                    resyncing=moved(complete.resyncing),
                    synced_from=moved_keys(complete.synced_from),
                )
            )

    def record_finished(self, at: Lsn) -> None:
        """Record that the current chain's replication is ended, the target at ``at``
        (:attr:`Chain.finished_at`; a later call keeps the first position)."""
        with self.chain_lock() as chain:
            complete = self._complete(chain)
            if complete.finished_at is None:
                finished = dataclasses.replace(complete, finished_at=at)
                self._write_chain(self._record_of(finished))

    @staticmethod
    def _complete(chain: Chain | None) -> Chain:
        if chain is None or not chain.complete:
            raise StoreError(
                "there is no complete base snapshot in the store: take one (pgcdc snapshot) first"
            )
        return chain

    @staticmethod
    def _record_of(chain: Chain, **tables: Any) -> dict[str, Any]:
        """``chain``'s record, its per-table fields replaced by ``tables``'s."""
        record: dict[str, Any] = {
            "slot": chain.slot,
            "state": CHAIN_COMPLETE,
            "consistent_point": str(chain.consistent_point),
            "snapshot": chain.snapshot,
        }
        if chain.pruned_at is not None:
            record["pruned_at"] = chain.pruned_at
        if chain.pruned_through is not None:
            record["pruned_through"] = str(chain.pruned_through)
            last = chain.pruned_last_commit
            record["pruned_last_commit"] = None if last is None else str(last)
        if chain.finished_at is not None:
            record["finished_at"] = str(chain.finished_at)
        if chain.timeline is not None:
            record["timeline"] = chain.timeline
            record["system_id"] = chain.system_id
        fields = {
            "tables": chain.tables,
            "unpublished": chain.unpublished,
            "row_filters": chain.row_filters,
            "adding": chain.adding,
            "synced_from": chain.synced_from,
            "resyncing": chain.resyncing,
        }
        _put_tables(record, **{**fields, **tables})
        return record

    def hide_range(self, rng: LsnRange) -> str | None:
        """Take a stored range out of the store (a prune's, whose chain record already says
        so) by renaming it to a hidden folder: it vanishes from every reader at once. Returns
        that folder, for :func:`remove_folder`; ``None`` when another prune took it first.
        Its bucket goes too once empty (a writer that finds its bucket gone makes it again,
        see :meth:`make_bucket`)."""
        hidden = os.path.join(self.changes_dir, PRUNED_PREFIX + rng.key)
        try:
            os.rename(self.range_path(rng), hidden)
        except FileNotFoundError:
            return None
        self._manifests.pop(rng, None)
        bucket = self.bucket_of(rng.start)
        for folder in (bucket, bucket.parent):
            try:
                os.rmdir(folder)
            except OSError:  # not empty, or gone
                break
        return hidden

    def make_bucket(self, start: Lsn) -> Path:
        """The bucket of ranges starting at ``start``, made (and its making made durable) if
        it was not there."""
        bucket = self.bucket_of(start)
        self.root.mkdir(parents=True, exist_ok=True)
        for folder in (self.changes_dir, bucket.parent, bucket):
            try:
                folder.mkdir()  # FileNotFoundError: a prune removed the one above meanwhile
            except FileExistsError:
                continue
            _fsync_path(folder.parent)
        return bucket

    def sweep_removed(self) -> None:
        """Delete what a prune killed mid-removal left hidden, and what a writer of the layout
        before buckets, killed mid-write, left (a writer now sweeps its own, in its bucket)."""
        if self.changes_dir.is_dir():
            for left in self.changes_dir.glob(".*"):
                if left.name.startswith(PRUNED_PREFIX):
                    remove_folder(str(left))
                elif left.name.startswith(".tmp-") and left.is_dir():
                    shutil.rmtree(left, ignore_errors=True)

    def _write_chain(self, chain: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{CHAIN}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(chain, indent=1, sort_keys=True))
        _fsync_path(tmp)
        os.replace(tmp, self.root / CHAIN)
        _fsync_path(self.root)

    def chain(self) -> Chain | None:
        try:
            raw = json.loads((self.root / CHAIN).read_text())
        except FileNotFoundError:
            return None
        point = raw.get("consistent_point")
        pruned = raw.get("pruned_through")
        pruned_commit = raw.get("pruned_last_commit")
        return Chain(
            slot=raw["slot"],
            # Chains written before snapshots recorded their state were always complete.
            state=raw.get("state", CHAIN_COMPLETE),
            consistent_point=None if point is None else Lsn.parse(point),
            snapshot=raw.get("snapshot"),
            started_at=raw.get("started_at"),
            pruned_through=None if pruned is None else Lsn.parse(pruned),
            pruned_last_commit=None if pruned_commit is None else Lsn.parse(pruned_commit),
            pruned_at=raw.get("pruned_at"),
            tables=tuple(TableName(schema, name) for schema, name in raw.get("tables", [])),
            unpublished={
                TableName(schema, name): tuple(columns)
                for schema, name, columns in raw.get("unpublished", [])
            },
            row_filters={
                TableName(schema, name): row_filter
                for schema, name, row_filter in raw.get("row_filters", [])
            },
            adding=tuple(TableName(schema, name) for schema, name in raw.get("adding", [])),
            resyncing=tuple(TableName(s, n) for s, n in raw.get("resyncing", [])),
            synced_from={
                TableName(schema, name): Lsn.parse(lsn)
                for schema, name, lsn in raw.get("synced_from", [])
            },
            finished_at=None if raw.get("finished_at") is None else Lsn.parse(raw["finished_at"]),
            copying_at=None if raw.get("copying_at") is None else Lsn.parse(raw["copying_at"]),
            timeline=raw.get("timeline"),
            system_id=raw.get("system_id"),
        )

    def consistent_point(self) -> Lsn:
        """The current chain's start; :class:`StoreError` naming the fix when there is no
        complete base snapshot."""
        chain = self.chain()
        if chain is None:
            raise StoreError(
                f"no base snapshot recorded in the output store {self.root}: take one first "
                "(pgcdc snapshot, or materialise base_snapshot)"
            )
        if chain.state == RECOVERING:
            raise StoreError(
                f"the recovery of slot {chain.slot} started at {chain.started_at} did not finish "
                "(the process was killed or failed): run pgcdc recover, which redoes it"
            )
        if not chain.complete or chain.consistent_point is None:
            raise StoreError(
                f"the base snapshot of slot {chain.slot} started at {chain.started_at} did not "
                "finish (the process was killed or failed): run pgcdc snapshot, which resumes "
                "it, keeping what it copied, or else takes it again"
            )
        return chain.consistent_point

    def chain_start(self) -> Lsn:
        """Where the current chain's stored ranges begin: the consistent point, or past the
        ranges a prune removed (:attr:`Chain.start`)."""
        self.consistent_point()  # refuses a missing or unfinished snapshot
        chain = self.chain()
        assert chain is not None and chain.start is not None
        return chain.start

    def chain_end(self) -> Lsn:
        """Where the next range of the current chain starts: the end of its last stored range,
        or the chain's start when none is stored (yet, or since a prune)."""
        last = self.last_chain_range()
        return last.end if last is not None else self.chain_start()

    def last_stored(self) -> StoredRange | None:
        """The last stored range of the current chain."""
        last = self.last_chain_range()
        return self.get(last) if last is not None else None

    def last_chain_range(self) -> LsnRange | None:
        """The current chain's last stored range: one step of a walk back from the end."""
        start = self.chain_start()
        last = next(self.walk(reverse=True), None)
        return last if last is not None and last.start >= start else None

    def chain_ranges(self) -> list[LsnRange]:
        """Stored ranges of the current chain past its pruned start, in LSN order: all of them
        (a week of a follow's is millions); :meth:`chain_from` takes the part a decision
        needs."""
        return list(self.walk(self.chain_start()))

    def chain_count(self) -> int:
        """How many ranges the current chain stores past its pruned start: folder names
        counted, not parsed (a person's figure; a week of a follow's is millions)."""
        return sum(1 for _ in self._names(self.chain_start(), reverse=False))

    def chain_from(self, lsn: Lsn) -> list[LsnRange]:
        """The current chain's stored ranges from the one ``lsn`` falls in (the last starting
        at or before it) on, in LSN order; from the chain's start when ``lsn`` lies before its
        first range. What a decision past ``lsn`` (the target's origin) needs: the ranges it
        may still have to apply, and where the chain ends, without the applied ones before."""
        start = self.chain_start()
        if lsn > start:
            holding = next(self.walk(lsn, reverse=True), None)
            if holding is not None and holding.start > start:
                start = holding.start
        return list(self.walk(start))


class RangeWriter:
    """Writes one range's Parquet files into a temporary folder and publishes it atomically."""

    def __init__(self, store: OutputStore, rng: LsnRange, row_group_rows: int = 131_072) -> None:
        self.store = store
        self.range = rng
        self.row_group_rows = row_group_rows
        # Written in a folder of its own start's, in the range's bucket: the rename into place
        # stays in one folder, and what a crash left of a write from this start (a receive
        # cut in several ends where it chose, see receive.receive_in_cuts) is that one folder,
        # swept without listing anything. One receiver at a time holds the range lock.
        self.tmp = Path()
        for attempt in range(3):
            try:
                store.make_bucket(rng.start)
                self._scratch = store.scratch_of(rng.start)
                shutil.rmtree(self._scratch, ignore_errors=True)
                self._scratch.mkdir()
                self.tmp = self._scratch / uuid.uuid4().hex[:8]
                self.tmp.mkdir()
                break
            except FileNotFoundError:  # a prune removed the bucket, empty, meanwhile
                if attempt == 2:
                    raise
        self._writer: pq.ParquetWriter | None = None
        self.rows = 0
        self._spill_seq = 0

    @contextlib.contextmanager
    def space_checked(self) -> Iterator[None]:
        """Writes of this range's files: a full file system (``ENOSPC``, a quota) is named in
        one line, :class:`StoreFullError`, with the store's path and the fix, instead of the
        file library's words (pyarrow's ``OSError: [Errno 28] Error writing bytes to
        file``)."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in _OUT_OF_SPACE and "No space left on device" not in str(exc):
                raise
            raise StoreFullError(
                f"the output store at {self.store.root} is out of space storing range "
                f"{self.range.key} ({os.strerror(exc.errno or errno.ENOSPC)}): free space "
                "there, or keep applied ranges for less time (pgcdc prune --retention 1d now; "
                "PGCDC_STORE_RETENTION); nothing of the range was stored, and the next command "
                "receives it again"
            ) from exc

    def write(self, batch: pa.RecordBatch | pa.Table) -> None:
        with self.space_checked():
            self._write(batch)

    def _write(self, batch: pa.RecordBatch | pa.Table) -> None:
        if batch.num_rows == 0:
            return
        if self._writer is None:
            self._writer = pq.ParquetWriter(
                self.tmp / "part-00000.parquet",
                CHANGE_SCHEMA,
                compression="zstd",
                compression_level=1,
                use_dictionary=["action", "schema_name", "table_name"],
                write_statistics=["commit_end_lsn", "lsn", "relation_version"],
            )
        table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
        self._writer.write_table(table, row_group_size=self.row_group_rows)
        self.rows += batch.num_rows

    def spill_path(self) -> Path:
        """A scratch file inside the temporary folder, gone with it."""
        self._spill_seq += 1
        return self.tmp / f".spill-{self._spill_seq:05d}.arrow"

    def commit(self, manifest: RangeManifest) -> StoredRange:
        """Close the files, write the manifest, fsync everything, rename into place.

        The range stored is the manifest's: it may end before the one the writer was opened
        for (a receive that cuts one peek into several ranges knows a range's end only once its
        rows are written), never start elsewhere."""
        with self.space_checked():
            return self._commit(manifest)

    def _commit(self, manifest: RangeManifest) -> StoredRange:
        stored_range = LsnRange.from_key(manifest.result.range_key)
        if stored_range.start != self.range.start or stored_range.end > self.range.end:
            raise StoreError(
                f"range {stored_range.key} cannot be stored by a writer for {self.range.key}"
            )
        self.range = stored_range
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for spill in self.tmp.glob(".spill-*"):
            spill.unlink()
        parquet_bytes = sum(f.stat().st_size for f in self.tmp.glob("part-*.parquet"))
        result = dataclasses.replace(manifest.result, bytes=parquet_bytes)
        mark = result.transform_lsn
        if mark is None:
            before = self.store.last_commit_before(self.range.start)
            mark = None if before is None else str(before)
        manifest = dataclasses.replace(
            manifest, result=result, bytes=parquet_bytes, chain_last_commit=mark
        )
        (self.tmp / MANIFEST).write_text(manifest.to_json())
        for f in self.tmp.iterdir():
            _fsync_path(f)
        _fsync_path(self.tmp)
        if self.store.holds(self.range):
            where = self.store.range_path(self.range)
            raise StoreError(f"range {self.range.key} is already stored at {where}")
        final = self._scratch.parent / self.range.key
        os.rename(self.tmp, final)
        _fsync_path(final.parent)
        failpoint("store.renamed")
        self._scratch.rmdir()
        stored = self.store._keep(StoredRange(self.range, final, manifest))
        self.store._seen.stored(self.range)
        return stored

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        shutil.rmtree(self._scratch, ignore_errors=True)

    def __enter__(self) -> RangeWriter:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if self.tmp.exists():
            self.abort()


def iter_batches(path: Path) -> Iterator[pa.RecordBatch]:
    """Stream an Arrow IPC spill file back batch by batch (memory stays one batch)."""
    with pa.OSFile(str(path), "rb") as source:
        reader = pa.ipc.open_file(source)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def remove_folder(path: str) -> int:
    """Delete a range's folder (files only, no subfolders); returns the Parquet bytes it held.
    Plain ``os`` calls: a prune removes thousands of ranges, and the kernel's unlinks and
    rmdir are most of what each costs."""
    removed = 0
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.name.startswith("part-"):
                    removed += entry.stat().st_size
                os.unlink(entry.path)
        os.rmdir(path)
    except FileNotFoundError:
        pass  # another prune got there first
    return removed


RANGE_KEY_LENGTH = 33
"""``<16 hex digits>-<16 hex digits>``: the name of a range's folder."""


def bucket_names(start: Lsn) -> tuple[str, str]:
    """The two folders a range starting at ``start`` is stored under: its 4 GiB of WAL (the
    ``X`` of ``X/Y``) and its 16 MiB within those, in fixed-width upper-case hex, so names sort
    as the LSNs do."""
    digits = start.hex16
    return digits[:8], digits[8:10]


def _listed(folder: Path, reverse: bool) -> list[str]:
    """The visible subfolders of ``folder``, sorted (none when it is gone: a bucket a prune
    emptied and removed)."""
    try:
        with os.scandir(folder) as entries:
            names = [e.name for e in entries if not e.name.startswith(".") and e.is_dir()]
    except FileNotFoundError:
        return []
    return sorted(names, reverse=reverse)


def _ending_at(walked: Iterator[LsnRange], end: Lsn) -> LsnRange | None:
    """The first range of a walk back that ends at ``end``; ``None`` once one ends before it
    (ranges ending after it, of another chain, are passed)."""
    for rng in walked:
        if rng.end == end:
            return rng
        if rng.end < end:
            return None
    return None


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
