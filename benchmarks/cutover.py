"""The end of a migration, through the commands a user runs, against native, same data.

Per repeat, on fresh clusters: a source database with ``orders`` (a ``serial`` key: its
sequence must reach the target) and ``items``, replicated by ``pgcdc snapshot`` then ``pgcdc
follow`` (running in the background, warm: the command server an earlier command left up), and
by a native subscription. A writer inserts into both tables for ``--seconds`` and stops (the
application's writes stopped for the switch). Then, timed:

* ours: ``pgcdc cutover`` (the follow makes way; the rest caught up, sequence values copied,
  every table compared), then ``pgcdc finish`` (the slot and the origin dropped; the follow
  ends by itself);
* native: from the same moment (a thread, while ours run), until the subscription's slot
  confirms the source's position; then, after ours, the sequences set by hand (``setval`` from
  the source's ``last_value``: native replication does not carry them) and ``DROP
  SUBSCRIPTION`` (which drops its slot on the source), timed on their own and added.

Ours also compares every table (row counts and a content hash), which native has no command
for.

Both targets are compared with the source (row counts and a content hash per table, and the
next ``orders`` key each would hand out).

The clusters, the commands and the native peer are ``benchmarks/harness.py``'s.

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/cutover.py [--seconds 5]
[--repeat 1] [--json F] [--profile production|throwaway]``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from pgcdc_dagster.demo.local_cluster import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

TABLES = ("public.orders", "public.items")


def make_source(source: LocalCluster) -> str:
    return harness.source_database(
        source,
        "CREATE TABLE orders (id serial PRIMARY KEY, v text)",
        "CREATE TABLE items (id int PRIMARY KEY, v text)",
        "INSERT INTO orders (v) SELECT md5(g::text) FROM generate_series(1, 10000) g",
        "INSERT INTO items SELECT g, md5(g::text) FROM generate_series(1, 10000) g",
        tables=TABLES,
    )


def write(dsn: str, seconds: float) -> int:
    """Transactions inserting into both tables for ``seconds``; how many."""
    n, end = 0, time.monotonic() + seconds
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < end:
            with conn.transaction():
                conn.execute("INSERT INTO orders (v) VALUES ('w')")
                conn.execute("INSERT INTO items VALUES (%s, 'w')", (100_000 + n,))
            n += 1
    return n


def native_caught_up_s(native: harness.Subscription, seconds: list[float]) -> None:
    started = time.perf_counter()
    native.wait_confirmed()
    seconds.append(time.perf_counter() - started)


def native_cutover(source_dsn: str, native: harness.Subscription) -> tuple[float, float]:
    """The sequences set by hand, then the subscription dropped: seconds of each."""
    started = time.perf_counter()
    with psycopg.connect(source_dsn) as src:
        (last, called) = src.execute(  # type: ignore[misc]
            "SELECT last_value, is_called FROM orders_id_seq"
        ).fetchone()
    with psycopg.connect(native.target_dsn, autocommit=True) as dst:
        dst.execute("SELECT setval('orders_id_seq', %s, %s)", (last, called))
    cutover = time.perf_counter() - started
    started = time.perf_counter()
    native.drop()
    return cutover, time.perf_counter() - started


def next_order(dsn: str) -> int:
    """The next ``orders`` key this database would hand out."""
    with psycopg.connect(dsn) as conn:
        (last, called) = conn.execute(  # type: ignore[misc]
            "SELECT last_value, is_called FROM orders_id_seq"
        ).fetchone()
    return last + 1 if called else last


def equal(source_dsn: str, target_dsn: str) -> bool:
    """The tables (row counts and content) and the next ``orders`` key both the same."""
    same = harness.targets_equal(source_dsn, target_dsn, TABLES)["equal"]
    return same and next_order(target_dsn) == next_order(source_dsn)


def one_run(args: argparse.Namespace, run: int) -> dict[str, Any]:
    with harness.bench_clusters(args.profile, extra=harness.QUIET) as (work, source, target):
        source_dsn = make_source(source)
        env = harness.pgcdc_env(
            work, source_dsn, target, f"ours_{run}", publication=f"ours_{run}", server="auto"
        )
        harness.timed_command(env, work, "snapshot")
        native, _ = harness.native_peer(
            source_dsn, target, f"native_{run}", "native", tables=TABLES
        )
        target_dsn, slot = env["PGCDC_TARGET_DSN"], env["PGCDC_SLOT"]
        with harness.warm_command_server(env):
            follow, _ = harness.start_follow(env, work, target_dsn, slot)
            try:
                transactions = write(source_dsn, args.seconds)
                native_s: list[float] = []
                waiting = threading.Thread(target=native_caught_up_s, args=(native, native_s))
                waiting.start()
                ours_cutover = harness.timed_command(env, work, "cutover")
                ours_finish = harness.timed_command(env, work, "finish")
                _, err = follow.communicate(timeout=120)
                waiting.join()
            finally:
                if follow.poll() is None:
                    follow.send_signal(signal.SIGTERM)
                    follow.communicate(timeout=120)
            if follow.returncode != 0:
                raise RuntimeError(f"pgcdc follow failed: {err[-3000:]}")
        native_sequences, native_drop = native_cutover(source_dsn, native)
        with psycopg.connect(source_dsn) as conn:
            slots = conn.execute("SELECT count(*) FROM pg_replication_slots").fetchone()[0]  # type: ignore[index]
        return {
            "transactions": transactions,
            "ours_cutover_s": round(ours_cutover, 3),
            "ours_finish_s": round(ours_finish, 3),
            "native_cutover_s": round(native_s[0] + native_sequences, 3),
            "native_drop_s": round(native_drop, 3),
            "ours_equal": equal(source_dsn, target_dsn),
            "native_equal": equal(source_dsn, native.target_dsn),
            "slots_left_on_source": slots,
        }


def main() -> None:
    parser = harness.argument_parser(__doc__, repeat=1, json=True)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    runs = harness.run_repeats(lambda i: one_run(args, i), args.repeat)
    harness.emit_report(harness.summary(args, runs, seconds=args.seconds), args.json)


if __name__ == "__main__":
    main()
