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
   ``bench_a`` is then compared with the source
   (:func:`pgcdc_dagster.engine.compare.verify.compare_tables`: row counts and a content hash per
   table);
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
other sessions, kernel threads), from ``/proc``.

Ratio: ours throughput / native throughput, > 1 means we are faster. ``--repeat`` runs the
whole thing on fresh clusters and data and reports medians (and every run).

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/apply.py [--scale 10]
[--transactions 62500] [--range-mb 256] [--repeat 1] [--workload tpcb|insert-log]``
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from pgcdc_dagster.demo.local_cluster import (
    LOGICAL_SOURCE_SETTINGS,
    LocalCluster,
    temporary_cluster,
)
from pgcdc_dagster.demo.run import pgbench
from pgcdc_dagster.engine.compare import verify
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster.engine.spark.session import get_spark

CLIENTS = 4
SLOT = "bench"
PUBLICATION = "bench_pub"
NATIVE_SLOT = "native"
NATIVE_PUBLICATION = "native_pub"
NATIVE_SUBSCRIPTION = "native_sub"
DB_OURS = "bench_a"
DB_NATIVE = "bench_b"
POLL_S = 0.02
QUIET = {"autovacuum": "off"}
"""Added to both clusters' settings (over the throwaway defaults)."""

_TICK = os.sysconf("SC_CLK_TCK")
CPU_KEYS = ("source", "target", "driver", "others")


# -- CPU accounting ---------------------------------------------------------------------------


def _proc_stats() -> dict[int, list[str]]:
    """``/proc/<pid>/stat`` fields after the command name, for every process."""
    stats = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        stats[int(entry)] = text[text.rindex(")") + 2 :].split()
    return stats


Tree = dict[int, tuple[int, int]]
"""pid -> (parent pid, CPU ticks: utime + stime + cutime + cstime) of a process tree."""


def process_trees(roots: dict[str, int]) -> dict[str, Tree]:
    """Each root and its live descendants."""
    stats = _proc_stats()
    children: dict[int, list[int]] = {}
    for pid, fields in stats.items():
        children.setdefault(int(fields[1]), []).append(pid)
    out = {}
    for name, root in roots.items():
        tree: Tree = {}
        stack = [root]
        while stack:
            pid = stack.pop()
            info = stats.get(pid)
            if info is None:
                continue
            tree[pid] = (int(info[1]), sum(int(x) for x in info[11:15]))
            stack += children.get(pid, [])
        out[name] = tree
    return out


def cpu_between(start: Tree, end: Tree) -> float:
    """CPU seconds the tree spent between two samples.

    A child that exits and is reaped moves its whole CPU time into its parent's cutime/cstime,
    so the difference of the sums stays exact. A process whose parent is gone too (Spark's
    Python workers, orphaned when their daemon is stopped) takes its time with it: its ticks
    at the start are added back, so it counts zero for the interval instead of a negative.
    """
    lost = sum(ticks for pid, (ppid, ticks) in start.items() if pid not in end and ppid not in end)
    return (sum(t for _, t in end.values()) - sum(t for _, t in start.values()) + lost) / _TICK


def postmaster_pid(cluster: LocalCluster) -> int:
    return int((cluster.datadir / "postmaster.pid").read_text().split()[0])


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (``/proc/stat``: all but idle and iowait)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields)
    return (user + nice + system + irq + softirq + steal) / _TICK


class CpuMeter:
    """CPU seconds spent inside a ``with`` block by the source, the target, this process, and
    everything else on the machine (``others``: other people's work, kernel threads; it should
    stay near zero for a clean measurement)."""

    def __init__(self, source: LocalCluster, target: LocalCluster) -> None:
        self.clusters = (source, target)
        self.roots = {
            "source": postmaster_pid(source),
            "target": postmaster_pid(target),
            "driver": os.getpid(),
        }

    def __enter__(self) -> CpuMeter:
        self.busy = machine_busy()
        self.started = process_trees(self.roots)
        self.seconds: dict[str, float] = {}
        return self

    def __exit__(self, *exc: object) -> None:
        ended = process_trees(self.roots)
        busy = machine_busy() - self.busy
        ours = {k: cpu_between(self.started[k], ended[k]) for k in self.roots}
        self.seconds = {k: round(v, 2) for k, v in ours.items()}
        self.seconds["others"] = round(busy - sum(ours.values()), 2)


