"""Transaction-id bounds: read on the source in one statement (a transaction running then is
not older than the bound), recorded beside the origin on the target, the newest one at or
before the target's position chosen, the older ones removed once a newer one serves."""

from __future__ import annotations

import psycopg

from pgcdc_dagster.engine.apply.xid_bounds import (
    XidBound,
    bound_for,
    read_bound,
    read_bound_of,
    record_bound,
    record_if_due,
)
from pgcdc_dagster.engine.lsn import Lsn


def test_a_bound_is_not_newer_than_a_transaction_running_when_it_is_read(source_dsn: str) -> None:
    with (
        psycopg.connect(source_dsn) as running,
        psycopg.connect(source_dsn, autocommit=True) as src,
    ):
        src.execute("CREATE TABLE t (id int PRIMARY KEY)")
        (xid,) = running.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
        src.execute("INSERT INTO t VALUES (1)")  # a later transaction, committed
        before = Lsn.parse(src.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])
        bound = read_bound(src)
        after = Lsn.parse(src.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()[0])
        running.rollback()
    assert bound is not None
    assert bound.oldest_xid <= xid < bound.next_xid  # the running one is not older
    assert before <= bound.wal <= after
    assert bound.timeline == 1 and bound.system_id.isdigit()
    assert read_bound_of("host=127.0.0.1 port=1 dbname=nothing connect_timeout=1") is None


def test_the_latest_bound_at_or_before_the_position_serves_and_older_ones_go(
    source_dsn: str, target_dsn: str
) -> None:
    def bound(wal: str, xid: int) -> XidBound:
        return XidBound(Lsn.parse(wal), xid, xid + 5, "7", 1)

    with psycopg.connect(target_dsn, autocommit=True) as tgt:
        assert bound_for(tgt, "s", Lsn.parse("0/100")) is None  # no table yet
        record_bound(tgt, "s", bound("0/100", 10), None)
        record_bound(tgt, "s", bound("0/200", 20), None)
        record_bound(tgt, "other", bound("0/150", 99), None)
        record_bound(tgt, "s", bound("0/300", 30), Lsn.parse("0/250"))  # 0/200 serves now
        kept = tgt.execute(
            "SELECT slot, wal_position::text FROM pgcdc_ddl.xid_bounds ORDER BY 1, 2"
        ).fetchall()
        assert kept == [("other", "0/150"), ("s", "0/200"), ("s", "0/300")]
        assert bound_for(tgt, "s", Lsn.parse("0/1FF")) is None
        assert bound_for(tgt, "s", Lsn.parse("0/200")) == bound("0/200", 20)
        assert bound_for(tgt, "s", Lsn.parse("0/FFF")) == bound("0/300", 30)
    # An applying process records one at its first apply, then at most every EVERY_S.
    assert record_if_due(source_dsn, target_dsn, "due", None, now=1000.0)
    assert not record_if_due(source_dsn, target_dsn, "due", None, now=1010.0)
    assert record_if_due(source_dsn, target_dsn, "due", Lsn.parse("FF/0"), now=1031.0)
    with psycopg.connect(target_dsn, autocommit=True) as tgt:
        (count,) = tgt.execute(
            "SELECT count(*) FROM pgcdc_ddl.xid_bounds WHERE slot = 'due'"
        ).fetchone()
    assert count == 1  # the newer one serves at FF/0: the older one removed
