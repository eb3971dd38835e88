"""Receive + store throughput against the raw slot read rate, on one pgbench backlog.

Starts a throwaway source cluster, runs ``pgbench -i`` (scale 10) and a fixed TPC-B workload
(``--transactions`` per client, 4 clients) after creating several slots at the same point, then
on that same backlog measures, median of ``--repeat`` runs:

* raw: ``pg_logical_slot_peek_binary_changes`` fetched through a binary server-side cursor in
  batches, no decoding (the ceiling: what the server can hand us);
* receive+store: :func:`pgcdc_dagster.engine.source.peek.receive` of the whole backlog as one range
into
  a fresh Parquet store (decode, buffer, write, fsync, rename, slot advance), each run on its
  own slot so every run sees the same backlog.

Usage: ``.venv/bin/python benchmarks/receive.py [--scale 10] [--transactions 20000]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import psycopg

from pgcdc_dagster.demo.local_cluster import LOGICAL_SOURCE_SETTINGS, temporary_cluster
from pgcdc_dagster.demo.run import pgbench
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster.engine.source.peek import receive
from pgcdc_dagster.engine.store.output_store import OutputStore

PUBLICATION = "bench_pub"


def raw_read(dsn: str, slot: str, endpos: Lsn) -> tuple[float, int, int]:
    started = time.perf_counter()
    rows = wire = 0
    with psycopg.connect(dsn) as conn, conn.cursor(name="raw", binary=True) as cur:
        cur.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, %s::pg_lsn, NULL, "
            "'proto_version', '1', 'publication_names', %s)",
            (slot, str(endpos), PUBLICATION),
        )
        while batch := cur.fetchmany(20_000):
            rows += len(batch)
            wire += sum(len(r[0]) for r in batch)
    return time.perf_counter() - started, rows, wire


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--transactions", type=int, default=20_000, help="per client (4 clients)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    cluster = temporary_cluster(LOGICAL_SOURCE_SETTINGS, prefix="pgcdc-bench-")
    with cluster:
        dsn = cluster.dsn()
        t0 = time.perf_counter()
        pgbench(cluster, "-i", "-q", "-s", str(args.scale))
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(f"CREATE PUBLICATION {PUBLICATION} FOR ALL TABLES")
            slots = [f"bench_{i}" for i in range(args.repeat)]
            starts = [
                conn.execute(
                    "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')",
                    (slot,),
                ).fetchone()[0]
                for slot in slots
            ]
        # All slots at one point: create them back to back, then move each to the newest.
        start = max(Lsn(s) for s in starts)
        with psycopg.connect(dsn, autocommit=True) as conn:
            for slot in slots:
                conn.execute(
                    "SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, str(start))
                )
        workload = pgbench(cluster, "-n", "-c", "4", "-j", "2", "-t", str(args.transactions))
        assert workload is not None and workload.wait() == 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CHECKPOINT")
            endpos = Lsn(conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
        setup_s = time.perf_counter() - t0
        wal_mb = (endpos - start) / 1e6

        raw = [raw_read(dsn, slots[0], endpos) for _ in range(args.repeat)]
        raw_s = statistics.median(r[0] for r in raw)
        messages, wire = raw[0][1], raw[0][2]

        runs = []
        for slot in slots:
            with tempfile.TemporaryDirectory(prefix="pgcdc-bench-store-") as tmp:
                result = receive(dsn, slot, PUBLICATION, OutputStore(Path(tmp)), start, endpos)
                runs.append(result)
        recv_s = statistics.median(r.seconds for r in runs)
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
        "runs": {"raw_s": [round(r[0], 3) for r in raw], "receive_s": [r.seconds for r in runs]},
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
