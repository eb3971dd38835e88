"""Base snapshot throughput against PostgreSQL's own initial sync and a plain COPY pipe.

Starts two clusters with the same settings (a source and a target; ``--profile``, production by
default: ``benchmarks/harness.py``'s profiles), fills the source
with ``pgbench -i`` (scale 50 by default: 5M ``pgbench_accounts`` rows, so that fixed start-up
costs do not dominate), starts the SparkSession (timed apart, as fixed cost), then measures on
that same data, median of ``--repeat`` runs, each run into a fresh target database:

* ours: :func:`pgcdc_dagster.engine.snapshot.take_base_snapshot` into an empty database: preflight,
  publication, slot with exported snapshot, pre-data schema, the copy on Spark, post-data
  (primary keys), origin. The result's ``copy_seconds`` splits the copy phase from the fixed
  cost around it;
* native: ``CREATE SUBSCRIPTION`` on a target whose tables were pre-created from
  ``pg_dump --schema-only`` (keys included, as logical replication is normally set up), timed
  until every table's ``pg_subscription_rel.srsubstate`` is ``r`` (ready); PostgreSQL 15's table
  sync copies in text format, up to ``max_sync_workers_per_subscription`` (2) tables at a time;
* pipe, as issue 63 defines it, every step timed: ``pg_dump --section=pre-data | psql``, then
  ``psql -c 'COPY t TO STDOUT (FORMAT binary)' | psql -c 'COPY t FROM STDIN (FORMAT binary)'``
  per table, all tables at once, then ``pg_dump --section=post-data | psql`` (primary keys):
  what a user would script by hand, with no slot, no consistent snapshot and no resume.

Before the timed runs, one untimed pipe run warms both clusters up (``--no-warm-up`` skips it).
Why: a fresh cluster has no WAL segments to recycle, so its first few GB of WAL cost creating and
zero-filling each 16 MB file, and whichever method runs first would pay for that in target CPU
(``HISTORY.md``, ``benchmarks/snapshot.py --methods ...``). Every other repeat runs the
methods in reverse order, so none always runs first.

Besides wall time, every run records the CPU seconds spent by the source cluster, the target
cluster and this process's tree (driver, Spark JVM, Spark's Python workers, psql/pg_dump), read
from ``/proc`` (``harness.Measured``), and the WAL the target wrote: where the time goes,
measured. ``other`` is the CPU the rest of the machine used during the run: on a shared
machine, a run with a large ``other`` was slowed down by someone else (each run's value is
under ``runs``).

Throughput ratios are "ours is N times as fast": > 1 means we are faster (``ratios_legend``
says what each divides). MB/s are megabytes (10^6) of binary COPY data, as our copy counted
them, per second, the same volume for all three methods.

Trap: PostgreSQL 15's logical replication launcher starts apply workers at most once per
``wal_retrieve_retry_interval`` (5 s), so a subscription created right after the previous one
would wait up to 5 s before copying anything; the native run sleeps that out before its timer.

Usage: ``.venv/bin/python benchmarks/snapshot.py [--scale 50] [--repeat 1] [--parallelism N]
[--rows-per-task N] [--methods ours,native,pipe] [--profile production|throwaway]``
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from pgcdc_dagster.demo.local_cluster import LOGICAL_SOURCE_SETTINGS, LocalCluster
from pgcdc_dagster.engine.identifiers import TableName, origin_name
from pgcdc_dagster.engine.snapshot import DEFAULT_ROWS_PER_TASK, take_base_snapshot
from pgcdc_dagster.engine.spark.session import get_spark

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from harness import Measured

TABLES = harness.PGBENCH_TABLES
OURS_PUBLICATION = "bench_ours_pub"
NATIVE_PUBLICATION = "bench_native_pub"
NATIVE_TIMEOUT_SECONDS = 3600.0
MB = harness.MB


def _verify(dsn: str, expected: dict[str, list[int]], method: str) -> int:
    """The target's row counts against the source's (not the content: cheap at any scale)."""
    return harness.require_equal(expected, dsn, method, content=False)["rows"]


def _throughput(seconds: float, rows: int, nbytes: int) -> dict[str, float]:
    return {
        "rows_per_s": round(rows / seconds) if seconds > 0 else 0,
        "mb_per_s": round(nbytes / MB / seconds, 1) if seconds > 0 else 0.0,
    }


# ─── the three methods ────────────────────────────────────────────────────────────────────────


def run_ours(
    source: LocalCluster,
    target: LocalCluster,
    spark: Any,
    run: int,
    expected: dict[str, list[int]],
    options: dict[str, Any],
) -> dict[str, Any]:
    database, slot = f"bench_ours_{run}", f"bench_ours_{run}"
    target_dsn = harness.create_database(target, database)
    harness.checkpoint(source, target, sync=True)
    with Measured(source, target) as measured:
        result = take_base_snapshot(
            source.dsn(), target_dsn, slot, OURS_PUBLICATION, TABLES, spark=spark, **options
        )
    with psycopg.connect(source.dsn(), autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_replication_origin_drop(%s)", (origin_name(slot),))
    rows = _verify(target_dsn, expected, "ours")
    harness.drop_database(target, database)
    # A table copied in a bundle (the small ones) has no bytes or seconds of its own.
    busy = sum(t.seconds or 0.0 for t in result.tables)
    fixed = result.seconds - result.copy_seconds
    return {
        "seconds": result.seconds,
        "copy_seconds": result.copy_seconds,
        "fixed_seconds": fixed,
        "fixed": {
            "pre_data_seconds": result.pre_data.seconds,
            "post_data_seconds": result.post_data.seconds,
            "preflight_slot_origin_other_seconds": (
                fixed - result.pre_data.seconds - result.post_data.seconds
            ),
        },
        "rows": rows,
        "copy_bytes": sum(t.bytes or 0 for t in result.tables),
        "copy_tasks": sum(t.tasks for t in result.tables),
        "copy_task_busy_seconds": busy,
        "copy_parallelism": busy / result.copy_seconds if result.copy_seconds > 0 else 0.0,
        "copy_formats": sorted({f for t in result.tables for f in t.copy_formats}),
        "per_table": {
            str(t.table): {
                "rows": t.rows,
                "tasks": t.tasks,
                "busy_seconds": None if t.seconds is None else round(t.seconds, 3),
                "bundled_with": t.bundled_with,
            }
            for t in result.tables
        },
        **measured.report(),
    }


def run_cli(
    source: LocalCluster,
    target: LocalCluster,
    run: int,
    expected: dict[str, list[int]],
    work: Path,
    warm: bool = False,
) -> dict[str, Any]:
    """``pgcdc snapshot`` from a fresh process, as a user runs it: Python, Dagster, the run
    (PostgreSQL storage, the shipped dagster.yaml), Spark only if a table needs it.

    Cold (``warm=False``): the first command on the machine, nothing of ours running
    (``PGCDC_SERVER=off``: the same process a first command is, without leaving a server).

    ``warm``: a second snapshot, into a fresh target, with what the first one leaves up: the
    command server (:mod:`pgcdc_dagster.launcher`; the command runs in its forked child, with
    Dagster and the definitions already imported), and the warm Spark Connect server of
    ``pgcdc spark start`` (started and given a first job before the timing). That server runs
    local[*] on this machine's cores, so the driver still copies every table
    (``driver_max_rows``). The command server's CPU (its child's) is counted apart as
    ``pgcdc_server``."""
    from pgcdc_dagster.engine.spark import server as spark_server

    database = f"bench_cli_{run}w" if warm else f"bench_cli_{run}"
    # A user's Dagster storage already has its schema: created outside the timing.
    env = harness.pgcdc_env(
        work,
        source.dsn(),
        target,
        database,
        publication="bench_cli_pub",
        tables=TABLES,
        server="auto" if warm else "off",
    )
    target_dsn, slot = env["PGCDC_TARGET_DSN"], env["PGCDC_SLOT"]
    with contextlib.ExitStack() as stack:
        command_server = stack.enter_context(harness.warm_command_server(env)) if warm else None
        if warm:
            store = Path(env["PGCDC_STORE"])
            store.mkdir()
            server, _ = spark_server.start(store)
            stack.callback(spark_server.stop, store)
            subprocess.run(
                [sys.executable, "-c", "import sys; from pgcdc_dagster.engine.spark.session "
                 "import get_spark; get_spark(remote=sys.argv[1]).range(1000).count()",
                 server.url],
                check=True, env=env, cwd=work,
            )  # fmt: skip
        harness.checkpoint(source, target, sync=True)
        with Measured(source, target, command_server) as measured:
            _, done = harness.run_command(env, work, "snapshot")
    with psycopg.connect(source.dsn(), autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_replication_origin_drop(%s)", (origin_name(slot),))
    rows = _verify(target_dsn, expected, "cli_warm" if warm else "cli")
    harness.drop_database(target, database)
    return {
        "seconds": measured.wall,
        "rows": rows,
        "stdout": done.stdout.strip(),
        "progress": [line for line in done.stderr.splitlines() if line.startswith("pgcdc: ")],
        **measured.report(),
    }


def run_native(
    source: LocalCluster,
    target: LocalCluster,
    run: int,
    expected: dict[str, list[int]],
    schema_script: Path,
) -> dict[str, Any]:
    database = f"bench_native_{run}"
    target_dsn = harness.create_database(target, database)
    harness.psql(target_dsn, schema_script)
    subscription = harness.Subscription(source.dsn(), target_dsn, database, NATIVE_PUBLICATION)
    harness.wait_for_launcher(target_dsn)
    harness.checkpoint(source, target, sync=True)
    # first time each table was seen in each state: i(nit), d(ata copy), f(inished copy),
    # s(ync done), r(eady)
    seen: dict[str, dict[str, float]] = {}
    with (
        psycopg.connect(target_dsn, autocommit=True) as conn,
        Measured(source, target) as measured,
    ):

        def note(states: dict[str, str]) -> None:
            now = time.perf_counter() - measured.started
            for table, state in states.items():
                seen.setdefault(table, {}).setdefault(state, now)

        subscription.create(conn=conn)
        created = time.perf_counter() - measured.started
        subscription.wait_ready(timeout=NATIVE_TIMEOUT_SECONDS, seen=note, conn=conn)
    subscription.drop()
    rows = _verify(target_dsn, expected, "native")
    harness.drop_database(target, database)

    def first(table: str, *states: str) -> float:
        return min((seen[table][s] for s in states if s in seen[table]), default=float("nan"))

    synced = max(first(t, "s", "r") for t in seen)
    return {
        "seconds": measured.wall,
        "create_subscription_seconds": created,
        "first_copy_started_seconds": min(first(t, "d", "f", "s", "r") for t in seen),
        "all_synced_seconds": synced,
        "synced_to_ready_seconds": measured.wall - synced,
        "rows": rows,
        "per_table": {
            table: {
                "copy_started_at": round(first(table, "d", "f", "s", "r"), 3),
                "copy_finished_at": round(first(table, "f", "s", "r"), 3),
                "synced_at": round(first(table, "s", "r"), 3),
                "ready_at": round(first(table, "r"), 3),
            }
            for table in sorted(seen)
        },
        **measured.report(),
    }


def _pipe_table(source_dsn: str, target_dsn: str, table: TableName) -> int:
    name = sql.Identifier(table.schema, table.name).as_string(None)
    reader = subprocess.Popen(
        [
            harness.tool("psql"),
            "-X",
            "-q",  # no "COPY n" status line after the data
            "-d",
            source_dsn,
            "-c",
            f"COPY {name} TO STDOUT (FORMAT binary)",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert reader.stdout is not None
    writer = subprocess.Popen(
        [
            harness.tool("psql"),
            "-X",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            target_dsn,
            "-c",
            f"COPY {name} FROM STDIN (FORMAT binary)",
        ],
        stdin=reader.stdout,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    reader.stdout.close()  # the writer holds the pipe now: a dead writer must stop the reader
    out, err = writer.communicate()
    reader_err = reader.communicate()[1]
    if reader.returncode or writer.returncode:
        raise RuntimeError(f"COPY pipe of {table} failed: {reader_err!r} {err!r}")
    match = re.search(rb"COPY (\d+)", out)
    return int(match.group(1)) if match else 0


def run_pipe(
    source: LocalCluster,
    target: LocalCluster,
    run: int,
    expected: dict[str, list[int]],
) -> dict[str, Any]:
    """The pipe as issue 63 defines it, all in the timing: ``pg_dump --section=pre-data |
    psql``; one binary ``COPY ... TO STDOUT | COPY ... FROM STDIN`` per table, all tables at
    once; then ``pg_dump --section=post-data | psql``."""
    database = f"bench_pipe_{run}"
    target_dsn = harness.create_database(target, database)
    harness.checkpoint(source, target, sync=True)
    per_table: dict[str, dict[str, float]] = {}

    def pipe(table: TableName) -> None:
        started = time.perf_counter()
        copied = _pipe_table(source.dsn(), target_dsn, table)
        per_table[str(table)] = {"rows": copied, "seconds": time.perf_counter() - started}

    with Measured(source, target) as measured:
        harness.psql(target_dsn, harness.dump_schema(source.dsn(), TABLES, "--section=pre-data"))
        pre_data_seconds = time.perf_counter() - measured.started
        with ThreadPoolExecutor(len(TABLES)) as pool:
            list(pool.map(pipe, TABLES))
        copy_seconds = time.perf_counter() - measured.started - pre_data_seconds
        harness.psql(target_dsn, harness.dump_schema(source.dsn(), TABLES, "--section=post-data"))
    rows = _verify(target_dsn, expected, "pipe")
    harness.drop_database(target, database)
    return {
        "seconds": measured.wall,
        "pre_data_seconds": pre_data_seconds,
        "copy_seconds": copy_seconds,
        "post_data_seconds": measured.wall - pre_data_seconds - copy_seconds,
        "rows": rows,
        "per_table": per_table,
        **measured.report(),
    }


# ─── report ──────────────────────────────────────────────────────────────────────────────────


def _warm_up_task(index: int) -> int:
    """Imports what a copy task imports, so the first measured task does not pay for it."""
    import pgcdc_dagster.engine.snapshot  # noqa: F401

    return index


def spark_master_name(master: str | None) -> str:
    return master or os.environ.get("PGCDC_SPARK_MASTER") or "local[*]"


RATIO_LEGEND = {
    "ours_vs_native": "native seconds to all tables ready / ours seconds, end to end",
    "ours_vs_native_synced": "native seconds to all tables synced / ours seconds",
    "ours_copy_vs_native": "native seconds / our copy phase alone (without our fixed cost)",
    "ours_vs_pipe": "pipe seconds (pre-data, copy, post-data) / ours seconds, end to end",
    "ours_copy_vs_pipe_copy": "pipe copy seconds / our copy phase seconds",
    "native_vs_pipe": "pipe seconds / native seconds",
    "cli_vs_native": "native seconds to all tables ready / `pgcdc snapshot` seconds from a "
    "fresh process (Python, Dagster, the run, Spark if needed)",
    "cli_vs_pipe": "pipe seconds (pre-data, copy, post-data) / `pgcdc snapshot` seconds from a "
    "fresh process",
    "cli_warm_vs_native": "native seconds to all tables ready / `pgcdc snapshot` seconds with "
    "what a first snapshot leaves up: the command server and the warm Spark Connect server",
    "cli_warm_vs_pipe": "pipe seconds (pre-data, copy, post-data) / `pgcdc snapshot` seconds "
    "with the command server and the warm Spark Connect server up",
}


def main() -> None:
    parser = harness.argument_parser(__doc__, repeat=1)
    parser.add_argument("--scale", type=int, default=50, help="pgbench scale (100k rows each)")
    parser.add_argument("--spark-master", default=None, help="default: get_spark's (local[*])")
    parser.add_argument(
        "--parallelism",
        type=int,
        default=None,
        help="copy tasks at a time for ours (default: as many as Spark has cores)",
    )
    parser.add_argument("--rows-per-task", type=int, default=DEFAULT_ROWS_PER_TASK)
    parser.add_argument(
        "--no-warm-up",
        action="store_true",
        help="skip the untimed pipe run before the timed ones (see the module's docstring)",
    )
    parser.add_argument(
        "--methods",
        default="ours,native,pipe",
        help="comma-separated subset of ours,native,pipe,cli,cli_warm (in this order within a "
        "repeat); cli is `pgcdc snapshot` from a fresh process, cold; cli_warm the same with the "
        "command server and the warm Spark Connect server of `pgcdc spark start` up",
    )
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := set(methods) - {"ours", "native", "pipe", "cli", "cli_warm"}:
        parser.error(f"unknown method(s): {', '.join(sorted(unknown))}")

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally below

    signal.signal(signal.SIGTERM, terminate)

    ours_options = {"parallelism": args.parallelism, "target_rows_per_task": args.rows_per_task}
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    spark = None
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    try:
        with harness.bench_clusters(args.profile, logical_target=True) as (work, source, target):
            tmp = str(work)
            t0 = time.perf_counter()
            # pgbench_history has no primary key: REPLICA IDENTITY FULL, as our preflight needs
            harness.fill_pgbench(source, args.scale, analyse=False)
            harness.create_publication(source.dsn(), NATIVE_PUBLICATION, TABLES)
            with psycopg.connect(source.dsn(), autocommit=True) as conn:
                conn.execute("VACUUM ANALYZE")
                sizes: dict[str, tuple[int, int]] = {}
                for table in TABLES:
                    row = conn.execute(
                        "SELECT pg_relation_size(%s::regclass), "
                        "pg_total_relation_size(%s::regclass)",
                        (str(table), str(table)),
                    ).fetchone()
                    assert row is not None
                    sizes[str(table)] = (int(row[0]), int(row[1]))
                version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
            expected = harness.fingerprints(source.dsn(), TABLES, content=False)
            schema = Path(tmp) / "full.sql"
            harness.dump_schema(source.dsn(), TABLES, out=schema)
            setup_seconds = time.perf_counter() - t0

            fixed_costs: dict[str, float] = {}
            if "ours" in methods:  # started before any timing: a fixed cost of its own
                t0 = time.perf_counter()
                spark = get_spark(master=args.spark_master)
                fixed_costs["spark_session_start_seconds"] = round(time.perf_counter() - t0, 3)
                t0 = time.perf_counter()
                cores = spark.sparkContext.defaultParallelism
                spark.sparkContext.parallelize(range(cores), cores).map(_warm_up_task).collect()
                fixed_costs["spark_first_job_seconds"] = round(time.perf_counter() - t0, 3)

            methods_run: dict[str, Callable[[int], dict[str, Any]]] = {
                "ours": lambda i: run_ours(source, target, spark, i, expected, ours_options),
                "native": lambda i: run_native(source, target, i, expected, schema),
                "pipe": lambda i: run_pipe(source, target, i, expected),
                "cli": lambda i: run_cli(source, target, i, expected, Path(tmp)),
                "cli_warm": lambda i: run_cli(source, target, i, expected, Path(tmp), warm=True),
            }
            if not args.no_warm_up:
                t0 = time.perf_counter()
                run_pipe(source, target, -1, expected)
                fixed_costs["warm_up_seconds"] = round(time.perf_counter() - t0, 3)
            for i in range(args.repeat):
                # Every other repeat in reverse, so that no method always runs first.
                for method in harness.order_of(methods, i):
                    runs[method].append(methods_run[method](i))
    finally:
        if spark is not None:
            spark.stop()

    heap_bytes = sum(s[0] for s in sizes.values())
    if "ours" in runs:
        copy_bytes = int(runs["ours"][0]["copy_bytes"])
        mb_basis = "binary COPY bytes of the tables, as our copy counted them"
    else:
        copy_bytes = heap_bytes
        mb_basis = "pg_relation_size of the source tables (ours not run)"
    total_rows = sum(v[0] for v in expected.values())
    results: dict[str, Any] = {}
    for method, method_runs in runs.items():
        med = harness.medians(method_runs)
        med.update(_throughput(med["seconds"], total_rows, copy_bytes))
        if "copy_seconds" in med:
            copy = _throughput(med["copy_seconds"], total_rows, copy_bytes)
            med["copy_rows_per_s"], med["copy_mb_per_s"] = copy["rows_per_s"], copy["mb_per_s"]
        results[method] = med

    ratios: dict[str, float] = {}
    if "ours" in results and "native" in results:
        ratios["ours_vs_native"] = results["native"]["seconds"] / results["ours"]["seconds"]
        ratios["ours_vs_native_synced"] = (
            results["native"]["all_synced_seconds"] / results["ours"]["seconds"]
        )
        ratios["ours_copy_vs_native"] = (
            results["native"]["seconds"] / results["ours"]["copy_seconds"]
        )
    if "cli" in results and "native" in results:
        ratios["cli_vs_native"] = results["native"]["seconds"] / results["cli"]["seconds"]
    if "cli" in results and "pipe" in results:
        ratios["cli_vs_pipe"] = results["pipe"]["seconds"] / results["cli"]["seconds"]
    if "cli_warm" in results and "native" in results:
        ratios["cli_warm_vs_native"] = results["native"]["seconds"] / results["cli_warm"]["seconds"]
    if "cli_warm" in results and "pipe" in results:
        ratios["cli_warm_vs_pipe"] = results["pipe"]["seconds"] / results["cli_warm"]["seconds"]
    if "ours" in results and "pipe" in results:
        ratios["ours_vs_pipe"] = results["pipe"]["seconds"] / results["ours"]["seconds"]
        ratios["ours_copy_vs_pipe_copy"] = (
            results["pipe"]["copy_seconds"] / results["ours"]["copy_seconds"]
        )
    if "native" in results and "pipe" in results:
        ratios["native_vs_pipe"] = results["pipe"]["seconds"] / results["native"]["seconds"]

    report = {
        "data": {
            "pgbench_scale": args.scale,
            "rows": total_rows,
            "rows_per_table": {table: v[0] for table, v in expected.items()},
            "mb": round(copy_bytes / MB, 1),
            "mb_basis": mb_basis,
            "heap_mb": round(heap_bytes / MB, 1),
            "total_relation_mb": round(sum(s[1] for s in sizes.values()) / MB, 1),
            "setup_seconds": round(setup_seconds, 1),
        },
        "environment": {
            "cpus": os.cpu_count(),
            "postgres": version,
            "spark_master": spark_master_name(args.spark_master),
            "ours_options": ours_options,
            "cluster_profile": harness.describe_profile(args.profile),
            "cluster_settings": {
                **harness.describe_profile(args.profile)["settings"],
                **LOGICAL_SOURCE_SETTINGS,
            },
            "repeat": args.repeat,
            "load_average_at_start": load_at_start,
        },
        "fixed_costs": fixed_costs,
        **harness.rounded(results),
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "ratios_legend": {k: RATIO_LEGEND[k] for k in ratios},
        # per run: wall seconds and the CPU seconds the rest of the machine used meanwhile
        "runs": {
            m: [
                {"seconds": round(r["seconds"], 3), "other_cpu_seconds": r["cpu_seconds"]["other"]}
                for r in rs
            ]
            for m, rs in runs.items()
        },
    }
    harness.emit_report(report)


if __name__ == "__main__":
    main()
