"""The range decoder from byte strings: which transactions a range holds, straddlers, the safe
point, and a transaction spilled across batches. No database: pgoutput messages built here."""

from __future__ import annotations

import contextlib
import struct
from pathlib import Path

import pyarrow as pa

from pgcdc_dagster.engine.decode.range_decoder import RangeDecoder
from pgcdc_dagster.engine.lsn import LsnRange
from pgcdc_dagster.engine.store.output_store import EndposOutcome

RELID = 16400
TS = 800_000_000_000_000  # microseconds since 2000-01-01, as pgoutput sends them


def relation() -> bytes:
    columns = [(1, b"id", 23, -1), (0, b"name", 25, -1)]
    body = struct.pack("!I", RELID) + b"public\0" + b"items\0" + b"d" + struct.pack("!H", 2)
    for flags, name, oid, typmod in columns:
        body += struct.pack("!B", flags) + name + b"\0" + struct.pack("!Ii", oid, typmod)
    return b"R" + body


def begin(commit_lsn: int, xid: int) -> bytes:
    return b"B" + struct.pack("!QqI", commit_lsn, TS, xid)


def commit(commit_lsn: int, end_lsn: int) -> bytes:
    return b"C" + struct.pack("!BQQq", 0, commit_lsn, end_lsn, TS)


def insert(row_id: int, name: str) -> bytes:
    raw_id, raw_name = str(row_id).encode(), name.encode()
    tuple_data = (
        struct.pack("!H", 2)
        + b"t"
        + struct.pack("!I", len(raw_id))
        + raw_id
        + b"t"
        + struct.pack("!I", len(raw_name))
        + raw_name
    )
    return b"I" + struct.pack("!I", RELID) + b"N" + tuple_data


def transaction(first: int, rows: list[int], xid: int) -> list[tuple[int, bytes]]:
    """A transaction whose BEGIN is at ``first``; change i at first+8(i+1), its COMMIT record
    right after (COMMIT's row carries its end LSN, as the slot sends it)."""
    commit_lsn = first + 8 * (len(rows) + 1)
    out = [(first, begin(commit_lsn, xid))]
    out += [(first + 8 * (i + 1), insert(r, f"row {r}")) for i, r in enumerate(rows)]
    out.append((commit_lsn + 16, commit(commit_lsn, commit_lsn + 16)))
    return out


