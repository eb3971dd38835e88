"""The output store on an object store (``PGCDC_STORE=s3://bucket/prefix``): the same ranges,
manifests and chain record as on a disk, committed without rename or lock.

Keys under the prefix mirror the local layout (:mod:`.output_store`)::

    changes/<hi>/<mid>/<range key>/part-00000.parquet
    changes/<hi>/<mid>/<range key>/_RANGE.json      written last: the range exists from here
    changes/.pruned/<range key>                      a prune's tombstone, until it is done
    _CHAIN.json                                      the chain record

Why a crash anywhere leaves the store as good as a disk's:

- **A range exists exactly when its manifest object does.** A writer uploads the range's
  Parquet files first, then creates the manifest with a conditional put (``If-None-Match:
  *``): an object store makes an object visible whole or not at all, so there is never a
  manifest without its files, and the slot is confirmed past a range only once that put
  returned (:mod:`..source.peek`, :mod:`..source.stream`). A writer killed before the put
  leaves files no walk lists (walks list manifests); the next writer of that range writes the
  same keys again, and one that ends elsewhere leaves them to a prune, which deletes them once
  a range it keeps lies past them (:meth:`ObjectOutputStore.sweep_unpublished`). A second
  writer of the same range loses the put and stores nothing.
- **The chain record is replaced only if unchanged since it was read** (``If-Match`` on its
  ETag, ``If-None-Match`` when there was none): every update is a read-modify-write under
  :meth:`ObjectOutputStore.chain_lock`, which on a disk is an ``flock``. A writer that lost
  the race fails in one line and changes nothing; one command at a time holds the target's
  range lock, so that only happens to a second command run beside it.
- **A prune takes a range out in one step, its manifest's delete**, after writing a tombstone
  naming it; then deletes its files, then the tombstone. Killed in between, the tombstone
  remains and the next prune finishes it (:meth:`ObjectOutputStore.sweep_removed`).

What stays local, in the store's work folder (:attr:`..store_location.StoreLocation.work_folder`):
a range while it is written (and its spill files), transactions spooled ahead of their
COMMIT, a big range's key-hash partitions. None of it is durable state.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from ..failpoints import failpoint
from ..lsn import Lsn, LsnRange
from ..store_location import StoreLocation
from .chain import Chain, parse_chain
from .errors import StoreError
from .layout import CHAIN, PRUNED_PREFIX, RANGE_KEY_LENGTH, bucket_names
from .objects import ObjectInfo, S3Objects
from .output_store import _SEEN, MANIFESTS_KEPT, OutputStore, _Seen
from .range_format import MANIFEST, RangeManifest, StoredRange
from .range_writer import RangeWriter

TOMBSTONES = "changes/.pruned/"

PARTS_KEPT_BYTES = 256 * 1024 * 1024
"""Parquet bytes of the latest ranges read that a store keeps in memory (:meth:`open_part`):
a follow's ranges are kilobytes, a big range tens of megabytes."""


@dataclass(frozen=True)
class ObjectStoredRange(StoredRange):
    """A range stored on an object store: its files are read from there."""

    @property
    def _store(self) -> ObjectOutputStore:
        assert isinstance(self.store, ObjectOutputStore)
        return self.store

    @property
    def keys(self) -> list[str]:
        """The object keys of the range's Parquet files."""
        return self._store.part_keys(self.range)

    @property
    def files(self) -> list[Path]:
        return []  # nothing on a disk

    def sources(self) -> list[Any]:
        return [self._store.open_part(key) for key in self.keys]

    def spark_inputs(self) -> list[str]:
        return [self._store.location.object_url(key) for key in self.keys]

    @property
    def store_root(self) -> Path:
        return self._store.root


_CHAIN_LOCKS: dict[str, threading.Lock] = {}
_CHAIN_LOCKS_GUARD = threading.Lock()


