"""Comparing a table chunk by chunk, on both sides, each in a snapshot given to it: which parts
of a table differ, not only whether it does.

A chunk of a table with a primary key is a range of its first key column (the leading column
of the key's index), cut on the source at about ``chunk_rows`` rows each
(``percentile_disc``); a text key is cut and compared in the "C" collation on both sides, so a
target with another collation puts every row in the same chunk. A table without a key is cut
by the first hex digits of each row's hash instead: the same rows fall in the same chunk on
both sides, though a chunk is then no key range.

Each side reads the table once (one sequential scan, whatever the chunk count) and gives per
chunk the row count and two sums of 60-bit pieces of each row's ``md5`` (over the row's text
in UTF-8 as :mod:`.verify` prints it): sums, so no sort and no memory per row, and the order
of the rows does not matter. Two chunks are equal when count and both sums are. Sums add up,
so a scan could be split further (ctid ranges, Spark tasks) and its parts added.

Where both servers hash text alike (:func:`same_text_hash`: one server encoding, and
``hashtextextended`` giving the same values, which it does between machines of one byte order
and hash algorithm), a keyed table's rows are hashed with it instead, with two seeds (two
64-bit sums): the md5 is most of the compare's cost, and this hash is far cheaper
(``benchmarks/recover.py``; ``benchmarks/HISTORY.md``, "The compare's row hash"). A table
without a key keeps the md5, whose hex digits cut it.

For a differing chunk of a keyed table, :func:`differing_keys` reads that chunk again on both
sides and names the keys whose row is missing, extra or changed.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from ..identifiers import TableName
from ..published_columns import row_filter_sql


@dataclass(frozen=True)
class ChunkPlan:
    """How one table is cut: by ``column`` at ``bounds`` (chunk ``i`` holds the values in
    ``[bounds[i-1], bounds[i])``, the first everything below ``bounds[0]``, the last everything
    from ``bounds[-1]`` on), or, without ``column``, by the first ``hex_digits`` of the row's
    hash."""

    table: TableName
    columns: tuple[str, ...]
    key: tuple[str, ...]
    column: str | None
    type_sql: str
    collatable: bool
    bounds: tuple[str, ...]
    hex_digits: int
    row_filter: str | None = None
    """The publication's filter: the source side reads only the rows it passes."""
    text_hash: bool = False
    """Rows hashed with ``hashtextextended`` rather than md5: a keyed table only (a keyless
    one is cut by its md5's digits), both servers hashing alike (see the module docstring)."""

    @property
    def chunks(self) -> int:
        return len(self.bounds) + 1 if self.column is not None else 16**self.hex_digits

    def describe(self, chunk: Any) -> str:
        """Where ``chunk`` lies: a key range, or the rows whose hash starts so."""
        if self.column is None:
            return f"rows whose md5 starts with {chunk!r}"
        index = int(chunk)
        low = self.bounds[index - 1] if index > 0 else None
        high = self.bounds[index] if index < len(self.bounds) else None
        if low is None and high is None:
            return f"all of {self.column}"
        if low is None:
            return f"{self.column} < {high!r}"
        if high is None:
            return f"{self.column} >= {low!r}"
        return f"{low!r} <= {self.column} < {high!r}"


Sums = dict[Any, tuple[int, int, int]]
"""Per chunk: rows and the two sums."""


