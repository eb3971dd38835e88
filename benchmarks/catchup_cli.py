"""Catch-up through the command a user runs, against native logical replication, same backlog.

Where the user stands: ``pgcdc catchup --endpos L1`` started as a fresh process (Python,
Dagster and definitions load, the Dagster run, the follow pipeline: receive of range N+1
overlapping the apply of range N) with Dagster on PostgreSQL storage, timed from the moment the
process is started to its exit. The backlog, the snapshot, the cloned target database and the
native side are ``benchmarks/apply.py``'s, from ``benchmarks/harness.py``: pgbench TPC-B on
scale ``--scale``, ``--transactions`` per client and 4 clients, a ``CREATE SUBSCRIPTION`` over
a slot made right after our snapshot, timed from ``ENABLE`` until its slot confirms the
backlog's end. The two sides alternate order between repeats, and each starts from a
``CHECKPOINT`` of both clusters and a ``sync`` (the side before must not leave its dirty
buffers, or a checkpoint due to its WAL, to the next). The command's Dagster storage holds the
base snapshot's materialisation, as ``pgcdc snapshot`` leaves it.

Reported per run: both wall times, the ratio (native seconds / ours, > 1: we are faster), and
from the follow run's own totals how long receive and apply were busy and how long they ran at
the same time. Each side's CPU seconds (``harness.CpuMeter``: the source cluster's
processes, the target's, this benchmark's process tree, the rest of the machine) and, for ours,
the command's own tree apart (``command``: the ``pgcdc`` process and the children it reaped,
its follower among them, from ``wait4``'s resource usage; ``driver`` is then the benchmark's
own process and its untimed Spark, the command taken out). The 1-minute load average before
and after each side. For ours also a timeline polled as native's is (every 20 ms: the slot's
``confirmed_flush_lsn`` on the source, moved once a range is stored and its peek has ended,
and the origin's progress on the target, moved by each range's apply), and per range (from
the run's events in Dagster's storage) its WAL, changes, receive, staging and apply seconds,
when its slot position was confirmed and when it was applied (the origin reached its last
commit). ``--py-spy FILE``: one more run of ours alone, under ``py-spy record
--subprocesses`` (raw collapsed stacks to FILE), untimed.

``--server off`` (default): the command is the first on the machine, cold, in a process of its
own. ``--server warm``: an earlier command left the command server up
(:mod:`pgcdc_dagster.launcher`), so the command runs in its forked child with Dagster and the
definitions already imported; the child's CPU is counted as ``command_server``.

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/catchup_cli.py
[--transactions 20000] [--scale 10] [--repeat 1] [--server off|warm]
[--workload tpcb|insert-log] [--profile production|throwaway]`` (80k transactions = 4 x 20000).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg

from pgcdc_dagster.engine.lsn import Lsn, LsnRange
from pgcdc_dagster.engine.spark.session import get_spark

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

STORAGE = "storage"
"""The name of Dagster's storage (``dagster_storage``) in the environment of the command."""