@contextlib.contextmanager
def warm_command_server(env: dict[str, str]) -> Iterator[int]:
    """What an earlier ``pgcdc`` command leaves up: the command server of ``env`` (its
    ``PGCDC_SERVER_DIR``), started before a measured command and stopped after it. Yields its
    pid: the measured command runs in its forked child, so that tree holds the command's CPU."""
    pgcdc = str(Path(sys.executable).parent / "pgcdc")
    subprocess.run([pgcdc, "server", "start"], env=env, check=True, capture_output=True)
    try:
        status = subprocess.run([pgcdc, "server", "status", "--json"], env=env, check=True,
                                capture_output=True, text=True)  # fmt: skip
        yield int(json.loads(status.stdout)["pid"])
    finally:
        subprocess.run([pgcdc, "server", "stop"], env=env, check=True, capture_output=True)


# -- setup ------------------------------------------------------------------------------------


def flush_lsn(conn: psycopg.Connection[Any]) -> Lsn:
    (text,) = conn.execute("SELECT pg_current_wal_flush_lsn()::text").fetchone()  # type: ignore[misc]
    return Lsn.parse(text)


def checkpoint(*clusters: LocalCluster) -> None:
    for cluster in clusters:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute("CHECKPOINT")


def clone_database(target: LocalCluster, template: str, name: str) -> None:
    """``CREATE DATABASE name TEMPLATE template`` once nobody is connected to the template."""
    with psycopg.connect(target.dsn(), autocommit=True) as conn:
        deadline = time.monotonic() + 30
        while True:
            try:
                conn.execute(
                    sql.SQL("CREATE DATABASE {} TEMPLATE {} STRATEGY file_copy").format(
                        sql.Identifier(name), sql.Identifier(template)
                    )
                )
                return
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)


@dataclasses.dataclass
class Setup:
    settings: ReplicationSettings
    start: Lsn
    """The source's flushed WAL just before the backlog."""
    end: Lsn
    pgbench_s: float
    setup_s: float
    snapshot_s: float


INSERT_LOG_SCRIPT = """\\set aid random(1, 100000 * :scale)
\\set bid random(1, :scale)
\\set tid random(1, 10 * :scale)
\\set delta random(-5000, 5000)
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime)
  SELECT :tid, :bid, :aid + g, :delta, now() FROM generate_series(0, 3) g;
"""
"""``--workload insert-log``: each transaction inserts 4 rows into ``pgbench_history`` (no
key, identity FULL) and changes nothing else: a log or audit table's stream, with as many row
changes per transaction as TPC-B's."""

WORKLOADS = ("tpcb", "insert-log")


