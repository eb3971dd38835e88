"""``pgcdc demo``: the embedded default, end to end, on throwaway local clusters.

Starts a source, a target and a Dagster-storage PostgreSQL under ``.pgcdc/``, loads sample data
(pgbench plus tables with TOASTed values, a table without primary key under REPLICA IDENTITY
FULL, and odd identifiers), takes the base snapshot, replays a backfill (one transaction that
updates every account), then runs a write workload while the Dagster daemon's slot sensor
catches up range by range (mid-way, a column is added on the source, as a migration does, and
followed on the target by itself); stops the workload, cuts over and verifies. The report is
measured, nothing in it is fixed in advance.

Spark at work: the demo's thresholds are scaled to its data (:data:`SPARK_DEMO_ENV`), so the
biggest table of the base snapshot is copied by Spark tasks, and the backfill's range is
compacted and staged on the target by Spark's executors, as a big table and a big range are
on a cluster. The Spark is local (``local[2]``) and lives in this process, shared by the
snapshot run and the backfill's catch-up run; the report says what it did.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from ..engine.connect import libpq_tool_environment
from ..engine.lsn import Lsn
from .local_cluster import LOGICAL_SOURCE_SETTINGS, LocalCluster, find_bindir

REPO = Path(__file__).resolve().parents[2]
SAMPLE_SCHEMA = """
ALTER TABLE pgbench_history REPLICA IDENTITY FULL;
CREATE TABLE documents (id bigserial PRIMARY KEY, title text NOT NULL, body text);
ALTER TABLE documents ALTER COLUMN body SET STORAGE EXTERNAL;
INSERT INTO documents (title, body)
SELECT 'doc ' || g, repeat(md5(g::text), 400) FROM generate_series(1, 200) g;
CREATE TABLE events_log (at timestamptz NOT NULL DEFAULT now(), kind text, payload jsonb);
ALTER TABLE events_log REPLICA IDENTITY FULL;
INSERT INTO events_log (kind, payload)
SELECT 'seed', jsonb_build_object('n', g) FROM generate_series(1, 100) g;
CREATE SCHEMA "Sales Dept";
CREATE TABLE "Sales Dept"."Order" ("Id" int PRIMARY KEY, "select" text, amount numeric(12,2));
INSERT INTO "Sales Dept"."Order" SELECT g, 'item ' || g, g * 1.5 FROM generate_series(1, 500) g;
CREATE TABLE demo_probe (id bigint PRIMARY KEY, written_at timestamptz NOT NULL);
"""


SPARK_DEMO_ENV = {
    "PGCDC_SPARK_MASTER": "local[2]",
    # pgbench_accounts (100,000 rows at scale 1) goes to Spark tasks; the others to the driver.
    "PGCDC_SNAPSHOT_DRIVER_ROWS": "50000",
    # The backfill's range (100,000 changes) is staged by Spark's executors; the follow's
    # ranges under the workload (a few hundred changes) stay in process.
    "PGCDC_SPARK_MIN_CHANGES": "50000",
}
"""What puts Spark to work on demo-sized data: on a real cluster the defaults send tables of
millions of rows and ranges of millions of changes there."""
BACKFILL = "UPDATE pgbench_accounts SET abalance = abalance + 1"
"""The backfill: one transaction of 100,000 changes."""


@dataclass
class SparkWork:
    """What Spark did in the demo, from the runs' metadata."""

    tables: list[dict[str, Any]] = field(default_factory=list)
    """The snapshot's tables copied by Spark tasks (table, tasks, rows, seconds)."""
    ranges: int = 0
    tasks: int = 0
    changes: int = 0
    seconds: float = 0.0
    """The ranges staged by Spark's executors: count, tasks, changes, seconds."""
    application_id: str | None = None


@dataclass
class DemoClusters:
    source: LocalCluster
    target: LocalCluster
    storage: LocalCluster

    def stop(self) -> None:
        for cluster in (self.source, self.target, self.storage):
            cluster.stop()


@dataclass
class Measurements:
    lag: list[tuple[float, int]] = field(default_factory=list)
    freshness_s: list[float] = field(default_factory=list)
    probes_sent: int = 0


def start_clusters(base: Path) -> DemoClusters:
    """Fresh clusters every time: the demo owns ``.pgcdc/`` and starts from nothing."""
    for name in ("source", "target", "storage"):
        old = LocalCluster(directory=base / name)
        old.stop()
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    password = secrets.token_urlsafe(12)
    source = LocalCluster(base / "source", LOGICAL_SOURCE_SETTINGS, password=password).start()
    target = LocalCluster(base / "target", password=password).start()
    storage = LocalCluster(base / "storage").start()
    return DemoClusters(source, target, storage)


