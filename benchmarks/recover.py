"""``pgcdc recover`` after a lost slot, against a full re-snapshot (``pgcdc snapshot
--resnapshot``), through the commands a user runs, from fresh processes, same clusters.

pgbench at ``--scale``; ``pgcdc snapshot``; then twice: 1% of ``pgbench_accounts`` updated
while nothing reads the slot, the slot lost for real (``max_slot_wal_keep_size`` 1MB, WAL
switched, a checkpoint), ``pgcdc recover`` timed:

* ``clustered``: the 1% is one key range (``aid`` below scale * 1000), the case chunks serve;
* ``scattered``: every 100th ``aid``, which touches every chunk of 100,000 rows.

Then ``pgcdc snapshot --resnapshot`` timed, and the target checked equal (row counts and a
hash of each table). CPU seconds of each side from ``harness.Measured``.

Usage: ``.venv/bin/python benchmarks/recover.py [--scale 100] [--profile production|throwaway]``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

TABLES = harness.PGBENCH_TABLES
CHECKED = ("public.pgbench_accounts", "public.pgbench_tellers")
"""The tables the changes touch: compared with the source's after each step."""


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


def _command(
    env: dict[str, str], work: Path, clusters: harness.BenchClusters, *args: str
) -> tuple[float, dict[str, Any], str]:
    with harness.Measured(clusters.source, clusters.target) as measured:
        _, done = harness.run_command(env, work, *args)
    return measured.wall, measured.report(), done.stdout


def _check(source_dsn: str, target_dsn: str, what: str) -> None:
    harness.require_equal(harness.fingerprints(source_dsn, CHECKED), target_dsn, what)


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--scale", type=int, default=100)
    args = parser.parse_args()
    report: dict[str, Any] = {
        "scale": args.scale,
        "cluster_profile": harness.describe_profile(args.profile),
    }
    with harness.bench_clusters(args.profile, logical_target=True) as clusters:
        work, source, target = clusters
        harness.fill_pgbench(source, args.scale)
        slot = "bench_recover"
        env = harness.pgcdc_env(
            work, source.dsn(), target, slot, tables=TABLES, prepare_storage=False
        )
        target_dsn = env["PGCDC_TARGET_DSN"]
        seconds, _, _ = _command(env, work, clusters, "snapshot")
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
            harness.checkpoint(source, target, sync=True)
            seconds, measured, out = _command(env, work, clusters, "recover", "--json")
            _check(source.dsn(), target_dsn, name)
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
        harness.checkpoint(source, target, sync=True)
        seconds, measured, _ = _command(env, work, clusters, "snapshot", "--resnapshot")
        _check(source.dsn(), target_dsn, "resnapshot")
        report["resnapshot"] = {
            "command_seconds": round(seconds, 2),
            "cpu_seconds": measured["cpu_seconds"],
        }
    harness.emit_report(report)


if __name__ == "__main__":
    main()
