"""A table a killed snapshot copied in part, continued as of a later point instead of copied
again whole.

A base snapshot killed while it copied a big table split into block ranges left some of them
on the target, read at its slot's consistent point ``C1``, and recorded with their relation's
``relfilenode`` (:mod:`.copied_ranges`). A resume (:mod:`.resume`) copies that table again
as a resync does, as of a temporary slot's point ``C2`` (:mod:`.added`), but keeps those
ranges: every row whose key a change in ``(C1, C2]`` touched is deleted from them on the
target, the other blocks are copied at ``C2``, and the rows under those keys that lie in the
kept blocks at ``C2`` are copied then too.

Why the table then holds exactly the source's rows at ``C2``:

* The kept ranges and the ones copied at ``C2`` tile the relation's blocks without overlap
  (:func:`gaps`), and the relation was not rewritten between ``C1`` and ``C2`` (the same
  ``relfilenode``: a ``VACUUM FULL``, a ``CLUSTER``, a ``TRUNCATE`` or a rewriting ``ALTER``
  gives a new one), so a row version keeps its block from ``C1`` to ``C2``.
* A key no transaction committed in ``(C1, C2]`` touched has the same row version at both
  points, in exactly one block: it was copied once, at ``C1`` or at ``C2``, and is the
  source's at ``C2``.
* Every other row the target holds at that moment (a version deleted or replaced after
  ``C1``, one inserted before ``C2`` into a block copied then, a version moved by an update
  from a block not yet copied into one copied, or the other way) belongs to a key such a
  transaction touched: an insert's, an update's old and new keys, a delete's. The slot still
  stands at ``C1`` (checked), so peeking it up to ``C2`` decodes every such transaction, as
  the publication sends it (an update leaving the row filter arrives as a delete): those keys,
  all of them, are deleted from the rows copied at ``C1`` before any other block is copied.
  The row the source holds under such a key at ``C2``, if any, lies in one block: in the
  other blocks it is copied with them; in the kept ones it is copied by its key, restricted
  to those blocks, in the same exported snapshot, filter and columns as the rest. So it is
  copied exactly once. The peek may decode a few transactions past ``C2``: a key touched
  only there is replaced needlessly, never wrongly.
* The target table has no key yet (it is built after this, as for any table copied); a
  duplicate left by a mistake here would fail that key's build, loudly. So the touched keys
  are deleted by a scan of the kept rows (which also sets their hint bits, which the key's
  build would otherwise do). Building the key on the kept rows first, to delete through it
  and maintain it during the rest of the copy, is no faster (``benchmarks/HISTORY.md``,
  snapshot_resume).

From ``C2`` on the table is a resynced table like any other
(:func:`~..control.pipeline.add_tables`): its changes committed up to ``C2`` are skipped,
those after applied.

What breaks the premise and gets the table copied whole again (named in one line): a new
``relfilenode``, columns that differ between the source at ``C2`` and the target (DDL since
``C1``), a table without a usable key (the key the stream identifies rows by: the primary key
or the replica identity index), a ``TRUNCATE`` of it in the window, a key value the stream
left out (an unchanged key stored out of line in TOAST), a slot not at ``C1``.

Crash anywhere: nothing of this is recorded; the table is in the resync that the chain
records (``Chain.resyncing``), and a resync that runs again copies it whole.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from psycopg import sql

from ..catalog import table_columns
from ..connect import connect
from ..decode.pgoutput import Delete, Insert, Relation, Truncate, TupleData, Update, decode
from ..errors import server_message
from ..identifiers import TableName
from ..lsn import Lsn
from ..published_columns import row_filter_sql
from .common import TableRange, resolve_oids, snapshot_transaction
from .copied_ranges import PartlyCopied
from .copy import plan_table_ranges

Blocks = tuple[int, int | None]
"""A block range ``[start, end)``; ``None``: to the relation's end."""


def gaps(kept: Sequence[Blocks]) -> list[Blocks]:
    """The block ranges of ``[0, ∞)`` that ``kept`` (ranges without overlap) leaves out."""
    left: list[Blocks] = []
    at = 0
    for start, end in sorted(kept):
        if start > at:
            left.append((at, start))
        if end is None:
            return left
        at = max(at, end)
    left.append((at, None))
    return left


