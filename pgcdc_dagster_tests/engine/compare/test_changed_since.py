"""The fast path's two reads: the rows written since a bound, found by ``xmin`` whatever
freezing and rewriting did to the rows; and the keys per bucket, equal on equal sides. A bound
of another source, or one too old to compare by age, is refused with its reason."""

from __future__ import annotations

import dataclasses

import psycopg
from psycopg import sql

from pgcdc_dagster.engine.apply.xid_bounds import read_bound
from pgcdc_dagster.engine.compare.changed_since import (
    KeyedTable,
    bound_unusable,
    buckets_for,
    changed_filter,
    key_sums,
)
from pgcdc_dagster.engine.identifiers import TableName


def test_rows_written_since_the_bound_are_found_after_freeze_vacuum_full_and_cluster(
    source_dsn: str,
) -> None:
    with psycopg.connect(source_dsn, autocommit=True) as src:
        src.execute("CREATE TABLE t (id int PRIMARY KEY, v int)")
        src.execute("INSERT INTO t SELECT g, 0 FROM generate_series(1, 1000) g")
        bound = read_bound(src)
        assert bound is not None
        src.execute("UPDATE t SET v = 1 WHERE id % 100 = 0")
        src.execute("INSERT INTO t VALUES (1001, 1)")

        def changed() -> object:
            with src.transaction():
                query = sql.SQL("SELECT array_agg(id ORDER BY id) FROM t WHERE {}").format(
                    changed_filter(src, bound)
                )
                return src.execute(query).fetchone()

        expected = [*range(100, 1001, 100), 1001]
        assert changed() == (expected,)
        for rewrite in ("VACUUM FREEZE t", "VACUUM FULL t", "CLUSTER t USING t_pkey"):
            src.execute(rewrite)
            assert changed() == (expected,), rewrite
        assert bound_unusable(src, bound) is None
        assert "another source" in (
            bound_unusable(src, dataclasses.replace(bound, system_id="1")) or ""
        )
        assert "timeline" in (bound_unusable(src, dataclasses.replace(bound, timeline=2)) or "")
        ancient = dataclasses.replace(bound, oldest_xid=bound.oldest_xid - 3_000_000_000)
        assert "autovacuum_freeze_max_age" in (bound_unusable(src, ancient) or "")
        assert "no transaction-id bound" in (bound_unusable(src, None) or "")


def test_equal_keys_give_equal_buckets_and_a_deleted_key_changes_one(
    source_dsn: str, target_dsn: str
) -> None:
    keyed = KeyedTable(TableName("public", "k"), ("a", "b", "v"), ("a", "b"))
    for dsn in (source_dsn, target_dsn):
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE k (a int, b text, v int, PRIMARY KEY (a, b))")
            conn.execute("INSERT INTO k SELECT g, 'x' || g, g FROM generate_series(1, 3000) g")
    buckets = buckets_for(250_000)
    assert buckets == 4 and buckets_for(0) == 1 and buckets_for(10**12) == 4096
    with (
        psycopg.connect(source_dsn, autocommit=True) as src,
        psycopg.connect(target_dsn, autocommit=True) as tgt,
    ):
        integer = KeyedTable(keyed.table, ("a", "v"), ("a",), integer_key=True)
        for table, text_hash in ((keyed, True), (keyed, False), (integer, False)):
            for count in (buckets, 1):  # per bucket, and the totals
                ours = key_sums(src, table, count, source=True, text_hash=text_hash)
                assert ours == key_sums(tgt, table, count, source=False, text_hash=text_hash)
                assert sum(n for n, _ in ours.values()) == 3000 and len(ours) == count
        src.execute("DELETE FROM k WHERE a = 77")
        src.execute("UPDATE k SET v = -1")  # values do not count: keys only
        for table in (keyed, integer):
            ours = key_sums(src, table, buckets, source=True, text_hash=True)
            theirs = key_sums(tgt, table, buckets, source=False, text_hash=True)
            assert len([b for b in theirs if ours.get(b) != theirs[b]]) == 1
            totals = key_sums(src, table, 1, source=True, text_hash=True)
            assert totals != key_sums(tgt, table, 1, source=False, text_hash=True)
            assert totals[0][0] == 2999
