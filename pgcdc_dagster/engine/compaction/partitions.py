"""A range's changes routed to key-hash partitions in this process, batch by batch: the
in-memory twin of :func:`.spark.route_changes`, so that a range of any size is compacted one
partition at a time (:mod:`..apply.partitioned_staging`).

The rules are Spark's (its docstring argues them): every change of an identity value goes to
the partition of the value's hash; every change touching a key that a move (an update changing
the identity) touched goes to one extra partition, ``parts``, chains and all; TRUNCATEs are
copied into every partition of their table; a table without identity hashes one empty key, so
it goes whole into one partition, in commit order. Two passes over the range: the first learns
the moved keys, the second routes. Only the moved keys are held (nothing else of the range):
a range whose every row moves (``UPDATE t SET id = id + 1``) puts them all into the extra
partition, which then holds that table's range whole.

The hash is this module's own (:func:`hash_strings`), not Spark's ``xxhash64``: the two paths
never share partitions, each only needs a key's changes together.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..identifiers import TableName
from .kernel import KERNEL_COLUMNS, TableRelation

KEY_SEPARATOR = "\x1f"
"""Between a multi-column identity's values in a routing key (and between the table's index
and the key in the moved set)."""
_WEIGHTS = np.random.default_rng(20261128).integers(1, 2**63, 64, dtype=np.uint64) | np.uint64(1)
"""Per byte position (modulo 64) within a key: the hash is a weighted sum of the key's bytes,
mixed. Fixed, so a key hashes the same in every process and run."""


def hash_strings(values: pa.Array) -> np.ndarray:
    """A 64-bit hash of every string of ``values`` (NULL as the empty string), vectorised over
    the array's buffers: no Python object per value."""
    values = values.cast(pa.string())
    n = len(values)
    if n == 0:
        return np.zeros(0, np.uint64)
    offsets_buffer, data_buffer = values.buffers()[1], values.buffers()[2]
    offsets = np.frombuffer(offsets_buffer, np.int32)[values.offset : values.offset + n + 1]
    offsets = offsets.astype(np.int64)
    base = int(offsets[0])
    starts, ends = offsets[:-1] - base, offsets[1:] - base
    lengths = ends - starts
    size = int(ends[-1]) if n else 0
    if size:
        data = np.frombuffer(data_buffer, np.uint8)[base : base + size].astype(np.uint64)
        position = np.arange(size, dtype=np.int64) - np.repeat(starts, lengths)
        weighted = data * _WEIGHTS[position % len(_WEIGHTS)]  # wraps modulo 2**64, as meant
        sums = np.concatenate((np.zeros(1, np.uint64), np.cumsum(weighted, dtype=np.uint64)))
        h = sums[ends] - sums[starts]
    else:
        h = np.zeros(n, np.uint64)
    h ^= lengths.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(29)
    return h


def _elements(lists: pa.Array, positions: np.ndarray) -> pa.Array:
    """Per row, element ``positions[i]`` of list ``i`` (NULL where the list is NULL or too
    short, or the position is -1)."""
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks()
    offsets = lists.offsets.to_numpy().astype(np.int64)
    lengths = offsets[1:] - offsets[:-1]
    valid = (positions >= 0) & (positions < lengths)
    if lists.null_count:
        valid &= lists.is_valid().to_numpy(zero_copy_only=False)
    at = np.where(valid, offsets[:-1] + positions, 0)
    values = lists.values
    if len(values) == 0:
        return pa.nulls(len(lists), pa.string())
    taken = values.take(pa.array(at, pa.int64()))
    return pc.if_else(pa.array(valid), taken, pa.scalar(None, pa.string()))


@dataclass(frozen=True)
class _Version:
    table: int
    old: tuple[int, ...]
    """Positions of the identity's values in ``key`` (empty: no identity)."""
    new: tuple[int, ...]
    """Positions of the identity's values in ``new_row``."""


