"""``pgcdc recover`` after a lost slot, against a full re-snapshot (``pgcdc snapshot
--resnapshot``), through the commands a user runs, from fresh processes, same clusters.

pgbench at ``--scale``; ``pgcdc snapshot``; then twice: 1% of ``pgbench_accounts`` updated
while nothing reads the slot, the slot lost for real (``max_slot_wal_keep_size`` 1MB, WAL
switched, a checkpoint), ``pgcdc recover`` timed:

* ``clustered``: the 1% is one key range (``aid`` below scale * 1000), the case chunks serve;
* ``scattered``: every 100th ``aid``, which touches every chunk of 100,000 rows.

Then ``pgcdc snapshot --resnapshot`` timed, and the target checked equal (row counts and a
hash of each table).

Usage: ``.venv/bin/python benchmarks/recover.py [--scale 100]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psycopg
from snapshot import REPO, Measured, _create_database, _quiesce, pgbench_clusters

PGCDC = str(Path(sys.executable).parent / "pgcdc")
TABLES = ("pgbench_accounts", "pgbench_branches", "pgbench_tellers", "pgbench_history")
CONTENT = (
    "SELECT count(*), sum(hashtext(a::text)) FROM pgbench_accounts a",
    "SELECT count(*), sum(hashtext(t::text)) FROM pgbench_tellers t",
)


def _lose(source_dsn: str, slot: str) -> None:
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        conn.execute("SELECT pg_reload_conf()")
        for _ in range(4):
            conn.execute("SELECT pg_switch_wal()")
            conn.execute("CREATE TEMP TABLE IF NOT EXISTS f (g int); INSERT INTO f VALUES (1)")
        conn.execute("CHECKPOINT")
        (status,) = conn.execute(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
        conn.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
        conn.execute("SELECT pg_reload_conf()")
    assert status == "lost", status


def _content(dsn: str) -> list[Any]:
    with psycopg.connect(dsn) as conn:
        return [conn.execute(q).fetchone() for q in CONTENT]


def _command(env: dict[str, str], work: Path, *args: str) -> tuple[float, dict[str, Any], str]:
    source, target = env["_source"], env["_target"]
    with Measured(source, target) as measured:  # type: ignore[arg-type]
        done = subprocess.run(
            [PGCDC, *args],
            env={k: v for k, v in env.items() if not k.startswith("_")},
            capture_output=True,
            text=True,
            cwd=work,
        )
    if done.returncode != 0:
        raise RuntimeError(f"pgcdc {' '.join(args)} failed: {done.stderr[-3000:]}")
    return measured.wall, measured.report(), done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=100)
    args = parser.parse_args()
    report: dict[str, Any] = {"scale": args.scale}
    with (
        pgbench_clusters(args.scale) as (source, target),
        tempfile.TemporaryDirectory(prefix="pgcdc-bench-recover-") as tmp,
    ):
        work = Path(tmp)
        target_dsn = _create_database(target, "bench_recover")
        _create_database(target, "dagster_recover")
        home = work / "dagster_home"
        home.mkdir()
        shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
        slot = "bench_recover"
        env: dict[str, Any] = {
            **os.environ,
            "PGCDC_SOURCE_DSN": source.dsn(),
            "PGCDC_TARGET_DSN": target_dsn,
            "PGCDC_SLOT": slot,
            "PGCDC_TABLES": ",".join(f"public.{t}" for t in TABLES),
            "PGCDC_STORE": str(work / "store"),
            "DAGSTER_HOME": str(home),
            "DAGSTER_POSTGRES_URL": (
                f"postgresql+psycopg2://postgres@127.0.0.1:{target.port}/dagster_recover"
            ),
            "PGCDC_SERVER": "off",
            "_source": source,
            "_target": target,
        }
        seconds, _, _ = _command(env, work, "snapshot")
        report["snapshot_seconds"] = round(seconds, 2)
        accounts = args.scale * 100_000
        changes = {
            "clustered": f"UPDATE pgbench_accounts SET abalance = abalance + 1 "
            f"WHERE aid <= {accounts // 100}",
            "scattered": "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid % 100 = 0",
        }
        for name, change in changes.items():
            with psycopg.connect(source.dsn(), autocommit=True) as conn:
                conn.execute(change)
                conn.execute("UPDATE pgbench_tellers SET tbalance = tbalance + 1")
            _lose(source.dsn(), slot)
            _quiesce(source, target)
            seconds, measured, out = _command(env, work, "recover", "--json")
            assert _content(source.dsn()) == _content(target_dsn), name
            report[f"recover_{name}"] = {
                "command_seconds": round(seconds, 2),
                **{
                    k: v
                    for k, v in json.loads(out).items()
                    if k in ("chunks_compared", "chunks_repaired", "rows_copied")
                    or k.endswith("seconds")
                },
                "cpu_seconds": measured["cpu_seconds"],
            }
            print(json.dumps({name: report[f"recover_{name}"]}), flush=True)
        with psycopg.connect(source.dsn(), autocommit=True) as conn:
            conn.execute(changes["scattered"])
        _lose(source.dsn(), slot)
        _quiesce(source, target)
        seconds, measured, _ = _command(env, work, "snapshot", "--resnapshot")
        assert _content(source.dsn()) == _content(target_dsn)
        report["resnapshot"] = {
            "command_seconds": round(seconds, 2),
            "cpu_seconds": measured["cpu_seconds"],
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