def run_ours_cli(
    setup: harness.Setup,
    source: Any,
    target: Any,
    work: Path,
    meter: harness.CpuMeter,
    warm: bool = False,
    profile: Path | None = None,
) -> dict[str, Any]:
    settings = setup.settings
    # Dagster's storage schema made outside the timing, as a user's instance already has it.
    env = harness.pgcdc_env(
        work,
        settings.source_dsn,
        target,
        STORAGE,
        target_dsn=settings.target_dsn,
        slot=settings.slot,
        publication=settings.publication,
        store=settings.store,
        server="auto" if warm else "off",
    )
    harness.record_snapshot(env, work, setup.snapshot)
    # As native's side: neither pays for the dirty buffers, nor a checkpoint due to, the WAL
    # of whatever ran before it (the other side's 1.2-1.3 GB brings the next checkpoint within
    # reach of max_wal_size's trigger).
    harness.checkpoint(source, target, sync=True)
    pyspy: list[str] = []
    if profile is not None:
        pyspy = [str(Path(sys.executable).parent / "py-spy"), "record", "--subprocesses",
                 "--rate", "200", "--format", "raw", "--nonblocking",
                 "-o", str(profile), "--"]  # fmt: skip
    out_path, err_path = work / "catchup.out", work / "catchup.err"
    timeline = Timeline(setup, target)
    with contextlib.ExitStack() as stack:
        if warm:
            meter.roots["command_server"] = stack.enter_context(harness.warm_command_server(env))
            stack.callback(meter.roots.pop, "command_server")
        load_before = os.getloadavg()[0]
        with open(out_path, "w") as out, open(err_path, "w") as err, timeline, meter:
            started = time.perf_counter()
            timeline.started = started
            proc = subprocess.Popen(
                [*pyspy, harness.PGCDC, "catchup", "--endpos", str(setup.end), "--json"],
                env=env,
                stdout=out,
                stderr=err,
                cwd=work,
            )
            _, status, usage = os.wait4(proc.pid, 0)
            seconds = time.perf_counter() - started
            proc.returncode = os.waitstatus_to_exitcode(status)
        load_after = os.getloadavg()[0]
    if proc.returncode != 0:
        raise RuntimeError(f"pgcdc catchup failed: {err_path.read_text()[-3000:]}")
    output = out_path.read_text()
    summary, _ = json.JSONDecoder().raw_decode(output, output.index("{"))  # py-spy prints too
    cpu = dict(meter.seconds)
    command = round(usage.ru_utime + usage.ru_stime, 2)
    cpu["command"] = command
    cpu["driver"] = round(cpu["driver"] - command, 2)  # the benchmark itself, its Spark
    ranges = range_events(target, f"dagster_{STORAGE}", timeline)
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "load_1m": [load_before, load_after],
        "follow": summary.get("follow", {}),
        "ranges": summary["ranges_run"],
        "timeline": timeline.summary(seconds),
        "per_range": ranges,
        "verify": harness.replication_equal(settings),
    }


class Timeline:
    """Poll, from a thread, the slot's confirmed position on the source (moved once a range is
    stored) and our origin's progress on the target (moved by each range's apply), every
    :data:`harness.POLL_S`, as native's side is polled; keep each change with its time."""

    def __init__(self, setup: harness.Setup, target: Any) -> None:
        self.setup = setup
        self.target = target
        self.started = time.perf_counter()
        self.stored: list[tuple[float, Lsn]] = []
        self.applied: list[tuple[float, Lsn]] = []
        self.target_wal: list[tuple[float, int, int]] = []
        """(seconds, full-page images, WAL bytes) of the target cluster, each poll."""
        self._stop = threading.Event()

    def __enter__(self) -> Timeline:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        settings = self.setup.settings
        with (
            psycopg.connect(settings.source_dsn, autocommit=True) as src,
            psycopg.connect(self.target.dsn(), autocommit=True) as tgt,
        ):
            while not self._stop.is_set():
                (confirmed,) = src.execute(
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                    "WHERE slot_name = %s",
                    (settings.slot,),
                ).fetchone()  # type: ignore[misc]
                (applied,) = tgt.execute(
                    "SELECT pg_replication_origin_progress(%s, false)::text",
                    (f"pgcdc_{settings.slot}",),
                ).fetchone()  # type: ignore[misc]
                now = time.perf_counter() - self.started
                self.target_wal.append((round(now, 3), *target_wal(tgt)))
                for points, text in ((self.stored, confirmed), (self.applied, applied)):
                    if text is None:
                        continue
                    lsn = Lsn.parse(text)
                    if not points or points[-1][1] != lsn:
                        points.append((round(now, 3), lsn))
                self._stop.wait(harness.POLL_S)

    def when(self, points: list[tuple[float, Lsn]], lsn: Lsn) -> float | None:
        """First time the polled position reached ``lsn``."""
        return next((t for t, at in points if at >= lsn), None)

    def summary(self, seconds: float) -> dict[str, Any]:
        first_stored = self.stored[1][0] if len(self.stored) > 1 else None
        first_applied = self.applied[1][0] if len(self.applied) > 1 else None
        end = self.setup.end
        return {
            "first_stored_s": first_stored,
            "first_applied_s": first_applied,
            "all_stored_s": self.when(self.stored, end),
            "all_applied_s": self.applied[-1][0] if len(self.applied) > 1 else None,
            "exit_s": round(seconds, 3),
            "by_5s": self.by_period(5.0),
        }

    def by_period(self, period_s: float) -> list[dict[str, Any]]:
        """Per ``period_s`` of the run: the source WAL the target applied (MB, by the origin's
        moves), the WAL the target wrote meanwhile (MB) and its full-page images (the first
        change of each page after a checkpoint writes the whole page): where a slow start goes."""
        out: list[dict[str, Any]] = []
        if not self.target_wal:
            return out
        start_fpi, start_bytes = self.target_wal[0][1:]
        begin = self.setup.start
        t = period_s
        while t <= self.target_wal[-1][0] + period_s:
            applied = [lsn for at, lsn in self.applied if at <= t]
            wal = [w for w in self.target_wal if w[0] <= t][-1]
            reached = applied[-1] if applied else begin
            out.append({
                "until_s": t,
                "applied_mb": round(max(0, int(reached) - int(begin)) / 1e6, 1),
                "target_wal_mb": round((wal[2] - start_bytes) / 1e6, 1),
                "target_fpi": wal[1] - start_fpi,
            })  # fmt: skip
            t += period_s
        return out


