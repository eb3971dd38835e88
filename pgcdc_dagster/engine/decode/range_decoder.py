"""Decoding one range: pgoutput messages (LSN, bytes) in, whole transactions of Arrow rows out.

No connection and no file of its own: :class:`RangeDecoder` is fed the rows a slot read returns
(``(lsn, data)`` pairs, in order) and writes the rows of every transaction whose COMMIT ends in
the range to a :class:`RowSink` (the store's
:class:`~pgcdc_dagster.engine.store.output_store.RangeWriter` in production, a list in tests);
:meth:`RangeDecoder.finish` gives the range's watermarks and endpos outcome. So it can be tested
with byte strings, and :mod:`..source.peek` only moves bytes.

Which transactions a range holds, straddlers and the safe point are argued in :mod:`..source.peek`.

Why one module: :class:`RangeDecoder` is one state machine over a range's messages (the open
transaction, the relations it has seen, the streamed blocks), and its Arrow batching is where
its speed comes from; split, each half would have to know the other's state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import PgcdcError
from ..failpoints import failpoint
from ..lsn import Lsn, LsnRange
from ..store.output_store import (
    CHANGE_SCHEMA,
    EndposOutcome,
    RangeManifest,
    RangeResult,
    iter_batches,
)
from .pgoutput import Message, Relation, Truncate, Type, decode
from .pgoutput_batch import (
    KIND_BEGIN,
    KIND_COMMIT,
    KIND_DELETE,
    KIND_INSERT,
    KIND_UPDATE,
    BeginCommitFields,
    ChangeBlock,
    MessageBatch,
    decode_begin_commit,
    decode_changes,
    one_byte_strings,
    text_lists,
)

_first, _second = itemgetter(0), itemgetter(1)


class DecodeError(PgcdcError):
    """The slot's output is not the pgoutput stream it must be."""


class RowSink(Protocol):
    """Where decoded rows go: the store's range writer, or a test's list."""

    rows: int

    def write(self, batch: pa.Table) -> None: ...

    def spill_path(self) -> Path:
        """A scratch file for the rows of a transaction too big to hold in memory."""
        ...

    def space_checked(self) -> AbstractContextManager[None]:
        """Around a write of a scratch file: a full file system becomes the sink's one-line
        error (:meth:`~..store.output_store.RangeWriter.space_checked`)."""
        ...


@dataclass
class Straddler:
    xid: int
    first_lsn: int
    commit_lsn: int
    """Where its COMMIT record starts; for a transaction still being streamed at a stream's
    cut, the cut itself (its COMMIT lies after it: no record straddles the cut)."""


def classify_endpos(
    endpos: int, last_end_lsn: int | None, straddlers: list[Straddler]
) -> EndposOutcome:
    """Where ``endpos`` fell. A deferred transaction outranks the rest: it is the one fact
    about this range that the next range depends on."""
    if any(s.first_lsn < endpos for s in straddlers):
        return EndposOutcome.MID_TRANSACTION
    if last_end_lsn is None:
        return EndposOutcome.EMPTY
    if last_end_lsn == endpos:
        return EndposOutcome.AT_COMMIT_BOUNDARY
    return EndposOutcome.BETWEEN_TRANSACTIONS


def safe_point(endpos: int, straddlers: list[Straddler]) -> int:
    """See the module docstring: ``endpos``, lowered to the COMMIT start of a straddler whose
    COMMIT record contains ``endpos``."""
    point = endpos
    for s in straddlers:
        if s.commit_lsn < endpos:
            point = min(point, s.commit_lsn)
    return point


@dataclass
class _OpenTxn:
    xid: int
    first_lsn: int
    final_lsn: int
    position: int
    """Batch position of its Begin; -1 when it began in an earlier batch."""


