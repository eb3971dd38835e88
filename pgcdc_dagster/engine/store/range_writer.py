"""Writing one range: its Parquet files into a hidden folder, fsynced, then renamed into place
in one step, so a crash leaves either no range or a complete one, never a half partition that
looks complete; a writer sweeps what a crashed write of its own start left."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..failpoints import failpoint
from ..lsn import LsnRange
from .errors import OUT_OF_SPACE, StoreError, StoreFullError
from .layout import fsync_path
from .range_format import CHANGE_SCHEMA, MANIFEST, RangeManifest, StoredRange

if TYPE_CHECKING:
    from .output_store import OutputStore


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
        self._writer: pq.ParquetWriter | None = None
        self._used: set[int] = set()  # the relation versions of the rows written
        self.rows = 0
        self._spill_seq = 0
        self._open_scratch(store, rng)

    def _open_scratch(self, store: OutputStore, rng: LsnRange) -> None:
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

    @contextlib.contextmanager
    def space_checked(self) -> Iterator[None]:
        """Writes of this range's files: a full file system (``ENOSPC``, a quota) is named in
        one line, :class:`StoreFullError`, with the store's path and the fix, instead of the
        file library's words (pyarrow's ``OSError: [Errno 28] Error writing bytes to
        file``)."""
        try:
            yield
        except OSError as exc:
            if exc.errno not in OUT_OF_SPACE and "No space left on device" not in str(exc):
                raise
            raise StoreFullError(
                f"the output store at {self.store.where} is out of space storing range "
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
        self._used.update(pc.unique(table.column("relation_version")).to_pylist())
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
            manifest,
            result=result,
            bytes=parquet_bytes,
            chain_last_commit=mark,
            used_relations=sorted(self._used),
        )
        return self._publish(manifest)

    def _publish(self, manifest: RangeManifest) -> StoredRange:
        """Make the written range visible, whole, in one step (here: the folder's rename; on
        an object store, the manifest's conditional put, :mod:`.object_store`)."""
        (self.tmp / MANIFEST).write_text(manifest.to_json())
        for f in self.tmp.iterdir():
            fsync_path(f)
        fsync_path(self.tmp)
        if self.store.holds(self.range):
            where = self.store.range_path(self.range)
            raise StoreError(f"range {self.range.key} is already stored at {where}")
        final = self._scratch.parent / self.range.key
        os.rename(self.tmp, final)
        fsync_path(final.parent)
        failpoint("store.renamed")
        self._scratch.rmdir()
        stored = self.store._keep(StoredRange(self.range, final, manifest, self.store))
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
