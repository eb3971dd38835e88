"""Many small tables, through the commands a user runs, against native logical replication.

A real database has hundreds of tables, most of them small; pgbench has four. This measures
what a table costs, not what a row costs: ``--tables`` tables of ``--rows`` rows each (an
``int`` key, a ``text`` and a ``numeric`` column), in one source database.

Per repeat, in the same run, on fresh target databases:

1. ``pgcdc snapshot`` from a fresh process (``PGCDC_SERVER=off``: cold, the first command on
   the machine; Dagster on PostgreSQL), against native initial sync (``CREATE SUBSCRIPTION``
   with ``copy_data``, timed until every table is ``ready``);
2. with the native subscription disabled, ``--transactions`` transactions that each update
   one row of every table; then ``pgcdc catchup --endpos current`` from a fresh process,
   against the native subscription enabled again, timed until its slot confirms the same end.
   ``--server warm``: the catch-up runs with the command server an earlier command left up
   (started after the snapshot, outside the timing), as a user's second command does.

Both targets are compared with the source, table by table (row counts and a content hash:
``benchmarks/harness.py``'s equality, as its clusters, commands and native peer).

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/many_tables.py [--tables 200]
[--rows 200] [--transactions 5] [--repeat 1] [--server off|warm] [--json F]
[--profile production|throwaway]``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from pgcdc_dagster.demo.local_cluster import LocalCluster
from pgcdc_dagster.engine.lsn import Lsn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

SERVER_HELP = "off: every command cold; warm: the catch-up with the command server up"


def _table(i: int) -> sql.Identifier:
    return sql.Identifier(f"t{i:04d}")


def _names(tables: int) -> list[str]:
    return [f"public.t{i:04d}" for i in range(tables)]


def make_source(source: LocalCluster, tables: int, rows: int) -> str:
    """``tables`` tables of ``rows`` rows, all published to ``native``."""
    create = "CREATE TABLE {} (id int PRIMARY KEY, v text, n numeric)"
    fill = f"INSERT INTO {{}} SELECT g, md5(g::text), g * 1.5 FROM generate_series(1, {rows:d}) g"
    return harness.source_database(
        source, *(sql.SQL(step).format(_table(i)) for i in range(tables) for step in (create, fill))
    )


def write_backlog(source_dsn: str, tables: int, transactions: int) -> Lsn:
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        for k in range(transactions):
            with conn.transaction():
                for i in range(tables):
                    conn.execute(
                        sql.SQL("UPDATE {} SET v = v || 'x' WHERE id = %s").format(_table(i)),
                        (k + 1,),
                    )
    return harness.wal_position(source_dsn)


def native_catchup(native: harness.Subscription, end: Lsn) -> float:
    """The disabled subscription enabled again, until its slot confirms ``end``."""
    with (
        psycopg.connect(native.target_dsn, autocommit=True) as tgt,
        psycopg.connect(native.source_dsn, autocommit=True) as src,
    ):
        started = time.perf_counter()
        native.alter("ENABLE", tgt)
        native.wait_confirmed(end, conn=src)
        seconds = time.perf_counter() - started
        native.alter("DISABLE", tgt)
    return seconds


def one_run(args: argparse.Namespace, run: int) -> dict[str, Any]:
    with harness.bench_clusters(args.profile, extra=harness.QUIET) as (work, source, target):
        source_dsn = make_source(source, args.tables, args.rows)
        env = harness.pgcdc_env(work, source_dsn, target, f"ours_{run}", publication=f"ours_{run}")
        ours_snapshot = harness.timed_command(env, work, "snapshot")
        native, native_snapshot = harness.native_peer(source_dsn, target, f"native_{run}", "native")
        native.alter("DISABLE")
        end = write_backlog(source_dsn, args.tables, args.transactions)
        with contextlib.ExitStack() as stack:
            if args.server == "warm":
                env = {**env, "PGCDC_SERVER": "auto"}
                stack.enter_context(harness.warm_command_server(env))
            ours_catchup = harness.timed_command(env, work, "catchup", "--endpos", str(end))
        native_catchup_s = native_catchup(native, end)
        expected = harness.fingerprints(source_dsn, _names(args.tables))
        return {
            "ours_snapshot_s": round(ours_snapshot, 3),
            "native_snapshot_s": round(native_snapshot, 3),
            "snapshot_ratio": round(native_snapshot / ours_snapshot, 3),
            "ours_catchup_s": round(ours_catchup, 3),
            "native_catchup_s": round(native_catchup_s, 3),
            "catchup_ratio": round(native_catchup_s / ours_catchup, 3),
            "ours_equal": harness.equality(expected, env["PGCDC_TARGET_DSN"])["equal"],
            "native_equal": harness.equality(expected, native.target_dsn)["equal"],
        }


def main() -> None:
    parser = harness.argument_parser(__doc__, repeat=1, json=True, server=SERVER_HELP)
    parser.add_argument("--tables", type=int, default=200)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--transactions", type=int, default=5)
    args = parser.parse_args()
    runs = harness.run_repeats(lambda i: one_run(args, i), args.repeat)
    medians = {"median_snapshot_ratio": "snapshot_ratio", "median_catchup_ratio": "catchup_ratio"}
    workload = {"tables": args.tables, "rows": args.rows, "transactions": args.transactions}
    report = harness.summary(args, runs, medians, **workload, catchup_command_server=args.server)
    harness.emit_report(report, args.json)


if __name__ == "__main__":
    main()