def demo_environment(base: Path, clusters: DemoClusters) -> dict[str, str]:
    home = base / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    storage_url = f"postgresql+psycopg2://postgres@127.0.0.1:{clusters.storage.port}/postgres"
    return {
        "PGCDC_SOURCE_DSN": clusters.source.dsn(),
        "PGCDC_TARGET_DSN": clusters.target.dsn(),
        "PGCDC_STORE": str(base / "store"),
        "PGCDC_RANGE_MAX_BYTES": str(8 * 1024 * 1024),
        "PGCDC_MODE": "follow",
        "DAGSTER_HOME": str(home),
        "DAGSTER_POSTGRES_URL": storage_url,
        "SPARK_LOCAL_IP": "127.0.0.1",
        **SPARK_DEMO_ENV,
    }


def load_sample_data(cluster: LocalCluster) -> None:
    pgbench(cluster, "-i", "-q", "-s", "1")
    with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
        conn.execute(SAMPLE_SCHEMA)


def pgbench(cluster: LocalCluster, *args: str) -> subprocess.Popen[bytes] | None:
    tool_env, extra = libpq_tool_environment(cluster.dsn())
    cmd = [str(find_bindir() / "pgbench"), *args, *extra]
    env = {**os.environ, **tool_env}
    if "-i" in args:
        subprocess.run(cmd, check=True, capture_output=True, env=env)
        return None
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)


SCHEMA_CHANGE_AT = 100
"""The side workload's step at which it adds a column on the source (a migration's DDL,
mid-stream): the follow carries it out on the target by itself (:mod:`..engine.apply.ddl`)."""