class RangeDecoder:
    """Turns the peek's rows into whole transactions of Arrow rows and writes them.

    Per batch: the hot messages are decoded at once (:mod:`.pgoutput_batch`), rare ones one by
    one; then a short loop over Begin/Commit positions decides which transaction each change
    belongs to and whether that transaction is stored (its COMMIT ends in the range), skipped
    (ended at or before the range start) or a straddler (no COMMIT at or before ``endpos``).
    Rows of the transaction still open at the end of a batch wait in ``pending`` (spilled to
    disk past ``spill_rows``) until its COMMIT arrives.
    """

    def __init__(self, rng: LsnRange, writer: RowSink, spill_rows: int) -> None:
        self.range = rng
        self.writer = writer
        self.spill_rows = spill_rows
        self.relations: dict[int, int] = {}
        self.versions: list[tuple[Relation, np.ndarray]] = []
        self.relations_meta: list[dict[str, Any]] = []
        self.types: dict[int, str] = {}
        self.open: _OpenTxn | None = None
        self.pending: list[pa.RecordBatch] = []
        self.pending_rows = 0
        self.spills: list[Path] = []
        self.straddlers: list[Straddler] = []
        self.counts = {"I": 0, "U": 0, "D": 0, "T": 0}
        self.transactions = 0
        self.messages = 0
        self.wire_bytes = 0
        self.last_end: int | None = None
        self.last_xid: int | None = None
        self.last_ts: int | None = None

    # -- per batch ---------------------------------------------------------------------------

    def feed(self, rows: Sequence[tuple[int, bytes]]) -> None:
        failpoint("receive.fetching")
        # Column by column through C iterators: zip(*rows) and np.array of a tuple of ints cost
        # several times as much (see benchmarks/HISTORY.md, "Decoding pgoutput in batches").
        lsns = np.fromiter(map(_first, rows), np.int64, len(rows))
        batch = MessageBatch.from_messages(list(map(_second, rows)))
        self.wire_bytes += int(batch.ends[-1]) if len(rows) else 0
        self._assign_transactions(batch, lsns, self._decoded(batch, lsns))

    def _decoded(self, batch: MessageBatch, lsns: np.ndarray) -> pa.Table:
        """The batch's change rows (TRUNCATEs among them, in order), relations and types
        taken in on the way; no transaction fields yet."""
        changes = decode_changes(batch)
        relver = np.zeros(len(changes.index), np.int32)
        truncates = self._walk_rare_messages(batch, lsns, changes, relver)
        table = self._change_rows(batch, lsns, changes, relver)
        return _merge_in_order(table, truncates) if truncates else table

    def feed_streamed(
        self,
        xid: int,
        commit_lsn: int,
        end_lsn: int,
        commit_ts_us: int,
        chunks: Iterable[tuple[np.ndarray, MessageBatch]],
    ) -> None:
        """A transaction received ahead of its COMMIT by pgoutput's streaming
        (:mod:`..source.streamed`), now committed: its changes chunk by chunk, already in
        protocol 1's layout, its Commit's fields known. Written straight to the sink, whole and
        in commit order (every transaction fed before it is complete: a Stream Commit never
        comes inside a transaction), so none of it is parked or spilled twice. Every chunk is
        consumed (the spool deletes each as it is read)."""
        if self.open is not None:
            raise DecodeError(
                f"streamed transaction {xid} committed inside transaction {self.open.xid}"
            )
        keep = self.range.holds_commit(end_lsn)
        fields = np.array([[end_lsn, commit_lsn, xid, commit_ts_us]], np.int64)
        seq = 0
        for lsns, batch in chunks:
            if not keep or not len(lsns):
                continue
            self.wire_bytes += int(batch.ends[-1])
            table = self._decoded(batch, lsns)
            n = table.num_rows
            if n:
                order = np.arange(seq, seq + n, dtype=np.int32)
                self._write(self._with_transaction(table, order, np.broadcast_to(fields, (n, 4))))
                seq += n
        if keep:
            self.transactions += 1
            self.last_end, self.last_xid, self.last_ts = end_lsn, xid, commit_ts_us

    def _walk_rare_messages(
        self, batch: MessageBatch, lsns: np.ndarray, changes: ChangeBlock, relver: np.ndarray
    ) -> list[tuple[int, int, int, int]]:
        """Relation/Type/Truncate/Message/Origin in order, versioning changes in between."""
        kinds = batch.kinds
        hot = np.isin(kinds, _HOT_KINDS)
        rare = np.flatnonzero(~hot)
        truncates: list[tuple[int, int, int, int]] = []
        done = 0
        for position in [*rare.tolist(), len(kinds)]:
            upto = int(np.searchsorted(changes.index, position))
            if upto > done:
                self._version_changes(changes.relid[done:upto], relver[done:upto])
                done = upto
            if position == len(kinds):
                break
            start, end = int(batch.starts[position]), int(batch.ends[position])
            msg = decode(batch.buf[start:end].tobytes())
            if isinstance(msg, Relation):
                self._relation(msg)
            elif isinstance(msg, Truncate):
                for relid in msg.relids:
                    version = self._version_of(relid)
                    truncates.append((position, int(lsns[position]), version, msg.options))
            elif isinstance(msg, Type):
                self.types[msg.oid] = f"{msg.namespace}.{msg.name}"
            elif isinstance(msg, Message):
                self.messages += 1
            # Origin: a transaction replicated into the source from elsewhere; nothing to keep.
        return truncates

    def _version_changes(self, relids: np.ndarray, out: np.ndarray) -> None:
        for relid in np.unique(relids).tolist():
            out[relids == relid] = self._version_of(relid)

    def _version_of(self, relid: int) -> int:
        try:
            return self.relations[relid]
        except KeyError:
            raise DecodeError(
                f"change for relation oid {relid} arrived before its Relation message: the "
                "slot's output is not pgoutput protocol 1 as expected"
            ) from None

    def _relation(self, rel: Relation) -> None:
        cached = self.relations.get(rel.relid)
        if cached is not None and self.versions[cached][0] == rel:
            return
        self.relations[rel.relid] = len(self.versions)
        self.versions.append((rel, np.array(rel.key_indexes, dtype=np.int64)))
        self.relations_meta.append(
            {
                "relid": rel.relid,
                "schema": rel.namespace,
                "table": rel.name,
                "replica_identity": rel.replica_identity,
                "columns": [
                    {"name": c.name, "type_oid": c.type_oid, "typmod": c.typmod, "key": c.is_key}
                    for c in rel.columns
                ],
            }
        )

    def _change_rows(
        self, batch: MessageBatch, lsns: np.ndarray, changes: ChangeBlock, relver: np.ndarray
    ) -> pa.Table:
        """Insert/Update/Delete rows of the batch, without transaction fields yet."""
        n = len(changes.index)
        key_width = max((len(k) for _, k in self.versions), default=0)
        key_starts = np.zeros((n, key_width), np.int64)
        key_lengths = np.zeros((n, key_width), np.int64)
        key_kinds = np.zeros((n, key_width), np.uint8)
        key_count = np.zeros(n, np.int64)
        src = changes.key_source
        for version in np.unique(relver).tolist() if n else []:
            rows = np.flatnonzero(relver == version)
            idx = self.versions[version][1]
            k = len(idx)
            key_starts[rows, :k] = src.starts[rows][:, idx]
            key_lengths[rows, :k] = src.lengths[rows][:, idx]
            key_kinds[rows, :k] = src.kinds[rows][:, idx]
            key_count[rows] = k
        keys = text_lists(batch, key_starts, key_lengths, key_kinds, key_count)
        new_rows = text_lists(
            batch,
            changes.new.starts,
            changes.new.lengths,
            changes.new.kinds,
            changes.new.ncols,
            row_valid=changes.has_new,
        )
        toast = self._unchanged_toast(changes, relver)
        action = one_byte_strings(changes.action)
        return pa.table(
            {
                "msg_idx": pa.array(changes.index, pa.int64()),
                "lsn": pa.array(lsns[changes.index], pa.int64()),
                "action": action,
                "relation_version": pa.array(relver, pa.int32()),
                "key": keys,
                "new_row": new_rows,
                "unchanged_toast": toast,
                "flags": pa.array(np.zeros(n, np.int8), pa.int8()),
            }
        )

    def _unchanged_toast(self, changes: ChangeBlock, relver: np.ndarray) -> pa.Array:
        marked = (changes.new.kinds == _UNCHANGED).any(axis=1)
        if changes.old_kinds.size:
            marked |= (changes.old_kinds == _UNCHANGED).any(axis=1)
        names: list[list[str] | None] = [None] * len(relver)
        for row in np.flatnonzero(marked).tolist():
            cols = np.flatnonzero(
                (changes.new.kinds[row] == _UNCHANGED) | (changes.old_kinds[row] == _UNCHANGED)
            )
            rel = self.versions[int(relver[row])][0]
            names[row] = [rel.columns[c].name for c in cols.tolist()]
        return pa.array(names, pa.list_(pa.string()))

    def _assign_transactions(self, batch: MessageBatch, lsns: np.ndarray, table: pa.Table) -> None:
        """Give each change its transaction, write those whose COMMIT is in the range, park
        the rows of the transaction still open at the end of the batch."""
        ctl = decode_begin_commit(batch)
        carried = self.open is not None and self.open.position < 0
        completed = self._pair_fast(ctl, lsns)
        if completed is None:
            completed = self._pair_slow(ctl, lsns)
        if len(completed):
            self.transactions += len(completed)
            self.last_end, self.last_xid, self.last_ts = (
                int(completed[-1, 2]),
                int(completed[-1, 4]),
                int(completed[-1, 5]),
            )
        msg_idx = table.column("msg_idx").to_numpy()
        if len(completed):
            starts, commits = completed[:, 0], completed[:, 1]
            which = np.searchsorted(commits, msg_idx)
            inside = which < len(completed)
            inside[inside] &= starts[which[inside]] < msg_idx[inside]
            rows = np.flatnonzero(inside)
            carried_offset = 0
            if carried and completed[0, 0] < 0:
                carried_offset = self._flush_pending(completed[0])
            if len(rows):
                rows_table = _take(table, rows)
                self._write_completed(rows_table, which[rows], completed, carried_offset)
        if self.open is not None:
            open_rows = np.flatnonzero(msg_idx > self.open.position)
            if len(open_rows):
                chunk = _take(table, open_rows)
                seq = np.arange(len(open_rows), dtype=np.int32) + self.pending_rows
                self._add_pending(chunk, seq)
            self.open.position = -1

    def _pair_fast(self, ctl: BeginCommitFields, lsns: np.ndarray) -> np.ndarray | None:
        """The common batch, paired without a loop: Begin and Commit strictly alternate (after
        the Commit of a transaction carried in from the previous batch) and every Commit ends
        in the range. ``None`` when the batch is not that simple (straddlers, skipped
        transactions): the loop in :meth:`_pair_slow` handles it."""
        kinds = ctl.kind
        if len(kinds) == 0:  # inside one long transaction: nothing begins or ends here
            return np.zeros((0, 6), np.int64)
        carried = self.open
        first = KIND_COMMIT if carried is not None else KIND_BEGIN
        second = KIND_BEGIN if first == KIND_COMMIT else KIND_COMMIT
        if not ((kinds[0::2] == first).all() and (kinds[1::2] == second).all()):
            return None
        is_commit = kinds == KIND_COMMIT
        ends = ctl.end_lsn[is_commit]
        if len(ends) and not ((ends > self.range.start) & (ends <= self.range.end)).all():
            return None
        begin_pos = ctl.index[~is_commit]
        begin_xid = ctl.xid[~is_commit]
        if carried is not None:
            begin_pos = np.r_[carried.position, begin_pos]
            begin_xid = np.r_[carried.xid, begin_xid]
        n = int(is_commit.sum())
        completed = np.empty((n, 6), np.int64)
        completed[:, 0] = begin_pos[:n]
        completed[:, 1] = ctl.index[is_commit]
        completed[:, 2] = ends
        completed[:, 3] = ctl.final_or_commit_lsn[is_commit]
        completed[:, 4] = begin_xid[:n]
        completed[:, 5] = ctl.ts_us[is_commit]
        if kinds[-1] == KIND_BEGIN:  # the last Begin opens a transaction that goes on
            i = len(kinds) - 1
            position = int(ctl.index[i])
            self.open = _OpenTxn(
                int(ctl.xid[i]), int(lsns[position]), int(ctl.final_or_commit_lsn[i]), position
            )
        else:
            self.open = None
        return completed

    def _pair_slow(self, ctl: BeginCommitFields, lsns: np.ndarray) -> np.ndarray:
        completed: list[tuple[int, int, int, int, int, int]] = []
        for position, kind, lsn_field, end_lsn, ts, xid in zip(
            ctl.index.tolist(),
            ctl.kind.tolist(),
            ctl.final_or_commit_lsn.tolist(),
            ctl.end_lsn.tolist(),
            ctl.ts_us.tolist(),
            ctl.xid.tolist(),
            strict=True,
        ):
            if kind == KIND_BEGIN:
                if self.open is not None:
                    self._straddler(self.open)
                self.open = _OpenTxn(xid, int(lsns[position]), lsn_field, position)
                continue
            txn = self.open
            if txn is None:
                continue
            self.open = None
            if not self.range.holds_commit(end_lsn):
                # Ended at or before the range start: stored already.
                self._forget(txn)
                continue
            completed.append((txn.position, position, end_lsn, lsn_field, txn.xid, ts))
        return np.array(completed, np.int64).reshape(-1, 6)

    def _write_completed(
        self,
        rows: pa.Table,
        txn_of_row: np.ndarray,
        completed: np.ndarray,
        carried_offset: int,
    ) -> None:
        first = np.r_[True, txn_of_row[1:] != txn_of_row[:-1]]
        run_start = np.maximum.accumulate(np.where(first, np.arange(len(txn_of_row)), 0))
        seq = np.arange(len(txn_of_row)) - run_start
        if completed[0][0] < 0:
            seq[txn_of_row == 0] += carried_offset
        fields = completed[:, 2:][txn_of_row]
        self._write(self._with_transaction(rows, seq.astype(np.int32), fields))

    def _flush_pending(self, txn: np.ndarray) -> int:
        """The transaction open across batches committed: write its parked rows first.
        Returns how many there were (the sequence number its next row continues from)."""
        fields = np.asarray(txn[2:], np.int64)
        for spill in self.spills:
            for batch in iter_batches(spill):
                self._write_parked(batch, fields)
            spill.unlink()
        for batch in self.pending:
            self._write_parked(batch, fields)
        parked = self.pending_rows
        self.spills.clear()
        self.pending.clear()
        self.pending_rows = 0
        return parked

    def _write_parked(self, batch: pa.RecordBatch, fields: np.ndarray) -> None:
        rows = pa.Table.from_batches([batch])
        seq = rows.column("seq").to_numpy()
        rows = rows.drop_columns(["seq"])
        self._write(self._with_transaction(rows, seq, np.broadcast_to(fields, (len(seq), 4))))

    def _add_pending(self, chunk: pa.Table, seq: np.ndarray) -> None:
        chunk = chunk.append_column("seq", pa.array(seq, pa.int32()))
        self.pending.extend(chunk.to_batches())
        self.pending_rows += chunk.num_rows
        if sum(b.num_rows for b in self.pending) >= self.spill_rows:
            path = self.writer.spill_path()
            table = pa.Table.from_batches(self.pending)
            with (
                self.writer.space_checked(),
                pa.OSFile(str(path), "wb") as sink,
                pa.ipc.new_file(sink, table.schema) as ipc,
            ):
                ipc.write_table(table)
            self.spills.append(path)
            self.pending.clear()

    def _straddler(self, txn: _OpenTxn) -> None:
        if txn.first_lsn < self.range.end:
            self.straddlers.append(Straddler(txn.xid, txn.first_lsn, txn.final_lsn))
        self._forget(txn)

    def _forget(self, txn: _OpenTxn) -> None:
        """Drop what is parked for ``txn``. Only the transaction carried in from the previous
        batch (position < 0) has parked rows: one that began in this batch has none yet, and
        the parked rows may then belong to the carried transaction, which committed earlier in
        this batch and is written after the pairing (it must keep them)."""
        if txn.position < 0:
            self._drop_pending()

    def _drop_pending(self) -> None:
        for spill in self.spills:
            spill.unlink(missing_ok=True)
        self.spills.clear()
        self.pending.clear()
        self.pending_rows = 0

    def _with_transaction(self, rows: pa.Table, seq: np.ndarray, fields: np.ndarray) -> pa.Table:
        """Rows in store order with their transaction columns (end_lsn, commit_lsn, xid, ts)
        and the relation's schema and table names."""
        version = rows.column("relation_version")
        schemas = pa.array([rel.namespace for rel, _ in self.versions], pa.string())
        tables = pa.array([rel.name for rel, _ in self.versions], pa.string())
        return pa.table(
            {
                "commit_end_lsn": pa.array(fields[:, 0], pa.int64()),
                "commit_lsn": pa.array(fields[:, 1], pa.int64()),
                "lsn": rows.column("lsn"),
                "xid": pa.array(fields[:, 2], pa.int64()),
                "commit_ts": pa.array(fields[:, 3], pa.int64()).cast(pa.timestamp("us", tz="UTC")),
                "seq": pa.array(seq, pa.int32()),
                "action": rows.column("action"),
                "schema_name": pc.take(schemas, version),
                "table_name": pc.take(tables, version),
                "relation_version": version,
                "key": rows.column("key"),
                "new_row": rows.column("new_row"),
                "unchanged_toast": rows.column("unchanged_toast"),
                "flags": rows.column("flags"),
            },
            schema=CHANGE_SCHEMA,
        )

    def _write(self, rows: pa.Table) -> None:
        for entry in pc.value_counts(rows.column("action")).to_pylist():
            self.counts[entry["values"]] += entry["counts"]
        self.writer.write(rows)

    def manifest(self, result: RangeResult) -> RangeManifest:
        """What the store keeps beside the rows of ``result``: it and the relations and types
        the rows refer to."""
        return RangeManifest(
            result=result,
            relations=self.relations_meta,
            types={str(oid): name for oid, name in self.types.items()},
        )

    def successor(self, rng: LsnRange, writer: RowSink) -> RangeDecoder:
        """A decoder for the next range of the same peek. pgoutput sends a relation's
        Relation (and a type's Type) message once per peek, so the next range starts with
        every relation and type seen so far (its manifest lists them; a version no row uses
        is harmless, as a straddler's relation is today)."""
        following = RangeDecoder(rng, writer, self.spill_rows)
        following.relations = dict(self.relations)
        following.versions = list(self.versions)
        following.relations_meta = list(self.relations_meta)
        following.types = dict(self.types)
        return following

    def cut(self, end: int, straddlers: list[Straddler], seconds: float) -> RangeResult:
        """Finish the range early, at ``end``: the end_lsn of the COMMIT just fed (so no
        transaction is open in the output). ``straddlers`` are transactions the peek shows
        after that COMMIT that began before ``end``; each COMMIT record starts at or after
        ``end`` (records do not overlap), so the safe point is ``end`` itself."""
        if self.open is not None or self.last_end != end:
            raise DecodeError(f"a range can only be cut just after a COMMIT ending at {end}")
        return self._end_at(end, straddlers, seconds)

    def close_at(
        self, end: int, seconds: float, streaming: Sequence[Straddler] = ()
    ) -> RangeResult:
        """Finish the range at ``end``, a point a stream vouched for (:mod:`..source.walsender`): no
        transaction is open in the output, and every transaction whose COMMIT ends at or before
        ``end`` was fed. No record straddles it, so it is the safe point; without a
        transaction it is an empty range that moves the slot on an idle source.
        ``streaming``: transactions begun before ``end`` and still being streamed (their
        COMMIT lies after ``end``): the range's straddlers, deferred whole to the range of
        their COMMIT."""
        if self.open is not None or max(self.last_end or 0, int(self.range.start)) > end:
            raise DecodeError(f"a range cannot end at {end} with a transaction open before it")
        return self._end_at(end, [s for s in streaming if s.first_lsn < end], seconds)

    def _end_at(self, end: int, straddlers: list[Straddler], seconds: float) -> RangeResult:
        self.range = LsnRange(self.range.start, end)
        self.straddlers = straddlers
        return self.finish(seconds)

    def finish(self, seconds: float) -> RangeResult:
        if self.open is not None:
            self._straddler(self.open)
            self.open = None
        end = int(self.range.end)
        point = max(safe_point(end, self.straddlers), self.last_end or 0)
        return RangeResult(
            range_key=self.range.key,
            start_lsn=str(self.range.start),
            endpos=str(self.range.end),
            endpos_outcome=classify_endpos(end, self.last_end, self.straddlers),
            transform_lsn=None if self.last_end is None else str(Lsn(self.last_end)),
            safe_point=str(Lsn(point)),
            last_xid=self.last_xid,
            last_commit_ts_us=self.last_ts,
            transactions=self.transactions,
            changes=self.writer.rows,
            inserts=self.counts["I"],
            updates=self.counts["U"],
            deletes=self.counts["D"],
            truncates=self.counts["T"],
            messages=self.messages,
            straddlers=[asdict(s) for s in self.straddlers],
            wire_bytes=self.wire_bytes,
            seconds=round(seconds, 4),
        )