def target_wal(conn: Any) -> tuple[int, int]:
    """The target cluster's full-page images and WAL bytes written so far (``pg_stat_wal``)."""
    row = conn.execute("SELECT wal_fpi, wal_bytes FROM pg_stat_wal").fetchone()
    return int(row[0]), int(row[1])


def _wal_bytes(key: str) -> int:
    """WAL a range spans, from its partition key."""
    rng = LsnRange.from_partition_key(key)
    return int(rng.end) - int(rng.start)


def range_events(target: Any, storage_db: str, timeline: Timeline) -> list[dict[str, Any]]:
    """Per range, from the run's materialisations in Dagster's storage: ``decoded_changes``
    (the receive) and one target table's (the apply's staging and statement seconds)."""
    from dagster._serdes import deserialize_value

    with psycopg.connect(target.dsn(storage_db)) as conn:
        rows = conn.execute(
            "SELECT event FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION' "
            "ORDER BY id"
        ).fetchall()
    ranges: dict[str, dict[str, Any]] = {}
    for (event,) in rows:
        entry: Any = deserialize_value(event)
        mat = entry.dagster_event.event_specific_data.materialization
        meta = {k: getattr(v, "value", v) for k, v in mat.metadata.items()}
        row = ranges.setdefault(mat.partition, {"range": mat.partition})
        if mat.asset_key.path == ["decoded_changes"]:
            row.update(
                wal_mb=round(_wal_bytes(mat.partition) / 1e6, 1),
                stored_mb=round(meta["bytes"] / 1e6, 1),
                transactions=meta["transactions"],
                changes=meta["changes"],
                receive_s=round(meta["seconds"], 3),
                endpos=meta["endpos"],
            )
        elif "apply_seconds" in meta and "apply_s" not in row:
            row.update(staging_s=round(meta["staging_seconds"], 3),
                       apply_s=round(meta["apply_seconds"], 3),
                       replay_lsn=meta["replay_lsn"])  # fmt: skip
    out = []
    for row in ranges.values():
        if "endpos" in row:
            end = Lsn.parse(row["endpos"])
            row["stored_at_s"] = timeline.when(timeline.stored, end)
        if row.get("replay_lsn", "none") != "none":
            row["applied_at_s"] = timeline.when(timeline.applied, Lsn.parse(row["replay_lsn"]))
        out.append(row)
    return sorted(out, key=lambda r: Lsn.parse(r["endpos"]) if "endpos" in r else Lsn(0))


