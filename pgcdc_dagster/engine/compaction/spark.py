"""A range's changes routed to key-hash partitions by Spark, for its workers to compact one
group each with the same :func:`~.kernel.compact_table` (the executors' staging,
:mod:`~pgcdc_dagster.engine.apply.spark_staging`); only the grouping and the crossing between
the JVM and Python are Spark's.

How the partitions keep the kernel's answer unchanged:

* every change of an identity value lands in the partition of its hash, so the kernel sees
  a key's whole history;
* moves tie keys together (a moved row's values may live at the key it came from), so every
  change touching a key that any move touched goes to one extra partition, chains and all;
* TRUNCATE rows are copied into every partition of their table, so each partition drops
  what came before the same last truncate;
* a table without identity goes whole into one partition, in commit order.

Routing is Spark SQL on the JVM; rows cross into Python once, into the kernel, with
``unchanged_toast`` sent as one joined string (a column of mostly NULL lists is the slowest
thing to cross), which :func:`unjoin_toast` turns back into the kernel's list.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc

from ..identifiers import TableName
from .kernel import TableRelation
from .object_reader import is_object_url, object_frame

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


def route_changes(
    spark: SparkSession,
    source: str | Sequence[str] | DataFrame,
    relations: Mapping[TableName, TableRelation],
    *,
    after_lsn: int | None = None,
    floors: Mapping[TableName, int] | None = None,
    partitions: int | None = None,
) -> DataFrame:
    """The range's changes with ``_tbl`` (index in ``relations``) and ``_pid`` (partition), as
    the module docstring describes; grouping by both gives the kernel's groups. Rows
    at or before ``after_lsn``, and a table's at or before its ``floors`` entry, are left
    out (see :func:`~pgcdc_dagster.engine.compaction.compact_range`)."""
    from pyspark.sql import functions as F

    parts = partitions or max(1, int(spark.conf.get("spark.sql.shuffle.partitions") or "4"))
    if isinstance(source, str):
        source = [source]
    if not isinstance(source, Sequence):
        df = source
    elif source and all(is_object_url(path) for path in source):
        df = object_frame(spark, source)  # an object store's range: read by pyarrow
    else:
        df = spark.read.parquet(*source)
    if after_lsn is not None:
        df = df.filter(F.col("commit_end_lsn") > F.lit(int(after_lsn)))
    tables = list(relations)
    table_of_version = {v: t for t, name in enumerate(tables) for v in relations[name].versions}
    df = df.filter(F.col("relation_version").isin(list(table_of_version)))
    for table, floor in (floors or {}).items():
        if table in relations and (after_lsn is None or floor > after_lsn):
            of_table = F.col("relation_version").isin(list(relations[table].versions))
            df = df.filter(~of_table | (F.col("commit_end_lsn") > F.lit(int(floor))))

    def by_version(values: Callable[[TableRelation, int], Any]) -> Any:
        expr = None
        for version, t in table_of_version.items():
            value = values(relations[tables[t]], version)
            cond = F.col("relation_version") == F.lit(version)
            expr = F.when(cond, value) if expr is None else expr.when(cond, value)
        return expr

    def old_key(rel: TableRelation, version: int) -> Any:
        if not rel.collapsible:
            return F.lit("")
        flagged = rel.versions[version][1]
        return F.to_json(
            F.array(*[F.try_element_at("key", F.lit(flagged.index(c) + 1)) for c in rel.identity])
        )

    def new_key(rel: TableRelation, version: int) -> Any:
        if not rel.collapsible:
            return F.lit(None).cast("string")
        names = rel.versions[version][0]
        return F.to_json(
            F.array(*[F.try_element_at("new_row", F.lit(names.index(c) + 1)) for c in rel.identity])
        )

    def key_unsent(rel: TableRelation, version: int) -> Any:
        unsent = F.lit(False)
        for c in rel.identity:
            unsent |= F.coalesce(F.array_contains("unchanged_toast", F.lit(c)), F.lit(False))
        return unsent

    routed = (
        df.select(
            by_version(lambda rel, v: F.lit(table_of_version[v])).cast("int").alias("_tbl"),
            "commit_end_lsn",
            "seq",
            "action",
            "relation_version",
            "key",
            "new_row",
            F.array_join("unchanged_toast", "\x00").alias("unchanged_toast"),
            "flags",
            by_version(old_key).alias("_okey"),
            by_version(new_key).alias("_nkey"),
            by_version(key_unsent).alias("_key_unsent"),
        )
        .withColumn("_tbl", by_version(lambda rel, v: F.lit(table_of_version[v])).cast("int"))
        .withColumn(
            "_moved",
            (F.col("action") == "U")
            & ~F.col("_key_unsent")
            & F.coalesce(F.col("_okey") != F.col("_nkey"), F.lit(False)),
        )
    )
    moved_keys = (
        routed.filter("_moved")
        .select("_tbl", F.explode(F.array("_okey", "_nkey")).alias("_k"))
        .distinct()
        .withColumn("_m", F.lit(True))
    )
    for side in ("_okey", "_nkey"):
        hit = moved_keys.select(
            F.col("_tbl").alias("_mt"), F.col("_k").alias("_mk"), F.col("_m").alias(f"{side}_m")
        )
        routed = routed.join(
            F.broadcast(hit),
            (routed["_tbl"] == hit["_mt"]) & (routed[side] == hit["_mk"]),
            "left",
        ).drop("_mt", "_mk")
    member = F.coalesce(F.col("_okey_m"), F.col("_nkey_m"), F.lit(False))
    pid = (
        F.when(member, F.lit(parts))
        .otherwise(F.pmod(F.xxhash64(F.col("_okey")), F.lit(parts)))
        .cast("int")
    )
    routed = routed.withColumn(
        "_pid",
        F.explode(
            F.when(F.col("action") == "T", F.sequence(F.lit(0), F.lit(parts))).otherwise(
                F.array(pid)
            )
        ),
    ).select(
        "_tbl",
        "_pid",
        "commit_end_lsn",
        "seq",
        "action",
        "relation_version",
        "key",
        "new_row",
        "unchanged_toast",
        "flags",
    )
    return routed


def unjoin_toast(group: pa.Table) -> pa.Table:
    """A routed group's ``unchanged_toast`` back to the list the kernel reads."""
    toast = pc.split_pattern(group.column("unchanged_toast"), "\x00")
    return group.set_column(
        group.schema.get_field_index("unchanged_toast"), "unchanged_toast", toast
    )
