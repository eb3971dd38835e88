"""Compaction: the net effect of one range per table (:mod:`.kernel`), in this process or on
Spark (:mod:`.spark`) by the range's size.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..identifiers import TableName
from ..store import StoredRange
from .kernel import (
    KERNEL_COLUMNS,
    CompactionError,
    NetChanges,
    RelationColumn,
    TableRelation,
    compact_table,
    encode_keys,
    relations_of,
)
from .spark import compact_with_spark

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


DEFAULT_SPARK_MIN_CHANGES = 2_000_000
"""Ranges with fewer changes are compacted in this process even when a SparkSession is given.

Measured on 2 shared cores, pgbench backlog of 320k changes (157k net rows): the Arrow kernel
takes 0.14-0.23 s (0.3-0.5 s with the Parquet read); Spark local[2] takes 6 s warm (each
crossing of 300k rows between the JVM and Python costs seconds), and the net rows come back to
the driver for the COPY anyway. So on one machine Spark never wins; it is there for ranges
whose changes would not fit the driver (about 155 bytes per change in Arrow, several times that
while compacting: 2 M changes is about 0.3 GB in, 1.5 s) and for clusters with many cores."""


@dataclass
class CompactionResult:
    tables: dict[TableName, NetChanges]
    path: str
    """``arrow`` (in this process) or ``spark``."""
    changes: int
    seconds: float

    @property
    def net_rows(self) -> int:
        return sum(t.net.num_rows for t in self.tables.values())


# -- the kernel ---------------------------------------------------------------------------------


def compact_range(
    stored: StoredRange,
    relations: Mapping[TableName, TableRelation],
    *,
    after_lsn: int | None = None,
    spark: SparkSession | None = None,
    spark_min_changes: int = DEFAULT_SPARK_MIN_CHANGES,
    partitions: int | None = None,
) -> CompactionResult:
    """Every table's net changes of a stored range, skipping transactions whose COMMIT ends at
    or before ``after_lsn`` (already applied).

    Runs on Spark when a session is given and the range holds at least ``spark_min_changes``
    changes; in this process otherwise. Both give the same net rows.
    """
    started = time.perf_counter()
    changes = stored.changes
    if spark is not None and changes >= spark_min_changes:
        tables = compact_with_spark(
            spark,
            [str(f) for f in stored.files],
            relations,
            after_lsn=after_lsn,
            partitions=partitions,
        )
        path = "spark"
    else:
        tables = compact_arrow(stored.read_table(), relations, after_lsn=after_lsn)
        path = "arrow"
    return CompactionResult(tables, path, changes, round(time.perf_counter() - started, 4))


def compact_arrow(
    changes: pa.Table,
    relations: Mapping[TableName, TableRelation],
    *,
    after_lsn: int | None = None,
) -> dict[TableName, NetChanges]:
    """:func:`compact_table` for every table of a range's changes, in this process."""
    changes = changes.select(list(KERNEL_COLUMNS))
    if after_lsn is not None:
        changes = changes.filter(pc.greater(changes.column("commit_end_lsn"), after_lsn))
    out: dict[TableName, NetChanges] = {}
    for table, rows in _split_by_table(changes, relations):
        out[table] = compact_table(rows, relations[table])
    return out


def _split_by_table(
    changes: pa.Table, relations: Mapping[TableName, TableRelation]
) -> Iterator[tuple[TableName, pa.Table]]:
    """Rows grouped by table through their relation version (one sort, no per-table scan)."""
    if changes.num_rows == 0:
        return
    owner: dict[int, int] = {}
    tables = list(relations)
    for t, table in enumerate(tables):
        for version in relations[table].versions:
            owner[version] = t
    versions = changes.column("relation_version").to_numpy()
    lookup = np.full(int(versions.max()) + 1, -1, np.int64)
    for version, t in owner.items():
        if version < len(lookup):
            lookup[version] = t
    table_of = lookup[versions]
    if (table_of < 0).any():
        unknown = sorted(set(versions[table_of < 0].tolist()))
        raise CompactionError(
            f"changes carry relation version(s) {unknown} missing from the relation "
            "descriptions: the range manifest and its Parquet files disagree"
        )
    order = np.argsort(table_of, kind="stable")
    sorted_ids = table_of[order]
    bounds = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1], True])
    taken = changes.take(pa.array(order, pa.int64()))
    for a, b in itertools.pairwise(bounds.tolist()):
        yield tables[int(sorted_ids[a])], taken.slice(a, b - a)


# -- the same kernel on Spark --------------------------------------------------------------------


__all__ = [
    "DEFAULT_SPARK_MIN_CHANGES",
    "CompactionError",
    "CompactionResult",
    "NetChanges",
    "RelationColumn",
    "TableRelation",
    "compact_arrow",
    "compact_range",
    "compact_table",
    "compact_with_spark",
    "encode_keys",
    "relations_of",
]
