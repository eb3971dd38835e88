"""The decoded output store: one Parquet folder per LSN-range partition, plus its manifest.

Layout under the store root::

    changes/<range key>/part-00000.parquet ...   one row per change, commit order
    changes/<range key>/_RANGE.json              the manifest: watermarks, counts, relations

The manifest is the store's single source of truth for "what each LSN range holds"; a range
exists exactly when its folder (with manifest) exists. A range is written into a hidden
temporary folder, fsynced, and renamed into place in one step, so a crash leaves either no
range or a complete one: never a half partition that looks complete. Readers ignore hidden
folders, and a writer sweeps stale ones of its own range before it starts.

Row values are positional lists of the text the server sent (``new_row``, ``key``); the column
names, types and key flags of each list live in the manifest's ``relations``, indexed by the
row's ``relation_version``. That keeps a range self-describing across DDL (a Relation message
re-sent mid-range becomes a new version) without repeating names in every row.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from .lsn import Lsn, LsnRange

MANIFEST = "_RANGE.json"
CHAIN = "_CHAIN.json"
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
_PARTITIONING_HINT = "changes/<range key>/part-*.parquet"


class StoreError(RuntimeError):
    """The output store is missing, unreadable or inconsistent."""


@dataclass(frozen=True)
class StoredRange:
    range: LsnRange
    path: Path
    manifest: dict[str, Any]

    @property
    def files(self) -> list[Path]:
        return sorted(self.path.glob("part-*.parquet"))

    def read_table(self) -> pa.Table:
        files = self.files
        if not files:
            return CHANGE_SCHEMA.empty_table()
        return pa.concat_tables([pq.read_table(f, schema=CHANGE_SCHEMA) for f in files])


class OutputStore:
    """A local-filesystem output store rooted at ``root``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.changes_dir = self.root / "changes"

    def range_path(self, rng: LsnRange) -> Path:
        return self.changes_dir / rng.key

    def get(self, rng: LsnRange) -> StoredRange | None:
        path = self.range_path(rng)
        manifest = path / MANIFEST
        if not manifest.exists():
            return None
        return StoredRange(rng, path, json.loads(manifest.read_text()))

    def ranges(self) -> list[LsnRange]:
        """Every stored range, in LSN order."""
        if not self.changes_dir.exists():
            return []
        keys = sorted(
            p.name
            for p in self.changes_dir.iterdir()
            if not p.name.startswith(".") and (p / MANIFEST).exists()
        )
        return [LsnRange.from_key(k) for k in keys]

    def range_ending_at(self, end: Lsn) -> StoredRange | None:
        for rng in reversed(self.ranges()):
            if rng.end == end:
                return self.get(rng)
            if rng.end < end:
                break
        return None

    def writer(self, rng: LsnRange) -> RangeWriter:
        return RangeWriter(self, rng)

    # -- the chain: where the current base snapshot's ranges begin ---------------------------

    def record_chain(self, slot: str, consistent_point: Lsn, snapshot_name: str) -> None:
        """Start a new chain of ranges at a base snapshot's consistent point.

        Ranges of an earlier chain (before a re-snapshot) stay as history: they end before the
        new consistent point, since a new slot starts at the WAL position of its creation.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        chain = {"slot": slot, "consistent_point": str(consistent_point), "snapshot": snapshot_name}
        tmp = self.root / f".{CHAIN}.{uuid.uuid4().hex[:8]}"
        tmp.write_text(json.dumps(chain, indent=1, sort_keys=True))
        _fsync_path(tmp)
        os.replace(tmp, self.root / CHAIN)
        _fsync_path(self.root)

    def chain(self) -> dict[str, str] | None:
        path = self.root / CHAIN
        return json.loads(path.read_text()) if path.exists() else None

    def consistent_point(self) -> Lsn:
        chain = self.chain()
        if chain is None:
            raise StoreError(
                f"no base snapshot recorded in the output store {self.root}: take one first "
                "(pgcdc snapshot, or materialise base_snapshot)"
            )
        return Lsn.parse(chain["consistent_point"])

    def chain_ranges(self) -> list[LsnRange]:
        """Stored ranges of the current chain, in LSN order."""
        start = self.consistent_point()
        return [r for r in self.ranges() if r.start >= start]


class RangeWriter:
    """Writes one range's Parquet files into a temporary folder and publishes it atomically."""

    def __init__(self, store: OutputStore, rng: LsnRange, row_group_rows: int = 131_072) -> None:
        self.store = store
        self.range = rng
        self.row_group_rows = row_group_rows
        store.changes_dir.mkdir(parents=True, exist_ok=True)
        for stale in store.changes_dir.glob(f".tmp-{rng.key}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        self.tmp = store.changes_dir / f".tmp-{rng.key}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir()
        self._writer: pq.ParquetWriter | None = None
        self.rows = 0
        self._spill_seq = 0

    def write(self, batch: pa.RecordBatch | pa.Table) -> None:
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

    def commit(self, manifest: dict[str, Any]) -> StoredRange:
        """Close the files, write the manifest, fsync everything, rename into place."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        for spill in self.tmp.glob(".spill-*"):
            spill.unlink()
        parquet_bytes = sum(f.stat().st_size for f in self.tmp.glob("part-*.parquet"))
        manifest = {**manifest, "format_version": FORMAT_VERSION, "bytes": parquet_bytes}
        (self.tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        for f in self.tmp.iterdir():
            _fsync_path(f)
        _fsync_path(self.tmp)
        final = self.store.range_path(self.range)
        if final.exists():
            raise StoreError(f"range {self.range.key} is already stored at {final}")
        os.rename(self.tmp, final)
        _fsync_path(self.store.changes_dir)
        return StoredRange(self.range, final, manifest)

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        shutil.rmtree(self.tmp, ignore_errors=True)

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


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
