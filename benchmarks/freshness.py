"""Freshness under steady load: source commit to visible on the target, with ``pgcdc follow``.

Set-up, on fresh clusters (the demo's: a source with logical WAL, a target, and a third
cluster for Dagster's PostgreSQL storage, with the shipped ``dagster.yaml``; ``--profile``,
production by default): the demo's
sample data (pgbench scale 1 and the extra tables), ``pgcdc snapshot``, then ``pgcdc follow``
started as a fresh process: one Dagster run that receives and applies continuously.

Load: ``pgbench -b simple-update`` (one UPDATE, one SELECT, one INSERT per transaction) rate
limited to ``--tps`` for ``--seconds``. Meanwhile a probe row is committed on the source every
``--probe-interval`` seconds (its own connection, synchronous commit) and the target is polled
every 20 ms for it: the probe's freshness is the time from its commit returning to the poll
that first sees it. The first probes are sent once the follow run holds the range lock (its
start-up is reported separately, not counted as freshness).

The peer, in the same run (unless ``--no-native``): once ours is stopped and verified, a
``CREATE SUBSCRIPTION`` of PostgreSQL's native logical replication to the same publication,
into a second database on the target cluster (schema from ``pg_dump --schema-only``, initial
sync waited out), under the same load and probes, polled there.

Reported for each: freshness median, p95 and max; the pgbench rate achieved; the CPU seconds
spent during the load window by the source cluster, the target cluster, the follow process
(with its follower) and Dagster's storage cluster (ours only), and this process (the prober and
pgbench, the same load for both); for ours the follow run's totals (ranges, receive and apply
busy time); each target verified equal to the source (ours after a final ``pgcdc catchup``).

With ``--storage-outage S``, Dagster's storage cluster is stopped for ``S`` seconds in the
middle of our load (a restart, a failover of the server holding Dagster's records): the
freshness of the probes that arrived while it was away is reported apart
(``storage_away_*``), and the follow's totals count the outage.

With ``--side-rows N``, half the load's transactions insert N rows each into a table that no
publication holds (a busy source of which little is replicated). With ``--big-insert N``, one
transaction inserts N rows into a table that no publication holds
just before each load starts (for ours and for native alike).

``PGCDC_FOLLOW_READ=peek`` measures the follow's peek loop instead of its stream.

The clusters, the follow, the native peer, the CPU meter and the comparison are
``benchmarks/harness.py``'s.

Usage: ``.venv/bin/python benchmarks/freshness.py [--tps 1000] [--seconds 40] [--no-native]
[--storage-outage 15] [--big-insert 1000000] [--profile production|throwaway]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from pgcdc_dagster.demo.local_cluster import find_bindir
from pgcdc_dagster.demo.run import (
    Measurements,
    demo_environment,
    load_sample_data,
    probe_freshness,
)
from pgcdc_dagster.engine.connect import libpq_tool_environment
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.lsn import Lsn, LsnRange
from pgcdc_dagster.engine.settings import ReplicationSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness

NATIVE_DB = "native"
NATIVE_SUBSCRIPTION = "fresh_native"
BUSY_ROWS = 100


def create_busy_tables(dsn: str, count: int) -> None:
    """``count`` tables of :data:`BUSY_ROWS` rows, and ``bench_busy(t, k)``, which updates row
    ``k`` of table ``t`` (what ``--busy-tables`` writes: a range then changes many tables)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for n in range(count):
            table = sql.Identifier(f"busy_{n:03d}")
            conn.execute(sql.SQL("CREATE TABLE {} (id int PRIMARY KEY, v int)").format(table))
            conn.execute(
                sql.SQL("INSERT INTO {} SELECT g, 0 FROM generate_series(1, %s) g").format(table),
                (BUSY_ROWS,),
            )
        conn.execute(
            "CREATE FUNCTION bench_busy(t int, k int) RETURNS void LANGUAGE plpgsql AS $$ "
            "BEGIN EXECUTE format('UPDATE busy_%s SET v = v + 1 WHERE id = $1', "
            "lpad(t::text, 3, '0')) USING k; END $$"
        )


def freshness_figures(seconds: list[float], prefix: str = "freshness") -> dict[str, Any]:
    fresh = sorted(seconds)
    if not fresh:
        return {f"{prefix}_probes": 0}
    return {
        f"{prefix}_median_s": round(harness.median(fresh), 3),  # type: ignore[arg-type]
        f"{prefix}_p95_s": round(fresh[min(len(fresh) - 1, int(0.95 * len(fresh)))], 3),
        f"{prefix}_max_s": round(fresh[-1], 3),
    }


