"""Resources: connection strings through ``EnvVar`` (never stored in run config), settings,
Spark, and the range lock a run holds for its whole life."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dagster import ConfigurableResource, EnvVar, InitResourceContext
from dagster_pyspark import LazyPySparkResource
from pydantic import PrivateAttr

from ..engine.settings import (
    DEFAULT_DECODING_WORK_MEM,
    DEFAULT_FOLLOW_RETRY_S,
    DEFAULT_MEMORY_LIMIT,
    DEFAULT_PARTITIONS_KEPT,
    DEFAULT_STORE_RETENTION_S,
    ReplicationSettings,
)


class PostgresResource(ConfigurableResource):
    """A PostgreSQL server by libpq conninfo; the value comes from an environment variable."""

    dsn: str


class ReplicationResource(ConfigurableResource):
    """Slot, publication, table selection and range size (see
    :class:`~pgcdc_dagster.engine.settings.ReplicationSettings`, which validates them)."""

    slot: str
    publication: str
    tables: str = ""
    """Comma list of ``schema.table``; empty means every user table."""
    range_max_bytes: int
    snapshot_parquet: bool = False
    """Also write the base snapshot as Parquet under the store's ``snapshot/``."""
    snapshot_driver_rows: int | None = None
    snapshot_jobs: int | None = None
    snapshot_range_rows: int | None = None
    apply_synchronous_commit: str = "off"
    """The apply transactions' ``synchronous_commit`` on the target (``off``: a subscription's)."""
    follow_cut_ms: int = 200
    follow_range_bytes: int = 32 * 1024 * 1024
    follow_read: str = "stream"
    """``stream`` or ``peek``: how a follow that keeps up reads the slot."""
    follow_idle_s: float = 10.0
    spark_min_changes: int | None = None
    """Unset: Spark takes big ranges on a cluster only (see ``ReplicationSettings``)."""
    memory_limit: int = DEFAULT_MEMORY_LIMIT
    """Bytes the applying process may use about: bigger ranges are applied by partitions."""
    store_retention: float | None = DEFAULT_STORE_RETENTION_S
    """Seconds an applied range stays in the store; ``None``: forever."""
    follow_table_events: str = "all"
    """``all`` or ``changed``: which target tables a follow materialises per range."""
    follow_retry: float | None = DEFAULT_FOLLOW_RETRY_S
    """Seconds a follow retries a server that went away; ``None``: forever."""
    partitions_kept: int | None = DEFAULT_PARTITIONS_KEPT
    """At most about this many ``lsn_ranges`` partitions stay registered; ``None``: all."""
    decoding_work_mem: int = DEFAULT_DECODING_WORK_MEM
    """Bytes of ``logical_decoding_work_mem`` for the sessions that read the slot."""
    retained_wal_limit: int = 8 * 1024 * 1024 * 1024
    """``slot_health`` fails above this many bytes of WAL retained by the slot."""
    ddl: str = "auto"
    """``auto`` or ``strict``: what an apply does with DDL it cannot follow column by column."""
    auto_add: bool = False
    """A table the publication sends that the target lacks is copied in by the apply."""
    auto_recover: bool = False
    """The slot sensor recovers a lost slot by itself (runs the ``recover`` job)."""
    dropped_columns: str = "drop"
    """``drop`` or ``keep``: a column dropped on the source, on the target."""
    slot_failover: str = "auto"
    """``auto``, ``on`` or ``off``: whether the slot is a failover slot (PostgreSQL 17+)."""
    spark_staging: str = "auto"
    """``auto`` or ``required``: a range the executors cannot read, staged on the driver or
    refused."""


class OutputStoreResource(ConfigurableResource):
    """Where decoded ranges live: a local path, or an object store's URL (``s3://bucket/prefix``,
    which holds no credential: those come from the ``AWS_*`` chain)."""

    path: str


