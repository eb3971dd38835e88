"""One big transaction while ``pgcdc follow`` runs, beside a native subscription.

Set-up, on fresh clusters for every run (the demo's: a source with logical WAL, a target, and
a third cluster for Dagster's storage, with the demo's environment; ``--profile``,
production by default): the source
holds two tables only, so the publication (``PGCDC_TABLES`` unset: every user table) carries
exactly them, and the product's defaults (the demo's Spark thresholds, scaled to its small
data, are left out): ``big (id bigint PRIMARY KEY, v int, pad text)`` of 200,000 rows and
``probe (id int PRIMARY KEY, at timestamptz)``. Then ``pgcdc snapshot``; a native
subscription to the same publication into a database ``native`` on the target cluster
(schema from ``pg_dump --schema-only``, initial sync waited out); then ``pgcdc follow
--json`` started as a fresh process (``PGCDC_SERVER=off``), waited for until it holds the
range lock and a warm-up probe row is visible on both targets, and its process tree's memory
has settled.

The transaction, in one source connection: ``INSERT`` of ``--rows`` new rows into ``big``,
``UPDATE`` of its 200,000 first rows, ``COMMIT`` (each statement timed). Right after, a probe
row is committed (autocommit) and both targets are polled for it every 20 ms, each from its
own thread: the time from the probe's insert returning to the poll that first sees it is the
freshness of each (up to 900 s). Both replicate the same transaction at the same time.

Meanwhile the resident memory of the follow's process tree (the ``pgcdc follow`` command and
all its descendants: the follower process, a local Spark JVM and its Python workers) is
sampled every 0.2 s: its value just before the transaction and its peak are reported, also by
process name (``command``, then the descendants' ``/proc/<pid>/comm``: ``pgcdc`` for the
follower, ``java``, ``python``). Also: CPU seconds of the source, the target, the follow tree
and this process from the transaction's start to both probes seen; the follow's ``--json``
totals after SIGTERM, and per non-empty range what Dagster's event log says (changes, receive
seconds, who staged the net rows: ``driver`` is the in-process Arrow compaction, ``spark
executors`` the Spark path, staging and apply seconds); and both targets compared with the
source (row count and a content hash of ``big`` and of ``probe``). The clusters, the follow,
the native peer, the CPU meter, the comparison and the medians are ``benchmarks/harness.py``'s.

``--memory-limit-mb M`` sets ``PGCDC_MEMORY_LIMIT=<M>MB`` for the follow (ignored by code that
does not know it). ``--set KEY=VALUE`` (repeatable) overrides any variable of the follow's
environment, e.g. ``--set PGCDC_SPARK_MIN_CHANGES=100000000`` keeps the range in process.

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/big_transaction.py
[--rows 3000000] [--runs 1] [--no-native] [--memory-limit-mb 1024] [--json out.json]
[--profile production|throwaway]``
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

import pgcdc_dagster
from pgcdc_dagster.demo.run import SPARK_DEMO_ENV, demo_environment
from pgcdc_dagster.engine.settings import ReplicationSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

BASE_ROWS = 200_000
PAD = 40
WARMUP_PROBE, PROBE = 0, 1
POLL_S = 0.02
SAMPLE_S = 0.2
TIMELINE_S = 2.0
"""The report's memory timeline keeps one sample every this many seconds."""
PROBE_TIMEOUT_S = 900.0
TABLES = ("public.big", "public.probe")

SCHEMA = f"""
CREATE TABLE big (id bigint PRIMARY KEY, v int NOT NULL, pad text);
INSERT INTO big SELECT g, 0, repeat('x', {PAD}) FROM generate_series(1, {BASE_ROWS}) g;
CREATE TABLE probe (id int PRIMARY KEY, at timestamptz DEFAULT now());
ANALYZE big;
"""


def wait_probe(
    conn: psycopg.Connection[Any],
    probe: int,
    since: float,
    timeout_s: float,
    alive: Callable[[], bool] | None = None,
) -> float | str:
    """Seconds from ``since`` (monotonic) to the poll that first sees probe row ``probe`` on
    ``conn``'s database, polled every :data:`POLL_S`; or why it was not seen."""
    while True:
        if conn.execute("SELECT 1 FROM probe WHERE id = %s", (probe,)).fetchone():
            return round(time.monotonic() - since, 3)
        if alive is not None and not alive():
            return "pgcdc follow exited"
        if time.monotonic() - since > timeout_s:
            return f"not seen within {timeout_s:.0f} s"
        time.sleep(POLL_S)


