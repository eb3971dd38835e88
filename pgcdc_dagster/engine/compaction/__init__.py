"""Compaction: the net effect of one range per table (:mod:`.kernel`), in this process or on
Spark (:mod:`.spark`) by the range's size.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..identifiers import TableName
from ..settings import DEFAULT_SPARK_MIN_CHANGES
from ..store.output_store import StoredRange
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
    floors: Mapping[TableName, int] | None = None,
    held_back: Collection[int] = (),
) -> CompactionResult:
    """Every table's net changes of a stored range, in this process, skipping transactions
    whose COMMIT ends at or before ``after_lsn`` (already applied), a table's changes
    committed at or before its ``floors`` entry (a table added after the base snapshot: its
    own copy holds them), and the rows of the relation versions ``held_back`` (tables being
    added, absent from ``relations``; Spark's compaction leaves out every version
    ``relations`` lacks). (Ranges past :data:`DEFAULT_SPARK_MIN_CHANGES` are compacted and
    staged by Spark's workers instead: :mod:`..apply.spark_staging`.)"""
    started = time.perf_counter()
    changes = stored.read_table(KERNEL_COLUMNS)
    if held_back and changes.num_rows:
        versions = pa.array(sorted(held_back), pa.int32())
        changes = changes.filter(
            pc.invert(pc.is_in(changes.column("relation_version"), value_set=versions))
        )
    tables = compact_arrow(changes, relations, after_lsn=after_lsn, floors=floors)
    return CompactionResult(
        tables, "arrow", stored.changes, round(time.perf_counter() - started, 4)
    )


def compact_arrow(
    changes: pa.Table,
    relations: Mapping[TableName, TableRelation],
    *,
    after_lsn: int | None = None,
    floors: Mapping[TableName, int] | None = None,
) -> dict[TableName, NetChanges]:
    """:func:`compact_table` for every table of a range's changes, in this process (for
    ``after_lsn`` and ``floors`` see :func:`compact_range`)."""
    changes = changes.select(list(KERNEL_COLUMNS))
    if after_lsn is not None and changes.num_rows:
        # Only a range applied in part before (its transactions up to the origin) has rows
        # to drop; a filter copies every column, lists included, even when it keeps them all.
        lsns = changes.column("commit_end_lsn")
        if pc.min(lsns).as_py() <= after_lsn:
            changes = changes.filter(pc.greater(lsns, after_lsn))
    out: dict[TableName, NetChanges] = {}
    for table, rows in _split_by_table(changes, relations):
        floor = (floors or {}).get(table)
        if floor is not None and (after_lsn is None or floor > after_lsn):
            rows = rows.filter(pc.greater(rows.column("commit_end_lsn"), floor))
        out[table] = compact_table(rows, relations[table])
    return out


def compact_in_commit_order(
    stored: StoredRange,
    relations: Mapping[TableName, TableRelation],
    table: TableName,
    *,
    after_lsn: int | None = None,
    floors: Mapping[TableName, int] | None = None,
) -> NetChanges:
    """``table``'s changes of a stored range in commit order (``ordered``), not collapsed by
    its identity: for an apply whose net rows the target's other unique keys refused, as the
    source's own order of statements never did (a swap of two rows' unique values through a
    third, say; see :func:`~..apply.transaction.apply_range`)."""
    relation = relations[table].with_identity(())
    changes = stored.read_table(KERNEL_COLUMNS)
    versions = pa.array(list(relation.versions), pa.int32())
    changes = changes.filter(pc.is_in(changes.column("relation_version"), value_set=versions))
    return compact_arrow(changes, {table: relation}, after_lsn=after_lsn, floors=floors)[table]


class HeldBack:
    """The changes of tables being added (which the applies held back) committed in
    ``(since, through]``, gathered from consecutive stored ranges to be compacted and applied
    as one (:func:`~..apply.transaction.apply_added_changes`).

    Why gathered: an add's copy of a big table lasts as long as it takes, and a follow stores a
    range every few hundred milliseconds meanwhile; one transaction per range pays the target's
    catalog read, staging, the statements and the commit for a few hundred changes. Gathered,
    those costs are paid once per batch (see ``benchmarks/held_back.py`` and
    ``benchmarks/HISTORY.md``).

    What must hold: the rows stay in commit order (ranges are added in LSN order, each in its
    own order); each range's relation versions (indexes into its own manifest's ``relations``)
    are renumbered into one list, so a table altered between two gathered ranges keeps each
    row's own layout, as the kernel does for a mid-range ``ALTER TABLE``; only the versions
    rows use are kept, so a table's latest shape is that of its latest change."""

    def __init__(self, tables: Collection[TableName], *, since: int, through: int) -> None:
        self.tables = frozenset(tables)
        self.since = since
        self.through = through
        self._parts: list[pa.Table] = []
        self._relations: list[Mapping[str, Any]] = []
        self.rows = 0
        self.ranges = 0

    def lists_any(self, stored: StoredRange) -> bool:
        """Whether ``stored``'s manifest describes any of the tables (else it holds none of
        their changes, and its files need not be read)."""
        return any(self._wanted(rel) for rel in stored.manifest.relations)

    def _wanted(self, rel: Mapping[str, Any]) -> bool:
        return TableName(str(rel["schema"]), str(rel["table"])) in self.tables

    def add(self, stored: StoredRange) -> None:
        """Gather ``stored``'s share."""
        listed = [v for v, rel in enumerate(stored.manifest.relations) if self._wanted(rel)]
        if not listed:
            return
        changes = stored.read_table(KERNEL_COLUMNS)
        lsns = changes.column("commit_end_lsn")
        rows = changes.filter(
            pc.and_(
                pc.is_in(
                    changes.column("relation_version"), value_set=pa.array(listed, pa.int32())
                ),
                pc.and_(pc.greater(lsns, self.since), pc.less_equal(lsns, self.through)),
            )
        )
        if rows.num_rows == 0:
            return
        versions = rows.column("relation_version").to_numpy()
        lookup = np.full(int(versions.max()) + 1, -1, np.int32)
        for version in np.unique(versions).tolist():
            lookup[version] = len(self._relations)
            self._relations.append(stored.manifest.relations[version])
        at = rows.schema.get_field_index("relation_version")
        rows = rows.set_column(at, "relation_version", pa.array(lookup[versions], pa.int32()))
        self._parts.append(rows)
        self.rows += rows.num_rows
        self.ranges += 1

    def relations(self) -> dict[TableName, TableRelation]:
        """The gathered tables, each by its latest gathered version, every version's layout."""
        return relations_of(self._relations)

    def compact(self, relations: Mapping[TableName, TableRelation]) -> dict[TableName, NetChanges]:
        """Net changes per table (a relation with no identity, ``with_identity(())``, gives its
        changes in commit order)."""
        if not self._parts:
            return {}
        return compact_arrow(pa.concat_tables(self._parts), relations)


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
    if (table_of[1:] >= table_of[:-1]).all():
        # Already grouped (a range of one table, such as a log table's stream): a take
        # would copy every column, lists included, into the same order.
        sorted_ids, taken = table_of, changes
    else:
        order = np.argsort(table_of, kind="stable")
        sorted_ids = table_of[order]
        taken = changes.take(pa.array(order, pa.int64()))
    bounds = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1], True])
    for a, b in itertools.pairwise(bounds.tolist()):
        yield tables[int(sorted_ids[a])], taken.slice(a, b - a)


# -- the same kernel on Spark --------------------------------------------------------------------


__all__ = [
    "DEFAULT_SPARK_MIN_CHANGES",
    "CompactionError",
    "CompactionResult",
    "HeldBack",
    "NetChanges",
    "RelationColumn",
    "TableRelation",
    "compact_arrow",
    "compact_in_commit_order",
    "compact_range",
    "compact_table",
    "encode_keys",
    "relations_of",
]
