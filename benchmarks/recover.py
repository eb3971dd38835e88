"""``pgcdc recover`` after a lost slot, against a full re-snapshot, through the commands.

Both run as a user runs them, each from a fresh process: ``pgcdc recover --json`` and ``pgcdc
snapshot --resnapshot``.

``--lost-by wal-limit`` (the default), one pair of clusters: pgbench at ``--scale``; ``pgcdc
snapshot``; then ``--runs`` times (default 3): 1% of ``pgbench_accounts`` updated while nothing
reads the slot, the slot lost for real (``max_slot_wal_keep_size`` 1MB, WAL switched, a
checkpoint), ``pgcdc recover`` timed, for each of:

* ``clustered``: the 1% is one key range (``aid`` below scale * 1000);
* ``scattered``: every 100th ``aid``, which touches every chunk of 100,000 rows.

Then the scattered change once more, the slot lost again, and ``pgcdc snapshot --resnapshot``
timed. The report gives each run, the medians and the ratios recover / resnapshot of the
medians. ``pgcdc recover`` takes its fast path here (:mod:`pgcdc_dagster.engine.compare.
changed_since`): every recovery starts from a base (snapshot, recovery or resnapshot) that
recorded a transaction-id bound.

``--lost-by promotion``: the slot lost the way every PostgreSQL 15 or 16 source loses it, with
no failover slot to carry it over to a standby. Each of ``--runs`` runs (default 3) on fresh
clusters: a PostgreSQL 16 primary and its physical standby
(``pgcdc_dagster_tests.support.standby.primary_with_standby``, no slot synchronisation),
restarted with the settings of ``--profile`` (:func:`harness.apply_profile`), and a target.
pgbench at ``--scale`` on the primary; ``pgcdc snapshot`` through the multi-host source DSN
(``host=primary,standby target_session_attrs=read-write``); 1% of ``pgbench_accounts`` updated
in one key range (``aid <= accounts / 100``) and every teller; the standby caught up, the
primary crashed (``pg_ctl stop -m immediate``), the standby promoted. Then ``pgcdc recover``
timed, and ``pgcdc snapshot --resnapshot`` timed on the same data. The report gives each run,
the medians and the ratio recover / resnapshot (of the medians, and per run).

After each timed command the target is checked equal to the source (the promoted standby with
``promotion``): row counts and a hash of each table the changes touch. CPU seconds of each
side from ``harness.Measured``; a ``CHECKPOINT`` on both servers before each timing.

Usage: ``.venv/bin/python benchmarks/recover.py [--lost-by wal-limit|promotion] [--scale 100]
[--runs 3] [--profile production|throwaway] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the tests' standby helper

import psycopg  # noqa: E402

from pgcdc_dagster.demo.local_cluster import LocalCluster  # noqa: E402
from pgcdc_dagster_tests.support.standby import primary_with_standby  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
import harness  # noqa: E402

TABLES = harness.PGBENCH_TABLES
CHECKED = ("public.pgbench_accounts", "public.pgbench_tellers")
"""The tables the changes touch: compared with the source's after each step."""
SLOT = "bench_recover"
SOURCE_MAJOR = 16
"""The promoted source's PostgreSQL: 16 has no failover slots (17 brought them)."""
RECOVER_FIGURES = (
    "chunks_compared",
    "chunks_repaired",
    "rows_copied",
    "rows_changed",
    "keys_deleted",
    "mb_copied",
    "tables_by_fallback",
    "bound",
)
"""What ``pgcdc recover --json`` says that a run reports, besides its ``*seconds``."""


