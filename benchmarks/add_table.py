"""A table added to a running replication, through the command a user runs, against native.

Per repeat, on fresh clusters: a source database with a small table ``a``, replicated by
``pgcdc snapshot`` and by a native subscription (``CREATE SUBSCRIPTION``, synced); then a table
``b`` of ``--rows`` rows (pgbench_accounts' shape: an ``int`` key, two ``int`` columns and an
84-character filler) is created on the source and added:

* ours: ``pgcdc add-table b`` from a fresh process (``--server off``: cold; ``warm``: with the
  command server an earlier command left up, started outside the timing), which extends the
  publication, copies ``b`` (schema, rows, key) as of its own consistent point and records it;
* native: ``ALTER PUBLICATION ... ADD TABLE b``, ``b``'s schema created on the subscriber
  (``pg_dump --schema-only -t b | psql``: native replication needs the table there first),
  ``ALTER SUBSCRIPTION ... REFRESH PUBLICATION``, timed until ``b`` is ``ready``.

Then a few changes to ``b`` on the source, ``pgcdc catchup`` (untimed) and native caught up,
and both targets' ``b`` compared with the source's (row count and an aggregate).

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/add_table.py [--rows 1000000]
[--repeat 1] [--server off|warm] [--json F]``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from typing import Any

import psycopg
from apply import bench_clusters, warm_command_server
from many_tables import emit_report, native_schema, pgcdc_env, timed_command, wait_ready
from psycopg import sql

from pgcdc_dagster.demo.local_cluster import LocalCluster
from pgcdc_dagster.engine.lsn import Lsn

POLL_S = 0.02


def make_source(source: LocalCluster) -> str:
    with psycopg.connect(source.dsn(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE app")
    dsn = source.dsn("app")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE a (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO a SELECT g, md5(g::text) FROM generate_series(1, 1000) g")
        conn.execute("CREATE PUBLICATION native FOR TABLE a")
    return dsn


def native_subscription(source_dsn: str, target: LocalCluster, run: int) -> str:
    """A native subscription to ``native``, its initial sync done; the subscriber's DSN."""
    name = f"native_{run}"
    with psycopg.connect(target.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = target.dsn(name)
    native_schema(source_dsn, dsn, "a")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION native").format(
                sql.Identifier(name), sql.Literal(source_dsn)
            )
        )
        wait_ready(conn, name)
    return dsn


def make_added(source_dsn: str, rows: int) -> None:
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE b (id int PRIMARY KEY, bid int, abalance int, filler char(84))")
        conn.execute(
            "INSERT INTO b SELECT g, g / 100000, 0, '' FROM generate_series(1, %s) g", (rows,)
        )
        conn.execute("VACUUM ANALYZE b")


def native_add(source_dsn: str, native_dsn: str, run: int) -> float:
    name = f"native_{run}"
    started = time.perf_counter()
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("ALTER PUBLICATION native ADD TABLE b")
    native_schema(source_dsn, native_dsn, "b")
    with psycopg.connect(native_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER SUBSCRIPTION {} REFRESH PUBLICATION").format(sql.Identifier(name))
        )
        wait_ready(conn, name)
    return time.perf_counter() - started


def fingerprint(dsn: str) -> tuple[int, int]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(  # type: ignore[return-value]
            "SELECT count(*), coalesce(sum(hashint4(id) # hashint4(abalance)), 0) FROM b"
        ).fetchone()


def native_caught_up(source_dsn: str, native_dsn: str, run: int) -> None:
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        (end,) = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()  # type: ignore[misc]
        while True:
            (confirmed,) = conn.execute(  # type: ignore[misc]
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                (f"native_{run}",),
            ).fetchone()
            if confirmed is not None and Lsn.parse(confirmed) >= Lsn.parse(end):
                return
            time.sleep(POLL_S)


def one_run(args: argparse.Namespace, run: int) -> dict[str, Any]:
    with bench_clusters() as (work, source, target):
        source_dsn = make_source(source)
        env = pgcdc_env(work, source_dsn, target, run)
        timed_command(env, work, "snapshot")
        native_dsn = native_subscription(source_dsn, target, run)
        make_added(source_dsn, args.rows)
        with contextlib.ExitStack() as stack:
            if args.server == "warm":
                env = {**env, "PGCDC_SERVER": "auto"}
                stack.enter_context(warm_command_server(env))
            ours = timed_command(env, work, "add-table", "b")
            native = native_add(source_dsn, native_dsn, run)
            with psycopg.connect(source_dsn, autocommit=True) as conn:
                conn.execute("UPDATE b SET abalance = abalance + 1 WHERE id % 1000 = 0")
                conn.execute("DELETE FROM b WHERE id % 1000 = 1")
            timed_command(env, work, "catchup")
        native_caught_up(source_dsn, native_dsn, run)
        expected = fingerprint(source_dsn)
        return {
            "ours_add_s": round(ours, 3),
            "native_add_s": round(native, 3),
            "ratio": round(native / ours, 3),
            "ours_equal": fingerprint(env["PGCDC_TARGET_DSN"]) == expected,
            "native_equal": fingerprint(native_dsn) == expected,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--server", choices=("off", "warm"), default="off")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    runs = [one_run(args, i) for i in range(args.repeat)]
    report = {
        "rows": args.rows,
        "command_server": args.server,
        "median_ratio": statistics.median(r["ratio"] for r in runs),
        "runs": runs,
    }
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
