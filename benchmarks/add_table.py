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
and both targets' ``b`` compared with the source's (row count and an aggregate).

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

Usage: ``SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/add_table.py [--rows 1000000]
[--repeat 1] [--server off|warm] [--while-following [--writes-to-added R]] [--json F]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
from apply import bench_clusters, warm_command_server
from many_tables import PGCDC, emit_report, native_schema, pgcdc_env, timed_command, wait_ready
from psycopg import sql

from pgcdc_dagster.demo.local_cluster import LocalCluster
from pgcdc_dagster.engine.control.range_lock import lock_holders
from pgcdc_dagster.engine.lsn import Lsn

POLL_S = 0.02


def make_source(source: LocalCluster) -> str:
    with psycopg.connect(source.dsn(), autocommit=True) as conn:
        conn.execute("CREATE DATABASE app")
    dsn = source.dsn("app")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE a (id int PRIMARY KEY, v text)")
        conn.execute("INSERT INTO a SELECT g, md5(g::text) FROM generate_series(1, 1000) g")
        conn.execute("CREATE PUBLICATION native FOR TABLE a")
    return dsn


def native_subscription(
    source_dsn: str, target: LocalCluster, run: int, tables: tuple[str, ...] = ("a",)
) -> str:
    """A native subscription to ``native`` (publishing ``tables``), its initial sync done;
    the subscriber's DSN."""
    name = f"native_{run}"
    with psycopg.connect(target.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = target.dsn(name)
    native_schema(source_dsn, dsn, *tables)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION native").format(
                sql.Identifier(name), sql.Literal(source_dsn)
            )
        )
        wait_ready(conn, name)
    return dsn


def make_added(source_dsn: str, rows: int) -> None:
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE b (id int PRIMARY KEY, bid int, abalance int, filler char(84))")
        conn.execute(
            "INSERT INTO b SELECT g, g / 100000, 0, '' FROM generate_series(1, %s) g", (rows,)
        )
        conn.execute("VACUUM ANALYZE b")


def native_add(source_dsn: str, native_dsn: str, run: int) -> float:
    name = f"native_{run}"
    started = time.perf_counter()
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        conn.execute("ALTER PUBLICATION native ADD TABLE b")
    native_schema(source_dsn, native_dsn, "b")
    with psycopg.connect(native_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER SUBSCRIPTION {} REFRESH PUBLICATION").format(sql.Identifier(name))
        )
        wait_ready(conn, name)
    return time.perf_counter() - started


def fingerprint(dsn: str) -> tuple[int, int]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(  # type: ignore[return-value]
            "SELECT count(*), coalesce(sum(hashint4(id) # hashint4(abalance)), 0) FROM b"
        ).fetchone()