def side_workload(dsn: str, stop: threading.Event) -> None:
    """Writes pgbench does not make: TOAST-preserving updates, FULL-identity deletes, odd names;
    and, mid-way, an ``ADD COLUMN ... NOT NULL DEFAULT`` that later updates set."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        i = 0
        while not stop.is_set():
            i += 1
            if i == SCHEMA_CHANGE_AT:
                conn.execute(
                    "ALTER TABLE documents ADD COLUMN reviewed boolean NOT NULL DEFAULT false"
                )
            with conn.transaction():
                if i > SCHEMA_CHANGE_AT and i % 4 == 0:  # a quarter of the documents
                    conn.execute(
                        "UPDATE documents SET title = title || '.', reviewed = true WHERE id = %s",
                        (i % 200 + 1,),
                    )
                else:
                    conn.execute(
                        "UPDATE documents SET title = title || '.' WHERE id = %s",
                        (i % 200 + 1,),
                    )
                conn.execute(
                    "INSERT INTO events_log (kind, payload) "
                    "VALUES ('tick', jsonb_build_object('i', %s::int))",
                    (i,),
                )
                conn.execute(
                    """UPDATE "Sales Dept"."Order" SET amount = amount + 1 WHERE "Id" = %s""",
                    (i % 500 + 1,),
                )
            if i % 10 == 0:
                conn.execute(
                    "DELETE FROM events_log WHERE ctid = (SELECT ctid FROM events_log "
                    "WHERE kind = 'tick' LIMIT 1)"
                )
            time.sleep(0.05)


def probe_freshness(
    source_dsn: str,
    target_dsn: str,
    writing: threading.Event,
    stop: threading.Event,
    out: Measurements,
    interval_s: float = 1.0,
    poll_s: float = 0.05,
) -> None:
    """A probe row every ``interval_s`` while ``writing``; each probe's time until the target
    has it (polled every ``poll_s``). Returns once every probe arrived, or at ``stop``."""
    sent_at: dict[int, float] = {}
    last_sent = 0.0
    seen = 0
    with (
        psycopg.connect(source_dsn, autocommit=True) as src,
        psycopg.connect(target_dsn, autocommit=True) as tgt,
    ):
        while not stop.is_set():
            now = time.monotonic()
            if writing.is_set() and now - last_sent >= interval_s:
                probe = len(sent_at) + 1
                src.execute("INSERT INTO demo_probe VALUES (%s, now())", (probe,))
                sent_at[probe] = last_sent = time.monotonic()
                out.probes_sent += 1
            rows = tgt.execute("SELECT id FROM demo_probe WHERE id > %s", (seen,)).fetchall()
            arrived = time.monotonic()
            for (probe,) in rows:
                out.freshness_s.append(arrived - sent_at[probe])
                seen = max(seen, probe)
            if not writing.is_set() and seen >= len(sent_at):
                return
            time.sleep(poll_s)


def sample_lag(settings_env: dict[str, str], stop: threading.Event, out: Measurements) -> None:
    from ..engine.control.pipeline import source_positions
    from ..engine.settings import ReplicationSettings

    settings = ReplicationSettings.from_env(settings_env)
    started = time.monotonic()
    while not stop.is_set():
        # A sample lost to a busy server is just a gap in the series.
        with contextlib.suppress(Exception):
            out.lag.append((time.monotonic() - started, source_positions(settings).lag_bytes))
        time.sleep(1)


def run_demo(*, ui: bool = False, seconds: float = 20.0, tps: int = 300) -> int:
    from ..defs.instance import dagster_instance
    from ..engine.control import pipeline
    from ..engine.settings import ReplicationSettings
    from ..runner import clear_the_way, materialization_metadata, run_job

    base = (Path.cwd() / ".pgcdc").resolve()
    started = time.monotonic()
    spark_warming = warm_spark()
    print(f"starting source, target and Dagster-storage clusters under {base} ...")
    clusters = start_clusters(base)
    env = demo_environment(base, clusters)
    os.environ.update(env)
    daemon: subprocess.Popen[bytes] | None = None
    try:
        load_sample_data(clusters.source)
        spark_warming.join()  # the snapshot's run finds the session started
        settings = ReplicationSettings.from_env()
        print(
            "taking the base snapshot (Dagster run of job 'snapshot'; tables past "
            f"{settings.snapshot_driver_rows:,} rows are copied by Spark tasks on "
            f"{settings.spark_master}) ..."
        )
        snapshot = materialization_metadata(run_job("snapshot"), "base_snapshot")
        spark = SparkWork(
            tables=[t.data for t in snapshot["tables"].records if t.data["copied_by"] == "spark"],
            application_id=snapshot.get("spark_application_id"),
        )
        print(f"  consistent point {snapshot['consistent_point']}")
        print(
            "backfill: one transaction updates all 100,000 accounts; a catch-up run (job "
            "'follow' to its endpos) has Spark's executors stage its range ..."
        )
        catch_up_backfill(clusters.source, settings, spark)

        daemon = start_dagster_process(base, "dagster-daemon", ["run"])
        print("starting dagster-daemon; its slot sensor starts a follow run ...")
        follow_start = wait_follow_run(dagster_instance(), settings, timeout_s=120)
        print(f"  follow run holds the range lock {follow_start:.1f} s after the daemon started")
        print(
            f"workload: pgbench at {tps} tps for {seconds:.0f} s plus side writes; the daemon's "
            "slot sensor catches up ..."
        )
        measurements = Measurements()
        writing, stop_probes, stop_side = threading.Event(), threading.Event(), threading.Event()
        writing.set()
        side = threading.Thread(target=side_workload, args=(settings.source_dsn, stop_side))
        probes = threading.Thread(
            target=probe_freshness,
            args=(settings.source_dsn, settings.target_dsn, writing, stop_probes, measurements),
        )
        lag = threading.Thread(target=sample_lag, args=(env, stop_probes, measurements))
        for thread in (side, probes, lag):
            thread.start()
        bench = pgbench(
            clusters.source, "-n", "-c", "2", "-j", "2", "-T", str(int(seconds)), "-R", str(tps)
        )
        assert bench is not None
        bench.wait()
        stop_side.set()
        writing.clear()
        side.join()
        workload_end = pipeline.resolve_endpos(settings, "current")
        print(f"workload stopped at {workload_end}; waiting for the sensor to catch up ...")
        instance = dagster_instance()
        wait_caught_up(settings, workload_end, timeout_s=180)
        probes.join(timeout=60)
        stop_probes.set()
        lag.join()
        # Stopping the daemon stops its sensor and sends the follow run's worker SIGTERM, which
        # stops it at a range boundary; then nothing holds the range lock.
        stop_process(daemon)
        daemon = None
        clear_the_way(instance, settings, 60, "pgcdc demo")

        print(
            "cutover (Dagster run of job 'cutover_job'): catch up to the flush LSN, sync "
            "sequences, verify ..."
        )
        result = run_job("cutover_job")
        cutover = materialization_metadata(result, "cutover")
        # The cutover run compared every table (its data_consistency check): report that.
        comparisons = [record.data for record in cutover["tables"].records]
        runs = follow_run_costs(instance)
        print_report(
            settings, measurements, cutover, comparisons, runs, spark, time.monotonic() - started
        )
        if ui:
            serve_ui(base)
        return 0 if all(c["equal"] for c in comparisons) else 1
    finally:
        if daemon is not None:
            stop_process(daemon)
        clusters.stop()


def warm_spark() -> threading.Thread:
    """Start this process's Spark (the demo's ``local[2]``, with ``PGCDC_SPARK_CONF``) on a
    thread now, while the clusters start and the sample data loads: its JVM takes seconds to
    start, which the snapshot's run would otherwise wait for. The runs then find the session
    running (one process, one session: :func:`~pgcdc_dagster.engine.spark.session.get_spark`).
    A failure here is left to the snapshot's run, which starts Spark again and says why."""
    from ..engine.settings import parse_spark_conf
    from ..engine.spark.session import get_spark

    def start() -> None:
        with contextlib.suppress(Exception):
            get_spark(
                master=SPARK_DEMO_ENV["PGCDC_SPARK_MASTER"],
                conf=parse_spark_conf(os.environ.get("PGCDC_SPARK_CONF", "")),
            )

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    thread = threading.Thread(target=start, name="pgcdc-demo-spark", daemon=True)
    thread.start()
    return thread


