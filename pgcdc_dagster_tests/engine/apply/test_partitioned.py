"""Partitioned tables end to end: their keys arrive valid with the partitions' own, and the
apply's changes land in the right partition, counted right, with a key or without one."""

from __future__ import annotations

import psycopg
import pytest

from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster_tests.support.pg import set_for_database
from pgcdc_dagster_tests.support.replication import catch_up, equal_tables, settings_for

KEYED = """
CREATE TABLE m (id int, a text, b int, PRIMARY KEY (id, b)) PARTITION BY RANGE (b);
-- created on its own, columns in another order and one dropped, then attached
CREATE TABLE m1 (b int NOT NULL, junk int, a text, id int NOT NULL);
ALTER TABLE m1 DROP COLUMN junk;
ALTER TABLE m ATTACH PARTITION m1 FOR VALUES FROM (0) TO (10);
CREATE TABLE m2 PARTITION OF m FOR VALUES FROM (10) TO (20);
-- a partition partitioned again
CREATE TABLE m3 PARTITION OF m FOR VALUES FROM (20) TO (30) PARTITION BY LIST (id);
CREATE TABLE m3_low PARTITION OF m3 FOR VALUES IN (1, 2, 3);
CREATE TABLE m3_rest PARTITION OF m3 DEFAULT;
CREATE INDEX m_a ON m (a);
INSERT INTO m VALUES (1, 'one', 5), (2, 'two', 15), (3, 'three', 25), (4, 'four', 25);
"""

UNKEYED = """
CREATE TABLE q (k int, v text) PARTITION BY LIST (k);
CREATE TABLE q1 PARTITION OF q FOR VALUES IN (1);
CREATE TABLE q2 PARTITION OF q FOR VALUES IN (2);
ALTER TABLE q1 REPLICA IDENTITY FULL;
ALTER TABLE q2 REPLICA IDENTITY FULL;
ALTER TABLE q REPLICA IDENTITY FULL;  -- what its partitions' old rows carry (preflight)
-- the first row of each partition is at ctid (0,1): equal ctids, different rows
INSERT INTO q VALUES (1, 'a'), (2, 'b'), (1, 'dup'), (1, 'dup'), (2, 'b');
"""


def _replicate(source_dsn, target_dsn, tmp_path, spark, schema: str) -> ReplicationSettings:
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(schema)
    settings = settings_for(source_dsn, target_dsn, tmp_path, "parts")
    pipeline.take_snapshot(settings, spark)
    return settings


@pytest.mark.parametrize("track_counts", ["on", "off"])
def test_a_keyed_partitioned_table_arrives_with_valid_keys_and_takes_every_change(
    source_dsn, target_dsn, tmp_path, spark, staged, track_counts
):
    # Inserts told from updates by the transaction's counters, or without them (off).
    set_for_database(target_dsn, track_counts=track_counts)
    settings = _replicate(source_dsn, target_dsn, tmp_path, spark, KEYED)
    with psycopg.connect(target_dsn) as conn:
        indexes = conn.execute(
            "SELECT c.relname, i.indisvalid FROM pg_index i "
            "JOIN pg_class c ON c.oid = i.indexrelid "
            "JOIN pg_partition_tree('m') p ON p.relid = i.indrelid ORDER BY 1"
        ).fetchall()
    # Every level's key and index, each valid: the root's, the sub-partitioned one's, and
    # every leaf's, attached to them.
    assert len(indexes) == 12 and all(valid for _, valid in indexes), indexes

    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO m VALUES (5, 'five', 6), (6, 'six', 16), (7, 'seven', 27)")
        conn.execute("UPDATE m SET a = a || '!' WHERE id IN (1, 2, 3)")
        conn.execute("UPDATE m SET b = 12 WHERE id = 4")  # from m3_rest to m2
        conn.execute("DELETE FROM m WHERE id = 5")
    results = catch_up(settings)
    applied = [a.tables["public.m"] for _, a in results if "public.m" in a.tables]
    assert sum(t.inserted for t in applied) == 3  # 6, 7, and 4 in its new partition
    assert sum(t.updated for t in applied) == 3  # 1, 2, 3
    assert sum(t.deleted for t in applied) == 1  # 4 from its old partition (5 nets out)
    assert equal_tables(settings) == [("public.m", True)]
    with psycopg.connect(target_dsn) as conn:
        rows = conn.execute(
            "SELECT tableoid::regclass::text, id, a, b FROM m ORDER BY id"
        ).fetchall()
    assert rows == [
        ("m1", 1, "one!", 5),
        ("m2", 2, "two!", 15),
        ("m3_low", 3, "three!", 25),
        ("m2", 4, "four", 12),
        ("m2", 6, "six", 16),
        ("m3_rest", 7, "seven", 27),
    ]


def test_changes_of_a_partitioned_table_without_a_key_touch_one_row_of_one_partition(
    source_dsn, target_dsn, tmp_path, spark
):
    settings = _replicate(source_dsn, target_dsn, tmp_path, spark, UNKEYED)
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM q WHERE v = 'a'")
        # (each partition by itself: by ctid alone, a statement on q touches every partition)
        conn.execute("UPDATE q2 SET v = 'b2' WHERE ctid = (SELECT min(ctid) FROM q2)")
        conn.execute("DELETE FROM q1 WHERE ctid = (SELECT min(ctid) FROM q1 WHERE v = 'dup')")
    catch_up(settings)
    with psycopg.connect(target_dsn) as conn:
        rows = conn.execute("SELECT k, v FROM q ORDER BY k, v").fetchall()
    assert rows == [(1, "dup"), (2, "b"), (2, "b2")]
    assert equal_tables(settings) == [("public.q", True)]