def outside(rng: TableRange, kept: Sequence[Blocks]) -> list[TableRange]:
    """The parts of ``rng`` outside the ``kept`` blocks, each estimated at its share of
    ``rng``'s rows (the whole estimate for a part without an end: it only balances tasks)."""
    low, high = rng.start_block or 0, rng.end_block
    parts = []
    for start, end in gaps(kept):
        first = max(low, start)
        last = end if high is None else high if end is None else min(high, end)
        if last is not None and last <= first:
            continue
        share = 1.0 if high is None or last is None else (last - first) / max(1, high - low)
        parts.append(
            replace(
                rng,
                start_block=first or None,
                end_block=last,
                estimated_rows=int(rng.estimated_rows * share),
            )
        )
    return parts


@dataclass(frozen=True)
class Continuing:
    """What a resume asks of the resync that copies its other tables: these, partly copied at
    ``since`` by the snapshot of the chain's slot, are continued rather than copied again."""

    since: Lsn
    tables: Mapping[TableName, PartlyCopied]


@dataclass(frozen=True)
class KeyColumn:
    name: str
    type_sql: str


@dataclass
class Continuation:
    """The tables being continued at ``C2``, their touched keys held in a temporary table of
    ``conn`` (a target session of its own), and why the others are copied whole."""

    conn: psycopg.Connection[Any] | None
    kept: dict[TableName, PartlyCopied] = field(default_factory=dict)
    keys: dict[TableName, tuple[KeyColumn, ...]] = field(default_factory=dict)
    places: dict[TableName, int] = field(default_factory=dict)
    """Each kept table's number in the temporary table of touched keys."""
    changes: int = 0
    """The kept tables' changes since ``C1`` whose keys were collected."""
    read_seconds: float = 0.0
    """Time spent reading the touched keys from the slot."""
    replace_seconds: float = 0.0
    """Time spent deleting and copying again their rows."""
    whole: dict[TableName, str] = field(default_factory=dict)
    """Tables asked for that are copied whole, each with why, for the user."""

    def blocks(self) -> dict[TableName, tuple[Blocks, ...]]:
        """The blocks to leave out of each continued table's copy."""
        return {t: p.blocks for t, p in self.kept.items()}

    def lines(self, recopied: Mapping[TableName, int]) -> tuple[str, ...]:
        """What became of each table asked for, a line each, with the rows under touched
        keys copied again (``recopied``)."""
        said = [
            f"{t}: continued: the {len(p.blocks)} range(s) copied before kept "
            f"({'their' if p.rows is None else f'{p.rows:,}'} row(s)), the other blocks "
            f"copied, and the {recopied.get(t, 0):,} row(s) of keys changed in between copied "
            f"again (the keys read from the slot in {self.read_seconds:.1f} s, the rows of every "
            f"table continued replaced in {self.replace_seconds:.1f} s)"
            for t, p in self.kept.items()
        ]
        said += [f"{t}: copied whole again: {why}" for t, why in self.whole.items()]
        return tuple(said)


_KEY = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod)
FROM pg_class c
JOIN pg_index i ON i.indrelid = c.oid
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = ANY(i.indkey)
WHERE c.oid = %(relid)s AND i.indisvalid AND i.indisunique AND i.indpred IS NULL
  AND CASE c.relreplident WHEN 'i' THEN i.indisreplident
                          WHEN 'n' THEN false ELSE i.indisprimary END
ORDER BY array_position(i.indkey::int2[], a.attnum)
"""
"""The columns the stream identifies a row by: the replica identity index's, else the primary
key's (with ``REPLICA IDENTITY FULL`` the old row holds them too)."""

_RELATION = "SELECT relkind, relfilenode::int8 FROM pg_class WHERE oid = %s"

_PEEK = """
SELECT data
FROM pg_logical_slot_peek_binary_changes(
    %(slot)s, %(upto)s::pg_lsn, NULL,
    'proto_version', '1', 'publication_names', %(publication)s)
WHERE get_byte(data, 0) = 84  -- T: a TRUNCATE, which lists its tables after
   OR (get_byte(data, 0) IN (68, 73, 82, 85)  -- D, I, R, U: the relation's oid follows
       AND substring(data FROM 2 FOR 4) = ANY(%(relids)s::bytea[]))
"""
"""The slot's messages about the continued tables, up to ``upto``, peeked (the slot does not
move): filtered by the source, so only those cross the network."""