_HOT_KINDS = np.array([KIND_BEGIN, KIND_COMMIT, KIND_INSERT, KIND_UPDATE, KIND_DELETE], np.uint8)
_UNCHANGED = ord("u")
_ROW_SCHEMA = pa.schema(
    [
        ("msg_idx", pa.int64()),
        ("lsn", pa.int64()),
        ("action", pa.string()),
        ("relation_version", pa.int32()),
        ("key", pa.list_(pa.string())),
        ("new_row", pa.list_(pa.string())),
        ("unchanged_toast", pa.list_(pa.string())),
        ("flags", pa.int8()),
    ]
)


def _take(table: pa.Table, rows: np.ndarray) -> pa.Table:
    """``table``'s ``rows`` (ascending): a zero-copy slice when they are one run, as they
    nearly always are (a batch's changes minus those of transactions before the range or still
    open at its end), else a copy. A slice keeps the whole batch's buffers alive, so a small
    part of a batch (which may be parked for long) is copied."""
    if int(rows[-1]) - int(rows[0]) + 1 == len(rows) and 2 * len(rows) >= table.num_rows:
        return table.slice(int(rows[0]), len(rows))
    return table.take(pa.array(rows))


def _merge_in_order(table: pa.Table, truncates: list[tuple[int, int, int, int]]) -> pa.Table:
    """Slot TRUNCATE rows (one per truncated table) in among the change rows, by position."""
    n = len(truncates)
    extra = pa.table(
        {
            "msg_idx": pa.array([t[0] for t in truncates], pa.int64()),
            "lsn": pa.array([t[1] for t in truncates], pa.int64()),
            "action": pa.array(["T"] * n, pa.string()),
            "relation_version": pa.array([t[2] for t in truncates], pa.int32()),
            "key": pa.nulls(n, pa.list_(pa.string())),
            "new_row": pa.nulls(n, pa.list_(pa.string())),
            "unchanged_toast": pa.nulls(n, pa.list_(pa.string())),
            "flags": pa.array([t[3] for t in truncates], pa.int8()),
        },
        schema=_ROW_SCHEMA,
    )
    merged = pa.concat_tables([table.cast(_ROW_SCHEMA), extra])
    order = np.argsort(merged.column("msg_idx").to_numpy(), kind="stable")
    return merged.take(pa.array(order))
