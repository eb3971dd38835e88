"""Online verify (``compare_online``) on pgbench data: on a quiet source, then under a steady
pgbench load with a follow applying, against the whole-table compare on the quiet source.

Engine only: two clusters (``--profile``), ``pgbench -i`` at ``--scale``, a base snapshot
(:func:`pgcdc_dagster.engine.control.pipeline.take_snapshot`), then, each timed and checked
equal:

* ``whole_quiet``: :func:`~pgcdc_dagster.engine.compare.verify.compare_tables` (one md5 of the
  sorted row md5s per table and side), nothing writing;
* ``online_quiet``: :func:`~pgcdc_dagster.engine.compare.verify.compare_online`, nothing
  writing;
* ``online_busy``: the same while ``pgbench -R --tps`` runs and a follow (a
  :class:`~pgcdc_dagster.engine.follow.follower.Follower` on a thread, under the range lock)
  applies; it must find the tables equal (no lag reported as a difference) and the follow
  must go on after it.

Usage: ``.venv/bin/python benchmarks/verify_online.py [--scale 100] [--tps 500]
[--profile production|throwaway]``
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from pgcdc_dagster.demo.run import pgbench
from pgcdc_dagster.engine.compare import verify
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.follow.follower import Follower
from pgcdc_dagster.engine.settings import ReplicationSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

TABLES = harness.PGBENCH_TABLES


def _timed(source: Any, target: Any, call: Any) -> tuple[Any, dict[str, Any]]:
    with harness.Measured(source, target) as measured:
        result = call()
    return result, {
        "seconds": round(measured.wall, 2),
        "cpu_seconds": {k: measured.cpu[k] for k in ("source_pg", "target_pg", "client")},
    }


def main() -> None:
    parser = harness.argument_parser(__doc__)
    parser.add_argument("--scale", type=int, default=100)
    parser.add_argument("--tps", type=int, default=500)
    args = parser.parse_args()
    report: dict[str, Any] = {
        "scale": args.scale,
        "tps": args.tps,
        "cluster_profile": harness.describe_profile(args.profile),
    }
    with harness.bench_clusters(args.profile, logical_target=True) as (work, source, target):
        harness.fill_pgbench(source, args.scale)
        settings = ReplicationSettings(
            source_dsn=source.dsn(),
            target_dsn=target.dsn(),
            slot="bench_verify",
            store=str(work / "store"),
            tables=tuple(TABLES),
        )
        pipeline.take_snapshot(settings, None)
        harness.checkpoint(source, target, sync=True)

        whole, report["whole_quiet"] = _timed(
            source, target, lambda: verify.compare_tables(settings, TABLES)
        )
        assert all(c.equal for c in whole), whole
        quiet, report["online_quiet"] = _timed(
            source,
            target,
            lambda: verify.compare_online(settings, TABLES, "bench"),
        )
        assert all(c.equal for c in quiet.tables), quiet.tables
        report["online_quiet"]["chunks"] = sum(c.chunks for c in quiet.tables)

        follower = Follower(settings)

        def follow() -> None:
            with pipeline.range_lock(settings):
                for _ in follower.run():
                    pass

        load = pgbench(source, "-n", "-c", "4", "-j", "2", "-R", str(args.tps), "-T", "600")
        thread = threading.Thread(target=follow)
        thread.start()
        try:
            while follower.summary.ranges < 3:
                time.sleep(0.1)
            busy, report["online_busy"] = _timed(
                source,
                target,
                lambda: verify.compare_online(settings, TABLES, "bench"),
            )
            ranges_after = follower.summary.ranges
            time.sleep(3)
            assert follower.summary.ranges > ranges_after, "the follow did not go on"
            assert all(c.equal for c in busy.tables), busy.tables
            report["online_busy"].update(
                {
                    "equal": True,
                    "made_way_by": busy.pair.made_way_by,
                    "ranges_caught_up_to_point": busy.pair.ranges_caught_up,
                }
            )
        finally:
            if load is not None:
                load.terminate()
                load.wait()
            follower.stop("benchmark")
            thread.join(timeout=120)
    harness.emit_report(report)


if __name__ == "__main__":
    main()
