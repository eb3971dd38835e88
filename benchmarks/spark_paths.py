"""Where Spark pays off: the base snapshot and one big range, each on three paths, same run.

Paths (``--paths``):

* ``driver``: no Spark. The snapshot's tables are all copied by the driver process (its
  ``psql | psql`` pipes); a range is compacted and staged in process;
* ``local``: a warm local Spark on this machine's cores (``local[2]``), started before the
  timing, its start-up timed apart;
* ``cluster``: a Spark standalone cluster on this machine, started by this script from the
  pyspark wheel (``spark-class`` Master and Workers, each its own process group on loopback,
  killed at the end): a master and ``--workers`` workers of one core and ``--worker-memory``
  each. The engine ships its package to the executors (``addPyFile``) and checks them with a
  job before the first row moves; the session start, that check and a first job are timed
  apart. The executors run ``--executor-python`` (this virtualenv's: the code ships anyway).

Work:

(a) **the base snapshot**, pgbench scale ``--scales`` (each scale a fresh pair of clusters),
    ``pgbench_accounts`` on Spark tasks for ``local`` and ``cluster``
    (``PGCDC_SNAPSHOT_DRIVER_ROWS=--driver-rows``, 100,000: the three small tables stay the
    driver's, as they would in production). Each round measures, in an order that alternates
    between rounds:

    - ``cli``: ``pgcdc snapshot`` from a fresh process with the path's ``PGCDC_*`` env, as a
      user runs it (Dagster on PostgreSQL storage, ``PGCDC_SERVER=off``, a fresh target
      database and Dagster storage each time): the command's wall time, and the copy phase
      alone (the run's ``copy_seconds`` metadata, read back from Dagster's event log).
      ``driver``: no Spark setting at all. ``local``: a command cannot start a local Spark
      warm, so the warm local Spark of the command is the Spark Connect server
      ``pgcdc spark start --master local[2]`` leaves up (started once, before any timing, timed
      apart; its record copied into each run's store); the command attaches to it, ships the
      package and runs the executor check. ``cluster``: ``PGCDC_SPARK_MASTER=spark://...`` and
      ``PGCDC_SPARK_CONF`` (executor Python and memory): the command starts its own Spark
      driver against the running cluster (cold session, overlapping the slot and schema);
    - ``engine``: :func:`take_base_snapshot` in a fresh Python process of its own, the
      session started first (``get_spark``: ``local[2]`` classic, or the cluster), then
      :func:`check_executors`, then a first trivial job, each timed apart: the fixed cost;
      then the snapshot with the warm session: its ``copy_seconds`` and the big table's
      busy seconds over its tasks (one executor core's copy rate);
    - ``native``: PostgreSQL's logical replication initial sync of the same tables into a
      fresh database (``CREATE SUBSCRIPTION`` until every table is ready; tables pre-created
      from ``pg_dump --schema-only``), the peer.

(b) **one range of about ``--changes`` changes**, as ``benchmarks/spark_staging.py`` makes
    it: pgbench scale ``--range-scale`` snapshotted into a target database (the driver copies
    it), which is cloned (``CREATE DATABASE ... TEMPLATE``) into one database per path and
    round, each with a replication origin of its own at the same position; then three ranges
    are received from the slot: ``first``, a short pgbench TPC-B backlog (``--transactions``
    per client, 4 clients: 4,000 changes by default), ``small`` (``--small-changes`` account
    updates) and ``big`` (``--changes`` account updates, one tenth of ``pgbench_accounts`` per
    statement, so every account ends as one net row). Each path applies the three in order
    (``apply_range``, engine level) in a fresh process of its own into its own database, the
    session started before and timed apart (``local[2]`` or the cluster;
    ``spark_min_changes=1``, so every range goes to Spark's executors). Fixed cost: the
    session start, the check, a first job, and the ``first`` range (what a path's first
    range pays once: Python workers, imports, connections); rate: changes/s of ``big``, and
    between ``small`` and ``big`` (the line through the two sizes; its intercept is the cost
    every range pays). Spark's REST API gives the executors' busy time over the apply's stages
    and the busiest stage's tasks (one executor core's staging rate, Spark's per-task costs).

Every target (snapshot: CLI, engine and native; range: every path's) is compared with the
source (``harness.require_equal``): row count and a content hash per table (the sum of a 64-bit
hash of each row's text, ``hashtextextended``, in sessions that print values the same way:
duplicates count, order does not; the source's once per data set, since nothing writes it
meanwhile). A mismatch fails the run.

Every measurement records ``os.getloadavg()`` at its start and, over its wall time, the CPU
seconds (``harness.CpuMeter``) of the source and target clusters, this script's process tree
(commands, children, the Spark cluster, its executors, the Spark JVMs they leave behind: this
process is a child subreaper, see :func:`become_subreaper`), the warm Connect server and
``others``: the rest of
the machine (other people's tests), so a slow figure can be told from a busy machine. (The
split between the trees is good to a couple of CPU-seconds: a process orphaned inside one
tree is counted in ``ours`` from then on.)

Usage::

    SPARK_LOCAL_IP=127.0.0.1 .venv/bin/python benchmarks/spark_paths.py \\
        --scales 10,50 --changes 3000000 --paths driver,local,cluster [--rounds 2] \\
        [--range-rounds 2] [--json results.json]

A smoke run: ``--scales 1 --changes 100000 --small-changes 20000 --rounds 1 --range-rounds 1
--range-scale 1``. Raw results go to ``--json`` (and stdout's last block); Markdown tables are
printed to stderr at the end. ``--profile production|throwaway``: the clusters' settings
(``benchmarks/harness.py``'s profiles; production by default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness
from harness import median, rounded

REPO = harness.REPO
MB = harness.MB
PATHS = ("driver", "local", "cluster")
LOCAL_MASTER = "local[2]"
ACCOUNTS = "public.pgbench_accounts"
SNAPSHOT_PUBLICATION = "bench_paths_pub"
NATIVE_PUBLICATION = "bench_native_pub"

# ─── small helpers ───────────────────────────────────────────────────────────────────────────


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def load_now() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def child_env(**extra: str) -> dict[str, str]:
    """This environment without any ``PGCDC_*`` or Dagster setting of the caller's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PGCDC_", "DAGSTER_"))}
    env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    env.update(extra)
    return env