_KEY = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod), a.attcollation <> 0
FROM pg_index i
CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, position)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = %s::regclass AND i.indisprimary
ORDER BY k.position
"""


INTEGER_TYPES = ("smallint", "integer", "bigint")


def primary_key(conn: psycopg.Connection[Any], table: TableName) -> tuple[tuple[str, ...], bool]:
    """``table``'s primary-key columns in the key's order (empty: it has none), and whether
    every one of them is an integer."""
    rows = conn.execute(_KEY, (table.sql.as_string(conn),)).fetchall()
    return tuple(str(r[0]) for r in rows), bool(rows) and all(r[1] in INTEGER_TYPES for r in rows)


_TEXT_HASH_PROBE = (
    "SELECT current_setting('server_encoding'), "
    "hashtextextended('pgcdc: 1 text hash probe', 0), "
    "hashtextextended('pgcdc: 1 text hash probe', 1)"
)


def same_text_hash(source: psycopg.Connection[Any], target: psycopg.Connection[Any]) -> bool:
    """Whether the two servers hash a row's text alike: the same server encoding (the same
    text is the same bytes) and the same ``hashtextextended`` of a probe (the same algorithm
    and byte order; PostgreSQL's hashes are not portable across those)."""
    return (
        source.execute(_TEXT_HASH_PROBE).fetchone() == target.execute(_TEXT_HASH_PROBE).fetchone()
    )


def plan_chunks(
    conn: psycopg.Connection[Any],
    table: TableName,
    columns: Sequence[str],
    chunk_rows: int,
    row_filter: str | None = None,
    *,
    text_hash: bool = False,
) -> ChunkPlan:
    """Cut ``table`` on the source, in ``conn``'s snapshot (see the module docstring).
    ``text_hash``: both servers hash text alike (:func:`same_text_hash`), so a keyed table's
    rows are hashed with ``hashtextextended``."""
    key = conn.execute(_KEY, (table.sql.as_string(conn),)).fetchall()
    estimate = conn.execute(
        "SELECT greatest(reltuples, 0)::bigint FROM pg_class WHERE oid = %s::regclass",
        (table.sql.as_string(conn),),
    ).fetchone()
    rows = int(estimate[0]) if estimate else 0
    pieces = max(1, math.ceil(rows / chunk_rows))
    if not key:
        digits = 0 if pieces <= 1 else min(4, max(1, math.ceil(math.log(pieces, 16))))
        return ChunkPlan(table, tuple(columns), (), None, "", False, (), digits, row_filter)
    column, type_sql, collatable = key[0]
    bounds: tuple[str, ...] = ()
    if pieces > 1:
        ordered = _ordered(sql.Identifier(column), bool(collatable))
        where = _where(row_filter)
        fractions = [i / pieces for i in range(1, pieces)]
        row = conn.execute(
            sql.SQL(
                "SELECT percentile_disc(%s::float8[]) WITHIN GROUP (ORDER BY {})::text[] FROM {}{}"
            ).format(ordered, rows_of(conn, table), where),
            (fractions,),
        ).fetchone()
        values = [v for v in (row[0] if row and row[0] else []) if v is not None]
        bounds = tuple(dict.fromkeys(values))  # ascending already; duplicates add no chunk
    return ChunkPlan(
        table,
        tuple(columns),
        tuple(k[0] for k in key),
        str(column),
        str(type_sql),
        bool(collatable),
        bounds,
        0,
        row_filter,
        text_hash,
    )


def rows_of(conn: psycopg.Connection[Any], table: TableName) -> sql.Composable:
    """``table``'s rows as its side holds them, for a ``FROM``: ``ONLY`` the table, since an
    inheritance child is a replicated table of its own; but a partitioned table holds no rows
    of its own (``ONLY`` would read none, and find every partitioned table equal), so it is
    read with its partitions. Asked of each side: the target may partition a table the source
    does not, or the other way."""
    row = conn.execute(
        "SELECT relkind FROM pg_class WHERE oid = %s::regclass", (table.sql.as_string(conn),)
    ).fetchone()
    return table.sql if row is not None and row[0] == "p" else sql.SQL("ONLY {}").format(table.sql)


def _ordered(column: sql.Composable, collatable: bool) -> sql.Composable:
    return sql.SQL('{} COLLATE "C"').format(column) if collatable else column


def _where(row_filter: str | None, within: sql.Composable | None = None) -> sql.Composable:
    conditions = [c for c in (row_filter_sql(row_filter) if row_filter else None, within) if c]
    if not conditions:
        return sql.SQL("")
    return sql.SQL(" WHERE ") + sql.SQL(" AND ").join(sql.SQL("({})").format(c) for c in conditions)


def _hashed(
    plan: ChunkPlan,
    relation: sql.Composable,
    *,
    source: bool,
    with_key: bool = False,
    within: sql.Composable | None = None,
) -> sql.Composed:
    """The table's rows as ``(h, chunk)``, ``h`` the md5 of the row's text, or ``(a, b,
    chunk)``, the two ``hashtextextended`` of it (:attr:`ChunkPlan.text_hash`); and ``k``, the
    key as text, ``with_key``. The source side only the rows the publication's filter passes;
    ``within``: only the rows that meet it (a chunk's :func:`chunk_filter`)."""
    row = sql.SQL("ROW({})").format(sql.SQL(", ").join(sql.Identifier(c) for c in plan.columns))
    key = (
        sql.SQL(", ROW({})::text AS k").format(
            sql.SQL(", ").join(sql.Identifier(c) for c in plan.key)
        )
        if with_key
        else sql.SQL("")
    )
    if plan.column is None:
        chunk: sql.Composable = sql.SQL("")
    elif not plan.bounds:
        chunk = sql.SQL(", 0 AS chunk")
    else:
        chunk = sql.SQL(", width_bucket({}, {}::text[]::{}[]) AS chunk").format(
            _ordered(sql.Identifier(plan.column), plan.collatable),
            sql.Literal(list(plan.bounds)),
            sql.SQL(plan.type_sql),
        )
    # OFFSET 0 keeps the subquery whole: pulled up into its reader, ``h`` would be computed
    # again for each use (the two sums, a keyless chunk), the md5 being most of the cost.
    hashed = (
        "SELECT hashtextextended(t, 0) AS a, hashtextextended(t, 1) AS b{key_out}, chunk "
        "FROM (SELECT {row}::text AS t{key}{chunk} FROM {table}{where} OFFSET 0) texts "
        "OFFSET 0"
        if plan.text_hash
        else "SELECT md5(convert_to({row}::text, 'UTF8')) AS h{key}{chunk} "
        "FROM {table}{where} OFFSET 0"
    )
    rows = sql.SQL(hashed).format(
        row=row,
        key=key,
        chunk=chunk,
        key_out=sql.SQL(", k" if with_key else ""),
        table=relation,
        where=_where(plan.row_filter if source else None, within),
    )
    if plan.column is not None:
        return rows
    # Without a key the chunk comes from the hash itself.
    return sql.SQL("SELECT *, substr(h, 1, {}) AS chunk FROM ({}) hashed").format(
        sql.Literal(plan.hex_digits), rows
    )


def chunk_filter(plan: ChunkPlan, chunk: Any) -> sql.Composable:
    """A condition on a row of ``plan``'s table that holds for the rows of ``chunk`` only, the
    same on either side (a session printing values as :mod:`.verify` sets it). A key chunk is
    a range of its column, so an index on it serves the repair's delete and copy of a chunk
    (a text key compared in the "C" collation uses an index only in that collation)."""
    if plan.column is None:
        row = sql.SQL("ROW({})").format(sql.SQL(", ").join(sql.Identifier(c) for c in plan.columns))
        return sql.SQL("substr(md5(convert_to({}::text, 'UTF8')), 1, {}) = {}").format(
            row, sql.Literal(plan.hex_digits), sql.Literal(chunk)
        )
    index = int(chunk)
    if not 0 <= index <= len(plan.bounds):
        return sql.SQL("false")
    column = _ordered(sql.Identifier(plan.column), plan.collatable)
    limits = []
    if index > 0:  # chunk i holds [bounds[i-1], bounds[i]), as width_bucket counts
        limits.append((">=", plan.bounds[index - 1]))
    if index < len(plan.bounds):
        limits.append(("<", plan.bounds[index]))
    if not limits:
        return sql.SQL("true")
    return sql.SQL(" AND ").join(
        sql.SQL("{} {} {}::{}").format(
            column, sql.SQL(op), sql.Literal(value), sql.SQL(plan.type_sql)
        )
        for op, value in limits
    )


@dataclass(frozen=True)
class ScanPart:
    """A block range of one side's table, ``[start, end)`` (``None``: unbounded), read by one
    query of the compare; ``bytes`` is its size, for progress."""

    start: int | None
    end: int | None
    bytes: int

    def within(self) -> sql.Composable | None:
        """The condition that keeps a row of this part (a TID range scan reads only it)."""
        limits = []
        if self.start is not None:
            limits.append(sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({self.start},0)")))
        if self.end is not None:
            limits.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({self.end},0)")))
        return sql.SQL(" AND ").join(limits) if limits else None


PART_BLOCKS = 16384
"""A side's table is read in parts of this many blocks (128 MiB of 8 KiB pages), one query each:
the compare can say how far it is, in bytes and time left, and spread a big table over every
worker. The sums of a chunk add up over the parts."""

_SIZES = """
SELECT c.relkind,
       CASE WHEN c.relkind = 'p'
            THEN (SELECT coalesce(sum(pg_relation_size(t.relid)), 0)
                  FROM pg_partition_tree(c.oid) t WHERE t.isleaf)
            ELSE pg_relation_size(c.oid) END,
       current_setting('block_size')::int
FROM pg_class c WHERE c.oid = %s::regclass
"""


def scan_parts(
    conn: psycopg.Connection[Any], table: TableName, blocks: int | None = None
) -> list[ScanPart]:
    """``table`` on ``conn``'s side cut into block ranges of ``blocks`` each (default
    :data:`PART_BLOCKS`), the last one open-ended (blocks added since hold no row the snapshot
    sees, but cost nothing to read). A partitioned table is one part: each partition has ctids
    of its own."""
    blocks = blocks or PART_BLOCKS
    row = conn.execute(_SIZES, (table.sql.as_string(conn),)).fetchone()
    if row is None:
        return [ScanPart(None, None, 0)]
    relkind, size, block = str(row[0]), int(row[1]), int(row[2])
    pages = math.ceil(size / block)
    if relkind != "r" or pages <= blocks:
        return [ScanPart(None, None, size)]
    return [
        ScanPart(
            start or None,
            start + blocks if start + blocks < pages else None,
            min(blocks, pages - start) * block,
        )
        for start in range(0, pages, blocks)
    ]


def add_sums(total: Sums, part: Sums) -> Sums:
    """``total`` with a part's sums added, chunk by chunk."""
    for chunk, (n, a, b) in part.items():
        m, x, y = total.get(chunk, (0, 0, 0))
        total[chunk] = (m + n, x + a, y + b)
    return total


def chunk_sums(
    conn: psycopg.Connection[Any],
    plan: ChunkPlan,
    *,
    source: bool,
    part: ScanPart | None = None,
) -> Sums:
    """Per chunk of ``plan``: rows and the two sums, read in ``conn``'s snapshot (one scan of
    the table, or of its ``part``)."""
    sums = (
        "coalesce(sum(a), 0), coalesce(sum(b), 0)"
        if plan.text_hash
        else "coalesce(sum(('x' || substr(h, 1, 15))::bit(60)::bigint), 0), "
        "coalesce(sum(('x' || substr(h, 16, 15))::bit(60)::bigint), 0)"
    )
    query = sql.SQL("SELECT chunk, count(*), {} FROM ({}) rows GROUP BY chunk").format(
        sql.SQL(sums),
        _hashed(
            plan,
            rows_of(conn, plan.table),
            source=source,
            within=None if part is None else part.within(),
        ),
    )
    return {chunk: (int(n), int(a), int(b)) for chunk, n, a, b in conn.execute(query).fetchall()}


def digest(sums: Sums) -> str:
    """One md5 over a side's chunks: equal sides, equal digests."""
    text = ";".join(f"{k}:{n}:{a}:{b}" for k, (n, a, b) in sorted(sums.items(), key=str))
    return hashlib.md5(text.encode()).hexdigest()


def differing_chunks(source: Sums, target: Sums) -> list[Any]:
    """The chunks whose rows or sums differ, in chunk order."""
    return sorted(
        (k for k in source.keys() | target.keys() if source.get(k) != target.get(k)), key=str
    )


@dataclass(frozen=True)
class KeyDifference:
    key: str
    """The row's primary key, as text (``(1,a)`` for a key of two columns)."""
    kind: str
    """``missing`` on the target, ``extra`` on the target, or ``changed``."""


def _chunk_rows(
    conn: psycopg.Connection[Any], plan: ChunkPlan, chunk: Any, *, source: bool
) -> dict[str, str]:
    row_hash = "a::text || ' ' || b::text" if plan.text_hash else "h"
    query = sql.SQL("SELECT k, {} FROM ({}) rows").format(
        sql.SQL(row_hash),
        _hashed(
            plan,
            rows_of(conn, plan.table),
            source=source,
            with_key=True,
            within=chunk_filter(plan, chunk),
        ),
    )
    return {str(k): str(h) for k, h in conn.execute(query).fetchall()}


def differing_keys(
    source: psycopg.Connection[Any],
    target: psycopg.Connection[Any],
    plan: ChunkPlan,
    chunk: Any,
    limit: int,
) -> list[KeyDifference]:
    """The keys of ``chunk`` whose rows differ (at most ``limit``), each side read in its
    connection's snapshot. A table without a key has none to name."""
    if not plan.key:
        return []
    ours, theirs = (
        _chunk_rows(source, plan, chunk, source=True),
        _chunk_rows(target, plan, chunk, source=False),
    )
    found: list[KeyDifference] = []
    for key in sorted(ours.keys() | theirs.keys()):
        if key not in theirs:
            found.append(KeyDifference(key, "missing"))
        elif key not in ours:
            found.append(KeyDifference(key, "extra"))
        elif ours[key] != theirs[key]:
            found.append(KeyDifference(key, "changed"))
        if len(found) >= limit:
            break
    return found