def clustered_change(scale: int) -> str:
    """1% of ``pgbench_accounts`` updated, in one key range."""
    return (
        f"UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid <= {scale * 100_000 // 100}"
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


def _command(
    env: dict[str, str], work: Path, source: LocalCluster, target: LocalCluster, *args: str
) -> tuple[float, dict[str, Any], str]:
    with harness.Measured(source, target) as measured:
        _, done = harness.run_command(env, work, *args)
    return measured.wall, measured.report(), done.stdout


def _recover_report(seconds: float, measured: dict[str, Any], out: str) -> dict[str, Any]:
    """The command's seconds, what ``pgcdc recover --json`` said it did and took, its CPU."""
    said = json.loads(out)
    return {
        "command_seconds": round(seconds, 2),
        **{k: v for k, v in said.items() if k in RECOVER_FIGURES or k.endswith("seconds")},
        "cpu_seconds": measured["cpu_seconds"],
    }


def _check(source_dsn: str, target_dsn: str, what: str) -> None:
    harness.require_equal(harness.fingerprints(source_dsn, CHECKED), target_dsn, what)


def wal_limit(args: argparse.Namespace) -> None:
    """One pair of clusters; ``--runs`` times: the clustered change, lost, recovered; the
    scattered change, lost, recovered; the scattered change, lost, re-snapshotted. Medians of
    each, and the ratios recover / resnapshot of the medians."""
    report: dict[str, Any] = {
        "lost_by": "wal-limit",
        "scale": args.scale,
        "cluster_profile": harness.describe_profile(args.profile),
    }
    changes = {
        "clustered": clustered_change(args.scale),
        "scattered": "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid % 100 = 0",
    }
    runs: list[dict[str, Any]] = []
    with harness.bench_clusters(args.profile, logical_target=True) as clusters:
        work, source, target = clusters
        harness.fill_pgbench(source, args.scale)
        env = harness.pgcdc_env(
            work, source.dsn(), target, SLOT, tables=TABLES, prepare_storage=False
        )
        target_dsn = env["PGCDC_TARGET_DSN"]
        seconds, _, _ = _command(env, work, source, target, "snapshot")
        report["snapshot_seconds"] = round(seconds, 2)
        for number in range(1, args.runs + 1):
            run: dict[str, Any] = {"run": number}
            for name, change in changes.items():
                with psycopg.connect(source.dsn(), autocommit=True) as conn:
                    conn.execute(change)
                    conn.execute("UPDATE pgbench_tellers SET tbalance = tbalance + 1")
                _lose(source.dsn(), SLOT)
                harness.checkpoint(source, target, sync=True)
                seconds, measured, out = _command(env, work, source, target, "recover", "--json")
                _check(source.dsn(), target_dsn, f"run {number}: {name}")
                run[f"recover_{name}"] = _recover_report(seconds, measured, out)
            with psycopg.connect(source.dsn(), autocommit=True) as conn:
                conn.execute(changes["scattered"])
            _lose(source.dsn(), SLOT)
            harness.checkpoint(source, target, sync=True)
            seconds, measured, _ = _command(env, work, source, target, "snapshot", "--resnapshot")
            _check(source.dsn(), target_dsn, f"run {number}: resnapshot")
            run["resnapshot"] = {
                "command_seconds": round(seconds, 2),
                "cpu_seconds": measured["cpu_seconds"],
            }
            print(json.dumps(run), flush=True)
            runs.append(run)
    resnapshot_s = harness.median_at(runs, "resnapshot", "command_seconds")
    for name in changes:
        recover_s = harness.median_at(runs, f"recover_{name}", "command_seconds")
        report[f"recover_{name}_seconds"] = recover_s
        report[f"recover_{name}_over_resnapshot"] = (
            round(recover_s / resnapshot_s, 3) if recover_s and resnapshot_s else None
        )
    report["resnapshot_seconds"] = resnapshot_s
    report["medians"] = harness.medians([{k: v for k, v in r.items() if k != "run"} for r in runs])
    report["runs"] = runs
    harness.emit_report(report, args.json)
    print()
    print(wal_limit_table(runs, report))


def wal_limit_table(runs: list[dict[str, Any]], report: dict[str, Any]) -> str:
    head = ["run", "clustered: recover s", "rows changed", "scattered: recover s",
            "rows changed", "resnapshot s"]  # fmt: skip
    rows: list[list[Any]] = [
        [r["run"], r["recover_clustered"]["command_seconds"],
         r["recover_clustered"].get("rows_changed"), r["recover_scattered"]["command_seconds"],
         r["recover_scattered"].get("rows_changed"), r["resnapshot"]["command_seconds"]]
        for r in runs
    ]  # fmt: skip
    medians = [report[f"recover_{n}_seconds"] for n in ("clustered", "scattered")]
    rows.append(["median", medians[0], "", medians[1], "", report["resnapshot_seconds"]])
    rows.append(["/ resnapshot", report["recover_clustered_over_resnapshot"], "",
                 report["recover_scattered_over_resnapshot"], "", 1.0])  # fmt: skip
    return harness.markdown_table(head, rows)


def promoted_run(number: int, args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``--lost-by promotion`` on fresh clusters (see the module docstring)."""
    report: dict[str, Any] = {"run": number, "started": datetime.now(UTC).strftime("%H:%M:%S")}
    with (
        primary_with_standby(major=SOURCE_MAJOR, sync_slots=False, synchronized=False) as pair,
        harness.bench_target(args.profile, logical=True, prefix="pgcdc-bench-recover-") as bench,
    ):
        work, target = bench
        harness.apply_profile(pair, args.profile)
        harness.fill_pgbench(pair.primary, args.scale)
        source_dsn = pair.multi_host_dsn("postgres")
        env = harness.pgcdc_env(
            work, source_dsn, target, SLOT, tables=TABLES, prepare_storage=False
        )
        target_dsn = env["PGCDC_TARGET_DSN"]
        seconds, _, _ = _command(env, work, pair.primary, target, "snapshot")
        report["snapshot_seconds"] = round(seconds, 2)
        harness.execute(
            source_dsn,
            clustered_change(args.scale),
            "UPDATE pgbench_tellers SET tbalance = tbalance + 1",
        )
        pair.wait_replayed(timeout=600)
        crashed = time.monotonic()
        pair.crash_primary()
        pair.promote()
        report["crash_to_promoted_s"] = round(time.monotonic() - crashed, 3)
        promoted = pair.standby

        harness.checkpoint(promoted, target, sync=True)
        seconds, measured, out = _command(env, work, promoted, target, "recover", "--json")
        _check(promoted.dsn(), target_dsn, f"run {number}: recover after the promotion")
        report["recover"] = _recover_report(seconds, measured, out)

        harness.checkpoint(promoted, target, sync=True)
        seconds, measured, _ = _command(env, work, promoted, target, "snapshot", "--resnapshot")
        _check(promoted.dsn(), target_dsn, f"run {number}: resnapshot after the recover")
        report["resnapshot"] = {
            "command_seconds": round(seconds, 2),
            "cpu_seconds": measured["cpu_seconds"],
        }
    recover_s = report["recover"]["command_seconds"]
    resnapshot_s = report["resnapshot"]["command_seconds"]
    report["recover_over_resnapshot"] = round(recover_s / resnapshot_s, 3)
    report["equal"] = True
    return report


def promotion_table(runs: list[dict[str, Any]], ratio: float | None) -> str:
    head = ["run", "`pgcdc recover` s", "compare s", "chunks replaced / compared",
            "rows copied", "`pgcdc snapshot --resnapshot` s", "recover / resnapshot"]  # fmt: skip
    rows: list[list[Any]] = []
    for r in runs:
        recover = r["recover"]
        chunks = f"{recover.get('chunks_repaired')} / {recover.get('chunks_compared')}"
        rows.append([r["run"], recover["command_seconds"], recover.get("compare_seconds"),
                     chunks, recover.get("rows_copied"), r["resnapshot"]["command_seconds"],
                     r["recover_over_resnapshot"]])  # fmt: skip
    rows.append(["median", harness.median_at(runs, "recover", "command_seconds"),
                 harness.median_at(runs, "recover", "compare_seconds"), "", "",
                 harness.median_at(runs, "resnapshot", "command_seconds"), ratio])  # fmt: skip
    return harness.markdown_table(head, rows)


def promotion(args: argparse.Namespace) -> None:
    def run(index: int) -> dict[str, Any]:
        report = promoted_run(index + 1, args)
        print(json.dumps(report), flush=True)
        return report

    runs = harness.run_repeats(run, args.runs)
    recover_s = harness.median_at(runs, "recover", "command_seconds")
    resnapshot_s = harness.median_at(runs, "resnapshot", "command_seconds")
    ratio = round(recover_s / resnapshot_s, 3) if recover_s and resnapshot_s else None
    report = {
        "lost_by": "promotion",
        "scale": args.scale,
        "source_major": SOURCE_MAJOR,
        "cluster_profile": harness.describe_profile(args.profile),
        "recover_seconds": recover_s,
        "resnapshot_seconds": resnapshot_s,
        "recover_over_resnapshot": ratio,
        "medians": harness.medians(
            [{"recover": r["recover"], "resnapshot": r["resnapshot"]} for r in runs]
        ),
        "runs": runs,
    }
    harness.emit_report(report, args.json)
    print()
    print(promotion_table(runs, ratio))


def main() -> None:
    parser = harness.argument_parser(__doc__, json=True)
    parser.add_argument("--scale", type=int, default=100)
    parser.add_argument(
        "--lost-by",
        choices=("wal-limit", "promotion"),
        default="wal-limit",
        help="how the slot is lost: max_slot_wal_keep_size on one source (default), or a "
        f"PostgreSQL {SOURCE_MAJOR} primary crashed and its standby promoted (no failover slot)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=3,
        help="runs: cycles on one pair of clusters (wal-limit), or fresh clusters each "
        "(promotion); default 3",
    )
    args = parser.parse_args()
    if args.lost_by == "wal-limit":
        wal_limit(args)
    else:
        promotion(args)


if __name__ == "__main__":
    main()
