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

Both targets are compared with the source (row counts, and the next ``orders`` key each would
hand out).

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/cutover.py [--seconds 5]
[--repeat 1] [--json F]``.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import threading
import time
from typing import Any

import psycopg
from add_table import caught_up, native_subscription
from apply import bench_clusters, warm_command_server
from many_tables import PGCDC, emit_report, pgcdc_env, timed_command
from psycopg import sql

from pgcdc_dagster.demo.local_cluster import LocalCluster
from pgcdc_dagster.engine.control.range_lock import lock_holders


def make_source(source: LocalCluster) -> str:
    with psycopg.connect(source.dsn(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE app")
    dsn = source.dsn("app")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id serial PRIMARY KEY, v text)")
        conn.execute("CREATE TABLE items (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO orders (v) SELECT md5(g::text) FROM generate_series(1, 10000) g")
        conn.execute("INSERT INTO items SELECT g, md5(g::text) FROM generate_series(1, 10000) g")
        conn.execute("CREATE PUBLICATION native FOR TABLE orders, items")
    return dsn


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


def native_caught_up_s(source_dsn: str, run: int, seconds: list[float]) -> None:
    started = time.perf_counter()
    caught_up(source_dsn, f"native_{run}")
    seconds.append(time.perf_counter() - started)


def native_cutover(source_dsn: str, native_dsn: str, run: int) -> tuple[float, float]:
    """The sequences set by hand, then the subscription dropped: seconds of each."""
    started = time.perf_counter()
    with psycopg.connect(source_dsn) as src:
        (last, called) = src.execute(  # type: ignore[misc]
            "SELECT last_value, is_called FROM orders_id_seq"
        ).fetchone()
    with psycopg.connect(native_dsn, autocommit=True) as dst:
        dst.execute("SELECT setval('orders_id_seq', %s, %s)", (last, called))
    cutover = time.perf_counter() - started
    started = time.perf_counter()
    with psycopg.connect(native_dsn, autocommit=True) as dst:
        dst.execute(sql.SQL("DROP SUBSCRIPTION {}").format(sql.Identifier(f"native_{run}")))
    return cutover, time.perf_counter() - started


def state(dsn: str) -> tuple[int, int, int]:
    """Row counts, and the next ``orders`` key this database would hand out."""
    with psycopg.connect(dsn) as conn:
        (orders,) = conn.execute("SELECT count(*) FROM orders").fetchone()  # type: ignore[misc]
        (items,) = conn.execute("SELECT count(*) FROM items").fetchone()  # type: ignore[misc]
        (last, called) = conn.execute(  # type: ignore[misc]
            "SELECT last_value, is_called FROM orders_id_seq"
        ).fetchone()
    return orders, items, last + 1 if called else last


def one_run(args: argparse.Namespace, run: int) -> dict[str, Any]:
    with bench_clusters() as (work, source, target):
        source_dsn = make_source(source)
        env = {**pgcdc_env(work, source_dsn, target, run), "PGCDC_SERVER": "auto"}
        timed_command(env, work, "snapshot")
        native_dsn = native_subscription(source_dsn, target, run, ("orders", "items"))
        with warm_command_server(env):
            follow = subprocess.Popen(
                [PGCDC, "follow"], env=env, cwd=work, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            try:
                while not any(
                    h.holder.startswith("run ")
                    for h in lock_holders(env["PGCDC_TARGET_DSN"], env["PGCDC_SLOT"])
                ):
                    time.sleep(0.1)
                transactions = write(source_dsn, args.seconds)
                native_s: list[float] = []
                native = threading.Thread(
                    target=native_caught_up_s, args=(source_dsn, run, native_s)
                )
                native.start()
                ours_cutover = timed_command(env, work, "cutover")
                ours_finish = timed_command(env, work, "finish")
                _, err = follow.communicate(timeout=120)
                native.join()
            finally:
                if follow.poll() is None:
                    follow.send_signal(signal.SIGTERM)
                    follow.communicate(timeout=120)
            if follow.returncode != 0:
                raise RuntimeError(f"pgcdc follow failed: {err[-3000:]}")
        native_sequences, native_drop = native_cutover(source_dsn, native_dsn, run)
        expected = state(source_dsn)
        with psycopg.connect(source_dsn) as conn:
            slots = conn.execute("SELECT count(*) FROM pg_replication_slots").fetchone()[0]  # type: ignore[index]
        return {
            "transactions": transactions,
            "ours_cutover_s": round(ours_cutover, 3),
            "ours_finish_s": round(ours_finish, 3),
            "native_cutover_s": round(native_s[0] + native_sequences, 3),
            "native_drop_s": round(native_drop, 3),
            "ours_equal": state(env["PGCDC_TARGET_DSN"]) == expected,
            "native_equal": state(native_dsn) == expected,
            "slots_left_on_source": slots,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    runs = [one_run(args, i) for i in range(args.repeat)]
    emit_report({"seconds": args.seconds, "runs": runs}, args.json)


if __name__ == "__main__":
    main()