def storage_outage(
    cluster: Any, args: argparse.Namespace, measured: Measurements, out: dict[str, Any]
) -> None:
    """Stop Dagster's storage cluster for ``--storage-outage`` seconds in the middle of the
    load, and note which probes arrived while it was away."""
    time.sleep(max(0.0, (args.seconds - args.storage_outage) / 2))
    first = len(measured.freshness_s)
    cluster.stop()
    time.sleep(args.storage_outage)
    cluster.start()
    out["storage_outage_probes"] = (first, len(measured.freshness_s))


def load_window(
    args: argparse.Namespace,
    source_dsn: str,
    target_dsn: str,
    meter: harness.CpuMeter,
    storage: Any = None,
) -> dict[str, Any]:
    """The load, with a probe every ``--probe-interval`` polled on ``target_dsn``, inside
    ``meter``; its freshness figures, pgbench's rate and the CPU seconds. With ``storage``
    (Dagster's storage cluster) and ``--storage-outage``: that cluster stopped meanwhile, and
    the freshness of the probes that arrived while it was away reported apart."""
    if args.big_insert:
        # A big transaction into a table no publication holds, just before the load (a batch
        # job beside the replicated tables): a reader that decodes again from the slot's
        # restart point pays for it until the next running-xacts record moves that point.
        with psycopg.connect(source_dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS bulk_unpublished (id int, v text)")
            conn.execute(
                "INSERT INTO bulk_unpublished SELECT g, 'bulk' FROM generate_series(1, %s) g",
                (args.big_insert,),
            )
    measured = Measurements()
    outage: dict[str, Any] = {}
    outages = None
    if storage is not None and args.storage_outage:
        outages = threading.Thread(target=storage_outage, args=(storage, args, measured, outage))
    writing, never = threading.Event(), threading.Event()
    writing.set()
    prober = threading.Thread(
        target=probe_freshness,
        args=(source_dsn, target_dsn, writing, never, measured),
        kwargs={"interval_s": args.probe_interval, "poll_s": 0.02},
    )
    tool_env, extra = libpq_tool_environment(source_dsn)
    scripts = ["-b", "simple-update"]
    if args.busy_tables:  # half the transactions update one row of a random busy table
        busy = Path(tempfile.mkdtemp(prefix="pgcdc-busy-")) / "busy.sql"
        busy.write_text(
            f"\\set t random(0, {args.busy_tables - 1})\n\\set k random(1, {BUSY_ROWS})\n"
            "SELECT bench_busy(:t, :k);\n"
        )
        scripts = ["-b", "simple-update@1", "-f", f"{busy}@1"]
    if args.side_rows:  # half the transactions insert into a table no publication holds
        with psycopg.connect(source_dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS side_unpublished (id int, v text)")
        side = Path(tempfile.mkdtemp(prefix="pgcdc-side-")) / "side.sql"
        side.write_text(
            "INSERT INTO side_unpublished "
            f"SELECT g, 'side' FROM generate_series(1, {args.side_rows}) g;\n"
        )
        scripts = [*scripts, "-f", f"{side}@1"]  # a script without a weight weighs 1
    command = [
        str(find_bindir() / "pgbench"),
        *("-n", *scripts, "-c", "4", "-j", "2"),
        *("-R", str(args.tps), "-T", str(args.seconds)),
        *extra,
    ]
    with meter:
        prober.start()
        if outages is not None:
            outages.start()
        bench = subprocess.run(
            command, env={**os.environ, **tool_env}, capture_output=True, text=True, check=True
        )
        writing.clear()
        prober.join(timeout=60)
        if outages is not None:
            outages.join()
    cpu = dict(meter.seconds)  # a follow started by this process: its tree apart from ours
    found = re.findall(r"tps = ([0-9.]+)", bench.stdout)
    report = {
        "pgbench_tps": float(found[-1]) if found else None,
        "probes": len(measured.freshness_s),
        **freshness_figures(measured.freshness_s),
        "cpu_s": cpu,
    }
    if args.big_insert:  # how long the big transaction weighs: every probe, in order
        report["freshness_by_probe_s"] = [round(f, 3) for f in measured.freshness_s]
    if "storage_outage_probes" in outage:
        first, last = outage["storage_outage_probes"]
        report["storage_outage_s"] = args.storage_outage
        report["storage_outage_probes"] = last - first
        report.update(freshness_figures(measured.freshness_s[first:last], "storage_away"))
    return report


def setup_native(settings: ReplicationSettings, clusters: Any) -> harness.Subscription:
    """A native subscription to pgcdc's publication in database ``native`` of the target
    cluster, its initial sync waited out."""
    native, _ = harness.native_peer(
        settings.source_dsn,
        clusters.target,
        NATIVE_DB,
        settings.publication,
        name=NATIVE_SUBSCRIPTION,
        timeout=300,
    )
    return native


def run_native(
    args: argparse.Namespace, clusters: Any, settings: ReplicationSettings
) -> dict[str, Any]:
    """The same load and probes with native logical replication (see the module docstring)."""
    harness.execute(settings.source_dsn, "DELETE FROM demo_probe")  # the probes count from 1
    native = setup_native(settings, clusters)
    meter = harness.CpuMeter.of(clusters.source, clusters.target)
    report = load_window(args, settings.source_dsn, native.target_dsn, meter)
    end = harness.wal_position(settings.source_dsn, of="flush")
    with contextlib.suppress(TimeoutError):  # compared all the same: a lag shows there
        native.wait_confirmed(end, timeout=120)
    native.drop()
    report["equal"] = harness.replication_equal(settings, native.target_dsn)["equal"]
    return report


def follow_rss_mb(root: int) -> dict[str, float]:
    """Resident memory of the follow command (``command``: in a cold command, the Dagster run
    too) and of its descendants (``follower``: the follow process it forked), in MB."""
    parts = harness.tree_rss_mb(root)
    command = parts.pop("command")
    return {"command": command, "follower": round(float(sum(parts.values())), 1)}


def recorded_events(storage_url: str) -> dict[str, int]:
    """What the follow run recorded in Dagster's storage: its ranges, those that recorded only
    the tables they changed because the run's events trailed the apply (the default
    ``PGCDC_FOLLOW_TABLE_EVENTS=all``; see ``defs/following.py``), and target-table
    materialisations."""
    with psycopg.connect(storage_url.replace("+psycopg2", "")) as conn:
        row = conn.execute(
            "SELECT count(*) FILTER (WHERE asset_key = '[\"decoded_changes\"]'), "
            "count(*) FILTER (WHERE asset_key = '[\"decoded_changes\"]' "
            "AND event LIKE '%trailed the apply%'), "
            "count(*) FILTER (WHERE asset_key LIKE '[\"target\"%') "
            "FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION' "
            "AND partition IS NOT NULL"
        ).fetchone()
    assert row is not None
    ranges, trailing, tables = row
    return {"ranges": ranges, "ranges_changed_tables_only": trailing, "table_events": tables}


def store_earlier_ranges(settings: ReplicationSettings, count: int) -> dict[str, Any]:
    """Write ``count`` ranges of an earlier chain into the store, stored now (so the retention
    keeps them), spread evenly below the current chain's consistent point, each a manifest
    alone, in the layout of the code under test: the folders a store that ran for a while
    holds, for the paths that look at them."""
    if not count:
        return {}
    from pgcdc_dagster.engine.store.output_store import MANIFEST, OutputStore

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the tests' store helpers
    from pgcdc_dagster_tests.support.stores import range_manifest

    store = OutputStore(settings.store)
    point = store.consistent_point()
    step = max(1, (int(point) - 0x100) // count)
    began = time.monotonic()
    for i in range(count):
        start, end = Lsn(0x100 + i * step), Lsn(0x100 + (i + 1) * step)
        folder = store.range_path(LsnRange(start, end))
        folder.mkdir(parents=True)
        manifest = range_manifest(str(start), str(end), str(Lsn(int(end) - 1)))
        (folder / MANIFEST).write_text(manifest.to_json())
    return {"count": count, "step": step, "write_s": round(time.monotonic() - began, 1)}


def main() -> None:
    parser = harness.argument_parser(__doc__, json=True)
    parser.add_argument("--tps", type=int, default=1000)
    parser.add_argument("--seconds", type=int, default=40)
    parser.add_argument("--probe-interval", type=float, default=0.5)
    parser.add_argument(
        "--no-native", action="store_true", help="skip the native logical replication run"
    )
    parser.add_argument(
        "--extra-tables",
        type=int,
        default=0,
        help="that many more (idle) published tables: each is an asset every range records",
    )
    parser.add_argument(
        "--busy-tables",
        type=int,
        default=0,
        help="that many more published tables, half the load updating a random one of them: "
        "a range then changes many tables, and records an event for each",
    )
    parser.add_argument(
        "--stored-ranges",
        type=int,
        default=0,
        help="that many ranges of an earlier chain in the store before the follow starts (a "
        "store that has run for a while; 432,000 are a day of a follow at 5 ranges a second)",
    )
    parser.add_argument(
        "--side-rows",
        type=int,
        default=0,
        help="half the load's transactions insert that many rows into an unpublished table",
    )
    parser.add_argument(
        "--big-insert",
        type=int,
        default=0,
        help="rows of one INSERT into an unpublished table just before each load starts",
    )
    parser.add_argument(
        "--storage-outage",
        type=float,
        default=0.0,
        help="stop Dagster's storage cluster for that many seconds in the middle of the load",
    )
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="pgcdc-fresh-"))
    clusters = harness.demo_clusters(base, args.profile)
    follow: subprocess.Popen[str] | None = None
    try:
        env = {
            **os.environ,
            **demo_environment(base, clusters),
            "PGCDC_MODE": "follow",
            "PGCDC_SERVER": "off",  # steady state is measured; start-up is reported apart
        }
        os.environ.update(env)
        load_sample_data(clusters.source)
        if args.extra_tables:
            with psycopg.connect(clusters.source.dsn(), autocommit=True) as conn:
                for n in range(args.extra_tables):
                    conn.execute(f"CREATE TABLE extra_{n:03d} (id int PRIMARY KEY, v text)")
        if args.busy_tables:
            create_busy_tables(clusters.source.dsn(), args.busy_tables)
        settings = ReplicationSettings.from_env()
        harness.timed_command(env, base, "snapshot")
        prefilled = store_earlier_ranges(settings, args.stored_ranges)
        follow, startup_s = harness.start_follow(
            env, base, settings.target_dsn, settings.slot, "--json", new_session=True
        )

        meter = harness.CpuMeter.of(clusters.source, clusters.target, follow=follow.pid)
        if not args.storage_outage:  # a restarted storage is another process tree
            meter.roots["dagster_storage"] = harness.postmaster_pid(clusters.storage)
        sampled: list[dict[str, float]] = []
        sampling = threading.Event()

        def sample_rss(pid: int) -> None:  # every 10 s of the load: how memory grows
            while not sampling.wait(10.0 if sampled else 0.0):
                sampled.append(follow_rss_mb(pid))

        sampler = threading.Thread(target=sample_rss, args=(follow.pid,), daemon=True)
        sampler.start()
        ours = load_window(
            args, settings.source_dsn, settings.target_dsn, meter, storage=clusters.storage
        )
        sampling.set()
        sampler.join()
        ours["rss_mb"] = [*sampled, follow_rss_mb(follow.pid)]

        follow.send_signal(signal.SIGTERM)
        stopping = time.monotonic()
        out, ferr = follow.communicate(timeout=600)
        ours["stop_s"] = round(time.monotonic() - stopping, 2)  # SIGTERM to the command's exit
        if follow.returncode != 0:
            raise RuntimeError(f"pgcdc follow exited {follow.returncode}: {ferr[-2000:]}")
        totals = json.loads(out).get("follow", {})
        ours["stderr"] = {  # what the user's terminal got: one line when the storage went away
            "lines": len(ferr.splitlines()),  # and one when it came back, ours a try apart
            "dagster_log_write_errors": ferr.count("Exception while writing logger call"),
        }
        follow = None
        harness.timed_command(env, base, "catchup")
        ours["equal"] = harness.replication_equal(settings)["equal"]
        ours["follow_startup_s"] = round(startup_s, 2)
        ours["follow"] = totals
        ours["recorded"] = recorded_events(env["DAGSTER_POSTGRES_URL"])
        store = pipeline.store_of(settings)
        chain = store.chain()
        ours["store"] = {  # what the retention (PGCDC_STORE_RETENTION) left
            "ranges": len(store.ranges()),
            "earlier_ranges": prefilled,
            "pruned_through": str(chain.pruned_through) if chain and chain.pruned_through else None,
        }
        report: dict[str, Any] = {
            "load": f"pgbench simple-update, {args.tps} tps target, {args.seconds} s",
            "cluster_profile": harness.describe_profile(args.profile),
            "ours": ours,
        }
        if not args.no_native:
            report["native"] = run_native(args, clusters, settings)
        harness.emit_report(report, args.json)
    finally:
        if follow is not None and follow.poll() is None:
            os.killpg(follow.pid, signal.SIGKILL)
        clusters.stop()
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
