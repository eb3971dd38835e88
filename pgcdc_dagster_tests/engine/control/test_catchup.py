"""Snapshot + every later range reproduce the source exactly, with writes running throughout."""

from __future__ import annotations

import itertools
import random
import threading
import time

import psycopg

from pgcdc_dagster.engine.compare import verify
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster_tests.support.replication import catch_up, settings_for

SCHEMA = """
CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL, filler text);
INSERT INTO accounts SELECT g, 0, repeat('x', 80) FROM generate_series(1, 60000) g;
CREATE TABLE docs (id int PRIMARY KEY, title text, body text);
ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL;
INSERT INTO docs SELECT g, 't', repeat(md5(g::text), 200) FROM generate_series(1, 50) g;
CREATE TABLE history (account int, delta int, at timestamptz DEFAULT now());
ALTER TABLE history REPLICA IDENTITY FULL;
"""


def writer(dsn: str, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    with psycopg.connect(dsn, autocommit=True) as conn:
        next_id = 100000 + seed * 1000000
        while not stop.is_set():
            try:
                _one_transaction(conn, rng, next_id)
            except psycopg.errors.DeadlockDetected:
                continue  # two writers met on the same rows: the application retries
            next_id += 10


def _one_transaction(conn: psycopg.Connection, rng: random.Random, next_id: int) -> None:
    """One to five changes in one transaction; inserted ids from ``next_id`` up (at most 5)."""
    with conn.transaction():
        for _ in range(rng.randrange(1, 6)):
            choice = rng.random()
            account = rng.randrange(1, 60000)
            if choice < 0.5:
                delta = rng.randrange(-100, 100)
                conn.execute(
                    "UPDATE accounts SET balance = balance + %s WHERE id = %s", (delta, account)
                )
                conn.execute(
                    "INSERT INTO history (account, delta) VALUES (%s, %s)", (account, delta)
                )
            elif choice < 0.7:
                next_id += 1
                conn.execute("INSERT INTO accounts VALUES (%s, 1, 'new')", (next_id,))
            elif choice < 0.8:
                conn.execute("DELETE FROM accounts WHERE id = %s", (account,))
            elif choice < 0.9:
                conn.execute(
                    "UPDATE docs SET title = title || '.' WHERE id = %s", (rng.randrange(1, 51),)
                )
            else:
                conn.execute("DELETE FROM history WHERE ctid = (SELECT ctid FROM history LIMIT 1)")


def test_snapshot_under_concurrent_writes_then_every_range_reproduces_the_source(
    source_dsn, target_dsn, spark, tmp_path
):
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
    settings = settings_for(source_dsn, target_dsn, tmp_path, "catchup", range_max_bytes=512 * 1024)

    stop = threading.Event()
    writers = [threading.Thread(target=writer, args=(source_dsn, stop, s)) for s in (1, 2)]
    for thread in writers:
        thread.start()
    try:
        time.sleep(0.3)
        snapshot = pipeline.take_snapshot(settings, spark)
        results = []
        for _ in range(3):  # catch up while the writers keep going
            results += catch_up(settings)
    finally:
        stop.set()
        for thread in writers:
            thread.join()
    final = pipeline.resolve_endpos(settings, "current")
    results += catch_up(settings, final)
    assert len(results) >= 3
    assert sum(received.changes for received, _ in results) > 0
    chain = pipeline.store_of(settings).chain_ranges()
    assert chain[0].start == snapshot.consistent_point
    assert all(a.end == b.start for a, b in itertools.pairwise(chain))
    assert chain[-1].end >= final
    assert pipeline.origin_progress(settings) == pipeline.expected_origin_progress(settings)
    comparisons = verify.compare_tables(settings, pipeline.replicated_tables(settings))
    assert {str(c.table) for c in comparisons} == {
        "public.accounts",
        "public.docs",
        "public.history",
    }
    assert all(c.equal for c in comparisons), [c for c in comparisons if not c.equal]
    assert Lsn(final) > snapshot.consistent_point
