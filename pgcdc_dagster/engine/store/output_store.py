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
``benchmarks/HISTORY.md``). Ranges stored directly under ``changes/`` (the flat layout of
older stores) are read too, and leave as the retention removes them.

The manifest is the store's single source of truth for "what each LSN range holds"; a range
exists exactly when its folder (with manifest) exists. A range is written into a hidden
temporary folder, fsynced, and renamed into place in one step, so a crash leaves either no
range or a complete one: never a half partition that looks complete. Readers ignore hidden
folders, and a writer sweeps stale ones of its own range before it starts.

The rooms of the store: a range's format and manifest (:mod:`.range_format`), the chain
record and its codec (:mod:`.chain`), the folders on disk (:mod:`.layout`), the atomic writer
(:mod:`.range_writer`). This module is the one owner of every durable write of the store (the
chain under its lock, a range through its writer): the store's durable facts are written
nowhere else. Every name of those rooms is importable from here too.
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from pathlib import Path
from typing import Any

from ..identifiers import TableName
from ..lsn import Lsn, LsnRange
from ..published_columns import PublishedShape, row_filters, unpublished_columns
from .chain import (
    CHAIN_COMPLETE,
    RECOVERING,
    SNAPSHOT_IN_PROGRESS,
    Chain,
    chain_record,
    complete_chain,
    parse_chain,
)
from .errors import StoreError, StoreFullError
from .layout import (
    CHAIN,
    CHAIN_LOCK,
    PRUNED_PREFIX,
    RANGE_KEY_LENGTH,
    bucket_names,
    ending_at,
    fsync_path,
    listed,
    remove_folder,
)
from .range_format import (
    CHANGE_SCHEMA,
    FORMAT_VERSION,
    MANIFEST,
    EndposOutcome,
    RangeManifest,
    RangeResult,
    StoredRange,
)
from .range_writer import RangeWriter, iter_batches

__all__ = [
    "CHAIN",
    "CHAIN_COMPLETE",
    "CHAIN_LOCK",
    "CHANGE_SCHEMA",
    "FORMAT_VERSION",
    "MANIFEST",
    "PRUNED_PREFIX",
    "RANGE_KEY_LENGTH",
    "RECOVERING",
    "SNAPSHOT_IN_PROGRESS",
    "Chain",
    "EndposOutcome",
    "OutputStore",
    "RangeManifest",
    "RangeResult",
    "RangeWriter",
    "StoreError",
    "StoreFullError",
    "StoredRange",
    "bucket_names",
    "iter_batches",
    "remove_folder",
]