class ObjectOutputStore(OutputStore):
    """The output store on an object store (module docstring)."""

    def __init__(self, location: StoreLocation) -> None:
        super().__init__(location.work_folder)
        self.location = location
        self.objects = S3Objects(location)
        self._seen = _SEEN.setdefault(Path(location.url), _Seen())
        self._held = threading.local()
        self._parts: OrderedDict[LsnRange, list[str]] = OrderedDict()
        self._bytes: OrderedDict[str, bytes] = OrderedDict()
        self._bytes_lock = threading.Lock()
        with _CHAIN_LOCKS_GUARD:
            self._chain_thread_lock = _CHAIN_LOCKS.setdefault(location.url, threading.Lock())

    def reopened(self) -> ObjectOutputStore:
        return ObjectOutputStore(self.location)

    @property
    def where(self) -> str:
        return self.location.url

    @property
    def url(self) -> str:
        return self.location.url

    # -- keys ---------------------------------------------------------------------------------

    def range_prefix(self, rng: LsnRange) -> str:
        hi, mid = bucket_names(rng.start)
        return self.location.key("changes", hi, mid, rng.key) + "/"

    def part_keys(self, rng: LsnRange) -> list[str]:
        """The keys of ``rng``'s Parquet files (listed once: a stored range never changes)."""
        known = self._parts.get(rng)
        if known is not None:
            return known
        prefix = self.range_prefix(rng)
        keys = sorted(
            o.key
            for o in self.objects.objects(prefix)
            if o.key[len(prefix) :].startswith("part-") and o.key.endswith(".parquet")
        )
        self._parts[rng] = keys
        while len(self._parts) > MANIFESTS_KEPT:
            self._parts.popitem(last=False)
        return keys

    def open_part(self, key: str) -> Any:
        """A Parquet file of a range, downloaded whole in one request and kept in memory for
        the next reader (an apply reads a range two or three times: its relation versions,
        then its rows), up to :data:`PARTS_KEPT_BYTES` of the latest files; pyarrow's own S3
        reads would fetch it in many ranged requests, each time."""
        with self._bytes_lock:
            data = self._bytes.get(key)
            if data is not None:
                self._bytes.move_to_end(key)
        if data is None:
            found = self.objects.get(key)
            if found is None:
                raise StoreError(f"{key} vanished from the output store {self.where}")
            data = found[0]
            with self._bytes_lock:  # a receiver and an applier may share the store
                self._bytes[key] = data
                while len(self._bytes) > 1 and (
                    sum(len(b) for b in self._bytes.values()) > PARTS_KEPT_BYTES
                ):
                    self._bytes.popitem(last=False)
        return pa.BufferReader(data)

    def range_uri(self, rng: LsnRange) -> str:
        return self.location.object_url(self.range_prefix(rng))

    # -- the local scratch --------------------------------------------------------------------

    def scratch_of(self, start: Lsn) -> Path:
        return self.root / "scratch" / f".tmp-{start.hex16}"

    def make_bucket(self, start: Lsn) -> Path:
        folder = self.scratch_of(start).parent
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def drop_scratch(self, start: Lsn) -> None:
        with contextlib.suppress(OSError):
            self.scratch_of(start).rmdir()

    def writer(self, rng: LsnRange) -> RangeWriter:
        return ObjectRangeWriter(self, rng)

    # -- ranges -------------------------------------------------------------------------------

    def range_path(self, rng: LsnRange) -> Path:
        """A local path naming the range, for messages (the range is not on this disk)."""
        return self.root / "changes" / rng.key

    def get(self, rng: LsnRange) -> StoredRange | None:
        cached = self._manifests.get(rng)
        if cached is not None:
            self._manifests.move_to_end(rng)
            return cached
        found = self.objects.get(self.range_prefix(rng) + MANIFEST)
        if found is None:
            return None
        manifest = RangeManifest.from_json(found[0].decode())
        return self._keep(ObjectStoredRange(rng, self.range_path(rng), manifest, self))

    def holds(self, rng: LsnRange) -> bool:
        """Whether ``rng`` is stored: its manifest there (asked each time, as a disk's store
        stats its folder: a prune elsewhere may have taken it out)."""
        return self.objects.head(self.range_prefix(rng) + MANIFEST) is not None

    def stored_at(self, rng: LsnRange) -> float:
        info = self.objects.head(self.range_prefix(rng) + MANIFEST)
        return float("inf") if info is None else info.modified

    def _names(self, start: Lsn | None, reverse: bool) -> Iterator[str]:
        """Stored ranges' names in order: the buckets listed as the walk reaches them, and in
        each the ranges that have a manifest (files without one are a killed write's)."""
        bound = None if start is None else start.hex16
        first_hi, first_mid = ("", "") if start is None else bucket_names(start)
        changes = self.location.key("changes") + "/"

        def before(name: str, first: str) -> bool:
            return bool(first) and (name > first if reverse else name < first)

        for hi in sorted(
            (n for n in self.objects.folders(changes) if len(n) == 8), reverse=reverse
        ):
            if before(hi, first_hi):
                continue
            for mid in sorted(self.objects.folders(f"{changes}{hi}/"), reverse=reverse):
                if hi == first_hi and before(mid, first_mid):
                    continue
                bucket = f"{changes}{hi}/{mid}/"
                names = sorted(
                    (
                        o.key[len(bucket) : -len(MANIFEST) - 1]
                        for o in self.objects.objects(bucket)
                        if o.key.endswith("/" + MANIFEST)
                    ),
                    reverse=reverse,
                )
                for name in names:
                    if len(name) != RANGE_KEY_LENGTH:
                        continue
                    if bound is None or (name[:16] <= bound if reverse else name[:16] >= bound):
                        yield name

    def hide_range(self, rng: LsnRange) -> str | None:
        """Take ``rng`` out in one step: a tombstone naming it, then its manifest deleted (it
        vanishes from every reader); :meth:`remove_hidden` deletes its files."""
        manifest = self.range_prefix(rng) + MANIFEST
        if self.objects.head(manifest) is None:
            return None
        tombstone = self.location.key(TOMBSTONES + PRUNED_PREFIX + rng.key)
        self.objects.put(tombstone, self.range_prefix(rng).encode())
        self.objects.delete([manifest])
        self._manifests.pop(rng, None)
        return tombstone

    def remove_hidden(self, hidden: str) -> int:
        found = self.objects.get(hidden)
        if found is None:
            return 0
        prefix = found[0].decode()
        removed = 0
        keys = []
        for item in self.objects.objects(prefix):
            if item.key[len(prefix) :].startswith("part-"):
                removed += item.size
            keys.append(item.key)
        self.objects.delete(keys)
        self.objects.delete([hidden])
        return removed

    def sweep_unpublished(self, before: Lsn) -> int:
        """Delete the files of ranges starting before ``before`` that have no manifest, and
        return their bytes. A writer killed before its manifest's put leaves its files under
        its range's prefix; the next writer starts at the same LSN but may end elsewhere, so
        under another prefix, and nothing else would ever delete them (the module docstring).
        Safe because ``before`` is the start of a stored range of the chain: every writer
        writes at the chain's end, past it. Lists the buckets up to ``before``'s, which a
        prune has emptied of all but the ranges it keeps."""
        changes = self.location.key("changes") + "/"
        last = bucket_names(before)
        removed = 0
        for hi in self.objects.folders(changes):
            if len(hi) != 8 or hi > last[0]:
                continue
            for mid in self.objects.folders(f"{changes}{hi}/"):
                if (hi, mid) > last:
                    continue
                bucket = f"{changes}{hi}/{mid}/"
                held: dict[str, list[ObjectInfo]] = {}
                for item in self.objects.objects(bucket):
                    name = item.key[len(bucket) :].split("/", 1)[0]
                    if len(name) == RANGE_KEY_LENGTH and name[:16] < before.hex16:
                        held.setdefault(name, []).append(item)
                for items in held.values():
                    if any(i.key.endswith("/" + MANIFEST) for i in items):
                        continue
                    self.objects.delete([i.key for i in items])
                    removed += sum(i.size for i in items)
        return removed

    def sweep_removed(self) -> None:
        """Finish what a prune killed mid-removal left: each tombstone's range deleted."""
        for item in list(self.objects.objects(self.location.key(TOMBSTONES))):
            self.remove_hidden(item.key)

    # -- the chain record ---------------------------------------------------------------------

    def _chain_key(self) -> str:
        return self.location.key(CHAIN)

    def _chain_raw(self) -> dict[str, Any] | None:
        import json

        found = self.objects.get(self._chain_key())
        if found is None:
            return None
        raw: dict[str, Any] = json.loads(found[0].decode())
        return raw

    @contextlib.contextmanager
    def chain_lock(self) -> Iterator[Chain | None]:
        """The chain record as read, and its ETag kept for :meth:`_write_chain`'s conditional
        put: a writer that changed it meanwhile makes that put fail, naming the cause. Threads
        of this process take turns."""
        import json

        with self._chain_thread_lock:
            found = self.objects.get(self._chain_key())
            self._held.etag = None if found is None else found[1]
            self._held.inside = True
            try:
                yield None if found is None else parse_chain(json.loads(found[0].decode()))
            finally:
                self._held.inside = False

    def _write_chain(self, chain: dict[str, Any]) -> None:
        import json

        if not getattr(self._held, "inside", False):
            raise StoreError("the chain record is written only under chain_lock")
        data = json.dumps(chain, indent=1, sort_keys=True).encode()
        self._held.etag = self.objects.put_if(self._chain_key(), data, self._held.etag)


