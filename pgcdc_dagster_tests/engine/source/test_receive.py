"""Receiving LSN ranges from a real source slot: endpos outcomes, the collision, safe points."""

from __future__ import annotations

import threading
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pyarrow.compute as pc
import pytest

from pgcdc_dagster.engine.lsn import Lsn, LsnRange
from pgcdc_dagster.engine.source.peek import ReceiveError, receive
from pgcdc_dagster.engine.source.slot import read_slot
from pgcdc_dagster.engine.store.output_store import EndposOutcome, OutputStore
from pgcdc_dagster_tests.support.pg import flush_lsn, run_sql

SLOT = "recv_slot"
PUB = "recv_pub"


@dataclass
class Publisher:
    """A source database that publishes ``items``, ``"Odd Schema"."select"`` and ``nopk``
    through a slot of its own, and a store to receive its ranges into."""

    dsn: str
    store: OutputStore
    start: Lsn

    def sql(self, *statements: str) -> None:
        run_sql(self.dsn, *statements)

    def flush_lsn(self) -> Lsn:
        return flush_lsn(self.dsn)

    def confirmed(self) -> Lsn:
        with psycopg.connect(self.dsn) as conn:
            return read_slot(conn, SLOT).confirmed_flush_lsn

    def receive(self, endpos, start=None, **kwargs):
        result = receive(self.dsn, SLOT, PUB, self.store, start or self.start, endpos, **kwargs)
        self.start = Lsn.parse(result.endpos)
        return result

    def stored(self, result):
        return self.store.get(LsnRange.from_key(result.range_key))

    def rows(self, result):
        return self.stored(result).read_table()

    def peek_transactions(self) -> list[dict]:
        """(first_lsn, commit_lsn, end_lsn, xid) of every pending transaction, from the slot."""
        with psycopg.connect(self.dsn) as conn:
            rows = conn.execute(
                "SELECT lsn::text, xid::text::bigint, get_byte(data, 0), data "
                "FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, "
                "'proto_version', '1', 'publication_names', %s)",
                (SLOT, PUB),
            ).fetchall()
        txns, current = [], None
        for lsn, xid, kind, data in rows:
            if kind == ord("B"):
                current = {"first_lsn": Lsn(lsn), "xid": xid}
            elif kind == ord("C"):
                current["commit_lsn"] = Lsn(int.from_bytes(data[2:10], "big"))
                current["end_lsn"] = Lsn(int.from_bytes(data[10:18], "big"))
                txns.append(current)
        return txns


@pytest.fixture
def publisher(source_dsn, tmp_path) -> Publisher:
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(
            """
            CREATE TYPE mood AS ENUM ('sad', 'happy');
            CREATE TABLE items (id int PRIMARY KEY, name text, big text, feeling mood);
            CREATE SCHEMA "Odd Schema";
            CREATE TABLE "Odd Schema"."select" ("Key" int PRIMARY KEY, "order" text);
            CREATE TABLE nopk (a int, b text);
            ALTER TABLE nopk REPLICA IDENTITY FULL;
            CREATE TABLE unpublished (id serial PRIMARY KEY, payload text);
            """
        )
        conn.execute('CREATE PUBLICATION recv_pub FOR TABLE items, "Odd Schema"."select", nopk')
        start = conn.execute(
            "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,)
        ).fetchone()[0]
    return Publisher(source_dsn, OutputStore(tmp_path / "store"), Lsn(start))


def test_endpos_at_commit_boundary_stores_the_transaction_and_advances_to_it(publisher):
    publisher.sql("INSERT INTO items VALUES (1, 'a'), (2, 'b')")
    (txn,) = publisher.peek_transactions()
    result = publisher.receive(txn["end_lsn"])
    assert result.endpos_outcome == EndposOutcome.AT_COMMIT_BOUNDARY
    assert result.transform_lsn == str(txn["end_lsn"])
    assert result.last_xid == txn["xid"]
    assert (result.transactions, result.changes, result.inserts) == (1, 2, 2)
    assert publisher.confirmed() == txn["end_lsn"]
    table = publisher.rows(result)
    assert table.column("new_row").to_pylist() == [["1", "a", None, None], ["2", "b", None, None]]
    assert table.column("key").to_pylist() == [["1"], ["2"]]
    assert set(table.column("commit_end_lsn").to_pylist()) == {int(txn["end_lsn"])}
    assert table.column("seq").to_pylist() == [0, 1]