MANIFESTS_KEPT = 256
"""Stored ranges an :class:`OutputStore` keeps read (the most recently used): a follow's
receiver writes through one store for as long as it runs, and keeping every range it stored
would grow it with every range, without end; bounded, it stays small (see
``benchmarks/HISTORY.md``, "A follow that runs for days")."""
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
    """A local-filesystem output store rooted at ``root`` (an object store's is
    :class:`~.object_store.ObjectOutputStore`; :func:`open_store` opens either)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.changes_dir = self.root / "changes"
        self.streaming_dir = self.root / "streaming"
        """Where a stream session holds transactions received ahead of their COMMIT
        (:mod:`..source.streamed`): scratch of the one receiver, never a range."""
        self._manifests: OrderedDict[LsnRange, StoredRange] = OrderedDict()
        self._seen = _SEEN.setdefault(self.changes_dir.absolute(), _Seen())

    def reopened(self) -> OutputStore:
        """Another handle on the same store, with caches of its own (a thread's)."""
        return OutputStore(self.root)

    @property
    def where(self) -> str:
        """The store in a message: its folder (an object store's URL)."""
        return str(self.root)

    @property
    def url(self) -> str:
        """Where the store is, for people and the UI: a ``file://`` URL (an object store's
        is its bucket's, :mod:`.object_store`)."""
        return self.root.absolute().as_uri()

    def range_uri(self, rng: LsnRange) -> str:
        """Where ``rng`` is stored, as a URL (the UI's ``dagster/uri``)."""
        return self.range_path(rng).absolute().as_uri()

    def stored_at(self, rng: LsnRange) -> float:
        """When ``rng`` was stored (its manifest is written once, just before the rename), in
        seconds since the epoch; infinity when it is not stored (removed meanwhile). The
        manifest is not read: one ``stat``."""
        try:
            return os.stat(self.range_path(rng) / MANIFEST).st_mtime
        except FileNotFoundError:
            return float("inf")

    def remove_hidden(self, hidden: str) -> int:
        """Delete a range :meth:`hide_range` took out; the Parquet bytes it held."""
        return remove_folder(hidden)

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
        """Where ``rng`` is stored: in its bucket, or directly under ``changes/`` when it lies
        in the flat layout (one more ``stat``, paid by those and by ranges not stored)."""
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
        return self._keep(StoredRange(rng, path, manifest, self))

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
        ``reverse``: the ranges directly under ``changes/`` (the flat layout) merged
        with those of the buckets, listed as they are reached."""
        bound = None if start is None else start.hex16
        first_hi, first_mid = ("", "") if start is None else bucket_names(start)
        top = listed(self.changes_dir, reverse)
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
            for mid in listed(self.changes_dir / hi, reverse):
                if hi == first_hi and before(mid, first_mid):
                    continue
                yield from listed(self.changes_dir / hi / mid, reverse)

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
                rng = ending_at(walked, cursor)
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
                record = chain_record(chain)
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
            self._write_chain(chain_record(chain))

    def record_timeline(self, timeline: int, system_id: str) -> None:
        """Record that the chain's positions now belong to the source's ``timeline``
        (:attr:`Chain.timeline`), keeping everything else the record says, its state
        included (a recovery under way stays under way)."""
        with self.chain_lock() as chain:
            if chain is None:
                raise StoreError("there is no base snapshot in the store to record a timeline of")
            record = self._chain_raw() or {}
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
                self.remove_hidden(hidden)
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
        self._write_chain(chain_record(pruned))

    def begin_adding(self, tables: Sequence[TableName], *, resync: bool = False) -> None:
        """Record, durably, that ``tables`` are being added to the current chain
        (:attr:`Chain.adding`; ``resync``: copied again, :attr:`Chain.resyncing`): from here
        until :meth:`record_added`, the applies hold their changes back."""
        with self.chain_lock() as chain:
            complete = complete_chain(chain)
            adding = sorted({*complete.adding, *tables})
            resyncing = sorted({*complete.resyncing, *(tables if resync else ())})
            self._write_chain(chain_record(complete, adding=adding, resyncing=resyncing))

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
            complete = complete_chain(chain)
            done = set(tables)
            self._write_chain(
                chain_record(
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
            complete = complete_chain(chain)
            new = dict(renamed)

            def moved(tables: Sequence[TableName]) -> list[TableName]:
                return sorted({new.get(t, t) for t in tables})

            def moved_keys(fields: Mapping[TableName, Any]) -> dict[TableName, Any]:
                return {new.get(t, t): v for t, v in fields.items()}

            self._write_chain(
                chain_record(
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
            complete = complete_chain(chain)
            if complete.finished_at is None:
                finished = dataclasses.replace(complete, finished_at=at)
                self._write_chain(chain_record(finished))

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
            fsync_path(folder.parent)
        return bucket

    def sweep_unpublished(self, before: Lsn) -> int:
        """Delete the files of ranges starting before ``before`` that have no manifest (their
        writer was killed before publishing them) and return their bytes. On a disk there are
        none to find: a writer writes in a scratch folder named for its start, which the next
        writer of that start (there always is one) sweeps. ``before`` must be the start of a
        stored range of the chain: no writer writes before it."""
        del before
        return 0

    def sweep_removed(self) -> None:
        """Delete what a prune killed mid-removal left hidden, and the hidden scratch folders
        directly under ``changes/`` (a writer killed mid-write in the flat layout; a writer
        in a bucket sweeps its own)."""
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
        fsync_path(tmp)
        os.replace(tmp, self.root / CHAIN)
        fsync_path(self.root)

    def chain(self) -> Chain | None:
        raw = self._chain_raw()
        return None if raw is None else parse_chain(raw)

    def _chain_raw(self) -> dict[str, Any] | None:
        try:
            raw: dict[str, Any] = json.loads((self.root / CHAIN).read_text())
        except FileNotFoundError:
            return None
        return raw

    def consistent_point(self) -> Lsn:
        """The current chain's start; :class:`StoreError` naming the fix when there is no
        complete base snapshot."""
        point = self.complete_chain().consistent_point
        assert point is not None
        return point

    def complete_chain(self) -> Chain:
        """The chain record, read once (a GET on an object store); :class:`StoreError` naming
        the fix when there is no complete base snapshot."""
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
        return chain

    def chain_start(self) -> Lsn:
        """Where the current chain's stored ranges begin: the consistent point, or past the
        ranges a prune removed (:attr:`Chain.start`)."""
        start = self.complete_chain().start
        assert start is not None
        return start

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
