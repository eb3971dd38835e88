"""The net effect of one range's changes on one table: the compaction kernel.

Applying a range change by change would replay every intermediate state; what the target needs
is only each row's state at the range's end. This module computes it, once, as a vectorised
pure function over Arrow (:func:`compact_table`), and runs that same function either in this
process or per key-hash partition on Spark (:func:`~.spark.route_changes`).

Input and output::

    CHANGE_SCHEMA rows of one table ──▶ compact_table ──▶ NetChanges
    (any order: sorted here by               │              truncate + flags     applied first
     commit_end_lsn, seq)                    │              op D  k*             delete
                                             │              op U  k*, c*, u*, f*, n upsert
                                             └─ no identity: every change after the last
                                                truncate, in commit order (o*, m*, c*, u*)

What must hold (and why each rule is right)
    * Only changes after the table's last TRUNCATE matter: the truncate empties the table, so
      whatever came before it is gone. The truncate itself is applied first, then the rest.
    * Rows are identified by their *identity* columns: the replica-identity key of the
      relation (primary key or ``REPLICA IDENTITY USING INDEX``), or the primary key the caller
      names for a ``REPLICA IDENTITY FULL`` table. Per identity value only the last change
      counts: a delete is a delete, anything else is an upsert of the row it left.
    * An update that changes the identity is a delete of the old key and an upsert of the new
      key (a *move*).
    * Update chains merge column by column: a column's value is the latest one sent within the
      run of upserts since the key's last delete. An update that did not send a column (an
      unchanged TOASTed value, or a column its older relation version did not have) keeps the
      earlier value of the run. With no earlier value in the run, the column is flagged
      ``keep`` (``u<j>`` true): on the target it keeps the value it has. For a row that
      arrived by a move, that value lives at the key the row *came from*: the kernel follows
      the chain of moves back and names the key whose target row holds it (``f<j>``, the
      *origin key*); the apply reads it from there before deleting anything.
    * A table without identity columns (``REPLICA IDENTITY FULL`` and no primary key, or no
      key at all, where the source publishes only inserts) cannot be collapsed: two rows may
      be identical. Its changes stay in commit
      order, with their old values, for an ordered apply.

    * An upserted key whose first change in the range (after the last truncate) is its INSERT
      is *new* (``n``): the source did not have it when the range began, so neither has a
      target that applied everything before; the apply inserts such rows without an
      ``ON CONFLICT`` arbiter (about half the target's work for a big insert), and falls back
      to the upsert if the target has the key after all (a target written by hand).

Net tables are *wide*: one text column per table column, named by position (``k<j>`` identity,
``c<j>`` values, ``u<j>`` keep flags, ``f<j>`` origin key, ``o<j>`` old values) so no column
name of the user's table can collide with ours; :class:`TableRelation` maps positions to names.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import PgcdcError
from ..identifiers import TableName

if TYPE_CHECKING:
    pass


OP_DELETE = "D"
OP_UPSERT = "U"
OP_TRUNCATE = "T"
COUNT_MARKER = "C"

KERNEL_COLUMNS = (
    "commit_end_lsn",
    "seq",
    "action",
    "schema_name",
    "table_name",
    "relation_version",
    "key",
    "new_row",
    "unchanged_toast",
    "flags",
)
"""The CHANGE_SCHEMA columns the kernel reads (the rest never leaves the Parquet files)."""


class CompactionError(PgcdcError):
    """Changes that the kernel cannot interpret with the relation description it was given."""


# -- relation descriptions ----------------------------------------------------------------------


@dataclass(frozen=True)
class RelationColumn:
    name: str
    type_oid: int
    typmod: int
    key: bool
    """Flagged by pgoutput as part of the replica identity (every column under FULL)."""


@dataclass(frozen=True)
class TableRelation:
    """One table as the range describes it: its latest columns plus every version's layout.

    ``versions`` maps a ``relation_version`` (an index into the manifest's ``relations``) to
    the column names of that version's ``new_row`` lists and of its ``key`` lists, so rows
    written before and after a mid-range ``ALTER TABLE`` land in the right columns.
    ``identity`` holds the columns that identify a row for collapsing; empty means "keep the
    changes in commit order".
    """

    table: TableName
    replica_identity: str
    columns: tuple[RelationColumn, ...]
    identity: tuple[str, ...]
    versions: Mapping[int, tuple[tuple[str, ...], tuple[str, ...]]] = field(default_factory=dict)
    relid: int = 0
    """The table's oid on the source (0 in a manifest that did not record it): it survives
    renames of the table and its columns, so :mod:`..apply.ddl` finds the table in the source's
    catalog by it."""
    fills: Mapping[str, str | None] = field(default_factory=dict)
    """Per column the range adds, the value the source gave the rows that existed when it was
    added (``ALTER TABLE ... ADD COLUMN ... DEFAULT``'s ``attmissingval``, or NULL; see
    :mod:`..apply.ddl`): the rows of versions without it take that value, written, instead of
    keeping the target's, so a row inserted before the column was added is inserted too."""

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def flagged(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns if c.key)

    @property
    def collapsible(self) -> bool:
        return bool(self.identity)

    @property
    def identity_positions(self) -> tuple[int, ...]:
        names = self.names
        return tuple(names.index(k) for k in self.identity)

    def with_identity(self, identity: Sequence[str]) -> TableRelation:
        """The same relation collapsed by ``identity`` (e.g. the target's primary key of a
        REPLICA IDENTITY FULL table). Every identity column must be flagged in every version,
        since identity values before a change come from the ``key`` lists."""
        identity = tuple(identity)
        for version, (_, keys) in self.versions.items():
            missing = [c for c in identity if c not in keys]
            if missing:
                raise CompactionError(
                    f"table {self.table}: relation version {version} does not carry identity "
                    f"column(s) {', '.join(missing)} in its replica identity"
                )
        return replace(self, identity=identity)


def relations_of(manifest_relations: Sequence[Mapping[str, Any]]) -> dict[TableName, TableRelation]:
    """Every table of a range manifest's ``relations`` list, described by its latest version.

    The default identity is the flagged key columns, except under REPLICA IDENTITY FULL (where
    every column is flagged and no subset is known to be unique): there it is empty, and the
    caller may name the primary key with :meth:`TableRelation.with_identity`.
    """
    grouped: dict[TableName, list[int]] = {}
    for version, rel in enumerate(manifest_relations):
        grouped.setdefault(TableName(rel["schema"], rel["table"]), []).append(version)
    out: dict[TableName, TableRelation] = {}
    for table, versions in grouped.items():
        latest = manifest_relations[versions[-1]]
        columns = tuple(
            RelationColumn(c["name"], int(c["type_oid"]), int(c["typmod"]), bool(c["key"]))
            for c in latest["columns"]
        )
        layouts = {
            v: (
                tuple(c["name"] for c in manifest_relations[v]["columns"]),
                tuple(c["name"] for c in manifest_relations[v]["columns"] if c["key"]),
            )
            for v in versions
        }
        ri = str(latest["replica_identity"])
        identity = () if ri == "f" else tuple(c.name for c in columns if c.key)
        relid = int(latest.get("relid", 0))
        out[table] = TableRelation(table, ri, columns, identity, layouts, relid)
    return out


# -- the result ---------------------------------------------------------------------------------


@dataclass
class NetChanges:
    """The net effect of a range on one table.

    ``net`` is wide (see the module docstring). When ``ordered`` is false it holds one row per
    identity value: ``op`` ``D`` (delete ``k*``) or ``U`` (upsert ``k*`` with ``c*``, ``n`` true
    for a new key; ``u<j>``
    true means "do not overwrite column j", or, when ``f*`` is set, "take column j from the
    target row at origin key ``f*``"). When ``ordered`` is true it holds every change after the
    last truncate in commit order: ``ord``, ``op`` ``I``/``U``/``D``, old values ``o*`` with
    ``m<j>`` true where the old value was not sent (do not match on it), new values ``c*`` and
    keep flags ``u*``.
    """

    relation: TableRelation
    changes: int
    """Changes of this table the kernel read (truncates included)."""
    truncates: int
    """TRUNCATE changes among them."""
    truncate: bool
    truncate_flags: int
    """The last TRUNCATE's pgoutput flags: 1 CASCADE, 2 RESTART IDENTITY."""
    net: pa.Table
    ordered: bool

    @property
    def key_names(self) -> list[str]:
        return [f"k{j}" for j in range(len(self.relation.identity))]

    @property
    def deletes(self) -> pa.Table:
        rows = self.net.filter(pc.equal(self.net.column("op"), OP_DELETE))
        return rows.select(self.key_names)

    @property
    def upserts(self) -> pa.Table:
        rows = self.net.filter(pc.equal(self.net.column("op"), OP_UPSERT))
        return rows.drop_columns(["op"])

    def sorted_rows(self) -> list[dict[str, Any]]:
        """Python rows in a canonical order: for comparing two compactions in tests."""
        if self.ordered:
            return self.net.sort_by("ord").to_pylist()
        keys = [("op", "ascending"), *[(k, "ascending") for k in self.key_names]]
        return self.net.sort_by(keys).to_pylist()


def compact_table(changes: pa.Table, relation: TableRelation) -> NetChanges:
    """The net effect of ``changes`` (CHANGE_SCHEMA rows of one table) on that table.

    Pure and deterministic: the same changes give the same net rows whatever order or chunking
    they arrive in, which is what lets Spark run it per partition (see
    :func:`~.spark.route_changes`). Vectorised throughout: Arrow and NumPy calls per column or
    per chain depth of identity moves, never per row.
    """
    changes = changes.select(
        [c for c in KERNEL_COLUMNS if c in changes.column_names]
    ).combine_chunks()
    count = changes.num_rows
    if count and not _in_order(changes):
        order = pc.sort_indices(changes, [("commit_end_lsn", "ascending"), ("seq", "ascending")])
        changes = changes.take(order)
    truncate, flags = False, 0
    is_t = _is(changes, "T")
    truncates = int(is_t.sum())
    if truncates:
        last = int(np.flatnonzero(is_t)[-1])
        truncate, flags = True, int(changes.column("flags")[last].as_py())
        changes = changes.slice(last + 1)
    if relation.collapsible:
        net = _collapse(changes, relation)
    else:
        net = _in_commit_order(changes, relation)
    return NetChanges(relation, count, truncates, truncate, flags, net, not relation.collapsible)


def _in_order(changes: pa.Table) -> bool:
    """Whether the rows are already sorted by (``commit_end_lsn``, ``seq``), as a range is
    stored: then sorting them would only copy every column, lists included."""
    lsn = changes.column("commit_end_lsn").to_numpy()
    seq = changes.column("seq").to_numpy()
    same = lsn[1:] == lsn[:-1]
    return bool(((lsn[1:] > lsn[:-1]) | (same & (seq[1:] > seq[:-1]))).all())


def _is(changes: pa.Table, action: str) -> np.ndarray:
    if changes.num_rows == 0:
        return np.zeros(0, bool)
    return pc.equal(changes.column("action"), action).to_numpy(zero_copy_only=False)


def _collapse(changes: pa.Table, relation: TableRelation) -> pa.Table:
    n = changes.num_rows
    names = relation.names
    width, ident = len(names), relation.identity_positions
    is_d = _is(changes, "D")
    is_u = _is(changes, "U")
    versions = _versions(changes)
    values, masks = _row_values(changes, relation, versions)
    old_keys, _ = _pick(
        changes.column("key"),
        versions,
        {v: k for v, (_, k) in relation.versions.items()},
        relation.identity,
        relation.table,
    )
    new_keys = [values[p] for p in ident]
    old_str, new_str = encode_keys(old_keys), encode_keys(new_keys)
    # An update whose identity columns were not all sent (unchanged TOAST in a key column)
    # did not change them.
    moved = is_u & ~masks[:, list(ident)].any(axis=1)
    if n:
        moved &= pc.fill_null(pc.not_equal(old_str, new_str), False).to_numpy(zero_copy_only=False)

    # Events: one per change, plus the delete half of every move (just before its upsert).
    mi = np.flatnonzero(moved)
    m = len(mi)
    moved_arr = pa.array(moved)
    ev_change = np.concatenate([np.arange(n), mi])
    ev_pos = np.concatenate([2 * np.arange(n) + 1, 2 * mi])
    ev_upsert = np.concatenate([~is_d, np.zeros(m, bool)])
    ev_moved_in = np.concatenate([moved, np.zeros(m, bool)])
    ev_key_parts = [
        pa.concat_arrays([pc.if_else(moved_arr, nk, ok), ok.take(pa.array(mi, pa.int64()))])
        for ok, nk in zip(old_keys, new_keys, strict=True)
    ]
    ev_key_str = pa.concat_arrays(
        [pc.if_else(moved_arr, new_str, old_str), old_str.take(pa.array(mi, pa.int64()))]
    )
    key_ids = _dense_ids(ev_key_str)

    s = np.lexsort((ev_pos, key_ids))
    total = len(s)
    kid, up, mv, ch = key_ids[s], ev_upsert[s], ev_moved_in[s], ev_change[s]
    idx = np.arange(total)
    boundary = np.ones(total, bool)
    if total:
        boundary[1:] = kid[1:] != kid[:-1]
    last = np.ones(total, bool)
    if total:
        last[:-1] = boundary[1:]
    run_start_flag = boundary.copy()
    if total:
        run_start_flag[1:] |= ~up[:-1]
    run_start = np.maximum.accumulate(np.where(run_start_flag, idx, 0)) if total else idx
    final = np.flatnonzero(last)
    f_up, f_del = final[up[final]], final[~up[final]]
    # New keys: the key's first event is an INSERT itself (not the delete half of a move,
    # whose event indexes start at n, nor a move in, which is an UPDATE).
    first_of_key = np.maximum.accumulate(np.where(boundary, idx, 0)) if total else idx
    first = first_of_key[f_up]
    fresh = (s[first] < n) & _is(changes, "I")[ch[first]] if len(f_up) else np.zeros(0, bool)

    # Sorted position of the delete half of each move, reached from its upsert half.
    inverse = np.empty(total, np.int64)
    inverse[s] = idx
    partner = np.full(n, -1, np.int64)
    partner[mi] = n + np.arange(m)

    # Chain of moves behind each upserted row whose run began with a move: follow it back to
    # the run that did not begin with one; that run's key holds the values never sent.
    starts_moved = mv[run_start[f_up]]
    chain: list[tuple[np.ndarray, np.ndarray]] = []  # (rows of f_up, delete-half event) per depth
    rows = np.flatnonzero(starts_moved)
    cursor = run_start[f_up[rows]]
    root_event = np.full(len(f_up), -1, np.int64)
    while len(rows):
        delete_half = inverse[partner[ch[cursor]]]
        chain.append((rows, delete_half))
        rs = run_start[delete_half]
        deeper = mv[rs]
        root_event[rows[~deeper]] = delete_half[~deeper]
        rows, cursor = rows[deeper], rs[deeper]

    up_values: list[pa.Array] = []
    up_masks = np.zeros((len(f_up), width), bool)
    needs_origin = np.zeros(len(f_up), bool)
    for j in range(width):
        valid = up & ~masks[ch, j]
        latest = np.maximum.accumulate(np.where(valid, idx, -1)) if total else idx
        src = latest[f_up]
        found = src >= run_start[f_up]
        for depth_rows, delete_half in chain:
            open_rows = depth_rows[~found[depth_rows]]
            if not len(open_rows):
                continue
            dh = delete_half[~found[depth_rows]]
            cand = latest[dh]
            hit = cand >= run_start[dh]
            src[open_rows[hit]] = cand[hit]
            found[open_rows[hit]] = True
        taken = ch[np.where(found, src, 0)] if total else np.zeros(0, np.int64)
        up_values.append(values[j].take(pa.array(taken, pa.int64(), mask=~found)))
        up_masks[:, j] = ~found
        needs_origin |= ~found & (root_event >= 0)

    # Assemble the net table: deletes, then upserts.
    ev_f_up, ev_f_del = s[f_up], s[f_del]
    origin_ev = np.where(needs_origin, s[np.where(root_event >= 0, root_event, 0)], 0)
    nd, nu = len(f_del), len(f_up)
    columns: dict[str, pa.Array] = {
        "op": pa.array([OP_DELETE] * nd + [OP_UPSERT] * nu, pa.string()),
    }
    for j, part in enumerate(ev_key_parts):
        columns[f"k{j}"] = pa.concat_arrays(
            [part.take(pa.array(ev_f_del, pa.int64())), part.take(pa.array(ev_f_up, pa.int64()))]
        )
    for j in range(width):
        columns[f"c{j}"] = pa.concat_arrays([pa.nulls(nd, pa.string()), up_values[j]])
    for j in range(width):
        columns[f"u{j}"] = pa.array(np.concatenate([np.zeros(nd, bool), up_masks[:, j]]))
    for j, part in enumerate(ev_key_parts):
        origin = part.take(pa.array(origin_ev, pa.int64(), mask=~needs_origin))
        columns[f"f{j}"] = pa.concat_arrays([pa.nulls(nd, pa.string()), origin])
    columns["n"] = pa.array(np.concatenate([np.zeros(nd, bool), fresh]))
    return pa.table(columns)


def _in_commit_order(changes: pa.Table, relation: TableRelation) -> pa.Table:
    versions = _versions(changes)
    names = relation.names
    values, masks = _row_values(changes, relation, versions)
    old, unkeyed = _pick(
        changes.column("key"),
        versions,
        {v: k for v, (_, k) in relation.versions.items()},
        names,
        relation.table,
        missing_ok=True,
    )
    columns: dict[str, pa.Array] = {
        "ord": pa.array(np.arange(changes.num_rows), pa.int64()),
        "op": changes.column("action").combine_chunks().cast(pa.string()),
    }
    for j, arr in enumerate(old):
        columns[f"o{j}"] = arr
    for j, arr in enumerate(old):
        # Not sent (unchanged TOAST in the old tuple), or not in the replica identity at all
        # (a keyed table replayed in order: its rows are found by their key): the match must
        # ignore this column.
        columns[f"m{j}"] = pa.array((masks[:, j] & np.asarray(arr.is_null(), bool)) | unkeyed[:, j])
    for j in range(len(names)):
        columns[f"c{j}"] = values[j]
    for j in range(len(names)):
        columns[f"u{j}"] = pa.array(masks[:, j])
    return pa.table(columns)


def _versions(changes: pa.Table) -> np.ndarray:
    if changes.num_rows == 0:
        return np.zeros(0, np.int32)
    return changes.column("relation_version").to_numpy()


def _row_values(
    changes: pa.Table, relation: TableRelation, versions: np.ndarray
) -> tuple[list[pa.Array], np.ndarray]:
    """New values per latest column, and the n × width "not sent" mask: unchanged TOAST, or a
    column the row's relation version did not have."""
    names = relation.names
    values, missing = _pick(
        changes.column("new_row"),
        versions,
        {v: c for v, (c, _) in relation.versions.items()},
        names,
        relation.table,
        missing_ok=True,
        fills=relation.fills,
    )
    return values, missing | _unchanged(changes.column("unchanged_toast"), names)


def _pick(
    lists: pa.ChunkedArray | pa.Array,
    versions: np.ndarray,
    layouts: Mapping[int, tuple[str, ...]],
    wanted: Sequence[str],
    table: TableName,
    *,
    missing_ok: bool = False,
    fills: Mapping[str, str | None] | None = None,
) -> tuple[list[pa.Array], np.ndarray]:
    """Positional list values → one array per wanted column name, version by version; a
    column a version lacks is null and flagged missing, or takes its value in ``fills``."""
    if isinstance(lists, pa.ChunkedArray):
        lists = lists.combine_chunks() if lists.num_chunks != 1 else lists.chunk(0)
    n = len(lists)
    missing = np.zeros((n, len(wanted)), bool)
    present = np.unique(versions)
    groups: list[tuple[int | None, np.ndarray | None]]
    if len(present) <= 1:
        groups = [(int(present[0]) if len(present) else None, None)]
    else:
        groups = [(int(v), np.flatnonzero(versions == v)) for v in present]
    parts: list[list[pa.Array]] = [[] for _ in wanted]
    for version, rows in groups:
        subset = lists if rows is None else lists.take(pa.array(rows, pa.int64()))
        layout = layouts.get(version, ()) if version is not None else ()
        if version is not None and version not in layouts:
            raise CompactionError(
                f"table {table}: changes carry relation version {version}, which the "
                "relation description does not know"
            )
        for j, name in enumerate(wanted):
            if name in layout:
                parts[j].append(pc.list_element(subset, layout.index(name)))
            elif fills and name in fills:
                parts[j].append(pa.array([fills[name]] * len(subset), pa.string()))
            else:
                if not missing_ok and len(subset):
                    raise CompactionError(
                        f"table {table}: relation version {version} has no column {name} "
                        "in its replica identity"
                    )
                parts[j].append(pa.nulls(len(subset), pa.string()))
                missing[slice(None) if rows is None else rows, j] = True
    if len(groups) == 1:
        return [p[0] for p in parts], missing
    back = np.empty(n, np.int64)
    back[np.concatenate([r for _, r in groups if r is not None])] = np.arange(n)
    inverse = pa.array(back, pa.int64())
    return [pa.concat_arrays(p).take(inverse) for p in parts], missing


def _unchanged(toast: pa.ChunkedArray | pa.Array, names: Sequence[str]) -> np.ndarray:
    if isinstance(toast, pa.ChunkedArray):
        toast = toast.combine_chunks() if toast.num_chunks != 1 else toast.chunk(0)
    out = np.zeros((len(toast), len(names)), bool)
    if toast.null_count == len(toast):
        return out
    flat = pc.list_flatten(toast)
    parents = pc.list_parent_indices(toast).to_numpy()
    for j, name in enumerate(names):
        hit = pc.equal(flat, name).to_numpy(zero_copy_only=False)
        out[parents[hit], j] = True
    return out


def encode_keys(parts: Sequence[pa.Array]) -> pa.Array:
    """One string per row that is equal exactly when all identity values are equal.

    One column is itself; several are joined as ``<length>:<value>`` (``N`` for NULL), which no
    choice of values can make ambiguous.
    """
    if len(parts) == 1:
        return parts[0]
    encoded = []
    for part in parts:
        framed = pc.binary_join_element_wise(pc.cast(pc.utf8_length(part), pa.string()), part, ":")
        encoded.append(pc.fill_null(framed, "N"))
    return pc.binary_join_element_wise(*encoded, "|")


def _dense_ids(keys: pa.Array) -> np.ndarray:
    if len(keys) == 0:
        return np.zeros(0, np.int64)
    return pc.dictionary_encode(keys).indices.to_numpy().astype(np.int64)


# -- one range, in process ----------------------------------------------------------------------
