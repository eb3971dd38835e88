"""The source's DDL followed on the target, or refused: never a table silently different.

A source's ``ALTER TABLE`` reaches the change stream only as a new Relation message: the
names, types and key flags of the table's live columns, in ``attnum`` order. The rows that
existed before it never pass through the stream again, so what a DDL did to them (an added
column's default, a rename) has to be worked out from the source's catalog. This module does
that when a range's relation of a table no longer matches the target's columns, and the apply
(:mod:`.transaction`) carries out what it plans in the range's own transaction, before the rows.

How a column is told apart from another
    By its ``attnum`` on the source, which a rename keeps and a drop retires for good (a column
    added later gets a new one). The attnums of a table's columns are recorded on the target
    when the table is copied (:func:`record_copied`, in ``pgcdc_ddl.source_columns``, with the
    table's oid and ``relfilenode``), and updated in every transaction that changes the
    table's shape, so they are as durable and as current as the rows. The source's catalog is
    read by the table's oid (which survives renames) when a relation no longer matches.

What is followed by itself (:class:`TableChanges`, reported in the range's metadata)
    * RENAME COLUMN: the target's column of the same attnum is renamed (two columns swapping
      names too, through temporary names), and the range's older relation versions are read
      under the new names, so no value is lost.
    * ADD COLUMN: rows that existed then get exactly the source's value. With a non-volatile
      default (a constant, ``now()``) PostgreSQL stores that value once, in
      ``pg_attribute.attmissingval``: the column is added with it, and the range's rows of
      older versions take it too (:attr:`~..compaction.TableRelation.fills`). Without a
      default they are NULL, which is known only while the table was not rewritten since it
      was recorded (its ``relfilenode`` unchanged). The target's default then follows the
      source's.
    * Widening type changes (``int2`` → ``int4`` → ``int8``, ``float4`` → ``float8``,
      ``varchar(n)`` → ``varchar(m)`` with m > n or ``text``, ``numeric`` precision raised):
      every source value fits, so the target's column is altered.
    * DROP COLUMN: dropped on the target in the transaction of the range that shows it gone
      (``PGCDC_DROPPED_COLUMNS=drop``, the default: the target keeps the source's shape, and a
      migration's cutover expects exactly that), or kept, NULL in later rows (``keep``).

What is not (:class:`ResyncNeeded`)
    Anything whose effect on existing rows the catalog cannot tell: a volatile default
    (``random()``, ``clock_timestamp()``: the table is rewritten, each row differs), a column
    added without a default after the table was rewritten, a narrowing or other type change,
    a catalog that moved on past the range in a way that hides what the range did. The table
    is then re-copied (:func:`~..control.pipeline.resync_tables`), or, with ``PGCDC_DDL=strict``,
    the apply stops with one line naming ``pgcdc resync``. Either way nothing of the range is
    applied first.

Crash anywhere: the steps, the record's update, the range's rows and the origin's progress
commit together, so a kill leaves the target as it was and the next apply plans again.

Why one module: planning a change by ``attnum``, carrying it out and recording the new shape
are one transaction's work and one invariant (never a table silently different).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from psycopg import sql

from ..catalog import (
    RECORDS_SCHEMA,
    ensure_records_schema,
    records_table,
    records_table_exists,
)
from ..compaction import TableRelation
from ..errors import ApplyError
from ..identifiers import TableName

RECORD_TABLE = "source_columns"
RECORD = records_table(RECORD_TABLE)


class SchemaDriftError(ApplyError):
    """The target's columns differ from the source's in a way the apply will not repair."""


class ResyncNeeded(SchemaDriftError):
    """A table changed on the source in a way its target table cannot follow column by column:
    it must be re-copied. Raised before anything of the range is written."""

    def __init__(self, reasons: Mapping[TableName, str]) -> None:
        self.reasons = dict(reasons)
        names = " ".join(str(t) for t in sorted(self.reasons))
        why = "; ".join(f"{t}: {r}" for t, r in sorted(self.reasons.items()))
        super().__init__(
            f"{why}. Re-copy it while replication goes on: pgcdc resync {names} "
            "(PGCDC_DDL=auto does it by itself); nothing of the range was applied"
        )

    @property
    def tables(self) -> list[TableName]:
        return sorted(self.reasons)


# -- the source's catalog --------------------------------------------------------------------


@dataclass(frozen=True)
class SourceColumn:
    attnum: int
    name: str
    type_oid: int
    typmod: int
    type_sql: str
    not_null: bool
    dropped: bool
    generated: bool
    default_sql: str | None
    has_missing: bool
    missing_text: str | None
    """The value rows that existed when the column was added read (``attmissingval``), as
    text; ``None`` without one."""
    is_array: bool


@dataclass(frozen=True)
class SourceTable:
    relid: int
    table: TableName
    relfilenode: int
    columns: tuple[SourceColumn, ...]
    """Every attribute, the dropped ones too, in attnum order."""

    @property
    def live(self) -> dict[str, SourceColumn]:
        return {c.name: c for c in self.columns if not c.dropped}

    @property
    def by_attnum(self) -> dict[int, SourceColumn]:
        return {c.attnum: c for c in self.columns}


_SOURCE_TABLES = """
SELECT c.oid::int8, n.nspname, c.relname, c.relfilenode::int8, a.attnum, a.attname,
       a.atttypid::int8, a.atttypmod, format_type(a.atttypid, a.atttypmod), a.attnotnull,
       a.attisdropped, a.attgenerated <> '', pg_get_expr(d.adbin, d.adrelid), a.atthasmissing,
       CASE WHEN a.atthasmissing THEN (a.attmissingval::text::text[])[1] END,
       coalesce(t.typcategory = 'A', false)
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0
LEFT JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
WHERE c.relkind IN ('r', 'p')
  AND (c.oid = ANY(%s::oid[])
       OR (n.nspname, c.relname) IN (SELECT * FROM unnest(%s::text[], %s::text[])))