def prepare(
    source: LocalCluster,
    target: LocalCluster,
    spark: Any,
    store: Path,
    args: argparse.Namespace,
) -> Setup:
    t0 = time.perf_counter()
    pgbench(source, "-i", "-q", "-s", str(args.scale))
    with psycopg.connect(source.dsn(), autocommit=True) as conn:
        conn.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
        conn.execute(f"CREATE PUBLICATION {NATIVE_PUBLICATION} FOR ALL TABLES")
    with psycopg.connect(target.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {DB_OURS}")
    settings = ReplicationSettings(
        source_dsn=source.dsn(),
        target_dsn=target.dsn(DB_OURS),
        slot=SLOT,
        publication=PUBLICATION,
        store=str(store),
        range_max_bytes=args.range_mb * 1024 * 1024,
    )
    snapshot = pipeline.take_snapshot(settings, spark)
    with psycopg.connect(source.dsn(), autocommit=True) as conn:
        (native_lsn,) = conn.execute(
            "SELECT lsn::text FROM pg_create_logical_replication_slot(%s, 'pgoutput')",
            (NATIVE_SLOT,),
        ).fetchone()  # type: ignore[misc]
        start = flush_lsn(conn)
    with psycopg.connect(target.dsn(DB_OURS), autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    clone_database(target, DB_OURS, DB_NATIVE)
    if Lsn.parse(native_lsn) < snapshot.consistent_point:
        raise RuntimeError(f"native slot at {native_lsn}, before {snapshot.consistent_point}")

    t1 = time.perf_counter()
    script: list[str] = []
    if getattr(args, "workload", "tpcb") == "insert-log":
        path = store.parent / "insert_log.sql"
        path.write_text(INSERT_LOG_SCRIPT)
        script = ["-f", str(path)]
    workload = pgbench(
        source, "-n", *script, "-c", str(CLIENTS), "-j", "2", "-t", str(args.transactions)
    )
    assert workload is not None
    _, stderr = workload.communicate()
    if workload.returncode != 0:
        raise RuntimeError(f"pgbench failed: {stderr.decode(errors='replace')[-2000:]}")
    pgbench_s = time.perf_counter() - t1
    with psycopg.connect(source.dsn(), autocommit=True) as conn:
        conn.execute("CHECKPOINT")
        end = flush_lsn(conn)
    return Setup(
        settings,
        start,
        end,
        pgbench_s=pgbench_s,
        setup_s=time.perf_counter() - t0,
        snapshot_s=snapshot.seconds,
    )


# -- the two sides ----------------------------------------------------------------------------


def verify_target(settings: ReplicationSettings) -> dict[str, Any]:
    tables = pipeline.replicated_tables(settings)
    comparisons = verify.compare_tables(settings, tables)
    return {
        "equal": all(c.equal for c in comparisons),
        "rows": sum(c.target_rows for c in comparisons),
        "differ": [str(c.table) for c in comparisons if not c.equal],
    }


def run_ours(setup: Setup, spark: Any, meter: CpuMeter) -> dict[str, Any]:
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

    checkpoint(*meter.clusters)
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
    result["verify"] = verify_target(settings)
    return result


def run_native(
    setup: Setup, source: LocalCluster, target: LocalCluster, meter: CpuMeter, timeout_s: float
) -> dict[str, Any]:
    target_dsn = target.dsn(DB_NATIVE)
    with (
        psycopg.connect(target_dsn, autocommit=True) as tgt,
        psycopg.connect(source.dsn(), autocommit=True) as src,
    ):
        tgt.execute(
            sql.SQL(
                "CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {} WITH (create_slot = false, "
                "slot_name = {}, copy_data = false, enabled = false)"
            ).format(
                sql.Identifier(NATIVE_SUBSCRIPTION),
                sql.Literal(source.dsn()),
                sql.Identifier(NATIVE_PUBLICATION),
                sql.Literal(NATIVE_SLOT),
            )
        )
        (origin,) = tgt.execute(
            "SELECT 'pg_' || oid FROM pg_subscription WHERE subname = %s", (NATIVE_SUBSCRIPTION,)
        ).fetchone()  # type: ignore[misc]
        poll_source = (
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s"
        )
        poll_target = "SELECT pg_replication_origin_progress(%s, false)::text"
        timeline: list[tuple[float, Lsn | None]] = []
        checkpoint(*meter.clusters)
        with meter:
            started = time.perf_counter()
            tgt.execute(
                sql.SQL("ALTER SUBSCRIPTION {} ENABLE").format(sql.Identifier(NATIVE_SUBSCRIPTION))
            )
            while True:
                (confirmed,) = src.execute(poll_source, (NATIVE_SLOT,)).fetchone()  # type: ignore[misc]
                (applied,) = tgt.execute(poll_target, (origin,)).fetchone()  # type: ignore[misc]
                now = time.perf_counter() - started
                timeline.append((now, None if applied is None else Lsn.parse(applied)))
                if confirmed is not None and Lsn.parse(confirmed) >= setup.end:
                    break
                if now > timeout_s:
                    raise RuntimeError(
                        f"native subscription not caught up after {timeout_s} s: slot confirmed "
                        f"at {confirmed}, backlog ends at {setup.end}; the target's server log "
                        "(deleted with the cluster) ends with:\n"
                        + target.logfile.read_text(errors="replace")[-3000:]
                    )
                time.sleep(POLL_S)
            seconds = time.perf_counter() - started
        final = timeline[-1][1]
        applied_s = next(t for t, lsn in timeline if lsn == final)
        first_commit_s = next((t for t, lsn in timeline if lsn is not None), None)
        result = {
            "seconds": seconds,
            "applied_s": applied_s,
            "first_commit_s": first_commit_s,
            "polls": len(timeline),
            "cpu_s": meter.seconds,
        }
        native_settings = setup.settings.model_copy(update={"target_dsn": target_dsn})
        result["verify"] = verify_target(native_settings)
        name = sql.Identifier(NATIVE_SUBSCRIPTION)
        tgt.execute(sql.SQL("ALTER SUBSCRIPTION {} DISABLE").format(name))
        tgt.execute(sql.SQL("ALTER SUBSCRIPTION {} SET (slot_name = NONE)").format(name))
        tgt.execute(sql.SQL("DROP SUBSCRIPTION {}").format(name))
        deadline = time.monotonic() + 30
        while True:  # the walsender exits shortly after the worker stops
            try:
                src.execute("SELECT pg_drop_replication_slot(%s)", (NATIVE_SLOT,))
                break
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    return result


# -- one run, and the report ------------------------------------------------------------------


@contextlib.contextmanager
def bench_clusters() -> Iterator[tuple[Path, LocalCluster, LocalCluster]]:
    """A work folder, a started source (logical WAL) and target, all removed afterwards (every
    clean-up runs, even if one fails)."""
    with contextlib.ExitStack() as cleanup:
        work = Path(tempfile.mkdtemp(prefix="pgcdc-bench-"))
        cleanup.callback(shutil.rmtree, work, ignore_errors=True)
        source = temporary_cluster({**LOGICAL_SOURCE_SETTINGS, **QUIET}, prefix="pgcdc-bench-src-")
        cleanup.callback(source.destroy)
        target = temporary_cluster(QUIET, prefix="pgcdc-bench-tgt-")
        cleanup.callback(target.destroy)
        source.start()
        target.start()
        yield work, source, target


def alternating(
    sides: dict[str, Callable[[], dict[str, Any]]], index: int
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Run ``ours`` and ``native`` one after the other, the order alternating with ``index``."""
    order = ["ours", "native"] if index % 2 == 0 else ["native", "ours"]
    return order, {side: sides[side]() for side in order}


def one_run(args: argparse.Namespace, spark: Any, index: int) -> dict[str, Any]:
    with bench_clusters() as (work, source, target):
        setup = prepare(source, target, spark, work / "store", args)
        meter = CpuMeter(source, target)
        order, results = alternating(
            {
                "ours": lambda: run_ours(setup, spark, meter),
                "native": lambda: run_native(setup, source, target, meter, args.native_timeout),
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
            "expected_changes": 4 * CLIENTS * args.transactions,
            "wal_mb": (setup.end - setup.start) / 1e6,
            "pgbench_s": setup.pgbench_s,
            "snapshot_s": setup.snapshot_s,
            "setup_s": setup.setup_s,
        },
        "ours": ours,
        "native": native,
        "ratio": ours["changes_per_s"] / native["changes_per_s"],
    }


def _median(runs: list[dict[str, Any]], *path: str) -> float:
    def get(run: dict[str, Any]) -> float:
        value: Any = run
        for key in path:
            value = value[key]
        return float(value)

    return statistics.median(get(r) for r in runs)


def _rounded(value: Any, digits: int = 3) -> Any:
    if isinstance(value, float):
        return round(value, digits)
    if isinstance(value, dict):
        return {k: _rounded(v, digits) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v, digits) for v in value]
    return value


def report(args: argparse.Namespace, runs: list[dict[str, Any]], spark_start_s: float) -> dict:
    def m(*path: str) -> float:
        return _median(runs, *path)

    total = m("ours", "total_s")
    stages = ["receive_s", "compaction_s", "staging_s", "apply_s", "apply_other_s"]
    first = runs[0]
    return _rounded(
        {
            "backlog": {
                "pgbench_scale": args.scale,
                "clients": CLIENTS,
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
            "repeat": len(runs),
            "runs": runs,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument(
        "--transactions", type=int, default=62_500, help=f"per client ({CLIENTS} clients)"
    )
    parser.add_argument("--range-mb", type=int, default=256, help="range cap, MiB of WAL")
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="tpcb",
        help="tpcb: pgbench's TPC-B-like transactions; insert-log: 4 rows into pgbench_history",
    )
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--native-timeout", type=float, default=600.0)
    args = parser.parse_args()

    t0 = time.perf_counter()
    spark = get_spark()
    spark.range(1).count()  # the first job pays the JVM's warm-up, outside every timing
    spark_start_s = time.perf_counter() - t0
    try:
        runs = [one_run(args, spark, i) for i in range(args.repeat)]
    finally:
        spark.stop()
    print(json.dumps(report(args, runs, spark_start_s), indent=2))


if __name__ == "__main__":
    main()
