"""A base snapshot SIGKILLed at about 80% of its copy, resumed by the next ``pgcdc snapshot``,
against a full snapshot (``pgcdc snapshot --resnapshot``) and native logical replication's
initial sync of the same tables, through the commands a user runs, from fresh processes, same
clusters.

pgbench at ``--scale``; its accounts cut into ``--tables`` tables of equal size (``aid`` modulo
the count, each with its primary key), which are what is replicated. The killed run is killed
(its whole process group) once ``--kill-after`` of the driver's copy tasks committed
(``snapshot.range_copied``); ``--changed-permille`` of each table's rows are then updated on the
source; the resume is timed, then the full snapshot, then native's initial sync; each ends with
the target's row counts and content hashes checked against the source.

One big table killed at 80%: ``--tables 1 --range-rows 1000000``: the table is cut into ranges
of that many rows (``PGCDC_SNAPSHOT_RANGE_ROWS``, for every command timed), and the resume
continues it from the ranges it copied (``pgcdc_dagster/engine/snapshot/continued.py``).

Usage: ``.venv/bin/python benchmarks/snapshot_resume.py [--scale 100] [--tables 10]
[--kill-after 8] [--range-rows N] [--changed-permille 10] [--profile production|throwaway]``
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness


def _tables(count: int) -> list[str]:
    return [f"part_{i:02d}" for i in range(count)]


def _cut(source_dsn: str, count: int) -> None:
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        for i, name in enumerate(_tables(count)):
            table = sql.Identifier(name)
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} AS SELECT * FROM pgbench_accounts WHERE aid % {} = {}"
                ).format(table, sql.Literal(count), sql.Literal(i))
            )
            conn.execute(sql.SQL("ALTER TABLE {} ADD PRIMARY KEY (aid)").format(table))
        conn.execute("VACUUM ANALYZE")


def _change(source_dsn: str, count: int, permille: int) -> int:
    """Update ``permille`` of each table's rows, spread over it (by a hash of the key): what a
    source changes between the kill and the resume."""
    changed = 0
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        for name in _tables(count):
            cur = conn.execute(
                sql.SQL(
                    "UPDATE {} SET abalance = abalance + 1 WHERE abs(hashint4(aid)) % 1000 < {}"
                ).format(sql.Identifier(name), sql.Literal(permille))
            )
            changed += cur.rowcount
    return changed


def _expected(source_dsn: str, count: int) -> dict[str, list[Any]]:
    """The source's tables: row counts and content hashes, to check a target against."""
    return harness.fingerprints(source_dsn, _tables(count))


def _command(
    env: dict[str, str],
    work: Path,
    clusters: harness.BenchClusters,
    *args: str,
    failpoint: str | None = None,
) -> tuple[float, dict[str, Any], subprocess.CompletedProcess[str]]:
    environment = dict(env)
    if failpoint:
        environment["PGCDC_FAILPOINT"] = failpoint
    with harness.Measured(clusters.source, clusters.target) as measured:
        # a kill-group failpoint kills the command's group only
        _, done = harness.run_command(
            environment, work, *args, check=failpoint is None, start_new_session=True
        )
    return measured.wall, measured.report(), done


def _phase_ends(stderr: str) -> dict[str, str]:
    """The last progress line of each phase the command showed (``pgcdc: <work> <phase>: ...``),
    which carries the seconds elapsed when it ended."""
    ends: dict[str, str] = {}
    for line in stderr.splitlines():
        head, _, rest = line.partition(": ")[2].partition(": ")
        if rest and head.split(" ")[0] in ("snapshot", "add-table"):
            ends[head] = rest
    return ends


