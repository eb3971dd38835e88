"""Catch-up throughput, slot to applied target, against PostgreSQL's native logical replication.

One process, one pgbench backlog, both paths catching up the same changes from the same rows:

1. a source cluster (logical WAL) with ``pgbench -i -s <scale>`` (``pgbench_history`` set to
   REPLICA IDENTITY FULL first, as the preflight requires) and a ``FOR ALL TABLES`` publication
   for the native side; a target cluster. The SparkSession is started, then
   :func:`pgcdc_dagster.engine.control.pipeline.take_snapshot` copies the base data into target
   database ``bench_a`` (it creates our publication, slot and origin); right after it, before any
   backlog, the native slot is created on the source. ``bench_a`` is analysed (what autovacuum
   would have done during the backlog) and cloned, unconnected, into ``bench_b``
   (``CREATE DATABASE ... TEMPLATE``): both sides start from the same rows, the same physical
   files and the same planner statistics. Replication origins are cluster-wide, so the clone
   carries none of ours;
2. the backlog: pgbench TPC-B, ``--transactions`` per client, 4 clients (4 row changes per
   transaction: 3 updates, 1 insert), or with ``--workload insert-log``
   4 rows inserted into ``pgbench_history`` per transaction. Its end is the source's
   ``pg_current_wal_flush_lsn()`` after a CHECKPOINT;
3. ours, the production path with Spark already running:
   :func:`pgcdc_dagster.engine.control.pipeline.catch_up` plans ranges capped at ``--range-mb`` from
   the chain's start (the slot's confirmed position) to the end, and each range runs through
   :func:`pgcdc_dagster.engine.control.pipeline.run_step_in_process` (under the range lock:
   ``receive``, then ``apply_range``). Total = receive seconds + apply_range seconds over all
   ranges, split into the stages the results carry (receive; compaction, staging, apply statements +
   COMMIT, and the rest of ``apply_range``: target catalog reads, origin and gap checks).
   ``bench_a`` is then compared with the source (``harness.replication_equal``: row counts and a
   content hash per table);
4. native: ``CREATE SUBSCRIPTION`` on ``bench_b`` over the pre-made slot (no copy, disabled),
   timed from ``ALTER SUBSCRIPTION ... ENABLE`` until the source's ``confirmed_flush_lsn`` of
   the slot reaches the end (polled every 20 ms). The same poll reads the subscription origin's
   in-memory progress on the target, so the report also says when the last transaction was
   applied (``applied_s``) as opposed to confirmed flushed back to the source (``seconds``, the
   figure compared). ``bench_b`` is compared with the source, then the subscription and slot
   are dropped.

The two sides run one after the other (order alternates between repeats), each right after a
CHECKPOINT of both clusters. Autovacuum is off on both clusters so that a vacuum triggered by
one side's writes cannot land in the other side's timing. Every timed section also records
the CPU seconds of the source cluster, the target cluster, this process's tree (driver,
Spark JVM and its Python workers) and everything else on the machine (``others``: work of
other sessions, kernel threads), from ``/proc`` (``harness.CpuMeter``). The clusters, the
backlog and the native side are ``benchmarks/harness.py``'s (``prepare``, ``native_catch_up``);
``--profile`` picks the clusters' settings (production by default).

Ratio: ours throughput / native throughput, > 1 means we are faster. ``--repeat`` runs the
whole thing on fresh clusters and data and reports medians (and every run).

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/apply.py [--scale 10]
[--transactions 62500] [--range-mb 256] [--repeat 1] [--workload tpcb|insert-log]
[--profile production|throwaway]``
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.spark.session import get_spark

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

CPU_KEYS = ("source", "target", "driver", "others")


def run_ours(
    setup: harness.Setup, spark: Any, meter: harness.CpuMeter, clusters: harness.BenchClusters
) -> dict[str, Any]:
    settings = setup.settings
    ranges: list[dict[str, Any]] = []

    def run_step(step: Any) -> None:
        rng = step.range
        started = time.perf_counter()
        received, applied = pipeline.run_step_in_process(settings, step, spark)
        wall = time.perf_counter() - started
        other = applied.seconds - (
            applied.compaction_seconds + applied.staging_seconds + applied.apply_seconds
        )
        ranges.append(
            {
                "range": rng.key,
                "wal_mb": round((rng.end - rng.start) / 1e6, 1),
                "transactions": received.transactions,
                "changes": received.changes,
                "net_rows": applied.net_rows,
                "endpos_outcome": received.endpos_outcome,
                "apply_status": applied.status,
                "compaction_path": applied.compaction_path,
                "receive_s": received.seconds,
                "compaction_s": applied.compaction_seconds,
                "staging_s": applied.staging_seconds,
                "apply_s": applied.apply_seconds,
                "apply_other_s": round(other, 4),
                "apply_range_s": applied.seconds,
                "wall_s": round(wall, 4),
            }
        )

    harness.checkpoint(clusters.source, clusters.target)
    with meter:
        started = time.perf_counter()
        with pipeline.range_lock(settings):
            for _ in pipeline.catch_up(settings, setup.end, run_step=run_step):
                pass
        wall = time.perf_counter() - started
    cpu = meter.seconds

    def total(key: str) -> float:
        return sum(r[key] for r in ranges)

    receive_s = total("receive_s")
    apply_range_s = total("apply_range_s")
    result = {
        "ranges": len(ranges),
        "transactions": int(total("transactions")),
        "changes": int(total("changes")),
        "net_rows": int(total("net_rows")),
        "receive_s": receive_s,
        "compaction_s": total("compaction_s"),
        "staging_s": total("staging_s"),
        "apply_s": total("apply_s"),
        "apply_other_s": total("apply_other_s"),
        "apply_range_s": apply_range_s,
        "total_s": receive_s + apply_range_s,
        "wall_s": wall,
        "cpu_s": cpu,
        "per_range": ranges,
    }
    result["verify"] = harness.replication_equal(settings)
    return result


def one_run(args: argparse.Namespace, spark: Any, index: int) -> dict[str, Any]:
    with harness.bench_clusters(args.profile, extra=harness.QUIET) as clusters:
        source, target = clusters.source, clusters.target
        setup = harness.prepare(source, target, spark, clusters.work / "store", args)
        meter = harness.CpuMeter.of(source, target)
        order, results = harness.alternating(
            {
                "ours": lambda: run_ours(setup, spark, meter, clusters),
                "native": lambda: harness.native_catch_up(
                    setup, source, target, meter, args.native_timeout
                ),
            },
            index,
        )

    ours, native = results["ours"], results["native"]
    changes = ours["changes"]
    ours["changes_per_s"] = changes / ours["total_s"]
    native["changes_per_s"] = changes / native["seconds"]
    return {
        "order": order,
        "backlog": {
            "transactions": ours["transactions"],
            "changes": changes,
            "expected_changes": 4 * harness.CLIENTS * args.transactions,
            "wal_mb": (setup.end - setup.start) / 1e6,
            "pgbench_s": setup.pgbench_s,
            "snapshot_s": setup.snapshot_s,
            "setup_s": setup.setup_s,
        },
        "ours": ours,
        "native": native,
        "ratio": ours["changes_per_s"] / native["changes_per_s"],
    }


def report(args: argparse.Namespace, runs: list[dict[str, Any]], spark_start_s: float) -> dict:
    def m(*path: str) -> float:
        return harness.median_at(runs, *path)  # type: ignore[return-value]

    total = m("ours", "total_s")
    stages = ["receive_s", "compaction_s", "staging_s", "apply_s", "apply_other_s"]
    first = runs[0]
    return harness.rounded(
        {
            "backlog": {
                "pgbench_scale": args.scale,
                "clients": harness.CLIENTS,
                "transactions": int(m("backlog", "transactions")),
                "changes": int(m("backlog", "changes")),
                "expected_changes": first["backlog"]["expected_changes"],
                "wal_mb": round(m("backlog", "wal_mb"), 1),
                "pgbench_s": m("backlog", "pgbench_s"),
            },
            "ours": {
                "range_mb": args.range_mb,
                "ranges": int(m("ours", "ranges")),
                "net_rows": int(m("ours", "net_rows")),
                **{stage: m("ours", stage) for stage in stages},
                "apply_range_s": m("ours", "apply_range_s"),
                "total_s": total,
                "wall_s": m("ours", "wall_s"),
                "changes_per_s": round(m("ours", "changes_per_s")),
                "cpu_s": {k: m("ours", "cpu_s", k) for k in CPU_KEYS},
                "verified": all(r["ours"]["verify"]["equal"] for r in runs),
            },
            "native": {
                "seconds": m("native", "seconds"),
                "applied_s": m("native", "applied_s"),
                "changes_per_s": round(m("native", "changes_per_s")),
                "cpu_s": {k: m("native", "cpu_s", k) for k in CPU_KEYS},
                "verified": all(r["native"]["verify"]["equal"] for r in runs),
            },
            "ratio": m("ratio"),
            "shares": {stage.removesuffix("_s"): m("ours", stage) / total for stage in stages},
            "spark_start_s": spark_start_s,
            "cluster_profile": harness.describe_profile(args.profile),
            "repeat": len(runs),
            "runs": runs,
        }
    )


def main() -> None:
    parser = harness.argument_parser(__doc__, repeat=1)
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument(
        "--transactions", type=int, default=62_500, help=f"per client ({harness.CLIENTS} clients)"
    )
    parser.add_argument("--range-mb", type=int, default=256, help="range cap, MiB of WAL")
    parser.add_argument(
        "--workload",
        choices=harness.WORKLOADS,
        default="tpcb",
        help="tpcb: pgbench's TPC-B-like transactions; insert-log: 4 rows into pgbench_history",
    )
    parser.add_argument("--native-timeout", type=float, default=600.0)
    args = parser.parse_args()

    t0 = time.perf_counter()
    spark = get_spark()
    spark.range(1).count()  # the first job pays the JVM's warm-up, outside every timing
    spark_start_s = time.perf_counter() - t0
    try:
        runs = harness.run_repeats(lambda i: one_run(args, spark, i), args.repeat)
    finally:
        spark.stop()
    harness.emit_report(report(args, runs, spark_start_s))


if __name__ == "__main__":
    main()
