"""What ``pgcdc add-table`` applies after its copy: the added table's changes the applies held
back while it copied, from many small stored ranges (a follow stores one every few hundred
milliseconds for as long as the copy runs).

Engine-level figures (``apply_added_changes`` timed in this process), not the user's command:
the command's figure (``benchmarks/add_table.py --while-following``) is dominated by the copy,
and its held-back step is a fraction of a second at the sizes that benchmark can reach here.

1. ``harness.prepare`` (``benchmarks/harness.py``) builds the source (pgbench scale
   ``--scale``), the base snapshot into target database ``bench_a`` and its clone ``bench_b``,
   and a pgbench TPC-B backlog of ``--transactions`` per client (4 clients);
2. ``pgbench_accounts`` is recorded in the store as being added (as ``pgcdc add-table`` does
   while it copies), and the backlog is caught up into ``bench_a`` in ranges of at most
   ``--range-kb`` KB of WAL: the other tables' changes applied, the accounts' held back;
3. ``bench_b`` gets the same origin position; then ``apply_added_changes`` applies the held-back
   changes into each database: ``bench_a`` in one transaction per range (``batch_changes=1``: no
   batches), ``bench_b`` with the default batch, alternating which goes first over ``--repeat``
   rounds (each round on fresh copies of the two databases);
4. both targets are compared with the source (row counts and a content hash per table).

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/held_back.py [--scale 1]
[--transactions 5000] [--range-kb 256] [--repeat 2] [--profile production|throwaway]``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from pgcdc_dagster.engine.apply.held_back import apply_added_changes
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster.engine.settings import ReplicationSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

ADDED = TableName("public", "pgbench_accounts")


def held_back_into(
    settings: ReplicationSettings, db_dsn: str, since: Lsn, through: Lsn, per_range: bool
) -> dict[str, Any]:
    started = time.perf_counter()
    applied = apply_added_changes(
        db_dsn,
        pipeline.store_of(settings),
        [ADDED],
        since=since,
        through=through,
        unpublished={},
        staging_key=f"{settings.origin} add",
        batch_changes=1 if per_range else None,
    )
    return {
        "seconds": round(time.perf_counter() - started, 3),
        "changes": applied.changes,
        "transactions": applied.transactions,
    }


def main() -> None:
    parser = harness.argument_parser(__doc__, repeat=2)
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--transactions", type=int, default=5000, help="pgbench, per client")
    parser.add_argument("--range-kb", type=int, default=256)
    args = parser.parse_args()
    args.range_mb = 1  # prepare's; the ranges are cut by --range-kb below

    with harness.bench_clusters(args.profile, extra=harness.QUIET) as (work, source, target):
        setup = harness.prepare(source, target, None, work / "store", args)
        harness.drop_slot(source.dsn(), harness.NATIVE_SLOT)
        settings = ReplicationSettings(
            **{**setup.settings.model_dump(), "range_max_bytes": args.range_kb * 1024}
        )
        store = pipeline.store_of(settings)
        since = store.consistent_point()
        store.begin_adding([ADDED])
        t0 = time.perf_counter()
        with pipeline.range_lock(settings):
            steps = list(
                pipeline.catch_up(
                    settings,
                    setup.end,
                    run_step=lambda step: pipeline.run_step_in_process(settings, step, None),
                )
            )
        catch_up_s = time.perf_counter() - t0
        through = pipeline.origin_progress(settings)
        assert through is not None
        ranges = sum(1 for _, applied in steps if applied is not None and applied.held_back)
        rounds = []
        for round_ in range(args.repeat):
            for db in ("round_a", "round_b"):
                harness.clone_database(target, harness.DB_OURS, db)
            order = harness.order_of([("per_range", True), ("batched", False)], round_)
            results: dict[str, Any] = {}
            for (name, per_range), db in zip(order, ("round_a", "round_b"), strict=True):
                results[name] = held_back_into(settings, target.dsn(db), since, through, per_range)
                equal = harness.replication_equal(settings, target.dsn(db))["equal"]
                results[name]["target_equals_source"] = equal
            rounds.append({"first": order[0][0], **results})
            for db in ("round_a", "round_b"):
                harness.drop_database(target, db)
        harness.emit_report(
            {
                "scale": args.scale,
                "pgbench_transactions": args.transactions * 4,
                "range_kb": args.range_kb,
                "ranges_holding_back": ranges,
                "catch_up_s": round(catch_up_s, 1),
                "cluster_profile": harness.describe_profile(args.profile),
                "rounds": rounds,
            }
        )


if __name__ == "__main__":
    main()
