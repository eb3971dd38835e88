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

Both targets are compared with the source, table by table (row counts and an aggregate).

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/many_tables.py [--tables 200]
[--rows 200] [--transactions 5] [--repeat 1] [--server off|warm] [--json F]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from apply import bench_clusters, warm_command_server
from psycopg import sql

from pgcdc_dagster.demo.local_cluster import LocalCluster
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster.engine.postgres_installs import libpq_tool

REPO = Path(__file__).resolve().parent.parent
PGCDC = str(Path(sys.executable).parent / "pgcdc")
POLL_S = 0.02


def _table(i: int) -> sql.Identifier:
    return sql.Identifier(f"t{i:04d}")


def make_source(source: LocalCluster, tables: int, rows: int) -> str:
    with psycopg.connect(source.dsn(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE app")
    dsn = source.dsn("app")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(tables):
            conn.execute(
                sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, v text, n numeric)").format(_table(i))
            )
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} SELECT g, md5(g::text), g * 1.5 FROM generate_series(1, %s) g"
                ).format(_table(i)),
                (rows,),
            )
        conn.execute("CREATE PUBLICATION native FOR ALL TABLES")
    return dsn


def fingerprint(dsn: str, tables: int) -> list[tuple[int, str]]:
    """Per table: its row count and a sum of its rows' text, to compare both targets with."""
    with psycopg.connect(dsn) as conn:
        return [
            conn.execute(  # type: ignore[misc]
                sql.SQL(
                    "SELECT count(*), coalesce(md5(string_agg(t::text, ',' ORDER BY id)), '') "
                    "FROM {} t"
                ).format(_table(i))
            ).fetchone()
            for i in range(tables)
        ]


def pgcdc_env(work: Path, source_dsn: str, target: LocalCluster, run: int) -> dict[str, str]:
    with psycopg.connect(target.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE ours_{run}")
        conn.execute(f"CREATE DATABASE dagster_{run}")
    home = work / f"dagster_home_{run}"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    env = {
        **os.environ,
        "PGCDC_SOURCE_DSN": source_dsn,
        "PGCDC_TARGET_DSN": target.dsn(f"ours_{run}"),
        "PGCDC_SLOT": f"ours_{run}",
        "PGCDC_PUBLICATION": f"ours_{run}",
        "PGCDC_STORE": str(work / f"store_{run}"),
        "DAGSTER_HOME": str(home),
        "DAGSTER_POSTGRES_URL": (
            f"postgresql+psycopg2://postgres@127.0.0.1:{target.port}/dagster_{run}"
        ),
        "PGCDC_SERVER": "off",
        "PGCDC_SERVER_DIR": str(work / f"srv_{run}"),
    }
    # A user's Dagster storage already has its schema: create it outside the timing.
    subprocess.run(
        [
            sys.executable,
            "-c",
            "from pgcdc_dagster.defs.instance import dagster_instance as d; d()",
        ],
        env=env,
        check=True,
        cwd=work,
    )
    return env


def timed_command(env: dict[str, str], work: Path, *args: str) -> float:
    started = time.perf_counter()
    done = subprocess.run([PGCDC, *args], env=env, capture_output=True, text=True, cwd=work)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"pgcdc {' '.join(args)} failed: {done.stderr[-3000:]}")
    return seconds


