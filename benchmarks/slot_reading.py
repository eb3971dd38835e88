"""Reading the slot: the SQL peek loop (what ``pgcdc follow`` uses) against the streaming
protocol (``START_REPLICATION`` on a psycopg 3 replication connection), for throughput and for
freshness, on the same source in the same run.

Why this exists: issue 9 asks which way of reading the slot to keep. Both readers here do only
the reading (no decoding into columns, no store, no apply), so the figures compare the two
ways of getting pgoutput messages into this process; everything after that is the same code
whichever way the bytes came.

Set-up: one source cluster (logical WAL; ``--profile``), ``pgbench -i`` at ``--scale``, a
publication for all tables and one slot per reader and repeat, created at one point.

Throughput (engine-only): a TPC-B backlog of ``--transactions`` per client (4 clients) is read
up to the flushed WAL position, median of ``--repeat`` runs each, wall and this process's CPU:

* peek: ``pg_logical_slot_peek_binary_changes`` through a binary server-side cursor, 20,000
  rows a fetch (psycopg builds the rows in C);
* stream: ``START_REPLICATION SLOT … LOGICAL`` (pgoutput, the same options) by the engine's
  ``SlotStream`` (what a follow that keeps up reads by), one ``PGconn.get_copy_data`` per
  message (psycopg 3 has no replication API above the libpq level, so each XLogData header is
  parsed in Python, per message), until a keepalive reports the server's sent position at or
  past the backlog's end.

Freshness: ``pgbench -b simple-update`` rate limited to ``--tps`` for ``--seconds`` while a probe
transaction commits every 0.5 s (its own connection); both readers run at once, each on its own
slot and connection. A probe's freshness is the time from its COMMIT returning to its BEGIN
message reaching the reader (found by xid). The peek reader does what the follower's receiver
does: look at the flushed position every 50 ms, peek up to it at most every 200 ms
(``PGCDC_FOLLOW_CUT_MS``), then move the slot to the last commit read. The stream reader confirms
the last commit read by a status update.

Usage: ``.venv/bin/python benchmarks/slot_reading.py [--transactions 20000] [--tps 1000]
[--profile production|throwaway]``
"""

from __future__ import annotations

import argparse
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from pgcdc_dagster.demo.local_cluster import LOGICAL_SOURCE_SETTINGS
from pgcdc_dagster.demo.run import pgbench
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster.engine.source.walsender import Keepalive, SlotStream

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

PUBLICATION = "bench_pub"
BEGIN = struct.Struct("!cQqI")  # 'B', final_lsn, commit time, xid
COMMIT_END = struct.Struct("!Q")  # a Commit message's end_lsn, at offset 10


def cpu_wall(fn: Any, *args: Any) -> tuple[float, float, Any]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu, out


def peek_read(dsn: str, slot: str, upto: Lsn) -> int:
    """Every message up to ``upto``, by the cursor and batch size receive uses (data only)."""
    return harness.peek_slot(dsn, slot, upto, PUBLICATION)[1]


def stream_read(dsn: str, slot: str, upto: Lsn) -> int:
    """Every message up to ``upto``, by the engine's stream (``engine/source/walsender.py``)."""
    messages = 0
    with SlotStream(dsn, slot, PUBLICATION, Lsn(0)) as stream:
        while True:
            arrived = False
            for item in stream.messages(5.0):
                arrived = True
                if isinstance(item, Keepalive):
                    if item.wal_end >= upto:
                        return messages
                else:
                    messages += 1
            if not arrived:
                raise RuntimeError("stream idle before the backlog's end")


