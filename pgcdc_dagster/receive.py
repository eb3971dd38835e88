"""Receive one LSN range from the source slot into the output store.

Data flow::

    source slot ──peek (SQL, binary cursor, batches)──▶ pgoutput decode ──▶ per-column buffers
         ▲                                                                  │ whole transactions
         │ advance to the safe point, only after ──── fsync + rename ◀── Parquet (+ spill for
         │ the range is durably stored                                     huge transactions)

Which transactions a range holds
    Range ``(start, endpos]`` holds exactly the transactions whose COMMIT ``end_lsn`` lies in
    it (see :class:`~pgcdc_dagster.lsn.LsnRange`). A transaction whose COMMIT ends after
    ``endpos`` is deferred, whole, to the next range, wherever ``endpos`` falls inside it.

Why the peek looks past endpos
    PostgreSQL emits a transaction only at its COMMIT, and ``upto_lsn`` stops decoding at the
    record that contains it. To tell "between transactions" from "mid-transaction" we must see
    transactions that began before ``endpos`` but commit after it, so the peek decodes up to
    ``min(flush, endpos + lookahead)`` and keeps, server side, only rows at or before
    ``endpos``. A transaction whose Begin (at its first LSN) is kept but whose Commit (at its
    end_lsn) is not is a *straddler*. Straddlers always come last: the output is in commit
    order and their commits end after every stored one.

The safe point (what the slot may be advanced to)
    PostgreSQL skips, for ever, every transaction whose COMMIT record *starts* before the
    slot's confirmed position. So the slot may move to P only when every transaction with a
    COMMIT record starting before P is durably stored. The peek returned every transaction
    whose COMMIT starts before ``endpos`` (``endpos`` is never past the flushed WAL, checked
    first), so::

        P = endpos, lowered to the commit LSN (start of the COMMIT record) of any straddler
            whose COMMIT record contains endpos

    A straddler that commits at or after ``endpos`` does not lower P: its COMMIT starts at or
    after P, and PostgreSQL keeps ``restart_lsn`` before the first record of every transaction
    still open, so it is decoded whole again. On an idle or filtered source (no published
    change, WAL moving elsewhere) the range is empty and P = ``endpos``: the slot keeps moving
    and retained WAL stays bounded. P is never below the last stored commit's ``end_lsn``
    and the slot is never moved backwards.
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc

from .connect import connect
from .lsn import Lsn, LsnRange
from .pgoutput import (
    Begin,
    Commit,
    Delete,
    Insert,
    Message,
    Origin,
    Relation,
    Truncate,
    Type,
    Update,
    decode,
)
from .slot import advance_slot, read_slot
from .store import CHANGE_SCHEMA, OutputStore, RangeWriter, iter_batches

AT_COMMIT_BOUNDARY = "at_commit_boundary"
BETWEEN_TRANSACTIONS = "between_transactions"
MID_TRANSACTION = "mid_transaction"
EMPTY = "empty"

DEFAULT_LOOKAHEAD_BYTES = 16 * 1024 * 1024

_PEEK = """
SELECT (lsn - '0/0'::pg_lsn)::int8, data
FROM pg_logical_slot_peek_binary_changes(
    %(slot)s, %(upto)s::pg_lsn, NULL,
    'proto_version', '1', 'publication_names', %(publications)s)
