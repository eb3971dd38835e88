"""Crash anywhere, re-run converges: real ``pgcdc`` processes, real SIGKILL, real servers.

Every scenario runs the command a user runs (``pgcdc catchup`` / ``pgcdc snapshot``, fresh
processes, the shipped ``dagster.yaml`` on PostgreSQL storage) against its own source, target
and Dagster-storage clusters (this module crashes and restarts them). A process is killed with
its whole process group at a named fault point (``PGCDC_FAILPOINT``, :mod:`.failpoints`) or at
a random moment; then one plain command must finish the job: the target equals the source
(row counts and content hashes), the insert-only table without a key has exactly the source's
rows, and no Dagster run is left not finished.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest
from dagster import DagsterEventType, DagsterInstance, DagsterRunStatus, RunsFilter
from dagster._core.instance.ref import InstanceRef
from dagster._core.storage.dagster_run import NOT_FINISHED_STATUSES
from psycopg import sql

from pgcdc_dagster.defs.keys import BASE_SNAPSHOT_KEY
from pgcdc_dagster.defs.partitions import LSN_RANGES
from pgcdc_dagster.defs.run_liveness import PROCESS_TAG
from pgcdc_dagster.demo.local_cluster import (
    LOGICAL_SOURCE_SETTINGS,
    LocalCluster,
    origin_room,
    temporary_cluster,
)
from pgcdc_dagster.engine.apply import staging
from pgcdc_dagster.engine.compare import verify
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.control.range_lock import RangeLock, lock_holders, range_lock
from pgcdc_dagster.engine.follow.follower import Followed, Follower, RangeTakenError
from pgcdc_dagster.engine.identifiers import TableName
from pgcdc_dagster.engine.lsn import LsnRange
from pgcdc_dagster.engine.settings import ReplicationSettings
from pgcdc_dagster.engine.snapshot.common import CopyRecord, TableRange
from pgcdc_dagster.engine.snapshot.copied_ranges import record_statement
from pgcdc_dagster.engine.store.output_store import OutputStore
from pgcdc_dagster_tests.support.locks import holder_session, take_lock
from pgcdc_dagster_tests.support.procs import descendants, gone
from pgcdc_dagster_tests.support.stores import assert_chain_records, on_disk
from pgcdc_dagster_tests.support.waits import wait_for as _wait_for

REPO = Path(__file__).resolve().parent.parent
PGCDC = str(Path(sys.executable).parent / "pgcdc")

SCHEMA = """
CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL, filler text);
INSERT INTO accounts SELECT g, 0, repeat('a', 60) FROM generate_series(1, 20000) g;
CREATE TABLE history (account int, delta int, at timestamptz NOT NULL DEFAULT now());
ALTER TABLE history REPLICA IDENTITY FULL;
CREATE TABLE docs (id int PRIMARY KEY, title text, body text);
ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL;
INSERT INTO docs SELECT g, 't' || g, repeat(md5(g::text), 300) FROM generate_series(1, 30) g;
"""

BULK = """
CREATE TABLE bulk (id int PRIMARY KEY, v text NOT NULL);
INSERT INTO bulk SELECT g, md5(g::text) FROM generate_series(1, 1000000) g;
"""
"""Makes the snapshot's copy last about a second, so a kill can land in the middle of it."""


