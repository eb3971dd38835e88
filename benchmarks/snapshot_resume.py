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
[--kill-after 8] [--range-rows N] [--changed-permille 10]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from snapshot import (
    REPO,
    Measured,
    _create_database,
    _psql_file,
    _quiesce,
    _run,
    _tool,
    pgbench_clusters,
)

PGCDC = str(Path(sys.executable).parent / "pgcdc")


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


def _content(dsn: str, count: int) -> list[Any]:
    with psycopg.connect(dsn) as conn:
        return [
            conn.execute(
                sql.SQL("SELECT count(*), sum(hashtext(t::text)) FROM {} t").format(
                    sql.Identifier(name)
                )
            ).fetchone()
            for name in _tables(count)
        ]


def _command(
    env: dict[str, Any], work: Path, *args: str, failpoint: str | None = None
) -> tuple[float, dict[str, Any], subprocess.CompletedProcess[str]]:
    source, target = env["_source"], env["_target"]
    environment = {k: v for k, v in env.items() if not k.startswith("_")}
    if failpoint:
        environment["PGCDC_FAILPOINT"] = failpoint
    with Measured(source, target) as measured:
        done = subprocess.run(
            [PGCDC, *args],
            env=environment,
            capture_output=True,
            text=True,
            cwd=work,
            start_new_session=True,  # a kill-group failpoint kills the command's group only
        )
    if failpoint is None and done.returncode != 0:
        raise RuntimeError(f"pgcdc {' '.join(args)} failed: {done.stderr[-3000:]}")
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


def _native(source: Any, target: Any, count: int) -> float:
    """Native logical replication's initial sync of the tables into a fresh database (schema
    from ``pg_dump --schema-only``): seconds from ``CREATE SUBSCRIPTION`` until every table is
    ready."""
    dsn = _create_database(target, "bench_resume_native")
    names = _tables(count)
    script = Path(tempfile.mkdtemp(prefix="pgcdc-bench-resume-schema-")) / "schema.sql"
    tables = [f"--table={n}" for n in names]
    _run([_tool("pg_dump"), "--schema-only", *tables, "-f", str(script), source.dsn()])
    _psql_file(dsn, script)
    with psycopg.connect(source.dsn(), autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE PUBLICATION bench_resume_native FOR TABLE {}").format(
                sql.SQL(", ").join(sql.Identifier(n) for n in names)
            )
        )
    _quiesce(source, target)
    with psycopg.connect(dsn, autocommit=True) as conn, Measured(source, target) as measured:
        conn.execute(
            sql.SQL(
                "CREATE SUBSCRIPTION bench_resume_native CONNECTION {} "
                "PUBLICATION bench_resume_native"
            ).format(sql.Literal(source.dsn()))
        )
        while True:
            states = conn.execute(
                "SELECT count(*) FILTER (WHERE srsubstate <> 'r'), count(*) "
                "FROM pg_subscription_rel"
            ).fetchone()
            if states is not None and states[1] == count and states[0] == 0:
                break
            time.sleep(0.1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP SUBSCRIPTION bench_resume_native")
    assert _content(source.dsn(), count) == _content(dsn, count), "native"
    return measured.wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=100)
    parser.add_argument("--tables", type=int, default=10)
    parser.add_argument("--kill-after", type=int, default=8)
    parser.add_argument("--range-rows", type=int, default=None)
    parser.add_argument("--changed-permille", type=int, default=0)
    args = parser.parse_args()
    report: dict[str, Any] = vars(args).copy()
    with (
        pgbench_clusters(args.scale) as (source, target),
        tempfile.TemporaryDirectory(prefix="pgcdc-bench-resume-") as tmp,
    ):
        _cut(source.dsn(), args.tables)
        work = Path(tmp)
        target_dsn = _create_database(target, "bench_resume")
        _create_database(target, "dagster_resume")
        home = work / "dagster_home"
        home.mkdir()
        shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
        env: dict[str, Any] = {
            **os.environ,
            "PGCDC_SOURCE_DSN": source.dsn(),
            "PGCDC_TARGET_DSN": target_dsn,
            "PGCDC_SLOT": "bench_resume",
            "PGCDC_TABLES": ",".join(f"public.{t}" for t in _tables(args.tables)),
            "PGCDC_STORE": str(work / "store"),
            "DAGSTER_HOME": str(home),
            "DAGSTER_POSTGRES_URL": (
                f"postgresql+psycopg2://postgres@127.0.0.1:{target.port}/dagster_resume"
            ),
            "PGCDC_SERVER": "off",
            **({"PGCDC_SNAPSHOT_RANGE_ROWS": str(args.range_rows)} if args.range_rows else {}),
            "_source": source,
            "_target": target,
        }
        _quiesce(source, target)
        seconds, _, killed = _command(
            env,
            work,
            "snapshot",
            failpoint=f"snapshot.range_copied=kill-group@{args.kill_after}",
        )
        assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
        report["killed_after_seconds"] = round(seconds, 2)
        report["changed_rows"] = _change(source.dsn(), args.tables, args.changed_permille)
        _quiesce(source, target)
        seconds, measured, resumed = _command(env, work, "snapshot")
        line = " | ".join(
            ln
            for ln in resumed.stderr.splitlines()
            if "did not finish" in ln or ": continued:" in ln or "copied whole again" in ln
        )
        assert _content(source.dsn(), args.tables) == _content(target_dsn, args.tables)
        report["resume"] = {
            "command_seconds": round(seconds, 2),
            "cpu_seconds": measured["cpu_seconds"],
            "line": line,
            "phases": _phase_ends(resumed.stderr),
        }
        print(json.dumps({"resume": report["resume"]}), flush=True)

        def full(environment: dict[str, Any]) -> dict[str, Any]:
            """``pgcdc snapshot --resnapshot``, timed, its target checked."""
            _quiesce(source, target)
            seconds, measured, _ = _command(environment, work, "snapshot", "--resnapshot")
            assert _content(source.dsn(), args.tables) == _content(target_dsn, args.tables)
            return {"command_seconds": round(seconds, 2), "cpu_seconds": measured["cpu_seconds"]}

        report["full_snapshot"] = full(env)
        print(json.dumps({"full_snapshot": report["full_snapshot"]}), flush=True)
        if args.range_rows:  # what the fine ranges cost a snapshot nobody kills
            report["full_snapshot_default_ranges"] = full(
                {k: v for k, v in env.items() if k != "PGCDC_SNAPSHOT_RANGE_ROWS"}
            )
        report["native_initial_sync_seconds"] = round(_native(source, target, args.tables), 2)
        report["resume_share_of_full"] = round(
            report["resume"]["command_seconds"] / report["full_snapshot"]["command_seconds"], 3
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