class ObjectRangeWriter(RangeWriter):
    """Writes a range in the local scratch, then uploads its files and creates its manifest
    last, conditionally (module docstring)."""

    store: ObjectOutputStore

    def _open_scratch(self, store: OutputStore, rng: LsnRange) -> None:
        store.make_bucket(rng.start)
        self._scratch = store.scratch_of(rng.start)
        shutil.rmtree(self._scratch, ignore_errors=True)
        self._scratch.mkdir(parents=True)
        self.tmp = self._scratch / uuid.uuid4().hex[:8]
        self.tmp.mkdir()

    def _publish(self, manifest: RangeManifest) -> StoredRange:
        store = self.store
        prefix = store.range_prefix(self.range)
        for part in sorted(self.tmp.glob("part-*.parquet")):
            store.objects.upload(part, prefix + part.name)
        failpoint("store.uploaded")
        if not store.objects.put_new(prefix + MANIFEST, manifest.to_json().encode()):
            raise StoreError(
                f"range {self.range.key} is already stored at {store.range_uri(self.range)}"
            )
        failpoint("store.renamed")
        shutil.rmtree(self._scratch, ignore_errors=True)
        stored = store._keep(
            ObjectStoredRange(self.range, store.range_path(self.range), manifest, store)
        )
        store._seen.stored(self.range)
        return stored