def native_schema(source_dsn: str, target_dsn: str, *tables: str) -> None:
    """``pg_dump --schema-only`` of the source (only ``tables``, when named) into the target:
    native replication needs its tables there before it subscribes."""
    selection = [arg for table in tables for arg in ("-t", table)]
    schema = subprocess.run(
        [libpq_tool("pg_dump"), "--schema-only", *selection, "-d", source_dsn],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(
        [libpq_tool("psql"), "-q", "-X", "-v", "ON_ERROR_STOP=0", "-d", target_dsn],
        input=schema,
        check=True,
        capture_output=True,
    )


def wait_ready(conn: psycopg.Connection[Any], name: str) -> None:
    """Until every table of subscription ``name`` is ``ready`` (its initial sync done)."""
    states = (
        "SELECT count(*), count(*) FILTER (WHERE r.srsubstate = 'r') "
        "FROM pg_subscription_rel r JOIN pg_subscription s ON s.oid = r.srsubid "
        "WHERE s.subname = %s"
    )
    while True:
        (known, ready) = conn.execute(states, (name,)).fetchone()  # type: ignore[misc]
        if known and known == ready:
            return
        time.sleep(POLL_S)


def native_initial_sync(source_dsn: str, target: LocalCluster, run: int) -> tuple[str, float]:
    name = f"native_{run}"
    with psycopg.connect(target.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    dsn = target.dsn(name)
    native_schema(source_dsn, dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        started = time.perf_counter()
        conn.execute(
            sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION native").format(
                sql.Identifier(name), sql.Literal(source_dsn)
            )
        )
        wait_ready(conn, name)
        seconds = time.perf_counter() - started
        conn.execute(sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(sql.Identifier(name)))
    return dsn, seconds


def write_backlog(source_dsn: str, tables: int, transactions: int) -> Lsn:
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        for k in range(transactions):
            with conn.transaction():
                for i in range(tables):
                    conn.execute(
                        sql.SQL("UPDATE {} SET v = v || 'x' WHERE id = %s").format(_table(i)),
                        (k + 1,),
                    )
        (end,) = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()  # type: ignore[misc]
    return Lsn.parse(end)


def native_catchup(source_dsn: str, native_dsn: str, run: int, end: Lsn) -> float:
    name = f"native_{run}"
    with (
        psycopg.connect(native_dsn, autocommit=True) as tgt,
        psycopg.connect(source_dsn, autocommit=True) as src,
    ):
        started = time.perf_counter()
        tgt.execute(sql.SQL("ALTER SUBSCRIPTION {} ENABLE").format(sql.Identifier(name)))
        while True:
            (confirmed,) = src.execute(  # type: ignore[misc]
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
                (name,),
            ).fetchone()
            if confirmed is not None and Lsn.parse(confirmed) >= end:
                break
            time.sleep(POLL_S)
        seconds = time.perf_counter() - started
        tgt.execute(sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(sql.Identifier(name)))
    return seconds


def one_run(args: argparse.Namespace, run: int) -> dict[str, Any]:
    with bench_clusters() as (work, source, target):
        source_dsn = make_source(source, args.tables, args.rows)
        env = pgcdc_env(work, source_dsn, target, run)
        ours_snapshot = timed_command(env, work, "snapshot")
        native_dsn, native_snapshot = native_initial_sync(source_dsn, target, run)
        end = write_backlog(source_dsn, args.tables, args.transactions)
        with contextlib.ExitStack() as stack:
            if args.server == "warm":
                env = {**env, "PGCDC_SERVER": "auto"}
                stack.enter_context(warm_command_server(env))
            ours_catchup = timed_command(env, work, "catchup", "--endpos", str(end))
        native_catchup_s = native_catchup(source_dsn, native_dsn, run, end)
        expected = fingerprint(source_dsn, args.tables)
        return {
            "ours_snapshot_s": round(ours_snapshot, 3),
            "native_snapshot_s": round(native_snapshot, 3),
            "snapshot_ratio": round(native_snapshot / ours_snapshot, 3),
            "ours_catchup_s": round(ours_catchup, 3),
            "native_catchup_s": round(native_catchup_s, 3),
            "catchup_ratio": round(native_catchup_s / ours_catchup, 3),
            "ours_equal": fingerprint(env["PGCDC_TARGET_DSN"], args.tables) == expected,
            "native_equal": fingerprint(native_dsn, args.tables) == expected,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=200)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--transactions", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--server",
        choices=("off", "warm"),
        default="off",
        help="off: every command cold; warm: the catch-up with the command server up",
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    runs = [one_run(args, i) for i in range(args.repeat)]
    report = {
        "tables": args.tables,
        "rows": args.rows,
        "transactions": args.transactions,
        "catchup_command_server": args.server,
        "median_snapshot_ratio": statistics.median(r["snapshot_ratio"] for r in runs),
        "median_catchup_ratio": statistics.median(r["catchup_ratio"] for r in runs),
        "runs": runs,
    }
    emit_report(report, args.json)


def emit_report(report: dict[str, Any], path: str | None) -> None:
    """Print ``report`` as JSON, and write it to ``path`` too when given."""
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        Path(path).write_text(text + "\n")


if __name__ == "__main__":
    main()