@contextlib.contextmanager
def continuation(
    source_dsn: str,
    target_dsn: str,
    slot: str,
    publication: str,
    continuing: Continuing | None,
    snapshot_name: str,
    point: Lsn,
) -> Iterator[Continuation]:
    """In the exported snapshot ``snapshot_name`` of the point ``point`` (``C2``): which of
    ``continuing``'s tables can be continued (module docstring), with the keys the slot's
    changes since ``continuing.since`` touched collected on the target. The caller calls
    :func:`delete_touched`, copies the tables' other blocks (:meth:`Continuation.blocks`),
    then calls :func:`copy_touched`; the others it copies whole."""
    if continuing is None or not continuing.tables:
        yield Continuation(None)
        return
    with connect(target_dsn, role="target", autocommit=True) as tgt:
        found = Continuation(tgt)
        relids = _checked(source_dsn, tgt, continuing, snapshot_name, found)
        if found.kept:
            why = _slot_moved(source_dsn, slot, continuing.since)
            if why is not None:
                found.whole.update({t: why for t in found.kept})
                found.kept.clear()
            else:
                started = time.monotonic()
                try:
                    _collect_touched(source_dsn, tgt, slot, publication, point, relids, found)
                except psycopg.Error as exc:  # e.g. the slot in use: the whole copy is sure
                    why = (
                        f"its changes since could not be read from the slot: {server_message(exc)}"
                    )
                    found.whole.update({t: why for t in found.kept})
                    found.kept.clear()
                found.read_seconds = time.monotonic() - started
        yield found


def _checked(
    source_dsn: str,
    tgt: psycopg.Connection[Any],
    continuing: Continuing,
    snapshot_name: str,
    found: Continuation,
) -> dict[int, TableName]:
    """Sort ``continuing``'s tables into ``found``'s kept and whole by what the source says at
    ``snapshot_name`` and the target now; the kept ones' source oids."""
    tables = list(continuing.tables)
    on_target = table_columns(tgt, tables)
    relids: dict[int, TableName] = {}
    with (
        connect(source_dsn, role="source", autocommit=True) as src,
        snapshot_transaction(src, snapshot_name),
    ):
        oids = resolve_oids(src, tables)
        on_source = table_columns(src, tables)
        for table, partly in continuing.tables.items():
            row = src.execute(_RELATION, (oids[table],)).fetchone()
            key = tuple(
                KeyColumn(n, t) for n, t in src.execute(_KEY, {"relid": oids[table]}).fetchall()
            )
            columns = [(c.name, c.type_sql) for c in on_source.get(table, [])]
            if row is None or row[0] != "r":
                found.whole[table] = "it is not a plain table"
            elif int(row[1]) != partly.filenode:
                found.whole[table] = "rewritten since: a new file (VACUUM FULL, CLUSTER, ...)"
            elif columns != [(c.name, c.type_sql) for c in on_target.get(table, [])]:
                found.whole[table] = "its columns changed since"
            elif not key:
                found.whole[table] = "it has no key to find the changed rows by"
            else:
                found.kept[table] = partly
                found.keys[table] = key
                relids[oids[table]] = table
    return relids


def _slot_moved(source_dsn: str, slot: str, since: Lsn) -> str | None:
    """Why the slot cannot give the changes since ``since``: it must stand exactly there."""
    with connect(source_dsn, role="source", autocommit=True) as src:
        row = src.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        ).fetchone()
    if row is None or row[0] is None or Lsn.parse(row[0]) != since:
        return f"the slot is not at {since}, where the ranges were copied"
    return None


