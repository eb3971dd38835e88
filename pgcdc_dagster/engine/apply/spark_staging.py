"""Executor-side staging of a big range: Spark's workers compact their partitions and COPY the
net rows straight into shared staging tables on the target; only counts come back.

Why: a range past the Spark threshold may hold more net rows than one process should hold;
collecting them to the driver for the staging COPY would funnel the heavy part through it. Here
the driver only creates the tables, starts one Spark job and, afterwards, runs the set-based
merge and the origin advance in one transaction (:mod:`.transaction`). What must hold of the shared
tables and their partitions: :mod:`.shared_staging`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from ..compaction import TableRelation, compact_table
from ..compaction.object_reader import probe_paths
from ..compaction.spark import route_changes, unjoin_toast
from ..connect import connect
from ..failpoints import failpoint
from ..identifiers import TableName
from ..spark.executors import check_executors, task_log
from .shared_staging import (
    SUMMARY_SCHEMA,
    Names,
    SharedStage,
    create_shared_tables,
    stage_partition,
    summarise,
    summary_rows,
)

if TYPE_CHECKING:
    import psycopg
    from pyspark.sql import SparkSession


def stage_on_spark(
    spark: SparkSession,
    conn: psycopg.Connection[Any],
    target_dsn: str,
    origin_name: str,
    files: Sequence[str],
    relations: Mapping[TableName, TableRelation],
    *,
    after_lsn: int | None = None,
    floors: Mapping[TableName, int] | None = None,
    partitions: int | None = None,
) -> dict[TableName, SharedStage]:
    """Compact ``files`` (one range) on Spark, every group's net rows COPYed by the worker that
    computed them into the shared staging tables of ``origin_name``; the tables' counts back.

    ``conn`` is the driver's autocommit connection to the target, used for the DDL only.
    """
    check_executors(spark, {"target": target_dsn}, probe_paths(files[:1]))  # before any DDL
    tables = list(relations)
    names = create_shared_tables(conn, origin_name, relations)
    routed = route_changes(
        spark, files, relations, after_lsn=after_lsn, floors=floors, partitions=partitions
    )
    kernel = _staging_kernel(tables, relations, names, target_dsn)
    from pyspark.sql.pandas.types import from_arrow_schema

    summary = (
        routed.groupBy("_tbl", "_pid")
        .applyInArrow(kernel, from_arrow_schema(SUMMARY_SCHEMA))
        .toArrow()
    )
    return summarise(summary, tables, relations, names)


def _staging_kernel(
    tables: Sequence[TableName],
    relations: Mapping[TableName, TableRelation],
    names: Mapping[TableName, Names],
    target_dsn: str,
) -> Callable[[pa.Table], pa.Table]:
    """applyInArrow body, run by a Spark worker: the kernel on one (table, partition) group,
    its net rows COPYed to the target by :func:`~.shared_staging.stage_partition`."""

    def kernel(group: pa.Table) -> pa.Table:
        if group.num_rows == 0:
            return summary_rows([])
        t = int(group.column("_tbl")[0].as_py())
        pid = int(group.column("_pid")[0].as_py())
        net = compact_table(unjoin_toast(group), relations[tables[t]])
        with connect(target_dsn, role="target") as conn:
            summary = stage_partition(conn, net, names[tables[t]], t, pid)
        failpoint("apply.staging")
        task_log(
            f"staged {net.net.num_rows:,} net rows of {net.changes:,} changes of "
            f"{net.relation.table} (partition {pid})"
        )
        return summary_rows([summary])

    return kernel


__all__ = ["SharedStage", "stage_on_spark"]