def count_a(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.execute("SELECT count(*) FROM a").fetchone()[0]  # type: ignore[index]


def native_caught_up(source_dsn: str, native_dsn: str, run: int) -> None:
    caught_up(source_dsn, f"native_{run}")


def wal_position(source_dsn: str) -> str:
    """The source's WAL position now."""
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        (end,) = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()  # type: ignore[misc]
    return str(end)


def caught_up(
    source_dsn: str, slot: str, position: str = "confirmed_flush_lsn", end: str | None = None
) -> None:
    """Until ``slot``'s ``position`` is at least ``end`` (the source's WAL position as of
    now, when not given)."""
    end = end or wal_position(source_dsn)
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        while True:
            (confirmed,) = conn.execute(  # type: ignore[misc]
                sql.SQL("SELECT {}::text FROM pg_replication_slots WHERE slot_name = %s").format(
                    sql.Identifier(position)
                ),
                (slot,),
            ).fetchone()
            if confirmed is not None and Lsn.parse(confirmed) >= Lsn.parse(end):
                return
            time.sleep(POLL_S)


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
            "median_s": round(statistics.median(lags), 3) if lags else None,
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


def added_by_command(env: dict[str, str], work: Any) -> tuple[float, dict[str, Any]]:
    """``pgcdc add-table b --json`` from a fresh process: its seconds and its report."""
    started = time.perf_counter()
    done = subprocess.run(
        [PGCDC, "add-table", "b", "--json"], env=env, capture_output=True, text=True, cwd=work
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"pgcdc add-table b failed: {done.stderr[-3000:]}")
    return seconds, json.loads(done.stdout)


def run_while_following(
    env: dict[str, str],
    work: Any,
    source_dsn: str,
    native_dsn: str,
    run: int,
    rows: int,
    writes_to_added: float,
) -> dict[str, Any]:
    """The two adds while each side's replication runs, with probes (see the docstring)."""
    written = wal_position(source_dsn)  # b's rows are before it
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        # A checkpoint logs the running transactions: a record past b's rows for the slot's
        # restart point to move to (an idle source may have logged its last one just before).
        conn.execute("CHECKPOINT")
    follow = subprocess.Popen(
        [PGCDC, "follow", "--json"],
        env=env,
        cwd=work,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not any(
            h.holder.startswith("run ")
            for h in lock_holders(env["PGCDC_TARGET_DSN"], env["PGCDC_SLOT"])
        ):
            if follow.poll() is not None:
                raise RuntimeError(f"pgcdc follow ended: {follow.communicate()[1][-3000:]}")
            time.sleep(0.1)
        # b's rows, written before the follow started, are WAL every peek decodes again (and
        # filters out) until the slot's restart point is past them: about 15 s (see README).
        # (Not the position as of then: on an idle source the restart point stays at the last
        # running-xacts record, before it.)
        caught_up(source_dsn, env["PGCDC_SLOT"], "restart_lsn", written)
        with (
            Probes(
                source_dsn, {"ours": env["PGCDC_TARGET_DSN"], "native": native_dsn}
            ).running() as probes,
            writing_added(source_dsn, rows, writes_to_added),
        ):
            time.sleep(3.0)  # both sides steady
            steady = (time.monotonic() - 2.0, time.monotonic())
            began = time.monotonic()
            ours, report = added_by_command(env, work)
            ours_window = (began, time.monotonic())
            time.sleep(2.0)
            began = time.monotonic()
            native = native_add(source_dsn, native_dsn, run)
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
        "native_add_s": round(native, 3),
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
    with bench_clusters() as (work, source, target):
        source_dsn = make_source(source)
        env = pgcdc_env(work, source_dsn, target, run)
        timed_command(env, work, "snapshot")
        native_dsn = native_subscription(source_dsn, target, run)
        make_added(source_dsn, args.rows)
        with contextlib.ExitStack() as stack:
            if args.server == "warm":
                env = {**env, "PGCDC_SERVER": "auto"}
                stack.enter_context(warm_command_server(env))
            if args.while_following:
                following = run_while_following(
                    env, work, source_dsn, native_dsn, run, args.rows, args.writes_to_added
                )
                ours, native = following["ours_add_s"], following["native_add_s"]
            else:
                following = {}
                ours = timed_command(env, work, "add-table", "b")
                native = native_add(source_dsn, native_dsn, run)
            with psycopg.connect(source_dsn, autocommit=True) as conn:
                conn.execute("UPDATE b SET abalance = abalance + 1 WHERE id % 1000 = 0")
                conn.execute("DELETE FROM b WHERE id % 1000 = 1")
            timed_command(env, work, "catchup")
        native_caught_up(source_dsn, native_dsn, run)
        expected = fingerprint(source_dsn)
        return {
            "ours_add_s": round(ours, 3),
            "native_add_s": round(native, 3),
            "ratio": round(native / ours, 3),
            "ours_equal": fingerprint(env["PGCDC_TARGET_DSN"]) == expected,
            "native_equal": fingerprint(native_dsn) == expected,
            "a_equal": count_a(env["PGCDC_TARGET_DSN"])
            == count_a(source_dsn)
            == count_a(native_dsn),
            **following,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--server", choices=("off", "warm"), default="off")
    parser.add_argument("--writes-to-added", type=float, default=0.0)
    parser.add_argument(
        "--while-following", action="store_true", help="add while pgcdc follow runs, with probes"
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    runs = [one_run(args, i) for i in range(args.repeat)]
    report = {
        "rows": args.rows,
        "command_server": args.server,
        "while_following": args.while_following,
        "median_ratio": statistics.median(r["ratio"] for r in runs),
        "runs": runs,
    }
    emit_report(report, args.json)


if __name__ == "__main__":
    main()