ORDER BY c.oid, a.attnum
"""


def read_source_tables(
    conn: psycopg.Connection[Any],
    relids: Sequence[int] = (),
    tables: Sequence[TableName] = (),
) -> list[SourceTable]:
    """The source's tables of ``relids`` or named in ``tables``, every attribute of each."""
    rows = conn.execute(
        _SOURCE_TABLES,
        (list(relids), [t.schema for t in tables], [t.name for t in tables]),
    ).fetchall()
    grouped: dict[int, tuple[TableName, int, list[SourceColumn]]] = {}
    for relid, schema, rel, filenode, attnum, name, oid, typmod, type_sql, *rest in rows:
        not_null, dropped, generated, default_sql, has_missing, missing, is_array = rest
        entry = grouped.setdefault(int(relid), (TableName(schema, rel), int(filenode), []))
        entry[2].append(
            SourceColumn(
                int(attnum),
                name,
                int(oid),
                int(typmod),
                type_sql,
                bool(not_null),
                bool(dropped),
                bool(generated),
                default_sql,
                bool(has_missing),
                missing,
                bool(is_array),
            )
        )
    return [SourceTable(r, t, f, tuple(cols)) for r, (t, f, cols) in grouped.items()]


# -- the record on the target --------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """What the target knows of a table's source: its oid and ``relfilenode`` when recorded,
    and each target column's attnum on the source (``kept``: dropped there, kept here)."""

    table: TableName
    relid: int
    relfilenode: int
    attnums: Mapping[str, int]
    kept: Mapping[str, int] = field(default_factory=dict)


def ensure_record_table(conn: psycopg.Connection[Any]) -> None:
    """Create ``pgcdc_ddl.source_columns`` if it is not there (in the caller's transaction)."""
    if records_table_exists(conn, RECORD_TABLE):
        return
    ensure_records_schema(conn)
    conn.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (schema_name text NOT NULL, table_name text NOT NULL, "
            "relid oid NOT NULL, relfilenode oid NOT NULL, attnums jsonb NOT NULL, "
            "kept jsonb NOT NULL DEFAULT '{{}}', PRIMARY KEY (schema_name, table_name))"
        ).format(RECORD)
    )


def read_records(
    conn: psycopg.Connection[Any], tables: Sequence[TableName]
) -> dict[TableName, Record]:
    """The recorded tables among ``tables`` (a table copied before records were kept is
    absent)."""
    if not tables:
        return {}
    where = sql.SQL("(schema_name, table_name) IN (SELECT * FROM unnest(%s::text[], %s::text[]))")
    found = _records(conn, where, ([t.schema for t in tables], [t.name for t in tables]))
    return {r.table: r for r in found}


