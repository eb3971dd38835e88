"""What a base snapshot copied, recorded on the target in each copy's own transaction.

Every range a base snapshot copies (a ctid block range of a table or leaf partition, or a whole
table, :class:`~.common.TableRange`) inserts a row into ``pgcdc_ddl.copied_ranges`` in the same
target transaction as its ``COPY``, keyed by the slot and its consistent point. So the record
and the rows are one fact: a range is recorded if and only if its rows are on the target, even
when the process, its ``psql`` pair, a Spark executor or the target server dies anywhere. A
table is copied whole at that point when its recorded ranges tile every one of its relations
(each leaf of a partitioned table) from block 0 to the end (:func:`copied`): what a
killed snapshot resumes from (:mod:`.resume`).

What must hold: a range's record is written only by the transaction that copied it
(:func:`record_statement`, run by :mod:`.copy` after the ``COPY`` and before the commit), and
the primary key refuses a second record of one range, so a copy task Spark ran twice (an
executor lost between the commit and its report) fails instead of committing its rows twice.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..catalog import ensure_records_schema, records_table, records_table_exists
from ..connect import connect
from ..identifiers import TableName
from ..lsn import Lsn
from .common import CopyRecord, TableRange

NAME = "copied_ranges"
TABLE = records_table(NAME)


def ensure_table(conn: psycopg.Connection[Any]) -> None:
    """Create ``pgcdc_ddl.copied_ranges`` if it is not there (in the caller's transaction), with
    the ``filenode`` column a table an earlier release created lacks (its records then keep no
    partly copied table: :func:`copied`)."""
    ensure_records_schema(conn)
    conn.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} (slot text NOT NULL, consistent_point pg_lsn NOT NULL, "
            "schema_name text NOT NULL, table_name text NOT NULL, "
            "source_schema text NOT NULL, source_name text NOT NULL, "
            "start_block bigint NOT NULL, end_block bigint, rows bigint, filenode bigint, "
            "PRIMARY KEY (slot, consistent_point, schema_name, table_name, source_schema, "
            "source_name, start_block))"
        ).format(TABLE)
    )
    conn.execute(sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS filenode bigint").format(TABLE))


_ROWS_INSERTED = """
CASE WHEN current_setting('track_counts')::bool THEN
  (SELECT sum(pg_stat_get_xact_tuples_inserted(t.relid))::bigint
   FROM (SELECT {table}::regclass AS relid
         UNION SELECT p.relid FROM pg_partition_tree({table}::regclass) p WHERE p.isleaf) t)
END"""
"""The rows this transaction inserted into a table (into its leaves, when the target partitions
it), from the statistics' counters of the transaction itself: a range's rows, known to the
server and to no ``psql`` pair. ``NULL`` where the counters are off (``track_counts``). The
table itself is in the union because ``pg_partition_tree`` lists nothing for a table that is
not partitioned (its counter adds nothing for one that is: the rows are in its leaves)."""


def record_statement(record: CopyRecord, rng: TableRange, *, counted: bool = True) -> sql.Composed:
    """The insert that records ``rng`` as copied, for the copy's own target transaction, with
    its rows where ``counted``: not where the transaction writes the same table for another
    range too (a bundle of a partitioned table's leaves), whose counters add both up."""
    rows = (
        sql.SQL(_ROWS_INSERTED).format(table=sql.Literal(rng.table.sql.as_string(None)))
        if counted
        else sql.SQL("NULL")
    )
    return sql.SQL(
        "INSERT INTO {} (slot, consistent_point, schema_name, table_name, source_schema, "
        "source_name, start_block, end_block, rows, filenode) "
        "VALUES ({}, {}::pg_lsn, {}, {}, {}, {}, {}, {}, {}, {})"
    ).format(
        TABLE,
        sql.Literal(record.slot),
        sql.Literal(record.consistent_point),
        sql.Literal(rng.table.schema),
        sql.Literal(rng.table.name),
        sql.Literal(rng.source.schema),
        sql.Literal(rng.source.name),
        sql.Literal(rng.start_block or 0),
        sql.Literal(rng.end_block),
        rows,
        sql.Literal(rng.filenode),
    )


def _tiles(ranges: Sequence[tuple[int, int | None]]) -> bool:
    """Whether the block ranges cover ``[0, ∞)`` without a gap (they never overlap: one plan
    cut them, and the primary key holds one record a start)."""
    end: int | None = 0
    for start, stop in sorted(ranges):
        if end is None or start != end:
            return False
        end = stop
    return end is None


@dataclass(frozen=True)
class PartlyCopied:
    """A table (not partitioned) some of whose block ranges a killed snapshot copied: what a
    resume may keep of it (:mod:`.continued`)."""

    blocks: tuple[tuple[int, int | None], ...]
    """The block ranges copied, ``[start, end)`` (``None``: to the end), in order."""
    filenode: int
    """The relation's ``relfilenode`` when they were read (:attr:`~.common.TableRange.filenode`)."""
    rows: int | None
    """Their rows, as recorded (``None``: unknown)."""


@dataclass(frozen=True)
class Copied:
    """What a killed snapshot's records say it copied, table by table."""

    whole: dict[TableName, int | None]
    """Tables copied whole, each with its rows (``None`` where a range's count is unknown)."""
    partly: dict[TableName, PartlyCopied]
    """Tables copied in part, each read from one relation with one ``relfilenode``."""


def copied(
    conn: psycopg.Connection[Any],
    slot: str,
    consistent_point: Lsn,
    relations: Mapping[TableName, Sequence[TableName]],
) -> Copied:
    """Of ``relations`` (each target table with the source relations copied into it: itself,
    or each leaf of a partitioned table), those copied whole at ``consistent_point`` by the
    snapshot of ``slot``, and those copied in part from themselves alone (a partitioned table,
    or one whose ranges' file is not recorded, is not one)."""
    if not records_table_exists(conn, NAME):
        return Copied({}, {})
    ensure_table(conn)  # a table an earlier release created gains its filenode column
    records = conn.execute(
        sql.SQL(
            "SELECT schema_name, table_name, source_schema, source_name, start_block, end_block, "
            "rows, filenode FROM {} WHERE slot = %s AND consistent_point = %s::pg_lsn"
        ).format(TABLE),
        (slot, str(consistent_point)),
    ).fetchall()
    found: dict[tuple[TableName, TableName], list[tuple[int, int | None]]] = defaultdict(list)
    counted: dict[TableName, list[int | None]] = defaultdict(list)
    filenodes: dict[TableName, set[int | None]] = defaultdict(set)
    for schema, name, source_schema, source_name, start, end, rows, filenode in records:
        table = TableName(schema, name)
        found[(table, TableName(source_schema, source_name))].append((start, end))
        counted[table].append(rows)
        filenodes[table].add(filenode)

    def rows_of(table: TableName) -> int | None:
        return None if None in counted[table] else sum(int(n or 0) for n in counted[table])

    whole = {
        table: rows_of(table)
        for table, sources in relations.items()
        if sources and all(_tiles(found.get((table, s), [])) for s in sources)
    }
    partly: dict[TableName, PartlyCopied] = {}
    for table, sources in relations.items():
        nodes = filenodes[table]
        if table in whole or list(sources) != [table] or not found.get((table, table)):
            continue
        if len(nodes) == 1 and (node := next(iter(nodes))) is not None:
            partly[table] = PartlyCopied(tuple(sorted(found[(table, table)])), node, rows_of(table))
    return Copied(whole, partly)


def recorded(conn: psycopg.Connection[Any], slot: str, consistent_point: Lsn) -> bool:
    """Whether any range is recorded copied by the snapshot of ``slot`` at
    ``consistent_point``."""
    if not records_table_exists(conn, NAME):
        return False
    row = conn.execute(
        sql.SQL("SELECT FROM {} WHERE slot = %s AND consistent_point = %s::pg_lsn LIMIT 1").format(
            TABLE
        ),
        (slot, str(consistent_point)),
    ).fetchone()
    return row is not None


def forget(conn: psycopg.Connection[Any], slot: str) -> None:
    """Drop the records of ``slot``'s snapshots (in the caller's transaction), and the table
    once it holds none: a snapshot taken from scratch keeps nothing of an earlier one's, and a
    finished one needs them no more."""
    if records_table_exists(conn, NAME):
        conn.execute(sql.SQL("DELETE FROM {} WHERE slot = %s").format(TABLE), (slot,))
        if conn.execute(sql.SQL("SELECT FROM {} LIMIT 1").format(TABLE)).fetchone() is None:
            conn.execute(sql.SQL("DROP TABLE {}").format(TABLE))


def copied_some(target_dsn: str, slot: str, consistent_point: Lsn) -> bool:
    """Whether a snapshot of ``slot`` recorded some range copied at ``consistent_point``;
    ``False`` when the target cannot say."""
    try:
        with connect(target_dsn, role="target", autocommit=True) as tgt:
            return recorded(tgt, slot, consistent_point)
    except Exception:
        return False


def forget_all(target_dsn: str, slot: str) -> None:
    """A finished snapshot's records removed (:func:`forget`): nothing resumes it."""
    with connect(target_dsn, role="target") as tgt:
        forget(tgt, slot)
        tgt.commit()