def _collect_touched(
    source_dsn: str,
    tgt: psycopg.Connection[Any],
    slot: str,
    publication: str,
    point: Lsn,
    relids: dict[int, TableName],
    found: Continuation,
) -> None:
    """Peek the slot up to ``point`` and write every key its changes to the kept tables touch
    into a temporary table on ``tgt`` (the table's place in ``found.kept``, then the key's
    columns), as the messages stream: bounded memory. A table the stream truncates, or whose
    key a message leaves out, moves to the whole."""
    width = max(len(k) for k in found.keys.values())
    columns = sql.SQL(", ").join(_key_name(j) + sql.SQL(" text") for j in range(width))
    tgt.execute(
        sql.SQL("CREATE TEMPORARY TABLE {} (pgcdc_table int, {})").format(_TOUCHED, columns)
    )
    place = {table: i for i, table in enumerate(found.kept)}
    relations: dict[int, Relation] = {}
    params = {
        "slot": slot,
        "upto": str(point),
        "publication": publication,
        "relids": [oid.to_bytes(4, "big") for oid in relids],
    }
    with (
        tgt.cursor().copy(sql.SQL("COPY {} FROM STDIN").format(_TOUCHED)) as into,
        connect(source_dsn, role="source") as src,
        src.cursor(name="pgcdc_touched", binary=True) as cur,
    ):
        cur.itersize = 10_000
        cur.execute(_PEEK, params)
        for (data,) in cur:
            message = decode(bytes(data))
            if isinstance(message, Relation):
                relations[message.relid] = message
            elif isinstance(message, Truncate):
                for relid in message.relids:
                    if relid in relids and relids[relid] in found.kept:
                        _give_up(found, relids[relid], "it was truncated since")
            elif isinstance(message, (Insert, Update, Delete)):
                table = relids.get(message.relid)
                if table is None or table not in found.kept:
                    continue
                relation = relations.get(message.relid)
                keys = None if relation is None else _keys(message, relation, found.keys[table])
                if keys is None:
                    _give_up(found, table, "a change left its key out (TOAST)")
                    continue
                found.changes += 1
                for key in keys:
                    into.write_row((place[table], *key, *([None] * (width - len(key)))))
        src.commit()
    found.places = {t: place[t] for t in found.kept}


_TOUCHED = sql.Identifier("pgcdc_touched_keys")


def _key_name(j: int) -> sql.Identifier:
    return sql.Identifier(f"pgcdc_k{j}")


def _give_up(found: Continuation, table: TableName, why: str) -> None:
    """``table`` is copied whole: its keys are no longer collected."""
    found.kept.pop(table, None)
    found.keys.pop(table, None)
    found.whole[table] = why


def _keys(
    message: Insert | Update | Delete, relation: Relation, key: Sequence[KeyColumn]
) -> list[tuple[str, ...]] | None:
    """The keys ``message`` touches (an update's old and new), in text; ``None`` when one is
    not in it."""
    where = {c.name: i for i, c in enumerate(relation.columns)}
    if any(c.name not in where for c in key):
        return None
    indexes = [where[c.name] for c in key]

    def of(row: TupleData | None) -> tuple[str, ...] | None:
        if row is None or any(i in row.unchanged_toast for i in indexes):
            return None
        values = [row.values[i] for i in indexes]
        if any(v is None for v in values):
            return None
        return tuple(bytes(v).decode() for v in values if v is not None)

    if isinstance(message, Insert):
        new = of(message.new)
        return None if new is None else [new]
    if isinstance(message, Delete):
        old = of(message.old)
        return None if old is None else [old]
    old = of(message.old) if message.old is not None else None
    new = of(message.new)
    if new is None:
        new = old  # a key stored out of line and unchanged: the full old row holds it
    if new is None:
        return None
    return [new] if old is None or old == new else [old, new]


def _matches(key: Sequence[KeyColumn]) -> sql.Composable:
    """``t``'s key equal to ``k``'s text columns, each cast to its type."""
    return sql.SQL(" AND ").join(
        sql.SQL("t.{} = k.{}::{}").format(sql.Identifier(c.name), _key_name(j), sql.SQL(c.type_sql))
        for j, c in enumerate(key)
    )


def _distinct(found: Continuation, table: TableName) -> sql.Composed:
    """The touched keys of ``table``, each once."""
    names = sql.SQL(", ").join(_key_name(j) for j in range(len(found.keys[table])))
    return sql.SQL("SELECT DISTINCT {} FROM {} WHERE pgcdc_table = {}").format(
        names, _TOUCHED, sql.Literal(found.places[table])
    )


def delete_touched(found: Continuation) -> None:
    """Delete on the target every row of the continued tables under a touched key, in one
    transaction: before their other blocks are copied, so only rows copied at ``C1`` go (the
    versions those blocks hold at ``C2`` are then copied once, with them)."""
    if found.conn is None or not found.kept:
        return
    started = time.monotonic()
    with found.conn.transaction():
        for table in found.kept:
            found.conn.execute(
                sql.SQL("DELETE FROM ONLY {} AS t USING ({}) AS k WHERE {}").format(
                    table.sql, _distinct(found, table), _matches(found.keys[table])
                )
            )
    found.replace_seconds += time.monotonic() - started