class SparkResource(LazyPySparkResource):
    """dagster-pyspark's lazy session, built by :func:`pgcdc_dagster.engine.spark.session.get_spark`
    so a run starts at most one session, and only when a step needs Spark. ``spark_config``
    (any ``spark.*`` setting; ``PGCDC_SPARK_CONF`` by default) goes to the session's builder,
    so start-up settings (executor memory, ``spark.archives``) take effect."""

    master: str = ""
    remote: str = ""
    store: str = ""
    """The output store's local folder (an object store's work folder), where a warm server of
    ``pgcdc spark start`` is recorded: used when neither ``master`` nor ``remote`` is set."""

    def _init_session(self) -> None:
        if self._spark_session is None:
            from ..engine.spark.server import spark_target
            from ..engine.spark.session import get_spark

            target = spark_target(self.master, self.remote, Path(self.store or ".").resolve())
            conf = {key: str(value) for key, value in self.spark_config.items()}
            self._spark_session = get_spark(**target, conf=conf)


class PgcdcResource(ConfigurableResource):
    """Everything a stage needs to find its servers, slot and store, as one resource."""

    source: PostgresResource
    target: PostgresResource
    replication: ReplicationResource
    store: OutputStoreResource

    def settings(self, spark: SparkResource | None = None) -> ReplicationSettings:
        return ReplicationSettings(
            source_dsn=self.source.dsn,
            target_dsn=self.target.dsn,
            slot=self.replication.slot,
            publication=self.replication.publication,
            tables=self.replication.tables or None,
            store=self.store.path,
            spark_master=spark.master if spark else None,
            spark_remote=spark.remote if spark else None,
            spark_conf={k: str(v) for k, v in spark.spark_config.items()} if spark else {},
            range_max_bytes=self.replication.range_max_bytes,
            snapshot_parquet=self.replication.snapshot_parquet,
            snapshot_driver_rows=self.replication.snapshot_driver_rows,
            snapshot_jobs=self.replication.snapshot_jobs,
            snapshot_range_rows=self.replication.snapshot_range_rows,
            apply_synchronous_commit=self.replication.apply_synchronous_commit,  # type: ignore[arg-type]
            follow_cut_ms=self.replication.follow_cut_ms,
            follow_range_bytes=self.replication.follow_range_bytes,
            follow_read=self.replication.follow_read,  # type: ignore[arg-type]
            follow_idle_s=self.replication.follow_idle_s,
            spark_min_changes=self.replication.spark_min_changes,
            memory_limit=self.replication.memory_limit,
            store_retention=self.replication.store_retention,
            follow_table_events=self.replication.follow_table_events,  # type: ignore[arg-type]
            follow_retry=self.replication.follow_retry,
            partitions_kept=self.replication.partitions_kept,
            decoding_work_mem=self.replication.decoding_work_mem,
            retained_wal_limit=self.replication.retained_wal_limit,
            ddl=self.replication.ddl,  # type: ignore[arg-type]
            auto_add=self.replication.auto_add,
            auto_recover=self.replication.auto_recover,
            dropped_columns=self.replication.dropped_columns,  # type: ignore[arg-type]
            slot_failover=self.replication.slot_failover,  # type: ignore[arg-type]
            spark_staging=self.replication.spark_staging,  # type: ignore[arg-type]
        )


CUTOVER_WAIT_S = 120.0
"""How long a cutover run launched from the UI waits for the range: for a follow to make way,
or for another catch-up to end."""


