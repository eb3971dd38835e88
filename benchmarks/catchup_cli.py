"""Catch-up through the command a user runs, against native logical replication, same backlog.

Where the user stands: ``pgcdc catchup --endpos L1`` started as a fresh process (Python,
Dagster and definitions load, the Dagster run, the follow pipeline: receive of range N+1
overlapping the apply of range N) with Dagster on PostgreSQL storage, timed from the moment the
process is started to its exit. The backlog, the snapshot, the cloned target database and the
native side are :mod:`apply`'s (``benchmarks/apply.py``): pgbench TPC-B on scale ``--scale``,
``--transactions`` per client and 4 clients, a ``CREATE SUBSCRIPTION`` over a slot made right
after our snapshot, timed from ``ENABLE`` until its slot confirms the backlog's end. The two
sides alternate order between repeats.

Reported per run: both wall times, the ratio (native seconds / ours, > 1: we are faster), and
from the follow run's own totals how long receive and apply were busy and how long they ran at
the same time.

``--server off`` (default): the command is the first on the machine, cold, in a process of its
own. ``--server warm``: an earlier command left the command server up
(:mod:`pgcdc_dagster.launcher`), so the command runs in its forked child with Dagster and the
definitions already imported; the child's CPU is counted as ``command_server``.

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/catchup_cli.py
[--transactions 20000] [--scale 10] [--repeat 1] [--server off|warm]
[--workload tpcb|insert-log]`` (80k transactions = 4 x 20000).
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
from apply import (
    WORKLOADS,
    CpuMeter,
    Setup,
    alternating,
    bench_clusters,
    prepare,
    run_native,
    verify_target,
    warm_command_server,
)

from pgcdc_dagster.engine.spark_session import get_spark

REPO = Path(__file__).resolve().parent.parent
PGCDC = str(Path(sys.executable).parent / "pgcdc")


def run_ours_cli(
    setup: Setup, target: Any, work: Path, meter: CpuMeter, warm: bool = False
) -> dict[str, Any]:
    storage_db = "dagster_storage"
    with psycopg.connect(target.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {storage_db}")
    home = work / "dagster_home"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    settings = setup.settings
    env = {
        **os.environ,
        "PGCDC_SOURCE_DSN": settings.source_dsn,
        "PGCDC_TARGET_DSN": settings.target_dsn,
        "PGCDC_SLOT": settings.slot,
        "PGCDC_PUBLICATION": settings.publication,
        "PGCDC_STORE": settings.store,
        "DAGSTER_HOME": str(home),
        "DAGSTER_POSTGRES_URL": (
            f"postgresql+psycopg2://postgres@127.0.0.1:{target.port}/{storage_db}"
        ),
        "PGCDC_SERVER": "auto" if warm else "off",
        "PGCDC_SERVER_DIR": str(work / "srv"),
    }
    # Dagster creates its storage schema on first use: do that outside the timing, as a user's
    # instance already has it.
    subprocess.run([PGCDC, "status"], env=env, capture_output=True, check=False, cwd=work)
    with contextlib.ExitStack() as stack:
        if warm:
            meter.roots["command_server"] = stack.enter_context(warm_command_server(env))
            stack.callback(meter.roots.pop, "command_server")
        with meter:
            started = time.perf_counter()
            done = subprocess.run(
                [PGCDC, "catchup", "--endpos", str(setup.end), "--json"],
                env=env,
                capture_output=True,
                text=True,
                cwd=work,
            )
            seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"pgcdc catchup failed: {done.stderr[-3000:]}")
    summary = json.loads(done.stdout)
    return {
        "seconds": seconds,
        "cpu_s": meter.seconds,
        "follow": summary.get("follow", {}),
        "ranges": summary["ranges_run"],
        "verify": verify_target(settings.model_copy(update={"target_dsn": settings.target_dsn})),
    }


def one_run(args: argparse.Namespace, spark: Any, index: int) -> dict[str, Any]:
    with bench_clusters() as (work, source, target):
        args.range_mb = 256
        setup = prepare(source, target, spark, work / "store", args)
        meter = CpuMeter(source, target)
        order, results = alternating(
            {
                "ours": lambda: run_ours_cli(setup, target, work, meter, args.server == "warm"),
                "native": lambda: run_native(setup, source, target, meter, args.native_timeout),
            },
            index,
        )
    ours, native = results["ours"], results["native"]
    follow = ours["follow"]
    return {
        "order": order,
        "transactions": 4 * args.transactions,
        "wal_mb": round((setup.end - setup.start) / 1e6, 1),
        "ours_s": round(ours["seconds"], 3),
        "native_s": round(native["seconds"], 3),
        "ratio": round(native["seconds"] / ours["seconds"], 3),
        "ours_cpu_s": ours["cpu_s"],
        "native_cpu_s": native["cpu_s"],
        "ours_ranges": ours["ranges"],
        "follow": follow,
        "ours_equal": ours["verify"]["equal"],
        "native_equal": native["verify"]["equal"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--transactions", type=int, default=20_000, help="per client (4)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="tpcb",
        help="tpcb: pgbench's TPC-B-like transactions (3 updates, 1 insert); insert-log: 4 rows "
        "inserted into pgbench_history per transaction (no key)",
    )
    parser.add_argument("--native-timeout", type=float, default=600)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--server",
        choices=["off", "warm"],
        default="off",
        help="off: the command in a fresh process of its own, cold (the first command on the "
        "machine); warm: with the command server an earlier command leaves up, the command runs "
        "in its forked child (Dagster and the definitions already imported)",
    )
    args = parser.parse_args()
    spark = get_spark()  # for the untimed snapshot; the timed command starts its own
    runs = [one_run(args, spark, i) for i in range(args.repeat)]
    report = {
        "command": "pgcdc catchup --endpos L1 (fresh process, PostgreSQL-backed Dagster)",
        "command_server": args.server,
        "transactions": 4 * args.transactions,
        "workload": args.workload,
        "median_ratio": statistics.median(r["ratio"] for r in runs),
        "runs": runs,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
