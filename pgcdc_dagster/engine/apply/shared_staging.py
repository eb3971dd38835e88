"""Shared staging tables filled partition by partition: by Spark's workers
(:mod:`.spark_staging`) or by this process (:mod:`.partitioned_staging`).

A big range's changes are routed by key hash into partitions per table (the same routing on
both paths, :mod:`..compaction.partitions` and :func:`~..compaction.spark.route_changes`); each
(table, partition) is compacted alone by :func:`~..compaction.compact_table` and its net rows
COPYed into the table's shared staging tables (:mod:`.staging`), tagged with the partition;
only counts and flags come back (:data:`SUMMARY_SCHEMA`), summed per table by
:func:`summarise` into the :class:`SharedStage` the merge of :mod:`.transaction` reads.

What must hold
* A re-run starts clean: before staging, every shared staging table of the origin is dropped
  and made anew (the range lock makes this the only apply of the origin), so rows a killed
  run left never meet the new ones.
* A retried partition replaces its own rows: :func:`stage_partition` deletes the rows of its
  (table, partition) and COPYs its own in one transaction of its own.
* The staged rows are exactly what :func:`~..compaction.compact_arrow` would give: every
  change of a key lands in one partition (moves and truncates are routed so that each
  partition's kernel sees what it needs, see :func:`~..compaction.spark.route_changes`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

from ..compaction import NetChanges, TableRelation
from ..identifiers import TableName
from .staging import (
    PARTITION_COLUMN,
    SCHEMA,
    copy_into,
    copy_rows,
    create_stage,
    drop_shared,
    flag,
    shared_name,
    typed_as,
)

SUMMARY_SCHEMA = pa.schema(
    [
        ("tbl", pa.int32()),
        ("pid", pa.int32()),
        ("changes", pa.int64()),
        ("truncates", pa.int64()),
        ("truncate_flags", pa.int32()),
        ("net_rows", pa.int64()),
        ("deletes", pa.int64()),
        ("upserts", pa.int64()),
        ("new_rows", pa.int64()),
        ("direct", pa.int64()),
        ("all_inserts", pa.bool_()),
        ("has_origin", pa.bool_()),
        ("keep", pa.list_(pa.bool_())),
        ("old_missing", pa.list_(pa.bool_())),
    ]
)
"""What one task sends back: counts and flags, never rows (Spark's schema is derived from it)."""


@dataclass
class SharedStage:
    """One table's shared staging tables, filled, and what the merge needs to know of them."""

    relation: TableRelation
    changes: int = 0
    truncates: int = 0
    truncate_flags: int = 0
    net_rows: int = 0
    deletes: sql.Identifier | None = None
    upserts: sql.Identifier | None = None
    ordered: sql.Identifier | None = None
    upsert_rows: int = 0
    new_rows: int = 0
    """Upserted rows of new keys (their ``n`` flag staged): see :func:`~.merge.insert_new`."""
    direct: int = 0
    """Rows of new keys COPYed straight into the target (:func:`stage_partition`): inserted."""
    delete_rows: int = 0
    all_inserts: bool = True
    has_origin: bool = False
    keep: list[int] = field(default_factory=list)
    old_missing: list[int] = field(default_factory=list)
    tasks: int = 0
    """The partitions of the table's changes that staged it (Spark tasks, or this process's)."""

    @property
    def ordered_table(self) -> bool:
        return not self.relation.collapsible

    def net_changes(self) -> NetChanges:
        """The counts as a :class:`NetChanges` without rows (they are on the target)."""
        return NetChanges(
            self.relation,
            self.changes,
            self.truncates,
            self.truncates > 0,
            self.truncate_flags,
            pa.table({}),
            self.ordered_table,
        )


Names = dict[str, sql.Identifier]
"""Staging table by kind: ``del``, ``up`` (a table with identity) or ``ord`` (without)."""


def _create_tables(
    conn: psycopg.Connection[Any],
    index: int,
    rel: TableRelation,
    name: Callable[[int, str], sql.Identifier],
    shared: bool,
) -> Names:
    width = len(rel.names)
    every = range(width)
    if not rel.collapsible:
        ordered = name(index, "ord")
        create_stage(
            conn,
            ordered,
            rel.table,
            [sql.SQL("0::int8 AS ord"), sql.SQL("''::text AS op")]
            + [typed_as(rel, j, f"o{j}") for j in every]
            + [flag(f"m{j}") for j in every]
            + [typed_as(rel, j, f"c{j}") for j in every]
            + [flag(f"u{j}") for j in every],
            shared=shared,
        )
        return {"ord": ordered}
    ident = rel.identity_positions
    deletes = name(index, "del")
    create_stage(
        conn,
        deletes,
        rel.table,
        [typed_as(rel, p, f"k{j}") for j, p in enumerate(ident)],
        shared=shared,
    )
    upserts = name(index, "up")
    create_stage(
        conn,
        upserts,
        rel.table,
        [typed_as(rel, j, f"c{j}") for j in every]
        + [flag(f"u{j}") for j in every]
        + [typed_as(rel, p, f"f{j}") for j, p in enumerate(ident)]
        + [flag("n")],
        shared=shared,
    )
    return {"del": deletes, "up": upserts}


def create_shared_tables(
    conn: psycopg.Connection[Any],
    origin_name: str,
    relations: Mapping[TableName, TableRelation],
) -> dict[TableName, Names]:
    """Drop what an earlier apply of ``origin_name`` left, and create every table's shared
    staging tables anew (``conn``: an autocommit connection to the target)."""
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(SCHEMA)))
    drop_shared(conn, origin_name)
    return {
        t: _create_tables(conn, i, relations[t], partial(shared_name, origin_name), True)
        for i, t in enumerate(relations)
    }