def run_child(kind: str, params: dict[str, Any], timeout: float = 1800) -> dict[str, Any]:
    """This script's ``--child kind`` in a fresh Python process; its last stdout line, parsed."""
    done = subprocess.run(
        [sys.executable, __file__, "--child", kind, json.dumps(params)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"child {kind} failed ({done.returncode}): {done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ─── CPU over a measurement: harness.CpuMeter, this process a child subreaper ─────────────────


def meter(roots: dict[str, int]) -> harness.CpuMeter:
    """:class:`harness.CpuMeter` over ``roots``, the adopted orphans reaped before its end."""
    return harness.CpuMeter(roots, settle=reap_adopted)


# A process whose parent exits is handed to init, and its CPU time with it: a Spark JVM
# outlives the Python that started it (a child of ours, or a `pgcdc` command), so without
# this the JVM's CPU would count as the rest of the machine's. As a child subreaper, this
# process adopts such orphans (they stay in its tree) and reaps them once they exit, so their
# CPU lands in its own children's time.
_OWN_CHILDREN: set[int] = set()
"""Children this process waits for itself (the cluster's daemons): never reaped here."""


def become_subreaper() -> None:
    import ctypes

    pr_set_child_subreaper = 36
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)


def reap_adopted() -> None:
    """Reap the adopted orphans that have exited (zombie children not started by us)."""
    me = str(os.getpid())
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in _OWN_CHILDREN:
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = text[text.rindex(")") + 2 :].split()[:2]
        if ppid == me and state == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(entry), os.WNOHANG)


# ─── a Spark standalone cluster from the pyspark wheel ───────────────────────────────────────


class StandaloneCluster:
    """A master and one-core workers, each a ``spark-class`` JVM in a process group of its
    own on loopback; :meth:`stop` kills every group (and the executors in them)."""

    def __init__(self, directory: Path, workers: int, memory: str) -> None:
        import pyspark

        self.home = Path(pyspark.__file__).resolve().parent
        self.directory = directory
        self.workers = workers
        self.memory = memory
        self.processes: list[subprocess.Popen[bytes]] = []
        self.work_dirs: list[Path] = []
        self.url = ""
        self.started_s = 0.0

    def _env(self) -> dict[str, str]:
        # The workers' (hence the executors') environment: loopback, nothing of this Python's
        # path: what the executors import is the application's business (the shipped zip).
        dropped = ("PYTHON", "PYSPARK", "PG", "DAGSTER", "SPARK", "VIRTUAL_ENV")
        env = {k: v for k, v in os.environ.items() if not k.startswith(dropped)}
        env.update(
            SPARK_HOME=str(self.home),
            SPARK_LOCAL_IP="127.0.0.1",
            SPARK_DAEMON_MEMORY="256m",
            SPARK_DAEMON_JAVA_OPTS="-XX:+UseSerialGC -XX:TieredStopAtLevel=1",
            SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
        )
        return env

    def _spawn(self, args: list[str], logfile: Path) -> subprocess.Popen[bytes]:
        with open(logfile, "wb") as sink:
            process = subprocess.Popen(
                [str(self.home / "bin" / "spark-class"), *args],
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.directory,
            )
        self.processes.append(process)
        _OWN_CHILDREN.add(process.pid)
        return process

    def start(self, timeout: float = 120.0) -> StandaloneCluster:
        from pgcdc_dagster.engine.spark.server import free_port

        self.directory.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        master_log = self.directory / "master.log"
        self._spawn(
            ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
             "--port", str(free_port()), "--webui-port", str(free_port())],
            master_log,
        )  # fmt: skip
        found = self._wait(
            master_log, lambda t: re.search(r"Starting Spark master at (spark://\S+)", t), timeout
        )
        self.url = found.group(1)
        for n in range(self.workers):
            work = self.directory / f"worker-{n}"
            work.mkdir()
            self.work_dirs.append(work)
            self._spawn(
                ["org.apache.spark.deploy.worker.Worker", self.url, "--host", "127.0.0.1",
                 "--cores", "1", "--memory", self.memory, "--work-dir", str(work),
                 "--webui-port", str(free_port())],
                self.directory / f"worker-{n}.log",
            )  # fmt: skip
        self._wait(master_log, lambda t: t.count("Registering worker") >= self.workers, timeout)
        self.started_s = time.monotonic() - started
        return self

    def _wait(self, logfile: Path, ready: Any, timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            text = logfile.read_text(errors="replace") if logfile.exists() else ""
            found = ready(text)
            if found:
                return found
            dead = [p for p in self.processes if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"Spark cluster did not start: {text[-2000:]}")
            time.sleep(0.1)

    def task_lines(self, app_id: str) -> list[str]:
        lines: list[str] = []
        for work in self.work_dirs:
            for stderr in sorted(work.glob(f"{app_id}/*/stderr")):
                lines += [
                    ln for ln in stderr.read_text(errors="replace").splitlines()
                    if "pgcdc task:" in ln
                ]  # fmt: skip
        return lines

    def stop(self) -> None:
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in reversed(self.processes):
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # executors left in the group
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        self.processes.clear()


TASK_COPY = re.compile(
    r"pgcdc task: copied ([\d,]+) rows, ([\d,]+) bytes of (\S+) .* in ([\d.]+) s"
)


def copy_task_rates(lines: list[str], table: str = ACCOUNTS) -> dict[str, Any] | None:
    """One executor core's copy rate from the tasks' own lines (rows, bytes, seconds)."""
    tasks = [m.groups() for ln in lines if (m := TASK_COPY.search(ln)) and m.group(3) == table]
    if not tasks:
        return None
    rows = sum(int(r.replace(",", "")) for r, _, _, _ in tasks)
    nbytes = sum(int(b.replace(",", "")) for _, b, _, _ in tasks)
    seconds = sum(float(s) for _, _, _, s in tasks)
    return {
        "tasks": len(tasks),
        "rows": rows,
        "busy_s": round(seconds, 3),
        "rows_per_s": round(rows / seconds) if seconds else None,
        "mb_per_s": round(nbytes / MB / seconds, 1) if seconds else None,
        "task_seconds": [float(s) for _, _, _, s in tasks],
    }


# ─── Spark in a child: session, check, first job, REST metrics ───────────────────────────────


def _noop(x: int) -> int:
    return x


def start_session(path: str, master: str, conf: dict[str, str], servers: dict[str, str]) -> Any:
    """The warm session of a path, its start-up split: (spark, fixed-cost dict)."""
    from pgcdc_dagster.engine.spark.executors import check_executors
    from pgcdc_dagster.engine.spark.session import get_spark

    t0 = time.perf_counter()
    spark = get_spark(master=master, conf=conf)
    session_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    check = check_executors(spark, servers)
    check_s = time.perf_counter() - t0
    sc = spark.sparkContext
    cores = sc.defaultParallelism
    t0 = time.perf_counter()
    sc.parallelize(range(cores), cores).map(_noop).collect()
    first_s = time.perf_counter() - t0
    return spark, {
        "session_start_s": round(session_s, 3),
        "executor_check_s": round(check_s, 3) if check is not None else None,
        "first_job_s": round(first_s, 3),
        "fixed_s": round(session_s + check_s + first_s, 3),
        "cores": cores,
        "application_id": sc.applicationId,
        "master": str(sc.master),
        "executor_python": None if check is None else check.python,
    }


def stages(spark: Any) -> dict[int, dict[str, Any]]:
    """Completed stages of the application, from Spark's REST API (UI on)."""
    sc = spark.sparkContext
    url = sc.uiWebUrl
    if not url:
        return {}
    with urllib.request.urlopen(
        f"{url}/api/v1/applications/{sc.applicationId}/stages?status=complete", timeout=20
    ) as resp:
        found = json.load(resp)
    return {(s["stageId"] * 100 + s["attemptId"]): s for s in found}


def _tasks_of(spark: Any, stage: dict[str, Any]) -> dict[str, Any]:
    """The tasks of one stage: where their time went (Spark's own task metrics)."""
    sc = spark.sparkContext
    url = (
        f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}/stages/{stage['stageId']}/"
        f"{stage['attemptId']}/taskList?length=10000"
    )
    with urllib.request.urlopen(url, timeout=20) as resp:
        tasks = json.load(resp)

    def total(key: str, scale: float = 1000.0) -> float:
        return round(sum((t.get("taskMetrics") or {}).get(key, 0) for t in tasks) / scale, 3)

    return {
        "name": stage.get("name", "")[:60],
        "tasks": len(tasks),
        "duration_s": [round(t.get("duration", 0) / 1000, 3) for t in tasks],
        "executors": sorted({t.get("executorId") for t in tasks}),
        "run_s": total("executorRunTime"),
        "cpu_s": total("executorCpuTime", 1e9),
        "deserialize_s": total("executorDeserializeTime"),
        "gc_s": total("jvmGcTime"),
        "scheduler_delay_s": round(sum(t.get("schedulerDelay", 0) for t in tasks) / 1000, 3),
    }


