"""Receive + store throughput against the raw slot read rate, on one pgbench backlog.

Starts a source cluster (``--profile``), runs ``pgbench -i`` (scale 10) and a fixed TPC-B workload
(``--transactions`` per client, 4 clients) after creating several slots at the same point, then
on that same backlog measures, median of ``--repeat`` runs:

* raw: ``pg_logical_slot_peek_binary_changes`` fetched through a binary server-side cursor in
  batches, no decoding (the ceiling: what the server can hand us);
* receive+store: :func:`pgcdc_dagster.engine.source.peek.receive` of the whole backlog as one range
into
  a fresh Parquet store (decode, buffer, write, fsync, rename, slot advance), each run on its
  own slot so every run sees the same backlog.

The raw read, the slots, the cluster and the medians are ``benchmarks/harness.py``'s.

Usage: ``.venv/bin/python benchmarks/receive.py [--scale 10] [--transactions 20000]
[--profile production|throwaway]``
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from pgcdc_dagster.demo.local_cluster import LOGICAL_SOURCE_SETTINGS
from pgcdc_dagster.demo.run import pgbench
from pgcdc_dagster.engine.source.peek import receive
from pgcdc_dagster.engine.store.output_store import OutputStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

PUBLICATION = "bench_pub"


def main() -> None:
    parser = harness.argument_parser(__doc__, repeat=3)
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--transactions", type=int, default=20_000, help="per client (4 clients)")
    args = parser.parse_args()

    cluster = harness.new_cluster(args.profile, LOGICAL_SOURCE_SETTINGS)
    with cluster:
        dsn = cluster.dsn()
        t0 = time.perf_counter()
        pgbench(cluster, "-i", "-q", "-s", str(args.scale))
        harness.create_publication(dsn, PUBLICATION)
        slots = [f"bench_{i}" for i in range(args.repeat)]
        start = harness.make_slots(dsn, slots)  # all at one point
        workload = pgbench(cluster, "-n", "-c", "4", "-j", "2", "-t", str(args.transactions))
        assert workload is not None and workload.wait() == 0
        harness.checkpoint(cluster)
        endpos = harness.wal_position(dsn, of="flush")
        setup_s = time.perf_counter() - t0
        wal_mb = (endpos - start) / 1e6

        raw = [harness.peek_slot(dsn, slots[0], endpos, PUBLICATION) for _ in range(args.repeat)]
        raw_s: float = harness.median(r[0] for r in raw)  # type: ignore[assignment]
        messages, wire = raw[0][1], raw[0][2]

        runs = []
        for slot in slots:
            with tempfile.TemporaryDirectory(prefix="pgcdc-bench-store-") as tmp:
                result = receive(dsn, slot, PUBLICATION, OutputStore(Path(tmp)), start, endpos)
                runs.append(result)
        recv_s: float = harness.median(r.seconds for r in runs)  # type: ignore[assignment]
        result = runs[0]

    cluster.destroy()
    report = {
        "backlog": {
            "pgbench_scale": args.scale,
            "transactions": result.transactions,
            "changes": result.changes,
            "pgoutput_messages": messages,
            "wal_mb": round(wal_mb, 1),
            "wire_mb": round(wire / 1e6, 1),
            "setup_seconds": round(setup_s, 1),
        },
        "raw_peek": {
            "seconds": round(raw_s, 3),
            "messages_per_s": round(messages / raw_s),
            "changes_per_s": round(result.changes / raw_s),
            "mb_per_s": round(wire / 1e6 / raw_s, 1),
        },
        "receive_store": {
            "seconds": round(recv_s, 3),
            "messages_per_s": round(messages / recv_s),
            "changes_per_s": round(result.changes / recv_s),
            "mb_per_s": round(wire / 1e6 / recv_s, 1),
            "parquet_mb": round(result.bytes / 1e6, 1),
            "endpos_outcome": result.endpos_outcome,
        },
        "ratio_receive_to_raw": round(raw_s / recv_s, 3),
        "cluster_profile": harness.describe_profile(args.profile),
        "runs": {"raw_s": [round(r[0], 3) for r in raw], "receive_s": [r.seconds for r in runs]},
    }
    harness.emit_report(report)


if __name__ == "__main__":
    main()