def records_by_relid(conn: psycopg.Connection[Any], relids: Sequence[int]) -> dict[int, Record]:
    """The records of the source tables ``relids``, whatever the target's tables are named."""
    if not relids:
        return {}  # the apply's usual case: every table of the range is recorded
    found = _records(conn, sql.SQL("relid = ANY(%s::oid[])"), (list(relids),))
    return {r.relid: r for r in found}


def _records(
    conn: psycopg.Connection[Any], where: sql.Composable, params: tuple[Any, ...]
) -> list[Record]:
    """The records ``where`` selects (none before the first copy made the table). Outside a
    transaction (autocommit) the table is read at once, its absence told by the error (one
    round trip per range applied, not two); inside one, where an error would abort it, looked
    for first."""
    query = sql.SQL(
        "SELECT schema_name, table_name, relid::int8, relfilenode::int8, attnums, kept "
        "FROM {} WHERE {}"
    ).format(RECORD, where)
    if conn.autocommit and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        try:
            rows = conn.execute(query, params).fetchall()
        except psycopg.errors.UndefinedTable:
            return []
    elif not records_table_exists(conn, RECORD_TABLE):
        return []
    else:
        rows = conn.execute(query, params).fetchall()
    return [
        Record(TableName(schema, name), int(relid), int(node), dict(a), dict(k))
        for schema, name, relid, node, a, k in rows
    ]


def drop_records(conn: psycopg.Connection[Any]) -> None:
    """Remove the records from the target (the replication is finished: nothing follows the
    source's DDL any more), and their schema if nothing else is in it."""
    conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(RECORD))
    with contextlib.suppress(psycopg.errors.DependentObjectsStillExist), conn.transaction():
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {}").format(sql.Identifier(RECORDS_SCHEMA)))


def write_record(
    conn: psycopg.Connection[Any], record: Record, *, was: TableName | None = None
) -> None:
    """Upsert ``record`` (``was``: the table's former name, whose row it replaces)."""
    ensure_record_table(conn)
    if was is not None and was != record.table:
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE schema_name = %s AND table_name = %s").format(RECORD),
            (was.schema, was.name),
        )
    conn.execute(
        sql.SQL(
            "INSERT INTO {} VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (schema_name, table_name) "
            "DO UPDATE SET relid = EXCLUDED.relid, relfilenode = EXCLUDED.relfilenode, "
            "attnums = EXCLUDED.attnums, kept = EXCLUDED.kept"
        ).format(RECORD),
        (
            record.table.schema,
            record.table.name,
            record.relid,
            record.relfilenode,
            json.dumps(dict(record.attnums)),
            json.dumps(dict(record.kept)),
        ),
    )


def record_of(source: SourceTable, table: TableName | None = None) -> Record:
    """The record of a table as the source's catalog shows it now."""
    live = {c.name: c.attnum for c in source.columns if not c.dropped}
    return Record(table or source.table, source.relid, source.relfilenode, live)


def record_copied(
    src: psycopg.Connection[Any], tgt: psycopg.Connection[Any], tables: Sequence[TableName]
) -> None:
    """Record ``tables`` as the source's catalog shows them in ``src``'s snapshot (the one
    their rows are copied in), in ``tgt``'s transaction."""
    for source in read_source_tables(src, tables=tables):
        write_record(tgt, record_of(source))


# -- planning --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AddedColumn:
    name: str
    type_sql: str
    fill: str | None
    """The value existing rows get (``None``: NULL)."""
    not_null: bool
    default_sql: str | None
    """The source's default now, for the target's column (values always come from the
    stream; this is for people and for a cutover)."""