def test_consecutive_transactions_share_the_collision_lsn_and_split_cleanly(publisher):
    # The collision needs the two commits adjacent in the WAL; the cluster is shared, so a
    # record of another session's may land between them: then the pair is tried again.
    for n in range(1, 10, 2):
        publisher.sql(
            f"INSERT INTO items VALUES ({n}, 'a')", f"INSERT INTO items VALUES ({n + 1}, 'b')"
        )
        first, second = publisher.peek_transactions()[-2:]
        if first["end_lsn"] == second["first_lsn"]:  # the collision
            break
    assert first["end_lsn"] == second["first_lsn"]
    if n > 1:
        publisher.receive(first["first_lsn"])  # the earlier tries' transactions, out of the way
    r1 = publisher.receive(first["end_lsn"])
    assert r1.endpos_outcome == EndposOutcome.AT_COMMIT_BOUNDARY and r1.transactions == 1
    r2 = publisher.receive(second["end_lsn"])
    assert r2.endpos_outcome == EndposOutcome.AT_COMMIT_BOUNDARY and r2.transactions == 1
    assert publisher.rows(r1).column("key").to_pylist() == [[str(n)]]
    assert publisher.rows(r2).column("key").to_pylist() == [[str(n + 1)]]


def test_endpos_between_transactions_keeps_transform_lsn_at_last_commit(publisher):
    publisher.sql("INSERT INTO items VALUES (1, 'a')")
    (txn,) = publisher.peek_transactions()
    publisher.sql("INSERT INTO unpublished (payload) VALUES ('x')", "SELECT pg_switch_wal()")
    publisher.sql("INSERT INTO unpublished (payload) VALUES ('y')")
    endpos = publisher.flush_lsn()
    assert endpos > txn["end_lsn"]
    result = publisher.receive(endpos)
    assert result.endpos_outcome == EndposOutcome.BETWEEN_TRANSACTIONS
    assert result.transform_lsn == str(txn["end_lsn"])
    assert result.safe_point == str(endpos)
    assert publisher.confirmed() == endpos


def test_endpos_mid_transaction_defers_whole_txn_to_next_range(publisher):
    publisher.sql("INSERT INTO items VALUES (1, 'before')")
    with psycopg.connect(publisher.dsn) as open_txn:
        open_txn.execute("INSERT INTO items VALUES (10, 'straddler part 1')")
        with psycopg.connect(publisher.dsn) as other:
            endpos = Lsn(other.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])
        open_txn.execute("INSERT INTO items VALUES (11, 'straddler part 2')")
        open_txn.commit()
    publisher.sql("SELECT pg_switch_wal()")  # make sure endpos is flushed
    before, straddler = publisher.peek_transactions()
    assert straddler["first_lsn"] < endpos < straddler["commit_lsn"]

    result = publisher.receive(endpos)
    assert result.endpos_outcome == EndposOutcome.MID_TRANSACTION
    assert result.transform_lsn == str(before["end_lsn"])
    assert result.transactions == 1
    assert publisher.rows(result).column("key").to_pylist() == [["1"]]
    assert [s["xid"] for s in result.straddlers] == [straddler["xid"]]
    assert Lsn.parse(result.safe_point) <= straddler["commit_lsn"]

    nxt = publisher.receive(straddler["end_lsn"])
    assert nxt.endpos_outcome == EndposOutcome.AT_COMMIT_BOUNDARY
    assert publisher.rows(nxt).column("key").to_pylist() == [["10"], ["11"]]  # whole, both parts


def test_endpos_inside_commit_record_defers_txn_and_never_skips_it(publisher):
    publisher.sql("INSERT INTO items VALUES (1, 'a')", "INSERT INTO items VALUES (2, 'b')")
    first, second = publisher.peek_transactions()
    endpos = second["end_lsn"] - 1  # inside the second COMMIT record
    assert second["commit_lsn"] < endpos
    result = publisher.receive(endpos)
    assert result.endpos_outcome == EndposOutcome.MID_TRANSACTION
    assert result.transactions == 1 and result.transform_lsn == str(first["end_lsn"])
    # The slot must stop at the start of the COMMIT record, or PostgreSQL skips it for ever.
    assert publisher.confirmed() == second["commit_lsn"]
    nxt = publisher.receive(second["end_lsn"])
    assert nxt.transactions == 1
    assert publisher.rows(nxt).column("key").to_pylist() == [["2"]]