def stage_work(spark: Any, before: dict[int, dict[str, Any]]) -> dict[str, Any]:
    time.sleep(1.0)  # the listener bus settles the last stage's metrics
    new = [s for k, s in stages(spark).items() if k not in before]
    busiest = max(new, key=lambda s: s.get("executorRunTime", 0), default=None)
    return {
        "busiest_stage": None if busiest is None else _tasks_of(spark, busiest),
        "stages": len(new),
        "tasks": sum(s.get("numCompleteTasks", 0) for s in new),
        "executor_run_s": round(sum(s.get("executorRunTime", 0) for s in new) / 1000, 3),
        "executor_cpu_s": round(sum(s.get("executorCpuTime", 0) for s in new) / 1e9, 3),
        "per_stage": [
            {
                "name": s.get("name", "")[:60],
                "tasks": s.get("numCompleteTasks"),
                "executor_run_s": round(s.get("executorRunTime", 0) / 1000, 3),
            }
            for s in sorted(new, key=lambda s: s["stageId"])
        ],
    }


def spark_conf_for(path: str, params: dict[str, Any]) -> tuple[str, dict[str, str]]:
    if path == "local":
        return LOCAL_MASTER, {"spark.ui.enabled": "true"}  # for the REST API's stage metrics
    return params["cluster_url"], {
        "spark.pyspark.python": params["executor_python"],
        "spark.executor.memory": params["executor_memory"],
    }


# ─── child: the engine's base snapshot with a warm session ───────────────────────────────────