@dataclass
class TableChanges:
    """What one table's DDL comes to on the target, in the order it is carried out."""

    table: TableName
    record: Record
    renamed_from: TableName | None = None
    """The table's name on the target before the range (``ALTER TABLE ... RENAME TO`` or
    ``SET SCHEMA`` on the source, told by its oid)."""
    renames: list[tuple[str, str]] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    retypes: list[tuple[str, str]] = field(default_factory=list)
    adds: list[AddedColumn] = field(default_factory=list)

    @property
    def steps(self) -> list[str]:
        """One line per step, for the run's log and the range's metadata."""
        t = self.table
        out = [f"{t}: table renamed from {self.renamed_from}"] if self.renamed_from else []
        out += [f"{t}: column {a} renamed to {b}" for a, b in self.renames]
        out += [f"{t}: column {c} dropped (as on the source)" for c in self.drops]
        out += [f"{t}: column {c} kept (dropped on the source; PGCDC_DROPPED_COLUMNS=keep)"
                for c in self.kept]  # fmt: skip
        out += [f"{t}: column {c} widened to {ty}" for c, ty in self.retypes]
        for add in self.adds:
            rows = "NULL" if add.fill is None else f"{add.fill!r}"
            out.append(f"{t}: column {add.name} {add.type_sql} added, existing rows {rows}")
        return out

    def __bool__(self) -> bool:
        return bool(
            self.renamed_from
            or self.renames
            or self.drops
            or self.kept
            or self.retypes
            or self.adds
        )


def in_play(
    target_columns: Mapping[str, Any],
    relation: TableRelation,
    left_out: Sequence[str],
    kept: Sequence[str],
) -> list[str]:
    """The target's columns the stream writes, in the target's order: not generated, not left
    out by the publication's column list when the table was copied (unless the relation now
    sends it: a list widened since, which :func:`~..control.pipeline.tables_agreement` reports), not
    kept after a drop on the source."""
    skip = (set(left_out) - set(relation.names)) | set(kept)
    return [n for n, c in target_columns.items() if not c.generated and n not in skip]


def matches(relation: TableRelation, target_columns: Mapping[str, Any], columns: list[str]) -> bool:
    """Whether the range's relation is the target's shape: the same columns in the same order
    (two columns that swapped names show as another order) and types (built-in ones: a
    user-defined type's oid differs between clusters)."""
    if list(relation.names) != columns:
        return False
    for col in relation.columns:
        have = target_columns[col.name]
        builtin = col.type_oid < FIRST_USER_OID and have.type_oid < FIRST_USER_OID
        if builtin and (col.type_oid, col.typmod) != (have.type_oid, have.typmod):
            return False
    return True


FIRST_USER_OID = 16384
"""Type oids below this are built in and mean the same on every cluster of a major version."""

_INT_WIDTH = {21: 2, 23: 4, 20: 8}
_FLOAT_WIDTH = {700: 4, 701: 8}
_VARCHAR, _TEXT, _NUMERIC = 1043, 25, 1700


def widens(old_oid: int, old_mod: int, new_oid: int, new_mod: int) -> bool:
    """Whether every value of the old built-in type is a value of the new one, unchanged."""
    if old_oid in _INT_WIDTH and new_oid in _INT_WIDTH:
        return _INT_WIDTH[new_oid] > _INT_WIDTH[old_oid]
    if old_oid in _FLOAT_WIDTH and new_oid in _FLOAT_WIDTH:
        return _FLOAT_WIDTH[new_oid] > _FLOAT_WIDTH[old_oid]
    if old_oid == _VARCHAR and new_oid == _TEXT:
        return True
    if old_oid == new_oid == _VARCHAR:
        return new_mod == -1 or (old_mod != -1 and new_mod > old_mod)
    if old_oid == new_oid == _NUMERIC:
        if new_mod == -1:
            return True
        if old_mod == -1:
            return False
        (p1, s1), (p2, s2) = _numeric(old_mod), _numeric(new_mod)
        return s1 == s2 and p2 > p1
    return False


def _numeric(typmod: int) -> tuple[int, int]:
    return ((typmod - 4) >> 16) & 0xFFFF, (typmod - 4) & 0xFFFF