def test_empty_range_still_advances_the_slot(publisher):
    publisher.sql("INSERT INTO unpublished (payload) VALUES ('x')")
    endpos = publisher.flush_lsn()
    result = publisher.receive(endpos)
    assert result.endpos_outcome == EndposOutcome.EMPTY
    assert result.transform_lsn is None and result.transactions == 0
    assert publisher.confirmed() == endpos
    assert publisher.rows(result).num_rows == 0


def test_retained_wal_stays_bounded_on_idle_published_tables(publisher):
    segment = 16 * 1024 * 1024
    for _ in range(6):
        publisher.sql(
            "INSERT INTO unpublished (payload) SELECT 'w' FROM generate_series(1, 2000)",
            "SELECT pg_switch_wal()",
            "CHECKPOINT",
        )
        result = publisher.receive(publisher.flush_lsn())
        assert result.endpos_outcome == EndposOutcome.EMPTY
    with psycopg.connect(publisher.dsn) as conn:
        retained = conn.execute(
            "SELECT pg_current_wal_flush_lsn() - restart_lsn FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (SLOT,),
        ).fetchone()[0]
    # Six segment switches happened; without advancing, the slot would hold all of them.
    assert retained < 3 * segment


def test_large_transaction_streams_with_bounded_memory(publisher):
    publisher.sql("INSERT INTO items SELECT g, 'row ' || g FROM generate_series(1, 200000) g")
    endpos = publisher.flush_lsn()
    tracemalloc.start()
    try:
        result = publisher.receive(endpos, spill_rows=20_000, fetch_rows=5_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.transactions == 1 and result.changes == 200_000 == result.inserts
    table = publisher.rows(result)
    assert table.num_rows == 200_000
    assert (
        pc.min(table.column("commit_end_lsn")).as_py()
        == pc.max(table.column("commit_end_lsn")).as_py()
    )
    assert table.column("seq").to_pylist() == list(range(200_000))
    # All 200k rows held as Python objects would take well over 60 MB.
    assert peak < 40 * 1024 * 1024, f"peak Python memory {peak / 1e6:.1f} MB"


def test_update_leaving_toasted_column_unchanged(publisher):
    big = "x" * 1_000_000
    publisher.sql(
        "ALTER TABLE items ALTER COLUMN big SET STORAGE EXTERNAL",
        f"INSERT INTO items VALUES (1, 'a', '{big}')",
        "UPDATE items SET name = 'b' WHERE id = 1",
    )
    result = publisher.receive(publisher.flush_lsn())
    table = publisher.rows(result)
    assert table.column("action").to_pylist() == ["I", "U"]
    assert len(table.column("new_row")[0].as_py()[2]) == 1_000_000
    assert table.column("new_row")[1].as_py() == ["1", "b", None, None]
    assert table.column("unchanged_toast").to_pylist() == [None, ["big"]]


def test_truncate_with_cascade_and_restart_identity_flags(publisher):
    publisher.sql(
        "INSERT INTO items VALUES (1, 'a')",
        "TRUNCATE items RESTART IDENTITY CASCADE",
        "TRUNCATE nopk",
    )
    result = publisher.receive(publisher.flush_lsn())
    assert result.truncates == 2
    table = publisher.rows(result).filter(pc.equal(publisher.rows(result).column("action"), "T"))
    assert table.column("table_name").to_pylist() == ["items", "nopk"]
    assert table.column("flags").to_pylist() == [3, 0]


def test_replica_identity_full_without_primary_key(publisher):
    publisher.sql(
        "INSERT INTO nopk VALUES (1, 'dup'), (1, 'dup')",
        "UPDATE nopk SET b = 'changed' WHERE ctid = (SELECT min(ctid) FROM nopk)",
        "DELETE FROM nopk WHERE b = 'changed'",
    )
    result = publisher.receive(publisher.flush_lsn())
    table = publisher.rows(result)
    assert table.column("action").to_pylist() == ["I", "I", "U", "D"]
    assert table.column("key").to_pylist() == [
        ["1", "dup"],
        ["1", "dup"],
        ["1", "dup"],
        ["1", "changed"],
    ]
    assert table.column("new_row").to_pylist()[2] == ["1", "changed"]
    stored = publisher.stored(result).manifest
    (rel,) = [r for r in stored.relations if r["table"] == "nopk"]
    assert rel["replica_identity"] == "f"


def test_nulls_unicode_enums_and_odd_identifiers(publisher):
    publisher.sql(
        "INSERT INTO items VALUES (1, NULL, 'ünïcødé ✓ 漢字', 'happy')",
        """INSERT INTO "Odd Schema"."select" VALUES (7, 'quote '' and "dq"')""",
        """UPDATE "Odd Schema"."select" SET "Key" = 8 WHERE "Key" = 7""",
    )
    result = publisher.receive(publisher.flush_lsn())
    table = publisher.rows(result)
    assert table.column("new_row").to_pylist()[0] == ["1", None, "ünïcødé ✓ 漢字", "happy"]
    assert table.column("schema_name").to_pylist()[1:] == ["Odd Schema", "Odd Schema"]
    assert table.column("table_name").to_pylist()[1:] == ["select", "select"]
    assert table.column("new_row").to_pylist()[1] == ["7", 'quote \' and "dq"']
    # A key change: the old key finds the row, the new row carries the new key.
    assert table.column("key").to_pylist()[2] == ["7"]
    assert table.column("new_row").to_pylist()[2][0] == "8"


def test_relation_re_sent_after_ddl_replaces_the_cached_one(publisher):
    publisher.sql(
        "INSERT INTO items VALUES (1, 'a')",
        "ALTER TABLE items ADD COLUMN extra int DEFAULT 5",
        "INSERT INTO items VALUES (2, 'b')",
    )
    result = publisher.receive(publisher.flush_lsn())
    table = publisher.rows(result)
    assert [len(r) for r in table.column("new_row").to_pylist()] == [4, 5]
    versions = table.column("relation_version").to_pylist()
    manifest = publisher.stored(result).manifest
    widths = [len(manifest.relations[v]["columns"]) for v in versions]
    assert widths == [4, 5]


def test_re_receiving_a_stored_range_returns_it_unchanged(publisher):
    publisher.sql("INSERT INTO items VALUES (1, 'a')")
    endpos = publisher.flush_lsn()
    first = publisher.receive(endpos)
    files = sorted(p.stat().st_mtime_ns for p in Path(publisher.store.root).rglob("*.parquet"))
    again = receive(publisher.dsn, SLOT, PUB, publisher.store, first.start_lsn, endpos)
    assert again.already_stored
    assert (again.transactions, again.changes, again.transform_lsn) == (1, 1, first.transform_lsn)
    assert (
        sorted(p.stat().st_mtime_ns for p in Path(publisher.store.root).rglob("*.parquet")) == files
    )


def test_crash_between_store_and_slot_advance_is_finished_on_rerun(publisher):
    # Two slots at the same point: storing through one leaves the other exactly where a
    # crash between "range stored" and "slot advanced" would leave it.
    with psycopg.connect(publisher.dsn, autocommit=True) as conn:
        (point,) = conn.execute(
            "SELECT lsn::text FROM pg_create_logical_replication_slot('behind', 'pgoutput')"
        ).fetchone()
        conn.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (SLOT, point))
    publisher.start = Lsn(point)
    publisher.sql("INSERT INTO items VALUES (1, 'a')")
    endpos = publisher.flush_lsn()
    start = publisher.start
    result = publisher.receive(endpos)
    again = receive(publisher.dsn, "behind", PUB, publisher.store, start, endpos)
    assert again.already_stored and again.transactions == 1
    with psycopg.connect(publisher.dsn) as conn:
        assert read_slot(conn, "behind").confirmed_flush_lsn == Lsn.parse(result.safe_point)