def create_temporary_tables(
    conn: psycopg.Connection[Any], relations: Mapping[TableName, TableRelation]
) -> dict[TableName, Names]:
    """The same tables, temporary (dropped at COMMIT), in the apply's transaction: for this
    process's partitions (:mod:`.partitioned_staging`), which stage inside it."""

    def name(index: int, kind: str) -> sql.Identifier:
        return sql.Identifier(f"pgcdc_part_{kind}_{index}")

    return {t: _create_tables(conn, i, relations[t], name, False) for i, t in enumerate(relations)}


def stage_partition(
    conn: psycopg.Connection[Any],
    net: NetChanges,
    names: Names,
    table_index: int,
    pid: int,
    *,
    shared: bool = True,
) -> dict[str, Any]:
    """COPY one (table, partition)'s net rows into the table's staging tables; its
    :data:`SUMMARY_SCHEMA` row back.

    ``shared``: in a transaction of its own, which first removes what an earlier attempt of the
    same partition staged (a Spark task). Otherwise inside the caller's transaction (the
    apply's: the tables are temporary), where rows of new keys (``n``) go straight into the
    target table instead: a COPY into it does what a staging COPY and the merge's INSERT did,
    at about half the target's work. The range's TRUNCATE must have run before. A target that
    has such a key after all (written by hand) refuses the COPY, rolled back to its savepoint:
    those rows are then staged for the upsert, as any other (``direct`` counts those that went
    straight in)."""
    rel = net.relation
    width = len(rel.names)
    rows = net.net
    direct = 0
    with conn.transaction():
        if shared:
            for name in names.values():
                conn.execute(
                    sql.SQL("DELETE FROM {} WHERE {} = %s").format(
                        name, sql.Identifier(PARTITION_COLUMN)
                    ),
                    (pid,),
                )
        if not rel.collapsible:
            columns = ["ord", "op", *_names("o", width), *_names("m", width)]
            columns += [*_names("c", width), *_names("u", width)]
            copy_rows(conn, names["ord"], _tagged(rows, columns, pid, shared), rel.table)
            upserts = rows
            deletes = rows.slice(0, 0)
        else:
            is_delete = pc.equal(rows.column("op"), "D")
            deletes = rows.filter(is_delete)
            upserts = rows.filter(pc.invert(is_delete))
            if not shared:
                upserts, direct = _insert_new(conn, upserts, rel)
            k = len(rel.identity)
            copy_rows(conn, names["del"], _tagged(deletes, _names("k", k), pid, shared), rel.table)
            columns = [*_names("c", width), *_names("u", width), *_names("f", k), "n"]
            copy_rows(conn, names["up"], _tagged(upserts, columns, pid, shared), rel.table)
    ops = rows.column("op")
    return {
        "tbl": table_index,
        "pid": pid,
        "changes": net.changes,
        "truncates": net.truncates,
        "truncate_flags": net.truncate_flags,
        "net_rows": rows.num_rows,
        "deletes": deletes.num_rows,
        "upserts": upserts.num_rows,
        "new_rows": int(pc.sum(upserts.column("n")).as_py() or 0) if rel.collapsible else 0,
        "direct": direct,
        "all_inserts": bool(pc.all(pc.equal(ops, "I")).as_py()),
        "has_origin": rel.collapsible
        and bool(rel.identity)
        and upserts.column("f0").null_count < upserts.num_rows,
        "keep": [_any(upserts, f"u{j}") for j in range(width)],
        "old_missing": [(not rel.collapsible) and _any(rows, f"m{j}") for j in range(width)],
    }