def plan_table(
    relation: TableRelation,
    target: Any,
    record: Record | None,
    source: SourceTable | None,
    left_out: Sequence[str],
    *,
    keep_dropped: bool,
) -> tuple[TableChanges, TableRelation]:
    """What ``relation`` (the range's latest, which no longer matches ``target``) comes to on
    the target, and the relation to compact the range with (older versions' columns under
    their new names, added columns' fills). Raises :class:`ResyncNeeded` for what cannot be
    followed, :class:`SchemaDriftError` for what needs a person (a column list narrowed)."""
    table = relation.table
    if source is None:
        raise ResyncNeeded({table: "it is no longer in the source's catalog as the range saw it"})
    live = source.live
    # The range's columns, as the source's catalog has them now. A column it no longer has
    # under that name and type means DDL after the range: what the range did is hidden.
    for col in relation.columns:
        now = live.get(col.name)
        if now is None or now.generated or (now.type_oid, now.typmod) != (col.type_oid, col.typmod):
            raise ResyncNeeded(
                {table: f"its column {col.name} changed again on the source after this range"}
            )
    attnum_of = {c.name: live[c.name].attnum for c in relation.columns}
    numbers = list(attnum_of.values())
    if numbers != sorted(numbers):
        raise ResyncNeeded({table: "its columns were re-created on the source after this range"})
    kept = dict(record.kept) if record else {}
    columns = in_play(target.columns, relation, left_out, list(kept))
    # Each target column's attnum: recorded, or (no record) the live source column's by name.
    target_attnum: dict[str, int] = {}
    for name in columns:
        if record is not None and name in record.attnums:
            target_attnum[name] = record.attnums[name]
        elif name in live:
            target_attnum[name] = live[name].attnum
    by_number = {n: name for name, n in target_attnum.items()}
    changes = TableChanges(table, record_of(source, table))
    wanted = set(attnum_of.values())
    # Target columns no longer among the range's columns: dropped, or left out.
    for name in columns:
        number = target_attnum.get(name)
        if number is not None and number in wanted:
            continue
        now = source.by_attnum.get(number) if number is not None else None
        if now is not None and not now.dropped:
            raise SchemaDriftError(
                f"column {name} of table {table} is still on the source but the publication no "
                "longer sends it (its column list lists fewer columns): add it back to the "
                f"list (ALTER PUBLICATION ... SET TABLE {table} (...)), or resync the table "
                f"with the new list (pgcdc resync {table}); nothing of the range was applied"
            )
        if number is None and any(attnum_of[c] not in by_number for c in relation.names):
            raise ResyncNeeded(
                {table: f"column {name} is gone and columns were added, and which is a rename "
                 "of which is not recorded (the table was copied by an older version)"}
            )  # fmt: skip
        (changes.kept if keep_dropped else changes.drops).append(name)
    # The range's columns: renamed, retyped or added.
    for col in relation.columns:
        number = attnum_of[col.name]
        had = by_number.get(number)
        if had is not None and had != col.name:
            changes.renames.append((had, col.name))
        if had is not None:
            have = target.columns[had]
            same = (col.type_oid, col.typmod) == (have.type_oid, have.typmod)
            if not same and col.type_oid < FIRST_USER_OID and have.type_oid < FIRST_USER_OID:
                if not widens(have.type_oid, have.typmod, col.type_oid, col.typmod):
                    raise ResyncNeeded(
                        {table: f"column {col.name} changed type from {have.type_sql} to "
                         f"{live[col.name].type_sql}, which not every value survives"}
                    )  # fmt: skip
                changes.retypes.append((col.name, live[col.name].type_sql))
            continue
        now = live[col.name]
        if now.has_missing:
            if now.missing_text is None or now.is_array:
                raise ResyncNeeded({table: f"the value of added column {col.name} in its "
                                    "existing rows cannot be read back"})  # fmt: skip
            fill: str | None = now.missing_text
        elif record is not None and record.relfilenode == source.relfilenode:
            fill = None
        else:
            raise ResyncNeeded(
                {table: f"column {col.name} was added and the table was rewritten since it was "
                 "copied (a volatile default, a type change, VACUUM FULL, CLUSTER or TRUNCATE), "
                 "so the value its existing rows got is not known"}
            )  # fmt: skip
        changes.adds.append(
            AddedColumn(col.name, now.type_sql, fill, now.not_null, now.default_sql)
        )
    # A rewrite the record has not seen may hide behind the catalog's relfilenode now (a later
    # DDL's): only the recorded one tells that nothing was rewritten since the copy.
    changes.record = replace(
        changes.record,
        relfilenode=record.relfilenode if record else 0,
        kept={**kept, **{n: target_attnum.get(n, 0) for n in changes.kept}},
    )
    return changes, _read_as_now(relation, target_attnum, live, attnum_of, changes)