class RangeLockResource(ConfigurableResource):
    """The slot's range lock (:mod:`pgcdc_dagster.engine.control.range_lock`), held from the moment
    the run's resources are built until they are torn down: the whole run, every step of it, under
    the run's id. A run that finds the lock taken fails at once, naming the holder; a cutover run
    has a running follow make way for it instead (see
    :func:`pgcdc_dagster.engine.control.range_lock.range_lock_or_way`), as ``pgcdc cutover`` does.

    Required by every asset and op that receives, applies or snapshots; the jobs that run them
    execute in one process, so the lock is taken once per run. The run is also tagged with its
    process identity, so a dead worker is recognised at once on this host
    (:mod:`pgcdc_dagster.defs.run_liveness`).
    """

    pgcdc: PgcdcResource
    _lock: Any = PrivateAttr(default=None)

    @contextmanager
    def yield_for_execution(self, context: InitResourceContext) -> Iterator["RangeLockResource"]:
        from ..engine import processes
        from ..engine.control.range_lock import range_lock, range_lock_or_way, take_over
        from .run_liveness import PROCESS_TAG, RANGE_LOCK_TAG, lock_holder_name

        settings = self.pgcdc.settings()
        run = context.run
        holder = lock_holder_name(run.run_id if run is not None else "unknown")
        # A lock the command that started this run lends it is renamed for the run, and
        # range_lock hands that one out instead of taking its own.
        # A follow run adopts its command's follower, which rides a target that went away
        # since (taking the lock again itself), so that run goes on under the gone lock.
        kind = run.tags.get(RANGE_LOCK_TAG) if run is not None else None
        lent = take_over(settings.target_dsn, settings.slot, holder, gone_ok=kind == "follow")
        if lent is None and kind == "cutover":
            # Launched from the UI: a running follow makes way for it, as for pgcdc cutover.
            taking = range_lock_or_way(settings.target_dsn, settings.slot, holder, CUTOVER_WAIT_S)
        else:
            taking = range_lock(settings.target_dsn, settings.slot, holder)
        with taking as lock:
            if context.instance is not None and run is not None:
                context.instance.add_run_tags(run.run_id, {PROCESS_TAG: processes.identity()})
            self._lock = lock
            yield self

    def held(self) -> Any:
        """The :class:`~pgcdc_dagster.engine.control.range_lock.RangeLock` this run holds (a
        follower checks its session is still there after an outage)."""
        return self._lock


def default_resources(settings: ReplicationSettings) -> dict[str, Any]:
    """Resources from validated settings. The DSNs stay ``EnvVar``s: Dagster resolves them at
    run time and shows only the variable's name, never its value."""
    pgcdc = PgcdcResource(
        source=PostgresResource(dsn=EnvVar("PGCDC_SOURCE_DSN")),
        target=PostgresResource(dsn=EnvVar("PGCDC_TARGET_DSN")),
        replication=ReplicationResource(
            slot=settings.slot,
            publication=settings.publication,
            tables=",".join(str(t) for t in settings.tables or ()),
            range_max_bytes=settings.range_max_bytes,
            snapshot_parquet=settings.snapshot_parquet,
            snapshot_driver_rows=settings.snapshot_driver_rows,
            snapshot_jobs=settings.snapshot_jobs,
            snapshot_range_rows=settings.snapshot_range_rows,
            apply_synchronous_commit=settings.apply_synchronous_commit,
            follow_cut_ms=settings.follow_cut_ms,
            follow_range_bytes=settings.follow_range_bytes,
            follow_read=settings.follow_read,
            follow_idle_s=settings.follow_idle_s,
            spark_min_changes=settings.spark_min_changes,
            memory_limit=settings.memory_limit,
            store_retention=settings.store_retention,
            follow_table_events=settings.follow_table_events,
            follow_retry=settings.follow_retry,
            partitions_kept=settings.partitions_kept,
            decoding_work_mem=settings.decoding_work_mem,
            retained_wal_limit=settings.retained_wal_limit,
            ddl=settings.ddl,
            auto_add=settings.auto_add,
            auto_recover=settings.auto_recover,
            dropped_columns=settings.dropped_columns,
            slot_failover=settings.slot_failover,
            spark_staging=settings.spark_staging,
        ),
        store=OutputStoreResource(path=settings.store),
    )
    return {
        "pgcdc": pgcdc,
        "range_lock": RangeLockResource(pgcdc=pgcdc),
        "spark": SparkResource(
            spark_config=dict(settings.spark_conf),
            master=settings.spark_master or "",
            remote=settings.spark_remote or "",
            store=str(settings.store_path),  # an object store's local work folder
        ),
    }
