"""Running the project's jobs from a process of our own (the CLI, the demo), and the instance
they are recorded in.

The instance: ``$DAGSTER_HOME/dagster.yaml`` when there is one (the shipped ``dagster.yaml``:
PostgreSQL storage, the run queue, run monitoring, for the daemon and the UI). Without one,
the embedded default: Dagster's own local storage under ``$DAGSTER_HOME`` (default
``.pgcdc/dagster_home``), or PostgreSQL storage when ``DAGSTER_POSTGRES_URL`` is set; no
telemetry, and none of Dagster's warnings about a missing ``dagster.yaml``. Either way every
run shows in ``dagster dev`` pointed at the same home.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any

from ..engine.errors import PgcdcError
from ..engine.settings import ReplicationSettings
from .storage_outage import quiet_storage_retries

DEFAULT_DAGSTER_HOME = ".pgcdc/dagster_home"

QUIET = {"loggers": {"console": {"config": {"log_level": "CRITICAL"}}}}
"""Runs started here log to the instance (and the UI) in full; the terminal gets one line."""


class RunFailedError(PgcdcError):
    """A run of the project's jobs failed or cannot start; the message is the one line."""


_instance: Any = None


def dagster_instance() -> Any:
    """The instance runs are recorded in (see the module docstring); one per process."""
    global _instance
    if _instance is None:
        from dagster import DagsterInstance
        from dagster._core.instance.ref import InstanceRef

        home = Path(os.environ.get("DAGSTER_HOME") or DEFAULT_DAGSTER_HOME).resolve()
        home.mkdir(parents=True, exist_ok=True)
        overrides: dict[str, Any] | None = None
        if not (home / "dagster.yaml").exists():
            overrides = {"telemetry": {"enabled": False}}
            url = os.environ.get("DAGSTER_POSTGRES_URL")
            if url:
                overrides["storage"] = {"postgres": {"postgres_url": url}}
        quiet = _DropMissingConfigWarning()
        logging.getLogger("dagster").addFilter(quiet)
        try:
            ref = InstanceRef.from_dir(str(home), overrides=overrides)
        finally:
            logging.getLogger("dagster").removeFilter(quiet)
        quiet_storage_retries()
        _instance = DagsterInstance.from_ref(ref)
        keep_storage_connections(_instance)
        record_under_jobs(_instance)
    return _instance


POOL_RECYCLE_S = 3600
"""A kept storage connection is replaced after this long (as dagster-webserver's default)."""
POOL_MAX_OVERFLOW = 8
"""Connections beyond the kept one while several threads write at once (closed after use)."""
_kept: weakref.WeakSet[Any] = weakref.WeakSet()


def keep_storage_connections(instance: Any) -> None:
    """Hold one connection per storage open for the life of this process, as dagster-webserver
    does (``DagsterInstance.optimize_for_webserver``), instead of Dagster's default of a new
    connection for every read and write.

    Why: a ``follow`` run writes the events of every range it materialises, a range every
    ``PGCDC_FOLLOW_CUT_MS`` while changes flow: measured at 300 tps with the storage on the
    target server, 706 new server connections in 11 s (a backend started and ended for each
    write), against 9 with this; the 2-core machine was busy 17.3-18.3 CPU-s of every 10 s
    against 14.3-14.9. A ``pgcdc snapshot`` opened 56. Their commits do not wait for the disk
    (:func:`_commit_asynchronously`).

    What must hold: a kept connection the server dropped while it sat in the pool (a restart,
    an idle timeout) is not handed to Dagster: each checkout pings first and a dead connection
    is replaced (:func:`_ping_on_checkout`). One dropped while a write is under way fails that
    write, as it did unpooled. ``optimize_for_webserver`` sets ``statement_timeout`` on each
    connection; 0 (none) is Dagster's own default, but it overrides a timeout set on the
    storage database or role. Idempotent; storages that are not SQL (none here) ignore it."""
    if instance in _kept:
        return
    _listen_for_checkouts()
    instance.optimize_for_webserver(
        statement_timeout=0, pool_recycle=POOL_RECYCLE_S, max_overflow=POOL_MAX_OVERFLOW
    )
    _kept.add(instance)


def _listen_for_checkouts() -> None:
    """On every SQLAlchemy pool of this process: the storages' engines are private to
    dagster-postgres, and Dagster's are the only pools here. A fresh connection is pinged too,
    one round trip beside its connect."""
    from sqlalchemy import event
    from sqlalchemy.pool import Pool

    if not event.contains(Pool, "checkout", _ping_on_checkout):
        event.listen(Pool, "checkout", _ping_on_checkout)
    if not event.contains(Pool, "connect", _commit_asynchronously):
        event.listen(Pool, "connect", _commit_asynchronously)