def _read_as_now(
    relation: TableRelation,
    target_attnum: Mapping[str, int],
    live: Mapping[str, SourceColumn],
    attnum_of: Mapping[str, int],
    changes: TableChanges,
) -> TableRelation:
    """``relation`` with each version's columns read by attnum, so a renamed column's older
    values land under its new name and a dropped column's nowhere; and the added columns'
    fills.

    A version lists its columns in attnum order under the names they had then. The first
    versions are read with the target's names (what the record knows), and once that no longer
    fits (an attnum twice, or out of order) with the source's current names; a version that
    fits neither is a run of DDL within one range this cannot untangle: a resync."""
    fills = {a.name: a.fill for a in changes.adds}
    if not changes.renames and not changes.drops and not changes.kept:
        return replace(relation, fills=fills) if fills else relation
    latest = set(relation.names)
    name_of = {n: c for c, n in attnum_of.items()}
    now_number = {name: col.attnum for name, col in live.items()}
    versions = {}
    as_now = False
    for version in sorted(relation.versions):
        names, keys = relation.versions[version]
        numbers = None
        if not as_now:
            numbers = _numbered(names, lambda n: target_attnum.get(n, now_number.get(n)))
        if numbers is None:
            as_now = True
            numbers = _numbered(names, now_number.get)
        if numbers is None:
            raise ResyncNeeded(
                {relation.table: "several column changes in one range cannot be told apart"}
            )
        mapping = {}
        for i, (name, number) in enumerate(zip(names, numbers, strict=True)):
            new = name_of.get(number) if number is not None else None
            mapping[name] = new if new in latest else f"\0gone{i}"
        versions[version] = (tuple(mapping[n] for n in names), tuple(mapping[n] for n in keys))
    return replace(relation, versions=versions, fills=fills)


def _numbered(names: Sequence[str], number: Any) -> list[int | None] | None:
    """Each name's attnum by ``number`` (``None``: a column gone since), or ``None`` when they
    are not strictly increasing: the names are not of that time."""
    numbers = [number(n) for n in names]
    known = [n for n in numbers if n is not None]
    if any(b <= a for a, b in itertools.pairwise(known)):
        return None
    return numbers


def plan_changes(
    conn_source: psycopg.Connection[Any],
    tgt: psycopg.Connection[Any],
    drifted: Mapping[TableName, tuple[TableRelation, Any]],
    unpublished: Mapping[TableName, Sequence[str]],
    records: Mapping[TableName, Record],
    moved: Mapping[TableName, TableName],
    *,
    keep_dropped: bool,
) -> tuple[dict[TableName, TableChanges], dict[TableName, TableRelation]]:
    """:func:`plan_table` for every drifted table (its relation and target table; ``moved``:
    the target's former name of a table renamed), one catalog read; every table that needs a
    resync in one :class:`ResyncNeeded`."""
    relids = [rel.relid for rel, _ in drifted.values() if rel.relid]
    named = [t for t, (rel, _) in drifted.items() if not rel.relid]
    sources = read_source_tables(conn_source, relids, named)
    by_relid = {s.relid: s for s in sources}
    by_name = {s.table: s for s in sources}
    plans: dict[TableName, TableChanges] = {}
    relations: dict[TableName, TableRelation] = {}
    reasons: dict[TableName, str] = {}
    for table, (rel, target) in drifted.items():
        source = by_relid.get(rel.relid) if rel.relid else by_name.get(table)
        try:
            plans[table], relations[table] = plan_table(
                rel,
                target,
                records.get(table),
                source,
                unpublished.get(table, ()),
                keep_dropped=keep_dropped,
            )
        except ResyncNeeded as need:
            reasons.update(need.reasons)
            continue
        plans[table].renamed_from = moved.get(table)
    if reasons:
        raise ResyncNeeded(reasons)
    return plans, relations


# -- carrying it out -------------------------------------------------------------------------


