"""A table added to a running replication, through the command a user runs, against native.

Per repeat, on fresh clusters: a source database with a small table ``a``, replicated by
``pgcdc snapshot`` and by a native subscription (``CREATE SUBSCRIPTION``, synced); then a table
``b`` of ``--rows`` rows (pgbench_accounts' shape: an ``int`` key, two ``int`` columns and an
84-character filler) is created on the source and added:

* ours: ``pgcdc add-table b`` from a fresh process (``--server off``: cold; ``warm``: with the
  command server an earlier command left up, started outside the timing), which extends the
  publication, copies ``b`` (schema, rows, key) as of its own consistent point and records it;
* native: ``ALTER PUBLICATION ... ADD TABLE b``, ``b``'s schema created on the subscriber
  (``pg_dump --schema-only -t b | psql``: native replication needs the table there first),
  ``ALTER SUBSCRIPTION ... REFRESH PUBLICATION``, timed until ``b`` is ``ready``.

Then a few changes to ``b`` on the source, ``pgcdc catchup`` (untimed) and native caught up,
and both targets' ``b`` compared with the source's (row count and a content hash).

``--while-following``: the add is made while replication runs (``pgcdc follow`` started
before, as a user runs it; the native subscription enabled throughout), with a probe row
inserted into ``a`` every 50 ms and both targets polled for it every 20 ms. Each side's
freshness of ``a`` is reported for the probes committed during its own add (median and
worst): ours goes on applying ``a`` while ``b`` copies (holding ``b``'s changes back) and
makes way only for the add's last step (the held-back changes applied, ``b`` recorded), as
native goes on applying ``a`` while ``b`` syncs. The follow's own account (``made_way_s``)
comes from its ``--json`` totals once it is stopped. ``--writes-to-added R``: besides, ``b``
is updated R times a second on the source throughout (both adds), so each side must take the
changes committed while ``b`` copies (ours: held back by the applies, then applied by the add,
``held_back_changes``); the final comparison of ``b`` checks they were taken exactly once.

The clusters, the commands, the native peer and the comparison are ``benchmarks/harness.py``'s.

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/add_table.py [--rows 1000000]
[--repeat 1] [--server off|warm] [--while-following [--writes-to-added R]] [--json F]
[--profile production|throwaway]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

from pgcdc_dagster.demo.local_cluster import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness


def make_source(source: LocalCluster) -> str:
    """Database ``app`` with a table ``a`` of 1,000 rows, published to ``native``."""
    return harness.source_database(
        source,
        "CREATE TABLE a (id int PRIMARY KEY, v text)",
        "INSERT INTO a SELECT g, md5(g::text) FROM generate_series(1, 1000) g",
        tables=["a"],
    )


def make_added(source_dsn: str, rows: int) -> None:
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE b (id int PRIMARY KEY, bid int, abalance int, filler char(84))")
        conn.execute(
            "INSERT INTO b SELECT g, g / 100000, 0, '' FROM generate_series(1, %s) g", (rows,)
        )
        conn.execute("VACUUM ANALYZE b")


def native_add(source_dsn: str, native: harness.Subscription) -> float:
    started = time.perf_counter()
    harness.execute(source_dsn, "ALTER PUBLICATION native ADD TABLE b")
    harness.copy_schema(source_dsn, native.target_dsn, ["b"])
    with psycopg.connect(native.target_dsn, autocommit=True) as conn:
        native.alter("REFRESH PUBLICATION", conn)
        native.wait_ready(conn=conn)
    return time.perf_counter() - started


class Probes:
    """Probe rows inserted into ``a`` on the source, and when each target first had them."""

    FIRST = 10_000_000

    def __init__(self, source_dsn: str, targets: dict[str, str]) -> None:
        self.committed: dict[int, float] = {}
        self.seen: dict[str, dict[int, float]] = {name: {} for name in targets}
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._insert, args=(source_dsn,))] + [
            threading.Thread(target=self._poll, args=(name, dsn)) for name, dsn in targets.items()
        ]

    def _insert(self, dsn: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            n = self.FIRST
            while not self._stop.is_set():
                n += 1
                conn.execute("INSERT INTO a VALUES (%s, 'probe')", (n,))
                self.committed[n] = time.monotonic()
                time.sleep(0.05)

    def _poll(self, name: str, dsn: str) -> None:
        seen, last = self.seen[name], self.FIRST
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not self._stop.is_set():
                (top,) = conn.execute("SELECT coalesce(max(id), 0) FROM a").fetchone()  # type: ignore[misc]
                now = time.monotonic()
                for n in range(last + 1, top + 1):
                    seen[n] = now
                last = max(last, top)
                time.sleep(0.02)

    @contextlib.contextmanager
    def running(self) -> Iterator[Probes]:
        for thread in self._threads:
            thread.start()
        try:
            yield self
        finally:
            time.sleep(1.0)  # the last probes arrive
            self._stop.set()
            for thread in self._threads:
                thread.join()

    def freshness(self, name: str, began: float, ended: float) -> dict[str, Any]:
        """Seconds from commit to visible on ``name`` for the probes committed in the window."""
        lags = [
            self.seen[name][n] - t
            for n, t in self.committed.items()
            if began <= t <= ended and n in self.seen[name]
        ]
        missing = sum(
            1 for n, t in self.committed.items() if began <= t <= ended and n not in self.seen[name]
        )
        return {
            "probes": len(lags),
            "not_seen": missing,
            "median_s": harness.rounded(harness.median(lags)),
            "worst_s": round(max(lags), 3) if lags else None,
        }


@contextlib.contextmanager
def writing_added(source_dsn: str, rows: int, rate: float) -> Iterator[None]:
    """``b`` updated ``rate`` times a second (a row in 1,000 of the first ``rows``) meanwhile."""
    stop = threading.Event()

    def write() -> None:
        with psycopg.connect(source_dsn, autocommit=True) as conn:
            n = 0
            while not stop.wait(1.0 / rate):
                n += 1
                conn.execute(
                    "UPDATE b SET abalance = abalance + 1 WHERE id = %s", (n * 997 % rows + 1,)
                )

    writer = threading.Thread(target=write)
    if rate > 0:
        writer.start()
    try:
        yield
    finally:
        stop.set()
        if rate > 0:
            writer.join()


def run_while_following(
    env: dict[str, str],
    work: Any,
    source_dsn: str,
    native: harness.Subscription,
    rows: int,
    writes_to_added: float,
) -> dict[str, Any]:
    """The two adds while each side's replication runs, with probes (see the docstring)."""
    written = harness.wal_position(source_dsn)  # b's rows are before it
    # A checkpoint logs the running transactions: a record past b's rows for the slot's
    # restart point to move to (an idle source may have logged its last one just before).
    harness.execute(source_dsn, "CHECKPOINT")
    target_dsn, slot = env["PGCDC_TARGET_DSN"], env["PGCDC_SLOT"]
    follow, _ = harness.start_follow(env, work, target_dsn, slot, "--json")
    try:
        # b's rows, written before the follow started, are WAL every peek decodes again (and
        # filters out) until the slot's restart point is past them: about 15 s (see README).
        # (Not the position as of then: on an idle source the restart point stays at the last
        # running-xacts record, before it.)
        harness.wait_slot(source_dsn, slot, written, position="restart_lsn")
        with (
            Probes(
                source_dsn, {"ours": target_dsn, "native": native.target_dsn}
            ).running() as probes,
            writing_added(source_dsn, rows, writes_to_added),
        ):
            time.sleep(3.0)  # both sides steady
            steady = (time.monotonic() - 2.0, time.monotonic())
            began = time.monotonic()
            ours, report, _ = harness.json_command(env, work, "add-table", "b")
            ours_window = (began, time.monotonic())
            time.sleep(2.0)
            began = time.monotonic()
            native_s = native_add(source_dsn, native)
            native_window = (began, time.monotonic())
            time.sleep(2.0)
    finally:
        follow.send_signal(signal.SIGTERM)
        out, err = follow.communicate(timeout=300)
    if follow.returncode != 0:
        raise RuntimeError(f"pgcdc follow failed: {err[-3000:]}")
    totals = json.loads(out)["follow"]
    return {
        "ours_add_s": round(ours, 3),
        "native_add_s": round(native_s, 3),
        "ours_made_way_s": totals.get("made_way_s"),
        "ours_held_back_changes": report.get("held_back_changes"),
        "ours_held_back_with_range": report.get("held_back_with_range"),
        "ours_held_back_passes": report.get("held_back_passes"),
        "ours_held_back_transactions": report.get("held_back_transactions"),
        "ours_held_back_s": report.get("held_back_seconds"),
        "ours_follow_said": [
            line for line in err.splitlines() if "made way" in line or "going on" in line
        ],
        "ours_freshness_before": probes.freshness("ours", *steady),
        "native_freshness_before": probes.freshness("native", *steady),
        "ours_freshness_during_its_add": probes.freshness("ours", *ours_window),
        "native_freshness_during_its_add": probes.freshness("native", *native_window),
    }


