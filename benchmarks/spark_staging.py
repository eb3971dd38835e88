"""One big range applied two ways, same run: compacted and staged by Spark's workers (the
production path from ``PGCDC_SPARK_MIN_CHANGES`` on) against compacted and staged in process.

Engine-level figures (``apply_range`` called from a fresh Python process per path; for the
Spark path its session start is timed apart), not the user's command.

1. ``harness.prepare`` (``benchmarks/harness.py``) builds the source (pgbench scale
   ``--scale``), the base snapshot into target database ``bench_a`` and its clone ``bench_b``,
   with a small pgbench backlog (``--transactions`` per client); then ``--bulk`` more changes
   are written as UPDATE statements of ``pgbench_accounts`` (one tenth of the rows each, one
   transaction each), so the range holds millions of changes of which one net row per account
   remains;
2. the whole backlog is received as **one** range (no byte cap), timed;
3. each path applies that range in a fresh process of its own (so its peak RSS is its own):
   ``in-process`` into ``bench_a`` (origin ``pgcdc_bench``), ``executors`` into ``bench_b``
   (a second origin at the same position). Reported: seconds, the apply's own split, the
   driver's peak RSS (the JVM and its Python workers are not the driver);
4. both targets are compared with the source (row counts and a content hash per table).

``--held-back``: ``pgbench_accounts`` is recorded in the store as being added (as ``pgcdc
add-table`` records a table while it copies) before the paths run, so each path's
``apply_range`` holds its changes back and applies the other tables', and then
``apply_added_changes`` applies them as the add does (by Spark's workers on the ``executors``
path, in process on the other): what an add meets when a big transaction wrote its table
while it copied. Reported besides: that step's seconds and split.

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/spark_staging.py
[--scale 10] [--bulk 3000000] [--held-back] [--profile production|throwaway]``
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from pgcdc_dagster.engine.apply.held_back import apply_added_changes
from pgcdc_dagster.engine.apply.transaction import apply_range
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster.engine.spark.session import get_spark
from pgcdc_dagster.engine.store.output_store import OutputStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

OTHER_ORIGIN = "pgcdc_bench_b"
ADDED = TableName("public", "pgbench_accounts")


def child(
    path: str, target_dsn: str, store: str, range_key: str, origin: str, held_back: str = ""
) -> dict[str, Any]:
    """One path's apply, in this (fresh) process."""
    from pgcdc_dagster.engine.lsn import LsnRange

    stored = OutputStore(Path(store)).get(LsnRange.from_key(range_key))
    assert stored is not None
    spark = None
    spark_s = 0.0
    if path == "executors":
        t0 = time.perf_counter()
        spark = get_spark()
        spark.range(1).count()
        spark_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = apply_range(
        target_dsn, stored, origin, spark=spark, spark_min_changes=1, store=OutputStore(Path(store))
    )
    seconds = time.perf_counter() - t0
    added: dict[str, Any] = {}
    if held_back:
        t0 = time.perf_counter()
        applied = apply_added_changes(
            target_dsn,
            OutputStore(Path(store)),
            [ADDED],
            since=Lsn.parse(result.previous_lsn or "0/0"),
            through=Lsn.parse(result.replay_lsn or "0/0"),
            unpublished={},
            staging_key=f"{origin} add",
            spark=None if spark is None else lambda: spark,
            spark_min_changes=1,
        )
        added = {
            "held_back_s": round(time.perf_counter() - t0, 2),
            "held_back_changes": applied.changes,
            "held_back_ranges_on_spark": applied.on_spark,
        }
    return {
        "path": path,
        **added,
        "spark_start_s": round(spark_s, 2),
        "seconds": round(seconds, 2),
        **harness.apply_split(result),
        "driver_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--transactions", type=int, default=2500, help="pgbench, per client")
    parser.add_argument("--bulk", type=int, default=3_000_000, help="account updates")
    parser.add_argument("--held-back", action="store_true")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return

    with harness.bench_clusters(args.profile, extra=harness.QUIET) as (work, source, target):
        spark = get_spark()
        args.range_mb = 1 << 20
        setup = harness.prepare(source, target, spark, work / "store", args)
        spark.stop()
        harness.drop_slot(source.dsn(), harness.NATIVE_SLOT)
        t0 = time.perf_counter()
        bulk = harness.bulk_updates(source.dsn(), args.bulk)
        bulk_s = time.perf_counter() - t0
        settings = setup.settings
        end = pipeline.resolve_endpos(settings, "current")
        start = pipeline.store_of(settings).consistent_point()
        rng = pipeline.plan_next_range(start, None, end, 1 << 60)
        assert rng is not None
        t0 = time.perf_counter()
        pipeline.receive_range(settings, rng)
        receive_s = time.perf_counter() - t0
        with psycopg.connect(target.dsn(harness.DB_NATIVE), autocommit=True) as conn:
            (progress,) = conn.execute(
                "SELECT pg_replication_origin_progress(%s, true)::text", (settings.origin,)
            ).fetchone()  # type: ignore[misc]
            conn.execute("SELECT pg_replication_origin_create(%s)", (OTHER_ORIGIN,))
            conn.execute(
                "SELECT pg_replication_origin_advance(%s, %s::pg_lsn)", (OTHER_ORIGIN, progress)
            )
        if args.held_back:
            pipeline.store_of(settings).begin_adding([ADDED])
        runs = []
        for path, db, origin in (
            ("in-process", harness.DB_OURS, settings.origin),
            ("executors", harness.DB_NATIVE, OTHER_ORIGIN),
        ):
            out = subprocess.run(
                [sys.executable, __file__, "--child", path,
                 target.dsn(db), settings.store, rng.key, origin,
                 "held-back" if args.held_back else ""],
                check=True, capture_output=True, text=True,
            ).stdout  # fmt: skip
            run = json.loads(out.strip().splitlines()[-1])
            run["target_equals_source"] = harness.replication_equal(settings, target.dsn(db))[
                "equal"
            ]
            runs.append(run)
        harness.emit_report(
            {
                "scale": args.scale,
                "pgbench_transactions": args.transactions * 4,
                "bulk_updates": bulk,
                "bulk_s": round(bulk_s, 1),
                "range": rng.key,
                "receive_s": round(receive_s, 1),
                "cluster_profile": harness.describe_profile(args.profile),
                "runs": runs,
            }
        )


if __name__ == "__main__":
    main()