def carry_out(conn: psycopg.Connection[Any], changes: TableChanges) -> list[str]:
    """``changes``' DDL on the target and its record, in the caller's transaction; its
    steps, one line each."""
    t = changes.table.sql
    was = changes.renamed_from
    if was is not None:
        if was.schema != changes.table.schema:
            conn.execute(
                sql.SQL("ALTER TABLE {} SET SCHEMA {}").format(
                    was.sql, sql.Identifier(changes.table.schema)
                )
            )
        if was.name != changes.table.name:
            conn.execute(
                sql.SQL("ALTER TABLE {} RENAME TO {}").format(
                    TableName(changes.table.schema, was.name).sql,
                    sql.Identifier(changes.table.name),
                )
            )

    def alter(action: sql.Composable) -> None:
        conn.execute(sql.SQL("ALTER TABLE {} ").format(t) + action)

    # Renames through temporary names: two columns may swap theirs.
    for i, (old, _) in enumerate(changes.renames):
        alter(
            sql.SQL("RENAME COLUMN {} TO {}").format(
                sql.Identifier(old), sql.Identifier(f"pgcdc_rename_{i}")
            )
        )
    for i, (_, new) in enumerate(changes.renames):
        alter(
            sql.SQL("RENAME COLUMN {} TO {}").format(
                sql.Identifier(f"pgcdc_rename_{i}"), sql.Identifier(new)
            )
        )
    for name in changes.drops:
        alter(sql.SQL("DROP COLUMN {}").format(sql.Identifier(name)))
    for name in changes.kept:
        # Rows inserted from now on leave it empty: it may not refuse them.
        alter(sql.SQL("ALTER COLUMN {} DROP NOT NULL").format(sql.Identifier(name)))
    for name, type_sql in changes.retypes:
        alter(sql.SQL("ALTER COLUMN {} TYPE {}").format(sql.Identifier(name), sql.SQL(type_sql)))
    notes = []
    for add in changes.adds:
        column = sql.Identifier(add.name)
        fill = (
            sql.SQL(" DEFAULT {}::{}").format(sql.Literal(add.fill), sql.SQL(add.type_sql))
            if add.fill is not None
            else sql.SQL("")
        )
        alter(
            sql.SQL("ADD COLUMN {} {}{}{}").format(
                column,
                sql.SQL(add.type_sql),
                fill,
                sql.SQL(" NOT NULL") if add.not_null else sql.SQL(""),
            )
        )
        if add.default_sql is None:
            if add.fill is not None:
                alter(sql.SQL("ALTER COLUMN {} DROP DEFAULT").format(column))
            continue
        try:
            with conn.transaction():
                alter(
                    sql.SQL("ALTER COLUMN {} SET DEFAULT {}").format(
                        column, sql.SQL(add.default_sql)
                    )
                )
        except psycopg.Error as exc:
            reason = (exc.diag.message_primary or type(exc).__name__).strip()
            notes.append(
                f"{changes.table}: column {add.name}'s default {add.default_sql} not set on the "
                f"target ({reason}); its values still come from the source"
            )
            if add.fill is not None:
                alter(sql.SQL("ALTER COLUMN {} DROP DEFAULT").format(column))
    write_record(conn, changes.record, was=was)
    return changes.steps + notes


@dataclass(frozen=True)
class SourceDdl:
    """What an apply needs to follow the source's DDL: where the source's catalog is, and
    what to do with a column dropped there (``PGCDC_DROPPED_COLUMNS``)."""

    source_dsn: str = field(repr=False)
    keep_dropped: bool = False
    auto_add: bool = False
    """A table the stream sends that the target lacks is copied in (``PGCDC_AUTO_ADD``)."""


# -- what the change stream cannot show ---------------------------------------------------------

_TARGET_COLUMN_DEFAULTS = """
SELECT n.nspname, c.relname, a.attname, pg_get_expr(d.adbin, d.adrelid), a.attgenerated <> ''
FROM unnest(%s::text[], %s::text[]) AS want(nspname, relname)
JOIN pg_namespace n ON n.nspname = want.nspname
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = want.relname
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
LEFT JOIN pg_attrdef d ON d.adrelid = c.oid AND d.adnum = a.attnum
"""


