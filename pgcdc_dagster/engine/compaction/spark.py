"""The compaction kernel distributed on Spark: one ``applyInArrow`` group per key-hash partition.

The same :func:`~.kernel.compact_table` runs in the workers; only the grouping and the crossing
between the JVM and Python are Spark's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..identifiers import TableName
from .kernel import COUNT_MARKER, OP_TRUNCATE, NetChanges, TableRelation, compact_table

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession


SPARK_NET_SCHEMA = (
    "schema_name string, table_name string, op string, ord long, flags byte, "
    "key array<string>, row array<string>, keep array<boolean>, origin array<string>, "
    "old_missing array<boolean>"
)
"""The kernel's output on Spark: one schema for every table, so values travel as lists."""


def compact_with_spark(
    spark: SparkSession,
    source: str | Sequence[str] | DataFrame,
    relations: Mapping[TableName, TableRelation],
    *,
    after_lsn: int | None = None,
    floors: Mapping[TableName, int] | None = None,
    partitions: int | None = None,
) -> dict[TableName, NetChanges]:
    """:func:`compact_table` run by Spark, per table and key-hash partition.

    ``source`` is Parquet path(s) of a range (CHANGE_SCHEMA) or a DataFrame of such rows.
    How the partitions keep the kernel's answer unchanged:

    * every change of an identity value lands in the partition of its hash, so the kernel sees
      a key's whole history;
    * moves tie keys together (a moved row's values may live at the key it came from), so every
      change touching a key that any move touched goes to one extra partition, chains and all;
    * TRUNCATE rows are copied into every partition of their table, so each partition drops
      what came before the same last truncate;
    * a table without identity goes whole into one partition, in commit order.

    Routing is Spark SQL on the JVM; rows cross into Python once, into the kernel (each
    crossing of 300k rows costs seconds on 2 cores, so there is no Python routing pass), with
    ``unchanged_toast`` sent as one joined string (a column of mostly NULL lists is the slowest
    thing to cross).
    """
    tables = list(relations)
    routed = route_changes(
        spark, source, relations, after_lsn=after_lsn, floors=floors, partitions=partitions
    )
    net = routed.groupBy("_tbl", "_pid").applyInArrow(
        _spark_kernel(tables, relations), SPARK_NET_SCHEMA
    )
    return _from_spark(net.toArrow(), relations)


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
    :func:`compact_with_spark` describes; grouping by both gives the kernel's groups. Rows
    at or before ``after_lsn``, and a table's at or before its ``floors`` entry, are left
    out (see :func:`~pgcdc_dagster.engine.compaction.compact_range`)."""
    from pyspark.sql import functions as F

    parts = partitions or max(1, int(spark.conf.get("spark.sql.shuffle.partitions") or "4"))
    if isinstance(source, str):
        source = [source]
    df = source if not isinstance(source, Sequence) else spark.read.parquet(*source)
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


def _spark_kernel(
    tables: Sequence[TableName], relations: Mapping[TableName, TableRelation]
) -> Callable[[pa.Table], pa.Table]:
    """applyInArrow body: :func:`compact_table` on one (table, partition) group, its wide
    output turned into the list form of :data:`SPARK_NET_SCHEMA`."""

    def kernel(group: pa.Table) -> pa.Table:
        if group.num_rows == 0:
            return _empty_spark_net()
        name = tables[int(group.column("_tbl")[0].as_py())]
        result = compact_table(unjoin_toast(group), relations[name])
        return _to_spark(result, name)

    return kernel


def unjoin_toast(group: pa.Table) -> pa.Table:
    """A routed group's ``unchanged_toast`` back to the list the kernel reads."""
    toast = pc.split_pattern(group.column("unchanged_toast"), "\x00")
    return group.set_column(
        group.schema.get_field_index("unchanged_toast"), "unchanged_toast", toast
    )


def _to_spark(result: NetChanges, name: TableName) -> pa.Table:
    width = len(result.relation.columns)
    net = result.net
    n = net.num_rows
    if result.ordered:
        key = _as_lists([net.column(f"o{j}") for j in range(width)], pa.string(), n)
        missing = _as_lists([net.column(f"m{j}") for j in range(width)], pa.bool_(), n)
        origin = pa.nulls(n, pa.list_(pa.string()))
        ords = net.column("ord")
    else:
        k = len(result.relation.identity)
        key = _as_lists([net.column(f"k{j}") for j in range(k)], pa.string(), n)
        origin_parts = [net.column(f"f{j}") for j in range(k)]
        origin = _as_lists(origin_parts, pa.string(), n)
        origin = pc.if_else(pc.is_valid(origin_parts[0]), origin, pa.nulls(n, origin.type))
        missing = pa.nulls(n, pa.list_(pa.bool_()))
        ords = pa.nulls(n, pa.int64())
    body = pa.table(
        {
            "schema_name": pa.array([name.schema] * n, pa.string()),
            "table_name": pa.array([name.name] * n, pa.string()),
            "op": net.column("op"),
            "ord": ords,
            "flags": pc.cast(net.column("n"), pa.int8())
            if "n" in net.column_names
            else pa.nulls(n, pa.int8()),
            "key": key,
            "row": _as_lists([net.column(f"c{j}") for j in range(width)], pa.string(), n),
            "keep": _as_lists([net.column(f"u{j}") for j in range(width)], pa.bool_(), n),
            "origin": origin,
            "old_missing": missing,
        }
    )
    # Counts travel as markers: changes other than truncates (summed over partitions), and the
    # truncates, which every partition of the table saw (counted once).
    markers = [(COUNT_MARKER, result.changes - result.truncates, 0)]
    if result.truncate:
        markers.append((OP_TRUNCATE, result.truncates, result.truncate_flags))
    marker_table = pa.table(
        {
            "schema_name": pa.array([name.schema] * len(markers), pa.string()),
            "table_name": pa.array([name.name] * len(markers), pa.string()),
            "op": pa.array([m[0] for m in markers], pa.string()),
            "ord": pa.array([m[1] for m in markers], pa.int64()),
            "flags": pa.array([m[2] for m in markers], pa.int8()),
            "key": pa.nulls(len(markers), pa.list_(pa.string())),
            "row": pa.nulls(len(markers), pa.list_(pa.string())),
            "keep": pa.nulls(len(markers), pa.list_(pa.bool_())),
            "origin": pa.nulls(len(markers), pa.list_(pa.string())),
            "old_missing": pa.nulls(len(markers), pa.list_(pa.bool_())),
        }
    )
    return pa.concat_tables([body.cast(marker_table.schema), marker_table])