def catch_up_backfill(source: LocalCluster, settings: Any, spark: SparkWork) -> None:
    """Commit the backfill, then catch up to it in this process (whose Spark the snapshot
    started): the range holds more than ``PGCDC_SPARK_MIN_CHANGES`` changes."""
    from ..engine.control import pipeline
    from ..runner import observed_metadata, run_job

    with psycopg.connect(source.dsn(), autocommit=True) as conn:
        conn.execute(BACKFILL)
    endpos = pipeline.resolve_endpos(settings, "current")
    config = {"endpos": str(endpos)}
    result = run_job("follow", run_config={"ops": {"follow_stream": {"config": config}}})
    totals = observed_metadata(result, having="spark_ranges")
    spark.ranges = int(totals.get("spark_ranges", 0))
    spark.tasks = int(totals.get("spark_tasks", 0))
    spark.changes = int(totals.get("spark_changes", 0))
    spark.seconds = float(totals.get("spark_seconds", 0.0))
    spark.application_id = spark.application_id or totals.get("spark_application_id")
    print(
        f"  caught up to {endpos}: {spark.ranges} range(s) of {spark.changes:,} changes staged "
        f"by {spark.tasks} Spark task(s) in {spark.seconds:.1f} s"
    )


def wait_follow_run(instance: Any, settings: Any, timeout_s: float) -> float:
    """Seconds until a follow run holds the range lock (the sensor started it)."""
    from ..engine.control.range_lock import lock_holders

    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        with contextlib.suppress(Exception):
            if lock_holders(settings.target_dsn, settings.slot):
                return time.monotonic() - started
        time.sleep(0.2)
    raise RuntimeError(
        f"no follow run started within {timeout_s:.0f} s: see {instance.root_directory}"
    )


def wait_caught_up(settings: object, endpos: Lsn, timeout_s: float) -> None:
    """Until the target has applied everything committed up to ``endpos`` (the origin's word)."""
    from ..engine.control import pipeline
    from ..engine.control.next_step import CaughtUp

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):  # a busy server: ask again
            if isinstance(pipeline.next_step(settings, endpos), CaughtUp):  # type: ignore[arg-type]
                return
        time.sleep(0.2)