class Router:
    """Routes batches of a range's changes (:data:`~.kernel.KERNEL_COLUMNS`) to ``(table
    index, partition)``, leaving out what the apply skips: transactions at or before
    ``after_lsn``, a table's changes at or before its ``floors`` entry, and rows of relation
    versions ``relations`` lacks (tables being added)."""

    def __init__(
        self,
        relations: Mapping[TableName, TableRelation],
        parts: int,
        *,
        after_lsn: int | None = None,
        floors: Mapping[TableName, int] | None = None,
    ) -> None:
        self.tables = list(relations)
        self.parts = parts
        self._identity = [frozenset(relations[t].identity) for t in self.tables]
        self.after_lsn = after_lsn
        self.versions: dict[int, _Version] = {}
        for t, name in enumerate(self.tables):
            rel = relations[name]
            for version, (names, flagged) in rel.versions.items():
                if rel.collapsible:
                    old = tuple(flagged.index(c) if c in flagged else -1 for c in rel.identity)
                    new = tuple(names.index(c) if c in names else -1 for c in rel.identity)
                else:
                    old = new = ()
                self.versions[version] = _Version(t, old, new)
        size = max(self.versions, default=-1) + 1
        self._table_of = np.full(size, -1, np.int64)
        self._floor_of = np.full(size, np.iinfo(np.int64).min, np.int64)
        for version, v in self.versions.items():
            self._table_of[version] = v.table
            floor = (floors or {}).get(self.tables[v.table])
            if floor is not None and (after_lsn is None or floor > after_lsn):
                self._floor_of[version] = floor
        self.moved: set[str] = set()
        self._wanted: pa.Array | None = None
        self.truncated: dict[int, int] = {}
        """Table index -> flags of the last TRUNCATE routed (batches come in commit order)."""

    def _kept(self, batch: pa.Table) -> tuple[pa.Table, np.ndarray]:
        """The rows the apply takes, and their table indexes."""
        versions = batch.column("relation_version").to_numpy()
        lsns = batch.column("commit_end_lsn").to_numpy()
        if not self.versions:
            return batch.slice(0, 0), np.zeros(0, np.int64)
        known = versions < len(self._table_of)
        clipped = np.where(known, versions, 0)
        tables = np.where(known, self._table_of[clipped], -1)
        keep = (tables >= 0) & (lsns > self._floor_of[clipped])
        if self.after_lsn is not None:
            keep &= lsns > self.after_lsn
        if keep.all():
            return batch, tables
        return batch.filter(pa.array(keep)), tables[keep]

    def _keys(self, batch: pa.Table, *, with_new: bool) -> tuple[pa.Array, pa.Array]:
        """Each row's identity before (from ``key``) and after (from ``new_row``, only
        ``with_new``: else NULL) the change, as one string (empty for a table without
        identity; NULL where not sent)."""
        n = batch.num_rows
        versions = batch.column("relation_version").to_numpy()
        width = max((len(v.old) for v in self.versions.values()), default=0)
        if width == 0:
            empty = pa.array([""] * n, pa.string())
            return empty, empty
        old_parts, new_parts = [], []
        for j in range(width):
            old_at = np.full(len(self._table_of), -1, np.int64)
            new_at = np.full(len(self._table_of), -1, np.int64)
            for version, v in self.versions.items():
                if j < len(v.old):
                    old_at[version], new_at[version] = v.old[j], v.new[j]
            old_parts.append(_elements(batch.column("key"), old_at[versions]))
            if with_new:
                new_parts.append(_elements(batch.column("new_row"), new_at[versions]))
        identity = np.zeros(len(self._table_of), bool)
        for version, v in self.versions.items():
            identity[version] = bool(v.old)
        has = pa.array(identity[versions])
        none = pa.scalar(None, pa.string())
        old = pc.if_else(has, _joined(old_parts), pa.array([""] * n, pa.string()))
        if not with_new:
            return old, pa.nulls(n, pa.string())
        return old, pc.if_else(has, _joined(new_parts), none)

    def _moves(self, batch: pa.Table, old: pa.Array, new: pa.Array) -> np.ndarray:
        """Which rows move a row: an update whose identity changed (and was sent whole)."""
        moved = pc.and_(
            pc.equal(batch.column("action"), "U"),
            pc.fill_null(pc.not_equal(old, new), False),
        ).to_numpy(zero_copy_only=False)
        if moved.any():  # a key column left unsent (TOASTed, unchanged) did not move
            toast = batch.column("unchanged_toast")
            versions = batch.column("relation_version")
            for i in np.flatnonzero(moved & toast.is_valid().to_numpy(zero_copy_only=False)):
                unsent = set(toast[int(i)].as_py() or ())
                table = self.versions[int(versions[int(i)].as_py())].table
                if unsent & self._identity[table]:
                    moved[i] = False
        return moved

    def learn(self, batch: pa.Table) -> None:
        """First pass: remember the keys (table and identity) that a move touches."""
        batch, tables = self._kept(batch)
        updates = pc.equal(batch.column("action"), "U")
        if not batch.num_rows or not pc.any(updates).as_py():
            return
        if not pc.all(updates).as_py():  # only an UPDATE moves: the keys of the rest unread
            tables = tables[updates.to_numpy(zero_copy_only=False)]
            batch = batch.filter(updates)
        old, new = self._keys(batch, with_new=True)
        moved = self._moves(batch, old, new)
        if not moved.any():
            return
        mask = pa.array(moved)
        for side in (old, new):
            self.moved.update(_tagged(tables, side).filter(mask).to_pylist())

    def route(self, batch: pa.Table) -> Iterator[tuple[int, int, pa.Table]]:
        """Second pass: ``(table index, partition, rows)`` for every group of ``batch``, rows in
        their order (TRUNCATEs in every partition of their table)."""
        batch, tables = self._kept(batch)
        n = batch.num_rows
        if not n:
            return
        old, new = self._keys(batch, with_new=bool(self.moved))
        pid = (hash_strings(old) % np.uint64(self.parts)).astype(np.int64)
        if self.moved:
            if self._wanted is None:
                self._wanted = pa.array(sorted(self.moved), pa.string())
            member = pc.or_(
                pc.fill_null(pc.is_in(_tagged(tables, old), self._wanted), False),
                pc.fill_null(pc.is_in(_tagged(tables, new), self._wanted), False),
            ).to_numpy(zero_copy_only=False)
            pid[member] = self.parts
        rows = np.arange(n)
        truncate = pc.equal(batch.column("action"), "T").to_numpy(zero_copy_only=False)
        if truncate.any():
            every = np.flatnonzero(truncate)
            flags = batch.column("flags").to_numpy()
            for i in every.tolist():
                self.truncated[int(tables[i])] = int(flags[i])
            extra_rows = np.repeat(every, self.parts + 1)
            extra_pids = np.tile(np.arange(self.parts + 1), len(every))
            rows = np.concatenate((rows[~truncate], extra_rows))
            pid = np.concatenate((pid[~truncate], extra_pids))
        group = tables[rows] * (self.parts + 1) + pid
        order = np.lexsort((rows, group))
        group, rows = group[order], rows[order]
        bounds = np.flatnonzero(np.r_[True, group[1:] != group[:-1], True])
        taken = batch.select(list(KERNEL_COLUMNS)).take(pa.array(rows))
        for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
            g = int(group[a])
            yield g // (self.parts + 1), g % (self.parts + 1), taken.slice(a, b - a)


def _joined(parts: list[pa.Array]) -> pa.Array:
    if len(parts) == 1:
        return parts[0]
    return pc.binary_join_element_wise(
        *parts, KEY_SEPARATOR, null_handling="replace", null_replacement="\x00"
    )


def _tagged(tables: np.ndarray, keys: pa.Array) -> pa.Array:
    """``<table index><separator><key>``: a key of the moved set (NULL where ``keys`` is)."""
    return pc.binary_join_element_wise(
        pc.cast(pa.array(tables, pa.int64()), pa.string()), keys, KEY_SEPARATOR
    )