def _insert_new(
    conn: psycopg.Connection[Any], upserts: pa.Table, rel: TableRelation
) -> tuple[pa.Table, int]:
    """COPY the rows of new keys straight into the target table (in a savepoint); the rows left
    to stage, and how many went in."""
    new = upserts.column("n")
    count = int(pc.sum(new).as_py() or 0)
    if not count:
        return upserts, 0
    rows = upserts.filter(new).select(_names("c", len(rel.names))).rename_columns(list(rel.names))
    try:
        with conn.transaction():
            copy_into(conn, rel.table.sql, rows)
    except (psycopg.errors.UniqueViolation, psycopg.errors.ExclusionViolation):
        # Staged with the others, their flag cleared: the upsert decides for each (and a key
        # the target's own constraints refuse there is applied in commit order, see apply).
        at = upserts.schema.get_field_index("n")
        return upserts.set_column(at, "n", pa.array([False] * upserts.num_rows)), 0
    return upserts.filter(pc.invert(new)), count


def _names(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{j}" for j in range(count)]


def _tagged(rows: pa.Table, columns: list[str], pid: int, shared: bool) -> pa.Table:
    """``rows``' ``columns``, with the partition column when the tables are shared."""
    rows = rows.select(columns)
    if not shared:
        return rows
    return rows.append_column(PARTITION_COLUMN, pa.array([pid] * rows.num_rows, pa.int32()))


def _any(rows: pa.Table, column: str) -> bool:
    return rows.num_rows > 0 and bool(pc.any(rows.column(column)).as_py())


def summary_rows(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=SUMMARY_SCHEMA)


def summarise(
    summary: pa.Table,
    tables: Sequence[TableName],
    relations: Mapping[TableName, TableRelation],
    names: Mapping[TableName, Names],
) -> dict[TableName, SharedStage]:
    """The tasks' rows per table. Every partition of a table saw all of its TRUNCATEs (they
    are copied into each), so those count once; every other change once in total."""
    out: dict[TableName, SharedStage] = {}
    for row in summary.to_pylist():
        table = tables[row["tbl"]]
        stage = out.get(table)
        if stage is None:
            stage = out[table] = SharedStage(relations[table])
        stage.tasks += 1
        stage.changes += row["changes"] - row["truncates"]
        if row["truncates"] >= stage.truncates and row["truncates"]:
            stage.truncates = row["truncates"]
            stage.truncate_flags = row["truncate_flags"]
        stage.net_rows += row["net_rows"]
        stage.delete_rows += row["deletes"]
        stage.upsert_rows += row["upserts"]
        stage.new_rows += row["new_rows"]
        stage.direct += row["direct"]
        stage.all_inserts = stage.all_inserts and row["all_inserts"]
        stage.has_origin = stage.has_origin or row["has_origin"]
        stage.keep = _union(stage.keep, row["keep"])
        stage.old_missing = _union(stage.old_missing, row["old_missing"])
    for table, stage in out.items():
        stage.changes += stage.truncates
        staged = names[table]
        if stage.ordered_table:
            stage.ordered = staged["ord"] if stage.net_rows else None
        else:
            stage.deletes = staged["del"] if stage.delete_rows else None
            stage.upserts = staged["up"] if stage.upsert_rows else None
    return out


def _union(positions: list[int], flags: list[bool]) -> list[int]:
    return sorted(set(positions) | {j for j, on in enumerate(flags) if on})