def throughput(args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    dsn = cluster.dsn()
    slots = ["tp"]
    harness.make_slots(dsn, slots)
    workload = pgbench(cluster, "-n", "-c", "4", "-j", "2", "-t", str(args.transactions))
    assert workload is not None and workload.wait() == 0
    harness.checkpoint(cluster)
    upto = harness.wal_position(dsn, of="flush")
    report: dict[str, Any] = {"transactions": 4 * args.transactions}
    for name, reader in (("peek", peek_read), ("stream", stream_read)):
        runs = [cpu_wall(reader, dsn, slots[0], upto) for _ in range(args.repeat)]
        report[name] = {
            "seconds": harness.rounded(harness.median(r[0] for r in runs)),
            "client_cpu_s": harness.rounded(harness.median(r[1] for r in runs)),
            "messages": runs[0][2],
            "runs_s": [round(r[0], 3) for r in runs],
        }
    report["stream_over_peek_time"] = round(
        report["stream"]["seconds"] / report["peek"]["seconds"], 2
    )
    return report


def peek_follower(dsn: str, slot: str, seen: dict[int, float], stop: threading.Event) -> None:
    """The follower's receive loop, reading only: poll the flush every 50 ms, peek at most
    every 200 ms, then move the slot to the last commit read."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        last_end = 0
        while not stop.is_set():
            cycle = time.monotonic()
            flush = Lsn(conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()[0])
            if flush <= last_end:
                time.sleep(0.05)
                continue
            with conn.cursor(binary=True) as cur:
                cur.execute(harness.PEEK_SQL, (slot, str(flush), PUBLICATION))
                for (data,) in cur:
                    if data[0] == 0x42:
                        seen.setdefault(BEGIN.unpack_from(data)[3], time.time())
                    elif data[0] == 0x43:
                        last_end = max(last_end, COMMIT_END.unpack_from(data, 10)[0])
            if last_end:
                conn.execute(
                    "SELECT pg_replication_slot_advance(%s, %s::pg_lsn)", (slot, str(Lsn(last_end)))
                )
            stop.wait(max(0.0, cycle + 0.2 - time.monotonic()))


def stream_follower(dsn: str, slot: str, seen: dict[int, float], stop: threading.Event) -> None:
    last_end = 0
    with SlotStream(dsn, slot, PUBLICATION, Lsn(0)) as stream:
        while not stop.is_set():
            for item in stream.messages(0.1):
                if isinstance(item, Keepalive):
                    continue
                if item.data[0] == 0x42:
                    seen.setdefault(BEGIN.unpack_from(item.data)[3], time.time())
                elif item.data[0] == 0x43:
                    last_end = item.lsn  # a COMMIT's position is its end_lsn
            if last_end:
                stream.feedback(last_end)


def freshness(args: argparse.Namespace, cluster: Any) -> dict[str, Any]:
    dsn = cluster.dsn()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE probe (id int PRIMARY KEY, at timestamptz)")
    harness.make_slots(dsn, ["fr_peek", "fr_stream"])
    stop = threading.Event()
    seen: dict[str, dict[int, float]] = {"peek": {}, "stream": {}}
    readers = [
        threading.Thread(target=peek_follower, args=(dsn, "fr_peek", seen["peek"], stop)),
        threading.Thread(target=stream_follower, args=(dsn, "fr_stream", seen["stream"], stop)),
    ]
    for reader in readers:
        reader.start()
    load = pgbench(
        cluster, "-n", "-b", "simple-update", "-c", "4", "-j", "2",
        "-R", str(args.tps), "-T", str(args.seconds),
    )  # fmt: skip
    committed: dict[int, float] = {}
    with psycopg.connect(dsn) as conn:
        time.sleep(2)
        deadline = time.monotonic() + args.seconds - 4
        i = 0
        while time.monotonic() < deadline:
            i += 1
            xid = conn.execute(
                "INSERT INTO probe VALUES (%s, now()) RETURNING txid_current()", (i,)
            ).fetchone()[0]
            conn.commit()
            committed[xid % 2**32] = time.time()
            time.sleep(0.5)
    assert load is not None and load.wait() == 0
    time.sleep(1)
    stop.set()
    for reader in readers:
        reader.join()
    report: dict[str, Any] = {"tps": args.tps, "probes": len(committed)}
    for name, arrivals in seen.items():
        lags = sorted(arrivals[x] - t for x, t in committed.items() if x in arrivals)
        report[name] = {
            "seen": len(lags),
            "median_ms": round(1000 * harness.median(lags)),  # type: ignore[operator]
            "p95_ms": round(1000 * lags[int(0.95 * (len(lags) - 1))]),
            "max_ms": round(1000 * lags[-1]),
        }
    return report


def main() -> None:
    parser = harness.argument_parser(__doc__, repeat=3)
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--transactions", type=int, default=20_000, help="per client (4 clients)")
    parser.add_argument("--tps", type=int, default=1000)
    parser.add_argument("--seconds", type=int, default=30)
    args = parser.parse_args()
    cluster = harness.new_cluster(args.profile, LOGICAL_SOURCE_SETTINGS)
    with cluster:
        pgbench(cluster, "-i", "-q", "-s", str(args.scale))
        harness.create_publication(cluster.dsn(), PUBLICATION)
        report = {
            "cluster_profile": harness.describe_profile(args.profile),
            "throughput": throughput(args, cluster),
            "freshness": freshness(args, cluster),
        }
    cluster.destroy()
    harness.emit_report(report)


if __name__ == "__main__":
    main()