def _in_blocks(blocks: Sequence[Blocks]) -> sql.Composable:
    """``t``'s row in one of ``blocks`` (neighbours joined first: one condition a run)."""
    runs: list[list[int | None]] = []
    for start, end in sorted(blocks):
        if runs and runs[-1][1] == start:
            runs[-1][1] = end
        else:
            runs.append([start, end])
    return sql.SQL(" OR ").join(
        sql.SQL("(t.ctid >= {}::tid{})").format(
            sql.Literal(f"({start},0)"),
            sql.SQL("")
            if end is None
            else sql.SQL(" AND t.ctid < {}::tid").format(sql.Literal(f"({end},0)")),
        )
        for start, end in runs
    )


def copy_touched(
    source_dsn: str,
    found: Continuation,
    snapshot_name: str,
    ranges: Mapping[TableName, TableRange],
    batch: int = 50_000,
) -> dict[TableName, int]:
    """Copy the source's rows under the continued tables' touched keys that lie in their kept
    blocks, in the exported snapshot ``snapshot_name`` (those in the other blocks came with
    them), with ``ranges``' columns and row filter (any range the table's copy was planned
    into), in one target transaction; the rows copied, per table. Each key is one probe of the
    source's key index; bounded memory: the keys are read back ``batch`` at a time."""
    copied: dict[TableName, int] = {}
    if found.conn is None or not found.kept:
        return copied
    started = time.monotonic()
    tgt = found.conn
    with (
        connect(source_dsn, role="source", autocommit=True) as src,
        snapshot_transaction(src, snapshot_name),
        tgt.transaction(),
    ):
        # A probe of the key's index per key: the planner, which sees a long array, would
        # otherwise read the whole table for each batch.
        src.execute("SET LOCAL enable_hashjoin = off")
        src.execute("SET LOCAL enable_mergejoin = off")
        for table in found.kept:
            key = found.keys[table]
            rng = ranges[table]
            conditions = [_in_blocks(found.kept[table].blocks)]
            if rng.row_filter is not None:
                conditions.append(row_filter_sql(rng.row_filter))
            select = sql.SQL(
                "COPY (SELECT {columns} FROM unnest({arrays}) AS k({names}) "
                "JOIN ONLY {table} AS t ON {matches} WHERE {conditions}) TO STDOUT "
                "(FORMAT binary)"
            ).format(
                columns=sql.SQL(", ").join(
                    sql.SQL("t.{}").format(sql.Identifier(c)) for c in rng.columns
                ),
                table=rng.source.sql,
                arrays=sql.SQL(", ").join(sql.SQL("%s::text[]") for _ in key),
                names=sql.SQL(", ").join(_key_name(j) for j in range(len(key))),
                matches=_matches(key),
                conditions=sql.SQL(" AND ").join(sql.SQL("({})").format(c) for c in conditions),
            )
            insert = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT binary)").format(
                table.sql, sql.SQL(", ").join(sql.Identifier(c) for c in rng.columns)
            )
            rows = 0
            with tgt.cursor(name=f"pgcdc_touched_{found.places[table]}") as keys:
                keys.execute(_distinct(found, table))
                while chunk := keys.fetchmany(batch):
                    arrays = [list(column) for column in zip(*chunk, strict=True)]
                    with src.cursor() as out_cur, tgt.cursor() as into_cur:
                        with out_cur.copy(select, arrays) as out, into_cur.copy(insert) as into:
                            for block in out:
                                into.write(block)
                        rows += max(0, into_cur.rowcount)
            copied[table] = rows
    found.replace_seconds += time.monotonic() - started
    return copied


def ranges_of(
    source_dsn: str,
    tables: Sequence[TableName],
    snapshot_name: str,
    shapes: Mapping[TableName, Any],
) -> dict[TableName, TableRange]:
    """One planned range of each table, for its columns and row filter as the copy reads them
    (:func:`~.copy.plan_table_ranges`: one place decides them)."""
    if not tables:
        return {}
    with connect(source_dsn, role="source", autocommit=True) as src:
        planned = plan_table_ranges(src, tables, snapshot_name, shapes=shapes)
    return {r.table: r for r in planned}