class Writer:
    """Small transactions on the source, as a busy application commits them: account updates
    with a history insert (no key, REPLICA IDENTITY FULL), title updates that leave a TOASTed
    body unchanged, new TOASTed documents."""

    def __init__(self, dsn: str, seed: int) -> None:
        self.dsn = dsn
        self.random = random.Random(seed)
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.committed = 0
        self.next_doc = 0
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._write()
        except BaseException as exc:  # raised by __exit__: a writer that died fails the test
            self.error = exc

    def _write(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            # New documents go after every earlier writer's, whichever tests ran before.
            (self.next_doc,) = conn.execute("SELECT coalesce(max(id), 0) FROM docs").fetchone()
            while not self.stop_event.is_set():
                with conn.transaction():
                    for _ in range(self.random.randrange(1, 4)):
                        account = self.random.randrange(1, 20001)
                        delta = self.random.randrange(-50, 50)
                        conn.execute(
                            "UPDATE accounts SET balance = balance + %s WHERE id = %s",
                            (delta, account),
                        )
                        conn.execute(
                            "INSERT INTO history (account, delta) VALUES (%s, %s)",
                            (account, delta),
                        )
                    roll = self.random.random()
                    if roll < 0.1:
                        conn.execute(
                            "UPDATE docs SET title = title || '.' WHERE id = %s",
                            (self.random.randrange(1, 31),),
                        )
                    elif roll < 0.13:
                        self.next_doc += 1
                        conn.execute(
                            "INSERT INTO docs VALUES (%s, 'new', repeat(md5(%s::text), 300))",
                            (self.next_doc, self.next_doc),
                        )
                self.committed += 1
                time.sleep(0.004)

    def __enter__(self) -> Writer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join()
        if self.error is not None and exc[0] is None:
            raise AssertionError(f"the writer died: {self.error!r}") from self.error


@dataclass
class Clusters:
    source: LocalCluster
    target: LocalCluster
    storage: LocalCluster


@pytest.fixture(scope="module")
def clusters() -> Iterator[Clusters]:
    """Clusters of this module alone: its tests crash and restart them."""
    made = [
        temporary_cluster(LOGICAL_SOURCE_SETTINGS, prefix="pgcdc-resume-source-").start(),
        # A replication origin for each site of this module (eleven): past the default 10.
        temporary_cluster(origin_room(20), prefix="pgcdc-resume-target-").start(),
        temporary_cluster(prefix="pgcdc-resume-storage-").start(),
    ]
    try:
        yield Clusters(*made)
    finally:
        for cluster in made:
            cluster.destroy()


@dataclass
class Site:
    """One replication (source and target databases, store, slot, Dagster storage) driven
    through the ``pgcdc`` command in fresh processes."""

    clusters: Clusters
    env: dict[str, str]
    settings: ReplicationSettings
    home: Path
    killed_runs: list[str] = field(default_factory=list)
    last_pid: int = 0
    """The process of the latest :meth:`pgcdc` command."""

    def pgcdc(
        self,
        *args: str,
        failpoint: str | None = None,
        timeout: float = 240,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        running = self.start(*args, failpoint=failpoint, env=env)
        self.last_pid = running.pid
        try:
            out, err = running.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # A hang is a bug to read, not a timeout to retry: Python's fault handler prints
            # every thread's stack on SIGABRT.
            servers = self.server_activity()
            os.kill(running.pid, signal.SIGABRT)
            out, err = running.communicate(timeout=30)
            os.killpg(running.pid, signal.SIGKILL)
            raise AssertionError(
                f"pgcdc {' '.join(args)} hung for {timeout} s:\n{servers}\n{err}"
            ) from None
        return subprocess.CompletedProcess(running.args, running.returncode, out, err)

    def start(
        self, *args: str, failpoint: str | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        environment = {**os.environ, **self.env, "PYTHONFAULTHANDLER": "1", **(env or {})}
        environment.pop("PGCDC_FAILPOINT", None)
        if failpoint:
            environment["PGCDC_FAILPOINT"] = failpoint
        return subprocess.Popen(
            [PGCDC, *args],
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    def server_activity(self) -> str:
        """What the servers are doing (for a hang's report)."""
        lines = []
        for role, dsn in (
            ("source", self.settings.source_dsn),
            ("target", self.settings.target_dsn),
        ):
            with psycopg.connect(dsn, autocommit=True) as conn:
                lsns = conn.execute(
                    "SELECT pg_current_wal_flush_lsn(), pg_current_wal_insert_lsn()"
                ).fetchone()
                lines.append(f"{role} flush/insert {lsns}")
                for row in conn.execute(
                    "SELECT pid, state, wait_event_type, wait_event, left(query, 120) "
                    "FROM pg_stat_activity WHERE datname = current_database() "
                    "AND pid <> pg_backend_pid()"
                ):
                    lines.append(f"{role} {row}")
        return "\n".join(lines)

    def instance(self) -> DagsterInstance:
        storage = {"postgres": {"postgres_url": self.env["DAGSTER_POSTGRES_URL"]}}
        ref = InstanceRef.from_dir(str(self.home), overrides={"storage": storage})
        return DagsterInstance.from_ref(ref)

    def writer(self, seed: int) -> Writer:
        return Writer(self.settings.source_dsn, seed)

    def assert_converged(self) -> None:
        comparisons = verify.compare_tables(
            self.settings, pipeline.replicated_tables(self.settings)
        )
        assert comparisons and all(c.equal for c in comparisons), [
            (str(c.table), c.source_rows, c.target_rows) for c in comparisons if not c.equal
        ]
        history = {str(c.table): c for c in comparisons}["public.history"]
        assert history.target_rows == history.source_rows > 0
        assert_chain_records(
            pipeline.store_of(self.settings), pipeline.origin_progress(self.settings)
        )
        with self.instance() as instance:
            unfinished = instance.get_runs(RunsFilter(statuses=list(NOT_FINISHED_STATUSES)))
            assert unfinished == [], [(r.job_name, r.status) for r in unfinished]

    def runs_of_pid(self, pid: int) -> list[str]:
        """The runs a process of this machine created (their ``pgcdc/process`` tag)."""
        with self.instance() as instance:
            return [
                run.run_id
                for run in instance.get_runs()
                if run.tags.get(PROCESS_TAG, "").split(":")[1:2] == [str(pid)]
            ]

    def failures_of(self, pid: int) -> str:
        """The errors, with their causes and stacks, of the failed steps and runs of the runs
        process ``pid`` created: what a test shows when such a run ended where it should not."""
        shown = []
        with self.instance() as instance:
            for run_id in self.runs_of_pid(pid):
                for record in instance.all_logs(run_id):
                    event = record.dagster_event
                    if event is None or not (event.is_step_failure or event.is_run_failure):
                        continue
                    error = getattr(event.event_specific_data, "error", None)
                    while error is not None:
                        shown.append(f"{error.cls_name}: {error.message}{''.join(error.stack)}")
                        error = error.cause or error.context
        return "\n".join(shown) or "no failure recorded"

    def what_ended(self, process: subprocess.Popen[str]) -> str:
        """What an ended ``process`` and its runs said: its stderr's tail and its runs'
        failures (the report of a command that ended where it should not)."""
        try:
            err = process.communicate(timeout=30)[1]
        except ValueError:  # its output read already
            err = "(read already)"
        return f"its stderr:\n{err[-4000:]}\nits runs' failures:\n{self.failures_of(process.pid)}"

    def assert_killed_run_marked_failed(self) -> None:
        """The run of the killed process is failed, and says why, in the UI's event log."""
        with self.instance() as instance:
            failed = [
                run
                for run in instance.get_runs(RunsFilter(statuses=[DagsterRunStatus.FAILURE]))
                if run.run_id not in self.killed_runs
                and any(
                    "worker is gone" in (e.message or "") for e in instance.all_logs(run.run_id)
                )
            ]
            assert failed, "no run was marked failed for the killed process"
            self.killed_runs += [run.run_id for run in failed]


def error_line(stderr: str) -> str:
    """The one line of a failed command, after any notice about runs it found dead."""
    lines = [
        ln
        for ln in stderr.strip().splitlines()
        if not ln.startswith(("pgcdc: follow:", "pgcdc: snapshot:"))  # progress lines
    ]
    notices = [ln for ln in lines[:-1] if "was left unfinished" in ln]
    assert len(notices) == len(lines) - 1, stderr
    return lines[-1] if lines else ""


def _create_database(cluster: LocalCluster, name: str) -> str:
    with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return cluster.dsn(name)


def make_site(clusters: Clusters, tmp: Path, *, bulk: bool = False) -> Site:
    suffix = uuid.uuid4().hex[:8]
    source = _create_database(clusters.source, f"src_{suffix}")
    target = _create_database(clusters.target, f"tgt_{suffix}")
    _create_database(clusters.storage, f"dagster_{suffix}")
    with psycopg.connect(source, autocommit=True) as conn:
        conn.execute(SCHEMA)
        if bulk:
            conn.execute(BULK)
    home = tmp / f"dagster_home_{suffix}"
    home.mkdir(parents=True)
    shutil.copy(REPO / "dagster.yaml", home / "dagster.yaml")
    env = {
        "PGCDC_SOURCE_DSN": source,
        "PGCDC_TARGET_DSN": target,
        "PGCDC_STORE": str(tmp / f"store_{suffix}"),
        "PGCDC_SLOT": f"resume_{suffix}",
        "PGCDC_RANGE_MAX_BYTES": str(256 * 1024),
        "DAGSTER_HOME": str(home),
        "DAGSTER_POSTGRES_URL": (
            f"postgresql+psycopg2://postgres@127.0.0.1:{clusters.storage.port}/dagster_{suffix}"
        ),
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    return Site(clusters, env, ReplicationSettings.from_env(env), home)


@pytest.fixture(scope="module")
def site(clusters: Clusters, tmp_path_factory: pytest.TempPathFactory) -> Site:
    """A replication with its base snapshot taken: the catch-up scenarios share it, each one
    starting from the converged state the previous one left. (They come first in this module:
    the snapshot and daemon scenarios after them write hundreds of MB of WAL in other
    databases of the same source, which this slot would then cross in 256 KiB ranges.)"""
    made = make_site(clusters, tmp_path_factory.mktemp("resume"))
    taken = made.pgcdc("snapshot")
    assert taken.returncode == 0, taken.stderr
    return made


CATCHUP_POINTS = [
    "receive.fetching",
    "receive.after_store",
    "catchup.before_apply",
    "apply.in_transaction",
    "apply.after_commit",
    "follow.recording",
]


@pytest.mark.parametrize("point", CATCHUP_POINTS)
def test_kill_at_a_catchup_fault_point_then_a_plain_catchup_converges(site: Site, point: str):
    """The command starts working before its Dagster run exists (its head start), so a kill at
    an engine point may come before or after the run was created: if it was, the next command
    finds it dead and marks it failed; either way the target converges. ``follow.recording``
    fires only inside the run."""
    with site.writer(seed=CATCHUP_POINTS.index(point)) as writer:
        time.sleep(1.0)
        killed = site.pgcdc("catchup", "--endpos", "current", failpoint=f"{point}=kill-group")
    assert writer.committed > 0
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr)
    its_runs = site.runs_of_pid(site.last_pid)
    assert its_runs or point != "follow.recording"

    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    assert "caught up to" in done.stdout
    site.assert_converged()
    if its_runs:
        assert "left unfinished" in done.stderr  # the killed run was found dead and said so
        site.assert_killed_run_marked_failed()
    else:
        assert "left unfinished" not in done.stderr  # killed before its run existed


@pytest.mark.long
def test_kill_in_the_middle_of_executor_staging_then_a_plain_catchup_converges(site: Site):
    """Every range on Spark (``PGCDC_SPARK_MIN_CHANGES=1``): a worker has committed its part of
    the shared staging tables when the whole command is SIGKILLed (driver and JVM). The next
    catch-up starts the staging clean and converges; no staging table is left.

    A column added on the source comes first: a range with DDL to carry out is applied in
    process (its DDL commits with its rows), so the ranges staged on Spark after it find the
    column there."""
    on_spark = {"PGCDC_SPARK_MIN_CHANGES": "1", "PGCDC_RANGE_MAX_BYTES": str(64 << 20)}
    with psycopg.connect(site.settings.source_dsn, autocommit=True) as conn:
        conn.execute("ALTER TABLE accounts ADD COLUMN drift_note text")
        conn.execute("UPDATE accounts SET drift_note = 'drifted ' || id WHERE id <= 50")
    first = site.pgcdc("catchup", "--endpos", "current", env=on_spark)
    assert first.returncode == 0, first.stderr
    with site.writer(seed=41) as writer:
        time.sleep(1.0)
        running = site.start(
            "catchup", "--endpos", "current", failpoint="apply.staging=sleep(20)", env=on_spark
        )
        try:
            _wait_for(lambda: _staged_rows(site) > 0, "rows staged by a Spark worker", 180)
        finally:
            os.killpg(running.pid, signal.SIGKILL)
            running.communicate(timeout=30)
    assert writer.committed > 0
    assert running.returncode == -signal.SIGKILL
    done = site.pgcdc("catchup", "--endpos", "current", env=on_spark)
    assert done.returncode == 0, done.stderr
    assert "left unfinished" in done.stderr
    site.assert_converged()
    site.assert_killed_run_marked_failed()
    with psycopg.connect(site.settings.target_dsn) as conn:
        assert staging.shared_tables(conn, site.settings.origin) == []
        drifted = conn.execute("SELECT count(drift_note) FROM accounts").fetchone()
        assert drifted == (50,)


def _staged_rows(site: Site) -> int:
    with psycopg.connect(site.settings.target_dsn, autocommit=True) as conn:
        return sum(
            conn.execute(sql.SQL("SELECT count(*) FROM {}").format(name)).fetchone()[0]
            for name in staging.shared_tables(conn, site.settings.origin)
        )


def test_sigterm_stops_follow_at_a_range_boundary_and_the_next_resumes_exactly_once(site: Site):
    """``pgcdc follow`` under a writer, SIGTERM: exit 0, its run finished, the origin exactly at
    the last stored commit (nothing half applied); the next command takes it from there."""
    before = _ranges_stored(site)
    with site.writer(seed=31) as writer:
        follow = site.start("follow")
        _wait_for(lambda: _ranges_stored(site) >= before + 3, "three ranges followed", 120)
        assert writer.committed > 0
        follow.send_signal(signal.SIGTERM)
        out, err = follow.communicate(timeout=60)
        assert follow.returncode == 0, err
        assert "stopped at a range boundary" in out
        assert pipeline.origin_progress(site.settings) == pipeline.expected_origin_progress(
            site.settings
        )
        with site.instance() as instance:
            (run,) = instance.get_runs(RunsFilter(job_name="follow"), limit=1)
            assert run.status == DagsterRunStatus.SUCCESS
        time.sleep(1.0)  # more commits after the stop
    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    site.assert_converged()


def test_follow_rides_through_a_source_restart_and_a_target_crash_in_one_run(site: Site):
    """``pgcdc follow`` (no endpos) while its servers go away: the source restarted, then the
    target crashed (its range lock went with it). The follow waits each out, takes the range
    lock again, and goes on applying in the same run; SIGTERM then ends it with exit 0, and
    the next command finds nothing lost and nothing applied twice."""
    clusters = site.clusters
    follow = site.start("follow", "--json")
    try:
        for seed, outage in ((71, clusters.source.stop), (72, clusters.target.crash)):
            before = _ranges_stored(site)
            with site.writer(seed=seed):
                _wait_for(
                    lambda before=before: _ranges_stored(site) >= before + 2,
                    "two ranges followed",
                    120,
                    alive=follow,
                )
            assert follow.poll() is None
            outage()
            time.sleep(1.5)  # the follow finds it gone and waits
            (clusters.source if seed == 71 else clusters.target).start()
        # Where the chain ends before the last writes: the follow must store past it (read
        # after them, the follow may have stored them all already, and an idle source moves
        # the chain only by an empty range, seconds later).
        stored = pipeline.store_of(site.settings).chain_end()
        with site.writer(seed=73):
            time.sleep(1.0)
        try:
            _wait_for(
                lambda: (
                    (pipeline.origin_progress(site.settings) or 0)
                    >= (pipeline.expected_origin_progress(site.settings) or 0)
                    and pipeline.store_of(site.settings).chain_end() > stored
                ),
                "the follow to apply what was written after both outages",
                120,
                alive=follow,
            )
        except AssertionError as failed:
            positions = (
                f"origin {pipeline.origin_progress(site.settings)}, expected "
                f"{pipeline.expected_origin_progress(site.settings)}, chain end "
                f"{pipeline.store_of(site.settings).chain_end()}, before the last writes {stored}"
            )
            activity = site.server_activity()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(follow.pid, signal.SIGKILL)
            raise AssertionError(
                f"{failed}\n{positions}\n{activity}\n{site.what_ended(follow)}"
            ) from None
        holders = lock_holders(site.settings.target_dsn, site.settings.slot)
        assert [h.holder for h in holders] == [
            f"follow pid {_follower_pid(follow)} (after an outage)"
        ]
        follow.send_signal(signal.SIGTERM)
        out, err = follow.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(follow.pid, signal.SIGKILL)
    assert follow.returncode == 0, err
    totals = json.loads(out)["follow"]
    assert totals["outages"] == 2 and totals["outage_s"] > 1.0, totals
    assert "trying again in" in err and "the servers are back after" in err, err
    _follow_succeeded_then_a_catchup_converges(site)


def _follow_succeeded_then_a_catchup_converges(site: Site) -> None:
    """The latest follow run ended as a success, and the next plain catch-up finds nothing
    lost and nothing applied twice."""
    with site.instance() as instance:
        (run,) = instance.get_runs(RunsFilter(job_name="follow"), limit=1)
        assert run.status == DagsterRunStatus.SUCCESS
    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    site.assert_converged()


def test_a_follow_killed_while_it_waits_out_an_outage_then_a_catchup_converges(site: Site):
    """SIGKILL of ``pgcdc follow`` (its whole process group) while it waits for a source that
    went away: nothing is left holding the range lock, and once the source is back the next
    plain catch-up converges, nothing lost or applied twice."""
    clusters = site.clusters
    before = _ranges_stored(site)
    follow = site.start("follow")
    try:
        with site.writer(seed=78):
            _wait_for(lambda: _ranges_stored(site) >= before + 2, "two ranges followed", 120)
        clusters.source.stop()
        time.sleep(1.5)  # the follow finds it gone and waits
        assert follow.poll() is None
        os.killpg(follow.pid, signal.SIGKILL)
        follow.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(follow.pid, signal.SIGKILL)
        _started(clusters.source)  # stopped above, unless the test failed before
    assert follow.returncode == -signal.SIGKILL
    _wait_for(
        lambda: not lock_holders(site.settings.target_dsn, site.settings.slot),
        "the range lock to be free",
        30,
    )
    with site.writer(seed=79):
        time.sleep(0.5)  # more commits after the kill
    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    site.assert_converged()


def _run_started(site: Site, command: subprocess.Popen[str]) -> bool:
    """Whether the Dagster run ``command`` created has started (earlier tests' runs aside)."""
    runs = site.runs_of_pid(command.pid)
    if not runs:
        return False
    with site.instance() as instance:
        run = instance.get_run_by_id(runs[0])
        return run is not None and run.status == DagsterRunStatus.STARTED


def _run_recording(site: Site, command: subprocess.Popen[str]) -> bool:
    """Whether the run ``command`` created records ranges: its step is past Dagster's own
    start events (which no run can write without its storage) and follows."""
    runs = site.runs_of_pid(command.pid)
    if not runs:
        return False
    with site.instance() as instance:
        records = instance.get_records_for_run(
            runs[0], of_type=DagsterEventType.ASSET_MATERIALIZATION, limit=1
        ).records
    return bool(records)


@contextlib.contextmanager
def _following_under_writes(site: Site, follow: subprocess.Popen[str], seed: int) -> Iterator[None]:
    """Once ``follow``'s run has started: writes on the source, two ranges followed, and the
    run recording them."""
    _wait_for(lambda: _run_started(site, follow), "the follow run to start", 120, alive=follow)
    with site.writer(seed=seed):
        before = _ranges_stored(site)
        _wait_for(
            lambda: _ranges_stored(site) >= before + 2 and _run_recording(site, follow),
            "two ranges followed and recorded",
            120,
            alive=follow,
        )
        yield


STORAGE_DOWN_S = 12.0
"""Past dagster-postgres' own retries of a connection (about 6 s), so what carries a follow
through is :mod:`pgcdc_dagster.defs.storage_outage`."""


def test_follow_applies_through_a_dagster_storage_outage_and_records_it_once_back(site: Site):
    """Dagster's storage (the run's event log) goes away for 12 s under a ``pgcdc follow``:
    the follow goes on receiving and applying meanwhile, records the ranges it applied once
    the storage is back, in the same run, and a SIGTERM then ends it with exit 0."""
    clusters = site.clusters
    follow = site.start("follow", "--json")
    try:
        earlier = {r.partition_key for r in pipeline.store_of(site.settings).chain_ranges()}
        with _following_under_writes(site, follow, seed=81):
            clusters.storage.stop()
            applied_before = pipeline.origin_progress(site.settings) or 0
            time.sleep(STORAGE_DOWN_S)
            assert follow.poll() is None
            # Applied while Dagster's storage was away, not held back for it (on a loaded
            # machine the follow may still be in dagster-postgres' retries after 12 s).
            _wait_for(
                lambda: (pipeline.origin_progress(site.settings) or 0) > applied_before,
                "the follow to apply while Dagster's storage is away",
                60,
                follow,
            )
            clusters.storage.start()
            time.sleep(1.0)
        _wait_for(
            lambda: (
                (pipeline.origin_progress(site.settings) or 0)
                >= (pipeline.expected_origin_progress(site.settings) or 0)
            ),
            "the follow to apply what was written",
            120,
        )
        store = pipeline.store_of(site.settings)
        followed = {  # the ranges that hold changes: an idle one is no partition
            r.partition_key
            for r in store.chain_ranges()
            if store.get(r).manifest.result.transactions  # type: ignore[union-attr]
        } - earlier
        _wait_while_recording(site, followed, follow)
        follow.send_signal(signal.SIGTERM)
        out, err = follow.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(follow.pid, signal.SIGKILL)
        _started(clusters.storage)
    assert follow.returncode == 0, err
    totals = json.loads(out)["follow"]
    assert totals["storage_outages"] == 1 and totals["storage_outage_s"] > 5.0, totals
    assert "the follow goes on applying" in err and "is back after" in err, err
    assert "Retrying failed database connection" not in err, err
    _follow_succeeded_then_a_catchup_converges(site)


def test_follow_rides_through_a_crash_of_a_target_that_also_holds_dagsters_storage(site: Site):
    """A small set-up keeps Dagster's storage on the target server: a crash of it takes the
    apply and the run's event log away at once. The follower waits for the target while the
    run's recording waits for the storage; both come back in the same run, which ends with
    exit 0 on SIGTERM, and the next catch-up converges."""
    clusters = site.clusters
    database = f"dagster_on_target_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(clusters.target.dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    own_storage = site.env["DAGSTER_POSTGRES_URL"]
    site.env["DAGSTER_POSTGRES_URL"] = (
        f"postgresql+psycopg2://postgres@127.0.0.1:{clusters.target.port}/{database}"
    )
    try:
        follow = site.start("follow", "--json")
        try:
            with _following_under_writes(site, follow, seed=87):
                clusters.target.crash()
                time.sleep(STORAGE_DOWN_S)
                clusters.target.start()
                stored = pipeline.store_of(site.settings).chain_end()
                time.sleep(1.0)
            _wait_for(
                lambda: (
                    pipeline.store_of(site.settings).chain_end() > stored
                    and (pipeline.origin_progress(site.settings) or 0)
                    >= (pipeline.expected_origin_progress(site.settings) or 0)
                ),
                "the follow to apply what was written after the crash",
                120,
                alive=follow,
            )
            follow.send_signal(signal.SIGTERM)
            out, err = follow.communicate(timeout=90)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(follow.pid, signal.SIGKILL)
            if follow.poll() != 0:  # failed before it ended: show what it and its run said
                print(site.what_ended(follow))
        assert follow.returncode == 0, err
        totals = json.loads(out)["follow"]
        assert totals["outages"] == 1 and totals["outage_s"] > 5.0, totals
        # The storage's outage shows only if the recording wrote during it (a range applied
        # just before the crash); the follower's outage shows always.
        assert totals["storage_outages"] <= 1, totals
        _follow_succeeded_then_a_catchup_converges(site)
    finally:
        site.env["DAGSTER_POSTGRES_URL"] = own_storage


def test_kill_while_dagster_forgets_partitions_then_the_next_command_finishes_the_trim(
    site: Site,
):
    """A command killed between two batches of partitions it deletes from Dagster's storage
    (the stale ones of dead runs and the oldest past ``PGCDC_PARTITIONS_KEPT``): partitions are
    a view, so the next plain catch-up trims the rest, the store keeps every range, and the
    target converges."""
    stale = [LsnRange(0x100 + 8 * n, 0x108 + 8 * n).key for n in range(2500)]  # never stored
    with site.instance() as instance:
        instance.add_dynamic_partitions(LSN_RANGES, stale)
    stored_before = _ranges_stored(site)
    env = {"PGCDC_PARTITIONS_KEPT": "2"}
    with site.writer(seed=89):
        time.sleep(0.5)
    killed = site.pgcdc(
        "catchup", "--endpos", "current", env=env, failpoint="partitions.forgetting=kill-group@1"
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = _registered(site)
    assert 2 < len(left) < 2500  # one batch of a thousand went, the rest did not
    with site.writer(seed=90):
        time.sleep(0.5)
    done = site.pgcdc("catchup", "--endpos", "current", env=env)
    assert done.returncode == 0, done.stderr
    registered = _registered(site)
    store = pipeline.store_of(site.settings)
    assert len(registered) <= 2
    assert all(store.holds(LsnRange.from_partition_key(k)) for k in registered)
    assert _ranges_stored(site) > stored_before  # the store keeps every range
    site.assert_converged()


STORE_ROOM = 40 * 1024
"""What is left of the small file system when the catch-up starts (bytes)."""

RANDOM_FILLERS = "UPDATE accounts SET filler = md5(random()::text) || md5(random()::text)"
"""One transaction of 20,000 updates, each with 64 random hex characters (1.28 MB of them):
at least 640 KB however the store compresses them, sixteen times :data:`STORE_ROOM`, on any
machine (what a writer commits in a few seconds depends on the machine's speed: once it fit
in the room)."""


def test_a_full_store_fails_in_one_line_and_once_space_is_freed_the_next_converges(
    site: Site, tmp_path: Path
):
    """The store's file system fills up under a catch-up: the command fails in one line naming
    the store and the fix, leaves no half-written range behind, and once space is freed the
    next plain catch-up stores the range whole and converges. (A small tmpfs holds a copy of
    the store, which then replaces the site's, so the next tests go on from it: whatever
    happened here, since a command on it took the slot past what the site's store holds.)"""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a small file system to fill needs root and mount(8) for a tmpfs")
    small = tmp_path / "small"
    small.mkdir()
    site_store = Path(site.env["PGCDC_STORE"])
    # Room for the store the earlier tests left (its size varies with how their ranges were
    # cut, and too little room fails the copy below, and every later test with it), and 16 MB
    # for the catch-up once space is freed (the random fillers' range and its spill files).
    stored = sum(f.stat().st_size for f in site_store.rglob("*") if f.is_file())
    size_kb = (stored * 3 // 2 + 16 * 1024 * 1024) // 1024
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(small)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:  # a container without the capability to mount
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    store = small / "store"
    filler = small / "filler"
    env = {"PGCDC_STORE": str(store)}
    swapped = caught_up = False
    try:
        shutil.copytree(site_store, store)
        before = set(OutputStore(store).chain_ranges())
        with open(filler, "wb") as out, contextlib.suppress(OSError):  # until 40 KB are left
            out.write(b"\0" * max(0, shutil.disk_usage(small).free - STORE_ROOM))
        assert shutil.disk_usage(small).free <= STORE_ROOM + 64 * 1024
        with psycopg.connect(site.settings.source_dsn, autocommit=True) as conn:
            conn.execute(RANDOM_FILLERS)
        with site.writer(seed=85):
            time.sleep(1.0)
        swapped = True  # from here on the slot may be past what the site's store holds
        try:
            full = site.pgcdc("catchup", "--endpos", "current", env=env)
            assert full.returncode == 1, full.stderr
            last = full.stderr.strip().splitlines()[-1]
            assert f"the output store at {store} is out of space storing range" in last, last
            assert "PGCDC_STORE_RETENTION" in last and "Traceback" not in full.stderr, last
            assert not [n for n in on_disk(OutputStore(store)) if n.startswith(".tmp-")]
            filler.unlink()
            done = site.pgcdc("catchup", "--endpos", "current", env=env)
            assert done.returncode == 0, done.stderr
            caught_up = True
            taken = OutputStore(store)
            new = [taken.get(r) for r in taken.chain_ranges() if r not in before]
            # What the full catch-up had to store did not fit in the room it had.
            written = sum(s.manifest.bytes for s in new if s is not None)
            assert written > 10 * STORE_ROOM, written
        finally:
            # The small store is the site's from here on, whatever failed above.
            filler.unlink(missing_ok=True)
            shutil.rmtree(site_store)
            shutil.copytree(store, site_store)
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
        if swapped and not caught_up:
            # Failed before the store was caught up: the next tests start from a converged
            # site all the same (a plain catch-up, as after any failed command).
            site.pgcdc("catchup", "--endpos", "current")
    site.assert_converged()


def test_a_store_in_the_one_folder_layout_is_continued_by_the_next_catchup(site: Site):
    """A store in the flat layout (every range directly under ``changes/``, as older stores hold
    them): the next plain catch-up reads it, goes on from the target's origin, stores its new
    ranges in buckets, and converges; ``pgcdc status`` counts both."""
    store = OutputStore(site.env["PGCDC_STORE"])
    with site.writer(seed=86):
        time.sleep(2.0)
    assert site.pgcdc("catchup", "--endpos", "current").returncode == 0
    before = store.ranges()
    for rng in before:  # the flat layout
        os.rename(store.range_path(rng), store.changes_dir / rng.key)
    for bucket in [p for p in store.changes_dir.iterdir() if len(p.name) == 8]:
        shutil.rmtree(bucket)
    assert all(store.range_path(r).parent == store.changes_dir for r in before)
    with site.writer(seed=87):
        time.sleep(3.0)
    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    after = OutputStore(store.root).ranges()
    assert after[: len(before)] == before and len(after) > len(before)
    assert all(store.range_path(r).parent == store.bucket_of(r.start) for r in after[len(before) :])
    status = site.pgcdc("status", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["ranges_stored"] == len(OutputStore(store.root).chain_ranges())
    site.assert_converged()


def _started(cluster: LocalCluster) -> None:
    """Start ``cluster`` unless it runs (a test's way out, whether or not it got there)."""
    if not (cluster.datadir / "postmaster.pid").exists():
        cluster.start()


def _registered(site: Site) -> set[str]:
    with site.instance() as instance:
        return set(instance.get_dynamic_partitions(LSN_RANGES))


def _wait_while_recording(
    site: Site, followed: set[str], follow: subprocess.Popen[str], stalled_s: float = 60.0
) -> None:
    """Until every range of ``followed`` is recorded, failing once none more was for
    ``stalled_s``: a backlog of hundreds of ranges, each several writes to the storage, takes
    minutes to record on a loaded machine, and still moves (a fixed bound failed there)."""
    left = len(followed - _registered(site))
    moved = time.monotonic()
    while left:
        if follow.poll() is not None:
            raise AssertionError(
                f"the follow ended with {left} range(s) not recorded\n{site.what_ended(follow)}"
            )
        assert time.monotonic() - moved < stalled_s, (
            f"no range recorded for {stalled_s:.0f} s, {left} of {len(followed)} left"
        )
        time.sleep(1.0)
        now = len(followed - _registered(site))
        if now < left:
            left, moved = now, time.monotonic()


@pytest.mark.long
def test_a_follow_ends_in_one_line_when_dagster_storage_stays_away_then_the_next_converges(
    site: Site,
):
    """Dagster's storage gone for longer than ``PGCDC_FOLLOW_RETRY``: the follow stops at a
    range boundary and exits 1 with one line naming the storage (never its password) and the
    fix, without waiting for Dagster to fail at recording the run's end. While the storage
    stays away, ``pgcdc status`` still reports the replication and a catch-up fails in that
    one line; once it is back, a plain catch-up converges and the dead run is marked failed."""
    clusters = site.clusters
    url = site.env["DAGSTER_POSTGRES_URL"].replace("postgres@", "postgres:s3cret-pw@")
    env = {"PGCDC_FOLLOW_RETRY": "3s", "DAGSTER_POSTGRES_URL": url}  # trust: any password
    follow = site.start("follow", env=env)
    try:
        with _following_under_writes(site, follow, seed=83):
            clusters.storage.stop()
            stopped_at = time.monotonic()
            _, err = follow.communicate(timeout=90)
            ended_s = time.monotonic() - stopped_at
        assert follow.returncode == 1, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("pgcdc: Dagster's storage (postgresql at 127.0.0.1:"), err
        assert "PGCDC_FOLLOW_RETRY" in last and "Traceback" not in err, err
        assert "s3cret-pw" not in err
        assert ended_s < 45, ended_s  # 2-3 of dagster-postgres' 6 s retries, not the run's end
        assert not lock_holders(site.settings.target_dsn, site.settings.slot)

        status = site.pgcdc("status", "--json", env=env)
        assert status.returncode == 0, status.stderr
        runs = json.loads(status.stdout)["runs_in_flight"]
        assert runs.startswith("unknown: Dagster's storage") and "s3cret-pw" not in runs, runs
        caught = site.pgcdc("catchup", "--endpos", "current", env=env)
        assert caught.returncode == 1
        assert (
            caught.stderr.strip()
            .splitlines()[-1]
            .startswith("pgcdc: Dagster's storage (postgresql at")
        ), caught.stderr
        assert "s3cret-pw" not in caught.stderr + caught.stdout
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(follow.pid, signal.SIGKILL)
        _started(clusters.storage)
    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    assert "was left unfinished" in done.stderr, done.stderr
    site.assert_converged()


@dataclass
class RunFollower:
    """A follower as a Dagster run has it (on threads, under the run's range lock, as the
    daemon's follow run), consumed on a thread of its own."""

    follower: Follower
    lock: RangeLock
    followed: list[Followed] = field(default_factory=list)
    errors: list[BaseException] = field(default_factory=list)
    consumer: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.consumer = threading.Thread(target=self.consume)

    def consume(self) -> None:
        try:
            self.followed.extend(self.follower.run())
        except BaseException as exc:
            self.errors.append(exc)


@contextlib.contextmanager
def run_follower(settings: ReplicationSettings, holder: str) -> Iterator[RunFollower]:
    """Follow under the range lock held as ``holder``; stopped and joined on the way out."""
    with range_lock(settings.target_dsn, settings.slot, holder) as lock:
        follower = Follower(settings, None, lock_session=lock.session_pid, lock_holder=lock.holder)
        running = RunFollower(follower, lock)
        running.consumer.start()
        try:
            yield running
        finally:
            follower.stop("test over")
            running.consumer.join(60)


def test_a_run_follower_takes_its_range_lock_again_under_its_run_name_after_a_target_crash(
    site: Site,
):
    """The follower of a Dagster run (on threads, as the daemon's follow run has it) under the
    run's range lock: the target crashes (taking the lock with it) and comes back. The
    follower takes the lock again under the run's name, so the run is still seen as the
    holder, and goes on applying."""
    settings = site.settings
    with run_follower(settings, "run ride-test") as running:
        with site.writer(seed=76):
            _wait_for(lambda: len(running.followed) >= 1, "a range followed", 60)
        site.clusters.target.crash()
        time.sleep(1.0)
        site.clusters.target.start()
        before = len(running.followed)
        with site.writer(seed=77):
            _wait_for(lambda: len(running.followed) > before, "a range after the crash", 60)
        (holder,) = lock_holders(settings.target_dsn, settings.slot)
        assert holder.holder == "run ride-test"
        assert holder.backend_pid != running.lock.session_pid
    # Found as an outage (a session ended) or by the applier's kept connection, whichever
    # met the crash first.
    summary = running.follower.summary
    assert running.errors == [], running.errors
    assert summary.outages + summary.target_reconnects >= 1
    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    site.assert_converged()


def test_a_follower_whose_range_lock_another_catchup_took_ends_naming_it(site: Site):
    """The target ends the follower's sessions (its range lock's among them) and another
    catch-up takes the lock before the follower's next apply: the follower, finding its kept
    connection gone, checks the lock before it applies on a new one, and ends in one line
    naming the holder, instead of applying beside it."""
    settings = site.settings
    with run_follower(settings, "run lock-test") as running:
        with site.writer(seed=74):
            _wait_for(lambda: len(running.followed) >= 2, "two ranges followed", 60)
        taken = _lock_taken_from_the_follower(settings, running.lock.session_pid, "run intruder")
        with taken, site.writer(seed=75):
            running.consumer.join(60)
    errors = running.errors
    assert len(errors) == 1 and isinstance(errors[0], RangeTakenError), errors
    assert "run intruder" in str(errors[0]) and "\n" not in str(errors[0])
    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    site.assert_converged()


@contextlib.contextmanager
def _lock_taken_from_the_follower(
    settings: ReplicationSettings, lock_session: int, holder: str
) -> Iterator[None]:
    """Hold the range lock of ``settings.slot`` as ``holder`` (named as a catch-up names it),
    taken from the follower whose lock session is ``lock_session``: this session waits for the
    lock first, then the target ends that session, and, once this one has the lock, every other
    pgcdc session. PostgreSQL grants a released lock to the session waiting for it, so this one
    has it before the follower can try again. The lock session goes first: a follower whose
    applier lost its connection while the lock session still stood would rightly find its lock
    held and go on (``pg_terminate_backend`` with a timeout ends one backend after another)."""
    with (
        holder_session(settings.target_dsn, holder) as intruder,
        psycopg.connect(settings.target_dsn, autocommit=True) as admin,
    ):
        me = intruder.info.backend_pid
        waiting = threading.Thread(target=take_lock, args=(intruder, settings.slot))
        waiting.start()
        _wait_for(
            lambda: (
                admin.execute(
                    "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", (me,)
                ).fetchone()
                == (1,)
            ),
            "the intruder waiting for the range lock",
            10,
        )
        admin.execute("SELECT pg_terminate_backend(%s, 10000)", (lock_session,))
        waiting.join(10)
        assert not waiting.is_alive(), "the intruder did not get the range lock"
        (taken,) = lock_holders(settings.target_dsn, settings.slot)
        assert taken.backend_pid == me, taken
        admin.execute(
            "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name LIKE 'pgcdc%%' "
            "AND pid <> %s",
            (me,),
        )
        yield


def _follower_pid(command: subprocess.Popen[str]) -> int:
    """The follow process a cold ``pgcdc follow`` forked (engine/follow/process.py)."""
    (pid,) = [pid for pid, cmd in descendants(command.pid).items() if PGCDC in cmd]
    return pid


@pytest.mark.parametrize("victim", ["command", "follower"])
def test_a_cold_follow_runs_in_a_process_that_lives_and_dies_with_its_command(
    site: Site, victim: str
):
    """A fresh ``pgcdc follow`` forks its follower before importing Dagster
    (:mod:`pgcdc_dagster.engine.follow.process`). SIGKILL of the command alone takes the
    follower down with it (parent-death signal), so no follower runs on without the command's
    range lock; SIGKILL of the follower alone (as the OOM killer would) takes the command with
    it. Either way the next plain catch-up converges."""
    before = _ranges_stored(site)
    with site.writer(seed=37 if victim == "command" else 38):
        follow = site.start("follow")
        try:
            _wait_for(lambda: _ranges_stored(site) >= before + 2, "two ranges followed", 120)
            followers = [pid for pid, cmd in descendants(follow.pid).items() if PGCDC in cmd]
            assert len(followers) == 1, descendants(follow.pid)
            (follower,) = followers
            os.kill(follow.pid if victim == "command" else follower, signal.SIGKILL)
            assert gone(follower, 5), "the follower ran on after its command was killed"
            _, err = follow.communicate(timeout=30)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(follow.pid, signal.SIGKILL)
        assert follow.returncode == -signal.SIGKILL, err
        time.sleep(0.5)  # more commits after the kill
    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    site.assert_converged()


def _ranges_stored(site: Site) -> int:
    return len(pipeline.store_of(site.settings).chain_ranges())


SENSOR_TICK = """
from dagster import DagsterInstance, build_sensor_context
from pgcdc_dagster.definitions import defs
loaded = defs()
sensor = loaded.resolve_sensor_def("slot_progress_sensor")
with build_sensor_context(
    instance=DagsterInstance.get(), resources={"pgcdc": loaded.resources["pgcdc"]}
) as context:
    sensor(context)
"""


def test_kill_during_the_sensors_partition_registration_then_a_plain_catchup_converges(site: Site):
    with site.writer(seed=11):
        time.sleep(1.0)
    env = {**os.environ, **site.env, "PGCDC_FAILPOINT": "sensor.after_register"}
    tick = subprocess.run(
        [sys.executable, "-c", SENSOR_TICK], env=env, capture_output=True, text=True, timeout=120
    )
    assert tick.returncode == -signal.SIGKILL, tick.stderr
    store = pipeline.store_of(site.settings)
    with site.instance() as instance:
        orphans = [
            key
            for key in instance.get_dynamic_partitions(LSN_RANGES)
            if store.get(LsnRange.from_partition_key(key)) is None
        ]
    assert len(orphans) == 1  # registered, never run

    with site.writer(seed=12):
        time.sleep(0.5)
    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    site.assert_converged()
    with site.instance() as instance:
        keys = instance.get_dynamic_partitions(LSN_RANGES)
    # The partitions are a view of the store's chain again: the orphan was replaced.
    assert all(store.get(LsnRange.from_partition_key(key)) is not None for key in keys)


def _session_waiting(
    dsn: str, state: str, since: dt.datetime, query_like: str = "%", for_s: float = 2.0
) -> bool:
    """A session of ``dsn``'s database, started at ``since`` or later, in ``state`` for
    ``for_s`` seconds at least: the paused failpoint's of the command started then, not one
    passing through that state between two statements, nor one an earlier test's killed
    command left behind. (Twice in a loaded suite the target-crash test's catch-up went on and
    succeeded: the crash had come before its pause.)"""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND state = %s AND query LIKE %s AND pid <> pg_backend_pid() "
            "AND backend_start >= %s AND state_change < now() - make_interval(secs => %s)",
            (state, query_like, since, for_s),
        ).fetchone()
    return bool(row and row[0])


def server_gone_under_a_running_catchup(
    site: Site,
    seed: int,
    pause: str,
    reached: Callable[[dt.datetime], bool],
    restart: Callable[[], None],
    server: str,
) -> None:
    """Pause a running catch-up at a fault point, restart a server under it: the command fails
    with one line naming that server, and the next plain catch-up converges.

    One way on is not a failure: an applier whose target connection was kept from a range
    before (an empty one applied on it first, as what earlier tests left can make the backlog
    begin) replaces it once and applies the range again, safe as an apply commits whole or not
    at all. The command then ends well and says so (``target_reconnects``)."""
    with site.writer(seed=seed):
        time.sleep(1.0)
    since = dt.datetime.now(dt.UTC)
    running = site.start("catchup", "--endpos", "current", "--json", failpoint=pause)
    try:
        _wait_for(lambda: reached(since), f"the catch-up to reach {pause}", alive=running)
        restart()
        out, err = running.communicate(timeout=120)
    finally:  # a catch-up left paused would hold the range lock into the next test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(running.pid, signal.SIGKILL)
    assert running.returncode != -signal.SIGKILL, err[-4000:]
    if running.returncode == 0:
        summary, _ = json.JSONDecoder().raw_decode(out, out.index("{"))
        assert server == "target" and summary["follow"]["target_reconnects"] == 1, err[-4000:]
        site.assert_converged()
        return
    line = error_line(err)
    # The command's first word on the server's absence: the connection it lost, or, when its
    # next step reconnected first, the server still recovering.
    assert f"{server} PostgreSQL" in line, line
    assert "lost the connection" in line or "cannot connect" in line, line

    done = site.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    site.assert_converged()


def test_target_crash_under_a_running_catchup_fails_in_one_line_and_the_next_converges(site: Site):
    target = site.clusters.target

    def crash() -> None:
        target.crash()
        target.start()

    server_gone_under_a_running_catchup(
        site,
        seed=21,
        pause="apply.in_transaction=sleep(10)",
        reached=lambda since: _session_waiting(
            site.settings.target_dsn, "idle in transaction", since
        ),
        restart=crash,
        server="target",
    )


def test_source_restart_under_a_running_catchup_fails_in_one_line_and_the_next_converges(
    site: Site,
):
    source = site.clusters.source

    def restart() -> None:
        source.stop()
        source.start()

    server_gone_under_a_running_catchup(
        site,
        seed=31,
        pause="receive.fetching=sleep(10)@1",
        reached=lambda since: _session_waiting(
            site.settings.source_dsn, "idle in transaction", since, "%pgcdc_receive%"
        ),
        restart=restart,
        server="source",
    )


def test_random_kills_of_catchup_then_a_plain_catchup_converges(site: Site):
    """Seeded, bounded: runs killed at random moments (during start-up, receive or apply)
    while a writer commits, five kills in at most ten attempts (a run that finishes before its
    moment is not killed), under 30 s of kills; then one plain catch-up."""
    chance = random.Random(20261123)
    kills = 0
    with site.writer(seed=41):
        for _ in range(10):
            running = site.start("catchup", "--endpos", "current")
            time.sleep(chance.uniform(0.5, 3.0))
            if running.poll() is None:
                os.killpg(running.pid, signal.SIGKILL)
                kills += 1
            running.communicate(timeout=60)
            if kills == 5:
                break
    assert kills >= 3
    started = time.monotonic()
    done = site.pgcdc("catchup", "--endpos", "current")
    converged_s = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    site.assert_converged()
    print(f"\nrandom kills: {kills}; plain catch-up converged in {converged_s:.1f} s")


def test_wiping_dagsters_storage_changes_nothing_catchup_does(site: Site, clusters: Clusters):
    """Dagster's runs and partitions are a view: a fresh, empty Dagster storage plans the same
    next range and converges."""
    fresh = f"dagster_wiped_{uuid.uuid4().hex[:8]}"
    _create_database(clusters.storage, fresh)
    wiped = Site(
        clusters,
        {
            **site.env,
            "DAGSTER_POSTGRES_URL": (
                f"postgresql+psycopg2://postgres@127.0.0.1:{clusters.storage.port}/{fresh}"
            ),
        },
        site.settings,
        site.home,
    )
    store = pipeline.store_of(site.settings)
    chain_end = store.chain_end()
    with site.writer(seed=61):
        time.sleep(1.0)
    done = wiped.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    wiped.assert_converged()
    with wiped.instance() as instance:
        ranges = [
            LsnRange.from_partition_key(k) for k in instance.get_dynamic_partitions(LSN_RANGES)
        ]
    # The fresh storage knows the ranges from where the chain ended on: the first that holds a
    # transaction (a follow registers no empty range, and whatever ran before this test may
    # have left WAL of other databases to cross first).
    held = [
        r
        for r in store.chain_from(chain_end)
        if r.start >= chain_end and (got := store.get(r)) and got.manifest.result.transactions
    ]
    assert held and ranges and min(r.start for r in ranges) == held[0].start, (held, ranges)


SNAPSHOT_POINTS = [
    "snapshot.after_marker",
    "snapshot.after_slot",
    "snapshot.copying",
    "snapshot.after_copy",
    "snapshot.after_post_data",
    "snapshot.after_origin",
]


@pytest.mark.long
def test_snapshot_killed_at_every_step_is_never_taken_for_a_snapshot_and_is_redone(
    clusters: Clusters, tmp_path: Path
):
    fresh = make_site(clusters, tmp_path, bulk=True)
    for point in SNAPSHOT_POINTS:
        killed = fresh.pgcdc("snapshot", failpoint=f"{point}=kill-group")
        assert killed.returncode == -signal.SIGKILL, (point, killed.stderr)
        # Whatever the killed snapshot left, catch-up refuses it in one line naming the fix.
        refused = fresh.pgcdc("catchup", "--endpos", "current")
        assert refused.returncode != 0, (point, refused.stdout)
        line = error_line(refused.stderr)
        assert "pgcdc snapshot" in line, (point, line)

    redone = fresh.pgcdc("snapshot")
    assert redone.returncode == 0, redone.stderr
    # The last attempts were killed after their copy: what it copied is kept.
    assert "did not finish: resuming it" in redone.stderr, redone.stderr
    with fresh.writer(seed=51):
        time.sleep(1.0)
    done = fresh.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    fresh.assert_converged()
    with psycopg.connect(fresh.settings.source_dsn) as conn:
        slots = conn.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s",
            (fresh.settings.slot,),
        ).fetchone()
    assert slots == (1,)  # every killed attempt's slot was dropped and replaced by one


def _writing(dsn: str, table: str) -> int:
    """Transactions of ``dsn``'s database that hold a writer's lock on ``table``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        (n,) = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE relation = to_regclass(%s) "
            "AND mode = 'RowExclusiveLock' AND granted",
            (table,),
        ).fetchone()
    return int(n)


def _table_oids(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT relname, oid::int8 FROM pg_class WHERE relkind IN ('r', 'p') "
            "AND relnamespace = 'public'::regnamespace"
        ).fetchall()
    return dict(rows)


def test_a_snapshot_killed_mid_copy_under_writes_resumes_keeping_the_tables_it_copied_whole(
    clusters: Clusters, tmp_path: Path
):
    """SIGKILL of the snapshot's process group once its first copy task committed (the small
    tables' bundle), while the 1M-row table copies and a writer commits. The next plain
    ``pgcdc snapshot`` resumes it, keeping the tables copied whole (the same target tables: not
    dropped, not copied again), and is killed too, while it copies the rest again; the one after
    copies only that rest, as of a new point, and the catch-up converges: the insert-only table
    without a key has exactly the source's rows."""
    fresh = make_site(clusters, tmp_path, bulk=True)
    kill_after_a_copy = "snapshot.range_copied=kill-group@1"
    with fresh.writer(seed=71) as writer:
        killed = fresh.pgcdc("snapshot", failpoint=kill_after_a_copy)
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        before = _table_oids(fresh.settings.target_dsn)
        # Each copied range recorded its rows, from its own transaction's counters.
        with psycopg.connect(fresh.settings.target_dsn, autocommit=True) as conn:
            recorded = conn.execute(
                "SELECT table_name, sum(rows), count(*) - count(rows) "
                "FROM pgcdc_ddl.copied_ranges GROUP BY 1"
            ).fetchall()
            assert recorded, "no range recorded"
            for table, rows, unknown in recorded:
                count = conn.execute(
                    sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(table))
                ).fetchone()
                assert unknown == 0 and (rows,) == count, (table, rows, unknown, count)
        resumed = fresh.pgcdc("snapshot", failpoint=kill_after_a_copy)
        assert resumed.returncode == -signal.SIGKILL, resumed.stderr
        finished = fresh.pgcdc("snapshot")
        assert finished.returncode == 0, finished.stderr
    assert writer.committed > 0
    line = next(ln for ln in resumed.stderr.splitlines() if "did not finish" in ln)
    again = line.partition("copying again:")[2].split()
    assert "resuming it" in line and "public.bulk" in again, line
    assert "were being copied again when that stopped" in finished.stderr, finished.stderr
    after = _table_oids(fresh.settings.target_dsn)
    kept = [t for t in ("accounts", "docs", "history") if f"public.{t}" not in again]
    assert kept, line
    assert all(after[t] == before[t] for t in kept), (before, after)
    assert after["bulk"] != before.get("bulk")  # copied again: dropped and created
    done = fresh.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    fresh.assert_converged()
    chain = pipeline.store_of(fresh.settings).chain()
    assert chain is not None and not chain.adding and not chain.resyncing
    with psycopg.connect(fresh.settings.target_dsn, autocommit=True) as conn:
        records = conn.execute("SELECT to_regclass('pgcdc_ddl.copied_ranges')").fetchone()
    assert records == (None,)  # a finished snapshot's records are gone


@pytest.mark.parametrize("case", ["changed", "rewritten", "alone", "spark"])
def test_a_snapshot_killed_inside_a_split_table_continues_it_from_the_ranges_it_copied(
    clusters: Clusters, tmp_path: Path, case: str
):
    """The 1M-row table cut into ranges of 50,000 rows, copied two at a time; SIGKILL of the
    snapshot's process group once 12 of its ranges committed (most of its blocks), or,
    ``rewritten`` and ``alone``, one. Before the next ``pgcdc
    snapshot``, the source changes that table in the ways that would break a naive
    continuation: deletes and a vacuum that free space in the first blocks, updates that move
    rows from the last blocks into them, updates in place, key changes, inserts. The resume
    keeps the ranges copied (the same target table: not dropped), copies the other blocks,
    copies the changed keys' rows again, and a catch-up under a writer converges.
    ``spark``: the big table's ranges are copied by Spark's tasks, each waiting before its
    commit, so a range's transaction may still be open on the target after the kill; the resume
    waits for it to end (here it rolls back: its ``psql`` pair dies with the worker) before it
    reads what was copied.
    ``rewritten``: a ``VACUUM FULL`` too, which moves every row to a new file: the table is
    copied whole again, and says why. ``alone``: the big table is the only one replicated, so
    the killed snapshot copied no table whole: it is resumed all the same, and is SIGKILLed
    too, once the changed keys' rows are deleted from the kept ranges; the next ``pgcdc
    snapshot`` copies the table again whole (nothing of a continuation is recorded: the table
    is being resynced), and the catch-up converges."""
    fresh = make_site(clusters, tmp_path, bulk=True)
    fresh.env.update({"PGCDC_SNAPSHOT_JOBS": "2", "PGCDC_SNAPSHOT_RANGE_ROWS": "50000"})
    kill_after = 12 if case == "changed" else 1
    if case == "alone":
        fresh.env["PGCDC_TABLES"] = "public.bulk"
    if case == "spark":  # the big table's ranges on Spark's tasks, the small ones the driver's
        fresh.env["PGCDC_SNAPSHOT_DRIVER_ROWS"] = "100000"
    # On Spark, each range waits before its commit: a range's transaction may outlive the kill.
    slow = "copy.before_commit=sleep(4)" if case == "spark" else None
    running = fresh.start("snapshot", failpoint=slow)

    def bulk_range_copied() -> bool:
        with psycopg.connect(fresh.settings.target_dsn, autocommit=True) as conn:
            if conn.execute("SELECT to_regclass('pgcdc_ddl.copied_ranges')").fetchone() == (None,):
                return False
            found = conn.execute(
                "SELECT count(*) FROM pgcdc_ddl.copied_ranges WHERE table_name = 'bulk'"
            ).fetchone()
        return found is not None and found[0] >= kill_after

    try:
        _wait_for(bulk_range_copied, "ranges of the big table to be copied", 120, running)
    finally:
        os.killpg(running.pid, signal.SIGKILL)
        running.communicate()
    # On Spark a range's transaction may outlive the kill, so the records are not final yet
    # (whether one still is here depends on the moment of the kill; the wait for it is
    # proven by test_a_range_that_commits_after_the_kill_is_kept_by_the_resume_that_waited_for_it).
    with psycopg.connect(fresh.settings.target_dsn, autocommit=True) as conn:
        blocks = conn.execute(
            "SELECT start_block, end_block FROM pgcdc_ddl.copied_ranges "
            "WHERE table_name = 'bulk' ORDER BY start_block"
        ).fetchall()
        (kept_rows,) = conn.execute("SELECT count(*) FROM bulk").fetchone()
    # Some of the table's ranges, not all: they would tile [0, ∞) from block 0.
    assert blocks and not (blocks[0][0] == 0 and blocks[-1][1] is None), blocks
    assert 0 < kept_rows < 1_000_000, kept_rows
    before = _table_oids(fresh.settings.target_dsn)
    with psycopg.connect(fresh.settings.source_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM bulk WHERE id <= 3000")
        conn.execute("VACUUM bulk")  # the first blocks' space is free for the updates below
        conn.execute("UPDATE bulk SET v = 'moved ' || id WHERE id > 997000")
        conn.execute("UPDATE bulk SET v = 'again ' || id WHERE id BETWEEN 400001 AND 400100")
        conn.execute("UPDATE bulk SET id = id + 2000000 WHERE id BETWEEN 5001 AND 5010")
        conn.execute(
            "INSERT INTO bulk SELECT g, md5(g::text) FROM generate_series(1000001, 1002000) g"
        )
        if case == "rewritten":
            conn.execute("VACUUM FULL bulk")
    with fresh.writer(seed=73) as writer:
        if case == "alone":
            resumed = fresh.pgcdc("snapshot", failpoint="continue.after_delete=kill-group")
            assert resumed.returncode == -signal.SIGKILL, resumed.stderr
            again = fresh.pgcdc("snapshot")
            assert again.returncode == 0, again.stderr
            assert "were being copied again when that stopped" in again.stderr, again.stderr
        else:
            resumed = fresh.pgcdc("snapshot")
            assert resumed.returncode == 0, resumed.stderr
    assert writer.committed > 0
    line = next(ln for ln in resumed.stderr.splitlines() if "did not finish" in ln)
    assert "continuing public.bulk from its ranges" in line, line
    assert ("keeping the 0 table(s)" in line) == (case == "alone"), line
    if case == "alone":  # killed after the delete: the table had lost rows when it was killed
        assert "pgcdc: resync kept rows: deleting" in resumed.stderr, resumed.stderr
        assert _table_oids(fresh.settings.target_dsn)["bulk"] != before["bulk"]  # whole again
    elif case == "rewritten":
        said = next(ln for ln in resumed.stderr.splitlines() if "pgcdc: public.bulk:" in ln)
        assert "copied whole again: rewritten since" in said, said
        assert _table_oids(fresh.settings.target_dsn)["bulk"] != before["bulk"]
    else:
        said = next(ln for ln in resumed.stderr.splitlines() if "pgcdc: public.bulk:" in ln)
        found = re.search(r"range\(s\) copied before kept \(([\d,]+) row\(s\)\)", said)
        assert found is not None, said
        recorded = int(found.group(1).replace(",", ""))
        # On Spark a range still open at the kill may have committed since: the resume read
        # the records once it ended.
        assert recorded >= kept_rows if case == "spark" else recorded == kept_rows, said
        # The steps outside the copy's rows say what they do as they begin.
        for step in ("changed keys: reading", "kept rows: deleting", "changed rows: copying"):
            assert f"pgcdc: resync {step}" in resumed.stderr, resumed.stderr
        assert _table_oids(fresh.settings.target_dsn)["bulk"] == before["bulk"]  # not dropped
        with fresh.instance() as instance:  # the UI's snapshot table says what was kept
            event = instance.get_latest_materialization_event(BASE_SNAPSHOT_KEY)
        assert event is not None and event.asset_materialization is not None
        records = event.asset_materialization.metadata["tables"].value.records  # type: ignore[attr-defined]
        kept = {r.data["table"]: r.data["kept_rows"] for r in records}
        assert kept["public.bulk"] == recorded, kept
    done = fresh.pgcdc("catchup", "--endpos", "current")
    assert done.returncode == 0, done.stderr
    if case == "alone":
        (bulk,) = verify.compare_tables(fresh.settings, [TableName("public", "bulk")])
        assert bulk.equal, (bulk.source_rows, bulk.target_rows)
    else:
        fresh.assert_converged()
    with psycopg.connect(fresh.settings.target_dsn, autocommit=True) as conn:
        moved = conn.execute("SELECT count(*) FROM bulk WHERE v LIKE 'moved %'").fetchone()
        keyed = conn.execute("SELECT count(*) FROM bulk WHERE id > 2000000").fetchone()
    assert moved == (3000,) and keyed == (10,), (moved, keyed)


def test_a_range_that_commits_after_the_kill_is_kept_by_the_resume_that_waited_for_it(
    clusters: Clusters, tmp_path: Path
):
    """A copier the kill did not reach (a Spark task on another host) still has a range's
    transaction open on the target: its rows copied, its record and commit still to come. The next
    ``pgcdc snapshot`` waits for it before it reads what was copied; the range commits meanwhile,
    so the resume keeps it instead of copying its blocks again beside it, and the end is equal
    (no row twice: the key is built after the copy)."""
    fresh = make_site(clusters, tmp_path, bulk=True)
    fresh.env.update(
        {
            "PGCDC_SNAPSHOT_JOBS": "2",
            "PGCDC_SNAPSHOT_RANGE_ROWS": "50000",
            "PGCDC_TABLES": "public.bulk",
        }
    )
    running = fresh.start("snapshot")

    def ranges_copied() -> bool:
        with psycopg.connect(fresh.settings.target_dsn, autocommit=True) as conn:
            if conn.execute("SELECT to_regclass('pgcdc_ddl.copied_ranges')").fetchone() == (None,):
                return False
            found = conn.execute("SELECT count(*) FROM pgcdc_ddl.copied_ranges").fetchone()
        return found is not None and found[0] >= 3

    try:
        _wait_for(ranges_copied, "ranges of the big table to be copied", 120, running)
    finally:
        os.killpg(running.pid, signal.SIGKILL)
        running.communicate()
    _wait_for(lambda: _writing(fresh.settings.target_dsn, "bulk") == 0, "the killed copies", 30)
    with psycopg.connect(fresh.settings.target_dsn, autocommit=True) as conn:
        recorded = conn.execute(
            "SELECT start_block, end_block, slot, consistent_point::text, filenode "
            "FROM pgcdc_ddl.copied_ranges ORDER BY start_block"
        ).fetchall()
    # The orphan's range: the first blocks no record holds (50 of them, or up to the next).
    start = 0
    for begin, end, *_ in recorded:
        if begin > start:
            break
        start = end
    assert start is not None, recorded  # the records do not tile the table: it is unfinished
    following = [begin for begin, *_ in recorded if begin > start]
    stop = min([start + 50, *following])
    _, _, slot, point, filenode = recorded[0]
    orphan_range = TableRange(
        TableName("public", "bulk"), TableName("public", "bulk"), ("id", "v"), start, stop, 0,
        filenode=filenode,
    )  # fmt: skip
    select = (
        "COPY (SELECT id, v FROM bulk WHERE ctid >= %s::tid AND ctid < %s::tid) "
        "TO STDOUT (FORMAT binary)"
    )
    orphan = psycopg.connect(fresh.settings.target_dsn)
    try:
        # The source has not changed since the killed snapshot's point: these are its rows.
        with (
            psycopg.connect(fresh.settings.source_dsn, autocommit=True) as src,
            src.cursor().copy(select, (f"({start},0)", f"({stop},0)")) as out,
            orphan.cursor().copy("COPY bulk (id, v) FROM STDIN (FORMAT binary)") as into,
        ):
            for block in out:
                into.write(block)
        (orphan_rows,) = orphan.execute("SELECT count(*) FROM bulk").fetchone()
        resumed = fresh.start("snapshot")

        def waiting() -> bool:  # the resume's SHARE lock, queued behind the orphan's
            with psycopg.connect(fresh.settings.target_dsn, autocommit=True) as conn:
                (n,) = conn.execute(
                    "SELECT count(*) FROM pg_locks WHERE relation = to_regclass('bulk') "
                    "AND mode = 'ShareLock' AND NOT granted"
                ).fetchone()
            return n > 0

        _wait_for(waiting, "the resume to wait for the orphaned range", 60, resumed)
        # The orphan ends as a copy task does: its record, then its commit.
        orphan.execute(record_statement(CopyRecord(slot, point), orphan_range))
        orphan.commit()
    finally:
        orphan.close()
    out, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    line = next(ln for ln in err.splitlines() if "did not finish" in ln)
    assert "continuing public.bulk from its ranges" in line, line
    said = next(ln for ln in err.splitlines() if "pgcdc: public.bulk:" in ln)
    kept = re.search(r"(\d+) range\(s\) copied before kept \(([\d,]+) row\(s\)\)", said)
    assert kept is not None, said
    assert int(kept.group(1)) == len(recorded) + 1, said  # the orphan's range among them
    assert int(kept.group(2).replace(",", "")) >= orphan_rows, said
    (bulk,) = verify.compare_tables(fresh.settings, [TableName("public", "bulk")])
    assert bulk.equal, (bulk.source_rows, bulk.target_rows)


def test_a_snapshot_killed_alone_mid_copy_leaves_no_copy_running_behind_the_redo(
    clusters: Clusters, tmp_path: Path
):
    """SIGKILL of the ``pgcdc`` process only (not its group) while its ``psql`` pair copies:
    the pair is killed with it (parent-death signal) and its target side never got the
    ``COMMIT`` that only ``pgcdc`` writes, so nothing more lands on the target, and the redone
    snapshot converges."""
    fresh = make_site(clusters, tmp_path, bulk=True)
    killed = fresh.pgcdc("snapshot", failpoint="snapshot.copying=kill")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    target = fresh.settings.target_dsn

    def copies_running() -> int:
        with psycopg.connect(target, autocommit=True) as conn:
            (n,) = conn.execute(
                "SELECT count(*) FROM pg_stat_progress_copy WHERE datname = current_database()"
            ).fetchone()
        return int(n)

    _wait_for(lambda: copies_running() == 0, "the orphaned copies to end", 10)
    with psycopg.connect(target, autocommit=True) as conn:
        landed = conn.execute("SELECT count(*) FROM bulk").fetchone()
        time.sleep(1.0)
        assert conn.execute("SELECT count(*) FROM bulk").fetchone() == landed
        assert landed[0] < 1_000_000  # killed mid-copy: the copy did not run to its end

    redone = fresh.pgcdc("snapshot")
    assert redone.returncode == 0, redone.stderr
    assert "did not finish" in redone.stderr  # resumed, or taken again when nothing was whole
    comparisons = verify.compare_tables(fresh.settings, pipeline.replicated_tables(fresh.settings))
    assert comparisons and all(c.equal for c in comparisons), comparisons


@pytest.mark.long
@pytest.mark.parametrize("mode", ["range", "follow"])
def test_the_daemon_alone_converges_after_run_workers_and_its_code_server_are_killed(
    clusters: Clusters, tmp_path: Path, mode: str
):
    """dagster-daemon with the slot sensor and the shipped dagster.yaml: run workers SIGKILLed
    at random moments while a writer commits, and in range mode the code server killed once;
    after the writer stops, the sensor alone brings the target to the source within a bounded
    time. In follow mode the worker killed is the follow run's: the sensor finds it dead and
    starts another."""
    fresh = make_site(clusters, tmp_path)
    fresh.env.update(
        {
            "PGCDC_SENSOR_INTERVAL": "1",
            "PGCDC_DEAD_RUN_GRACE": "5",
            "PGCDC_RANGE_MAX_BYTES": str(4 * 1024 * 1024),
            "PGCDC_MODE": mode,
        }
    )
    taken = fresh.pgcdc("snapshot")
    assert taken.returncode == 0, taken.stderr
    daemon = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "dagster-daemon"),
            "run",
            "-w",
            str(REPO / "workspace.yaml"),
        ],
        cwd=REPO,
        env={**os.environ, **fresh.env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    chance = random.Random(7)
    workers_killed = 0
    # The daemon is blind from a code server's death to its next workspace refresh (Dagster
    # refreshes every 60 s): paid once, in range mode, once two workers were killed, so the
    # blind time overlaps the catch-up after the writes rather than adding to their backlog.
    code_server_killed = mode != "range"
    try:
        with fresh.writer(seed=71):
            # 12 s of writes and kills, longer (up to 137 s) until two workers (and the code
            # server) were killed: on a loaded machine the daemon starts its runs later.
            writing_until = time.monotonic() + 12
            while time.monotonic() < writing_until or (
                not (workers_killed >= 2 and code_server_killed)
                and time.monotonic() < writing_until + 125
            ):
                time.sleep(chance.uniform(0.5, 2.0))
                # The code server spawns each run worker through multiprocessing. A per-range
                # run lives a second or two: look for one for up to 5 s (one look, at a random
                # moment, can miss every worker for a long while).
                looking_until = time.monotonic() + 5.0
                while True:
                    tree = descendants(daemon.pid)
                    workers = [pid for pid, cmd in tree.items() if "multiprocessing.spawn" in cmd]
                    if workers or time.monotonic() >= looking_until:
                        break
                    time.sleep(0.1)
                if workers:
                    os.kill(chance.choice(workers), signal.SIGKILL)
                    workers_killed += 1
                if not code_server_killed and workers_killed >= 2:
                    servers = [pid for pid, cmd in tree.items() if "api grpc" in cmd]
                    for pid in servers:
                        os.kill(pid, signal.SIGKILL)
                    code_server_killed = bool(servers)
        stopped = time.monotonic()
        endpos = pipeline.resolve_endpos(fresh.settings, "current")

        def converged() -> bool:
            from pgcdc_dagster.engine.control.next_step import CaughtUp

            try:
                if not isinstance(pipeline.next_step(fresh.settings, endpos), CaughtUp):
                    return False
            except Exception:
                return False
            with fresh.instance() as instance:
                runs = instance.get_runs(RunsFilter(statuses=list(NOT_FINISHED_STATUSES)))
            # In follow mode one follow run stays alive by design.
            return all(run.job_name == "follow" for run in runs) if mode == "follow" else not runs

        _wait_for(converged, "the daemon to catch up", timeout=240)
        converge_s = time.monotonic() - stopped
    finally:
        os.killpg(daemon.pid, signal.SIGTERM)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(daemon.pid, signal.SIGKILL)
    assert workers_killed >= 2 and code_server_killed
    if mode == "follow":
        # The daemon's SIGTERM reached the follow run's worker: it stops at a range boundary.
        def finished() -> bool:
            with fresh.instance() as instance:
                return not instance.get_runs(RunsFilter(statuses=list(NOT_FINISHED_STATUSES)))

        _wait_for(finished, "the follow run to stop", timeout=60)
    fresh.assert_converged()
    if mode == "follow":
        with fresh.instance() as instance:
            failed = instance.get_runs(
                RunsFilter(job_name="follow", statuses=[DagsterRunStatus.FAILURE])
            )
        assert failed, "no killed follow run was marked failed"
    print(
        f"\ndaemon ({mode} mode): {workers_killed} run workers and the code server killed; "
        f"converged {converge_s:.1f} s after the writer stopped"
    )