def insert_probe(source_dsn: str, probe: int) -> float:
    """Commit probe row ``probe`` on the source; the monotonic time its insert returned."""
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO probe (id) VALUES (%s)", (probe,))
        return time.monotonic()


def total(parts: dict[str, float]) -> float:
    return round(sum(parts.values()), 1)


class RssSampler:
    """The follow tree's RSS every :data:`SAMPLE_S` seconds on a thread of its own."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, dict[str, float]]] = []  # (monotonic, by process)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            self.samples.append((time.monotonic(), harness.tree_rss_mb(self.pid)))
            self.stop.wait(SAMPLE_S)

    def since(self, start: float) -> list[tuple[float, dict[str, float]]]:
        return [s for s in self.samples if s[0] >= start]

    def settle(self, within_mb: float = 10.0, over_s: float = 3.0, limit_s: float = 60.0) -> None:
        """Wait until the tree's total RSS moved less than ``within_mb`` over ``over_s``."""
        began = time.monotonic()
        while time.monotonic() - began < limit_s:
            time.sleep(0.5)
            recent = [total(s[1]) for s in self.since(time.monotonic() - over_s)]
            if len(recent) >= over_s / SAMPLE_S - 2 and max(recent) - min(recent) < within_mb:
                return


def range_events(storage_url: str) -> list[dict[str, Any]]:
    """Per range with changes, what the follow run recorded in Dagster's storage: the
    ``decoded_changes`` partition (changes, transactions, bytes, receive seconds) and the
    ``target/public/big`` one (who staged the net rows, staging and apply seconds)."""
    from dagster import deserialize_value

    wanted = {'["decoded_changes"]': "received", '["target", "public", "big"]': "applied"}
    by_range: dict[str, dict[str, Any]] = {}
    with psycopg.connect(storage_url.replace("+psycopg2", "")) as conn:
        rows = conn.execute(
            "SELECT asset_key, partition, event FROM event_logs "
            "WHERE dagster_event_type = 'ASSET_MATERIALIZATION' AND asset_key = ANY(%s) "
            "ORDER BY id",
            (list(wanted),),
        ).fetchall()
    for asset_key, partition, event in rows:
        entry: Any = deserialize_value(event)
        metadata = entry.dagster_event.step_materialization_data.materialization.metadata
        values = {k: getattr(v, "value", v) for k, v in metadata.items()}
        by_range.setdefault(partition, {"range": partition})[wanted[asset_key]] = values
    out = []
    for partition, seen in by_range.items():
        received, applied = seen.get("received", {}), seen.get("applied", {})
        if not received.get("changes") and not applied.get("table_changes"):
            continue
        out.append(
            {
                "range": partition,
                "transactions": received.get("transactions"),
                "changes": received.get("changes"),
                "parquet_bytes": received.get("bytes"),
                "receive_s": received.get("seconds"),
                "deferred_transactions": received.get("deferred_transactions"),
                "big_changes": applied.get("table_changes"),
                "staged_by": applied.get("staged_by"),
                "staging_s": applied.get("staging_seconds"),
                "apply_s": applied.get("apply_seconds"),
                "spark_tasks": applied.get("spark_tasks"),
            }
        )
    return out


def big_transaction(source_dsn: str, rows: int) -> dict[str, float]:
    """The transaction: insert ``rows`` rows, update the first :data:`BASE_ROWS`, commit."""
    timed: dict[str, float] = {}
    with psycopg.connect(source_dsn) as conn:
        began = time.perf_counter()
        conn.execute(
            "INSERT INTO big SELECT g, 0, repeat('x', %s) FROM generate_series(%s, %s) g",
            (PAD, BASE_ROWS + 1, BASE_ROWS + rows),
        )
        inserted = time.perf_counter()
        conn.execute("UPDATE big SET v = v + 1 WHERE id <= %s", (BASE_ROWS,))
        updated = time.perf_counter()
        conn.commit()
        committed = time.perf_counter()
    timed["insert_s"] = round(inserted - began, 3)
    timed["update_s"] = round(updated - inserted, 3)
    timed["commit_s"] = round(committed - updated, 4)
    timed["transaction_s"] = round(committed - began, 3)
    return timed