def test_range_starting_before_the_slot_and_not_stored_is_refused(publisher):
    publisher.sql("INSERT INTO items VALUES (1, 'a')")
    endpos = publisher.flush_lsn()
    with psycopg.connect(publisher.dsn) as conn:
        conn.execute("SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (SLOT, str(endpos)))
    publisher.sql("INSERT INTO items VALUES (2, 'b')")
    with pytest.raises(ReceiveError, match="consumed elsewhere"):
        publisher.receive(publisher.flush_lsn())


def test_range_with_a_gap_is_refused(publisher):
    publisher.sql("INSERT INTO items VALUES (1, 'a')")
    flush = publisher.flush_lsn()
    with pytest.raises(ReceiveError, match="no stored range ends at"):
        publisher.receive(flush, start=publisher.start + 8)


def test_endpos_beyond_flushed_wal_is_refused(publisher):
    with pytest.raises(ReceiveError, match="beyond the source's flushed WAL"):
        publisher.receive(publisher.flush_lsn() + 10_000_000)


def test_slot_never_moves_past_a_stored_commit_under_concurrent_writes(publisher):
    stop = threading.Event()

    def writer():
        with psycopg.connect(publisher.dsn, autocommit=True) as conn:
            i = 100
            while not stop.is_set():
                with conn.transaction():
                    conn.execute("INSERT INTO items VALUES (%s, 'w')", (i,))
                    conn.execute("UPDATE items SET name = 'w2' WHERE id = %s", (i,))
                i += 1

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        results = []
        for _ in range(8):
            results.append(publisher.receive(publisher.flush_lsn()))
            assert publisher.confirmed() == Lsn.parse(results[-1].safe_point)
    finally:
        stop.set()
        thread.join()
    results.append(publisher.receive(publisher.flush_lsn()))
    keys = []
    for result in results:
        table = publisher.rows(result)
        ends = table.column("commit_end_lsn").to_pylist()
        assert all(Lsn.parse(result.start_lsn) < e <= Lsn.parse(result.endpos) for e in ends)
        if result.transform_lsn:
            assert Lsn.parse(result.safe_point) >= Lsn.parse(result.transform_lsn)
        keys += [
            k[0]
            for k, a in zip(
                table.column("key").to_pylist(), table.column("action").to_pylist(), strict=True
            )
            if a == "I"
        ]
    with psycopg.connect(publisher.dsn) as conn:
        expected = [str(r[0]) for r in conn.execute("SELECT id FROM items ORDER BY id")]
    assert sorted(keys, key=int) == expected  # every committed insert exactly once


def test_missing_publication_and_missing_slot_name_the_fix(publisher):
    from pgcdc_dagster.engine.source.slot import SlotError

    with pytest.raises(ReceiveError, match="create the publication"):
        receive(
            publisher.dsn,
            SLOT,
            "no_such_pub",
            publisher.store,
            publisher.start,
            publisher.flush_lsn(),
        )
    with pytest.raises(SlotError, match="no_such_slot"):
        receive(
            publisher.dsn,
            "no_such_slot",
            PUB,
            publisher.store,
            publisher.start,
            publisher.flush_lsn(),
        )


def test_without_lookahead_an_endpos_inside_a_commit_record_still_stops_the_slot_before_it(
    publisher,
):
    """A follower's own cuts are read up to their end only (no lookahead): the peek still
    decodes the record that crosses its end, so a COMMIT containing the end is seen and the slot
    stops at its start; a transaction open across the end goes whole to the next range."""
    publisher.sql("INSERT INTO items VALUES (1, 'a')", "INSERT INTO items VALUES (2, 'b')")
    first, second = publisher.peek_transactions()
    endpos = second["end_lsn"] - 1  # inside the second COMMIT record
    result = publisher.receive(endpos, lookahead_bytes=0)
    assert result.transactions == 1 and result.transform_lsn == str(first["end_lsn"])
    assert publisher.confirmed() == second["commit_lsn"]
    nxt = publisher.receive(second["end_lsn"], lookahead_bytes=0)
    assert publisher.rows(nxt).column("key").to_pylist() == [["2"]]

    with psycopg.connect(publisher.dsn) as open_txn:
        open_txn.execute("INSERT INTO items VALUES (10, 'open 1')")
        with psycopg.connect(publisher.dsn) as other:
            cut = Lsn(other.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])
        open_txn.execute("INSERT INTO items VALUES (11, 'open 2')")
        open_txn.commit()
    publisher.sql("SELECT pg_switch_wal()")
    before = publisher.receive(cut, lookahead_bytes=0)
    assert before.transactions == 0
    after = publisher.receive(publisher.flush_lsn(), lookahead_bytes=0)
    assert publisher.rows(after).column("key").to_pylist() == [["10"], ["11"]]
