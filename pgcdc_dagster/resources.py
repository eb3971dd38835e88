"""Resources: connection strings through ``EnvVar`` (never stored in run config), settings."""

from typing import Any

from dagster import ConfigurableResource, EnvVar
from dagster_pyspark import LazyPySparkResource

from .config import (
    DEFAULT_PUBLICATION,
    DEFAULT_RANGE_MAX_BYTES,
    DEFAULT_SLOT,
    DEFAULT_STORE,
    ENV_PUBLICATION,
    ENV_RANGE_MAX_BYTES,
    ENV_SLOT,
    ENV_SNAPSHOT_PARQUET,
    ENV_SOURCE_DSN,
    ENV_SPARK_MASTER,
    ENV_SPARK_REMOTE,
    ENV_STORE,
    ENV_TABLES,
    ENV_TARGET_DSN,
    ReplicationSettings,
    env_flag,
    parse_tables,
)


class PostgresResource(ConfigurableResource):
    """A PostgreSQL server by libpq conninfo; the value comes from an environment variable."""

    dsn: str


class ReplicationResource(ConfigurableResource):
    """Slot, publication, table selection and range size."""

    slot: str = DEFAULT_SLOT
    publication: str = DEFAULT_PUBLICATION
    tables: str = ""
    """Comma list of ``schema.table``; empty means every user table."""
    range_max_bytes: int = DEFAULT_RANGE_MAX_BYTES
    snapshot_parquet: bool = False
    """Also write the base snapshot as Parquet under the store's ``snapshot/``."""


class OutputStoreResource(ConfigurableResource):
    """Where decoded ranges live (a local path; ``s3a://``/``hdfs://`` go to Spark as is)."""

    path: str = DEFAULT_STORE


class SparkResource(LazyPySparkResource):
    """dagster-pyspark's lazy session, built by :func:`pgcdc_dagster.spark_session.get_spark`
    so a run starts at most one session, and only when a step needs Spark."""

    master: str = ""
    remote: str = ""

    def _init_session(self) -> None:
        if self._spark_session is None:
            from .spark_session import get_spark

            session = get_spark(master=self.master or None, remote=self.remote or None)
            for key, value in self.spark_config.items():
                session.conf.set(key, value)
            self._spark_session = session


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
            tables=parse_tables(self.replication.tables),
            store=self.store.path,
            spark_master=(spark.master or None) if spark else None,
            spark_remote=(spark.remote or None) if spark else None,
            range_max_bytes=self.replication.range_max_bytes,
            snapshot_parquet=self.replication.snapshot_parquet,
        )


def default_resources(env: dict[str, str]) -> dict[str, Any]:
    """Resources from the environment. The DSNs stay ``EnvVar``s: Dagster resolves them at run
    time and shows only the variable's name, never its value."""
    return {
        "pgcdc": PgcdcResource(
            source=PostgresResource(dsn=EnvVar(ENV_SOURCE_DSN)),
            target=PostgresResource(dsn=EnvVar(ENV_TARGET_DSN)),
            replication=ReplicationResource(
                slot=env.get(ENV_SLOT) or DEFAULT_SLOT,
                publication=env.get(ENV_PUBLICATION) or DEFAULT_PUBLICATION,
                tables=env.get(ENV_TABLES) or "",
                range_max_bytes=int(env.get(ENV_RANGE_MAX_BYTES) or DEFAULT_RANGE_MAX_BYTES),
                snapshot_parquet=env_flag(env, ENV_SNAPSHOT_PARQUET),
            ),
            store=OutputStoreResource(path=env.get(ENV_STORE) or DEFAULT_STORE),
        ),
        "spark": SparkResource(
            spark_config={},
            master=env.get(ENV_SPARK_MASTER) or "",
            remote=env.get(ENV_SPARK_REMOTE) or "",
        ),
    }