def child_snapshot(params: dict[str, Any]) -> dict[str, Any]:
    from pgcdc_dagster.engine.identifiers import TableName
    from pgcdc_dagster.engine.snapshot import take_base_snapshot

    path = params["path"]
    servers = {"source": params["source_dsn"], "target": params["target_dsn"]}
    fixed: dict[str, Any] = {}
    spark: Any = None
    if path != "driver":
        master, conf = spark_conf_for(path, params)
        spark, fixed = start_session(path, master, conf, servers)

    def no_spark() -> Any:
        raise RuntimeError("the driver path must not start Spark")

    before = stages(spark) if spark is not None else {}
    tables = [TableName(*t.split(".", 1)) for t in params["tables"]]
    t0 = time.perf_counter()
    result = take_base_snapshot(
        params["source_dsn"],
        params["target_dsn"],
        params["slot"],
        SNAPSHOT_PUBLICATION,
        tables,
        spark=spark if spark is not None else no_spark,
        driver_max_rows=sys.maxsize if path == "driver" else params["driver_rows"],
    )
    wall = time.perf_counter() - t0
    work = stage_work(spark, before) if spark is not None else None
    lines: list[str] = []
    if path == "local":  # the Python workers' stderr goes to the JVM's log
        jvm_log = Path(tempfile.gettempdir()) / f"pgcdc-spark-{os.getpid()}.log"
        if jvm_log.exists():
            lines = [ln for ln in jvm_log.read_text(errors="replace").splitlines()
                     if "pgcdc task:" in ln]  # fmt: skip
    per_table = {
        str(t.table): {
            "rows": t.rows,
            "bytes": t.bytes,
            "busy_s": t.seconds,
            "tasks": t.tasks,
            "copied_by": t.copied_by,
        }
        for t in result.tables
    }
    if spark is not None:
        spark.stop()
    return {
        "path": path,
        **fixed,
        "seconds": round(wall, 3),
        "snapshot_seconds": round(result.seconds, 3),
        "copy_s": round(result.copy_seconds, 3),
        "pre_data_s": round(result.pre_data.seconds, 3),
        "post_data_s": round(result.post_data.seconds, 3),
        "rows": result.rows,
        "copy_bytes": sum(t.bytes or 0 for t in result.tables),
        "per_table": per_table,
        "spark_stages": work,
        "task_lines": lines,
        "driver_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


# ─── child: apply the two ranges with a warm session ─────────────────────────────────────────


def child_range(params: dict[str, Any]) -> dict[str, Any]:
    from pgcdc_dagster.engine.apply.transaction import apply_range
    from pgcdc_dagster.engine.lsn import LsnRange
    from pgcdc_dagster.engine.store.output_store import OutputStore

    path = params["path"]
    store = OutputStore(Path(params["store"]))
    fixed: dict[str, Any] = {}
    spark: Any = None
    if path != "driver":
        master, conf = spark_conf_for(path, params)
        spark, fixed = start_session(path, master, conf, {"target": params["target_dsn"]})
    applied = []
    for key in params["ranges"]:
        stored = store.get(LsnRange.from_key(key))
        assert stored is not None, key
        before = stages(spark) if spark is not None else {}
        t0 = time.perf_counter()
        result = apply_range(
            params["target_dsn"], stored, params["origin"], spark=spark,
            spark_min_changes=1, store=store,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        work = stage_work(spark, before) if spark is not None else None
        applied.append(
            {
                "range": key,
                "seconds": round(seconds, 3),
                "status": str(result.status),
                **harness.apply_split(result),
                "spark_stages": work,
            }
        )
    if spark is not None:
        spark.stop()
    return {
        "path": path,
        **fixed,
        "ranges": applied,
        "driver_peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }


# ─── the snapshot measurements ───────────────────────────────────────────────────────────────


class SnapshotBench:
    """One data set (a pgbench scale) on a source and a target cluster, measured many ways."""

    def __init__(self, args: argparse.Namespace, work: Path, scale: int, ctx: dict[str, Any]):
        self.args = args
        self.work = work
        self.scale = scale
        self.ctx = ctx  # cluster url, warm server record, roots

    def setup(self, stack: contextlib.ExitStack) -> dict[str, Any]:
        t0 = time.perf_counter()
        profile = self.args.profile
        clusters = harness.bench_clusters(profile, logical_target=True, prefix="pgcdc-paths-")
        _, self.source, self.target = stack.enter_context(clusters)
        harness.fill_pgbench(self.source, self.scale, analyse=False)
        self.tables = [str(t) for t in harness.PGBENCH_TABLES]
        harness.create_publication(self.source.dsn(), NATIVE_PUBLICATION, self.tables)
        with psycopg.connect(self.source.dsn(), autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
            (heap,) = conn.execute(  # type: ignore[misc]
                "SELECT pg_relation_size('pgbench_accounts')"
            ).fetchone()
        t1 = time.perf_counter()
        self.expected = harness.fingerprints(self.source.dsn(), self.tables)
        fingerprint_s = time.perf_counter() - t1
        self.schema = harness.dump_schema(self.source.dsn(), self.tables)
        self.roots = {
            "source_pg": harness.postmaster_pid(self.source),
            "target_pg": harness.postmaster_pid(self.target),
            "ours": os.getpid(),
            "warm_connect_server": self.ctx.get("connect_server_pid", 0),
        }
        return {
            "scale": self.scale,
            "rows": sum(v[0] for v in self.expected.values()),
            "accounts_rows": self.expected[ACCOUNTS][0],
            "accounts_heap_mb": round(heap / MB, 1),
            "setup_s": round(time.perf_counter() - t0, 1),
            "source_fingerprint_s": round(fingerprint_s, 2),
        }

    def _cleanup(self, database: str, slot: str | None) -> None:
        from pgcdc_dagster.engine.identifiers import origin_name

        if slot is not None:
            with psycopg.connect(self.source.dsn(), autocommit=True) as conn:
                conn.execute(
                    "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                    "WHERE slot_name = %s",
                    (slot,),
                )
            with psycopg.connect(self.target.dsn(), autocommit=True) as conn:
                if conn.execute(
                    "SELECT FROM pg_replication_origin WHERE roname = %s", (origin_name(slot),)
                ).fetchone():
                    conn.execute("SELECT pg_replication_origin_drop(%s)", (origin_name(slot),))
        harness.drop_database(self.target, database)

    # -- the command --------------------------------------------------------------------------

    def cli(self, path: str, run: str) -> dict[str, Any]:
        name = f"cli_{path}_{run}"
        store = self.work / f"store_{name}"
        store.mkdir()
        # A user's Dagster storage already has its schema: made outside the timing.
        env = harness.pgcdc_env(
            self.work,
            self.source.dsn(),
            self.target,
            name,
            publication=SNAPSHOT_PUBLICATION,
            tables=self.tables,
            store=store,
            base_env=child_env(),
        )
        target_dsn = env["PGCDC_TARGET_DSN"]
        if path == "local":
            shutil.copy(self.ctx["connect_record"], store / "spark-connect.json")
            env["PGCDC_SNAPSHOT_DRIVER_ROWS"] = str(self.args.driver_rows)
        elif path == "cluster":
            env["PGCDC_SPARK_MASTER"] = self.ctx["cluster_url"]
            env["PGCDC_SPARK_CONF"] = (
                f"spark.pyspark.python={self.args.executor_python}; "
                f"spark.executor.memory={self.args.executor_memory}"
            )
            env["PGCDC_SNAPSHOT_DRIVER_ROWS"] = str(self.args.driver_rows)
        harness.checkpoint(self.source, self.target, sync=True)
        with meter(self.roots) as measured:
            _, done = harness.run_command(env, self.work, "snapshot")
        storage = f"dagster_{name}"
        meta = snapshot_metadata(self.target.dsn(storage))
        app = re.search(r"Spark application (\S+)", done.stdout)
        out: dict[str, Any] = {
            "seconds": round(measured.wall, 3),
            "engine_seconds": meta.get("seconds"),
            "copy_s": meta.get("copy_seconds"),
            "accounts": (meta.get("tables") or {}).get(ACCOUNTS),
            "spark_application_id": app.group(1) if app else None,
            "stdout": done.stdout.strip(),
            **measured.report(),
        }
        if path == "cluster" and app and self.ctx.get("cluster") is not None:
            out["executor_copy"] = copy_task_rates(self.ctx["cluster"].task_lines(app.group(1)))
        out["verify"] = harness.require_equal(
            self.expected, target_dsn, f"cli {path} scale {self.scale}"
        )
        self._cleanup(name, name)
        harness.drop_database(self.target, storage)
        return out

    # -- the engine, a warm session -----------------------------------------------------------

    def engine(self, path: str, run: str) -> dict[str, Any]:
        name = f"eng_{path}_{run}"
        target_dsn = harness.create_database(self.target, name)
        params = {
            "path": path,
            "source_dsn": self.source.dsn(),
            "target_dsn": target_dsn,
            "slot": name,
            "tables": self.tables,
            "driver_rows": self.args.driver_rows,
            "cluster_url": self.ctx.get("cluster_url"),
            "executor_python": self.args.executor_python,
            "executor_memory": self.args.executor_memory,
        }
        harness.checkpoint(self.source, self.target, sync=True)
        with meter(self.roots) as measured:
            out = run_child("snapshot", params)
        out.update(measured.report(), process_wall_s=round(measured.wall, 3))
        lines = out.pop("task_lines", [])
        if path == "cluster" and self.ctx.get("cluster") is not None:
            lines = self.ctx["cluster"].task_lines(out["application_id"])
        out["executor_copy"] = copy_task_rates(lines) if lines else None
        out["verify"] = harness.require_equal(
            self.expected, target_dsn, f"engine {path} scale {self.scale}"
        )
        self._cleanup(name, name)
        return out

    # -- native logical replication's initial sync --------------------------------------------

    def native(self, run: str) -> dict[str, Any]:
        name = f"native_{run}"
        target_dsn = harness.create_database(self.target, name)
        harness.psql(target_dsn, self.schema)
        subscription = harness.Subscription(self.source.dsn(), target_dsn, name, NATIVE_PUBLICATION)
        harness.wait_for_launcher(target_dsn)
        harness.checkpoint(self.source, self.target, sync=True)
        with (
            psycopg.connect(target_dsn, autocommit=True) as conn,
            meter(self.roots) as measured,
        ):
            subscription.create(conn=conn)
            subscription.wait_ready(timeout=1800, conn=conn)
        subscription.drop()
        out = {"seconds": round(measured.wall, 3), **measured.report()}
        out["verify"] = harness.require_equal(
            self.expected, target_dsn, f"native scale {self.scale}"
        )
        self._cleanup(name, None)
        return out


def snapshot_metadata(storage_dsn: str) -> dict[str, Any]:
    """``seconds``, ``copy_seconds`` and the per-table records of the run's ``base_snapshot``
    materialisation, read from Dagster's event log (serialised JSON: ``metadata_entries``, each
    a ``label`` and its ``entry_data``)."""
    with psycopg.connect(storage_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT event FROM event_logs WHERE dagster_event_type = 'ASSET_MATERIALIZATION' "
            "AND event LIKE '%copy_seconds%' ORDER BY id DESC LIMIT 1"
        ).fetchall()
    found: dict[str, Any] = {}

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            label, data = node.get("label"), node.get("entry_data")
            if label in ("seconds", "copy_seconds") and isinstance(data, dict):
                found[label] = data.get("value")
            elif label == "tables" and isinstance(data, dict):
                found["tables"] = {
                    r["data"]["table"]: r["data"] for r in data.get("records", []) if "data" in r
                }
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    if rows:
        walk(json.loads(rows[0][0]))
    return found


# ─── the range measurements ──────────────────────────────────────────────────────────────────


def range_bench(args: argparse.Namespace, ctx: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    from pgcdc_dagster.engine.control import pipeline

    def no_spark() -> Any:
        raise RuntimeError("the range's setup copies everything from the driver")

    with harness.bench_clusters(args.profile, extra=harness.QUIET) as (work, source, target):
        t0 = time.perf_counter()
        prep = argparse.Namespace(
            scale=args.range_scale, transactions=args.transactions, range_mb=1 << 20,
            workload="tpcb",
        )  # fmt: skip
        setup = harness.prepare(source, target, no_spark, work / "store", prep)
        settings = setup.settings
        harness.drop_slot(source.dsn(), harness.NATIVE_SLOT)
        harness.drop_database(target, harness.DB_NATIVE)
        targets = {
            (r, p): f"bench_r{r}_{p}" for r in range(args.range_rounds) for p in paths
        }  # fmt: skip
        for db in targets.values():
            harness.clone_database(target, harness.DB_OURS, db)
        with psycopg.connect(target.dsn(harness.DB_OURS), autocommit=True) as conn:
            (progress,) = conn.execute(  # type: ignore[misc]
                "SELECT pg_replication_origin_progress(%s, true)::text", (settings.origin,)
            ).fetchone()
            for db in targets.values():
                conn.execute("SELECT pg_replication_origin_create(%s)", (db,))
                conn.execute("SELECT pg_replication_origin_advance(%s, %s::pg_lsn)", (db, progress))
        setup_s = time.perf_counter() - t0

        ranges = []
        start = pipeline.store_of(settings).consistent_point()
        last_end = None
        # "first": the short pgbench backlog alone (a warm-up: what a path's first range
        # pays once, Python workers, imports, connections), then the two sizes.
        sizes = (("first", 0), ("small", args.small_changes), ("big", args.changes))
        for label, count in sizes:
            t0 = time.perf_counter()
            written = harness.bulk_updates(source.dsn(), count)
            bulk_s = time.perf_counter() - t0
            with psycopg.connect(source.dsn(), autocommit=True) as conn:
                conn.execute("CHECKPOINT")
            end = pipeline.resolve_endpos(settings, "current")
            rng = pipeline.plan_next_range(start, last_end, end, 1 << 60)
            assert rng is not None
            t0 = time.perf_counter()
            received = pipeline.receive_range(settings, rng)
            ranges.append(
                {
                    "label": label,
                    "key": rng.key,
                    "account_updates": written,
                    "changes": received.changes,
                    "transactions": received.transactions,
                    "wal_mb": round((rng.end - rng.start) / MB, 1),
                    "bulk_s": round(bulk_s, 1),
                    "receive_s": round(time.perf_counter() - t0, 1),
                }
            )
            last_end = rng.end
            log(f"range {label}: {received.changes:,} changes received")
        expected = harness.fingerprints(source.dsn(), harness.user_tables(source.dsn()))
        roots = {
            "source_pg": harness.postmaster_pid(source),
            "target_pg": harness.postmaster_pid(target),
            "ours": os.getpid(),
            "warm_connect_server": ctx.get("connect_server_pid", 0),
        }
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
        orders = []
        for r in range(args.range_rounds):
            order = harness.order_of(paths, r)
            orders.append(order)
            for path in order:
                db = targets[(r, path)]
                params = {
                    "path": path,
                    "target_dsn": target.dsn(db),
                    "store": settings.store,
                    "ranges": [x["key"] for x in ranges],
                    "origin": db,
                    "cluster_url": ctx.get("cluster_url"),
                    "executor_python": args.executor_python,
                    "executor_memory": args.executor_memory,
                }
                log(f"range round {r} {path} (load {load_now()})")
                harness.checkpoint(source, target)
                with meter(roots) as measured:
                    out = run_child("range", params)
                out.update(measured.report(), process_wall_s=round(measured.wall, 3))
                out["verify"] = harness.require_equal(
                    expected, target.dsn(db), f"range {path} round {r}"
                )
                log(
                    f"  {path}: "
                    + ", ".join(f"{x['seconds']:.1f} s" for x in out["ranges"])
                    + f" (fixed {out.get('fixed_s')})"
                )
                runs[path].append(out)
                harness.drop_database(target, db)
        return {
            "scale": args.range_scale,
            "setup_s": round(setup_s, 1),
            "ranges": ranges,
            "orders": orders,
            "runs": runs,
        }


# ─── summaries ───────────────────────────────────────────────────────────────────────────────


def line_fit(points: list[tuple[float, float]]) -> tuple[float | None, float | None]:
    """(rate in units/s, intercept s) of t = intercept + n / rate from (n, t) at two sizes."""
    if len(points) < 2:
        return None, None
    (n1, t1), (n2, t2) = sorted(points)[0], sorted(points)[-1]
    if n2 <= n1 or t2 <= t1:
        return None, None
    rate = (n2 - n1) / (t2 - t1)
    return rate, t1 - n1 / rate


def summarise_snapshot(snap: dict[int, dict[str, Any]], paths: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in paths:
        per_scale = {}
        for scale, data in snap.items():
            eng = data["engine"].get(path, [])
            cli = data["cli"].get(path, [])
            rows = data["data"]["rows"]
            acc = data["data"]["accounts_rows"]
            copy_bytes = median([e["copy_bytes"] for e in eng])
            acc_bytes = median([e["per_table"][ACCOUNTS]["bytes"] for e in eng])
            acc_busy = median([e["per_table"][ACCOUNTS]["busy_s"] for e in eng])
            eng_copy = median([e["copy_s"] for e in eng])
            ex = [e["executor_copy"] for e in eng if e.get("executor_copy")]
            per_scale[scale] = {
                "rows": rows,
                "copy_mb": None if copy_bytes is None else round(copy_bytes / MB, 1),
                "cli_s": median([c["seconds"] for c in cli]),
                "cli_copy_s": median([c["copy_s"] for c in cli]),
                "cli_runs": [c["seconds"] for c in cli],
                "engine_s": median([e["snapshot_seconds"] for e in eng]),
                "engine_copy_s": eng_copy,
                "engine_copy_runs": [e["copy_s"] for e in eng],
                "session_start_s": median([e.get("session_start_s") for e in eng]),
                "executor_check_s": median([e.get("executor_check_s") for e in eng]),
                "first_job_s": median([e.get("first_job_s") for e in eng]),
                "fixed_s": median([e.get("fixed_s") for e in eng]),
                "copy_rows_per_s": round(rows / eng_copy) if eng_copy else None,
                "copy_mb_per_s": round(copy_bytes / MB / eng_copy, 1)
                if eng_copy and copy_bytes
                else None,
                "accounts_busy_s": acc_busy,
                "accounts_tasks": median([e["per_table"][ACCOUNTS]["tasks"] for e in eng]),
                "per_core_rows_per_s": round(acc / acc_busy) if acc_busy else None,
                "per_core_mb_per_s": round(acc_bytes / MB / acc_busy, 1)
                if acc_busy and acc_bytes
                else None,
                "executor_task_seconds": [t for x in ex for t in x["task_seconds"]],
            }
        scales = sorted(per_scale)
        marginal = {}
        for key in ("engine_copy_s", "cli_copy_s", "cli_s"):
            pts = [(per_scale[s]["rows"], per_scale[s][key]) for s in scales
                   if per_scale[s][key] is not None]  # fmt: skip
            rate, intercept = line_fit(pts)
            marginal[key] = {
                "rows_per_s": None if rate is None else round(rate),
                "intercept_s": None if intercept is None else round(intercept, 2),
            }
        if len(scales) >= 2:
            s1, s2 = scales[0], scales[-1]
            mb1, mb2 = per_scale[s1]["copy_mb"], per_scale[s2]["copy_mb"]
            c1, c2 = per_scale[s1]["engine_copy_s"], per_scale[s2]["engine_copy_s"]
            if None not in (mb1, mb2, c1, c2) and c2 > c1:
                marginal["engine_copy_s"]["mb_per_s"] = round((mb2 - mb1) / (c2 - c1), 1)
        out[path] = {"per_scale": per_scale, "marginal_between_scales": marginal}
    return out


def summarise_range(rng: dict[str, Any], paths: list[str]) -> dict[str, Any]:
    labels = [x["label"] for x in rng["ranges"]]
    i_first, i_small, i_big = labels.index("first"), labels.index("small"), labels.index("big")
    out: dict[str, Any] = {}
    for path in paths:
        runs = rng["runs"][path]
        first = [r["ranges"][i_first] for r in runs]
        small = [r["ranges"][i_small] for r in runs]
        big = [r["ranges"][i_big] for r in runs]
        n_small, n_big = small[0]["changes"], big[0]["changes"]
        t_first = median([x["seconds"] for x in first])
        t_small = median([x["seconds"] for x in small])
        t_big = median([x["seconds"] for x in big])
        rate, intercept = line_fit(
            [(n_small, t_small), (n_big, t_big)] if t_small and t_big else []
        )
        run_s = [x["spark_stages"]["executor_run_s"] for x in big if x.get("spark_stages")]
        ex_run = median(run_s)
        session = median([r.get("fixed_s") for r in runs])
        out[path] = {
            "session_start_s": median([r.get("session_start_s") for r in runs]),
            "executor_check_s": median([r.get("executor_check_s") for r in runs]),
            "first_job_s": median([r.get("first_job_s") for r in runs]),
            "session_fixed_s": session,
            "first_range_changes": first[0]["changes"],
            "first_range_s": t_first,
            "fixed_s": round((session or 0.0) + (t_first or 0.0), 3),
            "small_changes": n_small,
            "small_s": t_small,
            "small_runs": [x["seconds"] for x in small],
            "big_changes": n_big,
            "big_net_rows": big[0]["net_rows"],
            "big_s": t_big,
            "big_runs": [x["seconds"] for x in big],
            "big_changes_per_s": round(n_big / t_big) if t_big else None,
            "big_split": {
                k: median([x[k] for x in big]) for k in ("compaction_s", "staging_s", "apply_s")
            },
            "marginal_changes_per_s": None if rate is None else round(rate),
            "intercept_s": None if intercept is None else round(intercept, 2),
            "executor_run_s": ex_run,
            "per_core_changes_per_s": round(n_big / ex_run) if ex_run else None,
            "driver_peak_rss_mb": median([r["driver_peak_rss_mb"] for r in runs]),
        }
    return out


def print_table(report: dict[str, Any]) -> str:
    """The medians in two Markdown tables: the snapshot's per path and scale, the range's per
    path."""
    tables: list[str] = []
    snap = report.get("summary", {}).get("snapshot", {})
    native = report.get("summary", {}).get("native", {})
    if snap:
        rows = []
        for path, data in snap.items():
            for scale, s in data["per_scale"].items():
                fixed = f"{s['session_start_s']}+{s['executor_check_s']}+{s['first_job_s']}"
                rows.append(
                    [path, scale, f"{s['fixed_s']} ({fixed})", s["engine_copy_s"],
                     f"{s['copy_rows_per_s']}, {s['copy_mb_per_s']}",
                     f"{s['per_core_rows_per_s']}, {s['per_core_mb_per_s']}",
                     f"{s['cli_s']} ({s['cli_copy_s']})", native.get(scale, {}).get("seconds")]
                )  # fmt: skip
            m = data["marginal_between_scales"]
            rows.append(
                [path, "marginal", "-", m["engine_copy_s"], "-", "-",
                 f"{m['cli_s']} (copy phase {m['cli_copy_s']})", "-"]
            )  # fmt: skip
        header = ["path", "scale", "fixed s (session+check+first job)", "engine copy s",
                  "copy rows/s, MB/s", "per core rows/s, MB/s",
                  "pgcdc snapshot s (its copy phase s)", "native s"]  # fmt: skip
        tables.append("Snapshot (medians)\n\n" + harness.markdown_table(header, rows))
    rng = report.get("summary", {}).get("range", {})
    if rng:
        rows = []
        for path, r in rng.items():
            fixed = (
                f"{r['session_start_s']}+{r['executor_check_s']}+{r['first_job_s']}"
                f"+{r['first_range_s']}"
            )
            rows.append(
                [path, f"{r['fixed_s']} ({fixed})", f"{r['small_changes']:,}, {r['small_s']}",
                 f"{r['big_changes']:,}, {r['big_s']}, {r['big_changes_per_s']}",
                 f"{r['marginal_changes_per_s']}, {r['intercept_s']}",
                 f"{r['executor_run_s']}, {r['per_core_changes_per_s']}",
                 r["driver_peak_rss_mb"]]
            )  # fmt: skip
        header = ["path", "fixed s (session start+check+first job+first range)",
                  "small: changes, s", "big: changes, s, changes/s",
                  "marginal changes/s, intercept s", "executor run s, per core changes/s",
                  "driver RSS MB"]  # fmt: skip
        tables.append("Range (medians)\n\n" + harness.markdown_table(header, rows))
    return "\n\n".join(tables)


# ─── main ────────────────────────────────────────────────────────────────────────────────────


def warm_local_server(work: Path) -> dict[str, Any]:
    """``pgcdc spark start --master local[2]``'s server, and a first job from a client."""
    from pgcdc_dagster.engine.spark import server as spark_server

    store = work / "warm_store"
    store.mkdir()
    t0 = time.perf_counter()
    server, _ = spark_server.start(store, LOCAL_MASTER)
    start_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import sys; from pgcdc_dagster.engine.spark.session "
         "import get_spark; get_spark(remote=sys.argv[1]).range(1000).count()", server.url],
        check=True, env=child_env(), capture_output=True,
    )  # fmt: skip
    return {
        "store": store,
        "record": spark_server.record_path(store),
        "pid": server.pid,
        "server_start_s": round(start_s, 2),
        "first_client_job_s": round(time.perf_counter() - t0, 2),
    }


def code_version() -> dict[str, Any]:
    import pgcdc_dagster

    where = Path(pgcdc_dagster.__file__).resolve().parent
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True).stdout.strip()  # fmt: skip
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "pgcdc_dagster"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    if where.parent == REPO:
        return {"package": str(where), "repo_head": rev, "package_modified": bool(dirty)}
    # Run from elsewhere (PYTHONPATH on an export of a commit): the path says which.
    return {"package": str(where), "repo_head_at_run_not_the_code_run": rev}


def main() -> None:
    parser = harness.argument_parser(__doc__, json=True)
    parser.add_argument("--scales", default="10,50")
    parser.add_argument("--changes", type=int, default=3_000_000, help="the big range's")
    parser.add_argument("--small-changes", type=int, default=300_000, help="the small range's")
    parser.add_argument("--range-scale", type=int, default=10)
    parser.add_argument("--transactions", type=int, default=250, help="pgbench, per client")
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--work", default="snapshot,range")
    parser.add_argument("--rounds", type=int, default=2, help="snapshot rounds per scale")
    parser.add_argument("--range-rounds", type=int, default=2)
    parser.add_argument("--no-native", action="store_true")
    parser.add_argument("--no-cli", action="store_true")
    parser.add_argument("--driver-rows", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker-memory", default="2g")
    parser.add_argument("--executor-memory", default="1g")
    parser.add_argument("--executor-python", default=sys.executable)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, params = args.child
        fn = {"snapshot": child_snapshot, "range": child_range}[kind]
        print(json.dumps(fn(json.loads(params))))
        return

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if bad := set(paths) - set(PATHS):
        parser.error(f"unknown path(s) {bad}")
    scales = [int(s) for s in args.scales.split(",") if s.strip()]
    work_kinds = {w.strip() for w in args.work.split(",")}

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    become_subreaper()
    started = time.perf_counter()
    report: dict[str, Any] = {
        "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "command": " ".join([".venv/bin/python", "benchmarks/spark_paths.py", *sys.argv[1:]]),
        "code": code_version(),
        "machine": {"cpus": os.cpu_count(), "load_at_start": load_now()},
        "cluster_profile": harness.describe_profile(args.profile),
        "paths": paths,
    }
    ctx: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="pgcdc-spark-paths-"))
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        if "cluster" in paths:
            cluster = StandaloneCluster(work / "spark", args.workers, args.worker_memory)
            stack.callback(cluster.stop)
            cluster.start()
            ctx.update(cluster=cluster, cluster_url=cluster.url)
            report["cluster"] = {
                "url": cluster.url,
                "workers": args.workers,
                "worker_cores": 1,
                "worker_memory": args.worker_memory,
                "executor_memory": args.executor_memory,
                "executor_python": args.executor_python,
                "started_s": round(cluster.started_s, 2),
            }
            log(f"cluster {cluster.url} up in {cluster.started_s:.1f} s")
        if "local" in paths and "snapshot" in work_kinds and not args.no_cli:
            from pgcdc_dagster.engine.spark import server as spark_server

            warm = warm_local_server(work)
            stack.callback(spark_server.stop, warm["store"])
            ctx.update(connect_record=warm["record"], connect_server_pid=warm["pid"])
            report["warm_local_connect_server"] = {
                k: warm[k] for k in ("server_start_s", "first_client_job_s")
            }
            log(f"warm local Connect server: {report['warm_local_connect_server']}")

        if "snapshot" in work_kinds:
            report["snapshot"] = {}
            for scale in scales:
                with contextlib.ExitStack() as data_stack:
                    bench = SnapshotBench(args, work, scale, ctx)
                    data = bench.setup(data_stack)
                    log(f"scale {scale}: {data}")
                    result: dict[str, Any] = {
                        "data": data, "cli": {p: [] for p in paths},
                        "engine": {p: [] for p in paths}, "native": [], "orders": [],
                    }  # fmt: skip
                    items: list[tuple[str, str | None]] = []
                    if not args.no_cli:
                        items += [("cli", p) for p in paths]
                    if not args.no_native:
                        items.append(("native", None))
                    items += [("engine", p) for p in paths]
                    for r in range(args.rounds):
                        order = harness.order_of(items, r)
                        result["orders"].append([f"{k}:{p}" if p else k for k, p in order])
                        for kind, path in order:
                            log(f"scale {scale} round {r} {kind} {path or ''} "
                                f"(load {load_now()})")  # fmt: skip
                            if kind == "native":
                                out = bench.native(f"s{scale}r{r}")
                                result["native"].append(out)
                            elif kind == "cli":
                                assert path is not None
                                out = bench.cli(path, f"s{scale}r{r}")
                                result["cli"][path].append(out)
                            else:
                                assert path is not None
                                out = bench.engine(path, f"s{scale}r{r}")
                                result["engine"][path].append(out)
                            log(
                                f"  -> {out['seconds']} s"
                                + (f", copy {out.get('copy_s')} s" if "copy_s" in out else "")
                                + (f", fixed {out.get('fixed_s')}" if out.get("fixed_s") else "")
                                + f", others {out['others_cores']} cores"
                            )
                    report["snapshot"][scale] = result
        if "range" in work_kinds:
            report["range"] = range_bench(args, ctx, paths)

    summary: dict[str, Any] = {}
    if "snapshot" in report:
        summary["snapshot"] = summarise_snapshot(report["snapshot"], paths)
        summary["native"] = {
            scale: {
                "seconds": median([n["seconds"] for n in data["native"]]),
                "runs": [n["seconds"] for n in data["native"]],
            }
            for scale, data in report["snapshot"].items()
            if data["native"]
        }
    if "range" in report:
        summary["range"] = summarise_range(report["range"], paths)
    everything_equal = all(v["equal"] for v in _find_verifies(report))
    summary["all_targets_equal"] = everything_equal
    summary["targets_verified"] = len(list(_find_verifies(report)))
    report["summary"] = summary
    report["machine"]["load_at_end"] = load_now()
    report["total_s"] = round(time.perf_counter() - started, 1)
    report = rounded(report)
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    print(print_table(report), file=sys.stderr)


def _find_verifies(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if "verify" in node and isinstance(node["verify"], dict):
            yield node["verify"]
        for k, v in node.items():
            if k != "verify":
                yield from _find_verifies(v)
    elif isinstance(node, list):
        for v in node:
            yield from _find_verifies(v)


if __name__ == "__main__":
    main()