def one_run(args: argparse.Namespace, spark: Any, index: int) -> dict[str, Any]:
    with harness.bench_clusters(args.profile, extra=harness.QUIET) as (work, source, target):
        args.range_mb = 256
        setup = harness.prepare(source, target, spark, work / "store", args)
        meter = harness.CpuMeter.of(source, target)

        def native() -> dict[str, Any]:
            before = os.getloadavg()[0]
            with psycopg.connect(target.dsn(), autocommit=True) as tgt:
                wal_before = target_wal(tgt)
                result = harness.native_catch_up(setup, source, target, meter, args.native_timeout)
                wal_after = target_wal(tgt)
            result["load_1m"] = [before, os.getloadavg()[0]]
            result["target_fpi"] = wal_after[0] - wal_before[0]
            result["target_wal_mb"] = round((wal_after[1] - wal_before[1]) / 1e6, 1)
            return result

        if index < 0:  # the profiled run: ours alone
            warm = args.server == "warm"
            ours = run_ours_cli(setup, source, target, work, meter, warm, args.py_spy)
            return {"profiled": str(args.py_spy), "ours_s": round(ours["seconds"], 3),
                    "ours": ours}  # fmt: skip
        order, results = harness.alternating(
            {
                "ours": lambda: run_ours_cli(
                    setup, source, target, work, meter, args.server == "warm"
                ),
                "native": native,
            },
            index,
        )
    ours, native_result = results["ours"], results["native"]
    follow = ours["follow"]
    return {
        "order": order,
        "transactions": 4 * args.transactions,
        "wal_mb": round((setup.end - setup.start) / 1e6, 1),
        "ours_s": round(ours["seconds"], 3),
        "native_s": round(native_result["seconds"], 3),
        "native_applied_s": round(native_result["applied_s"], 3),
        "ratio": round(native_result["seconds"] / ours["seconds"], 3),
        "ours_cpu_s": ours["cpu_s"],
        "native_cpu_s": native_result["cpu_s"],
        "ours_load_1m": ours["load_1m"],
        "native_load_1m": native_result["load_1m"],
        "ours_ranges": ours["ranges"],
        "follow": follow,
        "timeline": ours["timeline"],
        "per_range": ours["per_range"],
        "ours_target_fpi": ours["timeline"]["by_5s"][-1]["target_fpi"],
        "ours_target_wal_mb": ours["timeline"]["by_5s"][-1]["target_wal_mb"],
        "native_target_fpi": native_result["target_fpi"],
        "native_target_wal_mb": native_result["target_wal_mb"],
        "ours_equal": ours["verify"]["equal"],
        "native_equal": native_result["verify"]["equal"],
    }


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over the runs."""

    def med(*path: str) -> float | None:
        return harness.rounded(harness.median_at(runs, *path))

    out: dict[str, Any] = {key: med(key) for key in ("ours_s", "native_s", "ratio")}
    for side in ("ours", "native"):
        keys = sorted({k for r in runs for k in r[f"{side}_cpu_s"]})
        out[f"{side}_cpu_s"] = {k: med(f"{side}_cpu_s", k) for k in keys}
    for key in ("seconds", "receive_busy_s", "apply_busy_s", "overlap_s", "receive_cpu_s",
                "apply_cpu_s", "ranges"):  # fmt: skip
        out[f"follow_{key}"] = med("follow", key)
    for key in ("first_stored_s", "first_applied_s", "all_stored_s", "all_applied_s"):
        out[key] = med("timeline", key)
    return out


def main() -> None:
    parser = harness.argument_parser(
        __doc__,
        repeat=1,
        json=True,
        server="",
    )
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--transactions", type=int, default=20_000, help="per client (4)")
    parser.add_argument(
        "--workload",
        choices=harness.WORKLOADS,
        default="tpcb",
        help="tpcb: pgbench's TPC-B-like transactions (3 updates, 1 insert); insert-log: 4 rows "
        "inserted into pgbench_history per transaction (no key)",
    )
    parser.add_argument("--native-timeout", type=float, default=600)
    parser.add_argument(
        "--py-spy",
        type=Path,
        help="after the timed runs, one more run of ours alone under py-spy (raw stacks here)",
    )
    args = parser.parse_args()
    spark = get_spark()  # for the untimed snapshot; the timed command starts its own
    runs = harness.run_repeats(lambda i: one_run(args, spark, i), args.repeat)
    profiled = one_run(args, spark, -1) if args.py_spy else None
    report = harness.summary(
        args,
        runs,
        {"median_ratio": "ratio"},
        command="pgcdc catchup --endpos L1 (fresh process, PostgreSQL-backed Dagster)",
        command_server=args.server,
        transactions=4 * args.transactions,
        workload=args.workload,
        medians=medians(runs),
    )
    harness.emit_report({**report, "profiled": profiled}, args.json)


if __name__ == "__main__":
    main()