def _commit_asynchronously(dbapi_connection: Any, record: Any) -> None:
    """``synchronous_commit = off`` on each storage connection this process opens: a commit
    returns before its WAL is flushed to disk. Dagster commits each event on its own (twice
    for an asset event), so a follow waited for two disk flushes per event: measured on this
    machine, 1,000 materialisations took 4.1-5.2 ms an event against 7.0-8.3 ms. What a crash
    of the storage server can then lose is its last fraction of a second of events, never
    progress: that lives in the slot, the store and the origin, and Dagster's records are a
    view of them (the next range's events, or ``pgcdc status``, show where things stand)."""
    del record
    if not type(dbapi_connection).__module__.startswith("psycopg2"):
        return  # Dagster's local SQLite storage
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET synchronous_commit = off")
    finally:
        cursor.close()
    dbapi_connection.commit()


def _ping_on_checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    """SQLAlchemy's pessimistic disconnect handling: raising ``DisconnectionError`` here
    makes the pool drop this connection and check out a fresh one."""
    from sqlalchemy.exc import DisconnectionError

    del record, proxy
    try:
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute("SELECT 1")
        finally:
            cursor.close()
    except Exception as exc:  # any failure of the ping means the connection is unusable
        raise DisconnectionError("Dagster storage connection lost; reconnecting") from exc


class _DropMissingConfigWarning(logging.Filter):
    """Dagster warns when ``$DAGSTER_HOME`` has no ``dagster.yaml``; for pgcdc that is the
    documented embedded default, not a mistake to report."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "No dagster instance configuration file" not in record.getMessage()


def load_defs() -> Any:
    from ..definitions import defs

    return defs()


def _definitions_of(job: str) -> Any:
    """Where ``job`` is resolved: the op jobs alone (:func:`..definitions.op_job_definitions`)
    or the whole location."""
    from ..definitions import op_job_definitions
    from .jobs import OP_JOBS

    return op_job_definitions() if job in OP_JOBS else load_defs()


LOCATION_NAME = "pgcdc_dagster"
"""The code location's name in ``workspace.yaml``."""
REPOSITORY_NAME = "__repository__"
"""The name Dagster gives the repository of a code location's ``Definitions``."""


def job_origin(name: str) -> Any:
    """Where the UI finds the job ``name``: ``workspace.yaml``'s code location. A run that
    carries it is listed under its job, drawn in the Overview timeline, and can be re-executed
    from the UI, as a run the daemon launched; a run created by ``execute_in_process`` has
    none, and shows in the Runs list only."""
    from dagster._core.remote_origin import (
        ManagedGrpcPythonEnvCodeLocationOrigin,
        RemoteRepositoryOrigin,
    )
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin

    loadable = LoadableTargetOrigin(
        executable_path=sys.executable,
        module_name="pgcdc_dagster.definitions",
        attribute="defs",
        working_directory=os.getcwd(),
    )
    location = ManagedGrpcPythonEnvCodeLocationOrigin(loadable, LOCATION_NAME)
    return RemoteRepositoryOrigin(location, REPOSITORY_NAME).get_job_origin(name)