def reconcile(
    src: psycopg.Connection[Any], tgt: psycopg.Connection[Any], tables: Sequence[TableName]
) -> tuple[list[str], dict[TableName, str]]:
    """What the source's DDL did that the change stream never shows, for ``tables``, carried
    out on the target (``tgt`` in autocommit; each step its own transaction), and the tables
    that must be copied again.

    The stream shows a table's columns only: names, types and order. It does not show a
    column's default (``ALTER COLUMN ... SET DEFAULT``), a generated column (pgoutput leaves
    them out), or a column dropped and added again under its name and type (the same
    Relation message). So the catalogs are compared, by attnum (the record's):

    * a default that differs is set on the target (values still come from the stream; this
      is for a cutover, whose application then inserts without them);
    * a ``GENERATED ... STORED`` column the target lacks is added with the source's
      expression (the target computes the same values from the replicated columns);
    * a recorded column whose attnum the source retired while a column of its name lives on
      under another one was dropped and added again: its values on the target are the old
      column's, so the table is copied again (returned, with the reason).

    A column whose attnum differs from the record otherwise belongs to DDL the stream has not
    brought yet: left to the apply that meets it."""
    records = read_records(tgt, tables)
    if not records:
        return [], {}
    sources = {s.relid: s for s in read_source_tables(src, [r.relid for r in records.values()])}
    names = list(records)
    on_target: dict[TableName, dict[str, tuple[str | None, bool]]] = {t: {} for t in names}
    for schema, rel, name, default, generated in tgt.execute(
        _TARGET_COLUMN_DEFAULTS, ([t.schema for t in names], [t.name for t in names])
    ).fetchall():
        on_target[TableName(schema, rel)][name] = (default, bool(generated))
    steps: list[str] = []
    resync: dict[TableName, str] = {}
    for table, record in records.items():
        source = sources.get(record.relid)
        have = on_target[table]
        if source is None or not have:
            continue  # dropped on the source (or on the target): not a shape to follow
        live, by_attnum = source.live, source.by_attnum
        again = [
            name
            for name, number in record.attnums.items()
            if name in have
            and (old := by_attnum.get(number)) is not None
            and old.dropped
            and name in live
            and live[name].attnum != number
        ]
        if again:
            resync[table] = (
                f"column(s) {', '.join(again)} were dropped and added again on the source, so "
                "their values on the target are the old columns'"
            )
            continue
        for name, col in live.items():
            try:
                step = _reconciled(tgt, table, record, col, have.get(name))
            except psycopg.Error as exc:
                if col.generated:  # data the target would lack: copied again with it
                    resync[table] = (
                        f"its generated column {name} cannot be added on the target "
                        f"({(exc.diag.message_primary or type(exc).__name__).strip()})"
                    )
                continue  # a default naming what the target lacks: tried again later
            if step is not None:
                steps.append(step)
    return steps, resync


def _reconciled(
    tgt: psycopg.Connection[Any],
    table: TableName,
    record: Record,
    col: SourceColumn,
    have: tuple[str | None, bool] | None,
) -> str | None:
    """One column's default or generation brought to the source's; the step, or ``None``.
    A :class:`psycopg.Error` when the target refuses it (it lacks a sequence or a function
    the expression names)."""
    column = sql.Identifier(col.name)
    statement: sql.Composable
    if have is None:
        if not col.generated or col.default_sql is None:
            return None  # a plain column the stream has not brought yet
        statement = sql.SQL(
            "ALTER TABLE {} ADD COLUMN {} {} GENERATED ALWAYS AS ({}) STORED"
        ).format(table.sql, column, sql.SQL(col.type_sql), sql.SQL(col.default_sql))
        step = f"{table}: generated column {col.name} added ({col.default_sql})"
    else:
        default, generated = have
        if generated or col.generated or record.attnums.get(col.name) != col.attnum:
            return None
        if default == col.default_sql:
            return None
        if col.default_sql is None:
            statement = sql.SQL("ALTER TABLE {} ALTER COLUMN {} DROP DEFAULT").format(
                table.sql, column
            )
        else:
            statement = sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET DEFAULT {}").format(
                table.sql, column, sql.SQL(col.default_sql)
            )
        step = f"{table}: column {col.name} default set to {col.default_sql or 'none'}"
    with tgt.transaction():
        tgt.execute(statement)
    return step
