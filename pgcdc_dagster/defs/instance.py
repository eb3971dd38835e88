"""The Dagster instance a process of ours records its runs in (the CLI, the demo, the
benchmarks), and the origin those runs carry so the UI lists them under their jobs.

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

from .storage_outage import quiet_storage_retries

DEFAULT_DAGSTER_HOME = ".pgcdc/dagster_home"

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
        complete_storage_schema(_instance)
        keep_storage_connections(_instance)
        record_under_jobs(_instance)
    return _instance


def complete_storage_schema(instance: Any) -> None:
    """Create the tables of Dagster's SQL storage that a process killed while creating them left
    out (what exists is kept).

    Why: dagster-postgres creates a storage's tables only when its first table is missing, on an
    autocommit connection, one statement after the other. A first ``pgcdc`` command killed in
    between (its head start copies while it opens Dagster's storage) leaves some of them, and
    every later process skips the creation and fails on a missing table (``relation "run_tags"
    does not exist``): crash anywhere, re-run converges must hold for Dagster's records too.
    Costs one catalog query a storage when nothing is missing."""
    from dagster._core.storage.event_log.schema import SqlEventLogStorageMetadata
    from dagster._core.storage.runs.schema import RunStorageSqlMetadata
    from dagster._core.storage.schedules.schema import ScheduleStorageSqlMetadata
    from sqlalchemy import inspect

    storages = (
        (instance.run_storage, RunStorageSqlMetadata),
        (instance.event_log_storage, SqlEventLogStorageMetadata),
        (instance.schedule_storage, ScheduleStorageSqlMetadata),
    )
    for storage, metadata in storages:
        engine = getattr(storage, "_engine", None)
        if engine is None or engine.dialect.name != "postgresql":
            continue  # Dagster's local SQLite storage creates its files whole
        with engine.connect() as conn:
            if set(metadata.tables) - set(inspect(conn).get_table_names()):
                metadata.create_all(conn, checkfirst=True)


POOL_RECYCLE_S = 3600
"""A kept storage connection is replaced after this long (as dagster-webserver's default)."""
POOL_MAX_OVERFLOW = 8
"""Connections beyond the kept one while several threads write at once (closed after use)."""
_kept: weakref.WeakSet[Any] = weakref.WeakSet()


def keep_storage_connections(instance: Any) -> None:
    """Hold one connection per storage open for the life of this process, as dagster-webserver
    does (``DagsterInstance.optimize_for_webserver``), instead of Dagster's default of a new
    connection for every read and write.

    Why: a ``follow`` run writes the events of every range it materialises, a range every few
    milliseconds to ``PGCDC_FOLLOW_CUT_MS`` while changes flow, and a new connection for each
    write starts and ends a server backend every time, where kept connections are a few for
    the whole run; the machine is noticeably less busy with them (see
    ``benchmarks/HISTORY.md``, "Dagster's storage: kept connections and asynchronous
    commits"). Their commits do not wait for the disk (:func:`_commit_asynchronously`).

    What must hold: a kept connection the server dropped while it sat in the pool (a restart,
    an idle timeout) is not handed to Dagster: a checkout of one idle for
    :data:`PING_IDLE_S` or more pings first and a dead connection is replaced
    (:func:`_ping_on_checkout`). One dropped while a write is under way, or in the second after
    it, fails the next write, as it did unpooled. ``optimize_for_webserver`` sets
    ``statement_timeout`` on each connection; 0 (none) is Dagster's own default, but it
    overrides a timeout set on the storage database or role. Idempotent; storages that are
    not SQL (none here) ignore it."""
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
    if not event.contains(Pool, "checkin", _note_checkin):
        event.listen(Pool, "checkin", _note_checkin)
    if not event.contains(Pool, "connect", _commit_asynchronously):
        event.listen(Pool, "connect", _commit_asynchronously)


def _commit_asynchronously(dbapi_connection: Any, record: Any) -> None:
    """``synchronous_commit = off`` on each storage connection this process opens: a commit
    returns before its WAL is flushed to disk. Dagster commits each event on its own (twice for
    an asset event), so a follow would wait for two disk flushes per event; without them an
    event is written clearly faster (see ``benchmarks/HISTORY.md``, ``benchmarks/freshness.py
    --extra-tables 100`` and "Dagster's storage: kept connections and asynchronous commits").
    What a crash of the storage server can then lose is its last fraction of a second of events,
    never progress: that lives in the slot, the store and the origin, and Dagster's records are
    a view of them (the next range's events, or ``pgcdc status``, show where things stand)."""
    del record
    if not type(dbapi_connection).__module__.startswith("psycopg2"):
        return  # Dagster's local SQLite storage
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("SET synchronous_commit = off")
    finally:
        cursor.close()
    dbapi_connection.commit()


PING_IDLE_S = 1.0
"""A kept connection given back less than this long ago is handed out without a ping."""


def _note_checkin(dbapi_connection: Any, record: Any) -> None:
    del dbapi_connection
    if record is not None:
        record.info["pgcdc_checked_in"] = time.monotonic()


def _ping_on_checkout(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    """SQLAlchemy's pessimistic disconnect handling: raising ``DisconnectionError`` here
    makes the pool drop this connection and check out a fresh one.

    Only a connection that sat in the pool for :data:`PING_IDLE_S` or more is pinged: a follow
    writes about ten events a range, several ranges a second, and a ping before each doubled
    its round trips to the storage (a sixth of the recording's time, ``benchmarks/HISTORY.md``,
    "The cut when the applier is ready"). A server that went away within that second fails
    the next write instead, as one going away during a write does: the follow's writes ride
    it (:mod:`.storage_outage`), and any other run fails and the next one takes over (the
    records are a view; progress lives in the slot, the store and the origin)."""
    from sqlalchemy.exc import DisconnectionError

    del proxy
    checked_in = record.info.get("pgcdc_checked_in") if record is not None else None
    if checked_in is not None and time.monotonic() - checked_in < PING_IDLE_S:
        return
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