def one_run(args: argparse.Namespace, run: int) -> dict[str, Any]:
    with harness.bench_clusters(args.profile, extra=harness.QUIET) as (work, source, target):
        source_dsn = make_source(source)
        env = harness.pgcdc_env(work, source_dsn, target, f"ours_{run}", publication=f"ours_{run}")
        harness.timed_command(env, work, "snapshot")
        native, _ = harness.native_peer(source_dsn, target, f"native_{run}", "native", tables=["a"])
        make_added(source_dsn, args.rows)
        with contextlib.ExitStack() as stack:
            if args.server == "warm":
                env = {**env, "PGCDC_SERVER": "auto"}
                stack.enter_context(harness.warm_command_server(env))
            if args.while_following:
                following = run_while_following(
                    env, work, source_dsn, native, args.rows, args.writes_to_added
                )
                ours, native_s = following["ours_add_s"], following["native_add_s"]
            else:
                following = {}
                ours = harness.timed_command(env, work, "add-table", "b")
                native_s = native_add(source_dsn, native)
            harness.execute(
                source_dsn,
                "UPDATE b SET abalance = abalance + 1 WHERE id % 1000 = 0",
                "DELETE FROM b WHERE id % 1000 = 1",
            )
            harness.timed_command(env, work, "catchup")
        native.wait_confirmed()
        expected = harness.fingerprints(source_dsn, ["a", "b"])
        ours_equal = harness.equality(expected, env["PGCDC_TARGET_DSN"])
        native_equal = harness.equality(expected, native.target_dsn)
        return {
            "ours_add_s": round(ours, 3),
            "native_add_s": round(native_s, 3),
            "ratio": round(native_s / ours, 3),
            "ours_equal": "public.b" not in ours_equal["differ"],
            "native_equal": "public.b" not in native_equal["differ"],
            "a_equal": "public.a" not in ours_equal["differ"] + native_equal["differ"],
            **following,
        }


def main() -> None:
    parser = harness.argument_parser(__doc__, repeat=1, json=True, server="")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--writes-to-added", type=float, default=0.0)
    parser.add_argument(
        "--while-following", action="store_true", help="add while pgcdc follow runs, with probes"
    )
    args = parser.parse_args()
    runs = harness.run_repeats(lambda i: one_run(args, i), args.repeat)
    report = harness.summary(
        args,
        runs,
        {"median_ratio": "ratio"},
        rows=args.rows,
        command_server=args.server,
        while_following=args.while_following,
    )
    harness.emit_report(report, args.json)


if __name__ == "__main__":
    main()