def one_run(args: argparse.Namespace, overrides: dict[str, str]) -> dict[str, Any]:
    run_began = time.monotonic()
    base = Path(tempfile.mkdtemp(prefix="pgcdc-bigtx-"))
    clusters = harness.demo_clusters(base, args.profile)
    follow: subprocess.Popen[str] | None = None
    report: dict[str, Any] = {"rows_inserted": args.rows, "rows_updated": BASE_ROWS}
    try:
        env = {
            **os.environ,
            **demo_environment(base, clusters),
            "PGCDC_MODE": "follow",
            "PGCDC_SERVER": "off",
        }
        env.pop("PGCDC_TABLES", None)  # every user table of the source: big and probe
        # The product's defaults, not the demo's thresholds scaled to its small data (which
        # send a 50,000-change range to a local Spark).
        for demo_only in (*SPARK_DEMO_ENV, "PGCDC_RANGE_MAX_BYTES"):
            env.pop(demo_only, None)
        if args.memory_limit_mb is not None:
            env["PGCDC_MEMORY_LIMIT"] = f"{args.memory_limit_mb}MB"
        env.update(overrides)
        os.environ.update(env)
        settings = ReplicationSettings.from_env(env)
        report["settings"] = {
            k: v
            for k, v in env.items()
            if k.startswith("PGCDC_") and not k.endswith("_DSN") and k != "PGCDC_STORE"
        }
        with psycopg.connect(settings.source_dsn, autocommit=True) as conn:
            conn.execute(SCHEMA)

        report["snapshot_s"] = round(harness.timed_command(env, base, "snapshot"), 2)
        native_dsn = None
        if not args.no_native:
            began = time.monotonic()
            native, _ = harness.native_peer(
                settings.source_dsn,
                clusters.target,
                "native",
                settings.publication,
                name="fresh_native",
                timeout=300,
            )
            native_dsn = native.target_dsn
            report["native_initial_sync_s"] = round(time.monotonic() - began, 2)

        follow, startup_s = harness.start_follow(
            env,
            base,
            settings.target_dsn,
            settings.slot,
            "--json",
            log_dir=base,
            new_session=True,
        )
        report["follow_startup_s"] = round(startup_s, 2)
        sampler = RssSampler(follow.pid)
        sampler.thread.start()
        alive = follow.poll
        targets = {"pgcdc": settings.target_dsn}
        if native_dsn is not None:
            targets["native"] = native_dsn
        pollers = {name: psycopg.connect(dsn, autocommit=True) for name, dsn in targets.items()}
        try:
            # Warm-up: both targets apply a probe before the transaction; then memory settles.
            since = insert_probe(settings.source_dsn, WARMUP_PROBE)
            for name, conn in pollers.items():
                seen = wait_probe(
                    conn,
                    WARMUP_PROBE,
                    since,
                    120,
                    (lambda: alive() is None) if name == "pgcdc" else None,
                )
                report[f"warmup_probe_{name}_s"] = seen
                if isinstance(seen, str):
                    raise RuntimeError(
                        f"warm-up probe on {name}: {seen}: {harness.tail(base / 'follow.err')}"
                    )
            sampler.settle()
            before = harness.tree_rss_mb(follow.pid)
            report["rss_before_mb"] = total(before)
            report["rss_before_parts_mb"] = before

            meter = harness.CpuMeter.of(clusters.source, clusters.target, follow=follow.pid)
            seen_s: dict[str, float | str] = {}
            with meter:
                tx_began = time.monotonic()
                report["source"] = big_transaction(settings.source_dsn, args.rows)
                committed = time.monotonic()
                since = insert_probe(settings.source_dsn, PROBE)
                report["probe_after_commit_s"] = round(since - committed, 3)

                def poll(name: str) -> None:
                    check = (lambda: alive() is None) if name == "pgcdc" else None
                    seen_s[name] = wait_probe(pollers[name], PROBE, since, PROBE_TIMEOUT_S, check)

                threads = [threading.Thread(target=poll, args=(name,)) for name in pollers]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            report["cpu_s"] = meter.seconds  # the follow's tree apart from this process's
        finally:
            for conn in pollers.values():
                conn.close()
        for name in targets:
            report[f"probe_visible_{name}_s"] = seen_s.get(name)
        after = harness.tree_rss_mb(follow.pid)
        sampler.stop.set()
        sampler.thread.join()
        window = sampler.since(tx_began)
        if window:
            peak = max(window, key=lambda s: total(s[1]))
            report["rss_peak_mb"] = total(peak[1])
            report["rss_peak_parts_mb"] = peak[1]  # the sample of the peak, by process
            report["rss_peak_each_mb"] = {  # each process name's own peak
                name: max(s[1].get(name, 0.0) for s in window)
                for name in sorted({n for s in window for n in s[1]})
            }
            report["rss_peak_at_s"] = round(peak[0] - tx_began, 1)  # from the transaction's start
            report["rss_samples"] = len(window)
            step = max(1, int(TIMELINE_S / SAMPLE_S))
            report["rss_timeline_mb"] = [  # (seconds from the transaction's start, total)
                (round(s[0] - tx_began, 1), total(s[1])) for s in window[::step]
            ]
        report["rss_after_mb"] = total(after)

        follow.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        try:
            follow.wait(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(follow.pid, signal.SIGKILL)
            follow.wait()
        report["follow_stop_s"] = round(time.monotonic() - stopping, 2)
        report["follow_exit"] = follow.returncode
        out = (base / "follow.out").read_text()
        try:
            summary = json.loads(out)
        except json.JSONDecodeError:
            summary = {"unparsed_stdout": out[-2000:]}
        follow = None
        report["follow"] = summary.get("follow", summary)
        report["follow_ranges_run"] = summary.get("ranges_run")
        report["follow_last_range"] = summary.get("last_range")
        report["follow_stderr_tail"] = harness.tail(base / "follow.err").splitlines()
        try:
            report["ranges"] = range_events(env["DAGSTER_POSTGRES_URL"])
        except Exception as exc:  # a report without it is still worth having
            report["ranges"] = f"not read: {exc!r}"

        expected = harness.fingerprints(settings.source_dsn, TABLES)
        report["source_content"] = expected
        for name, dsn in targets.items():
            report[f"equal_{name}"] = harness.equality(expected, dsn)["equal"]
            if not report[f"equal_{name}"]:
                report[f"content_{name}"] = harness.fingerprints(dsn, TABLES)
    finally:
        if follow is not None and follow.poll() is None:
            os.killpg(follow.pid, signal.SIGKILL)
            follow.wait()
        clusters.stop()
        shutil.rmtree(base, ignore_errors=True)
    report["run_wall_s"] = round(time.monotonic() - run_began, 1)
    return report


SUMMARISED = (
    "source.commit_s",
    "source.transaction_s",
    "probe_visible_pgcdc_s",
    "probe_visible_native_s",
    "rss_before_mb",
    "rss_peak_mb",
    "run_wall_s",
)


def headline_medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each headline figure over the runs (those that have it as a number)."""
    out: dict[str, Any] = {}
    for path in SUMMARISED:
        values = [harness.value_at(run, *path.split(".")) for run in runs]
        values = [v for v in values if isinstance(v, int | float)]
        if values:
            out[path] = {"median": round(harness.median(values), 3), "all": values}  # type: ignore[arg-type]
    return out


def main() -> None:
    parser = harness.argument_parser(__doc__, json=True)
    parser.add_argument("--rows", type=int, default=3_000_000, help="rows the transaction inserts")
    parser.add_argument("--runs", type=int, default=1, help="runs, each on fresh clusters")
    parser.add_argument("--no-native", action="store_true", help="no native subscription")
    parser.add_argument(
        "--memory-limit-mb", type=int, help="PGCDC_MEMORY_LIMIT=<M>MB for the follow"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a variable of the follow's environment (repeatable)",
    )
    args = parser.parse_args()
    overrides = dict(item.split("=", 1) for item in args.set)

    runs = harness.run_repeats(lambda _: one_run(args, overrides), args.runs)
    report = harness.summary(
        args,
        runs,
        rows=args.rows,
        native=not args.no_native,
        code=str(Path(pgcdc_dagster.__file__).resolve().parent),
        code_in_subprocess=subprocess.run(
            [sys.executable, "-c", "import pgcdc_dagster; print(pgcdc_dagster.__file__)"],
            capture_output=True,
            text=True,
        ).stdout.strip(),
    )
    report["summary"] = headline_medians(runs)
    harness.emit_report(report, args.json)


if __name__ == "__main__":
    main()
