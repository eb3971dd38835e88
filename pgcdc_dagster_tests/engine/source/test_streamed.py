"""The spool of transactions streamed before their COMMIT: what a commit reads back after
subtransaction aborts, chunk boundaries included (byte strings in, no server: the follow's
tests stream real transactions through it, `test_follow.py`)."""

import struct

from pgcdc_dagster.engine.source.streamed import StreamedTransactions, discard_left


def insert(xid: int, n: int) -> bytes:
    """A streamed Insert of one text column ``n``, carrying ``xid``."""
    value = str(n).encode()
    return (
        b"I"
        + struct.pack("!II", xid, 16384)
        + b"N"
        + struct.pack("!HcI", 1, b"t", len(value))
        + value
    )


def plain(message: bytes) -> bytes:
    return message[:1] + message[5:]


def read_back(spool: StreamedTransactions, xid: int) -> list[tuple[int, bytes]]:
    out = []
    for lsns, batch in spool.commit(xid):
        out += [
            (int(lsn), batch.buf[s:e].tobytes())
            for lsn, s, e in zip(lsns, batch.starts, batch.ends, strict=True)
        ]
    return out


def test_a_subtransactions_abort_drops_it_and_what_came_after_even_inside_a_chunk(tmp_path):
    spool = StreamedTransactions(tmp_path / "streaming")
    rows = [(100 + i, insert(7, i)) for i in range(3)]  # the top transaction
    rows += [(200 + i, insert(8, i)) for i in range(2)]  # subtransaction 8, released
    rows += [(300 + i, insert(9, i)) for i in range(4)]  # subtransaction 9, rolled back
    spool.begin(7, 100)
    spool.add(7, rows[:4])  # subtransaction 8 begins in this chunk,
    spool.add(7, rows[4:7])  # 9 in this one: the abort cuts it
    spool.add(7, rows[7:])
    assert [s.xid for s in spool.straddlers(250)] == [7] and spool
    spool.abort(7, 9)
    spool.abort(7, 12)  # nothing of it was streamed: nothing to drop
    spool.add(7, [(400, insert(7, 99))])  # after the rollback to the savepoint
    got = read_back(spool, 7)
    assert got == [(lsn, plain(m)) for lsn, m in rows[:5]] + [(400, plain(insert(7, 99)))]
    assert not spool and not list((tmp_path / "streaming").iterdir())


def test_an_aborted_transaction_leaves_nothing_and_others_are_kept(tmp_path):
    spool = StreamedTransactions(tmp_path / "streaming")
    spool.begin(7, 100)
    spool.begin(11, 150)
    spool.add(7, [(100, insert(7, 1))])
    spool.add(11, [(150, insert(11, 2))])
    spool.abort(7, 7)
    assert [s.xid for s in spool.straddlers(160)] == [11]
    assert read_back(spool, 11) == [(150, plain(insert(11, 2)))]
    assert read_back(spool, 7) == []


def test_what_a_killed_session_spooled_is_removed_by_the_next_reader(tmp_path):
    folder = tmp_path / "streaming"
    spool = StreamedTransactions(folder)
    spool.begin(7, 100)
    spool.add(7, [(100, insert(7, 1))])
    assert list(folder.iterdir())  # a process killed here leaves this
    discard_left(folder)
    assert not folder.exists()
    discard_left(folder)  # nothing left: nothing to do