def record_under_jobs(instance: Any) -> None:
    """Have every run ``instance`` creates for a job in this process carry the job's origin
    (:func:`job_origin`). ``execute_in_process`` takes no origin and creates its run through
    the instance's ``create_run_for_job``: this instance's gives one. Idempotent."""
    create = instance.create_run_for_job
    if getattr(create, "records_under_jobs", False):
        return

    def create_run_for_job(job_def: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("remote_job_origin", job_origin(job_def.name))
        return create(job_def, **kwargs)

    create_run_for_job.records_under_jobs = True  # type: ignore[attr-defined]
    instance.create_run_for_job = create_run_for_job


def run_job(
    name: str,
    *,
    partition_key: str | None = None,
    run_config: dict | None = None,
    allow_failure: bool = False,
) -> Any:
    """Execute a job of the code location in this process, recorded in the instance and tagged
    with this process's identity (so that, if this process dies, the next command sees at once
    that the run is dead)."""
    from ..engine import processes
    from .runs import PROCESS_TAG

    job = _definitions_of(name).resolve_job_def(name)
    result = job.execute_in_process(
        instance=dagster_instance(),
        partition_key=partition_key,
        run_config={**QUIET, **(run_config or {})},
        tags={PROCESS_TAG: processes.identity()},
        raise_on_error=False,
    )
    if not result.success and not allow_failure:
        raise RunFailedError(f"{name} run {result.run_id} failed: {_failure_text(result)}")
    return result


def _failure_text(result: Any) -> str:
    for event in result.all_events:
        if event.is_step_failure:
            data = event.step_failure_data
            if data.user_failure_data and data.user_failure_data.description:
                return str(data.user_failure_data.description)
            return _error_line(data.error) or "step failed"
        if event.is_resource_init_failure or event.is_run_failure:
            line = _error_line(getattr(event.event_specific_data, "error", None))
            if line:
                return line
    return "see the run in the Dagster UI"


def _error_line(error: Any) -> str | None:
    """The line to show of a chain of errors: the deepest of ours (a :class:`PgcdcError`
    names the problem and the fix), else the deepest one's last line."""
    ours, deepest = None, None
    while error is not None:
        if error.cls_name in _pgcdc_error_names():
            ours = error
        deepest, error = error, error.cause
    chosen = ours or deepest
    if chosen is None:
        return None
    text = chosen.message.strip()
    if ours is None:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if len(lines) > 1 and lines[-1].startswith(("HINT:", "DETAIL:")):
            return f"{lines[0]} ({lines[-1]})"  # a server error: its message, then its hint
        return lines[-1] if lines else None
    head, sep, rest = text.partition(": ")
    return rest if sep and head.rsplit(".", 1)[-1] == chosen.cls_name else text


def _pgcdc_error_names() -> set[str]:
    names, todo = set(), [PgcdcError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def clear_the_way(
    instance: Any,
    settings: ReplicationSettings,
    wait_s: float,
    command: str,
    *,
    waiting: bool = True,
) -> None:
    """Before a run that takes the range lock: fail the runs whose worker died (saying so),
    cancel queued per-range runs (this command does their work), and wait for a live run to
    finish, or refuse after ``wait_s`` seconds. Runs started here and runs the daemon launches
    obey the same rule: one holder of the range lock at a time.

    ``waiting=False``: nothing to wait for here. Either this process already holds the lock (a
    head start), so no other run can be alive (a run launched meanwhile fails at once on the
    lock), or the command takes the range in its run, where a live follow makes way for it
    (``pgcdc add-table``, see :func:`~pgcdc_dagster.engine.range_lock.range_lock_or_way`)."""
    from dagster import DagsterRunStatus

    from ..engine.range_lock import lock_holders
    from .runs import ALIVE, QUEUED, fail_dead_runs, judge, pgcdc_runs_not_finished

    grace = settings.dead_run_grace
    deadline = time.monotonic() + wait_s
    while True:
        holders = lock_holders(settings.target_dsn, settings.slot)
        verdicts = judge(instance, pgcdc_runs_not_finished(instance), holders, grace)
        for dead in fail_dead_runs(instance, verdicts, command):
            print(
                f"pgcdc: run {dead.run.run_id} ({dead.run.job_name}) was left unfinished: "
                f"{dead.reason}; marked it failed",
                file=sys.stderr,
            )
        live = []
        for verdict in verdicts:
            if verdict.state == QUEUED and verdict.run.job_name == "catchup":
                if verdict.run.status == DagsterRunStatus.QUEUED:
                    instance.report_run_canceled(
                        verdict.run,
                        message=f"superseded by {command}, which takes the range itself",
                    )
            elif verdict.state in (ALIVE, QUEUED):
                live.append(verdict)
        if not waiting or (not live and not holders):
            return
        if time.monotonic() > deadline:
            who = (
                f"run {live[0].run.run_id} ({live[0].reason})"
                if live
                else f"{holders[0].holder}, holding the range lock"
            )
            raise RunFailedError(
                f"a catch-up is still in flight after {wait_s:.0f} s: {who}; wait for it (see "
                "the Dagster UI) or pass a longer --wait"
            )
        time.sleep(1)


def observed_metadata(result: Any, having: str | None = None) -> dict[str, Any]:
    """The metadata values of the run's last asset observation (with the key ``having``, when
    given): what an ops job reports (prune, add-table, finish; a follow's totals)."""
    observed: dict[str, Any] = {}
    for event in result.all_events:
        if event.is_asset_observation:
            metadata = event.asset_observation_data.asset_observation.metadata
            if having is None or having in metadata:
                observed = {k: v.value for k, v in metadata.items()}
    return observed


def materialization_metadata(result: Any, key: str) -> dict[str, Any]:
    for event in result.get_asset_materialization_events():
        mat = event.step_materialization_data.materialization
        if mat.asset_key.to_user_string() == key:
            return {k: getattr(v, "value", v) for k, v in mat.metadata.items()}
    return {}
