"""Memory of the ranges a follow has applied and its run has not recorded (engine only).

While Dagster's storage is away, a follow goes on applying and its ranges wait for the run to
record them (``defs/storage_outage.py``). This builds ``--ranges`` finished ranges as a follow
at 1,000 tps of the demo's load produces them (8 replicated tables, 2 changed a range, about
200 transactions each), queues them in a plain ``queue.Queue`` (the follower's queue without
:mod:`pgcdc_dagster.engine.follow.backlog`) and in a
:class:`~pgcdc_dagster.engine.follow.backlog.Backlog`, and reports for each the memory held
(``tracemalloc``) once all are queued, the bytes on disk, and the seconds to put and to get them all
back, in order.

Usage: ``.venv/bin/python benchmarks/backlog_memory.py [--ranges 100000]``.
"""

from __future__ import annotations

import queue
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's code, whatever the virtualenv installed
sys.path.insert(0, str(REPO / "benchmarks"))

import harness  # noqa: E402

from pgcdc_dagster.engine.apply.results import ApplyResult, ApplyStatus, TableApplyCounts  # noqa: E402
from pgcdc_dagster.engine.control.pipeline import RangeDone  # noqa: E402
from pgcdc_dagster.engine.follow.backlog import Backlog  # noqa: E402
from pgcdc_dagster.engine.follow.follower import Followed  # noqa: E402
from pgcdc_dagster.engine.lsn import Lsn, LsnRange  # noqa: E402
from pgcdc_dagster.engine.store.output_store import EndposOutcome, RangeResult  # noqa: E402

TABLES = [f"public.{n}" for n in ("pgbench_accounts", "pgbench_branches", "pgbench_history")]
TABLES += [f"public.{n}" for n in ("pgbench_tellers", "orders", "customers", "events", "notes")]


def finished(i: int) -> Followed:
    """The ``i``-th range of a steady follow: 60 KB of WAL, 200 transactions, 400 changes."""
    start, end = Lsn(0x1_0000_0000 + i * 0xF000), Lsn(0x1_0000_0000 + (i + 1) * 0xF000)
    key = LsnRange(start, end).key
    received = RangeResult(
        range_key=key,
        start_lsn=str(start),
        endpos=str(end),
        endpos_outcome=EndposOutcome.BETWEEN_TRANSACTIONS,
        transform_lsn=str(Lsn(int(end) - 0x40)),
        safe_point=str(end),
        last_xid=100_000 + i * 200,
        last_commit_ts_us=1_764_000_000_000_000 + i * 200_000,
        transactions=200,
        changes=400,
        inserts=200,
        updates=200,
        bytes=9_800,
        wire_bytes=61_000,
        seconds=0.041,
    )
    counts = {t: TableApplyCounts() for t in TABLES}
    counts[TABLES[0]] = TableApplyCounts(changes=200, net_rows=198, updated=198)
    counts[TABLES[2]] = TableApplyCounts(changes=200, net_rows=200, inserted=200)
    applied = ApplyResult(
        range_key=key,
        status=ApplyStatus.APPLIED,
        replay_lsn=received.transform_lsn,
        previous_lsn=str(start),
        tables=counts,
        changes=400,
        net_rows=398,
        seconds=0.012,
    )
    return Followed(RangeDone(received, applied), 4_096, time.monotonic())


def measure(make: Any, ranges: int) -> dict[str, Any]:
    tracemalloc.start()
    began = time.perf_counter()
    waiting = make()
    for i in range(ranges):
        waiting.put(finished(i))
    put_s = time.perf_counter() - began
    held = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    disk = 0
    if isinstance(waiting, Backlog) and waiting._file is not None:
        disk = waiting._file.seek(0, 2)
    began = time.perf_counter()
    keys = [waiting.get(timeout=0).done.received.range_key for _ in range(ranges)]
    get_s = time.perf_counter() - began
    assert keys == [finished(i).done.received.range_key for i in range(ranges)]
    return {
        "memory_mb": round(held / 2**20, 1),
        "bytes_per_range_in_memory": round(held / ranges),
        "disk_mb": round(disk / 2**20, 1),
        "put_us_per_range": round(put_s / ranges * 1e6, 1),
        "get_us_per_range": round(get_s / ranges * 1e6, 1),
    }


def main() -> None:
    parser = harness.argument_parser(__doc__, profile=None)
    parser.add_argument("--ranges", type=int, default=100_000)
    args = parser.parse_args()
    report = {
        "ranges": args.ranges,
        "queue": measure(queue.Queue, args.ranges),
        "backlog": measure(Backlog, args.ranges),
    }
    harness.emit_report(report, indent=1)


if __name__ == "__main__":
    main()
