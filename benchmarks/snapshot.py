"""Base snapshot throughput against PostgreSQL's own initial sync and a plain COPY pipe.

Starts two throwaway clusters with the same settings (a source and a target), fills the source
with ``pgbench -i`` (scale 50 by default: 5M ``pgbench_accounts`` rows, so that fixed start-up
costs do not dominate), starts the SparkSession (timed apart, as fixed cost), then measures on
that same data, median of ``--repeat`` runs, each run into a fresh target database:

* ours: :func:`pgcdc_dagster.engine.snapshot.take_base_snapshot` into an empty database: preflight,
  publication, slot with exported snapshot, pre-data schema, the copy on Spark, post-data
  (primary keys), origin. The result's ``copy_seconds`` splits the copy phase from the fixed
  cost around it;
* native: ``CREATE SUBSCRIPTION`` on a target whose tables were pre-created from
  ``pg_dump --schema-only`` (keys included, as logical replication is normally set up), timed
  until every table's ``pg_subscription_rel.srsubstate`` is ``r`` (ready); PostgreSQL 15's table
  sync copies in text format, up to ``max_sync_workers_per_subscription`` (2) tables at a time;
* pipe: ``psql -c 'COPY t TO STDOUT (FORMAT binary)' | psql -c 'COPY t FROM STDIN (FORMAT
  binary)'`` per table, one table after the other, into tables pre-created from the pre-data
  section (no indexes), then the post-data section (primary keys) replayed with ``psql``: the
  ceiling of the copy phase, and of copy + keys.

Before the timed runs, one untimed pipe run warms both clusters up (``--no-warm-up`` skips it).
Why: a fresh cluster has no WAL segments to recycle, so its first few GB of WAL cost creating and
zero-filling each 16 MB file; at scale 200 that made whichever method ran first pay 7-9 target
CPU-s more than the next (``HISTORY.md``, 2026-11-29 afternoon). Every other repeat runs the
methods in reverse order, so none always runs first.

Besides wall time, every run records the CPU seconds spent by the source cluster, the target
cluster and this process's tree (driver, Spark JVM, Spark's Python workers, psql/pg_dump), read
from ``/proc``, and the WAL the target wrote: where the time goes, measured. ``other`` is the
CPU the rest of the machine used during the run: on a shared machine, a run with a large
``other`` was slowed down by someone else (each run's value is under ``runs``).

Throughput ratios are "ours is N times as fast": > 1 means we are faster (``ratios_legend``
says what each divides). MB/s are megabytes (10^6) of binary COPY data, as our copy counted
them, per second, the same volume for all three methods.

Trap: PostgreSQL 15's logical replication launcher starts apply workers at most once per
``wal_retrieve_retry_interval`` (5 s), so a subscription created right after the previous one
would wait up to 5 s before copying anything; the native run sleeps that out before its timer.

Usage: ``.venv/bin/python benchmarks/snapshot.py [--scale 50] [--repeat 1] [--parallelism N]
[--rows-per-task N] [--methods ours,native,pipe]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from apply import warm_command_server
from psycopg import sql

from pgcdc_dagster.demo.local_cluster import (
    LOGICAL_SOURCE_SETTINGS,
    THROWAWAY_SETTINGS,
    LocalCluster,
    find_bindir,
    temporary_cluster,
)
from pgcdc_dagster.demo.run import pgbench
from pgcdc_dagster.engine.identifiers import TableName, origin_name
from pgcdc_dagster.engine.snapshot import DEFAULT_ROWS_PER_TASK, take_base_snapshot
from pgcdc_dagster.engine.spark.session import get_spark

TABLES = [
    TableName("public", name)
    for name in ("pgbench_accounts", "pgbench_branches", "pgbench_history", "pgbench_tellers")
]
OURS_PUBLICATION = "bench_ours_pub"
NATIVE_PUBLICATION = "bench_native_pub"
POLL_SECONDS = 0.02
NATIVE_TIMEOUT_SECONDS = 3600.0
MB = 1e6


# ─── measuring: CPU per process tree, target WAL ─────────────────────────────────────────────

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class _Proc:
    ppid: int
    comm: str
    own: int
    """utime + stime, in clock ticks"""
    reaped: int
    """cutime + cstime: the CPU of the children this process has waited for"""


def _process_table() -> dict[int, _Proc]:
    """Every process, from ``/proc/<pid>/stat``.

    Because a process's ``reaped`` ticks hold its finished children's CPU, a tree's sum of
    ``own + reaped`` stays right across processes that exit in between (backends, psql, Python
    workers).
    """
    table: dict[int, _Proc] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                text = stat.read()
        except OSError:
            continue
        comm = text[text.index(b"(") + 1 : text.rindex(b")")].decode(errors="replace")
        fields = text[text.rindex(b")") + 2 :].split()
        own = int(fields[11]) + int(fields[12])
        table[int(entry.name)] = _Proc(int(fields[1]), comm, own, int(fields[13]) + int(fields[14]))
    return table


def _descendants(table: dict[int, _Proc], root: int, exclude: set[int]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, proc in table.items():
        children.setdefault(proc.ppid, []).append(pid)
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        if pid in exclude or pid not in table:
            continue
        found.append(pid)
        stack += children.get(pid, [])
    return found


def _postmaster_pid(cluster: LocalCluster) -> int:
    return int((cluster.datadir / "postmaster.pid").read_text().splitlines()[0])


class CpuMeter:
    """CPU seconds of the source cluster, the target cluster, and this process's tree split into
    the driver (this interpreter), the Spark JVM, Spark's Python workers and the tools (psql,
    pg_dump, pg_restore); plus what the whole machine used, to tell other people's load apart.
    """

    def __init__(
        self, source: LocalCluster, target: LocalCluster, command_server: int | None = None
    ) -> None:
        self.servers = {"source_pg": _postmaster_pid(source), "target_pg": _postmaster_pid(target)}
        if command_server is not None:  # the warm pgcdc server: the command runs in its child
            self.servers["pgcdc_server"] = command_server

    def sample(self) -> dict[str, int]:
        table = _process_table()
        ticks = {
            name: sum(table[p].own + table[p].reaped for p in _descendants(table, pid, set()))
            for name, pid in self.servers.items()
        }
        me = os.getpid()
        client = {"driver": 0, "spark_jvm": 0, "spark_python": 0, "tools": 0}
        jvm_trees: set[int] = set()
        for pid in _descendants(table, me, set(self.servers.values())):
            proc = table[pid]
            if pid == me:
                client["driver"] += proc.own
                client["tools"] += proc.reaped  # psql, pg_dump: children we waited for
            elif proc.comm == "java":
                client["spark_jvm"] += proc.own + proc.reaped
                jvm_trees.update(_descendants(table, pid, set()))
            elif pid in jvm_trees:  # the JVM itself was counted above, before its children
                client["spark_python"] += proc.own + proc.reaped
            else:
                client["tools"] += proc.own + proc.reaped
        ticks.update(client)
        with open("/proc/stat") as stat:
            # user nice system idle iowait irq softirq steal: everything but idle and iowait
            cpu = [int(v) for v in stat.readline().split()[1:9]]
        ticks["machine"] = sum(cpu) - cpu[3] - cpu[4]
        return ticks

    @staticmethod
    def seconds(before: dict[str, int], after: dict[str, int], wall: float) -> dict[str, Any]:
        """CPU seconds per part, their ``total``, ``cores_busy`` (total / wall), and ``other``:
        what the rest of the machine used meanwhile (other people's load: noise in the wall
        time)."""
        used = {k: (after[k] - before[k]) / _CLOCK_TICKS for k in before}
        machine = used.pop("machine")
        parts = ("driver", "spark_jvm", "spark_python", "tools")
        client = {k: round(used.pop(k), 2) for k in parts}
        total = sum(used.values()) + sum(client.values())
        return {
            **{k: round(v, 2) for k, v in used.items()},
            "client": round(sum(client.values()), 2),
            "client_parts": client,
            "total": round(total, 2),
            "cores_busy": round(total / wall, 2) if wall > 0 else 0.0,
            "other": round(max(0.0, machine - total), 2),
        }


def _wal_lsn(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def _wal_mb(conn: psycopg.Connection[Any], start: str) -> float:
    row = conn.execute(
        "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s::pg_lsn)", (start,)
    ).fetchone()
    assert row is not None
    return round(float(row[0]) / MB, 1)


class Measured:
    """Wall time, CPU split and target WAL of one timed run."""

    def __init__(
        self, source: LocalCluster, target: LocalCluster, command_server: int | None = None
    ) -> None:
        self.meter = CpuMeter(source, target, command_server)
        self.target_dsn = target.dsn()

    def __enter__(self) -> Measured:
        with psycopg.connect(self.target_dsn, autocommit=True) as conn:
            self.wal_start = _wal_lsn(conn)
        self.cpu_start = self.meter.sample()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self.started
        self.cpu = CpuMeter.seconds(self.cpu_start, self.meter.sample(), self.wall)
        with psycopg.connect(self.target_dsn, autocommit=True) as conn:
            self.target_wal_mb = _wal_mb(conn, self.wal_start)

    def report(self) -> dict[str, Any]:
        return {"cpu_seconds": self.cpu, "target_wal_mb": self.target_wal_mb}


@contextlib.contextmanager
def pgbench_clusters(scale: int) -> Iterator[tuple[LocalCluster, LocalCluster]]:
    """Two throwaway clusters (``LOGICAL_SOURCE_SETTINGS``): a source filled by ``pgbench -i``
    at ``scale`` (its history table ``REPLICA IDENTITY FULL``, all vacuumed and analysed) and
    an empty target; both destroyed on the way out."""
    source = temporary_cluster(LOGICAL_SOURCE_SETTINGS, prefix="pgcdc-bench-source-")
    target = temporary_cluster(LOGICAL_SOURCE_SETTINGS, prefix="pgcdc-bench-target-")
    try:
        source.start()
        target.start()
        pgbench(source, "-i", "-q", "-s", str(scale))
        with psycopg.connect(source.dsn(), autocommit=True) as conn:
            conn.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
            conn.execute("VACUUM ANALYZE")
        yield source, target
    finally:
        for cluster in (source, target):
            cluster.destroy()


# ─── helpers ──────────────────────────────────────────────────────────────────────────────────


def _tool(name: str) -> str:
    return str(find_bindir() / name)


def _run(argv: list[str], **kwargs: Any) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, **kwargs)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(argv[0]).name} failed ({done.returncode}): {done.stderr}")
    return done.stdout


def _psql_file(dsn: str, script: Path) -> None:
    _run([_tool("psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-1", "-d", dsn, "-f", str(script)])


def _dump(dsn: str, out: Path, *options: str) -> None:
    selection = [f"--table={t.schema}.{t.name}" for t in TABLES]
    _run(
        [
            _tool("pg_dump"),
            "--schema-only",
            "--no-owner",
            "--no-privileges",
            "--no-publications",
            "--no-subscriptions",
            *options,
            *selection,
            f"--file={out}",
            "-d",
            dsn,
        ]
    )


def _quiesce(source: LocalCluster, target: LocalCluster) -> None:
    """Start every timed run from the same place: no dirty buffers, no pending writeback."""
    for cluster in (source, target):
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute("CHECKPOINT")
    os.sync()


def _create_database(target: LocalCluster, name: str) -> str:
    _drop_database(target, name)
    with psycopg.connect(target.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return target.dsn(name)


def _drop_database(target: LocalCluster, name: str) -> None:
    statement = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    with psycopg.connect(target.dsn(), autocommit=True) as conn:
        conn.execute(statement)


def _row_counts(dsn: str) -> dict[str, int]:
    counts = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table in TABLES:
            row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.sql)).fetchone()
            assert row is not None
            counts[str(table)] = int(row[0])
    return counts


def _verify(dsn: str, expected: dict[str, int], method: str) -> int:
    counts = _row_counts(dsn)
    if counts != expected:
        raise RuntimeError(f"{method}: target rows {counts} differ from the source's {expected}")
    return sum(counts.values())


def _throughput(seconds: float, rows: int, nbytes: int) -> dict[str, float]:
    return {
        "rows_per_s": round(rows / seconds) if seconds > 0 else 0,
        "mb_per_s": round(nbytes / MB / seconds, 1) if seconds > 0 else 0.0,
    }


# ─── the three methods ────────────────────────────────────────────────────────────────────────


def run_ours(
    source: LocalCluster,
    target: LocalCluster,
    spark: Any,
    run: int,
    expected: dict[str, int],
    options: dict[str, Any],
) -> dict[str, Any]:
    database, slot = f"bench_ours_{run}", f"bench_ours_{run}"
    target_dsn = _create_database(target, database)
    _quiesce(source, target)
    with Measured(source, target) as measured:
        result = take_base_snapshot(
            source.dsn(), target_dsn, slot, OURS_PUBLICATION, TABLES, spark=spark, **options
        )
    with psycopg.connect(source.dsn(), autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_replication_origin_drop(%s)", (origin_name(slot),))
    rows = _verify(target_dsn, expected, "ours")
    _drop_database(target, database)
    # A table copied in a bundle (the small ones) has no bytes or seconds of its own.
    busy = sum(t.seconds or 0.0 for t in result.tables)
    fixed = result.seconds - result.copy_seconds
    return {
        "seconds": result.seconds,
        "copy_seconds": result.copy_seconds,
        "fixed_seconds": fixed,
        "fixed": {
            "pre_data_seconds": result.pre_data.seconds,
            "post_data_seconds": result.post_data.seconds,
            "preflight_slot_origin_other_seconds": (
                fixed - result.pre_data.seconds - result.post_data.seconds
            ),
        },
        "rows": rows,
        "copy_bytes": sum(t.bytes or 0 for t in result.tables),
        "copy_tasks": sum(t.tasks for t in result.tables),
        "copy_task_busy_seconds": busy,
        "copy_parallelism": busy / result.copy_seconds if result.copy_seconds > 0 else 0.0,
        "copy_formats": sorted({f for t in result.tables for f in t.copy_formats}),
        "per_table": {
            str(t.table): {
                "rows": t.rows,
                "tasks": t.tasks,
                "busy_seconds": None if t.seconds is None else round(t.seconds, 3),
                "bundled_with": t.bundled_with,
            }
            for t in result.tables
        },
        **measured.report(),
    }


REPO = Path(__file__).resolve().parent.parent


def run_cli(
    source: LocalCluster,
    target: LocalCluster,
    run: int,
    expected: dict[str, int],
    work: Path,
    warm: bool = False,
) -> dict[str, Any]:
    """``pgcdc snapshot`` from a fresh process, as a user runs it: Python, Dagster, the run
    (PostgreSQL storage, the shipped dagster.yaml), Spark only if a table needs it.

    Cold (``warm=False``): the first command on the machine, nothing of ours running
    (``PGCDC_SERVER=off``: the same process a first command is, without leaving a server).

    ``warm``: a second snapshot, into a fresh target, with what the first one leaves up: the
    command server (:mod:`pgcdc_dagster.launcher`; the command runs in its forked child, with
    Dagster and the definitions already imported), and the warm Spark Connect server of
    ``pgcdc spark start`` (started and given a first job before the timing). That server runs
    local[*] on this machine's cores, so the driver still copies every table
    (``driver_max_rows``). The command server's CPU (its child's) is counted apart as
    ``pgcdc_server``."""
    import shutil
    import sys

    from pgcdc_dagster.engine.spark import server as spark_server

    run_name = f"{run}w" if warm else str(run)
    database, slot = f"bench_cli_{run_name}", f"bench_cli_{run_name}"
    target_dsn = _create_database(target, database)
    storage = f"dagster_cli_{run_name}"
    _create_database(target, storage)
    home = work / f"dagster_home_{run_name}"
    home.mkdir()
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    env = {
        **os.environ,
        "PGCDC_SOURCE_DSN": source.dsn(),
        "PGCDC_TARGET_DSN": target_dsn,
        "PGCDC_SLOT": slot,
        "PGCDC_PUBLICATION": "bench_cli_pub",
        "PGCDC_TABLES": ",".join(str(t) for t in TABLES),
        "PGCDC_STORE": str(work / f"store_{run_name}"),
        "DAGSTER_HOME": str(home),
        "DAGSTER_POSTGRES_URL": (
            f"postgresql+psycopg2://postgres@127.0.0.1:{target.port}/{storage}"
        ),
        "PGCDC_SERVER": "auto" if warm else "off",
        "PGCDC_SERVER_DIR": str(work / f"srv_{run_name}"),
    }
    pgcdc = str(Path(sys.executable).parent / "pgcdc")
    # A user's Dagster storage already has its schema: create it outside the timing.
    subprocess.run(
        [
            sys.executable,
            "-c",
            "from pgcdc_dagster.defs.instance import dagster_instance as d; d()",
        ],
        env=env,
        check=True,
        cwd=work,
    )
    with contextlib.ExitStack() as stack:
        command_server = stack.enter_context(warm_command_server(env)) if warm else None
        if warm:
            store = work / f"store_{run_name}"
            store.mkdir()
            server, _ = spark_server.start(store)
            stack.callback(spark_server.stop, store)
            subprocess.run(
                [sys.executable, "-c", "import sys; from pgcdc_dagster.engine.spark.session "
                 "import get_spark; get_spark(remote=sys.argv[1]).range(1000).count()",
                 server.url],
                check=True, env=env, cwd=work,
            )  # fmt: skip
        _quiesce(source, target)
        with Measured(source, target, command_server) as measured:
            done = subprocess.run(
                [pgcdc, "snapshot"],
                env=env,
                capture_output=True,
                text=True,
                cwd=work,
            )
    if done.returncode != 0:
        raise RuntimeError(f"pgcdc snapshot failed: {done.stderr[-3000:]}")
    with psycopg.connect(source.dsn(), autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_replication_origin_drop(%s)", (origin_name(slot),))
    rows = _verify(target_dsn, expected, "cli_warm" if warm else "cli")
    _drop_database(target, database)
    return {
        "seconds": measured.wall,
        "rows": rows,
        "stdout": done.stdout.strip(),
        "progress": [line for line in done.stderr.splitlines() if line.startswith("pgcdc: ")],
        **measured.report(),
    }


_SUBSCRIPTION_STATES = """
SELECT r.srrelid::regclass::text, r.srsubstate
FROM pg_subscription_rel r
JOIN pg_subscription s ON s.oid = r.srsubid
WHERE s.subname = %s
"""


_last_subscription_change = [0.0]
"""When the previous native run last woke the logical replication launcher (monotonic)."""


def _wait_for_launcher(conn: psycopg.Connection[Any]) -> None:
    """PostgreSQL 15's launcher starts apply workers at most once per
    ``wal_retrieve_retry_interval`` (5 s), counted from its last round: a subscription created
    sooner after the previous one's CREATE/DROP waits for the rest of it. A first subscription
    never pays that, so neither does the measurement."""
    row = conn.execute(
        "SELECT extract(epoch FROM current_setting('wal_retrieve_retry_interval')::interval)"
    ).fetchone()
    assert row is not None
    remaining = float(row[0]) + 0.5 - (time.monotonic() - _last_subscription_change[0])
    if remaining > 0:
        time.sleep(remaining)


def run_native(
    source: LocalCluster,
    target: LocalCluster,
    run: int,
    expected: dict[str, int],
    schema_script: Path,
) -> dict[str, Any]:
    database, subscription = f"bench_native_{run}", f"bench_native_{run}"
    target_dsn = _create_database(target, database)
    _psql_file(target_dsn, schema_script)
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        _wait_for_launcher(conn)
    _quiesce(source, target)
    # first time each table was seen in each state: i(nit), d(ata copy), f(inished copy),
    # s(ync done), r(eady)
    seen: dict[str, dict[str, float]] = {}
    with (
        psycopg.connect(target_dsn, autocommit=True) as conn,
        Measured(source, target) as measured,
    ):
        conn.execute(
            sql.SQL("CREATE SUBSCRIPTION {} CONNECTION {} PUBLICATION {}").format(
                sql.Identifier(subscription),
                sql.Literal(source.dsn()),
                sql.Identifier(NATIVE_PUBLICATION),
            )
        )
        created = time.perf_counter() - measured.started
        while True:
            now = time.perf_counter() - measured.started
            states: dict[str, str] = dict(
                conn.execute(_SUBSCRIPTION_STATES, (subscription,)).fetchall()
            )
            for table, state in states.items():
                seen.setdefault(table, {}).setdefault(state, now)
            if states and all(s == "r" for s in states.values()):
                break
            if now > NATIVE_TIMEOUT_SECONDS:
                raise RuntimeError(f"native initial sync not ready after {now:.0f} s: {states}")
            time.sleep(POLL_SECONDS)
    with psycopg.connect(target_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SUBSCRIPTION {}").format(sql.Identifier(subscription)))
    _last_subscription_change[0] = time.monotonic()
    rows = _verify(target_dsn, expected, "native")
    _drop_database(target, database)

    def first(table: str, *states: str) -> float:
        return min((seen[table][s] for s in states if s in seen[table]), default=float("nan"))

    synced = max(first(t, "s", "r") for t in seen)
    return {
        "seconds": measured.wall,
        "create_subscription_seconds": created,
        "first_copy_started_seconds": min(first(t, "d", "f", "s", "r") for t in seen),
        "all_synced_seconds": synced,
        "synced_to_ready_seconds": measured.wall - synced,
        "rows": rows,
        "per_table": {
            table: {
                "copy_started_at": round(first(table, "d", "f", "s", "r"), 3),
                "copy_finished_at": round(first(table, "f", "s", "r"), 3),
                "synced_at": round(first(table, "s", "r"), 3),
                "ready_at": round(first(table, "r"), 3),
            }
            for table in sorted(seen)
        },
        **measured.report(),
    }


def _pipe_table(source_dsn: str, target_dsn: str, table: TableName) -> int:
    name = sql.Identifier(table.schema, table.name).as_string(None)
    reader = subprocess.Popen(
        [
            _tool("psql"),
            "-X",
            "-q",  # no "COPY n" status line after the data
            "-d",
            source_dsn,
            "-c",
            f"COPY {name} TO STDOUT (FORMAT binary)",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert reader.stdout is not None
    writer = subprocess.Popen(
        [
            _tool("psql"),
            "-X",
            "-v",
            "ON_ERROR_STOP=1",
            "-d",
            target_dsn,
            "-c",
            f"COPY {name} FROM STDIN (FORMAT binary)",
        ],
        stdin=reader.stdout,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    reader.stdout.close()  # the writer holds the pipe now: a dead writer must stop the reader
    out, err = writer.communicate()
    reader_err = reader.communicate()[1]
    if reader.returncode or writer.returncode:
        raise RuntimeError(f"COPY pipe of {table} failed: {reader_err!r} {err!r}")
    match = re.search(rb"COPY (\d+)", out)
    return int(match.group(1)) if match else 0


def run_pipe(
    source: LocalCluster,
    target: LocalCluster,
    run: int,
    expected: dict[str, int],
    pre_data: Path,
    post_data: Path,
) -> dict[str, Any]:
    database = f"bench_pipe_{run}"
    target_dsn = _create_database(target, database)
    _psql_file(target_dsn, pre_data)
    _quiesce(source, target)
    per_table: dict[str, dict[str, float]] = {}
    with Measured(source, target) as measured:
        for table in TABLES:
            started = time.perf_counter()
            copied = _pipe_table(source.dsn(), target_dsn, table)
            per_table[str(table)] = {"rows": copied, "seconds": time.perf_counter() - started}
        copy_seconds = time.perf_counter() - measured.started
        _psql_file(target_dsn, post_data)
    rows = _verify(target_dsn, expected, "pipe")
    _drop_database(target, database)
    return {
        "seconds": measured.wall,
        "copy_seconds": copy_seconds,
        "post_data_seconds": measured.wall - copy_seconds,
        "rows": rows,
        "per_table": per_table,
        **measured.report(),
    }


# ─── report ──────────────────────────────────────────────────────────────────────────────────


def _median(runs: list[Any]) -> Any:
    """Medians of the numbers of ``runs`` (dicts of the same shape), key by key."""
    first = runs[0]
    if isinstance(first, dict):
        return {k: _median([r[k] for r in runs]) for k in first}
    if isinstance(first, bool) or not isinstance(first, int | float):
        return first
    return statistics.median(runs)


def _rounded(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, float):
        return round(value, 3)
    return value


def _warm_up_task(index: int) -> int:
    """Imports what a copy task imports, so the first measured task does not pay for it."""
    import pgcdc_dagster.engine.snapshot  # noqa: F401

    return index


def spark_master_name(master: str | None) -> str:
    return master or os.environ.get("PGCDC_SPARK_MASTER") or "local[*]"


RATIO_LEGEND = {
    "ours_vs_native": "native seconds to all tables ready / ours seconds, end to end",
    "ours_vs_native_synced": "native seconds to all tables synced / ours seconds",
    "ours_copy_vs_native": "native seconds / our copy phase alone (without our fixed cost)",
    "ours_vs_pipe": "pipe copy + post-data seconds / ours seconds, end to end",
    "ours_copy_vs_pipe_copy": "pipe copy seconds / our copy phase seconds",
    "native_vs_pipe": "pipe seconds / native seconds",
    "cli_vs_native": "native seconds to all tables ready / `pgcdc snapshot` seconds from a "
    "fresh process (Python, Dagster, the run, Spark if needed)",
    "cli_vs_pipe": "pipe copy + post-data seconds / `pgcdc snapshot` seconds from a fresh process",
    "cli_warm_vs_native": "native seconds to all tables ready / `pgcdc snapshot` seconds with "
    "what a first snapshot leaves up: the command server and the warm Spark Connect server",
    "cli_warm_vs_pipe": "pipe copy + post-data seconds / `pgcdc snapshot` seconds with the "
    "command server and the warm Spark Connect server up",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=50, help="pgbench scale (100k rows each)")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--spark-master", default=None, help="default: get_spark's (local[*])")
    parser.add_argument(
        "--parallelism",
        type=int,
        default=None,
        help="copy tasks at a time for ours (default: as many as Spark has cores)",
    )
    parser.add_argument("--rows-per-task", type=int, default=DEFAULT_ROWS_PER_TASK)
    parser.add_argument(
        "--no-warm-up",
        action="store_true",
        help="skip the untimed pipe run before the timed ones (see the module's docstring)",
    )
    parser.add_argument(
        "--methods",
        default="ours,native,pipe",
        help="comma-separated subset of ours,native,pipe,cli,cli_warm (in this order within a "
        "repeat); cli is `pgcdc snapshot` from a fresh process, cold; cli_warm the same with the "
        "command server and the warm Spark Connect server of `pgcdc spark start` up",
    )
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := set(methods) - {"ours", "native", "pipe", "cli", "cli_warm"}:
        parser.error(f"unknown method(s): {', '.join(sorted(unknown))}")

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through the finally below

    signal.signal(signal.SIGTERM, terminate)

    ours_options = {"parallelism": args.parallelism, "target_rows_per_task": args.rows_per_task}
    settings = LOGICAL_SOURCE_SETTINGS
    load_at_start = [round(x, 2) for x in os.getloadavg()]
    source = temporary_cluster(settings, prefix="pgcdc-bench-source-")
    target = temporary_cluster(settings, prefix="pgcdc-bench-target-")
    spark = None
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    try:
        with tempfile.TemporaryDirectory(prefix="pgcdc-bench-snapshot-") as tmp:
            source.start()
            target.start()
            _last_subscription_change[0] = time.monotonic()  # the launcher's first round
            t0 = time.perf_counter()
            pgbench(source, "-i", "-q", "-s", str(args.scale))
            with psycopg.connect(source.dsn(), autocommit=True) as conn:
                # no primary key: needed by our preflight (and harmless: it stays empty)
                conn.execute("ALTER TABLE pgbench_history REPLICA IDENTITY FULL")
                conn.execute(
                    sql.SQL("CREATE PUBLICATION {} FOR TABLE {}").format(
                        sql.Identifier(NATIVE_PUBLICATION),
                        sql.SQL(", ").join(t.sql for t in TABLES),
                    )
                )
                conn.execute("VACUUM ANALYZE")
                sizes: dict[str, tuple[int, int]] = {}
                for table in TABLES:
                    row = conn.execute(
                        "SELECT pg_relation_size(%s::regclass), "
                        "pg_total_relation_size(%s::regclass)",
                        (str(table), str(table)),
                    ).fetchone()
                    assert row is not None
                    sizes[str(table)] = (int(row[0]), int(row[1]))
                version = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
            expected = _row_counts(source.dsn())
            schema, pre_data, post_data = (Path(tmp) / f"{n}.sql" for n in ("full", "pre", "post"))
            _dump(source.dsn(), schema)
            _dump(source.dsn(), pre_data, "--section=pre-data")
            _dump(source.dsn(), post_data, "--section=post-data")
            setup_seconds = time.perf_counter() - t0

            fixed_costs: dict[str, float] = {}
            if "ours" in methods:  # started before any timing: a fixed cost of its own
                t0 = time.perf_counter()
                spark = get_spark(master=args.spark_master)
                fixed_costs["spark_session_start_seconds"] = round(time.perf_counter() - t0, 3)
                t0 = time.perf_counter()
                cores = spark.sparkContext.defaultParallelism
                spark.sparkContext.parallelize(range(cores), cores).map(_warm_up_task).collect()
                fixed_costs["spark_first_job_seconds"] = round(time.perf_counter() - t0, 3)

            methods_run: dict[str, Callable[[int], dict[str, Any]]] = {
                "ours": lambda i: run_ours(source, target, spark, i, expected, ours_options),
                "native": lambda i: run_native(source, target, i, expected, schema),
                "pipe": lambda i: run_pipe(source, target, i, expected, pre_data, post_data),
                "cli": lambda i: run_cli(source, target, i, expected, Path(tmp)),
                "cli_warm": lambda i: run_cli(source, target, i, expected, Path(tmp), warm=True),
            }
            if not args.no_warm_up:
                t0 = time.perf_counter()
                run_pipe(source, target, -1, expected, pre_data, post_data)
                fixed_costs["warm_up_seconds"] = round(time.perf_counter() - t0, 3)
            for i in range(args.repeat):
                # Every other repeat in reverse, so that no method always runs first.
                for method in methods if i % 2 == 0 else methods[::-1]:
                    runs[method].append(methods_run[method](i))
    finally:
        for cluster in (source, target):
            cluster.destroy()
        if spark is not None:
            spark.stop()

    heap_bytes = sum(s[0] for s in sizes.values())
    if "ours" in runs:
        copy_bytes = int(runs["ours"][0]["copy_bytes"])
        mb_basis = "binary COPY bytes of the tables, as our copy counted them"
    else:
        copy_bytes = heap_bytes
        mb_basis = "pg_relation_size of the source tables (ours not run)"
    total_rows = sum(expected.values())
    results: dict[str, Any] = {}
    for method, method_runs in runs.items():
        med = _median(method_runs)
        med.update(_throughput(med["seconds"], total_rows, copy_bytes))
        if "copy_seconds" in med:
            copy = _throughput(med["copy_seconds"], total_rows, copy_bytes)
            med["copy_rows_per_s"], med["copy_mb_per_s"] = copy["rows_per_s"], copy["mb_per_s"]
        results[method] = med

    ratios: dict[str, float] = {}
    if "ours" in results and "native" in results:
        ratios["ours_vs_native"] = results["native"]["seconds"] / results["ours"]["seconds"]
        ratios["ours_vs_native_synced"] = (
            results["native"]["all_synced_seconds"] / results["ours"]["seconds"]
        )
        ratios["ours_copy_vs_native"] = (
            results["native"]["seconds"] / results["ours"]["copy_seconds"]
        )
    if "cli" in results and "native" in results:
        ratios["cli_vs_native"] = results["native"]["seconds"] / results["cli"]["seconds"]
    if "cli" in results and "pipe" in results:
        ratios["cli_vs_pipe"] = results["pipe"]["seconds"] / results["cli"]["seconds"]
    if "cli_warm" in results and "native" in results:
        ratios["cli_warm_vs_native"] = results["native"]["seconds"] / results["cli_warm"]["seconds"]
    if "cli_warm" in results and "pipe" in results:
        ratios["cli_warm_vs_pipe"] = results["pipe"]["seconds"] / results["cli_warm"]["seconds"]
    if "ours" in results and "pipe" in results:
        ratios["ours_vs_pipe"] = results["pipe"]["seconds"] / results["ours"]["seconds"]
        ratios["ours_copy_vs_pipe_copy"] = (
            results["pipe"]["copy_seconds"] / results["ours"]["copy_seconds"]
        )
    if "native" in results and "pipe" in results:
        ratios["native_vs_pipe"] = results["pipe"]["seconds"] / results["native"]["seconds"]

    report = {
        "data": {
            "pgbench_scale": args.scale,
            "rows": total_rows,
            "rows_per_table": expected,
            "mb": round(copy_bytes / MB, 1),
            "mb_basis": mb_basis,
            "heap_mb": round(heap_bytes / MB, 1),
            "total_relation_mb": round(sum(s[1] for s in sizes.values()) / MB, 1),
            "setup_seconds": round(setup_seconds, 1),
        },
        "environment": {
            "cpus": os.cpu_count(),
            "postgres": version,
            "spark_master": spark_master_name(args.spark_master),
            "ours_options": ours_options,
            "cluster_settings": {**THROWAWAY_SETTINGS, **settings},
            "repeat": args.repeat,
            "load_average_at_start": load_at_start,
        },
        "fixed_costs": fixed_costs,
        **_rounded(results),
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "ratios_legend": {k: RATIO_LEGEND[k] for k in ratios},
        # per run: wall seconds and the CPU seconds the rest of the machine used meanwhile
        "runs": {
            m: [
                {"seconds": round(r["seconds"], 3), "other_cpu_seconds": r["cpu_seconds"]["other"]}
                for r in rs
            ]
            for m, rs in runs.items()
        },
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