def _native(clusters: harness.BenchClusters, count: int) -> float:
    """Native logical replication's initial sync of the tables into a fresh database (schema
    from ``pg_dump --schema-only``): seconds from ``CREATE SUBSCRIPTION`` until every table is
    ready."""
    source, target = clusters.source, clusters.target
    name = "bench_resume_native"
    dsn = harness.create_database(target, name)
    harness.copy_schema(source.dsn(), dsn, _tables(count))
    harness.create_publication(source.dsn(), name, _tables(count))
    subscription = harness.Subscription(source.dsn(), dsn, name, name)
    harness.checkpoint(source, target, sync=True)
    with (
        psycopg.connect(dsn, autocommit=True) as conn,
        harness.Measured(source, target) as measured,
    ):
        subscription.create(conn=conn)
        subscription.wait_ready(tables=count, conn=conn)
    subscription.drop()
    harness.require_equal(_expected(source.dsn(), count), dsn, "native")
    return measured.wall


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--scale", type=int, default=100)
    parser.add_argument("--tables", type=int, default=10)
    parser.add_argument("--kill-after", type=int, default=8)
    parser.add_argument("--range-rows", type=int, default=None)
    parser.add_argument("--changed-permille", type=int, default=0)
    args = parser.parse_args()
    report: dict[str, Any] = vars(args).copy()
    report["cluster_profile"] = harness.describe_profile(args.profile)
    with harness.bench_clusters(args.profile, logical_target=True) as clusters:
        work, source, target = clusters
        harness.fill_pgbench(source, args.scale)
        _cut(source.dsn(), args.tables)
        ranges = {"PGCDC_SNAPSHOT_RANGE_ROWS": str(args.range_rows)} if args.range_rows else {}
        env = harness.pgcdc_env(
            work,
            source.dsn(),
            target,
            "bench_resume",
            tables=[f"public.{t}" for t in _tables(args.tables)],
            prepare_storage=False,
            extra=ranges,
        )
        target_dsn = env["PGCDC_TARGET_DSN"]

        def check(what: str) -> None:
            harness.require_equal(_expected(source.dsn(), args.tables), target_dsn, what)

        harness.checkpoint(source, target, sync=True)
        seconds, _, killed = _command(
            env,
            work,
            clusters,
            "snapshot",
            failpoint=f"snapshot.range_copied=kill-group@{args.kill_after}",
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        report["killed_after_seconds"] = round(seconds, 2)
        report["changed_rows"] = _change(source.dsn(), args.tables, args.changed_permille)
        harness.checkpoint(source, target, sync=True)
        seconds, measured, resumed = _command(env, work, clusters, "snapshot")
        line = " | ".join(
            ln
            for ln in resumed.stderr.splitlines()
            if "did not finish" in ln or ": continued:" in ln or "copied whole again" in ln
        )
        check("resume")
        report["resume"] = {
            "command_seconds": round(seconds, 2),
            "cpu_seconds": measured["cpu_seconds"],
            "line": line,
            "phases": _phase_ends(resumed.stderr),
        }
        print(json.dumps({"resume": report["resume"]}), flush=True)

        def full(environment: dict[str, str]) -> dict[str, Any]:
            """``pgcdc snapshot --resnapshot``, timed, its target checked."""
            harness.checkpoint(source, target, sync=True)
            seconds, measured, _ = _command(environment, work, clusters, "snapshot", "--resnapshot")
            check("full snapshot")
            return {"command_seconds": round(seconds, 2), "cpu_seconds": measured["cpu_seconds"]}

        report["full_snapshot"] = full(env)
        print(json.dumps({"full_snapshot": report["full_snapshot"]}), flush=True)
        if args.range_rows:  # what the fine ranges cost a snapshot nobody kills
            report["full_snapshot_default_ranges"] = full(
                {k: v for k, v in env.items() if k != "PGCDC_SNAPSHOT_RANGE_ROWS"}
            )
        report["native_initial_sync_seconds"] = round(_native(clusters, args.tables), 2)
        report["resume_share_of_full"] = round(
            report["resume"]["command_seconds"] / report["full_snapshot"]["command_seconds"], 3
        )
    harness.emit_report(report)


if __name__ == "__main__":
    main()