class ListSink:
    """A row sink in memory, with scratch files in a test folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.tables: list[pa.Table] = []
        self.rows = 0
        self.spills = 0

    def write(self, batch: pa.Table) -> None:
        self.tables.append(batch)
        self.rows += batch.num_rows

    def spill_path(self) -> Path:
        self.spills += 1
        return self.folder / f"spill-{self.spills}.arrow"

    def space_checked(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def table(self) -> pa.Table:
        return pa.concat_tables(self.tables)


def decode_range(tmp_path: Path, rng: LsnRange, feeds: list[list[tuple[int, bytes]]], spill: int):
    sink = ListSink(tmp_path)
    decoder = RangeDecoder(rng, sink, spill)
    for rows in feeds:
        decoder.feed(rows)
    return decoder.finish(0.0), sink


def test_a_straddler_is_deferred_whole_and_lowers_the_safe_point(tmp_path):
    stored = transaction(0x1000, [1, 2], xid=700)  # commits at 0x1018, ends 0x1028
    straddler = transaction(0x1028, [3], xid=701)  # begins before endpos, COMMIT contains it
    endpos = 0x1028 + 16 + 4  # inside the straddler's COMMIT record (0x1038..0x1048)
    # The slot read keeps rows at or before endpos: the straddler's BEGIN, not its COMMIT.
    rows = [row for row in [(0x0FF0, relation()), *stored, *straddler] if row[0] <= endpos]
    result, sink = decode_range(tmp_path, LsnRange(0x0F00, endpos), [rows], spill=1000)

    table = sink.table()
    assert table.column("xid").to_pylist() == [700, 700]
    assert [r[0] for r in table.column("new_row").to_pylist()] == ["1", "2"]
    assert result.transactions == 1 and result.changes == 2
    assert result.transform_lsn == "0/1028"
    assert result.endpos_outcome == EndposOutcome.MID_TRANSACTION
    assert result.safe_point == "0/1038"  # the straddler's COMMIT start, not endpos
    assert result.straddlers == [{"xid": 701, "first_lsn": 0x1028, "commit_lsn": 0x1038}]


def test_a_transaction_ending_at_the_range_start_belongs_to_the_previous_range(tmp_path):
    earlier = transaction(0x2000, [10], xid=800)  # ends at 0x2020: the range starts there
    later = transaction(0x2020, [11], xid=801)  # begins at 0x2020 (the collision)
    rows = [(0x1FF0, relation()), *earlier, *later]
    result, sink = decode_range(tmp_path, LsnRange(0x2020, 0x2040), [rows], spill=1000)
    assert sink.table().column("xid").to_pylist() == [801]
    assert result.endpos_outcome == EndposOutcome.AT_COMMIT_BOUNDARY
    assert result.safe_point == result.endpos


def test_a_transaction_open_across_batches_is_spilled_and_written_in_order(tmp_path):
    big = transaction(0x3000, list(range(1, 51)), xid=900)
    rows = [(0x2FF0, relation()), *big]
    feeds = [rows[i : i + 7] for i in range(0, len(rows), 7)]  # 8 batches
    result, sink = decode_range(tmp_path, LsnRange(0x2FF0, 0x4000), feeds, spill=10)
    table = sink.table()
    assert sink.spills > 0
    assert [int(r[0]) for r in table.column("new_row").to_pylist()] == list(range(1, 51))
    assert table.column("seq").to_pylist() == list(range(50))
    assert result.endpos_outcome == EndposOutcome.BETWEEN_TRANSACTIONS
    assert result.transactions == 1 and result.changes == 50


def test_nothing_committed_in_the_range_is_empty_and_the_slot_may_move_to_endpos(tmp_path):
    result, sink = decode_range(tmp_path, LsnRange(0x5000, 0x6000), [], spill=10)
    assert sink.rows == 0
    assert result.endpos_outcome == EndposOutcome.EMPTY
    assert result.transform_lsn is None and result.safe_point == "0/6000"


def test_a_transaction_carried_into_a_batch_that_ends_with_a_straddler_keeps_every_row(tmp_path):
    """Found on a pgbench backlog: the last fetch batch begins inside a transaction whose first
    row was parked at the end of the batch before, and ends with a straddler. Deferring the
    straddler must not drop the parked rows of the transaction that committed before it."""
    first = transaction(0x7000, [1, 2, 3], xid=1000)  # B, I, I, I, C
    # Two straddlers (their COMMITs after endpos): the batch's BEGIN/COMMIT no longer simply
    # alternate, so it is paired one message at a time.
    straddlers = [transaction(0x7100, [8], xid=1001), transaction(0x7110, [9], xid=1002)]
    endpos = 0x7110 + 8  # the straddlers' BEGINs and changes only
    deferred = [r for s in straddlers for r in s if r[0] <= endpos]
    rows = [(0x6FF0, relation()), *first, *deferred]
    # The batch boundary right after the first transaction's first change (row 1).
    feeds = [rows[:3], rows[3:]]
    result, sink = decode_range(tmp_path, LsnRange(0x6F00, endpos), feeds, spill=1000)
    table = sink.table()
    assert [int(r[0]) for r in table.column("new_row").to_pylist()] == [1, 2, 3]
    assert table.column("seq").to_pylist() == [0, 1, 2]
    assert result.transactions == 1 and result.changes == 3
    assert result.endpos_outcome == EndposOutcome.MID_TRANSACTION


def test_where_the_batches_are_cut_changes_nothing_stored(tmp_path):
    """The same slot output, cut into batches of every size, stores the same rows."""
    before = transaction(0x8000 - 0x30, [100], xid=1099)  # ends before the range start
    stored = [transaction(0x8000 + 0x40 * i, [3 * i, 3 * i + 1], xid=1100 + i) for i in range(4)]
    straddlers = [transaction(0x8200, [50], xid=1200), transaction(0x8210, [51, 52], xid=1201)]
    endpos = 0x8218
    rows = [(0x7F00, relation()), *before]
    rows += [r for txn in [*stored, *straddlers] for r in txn if r[0] <= endpos]
    rng = LsnRange(0x8000 - 0x30 + 0x20, endpos)
    expected = None
    for size in range(1, len(rows) + 1):
        feeds = [rows[i : i + size] for i in range(0, len(rows), size)]
        result, sink = decode_range(tmp_path, rng, feeds, spill=3)
        got = (
            sink.table().select(["xid", "seq", "new_row"]).to_pylist(),
            result.transactions,
            result.safe_point,
            result.endpos_outcome,
        )
        if expected is None:
            expected = got
            assert result.transactions == 4 and result.changes == 8
        assert got == expected, f"batches of {size}"