WHERE lsn <= %(endpos)s::pg_lsn
"""


class ReceiveError(RuntimeError):
    """A range cannot be received as asked; the message says why and what to do."""


@dataclass
class Straddler:
    xid: int
    first_lsn: int
    commit_lsn: int


@dataclass
class ReceiveResult:
    """Watermarks and counts of one received range (also the manifest's ``result``)."""

    range_key: str
    start_lsn: str
    endpos: str
    endpos_outcome: str
    transform_lsn: str | None
    """End of the last stored COMMIT; ``None`` when the range stored no transaction."""
    safe_point: str
    """Where the slot's confirmed position was advanced to."""
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
    wire_bytes: int = 0
    seconds: float = 0.0
    already_stored: bool = False

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> ReceiveResult:
        fields = {k: v for k, v in manifest["result"].items() if k in cls.__dataclass_fields__}
        fields["bytes"] = manifest.get("bytes", 0)
        return cls(**fields)


def classify_endpos(endpos: int, last_end_lsn: int | None, straddlers: list[Straddler]) -> str:
    """Where ``endpos`` fell. A deferred transaction outranks the rest: it is the one fact
    about this range that the next range depends on."""
    if any(s.first_lsn < endpos for s in straddlers):
        return MID_TRANSACTION
    if last_end_lsn is None:
        return EMPTY
    if last_end_lsn == endpos:
        return AT_COMMIT_BOUNDARY
    return BETWEEN_TRANSACTIONS


def safe_point(endpos: int, straddlers: list[Straddler]) -> int:
    """See the module docstring: ``endpos``, lowered to the COMMIT start of a straddler whose
    COMMIT record contains ``endpos``."""
    point = endpos
    for s in straddlers:
        if s.commit_lsn < endpos:
            point = min(point, s.commit_lsn)
    return point


def receive(
    source_dsn: str,
    slot_name: str,
    publication: str,
    store: OutputStore,
    range_start: Lsn | int | str,
    endpos: Lsn | int | str,
    *,
    lookahead_bytes: int = DEFAULT_LOOKAHEAD_BYTES,
    fetch_rows: int = 20_000,
    spill_rows: int = 100_000,
) -> ReceiveResult:
    """Store every transaction of ``(range_start, endpos]`` and advance the slot past them.

    Idempotent: a range already stored is returned from the store (and the slot advanced to
    its safe point if a crash came between the store and the advance); it is never
    overwritten, even once the slot has moved past its changes.
    """
    rng = LsnRange(range_start, endpos)
    started = time.monotonic()
    with connect(source_dsn, role="source") as conn:
        stored = store.get(rng)
        if stored is not None:
            advance_slot(conn, slot_name, Lsn(stored.manifest["result"]["safe_point"]))
            conn.commit()
            result = ReceiveResult.from_manifest(stored.manifest)
            result.already_stored = True
            return result
        _check_position(conn, slot_name, store, rng)
        upto = _peek_upto(conn, rng.end, lookahead_bytes)
        with store.writer(rng) as writer:
            decoder = _RangeDecoder(rng, writer, spill_rows)
            _stream_peek(conn, slot_name, publication, rng.end, upto, decoder, fetch_rows)
            conn.commit()
            result = decoder.finish(time.monotonic() - started)
            stored = writer.commit({"result": asdict(result), "relations": decoder.relations_meta})
        result.bytes = stored.manifest["bytes"]
        advance_slot(conn, slot_name, Lsn(result.safe_point))
        conn.commit()
    result.seconds = round(time.monotonic() - started, 4)
    return result


def _check_position(
    conn: psycopg.Connection[Any], slot: str, store: OutputStore, rng: LsnRange
) -> None:
    """Refuse ranges that would lose or duplicate data, before reading anything."""
    info = read_slot(conn, slot)
    confirmed = info.confirmed_flush_lsn
    if confirmed is None:
        raise ReceiveError(f"slot {slot} has no confirmed position yet; re-create it")
    (flush,) = conn.execute("SELECT (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::int8").fetchone()  # type: ignore[misc]
    conn.commit()
    if rng.end > flush:
        raise ReceiveError(
            f"endpos {rng.end} is beyond the source's flushed WAL {Lsn(flush)}: transactions "
            "could still commit before it; choose an endpos at or before the flush position "
            "(pg_current_wal_flush_lsn()) or wait"
        )
    if confirmed > rng.start:
        raise ReceiveError(
            f"range {rng.key} starts at {rng.start}, before slot {slot}'s confirmed position "
            f"{confirmed}, and is not in the store: its changes were consumed elsewhere (another "
            "consumer of the slot, or a store that was deleted). The data between them is lost "
            "to this slot: re-take the base snapshot (pgcdc snapshot --resnapshot)"
        )
    if confirmed < rng.start:
        previous = store.range_ending_at(rng.start)
        if previous is None:
            raise ReceiveError(
                f"range {rng.key} starts at {rng.start} but the slot {slot} is at {confirmed} and "
                f"no stored range ends at {rng.start}: receive the range starting at {confirmed} "
                "first (ranges must be received in LSN order, without gaps)"
            )
        # A crash between storing the previous range and advancing the slot: finish it now.
        advance_slot(conn, slot, Lsn(previous.manifest["result"]["safe_point"]))
        conn.commit()


def _peek_upto(conn: psycopg.Connection[Any], endpos: Lsn, lookahead_bytes: int) -> Lsn:
    (flush,) = conn.execute("SELECT (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::int8").fetchone()  # type: ignore[misc]
    conn.commit()
    return Lsn(max(int(endpos), min(flush, int(endpos) + lookahead_bytes)))


def _stream_peek(
    conn: psycopg.Connection[Any],
    slot: str,
    publication: str,
    endpos: Lsn,
    upto: Lsn,
    decoder: _RangeDecoder,
    fetch_rows: int,
) -> None:
    params = {
        "slot": slot,
        "upto": str(upto),
        "endpos": str(endpos),
        # pgoutput splits this option as a list of identifiers: quote the name.
        "publications": '"' + publication.replace('"', '""') + '"',
    }
    gc_was_enabled = gc.isenabled()
    gc.disable()  # millions of short-lived objects, no cycles: the collector only costs time
    try:
        with conn.cursor(name="pgcdc_receive", binary=True) as cur:
            try:
                cur.execute(_PEEK, params)
            except psycopg.errors.ObjectInUse as exc:
                raise ReceiveError(
                    f"slot {slot} is in use by another process ({exc.diag.message_primary}): "
                    "only one receive may read a slot at a time; wait for it to finish"
                ) from None
            except psycopg.errors.UndefinedObject as exc:
                raise ReceiveError(
                    f"{exc.diag.message_primary}: create the publication {publication} "
                    "(pgcdc snapshot does) or set PGCDC_PUBLICATION to an existing one"
                ) from None
            while rows := cur.fetchmany(fetch_rows):
                decoder.feed(rows)
    finally:
        if gc_was_enabled:
            gc.enable()


class _RangeDecoder:
    """Turns the peek's rows into column buffers of whole transactions and writes them."""

    def __init__(self, rng: LsnRange, writer: RangeWriter, spill_rows: int) -> None:
        self.range = rng
        self.writer = writer
        self.spill_rows = spill_rows
        self.relations: dict[int, tuple[int, Relation]] = {}
        self.relations_meta: list[dict[str, Any]] = []
        self.types: dict[int, str] = {}
        # Row columns of the open transaction and of committed rows not yet written.
        self.lsn: list[int] = []
        self.seq: list[int] = []
        self.action: list[str] = []
        self.schema: list[str] = []
        self.table: list[str] = []
        self.relver: list[int] = []
        self.key: list[list[bytes | None] | None] = []
        self.new_row: list[list[bytes | None] | None] = []
        self.toast: list[list[str] | None] = []
        self.flags: list[int] = []
        # Transaction-level columns, extended at COMMIT to the committed row count.
        self.end_lsn: list[int] = []
        self.commit_lsn: list[int] = []
        self.xid: list[int] = []
        self.commit_ts: list[int] = []
        self.begin: Begin | None = None
        self.begin_lsn = 0
        self.txn_seq = 0
        self.spills: list[Path] = []
        self.straddlers: list[Straddler] = []
        self.counts = {"I": 0, "U": 0, "D": 0, "T": 0}
        self.transactions = 0
        self.changes = 0
        self.messages = 0
        self.wire_bytes = 0
        self.last_end: int | None = None
        self.last_xid: int | None = None
        self.last_ts: int | None = None

    def feed(self, rows: list[tuple[int, bytes]]) -> None:
        for row_lsn, data in rows:
            self.wire_bytes += len(data)
            msg = decode(data)
            cls = type(msg)
            if cls is Insert:
                version, rel = self.relations[msg.relid]  # type: ignore[union-attr]
                new = msg.new.values  # type: ignore[union-attr]
                self._change(
                    row_lsn,
                    "I",
                    version,
                    rel,
                    [new[i] for i in rel.key_indexes],
                    new,
                    msg.new.unchanged_toast,
                    0,
                )  # type: ignore[union-attr]
            elif cls is Update:
                version, rel = self.relations[msg.relid]  # type: ignore[union-attr]
                new_t = msg.new  # type: ignore[union-attr]
                old_t = msg.old or new_t  # type: ignore[union-attr]
                toast = new_t.unchanged_toast
                if msg.old is not None and msg.old.unchanged_toast:  # type: ignore[union-attr]
                    toast = tuple(sorted(set(toast) | set(msg.old.unchanged_toast)))  # type: ignore[union-attr]
                key = [old_t.values[i] for i in rel.key_indexes]
                self._change(row_lsn, "U", version, rel, key, new_t.values, toast, 0)
            elif cls is Delete:
                version, rel = self.relations[msg.relid]  # type: ignore[union-attr]
                old_t = msg.old  # type: ignore[union-attr]
                key = [old_t.values[i] for i in rel.key_indexes]
                self._change(row_lsn, "D", version, rel, key, None, old_t.unchanged_toast, 0)
            elif cls is Begin:
                self._begin(row_lsn, msg)  # type: ignore[arg-type]
            elif cls is Commit:
                self._commit(msg)  # type: ignore[arg-type]
            elif cls is Relation:
                self._relation(msg)  # type: ignore[arg-type]
            elif cls is Truncate:
                for relid in msg.relids:  # type: ignore[union-attr]
                    version, rel = self.relations[relid]
                    self._change(row_lsn, "T", version, rel, None, None, (), msg.options)  # type: ignore[union-attr]
            elif cls is Type:
                self.types[msg.oid] = f"{msg.namespace}.{msg.name}"  # type: ignore[union-attr]
            elif cls is Message:
                self.messages += 1
            elif cls is Origin:
                pass  # the origin of a transaction replicated into the source: not ours to track

    def _change(
        self,
        row_lsn: int,
        action: str,
        version: int,
        rel: Relation,
        key: list[bytes | None] | None,
        new: list[bytes | None] | None,
        toast: tuple[int, ...],
        flags: int,
    ) -> None:
        self.lsn.append(row_lsn)
        self.seq.append(self.txn_seq)
        self.txn_seq += 1
        self.action.append(action)
        self.schema.append(rel.namespace)
        self.table.append(rel.name)
        self.relver.append(version)
        self.key.append(key)
        self.new_row.append(new)
        self.toast.append([rel.columns[i].name for i in toast] if toast else None)
        self.flags.append(flags)
        if len(self.lsn) - len(self.end_lsn) >= self.spill_rows:
            self._spill_open_transaction()

    def _begin(self, row_lsn: int, begin: Begin) -> None:
        if self.begin is not None:
            # The previous transaction's COMMIT lies after endpos: it was a straddler.
            self._defer_open_transaction()
        self.begin = begin
        self.begin_lsn = row_lsn
        self.txn_seq = 0

    def _commit(self, commit: Commit) -> None:
        begin = self.begin
        if begin is None:
            return
        self.begin = None
        if not self.range.holds_commit(commit.end_lsn):
            # Ends at or before the range start: stored by the previous range already.
            self._drop_open_rows()
            return
        n_open = len(self.lsn) - len(self.end_lsn)
        for spill in self.spills:
            for batch in iter_batches(spill):
                self._write(self._with_commit(batch, begin, commit))
            spill.unlink()
        self.spills.clear()
        self.end_lsn.extend([commit.end_lsn] * n_open)
        self.commit_lsn.extend([commit.commit_lsn] * n_open)
        self.xid.extend([begin.xid] * n_open)
        self.commit_ts.extend([commit.commit_ts_us] * n_open)
        self.transactions += 1
        self.last_end, self.last_xid, self.last_ts = commit.end_lsn, begin.xid, commit.commit_ts_us
        if len(self.end_lsn) >= self.writer.row_group_rows:
            self._write_committed_prefix()

    def _relation(self, rel: Relation) -> None:
        cached = self.relations.get(rel.relid)
        if cached is not None and cached[1] == rel:
            return
        version = len(self.relations_meta)
        self.relations[rel.relid] = (version, rel)
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

    def _defer_open_transaction(self) -> None:
        begin = self.begin
        assert begin is not None
        if self.begin_lsn < self.range.end:
            self.straddlers.append(Straddler(begin.xid, self.begin_lsn, begin.final_lsn))
        self._drop_open_rows()
        self.begin = None

    def _drop_open_rows(self) -> None:
        keep = len(self.end_lsn)
        for column in self._row_columns():
            del column[keep:]
        for spill in self.spills:
            spill.unlink(missing_ok=True)
        self.spills.clear()

    def _row_columns(self) -> list[list[Any]]:
        return [
            self.lsn, self.seq, self.action, self.schema, self.table, self.relver,
            self.key, self.new_row, self.toast, self.flags,
        ]  # fmt: skip

    def _spill_open_transaction(self) -> None:
        """Bound memory on huge transactions: park the open transaction's rows on disk."""
        if self.end_lsn:
            self._write_committed_prefix()
        batch = self._batch(0, len(self.lsn), with_commit=False)
        path = self.writer.spill_path()
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as ipc:
            ipc.write_batch(batch)
        self.spills.append(path)
        for column in self._row_columns():
            column.clear()

    def _write(self, batch: pa.RecordBatch) -> None:
        for entry in pc.value_counts(batch.column(6)).to_pylist():
            self.counts[entry["values"]] += entry["counts"]
        self.writer.write(batch)

    def _write_committed_prefix(self) -> None:
        n = len(self.end_lsn)
        if n == 0:
            return
        self._write(self._batch(0, n, with_commit=True))
        for column in self._row_columns():
            del column[:n]
        for column in (self.end_lsn, self.commit_lsn, self.xid, self.commit_ts):
            column.clear()

    def _batch(self, lo: int, hi: int, *, with_commit: bool) -> pa.RecordBatch:
        n = hi - lo
        zeros = pa.nulls(n, pa.int64()) if not with_commit else None
        text_list = pa.list_(pa.binary())
        string_list = pa.list_(pa.string())
        arrays = [
            pa.array(self.end_lsn[lo:hi], pa.int64()) if with_commit else zeros,
            pa.array(self.commit_lsn[lo:hi], pa.int64()) if with_commit else zeros,
            pa.array(self.lsn[lo:hi], pa.int64()),
            pa.array(self.xid[lo:hi], pa.int64()) if with_commit else zeros,
            pa.array(self.commit_ts[lo:hi], pa.int64()).cast(pa.timestamp("us", tz="UTC"))
            if with_commit
            else pa.nulls(n, pa.timestamp("us", tz="UTC")),
            pa.array(self.seq[lo:hi], pa.int32()),
            pa.array(self.action[lo:hi], pa.string()),
            pa.array(self.schema[lo:hi], pa.string()),
            pa.array(self.table[lo:hi], pa.string()),
            pa.array(self.relver[lo:hi], pa.int32()),
            _text_lists(self.key[lo:hi], text_list, string_list),
            _text_lists(self.new_row[lo:hi], text_list, string_list),
            pa.array(self.toast[lo:hi], string_list),
            pa.array(self.flags[lo:hi], pa.int8()),
        ]
        schema = CHANGE_SCHEMA if with_commit else _nullable(CHANGE_SCHEMA)
        return pa.RecordBatch.from_arrays(arrays, schema=schema)

    @staticmethod
    def _with_commit(batch: pa.RecordBatch, begin: Begin, commit: Commit) -> pa.RecordBatch:
        n = batch.num_rows
        columns = batch.columns[:]
        columns[0] = pa.array([commit.end_lsn] * n, pa.int64())
        columns[1] = pa.array([commit.commit_lsn] * n, pa.int64())
        columns[3] = pa.array([begin.xid] * n, pa.int64())
        columns[4] = pa.array([commit.commit_ts_us] * n, pa.int64()).cast(
            pa.timestamp("us", tz="UTC")
        )
        return pa.RecordBatch.from_arrays(columns, schema=CHANGE_SCHEMA)

    def finish(self, seconds: float) -> ReceiveResult:
        if self.begin is not None:
            self._defer_open_transaction()
        self._write_committed_prefix()
        end = int(self.range.end)
        point = max(safe_point(end, self.straddlers), self.last_end or 0)
        return ReceiveResult(
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


def _text_lists(values: list[Any], text_list: pa.DataType, string_list: pa.DataType) -> pa.Array:
    """Lists of raw text values as ``list<string>`` (UTF-8 validated in bulk)."""
    try:
        return pa.array(values, text_list).cast(string_list)
    except pa.ArrowInvalid as exc:
        raise ReceiveError(
            "a decoded value is not valid UTF-8: the source database must use the UTF8 "
            f"encoding ({exc})"
        ) from None


def _nullable(schema: pa.Schema) -> pa.Schema:
    return pa.schema([f.with_nullable(True) for f in schema])