def _empty_spark_net() -> pa.Table:
    return pa.table(
        {
            "schema_name": pa.array([], pa.string()),
            "table_name": pa.array([], pa.string()),
            "op": pa.array([], pa.string()),
            "ord": pa.array([], pa.int64()),
            "flags": pa.array([], pa.int8()),
            "key": pa.array([], pa.list_(pa.string())),
            "row": pa.array([], pa.list_(pa.string())),
            "keep": pa.array([], pa.list_(pa.bool_())),
            "origin": pa.array([], pa.list_(pa.string())),
            "old_missing": pa.array([], pa.list_(pa.bool_())),
        }
    )


def _as_lists(
    columns: Sequence[pa.Array | pa.ChunkedArray], type_: pa.DataType, n: int
) -> pa.Array:
    """Row-major lists from columns: the inverse of ``list_element`` per position."""
    width = len(columns)
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * width, pa.int32())
    if width == 0 or n == 0:
        return pa.ListArray.from_arrays(offsets, pa.array([], type_))
    flat = pa.concat_arrays([_array(c).cast(type_) for c in columns])
    order = (np.arange(width)[None, :] * n + np.arange(n)[:, None]).ravel()
    return pa.ListArray.from_arrays(offsets, flat.take(pa.array(order, pa.int64())))


def _array(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(column, pa.ChunkedArray):
        return column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return column


def _from_spark(
    net: pa.Table, relations: Mapping[TableName, TableRelation]
) -> dict[TableName, NetChanges]:
    """The driver's half: list rows back to one wide :class:`NetChanges` per table."""
    out: dict[TableName, NetChanges] = {}
    if net.num_rows == 0:
        return out
    names = pc.binary_join_element_wise(net.column("schema_name"), net.column("table_name"), "\x00")
    for combined in pc.unique(names).to_pylist():
        schema, table = combined.split("\x00", 1)
        name = TableName(schema, table)
        relation = relations[name]
        rows = net.filter(pc.equal(names, combined))
        ops = rows.column("op")
        counts = rows.filter(pc.equal(ops, COUNT_MARKER))
        truncates = rows.filter(pc.equal(ops, OP_TRUNCATE))
        body = rows.filter(pc.and_(pc.not_equal(ops, COUNT_MARKER), pc.not_equal(ops, OP_TRUNCATE)))
        truncate = truncates.num_rows > 0
        flags = int(truncates.column("flags")[0].as_py()) if truncate else 0
        truncate_count = int(pc.max(truncates.column("ord")).as_py()) if truncate else 0
        changes = int(pc.sum(counts.column("ord")).as_py() or 0) + truncate_count
        width = len(relation.columns)
        if not relation.collapsible:
            body = body.sort_by("ord")
            columns: dict[str, pa.Array] = {
                "ord": _array(body.column("ord")),
                "op": _array(body.column("op")),
            }
            key, missing = _array(body.column("key")), _array(body.column("old_missing"))
            for j in range(width):
                columns[f"o{j}"] = pc.list_element(key, j)
            for j in range(width):
                columns[f"m{j}"] = pc.list_element(missing, j)
        else:
            columns = {"op": _array(body.column("op"))}
            key = _array(body.column("key"))
            for j in range(len(relation.identity)):
                columns[f"k{j}"] = pc.list_element(key, j)
        row, keep = _array(body.column("row")), _array(body.column("keep"))
        for j in range(width):
            columns[f"c{j}"] = pc.list_element(row, j)
        for j in range(width):
            columns[f"u{j}"] = pc.list_element(keep, j)
        if relation.collapsible:
            origin = _array(body.column("origin"))
            for j in range(len(relation.identity)):
                columns[f"f{j}"] = pc.list_element(origin, j)
            # A new key's flag (the kernel's ``n``) travels in ``flags``, unused by body rows.
            columns["n"] = pc.fill_null(pc.equal(_array(body.column("flags")), 1), False)
        if not body.num_rows:
            columns = {k: v.cast(_wide_type(k)) for k, v in columns.items()}
        out[name] = NetChanges(
            relation,
            changes,
            truncate_count,
            truncate,
            flags,
            pa.table(columns),
            not relation.collapsible,
        )
    return out


def _wide_type(name: str) -> pa.DataType:
    if name.startswith(("u", "m")) or name == "n":
        return pa.bool_()
    if name == "ord":
        return pa.int64()
    return pa.string()