def start_dagster_process(base: Path, tool: str, args: list[str]) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).parent / tool
    log = open(base / f"{tool}.log", "ab")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(
        [str(exe), *args, "-w", str(REPO / "workspace.yaml")],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


GROUP_GRACE_S = 10.0
"""How long what a stopped Dagster process leaves in its process group may take to go."""


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """Stop a Dagster process started by :func:`start_dagster_process` and everything in its
    process group: its code servers and run workers. A code server whose own cleanup thread
    died (Dagster's storage away under ``pgcdc demo --ui`` can make the thread that ends the
    server once its heartbeats stop raise, and SIGTERM then leaves the server running for
    good) is killed after :data:`GROUP_GRACE_S`."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            return
    deadline = time.monotonic() + GROUP_GRACE_S
    while _group_alive(process.pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            return
        time.sleep(0.1)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def follow_run_costs(instance) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    """(queued to finished, started to finished) seconds of each successful follow run."""
    from dagster import DagsterRunStatus, RunsFilter

    records = instance.get_run_records(
        RunsFilter(job_name="follow", statuses=[DagsterRunStatus.SUCCESS])
    )
    costs = []
    for record in records:
        if record.start_time and record.end_time:
            created = record.create_timestamp.timestamp()
            costs.append((record.end_time - created, record.end_time - record.start_time))
    return costs


def print_report(settings, measurements, cutover, comparisons, runs, spark, elapsed) -> None:  # type: ignore[no-untyped-def]
    from ..engine.control import pipeline

    store = pipeline.store_of(settings)
    ranges = store.chain_ranges()
    results = [store.get(r).manifest.result for r in ranges]  # type: ignore[union-attr]
    changes = sum(r.changes for r in results)
    txns = sum(r.transactions for r in results)
    receive_s = sum(r.seconds for r in results)
    outcomes: dict[str, int] = {}
    for r in results:
        outcomes[str(r.endpos_outcome)] = outcomes.get(str(r.endpos_outcome), 0) + 1
    fresh = sorted(measurements.freshness_s)
    print("\n=== pgcdc demo report ===")
    print(f"ranges received and applied : {len(ranges)} ({outcomes})")
    print(f"transactions / changes      : {txns} / {changes}")
    if receive_s:
        print(
            f"receive throughput          : {changes / receive_s:,.0f} changes/s "
            f"over {receive_s:.2f} s"
        )
    if fresh:
        p95 = fresh[min(len(fresh) - 1, int(0.95 * len(fresh)))]
        print(
            f"freshness (commit->target)  : median {statistics.median(fresh):.2f} s, "
            f"p95 {p95:.2f} s over {len(fresh)} of {measurements.probes_sent} probes"
        )
    if measurements.lag:
        peak = max(lag for _, lag in measurements.lag)
        series = " ".join(
            f"{lag // 1024}k" for _, lag in measurements.lag[:: max(1, len(measurements.lag) // 12)]
        )
        print(f"slot lag over time (bytes)  : {series} (peak {peak // 1024} KiB)")
    if runs:
        print(
            f"follow runs                 : {len(runs)} (the sensor keeps one alive; each range "
            "is a partition materialised from inside it)"
        )
    for table in spark.tables:
        print(
            f"Spark, snapshot copy        : {table['table']}: {table['tasks']} task(s), "
            f"{table['rows']:,} rows, {table['seconds']:.2f} task-seconds"
        )
    print(
        f"Spark, staged ranges        : {spark.ranges} range(s): {spark.tasks} task(s), "
        f"{spark.changes:,} changes, {spark.seconds:.2f} s (application "
        f"{spark.application_id or 'none'}, {settings.spark_master})"
    )
    print(
        f"cutover                     : endpos {cutover.get('endpos')}, outcome "
        f"{cutover.get('endpos_outcome')}, {cutover.get('ranges')} range(s)"
    )
    with psycopg.connect(settings.target_dsn) as conn:
        reviewed = conn.execute(
            "SELECT count(*) FILTER (WHERE reviewed), count(*) FILTER (WHERE NOT reviewed) "
            "FROM documents WHERE EXISTS (SELECT FROM information_schema.columns "
            "WHERE table_name = 'documents' AND column_name = 'reviewed')"
        ).fetchone()
    if reviewed is not None and sum(reviewed):
        print(
            "schema change               : documents.reviewed added on the source mid-workload "
            f"(NOT NULL DEFAULT false), followed on the target: {reviewed[1]} rows false "
            f"(the existing ones), {reviewed[0]} true (updated since)"
        )
    bad = [c["table"] for c in comparisons if not c["equal"]]
    rows = sum(c["target_rows"] for c in comparisons)
    print(
        f"verification                : {len(comparisons) - len(bad)}/{len(comparisons)} tables "
        f"equal ({rows} rows){' DIFFER: ' + ', '.join(bad) if bad else ''}"
    )
    print(f"total demo time             : {elapsed:.1f} s")


def serve_ui(base: Path) -> None:
    daemon = start_dagster_process(base, "dagster-daemon", ["run"])
    web = start_dagster_process(base, "dagster-webserver", ["-h", "127.0.0.1", "-p", "3000"])
    print(f"\nDagster UI: http://127.0.0.1:3000 (clusters under {base}; Ctrl-C stops everything)")

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        web.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop_process(web)
        stop_process(daemon)
