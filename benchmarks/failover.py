"""How soon the target sees the first change committed on a promoted standby: ``pgcdc follow``
against native logical replication with a failover slot, in the same run, same failover.

Set-up, fresh for every run: a PostgreSQL 18 primary and a physical standby
(:func:`pgcdc_dagster_tests.support.standby.primary_with_standby`: ``synchronized_standby_slots`` on
the primary, slot sync on the standby), restarted with the settings of ``--profile``
(``production`` by default: ``fsync`` and ``full_page_writes`` on, which the throwaway clusters'
defaults turn off); a database ``app`` with ``accounts`` of ``--rows`` rows. Two PostgreSQL 18
targets of the same profile: ``target`` holds our target database, Dagster's storage and
native's database ``native`` (``wal_retrieve_retry_interval`` left at its default, 5 s);
``target_fast`` holds ``native`` only, with ``wal_retrieve_retry_interval = 1s`` (a server
setting, hence a cluster of its own; ``--no-fast-native`` leaves it out).

Every connection goes through the multi-host DSN (``host=primary,standby
target_session_attrs=read-write``): ``pgcdc snapshot`` (its slot a failover slot), then ``pgcdc
follow --json`` as a fresh process (``PGCDC_SERVER=off``), and the native subscriptions
``CREATE SUBSCRIPTION ... PUBLICATION p WITH (failover = true)`` (initial sync waited out; the
harness's subscription has no ``failover`` option, so the statement is this script's). A
writer thread commits ``--rate`` single-row updates a second through the same DSN, riding the
failover (a lost connection is retried every 50 ms). Once every consumer has shown a warm-up
probe row, the standby's copies of the three slots are waited for until ``synced`` and not
``temporary`` (a running-transactions record logged and flushed, which the consumers confirm).

The failover: the primary crashed (``pg_ctl stop -m immediate``), ``--down-seconds`` waited
(default 0: an HA manager that acts at once), the standby promoted (``pg_ctl -w promote``,
then one read-write connection). The clock starts when that returns; a probe row is committed
on the new primary right away and every target is polled for it every 10 ms. The figure is the
time from the promotion to the poll that first sees the probe. Then the writer goes on for 3 s
and stops, and every target must equal the new primary (row count and content hash of
``accounts``, :func:`harness.fingerprints`); the follow must still be running, say it failed
over, and end with exit 0 on SIGTERM (its ``--json`` totals give its outage).

The cluster profiles, the databases, the native subscription's wait, the comparison, the
median and the table are ``benchmarks/harness.py``'s.

Usage: ``.venv/bin/python benchmarks/failover.py [--runs 3] [--rows 100000] [--rate 150]
[--down-seconds 0] [--no-fast-native] [--profile production|throwaway] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the tests' standby helper

import psycopg  # noqa: E402
from psycopg import sql  # noqa: E402

from pgcdc_dagster.demo.local_cluster import (  # noqa: E402
    LOGICAL_SOURCE_SETTINGS,
    LocalCluster,
    origin_room,
    temporary_cluster,
)
from pgcdc_dagster.engine.control.range_lock import lock_holders  # noqa: E402
from pgcdc_dagster_tests.support.standby import Pair, RidingWriter, primary_with_standby  # noqa: E402

sys.path.insert(0, str(REPO / "benchmarks"))
import harness  # noqa: E402

MAJOR = 18
POLL_S = 0.01
PROBE_TIMEOUT_S = 300.0
TABLES = ["public.accounts"]
SCHEMA = "CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL, pad text)"
SLOT = "bench_failover"
WARMUP_PROBE, PROBE = 2_000_000, 3_000_000
OURS, NATIVE, NATIVE_FAST = "ours", "native", "native_1s"


def wait_for(what: str, done: Callable[[], bool], timeout: float, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def target_cluster(name: str, profile: str, extra: dict[str, str]) -> LocalCluster:
    settings = harness.profile_settings(
        profile, {**LOGICAL_SOURCE_SETTINGS, **origin_room(20, MAJOR), **extra}
    )
    return temporary_cluster(settings, prefix=f"pgcdc-bench-{name}-", major=MAJOR)


def updating_writer(dsn: str, rows: int, rate: float) -> RidingWriter:
    """``rate`` single-row updates a second, each its own commit, riding the failover."""
    pick = random.Random(7)

    def update(conn: psycopg.Connection, n: int) -> None:
        conn.execute(
            "UPDATE accounts SET balance = balance + 1 WHERE id = %s", (pick.randint(1, rows),)
        )

    return RidingWriter(dsn, update, rate)


def subscribe(target: LocalCluster, name: str, source_dsn: str) -> harness.Subscription:
    """Database ``native`` on ``target`` with ``accounts``, subscribed to publication ``p``
    with a failover slot ``name`` (:meth:`harness.Subscription.create` has no ``failover``
    option, hence the statement here); :meth:`~harness.Subscription.wait_ready` waits out its
    initial sync."""
    subscription = harness.Subscription(
        source_dsn, harness.create_database(target, "native"), name, "p"
    )
    with psycopg.connect(subscription.target_dsn, autocommit=True) as conn:
        conn.execute(SCHEMA)
        conn.execute(
            sql.SQL(
                "CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {} WITH (failover = true)"
            ).format(
                sql.Identifier(name),
                sql.Literal(source_dsn),
                sql.Identifier(subscription.publication),
            )
        )
    return subscription


def wait_copies_persistent(pair: Pair, slots: list[str], timeout: float = 180.0) -> float:
    """Until the standby holds a ``synced``, non-``temporary`` copy of every slot in ``slots``:
    a running-transactions record logged and flushed on the primary, which the consumers
    confirm past; the seconds it took."""
    began = time.monotonic()
    pending = list(slots)
    while pending:
        with psycopg.connect(pair.primary.dsn(), autocommit=True) as conn:
            conn.execute("SELECT pg_log_standby_snapshot()")
            conn.execute("SELECT pg_logical_emit_message(false, 'bench-failover', '', true)")
        try:
            pair.wait_synced_slot(pending[0], timeout=5)
            pending.pop(0)
        except TimeoutError:
            if time.monotonic() - began > timeout:
                raise
    return time.monotonic() - began


def copy_lag(pair: Pair, slots: list[str]) -> dict[str, int]:
    """Bytes each standby copy's ``confirmed_flush_lsn`` trails the primary's slot."""
    lag: dict[str, int] = {}
    with (
        psycopg.connect(pair.primary.dsn("app")) as primary,
        psycopg.connect(pair.standby.dsn("app")) as standby,
    ):
        for slot in slots:
            query = "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %s"
            (on_primary,) = primary.execute(query, (slot,)).fetchone()  # type: ignore[misc]
            (on_standby,) = standby.execute(query, (slot,)).fetchone()  # type: ignore[misc]
            (diff,) = primary.execute(  # type: ignore[misc]
                "SELECT pg_wal_lsn_diff(%s::pg_lsn, %s::pg_lsn)::bigint",
                (on_primary, on_standby),
            ).fetchone()
            lag[slot] = int(diff)
    return lag


def poll_probe(dsns: dict[str, str], probe: int, since: float) -> dict[str, float | str]:
    """Seconds from ``since`` to the first poll that sees row ``probe`` on each target, all
    polled in turn every :data:`POLL_S`."""
    conns = {name: psycopg.connect(dsn, autocommit=True) for name, dsn in dsns.items()}
    seen: dict[str, float | str] = {}
    try:
        while len(seen) < len(conns):
            for name, conn in conns.items():
                if name in seen:
                    continue
                if conn.execute("SELECT 1 FROM accounts WHERE id = %s", (probe,)).fetchone():
                    seen[name] = round(time.monotonic() - since, 3)
            if time.monotonic() - since > PROBE_TIMEOUT_S:
                for name in conns:
                    seen.setdefault(name, f"not seen in {PROBE_TIMEOUT_S:.0f} s")
            time.sleep(POLL_S)
    finally:
        for conn in conns.values():
            conn.close()
    return seen


def insert_probe(dsn: str, probe: int) -> float:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO accounts VALUES (%s, 0, 'probe')", (probe,))
    return time.monotonic()


def one_run(number: int, args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "run": number,
        "started": datetime.now(UTC).strftime("%H:%M:%S"),
        "cluster_profile": args.profile,
    }
    targets: list[LocalCluster] = []
    follow: subprocess.Popen[str] | None = None
    writer: RidingWriter | None = None
    with (
        primary_with_standby(major=MAJOR) as pair,
        tempfile.TemporaryDirectory(prefix="pgcdc-bench-failover-") as tmp,
    ):
        work = Path(tmp)
        try:
            harness.apply_profile(pair, args.profile)
            with psycopg.connect(pair.primary.dsn(), autocommit=True) as conn:
                conn.execute("CREATE DATABASE app")
            source = pair.multi_host_dsn("app")
            with psycopg.connect(source, autocommit=True) as conn:
                conn.execute(SCHEMA)
                conn.execute(
                    "INSERT INTO accounts SELECT g, 0, repeat('x', 80) "
                    "FROM generate_series(1, %s) g",
                    (args.rows,),
                )
                conn.execute("VACUUM ANALYZE accounts")
                conn.execute("CREATE PUBLICATION p FOR TABLE accounts")
            pair.wait_replayed(timeout=60)

            target = target_cluster("target", args.profile, {})
            targets.append(target)
            if args.fast_native:
                fast = {"wal_retrieve_retry_interval": "1s"}
                targets.append(target_cluster("target-fast", args.profile, fast))
            for cluster in targets:
                cluster.start()
            ours_dsn = harness.create_database(target, "bench_failover")
            harness.create_database(target, "dagster_failover")
            home = work / "dagster_home"
            home.mkdir()
            shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
            env = {
                **os.environ,
                "PGCDC_SOURCE_DSN": source,
                "PGCDC_TARGET_DSN": ours_dsn,
                "PGCDC_SLOT": SLOT,
                "PGCDC_TABLES": "public.accounts",
                "PGCDC_STORE": str(work / "store"),
                "DAGSTER_HOME": str(home),
                "DAGSTER_POSTGRES_URL": (
                    f"postgresql+psycopg2://postgres@127.0.0.1:{target.port}/dagster_failover"
                ),
                "PGCDC_SERVER": "off",
            }
            _, done = harness.run_command(env, work, "snapshot")
            if "synchronized_standby_slots" in done.stderr:
                raise RuntimeError(f"the source is not set up for failover: {done.stderr}")

            slots = {OURS: SLOT, NATIVE: "bench_native"}
            natives = {NATIVE: subscribe(target, slots[NATIVE], source)}
            if args.fast_native:
                slots[NATIVE_FAST] = "bench_native_1s"
                natives[NATIVE_FAST] = subscribe(targets[1], slots[NATIVE_FAST], source)
            dsns = {OURS: ours_dsn, **{n: s.target_dsn for n, s in natives.items()}}
            for subscription in natives.values():
                subscription.wait_ready(timeout=300)
            with psycopg.connect(pair.primary.dsn("app")) as conn:
                failover = dict(
                    conn.execute(
                        "SELECT slot_name, failover FROM pg_replication_slots "
                        "WHERE slot_type = 'logical'"
                    ).fetchall()
                )
            assert all(failover.get(s) for s in slots.values()), failover

            writer = updating_writer(source, args.rows, args.rate)
            writer.start()
            follow = subprocess.Popen(
                [harness.PGCDC, "follow", "--json"],
                env=env,
                cwd=work,
                stdout=(work / "follow.out").open("w"),
                stderr=(work / "follow.err").open("w"),
                text=True,
                start_new_session=True,
            )
            wait_for(
                "the follow to take the range lock",
                lambda: (
                    follow.poll() is None
                    and any(h.holder.startswith("run ") for h in lock_holders(ours_dsn, SLOT))
                ),
                180,
            )
            began = insert_probe(source, WARMUP_PROBE + number)
            warm = poll_probe(dsns, WARMUP_PROBE + number, began)
            assert all(isinstance(v, float) for v in warm.values()), warm
            report["warmup_probe_s"] = warm
            report["copies_persistent_s"] = round(
                wait_copies_persistent(pair, list(slots.values())), 2
            )
            time.sleep(2)  # the writer's steady state again
            report["copy_lag_bytes"] = copy_lag(pair, list(slots.values()))
            report["load_1min"] = round(os.getloadavg()[0], 2)
            report["writer_commits_per_s"] = round(
                writer.committed / (time.monotonic() - writer.started), 1
            )

            crashed = time.monotonic()
            pair.crash_primary()
            time.sleep(args.down_seconds)
            pair.promote()
            promoted = time.monotonic()
            new_primary = pair.standby.dsn("app")
            committed = insert_probe(new_primary, PROBE + number)
            seen = poll_probe(dsns, PROBE + number, promoted)
            report["crash_to_promoted_s"] = round(promoted - crashed, 3)
            report["probe_commit_s"] = round(committed - promoted, 3)
            report["visible_s"] = seen
            if writer.back_at is not None:
                report["writer_back_s"] = round(writer.back_at - promoted, 3)

            time.sleep(3)
            writer.finish()
            expected = harness.fingerprints(new_primary, TABLES)
            for name, dsn in dsns.items():
                wait_for(
                    f"{name} to equal the new primary",
                    lambda d=dsn: bool(harness.equality(expected, d)["equal"]),
                    180,
                )
            report["rows"] = expected[TABLES[0]][0]
            report["equal"] = True
            if follow.poll() is not None:
                raise RuntimeError(f"pgcdc follow ended: {harness.tail(work / 'follow.err', 20)}")
            follow.send_signal(signal.SIGTERM)
            follow.wait(120)
            err = (work / "follow.err").read_text(errors="replace")
            if follow.returncode != 0:
                said = harness.tail(work / "follow.err", 20)
                raise RuntimeError(f"pgcdc follow exited {follow.returncode}: {said}")
            switched = re.search(r"the source failed over: timeline \d+ -> \d+ at \S+", err)
            if switched is None:
                raise RuntimeError(f"pgcdc follow never said it failed over: {err[-2000:]}")
            report["follow_said"] = switched.group(0)
            report["follow_log"] = [
                line for line in err.splitlines() if re.search(r"source|timeline|outage", line)
            ][:12]
            out = (work / "follow.out").read_text()
            totals = json.loads(out[out.index("{") :]).get("follow", {})
            report["follow_outages"] = totals.get("outages")
            report["follow_outage_s"] = totals.get("outage_s")
        finally:
            if writer is not None:
                writer.stop.set()
            if follow is not None and follow.poll() is None:
                os.killpg(follow.pid, signal.SIGKILL)
                follow.wait(30)
            for cluster in targets:
                cluster.destroy()
    return report


def seconds(value: float | str | None) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value or "")


def table(runs: list[dict[str, Any]], fast: bool) -> str:
    names = [OURS, NATIVE] + ([NATIVE_FAST] if fast else [])
    head = ["run", "crash → promoted s", "ours s", "native (retry 5 s) s"]
    head += ["native (retry 1 s) s"] if fast else []
    head += ["ours / native", "follow outage s", "targets equal"]
    rows: list[list[str]] = []

    def ratio(ours: Any, native: Any) -> str:
        ok = isinstance(ours, float) and isinstance(native, float) and native > 0
        return f"{ours / native:.2f}×" if ok else ""

    for r in runs:
        seen = r["visible_s"]
        cells = [str(r["run"]), seconds(r["crash_to_promoted_s"])]
        cells += [seconds(seen.get(n)) for n in names]
        cells += [ratio(seen.get(OURS), seen.get(NATIVE)), seconds(r.get("follow_outage_s"))]
        cells += ["yes" if r.get("equal") else "no"]
        rows.append(cells)
    medians: dict[str, float | None] = {}
    for n in names:
        values = [r["visible_s"].get(n) for r in runs]
        if values and all(isinstance(v, float) for v in values):
            medians[n] = harness.median(values)
    cells = ["median", seconds(harness.median(r["crash_to_promoted_s"] for r in runs))]
    cells += [seconds(medians.get(n)) for n in names]
    cells += [ratio(medians.get(OURS), medians.get(NATIVE)), "", ""]
    rows.append(cells)
    return harness.markdown_table(head, rows)


def main() -> None:
    parser = harness.argument_parser(__doc__, profile=harness.PRODUCTION, json=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rate", type=float, default=150.0, help="writer commits a second")
    parser.add_argument(
        "--down-seconds", type=float, default=0.0, help="between the crash and the promotion"
    )
    parser.add_argument(
        "--no-fast-native",
        dest="fast_native",
        action="store_false",
        help="leave out native with wal_retrieve_retry_interval = 1s",
    )
    args = parser.parse_args()

    def run(index: int) -> dict[str, Any]:
        report = one_run(index + 1, args)
        print(json.dumps(report), flush=True)
        return report

    runs = harness.run_repeats(run, args.runs)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    print()
    print(table(runs, args.fast_native))


if __name__ == "__main__":
    main()
