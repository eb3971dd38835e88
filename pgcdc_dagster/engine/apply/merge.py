"""The set-based merge: a range's net rows staged on the target and merged into its tables, in
the one apply transaction (:func:`apply_transaction`); a table whose net rows a unique key
refuses is applied again change by change, in commit order (:func:`replaying_refused`).

A table with a usable identity takes its collapsed net rows (what went deleted, what changed
updated, what is new inserted, new keys COPYed straight in where no key of the target can
refuse them); a table without one, or refused, takes its changes in commit order. The whole
apply, and what must hold, is described in :mod:`.transaction`.

Why one module: the staged table (:class:`_Staged`: its columns, flags and key) is the contract
between the staging and the two ways of merging it, collapsed and in commit order; the
refusal that sends a table from one to the other happens inside the one transaction
(:func:`apply_transaction`) this module owns.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import psycopg
import pyarrow as pa
import pyarrow.compute as pc
from psycopg import sql

from ..compaction import NetChanges, TableRelation
from ..errors import ApplyError, server_reason
from ..identifiers import TableName
from ..lsn import Lsn
from .origin import marked_commit
from .results import ApplyResult, TableApplyCounts
from .shared_staging import SharedStage
from .staging import (
    copy_into,
    copy_rows,
    create_stage,
    flag,
    inline_fits,
    inline_stage,
    typed_as,
)
from .target_tables import TargetTable

T = TypeVar("T")


def stage_all(
    conn: psycopg.Connection[Any],
    tables: Mapping[TableName, NetChanges],
    targets: Mapping[TableName, TargetTable],
) -> list[_Staged]:
    """Every table's net rows COPYed into temporary staging tables."""
    return [
        _stage(conn, i, net, targets[table])
        for i, (table, net) in enumerate(sorted(tables.items()))
    ]


def from_shared(
    shared: Mapping[TableName, SharedStage], targets: Mapping[TableName, TargetTable]
) -> list[_Staged]:
    """Tables staged in shared tables (by Spark's workers or partition by partition here,
    :mod:`.shared_staging`), as the merge reads them."""
    return [
        _Staged(
            stage.net_changes(),
            targets[table],
            upserts=stage.upserts,
            deletes=stage.deletes,
            ordered=stage.ordered,
            ordered_name=f"pgcdc_ord_{i}",
            keep=stage.keep,
            old_missing=stage.old_missing,
            has_origin=stage.has_origin,
            upsert_rows=stage.upsert_rows,
            new_rows=stage.new_rows,
            all_inserts=stage.all_inserts,
            net_rows=stage.net_rows,
        )
        for i, (table, stage) in enumerate(sorted(shared.items()))
    ]


def apply_staged(
    conn: psycopg.Connection[Any],
    staged: list[_Staged],
    result: ApplyResult,
    *,
    truncated_first: bool = False,
) -> None:
    """TRUNCATE what the range truncated (unless done before staging, ``truncated_first``),
    then apply table by table from the staged rows."""
    apply_started = time.perf_counter()
    for stage in staged:
        net = stage.net
        result.tables[str(net.relation.table)] = TableApplyCounts(
            changes=net.changes, net_rows=stage.net_rows, truncated=net.truncate
        )
    if not truncated_first:
        truncate_tables(
            conn,
            {s.net.relation.table: s.net.truncate_flags for s in staged if s.net.truncate},
        )
    for stage in staged:
        counts = result.tables[str(stage.net.relation.table)]
        with _writable(conn, stage):
            if stage.net.ordered:
                _apply_ordered(conn, stage, counts)
                continue
            try:
                _apply_collapsed(conn, stage, counts)
            except ApplyError as exc:
                if isinstance(exc.__cause__, _NET_ROW_CONFLICTS):
                    raise RefusedNetRows(stage.net.relation.table, exc) from exc
                raise
    result.apply_seconds = round(time.perf_counter() - apply_started, 4)


_PARTITION_WRITES = """
SELECT current_setting('track_counts')::bool,
       coalesce(sum(pg_stat_get_xact_tuples_inserted(p.relid)), 0),
       coalesce(sum(pg_stat_get_xact_tuples_updated(p.relid)), 0)
FROM pg_partition_tree(%s::regclass) AS p
WHERE p.isleaf
"""


def _partition_writes(conn: psycopg.Connection[Any], table: TableName) -> tuple[int, int] | None:
    """Rows inserted and updated in ``table``'s partitions so far by this transaction (the
    server's per-transaction counters), or ``None`` without them (``track_counts`` off).

    Why: an ``INSERT`` routed to a partition cannot return ``xmax`` ("cannot retrieve a system
    column in this context"), which tells an upsert's inserts from its updates elsewhere. The
    counters before and after the upsert tell them apart at almost no cost, where counting the
    staged keys already there first costs a large share of the upsert itself
    (``benchmarks/HISTORY.md``)."""
    row = conn.execute(_PARTITION_WRITES, (table.sql.as_string(conn),)).fetchone()
    assert row is not None
    tracked, inserted, updated = row
    return (int(inserted), int(updated)) if tracked else None


_NET_ROW_CONFLICTS = (psycopg.errors.UniqueViolation, psycopg.errors.ExclusionViolation)
"""What a table's net rows may meet that its changes in order would not: a unique or
exclusion key (other than the identity, which the upsert's ``ON CONFLICT`` names) holding a
value the net rows move from one row to another."""


class RefusedNetRows(Exception):
    """A table's net rows met :data:`_NET_ROW_CONFLICTS`; the transaction rolls back and
    :func:`replaying_refused` applies that table in commit order."""

    def __init__(self, table: TableName, error: ApplyError) -> None:
        super().__init__(str(error))
        self.table = table
        self.error = error


@dataclass
class ApplyTransaction:
    """What the body of :func:`apply_transaction` decides about its end."""

    progress: tuple[Lsn, dt.datetime] | None = None

    def mark(self, lsn: Lsn, commit_time: dt.datetime) -> None:
        """Let the COMMIT move the session's replication origin to ``lsn``
        (:func:`~.origin.marked_commit`: the mark is sent with the COMMIT, never before)."""
        self.progress = (lsn, commit_time)


@contextlib.contextmanager
def apply_transaction(
    conn: psycopg.Connection[Any], synchronous_commit: str | None = None
) -> Iterator[ApplyTransaction]:
    """The one transaction every apply runs its writes in: a range's, an add's batch of held
    back changes, the merge of what Spark's workers staged. The target's triggers and foreign
    keys stay quiet as for PostgreSQL's own apply (``session_replication_role = replica``,
    for this transaction only); the caller writes the rows and the DDL inside it, and marks
    the origin's progress (:meth:`ApplyTransaction.mark`), so a crash leaves all of them or
    none. ``conn`` is in autocommit: the transaction's BEGIN and COMMIT are ours, since the
    COMMIT of a marked transaction goes with the mark (:func:`~.origin.marked_commit`).

    ``synchronous_commit`` (``PGCDC_APPLY_SYNCHRONOUS_COMMIT``; ``None``: the server's): with
    ``off``, as PostgreSQL's own apply by default, the COMMIT returns before its WAL is on disk,
    so the rows are visible a disk flush sooner. A crash of the target loses the ranges applied
    in its last fraction of a second, rows and origin together (never one without the other),
    and they are applied again from the store: :func:`~.origin.read_progress` says what must
    hold of whoever reads the origin. Sent with the BEGIN, in one round trip."""
    if not conn.autocommit:
        raise ApplyError("the apply's target connection must be in autocommit mode")
    tx = ApplyTransaction()
    begin = sql.SQL("BEGIN; SET LOCAL session_replication_role = replica{}").format(
        sql.SQL("")
        if synchronous_commit is None
        else sql.SQL("; SET LOCAL synchronous_commit = {}").format(sql.Literal(synchronous_commit))
    )
    try:
        conn.execute(begin)
        yield tx
    except BaseException:
        if not (conn.closed or conn.broken):
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
        raise
    try:
        conn.execute(sql.SQL("COMMIT") if tx.progress is None else marked_commit(*tx.progress))
    except BaseException:
        if not (conn.closed or conn.broken):
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")
        raise


def replaying_refused(
    attempt: Callable[[], T],
    in_order: Container[TableName],
    take_in_order: Callable[[TableName], None],
) -> T:
    """``attempt()`` (one :func:`apply_transaction`), again each time a unique key of the
    target refused a table's net rows: the source's own order of statements passed every
    unique key, its net rows may not (a swap through a third value). The transaction rolled
    back whole; once per table, ``take_in_order`` has that table applied change by change, in
    commit order, by the next attempt. A table refused again (already ``in_order``) raises
    its error."""
    while True:
        try:
            return attempt()
        except RefusedNetRows as refused:
            if refused.table in in_order:
                raise refused.error from refused.error.__cause__
            take_in_order(refused.table)


@contextlib.contextmanager
def _writable(conn: psycopg.Connection[Any], stage: _Staged) -> Iterator[None]:
    """Let UPDATEs set ``GENERATED ALWAYS AS IDENTITY`` columns that are not identity keys.

    PostgreSQL only lets an UPDATE set such a column to DEFAULT (its own apply worker bypasses
    the check), so for the transaction the column becomes BY DEFAULT and then ALWAYS again:
    atomic with the rows, at the price of an ACCESS EXCLUSIVE lock on the table until COMMIT.
    Key columns never need it (they are matched, not set).
    """
    rel = stage.net.relation
    if stage.net.ordered:
        touched = stage.ordered is not None and not stage.all_inserts
        candidates = list(rel.names)
    else:
        touched = stage.upserts is not None
        candidates = [n for n in rel.names if n not in rel.identity]
    always = [n for n in candidates if stage.target.columns[n].identity_always] if touched else []

    def alter(kind: str) -> None:
        for name in always:
            conn.execute(
                sql.SQL("ALTER TABLE {} ALTER COLUMN {} SET GENERATED {}").format(
                    rel.table.sql, sql.Identifier(name), sql.SQL(kind)
                )
            )

    alter("BY DEFAULT")
    yield
    alter("ALWAYS")


@dataclass
class _Staged:
    net: NetChanges
    target: TargetTable
    upserts: sql.Composable | None = None
    """Where the merge reads the rows to upsert: a temporary table's name or, for few rows the
    merge only reads, an inline subquery (:func:`.staging.inline_stage`)."""
    deletes: sql.Composable | None = None
    ordered: sql.Identifier | None = None
    ordered_name: str = ""
    keep: list[int] = field(default_factory=list)
    """Positions of columns with a keep flag staged (``u<j>``)."""
    old_missing: list[int] = field(default_factory=list)
    has_origin: bool = False
    upsert_rows: int = 0
    new_rows: int = 0
    """Upserted rows of new keys (``n``, see :mod:`..compaction.kernel`) staged with their flag:
    inserted without an ``ON CONFLICT`` arbiter (0: every row goes through the upsert)."""
    all_inserts: bool = False
    net_rows: int = 0
    direct: pa.Table | None = None
    """An insert-only table's new rows in commit order, named as the target's columns: COPYed
    straight into the target when its turn comes (after the range's TRUNCATE)."""


def _stage(conn: psycopg.Connection[Any], i: int, net: NetChanges, target: TargetTable) -> _Staged:
    """COPY the table's net rows into temp tables typed like the target's columns (so the
    server parses each value once, in COPY, and the SQL needs no casts; dropped at COMMIT),
    or, when they are few and the merge only reads them, stage them inline in its statements
    (:func:`.staging.inline_stage`)."""
    stage = _Staged(net, target, net_rows=net.net.num_rows)
    rel = net.relation
    names = rel.names
    width = len(names)
    table = net.net
    if net.ordered:
        if table.num_rows == 0:
            return stage
        stage.all_inserts = bool(pc.all(pc.equal(table.column("op"), "I")).as_py())
        if stage.all_inserts:
            # The common case (a log table): new rows only, whose net rows are already in
            # commit order. One COPY into the target does what a staging COPY and an INSERT
            # ... SELECT from it did, at half the target's work.
            stage.direct = table.select([f"c{j}" for j in range(width)]).rename_columns(names)
            return stage
        stage.ordered_name = f"pgcdc_ord_{i}"
        stage.ordered = sql.Identifier(stage.ordered_name)
        stage.keep = _flagged(table, "u", width)
        stage.old_missing = _flagged(table, "m", width)
        cols = (
            [sql.SQL("0::int8 AS ord"), sql.SQL("''::text AS op")]
            + [typed_as(rel, j, f"o{j}") for j in range(width)]
            + [flag(f"m{j}") for j in stage.old_missing]
            + [typed_as(rel, j, f"c{j}") for j in range(width)]
            + [flag(f"u{j}") for j in stage.keep]
        )
        staged_names = (
            ["ord", "op"]
            + [f"o{j}" for j in range(width)]
            + [f"m{j}" for j in stage.old_missing]
            + [f"c{j}" for j in range(width)]
            + [f"u{j}" for j in stage.keep]
        )
        create_stage(conn, stage.ordered, rel.table, cols)
        copy_rows(conn, stage.ordered, table.select(staged_names), rel.table)
        return stage

    ident = rel.identity_positions
    deletes = net.deletes
    if deletes.num_rows:
        keys: list[tuple[str, int | None]] = [(f"k{j}", p) for j, p in enumerate(ident)]
        stage.deletes = _stage_rows(conn, f"pgcdc_del_{i}", deletes, keys, target, rel)
    upserts = net.upserts
    stage.upsert_rows = upserts.num_rows
    if upserts.num_rows:
        stage.keep = _flagged(upserts, "u", width)
        stage.has_origin = bool(ident) and upserts.column("f0").null_count < upserts.num_rows
        spec: list[tuple[str, int | None]] = [(f"c{j}", j) for j in range(width)]
        spec += [(f"u{j}", None) for j in stage.keep]
        if stage.has_origin:
            spec += [(f"f{j}", p) for j, p in enumerate(ident)]
        new_rows = int(pc.sum(upserts.column("n")).as_py() or 0)
        if new_rows >= NEW_ROWS_APART:
            stage.new_rows = new_rows
            spec.append(("n", None))
        rows = upserts.select([alias for alias, _ in spec])
        inline = not _fills_from_origin(stage)
        stage.upserts = _stage_rows(conn, f"pgcdc_up_{i}", rows, spec, target, rel, inline)
    return stage


def _stage_rows(
    conn: psycopg.Connection[Any],
    name: str,
    rows: pa.Table,
    spec: Sequence[tuple[str, int | None]],
    target: TargetTable,
    rel: TableRelation,
    inline: bool = True,
) -> sql.Composable:
    """Stage ``rows``, whose columns ``spec`` names with the position of the target column each
    is typed like (``None``: a boolean flag), and say where the merge reads them: inline when
    allowed and they are few (:func:`.staging.inline_stage`), else the temporary table
    ``name``."""
    if inline and inline_fits(rows):
        types = [
            _BOOLEAN if j is None else sql.SQL(target.columns[rel.names[j]].type_name_sql)
            for _, j in spec
        ]
        return inline_stage(rows, types)
    table = sql.Identifier(name)
    columns = [flag(alias) if j is None else typed_as(rel, j, alias) for alias, j in spec]
    create_stage(conn, table, rel.table, columns)
    copy_rows(conn, table, rows, rel.table)
    return table


_BOOLEAN = sql.SQL("boolean")


def _fills_from_origin(stage: _Staged) -> bool:
    """Moved rows have values the range did not send, which the merge first copies into the
    staged rows from their origin key (an UPDATE of the staging table: it must be one)."""
    return stage.has_origin and bool(stage.keep)


def _flagged(table: pa.Table, prefix: str, width: int) -> list[int]:
    """Positions whose boolean flag column is true in some row (only those are staged)."""
    return [j for j in range(width) if pc.any(table.column(f"{prefix}{j}")).as_py()]


def _run(
    conn: psycopg.Connection[Any], statement: sql.Composed | sql.SQL, what: str
) -> psycopg.Cursor[Any]:
    with _applying(conn, what):
        return conn.execute(statement)


@contextlib.contextmanager
def _applying(conn: psycopg.Connection[Any], what: str) -> Iterator[None]:
    """A statement that fails on the target names the table and the server's reason."""
    try:
        yield
    except psycopg.Error as exc:
        if conn.broken:
            raise  # the server went away, not the statement: the caller's server_errors says so
        raise ApplyError(f"applying {what} failed: {server_reason(exc)}") from exc


def truncate_tables(conn: psycopg.Connection[Any], tables: Mapping[TableName, int]) -> None:
    """TRUNCATE the tables a range truncated (with each one's last TRUNCATE's flags: RESTART
    IDENTITY if any asked for it; CASCADE never, see the module docstring)."""
    if not tables:
        return
    restart = any(flags & 2 for flags in tables.values())
    statement = sql.SQL("TRUNCATE {}{}").format(
        sql.SQL(", ").join(table.sql for table in tables),
        sql.SQL(" RESTART IDENTITY") if restart else sql.SQL(""),
    )
    _run(conn, statement, "the range's TRUNCATE")


NEW_ROWS_APART = 10_000
"""From this many rows of new keys on, a table's upsert inserts them apart, without an
``ON CONFLICT`` arbiter (much less of the target's work for a big insert:
``benchmarks/HISTORY.md``, big_transaction and "The apply's upserts"); below it, one statement
less is worth more."""


def insert_new(conn: psycopg.Connection[Any], stage: _Staged, what: str) -> bool:
    """INSERT the staged rows of new keys, in a savepoint; whether it went through. A target
    that has such a key after all (written by hand: a source key it lacked at the range's
    start) refuses it, and the upsert then takes every row, as it would have."""
    rel = stage.net.relation
    names = rel.names
    insert = sql.SQL(
        "INSERT INTO {t} ({cols}) OVERRIDING SYSTEM VALUE SELECT {vals} FROM {s} s "
        "WHERE s.n ORDER BY {order}"
    ).format(
        t=rel.table.sql,
        cols=sql.SQL(", ").join(sql.Identifier(n) for n in names),
        vals=sql.SQL(", ").join(
            sql.SQL("s.{}").format(sql.Identifier(f"c{j}")) for j in range(len(names))
        ),
        s=stage.upserts,
        order=sql.SQL(", ").join(
            sql.SQL("s.{}").format(sql.Identifier(f"c{p}")) for p in rel.identity_positions
        ),
    )
    try:
        with conn.transaction():
            _run(conn, insert, what)
    except ApplyError as exc:
        if isinstance(exc.__cause__, psycopg.errors.UniqueViolation):
            return False
        raise
    return True


def _apply_collapsed(
    conn: psycopg.Connection[Any], stage: _Staged, counts: TableApplyCounts
) -> None:
    """Moved rows' unsent values from their origin key, then DELETE, then upsert: deletes go
    first so that a key or unique value freed in the range can be taken again."""
    rel = stage.net.relation
    table = rel.table
    names = rel.names
    ident = rel.identity_positions
    what = f"the changes of table {table}"

    def col(j: int) -> sql.Identifier:
        return sql.Identifier(names[j])

    def staged(prefix: str, j: int) -> sql.Composable:
        return sql.SQL("s.{}").format(sql.Identifier(f"{prefix}{j}"))

    if stage.upserts is not None and _fills_from_origin(stage):
        # A moved row's values never sent in the range are those of the row it came from.
        sets = [
            sql.SQL("{c} = CASE WHEN {u} THEN o.{n} ELSE {c2} END").format(
                c=sql.Identifier(f"c{j}"), u=staged("u", j), n=col(j), c2=staged("c", j)
            )
            for j in stage.keep
        ]
        match = sql.SQL(" AND ").join(
            sql.SQL("o.{} = {}").format(col(p), staged("f", j)) for j, p in enumerate(ident)
        )
        _run(
            conn,
            sql.SQL("UPDATE {s} s SET {sets} FROM {t} o WHERE {m}").format(
                s=stage.upserts, sets=sql.SQL(", ").join(sets), t=table.sql, m=match
            ),
            what,
        )
        clear = sql.SQL(", ").join(
            sql.SQL("{} = false").format(sql.Identifier(f"u{j}")) for j in stage.keep
        )
        _run(
            conn,
            sql.SQL("UPDATE {} SET {} WHERE f0 IS NOT NULL").format(stage.upserts, clear),
            what,
        )

    if stage.deletes is not None:
        match = sql.SQL(" AND ").join(
            sql.SQL("t.{} = s.{}").format(col(p), sql.Identifier(f"k{j}"))
            for j, p in enumerate(ident)
        )
        deleted = _run(
            conn,
            sql.SQL("DELETE FROM {} t USING {} s WHERE {}").format(table.sql, stage.deletes, match),
            what,
        ).rowcount
        counts.deleted += deleted

    if stage.upserts is None:
        return
    keep_any = sql.SQL(" OR ").join(staged("u", j) for j in stage.keep)
    whole: list[sql.Composable] = [sql.SQL("NOT ({})").format(keep_any)] if stage.keep else []
    others = [j for j in range(len(names)) if j not in ident]
    partitioned = stage.target.partitioned
    before = _partition_writes(conn, table) if partitioned else None
    if stage.new_rows and insert_new(conn, stage, what):
        if before is None:
            counts.inserted += stage.new_rows
        whole.append(sql.SQL("NOT s.n"))
    full_rows = sql.SQL(" WHERE {}").format(sql.SQL(" AND ").join(whole)) if whole else sql.SQL("")
    on_conflict: sql.Composable
    if others:
        on_conflict = sql.SQL("DO UPDATE SET {}").format(
            sql.SQL(", ").join(sql.SQL("{c} = EXCLUDED.{c}").format(c=col(j)) for j in others)
        )
    else:
        on_conflict = sql.SQL("DO NOTHING")
    existing = 0
    if partitioned and before is None:
        # Without the transaction's write counts (track_counts off), the rows whose key is
        # there already are counted first: one more pass over the staged keys.
        there = sql.SQL("EXISTS (SELECT FROM {t} t WHERE {m})").format(
            t=table.sql,
            m=sql.SQL(" AND ").join(
                sql.SQL("t.{} = {}").format(col(p), staged("c", p)) for p in ident
            ),
        )
        (existing,) = _run(
            conn,
            sql.SQL("SELECT count(*) FROM {s} s WHERE {full}{there}").format(
                s=stage.upserts,
                full=sql.SQL("").join(sql.SQL("{} AND ").format(w) for w in whole),
                there=there,
            ),
            what,
        ).fetchone()  # type: ignore[misc]
    upsert = sql.SQL(
        "WITH written AS ("
        "INSERT INTO {t} AS t ({cols}) OVERRIDING SYSTEM VALUE "
        "SELECT {vals} FROM {s} s{where} ORDER BY {order} "
        "ON CONFLICT ({key}) {on_conflict} RETURNING {inserted} AS inserted) "
        "SELECT count(*) FILTER (WHERE inserted), count(*) FILTER (WHERE NOT inserted) "
        "FROM written"
    ).format(
        t=table.sql,
        cols=sql.SQL(", ").join(col(j) for j in range(len(names))),
        vals=sql.SQL(", ").join(staged("c", j) for j in range(len(names))),
        s=stage.upserts,
        where=full_rows,
        order=sql.SQL(", ").join(staged("c", p) for p in ident),
        key=sql.SQL(", ").join(col(p) for p in ident),
        on_conflict=on_conflict,
        inserted=sql.SQL("true" if partitioned else "(t.xmax = 0)"),
    )
    inserted, updated = _run(conn, upsert, what).fetchone()  # type: ignore[misc]
    if before is not None:
        after = _partition_writes(conn, table)
        assert after is not None
        inserted, updated = after[0] - before[0], after[1] - before[1]
    elif others:  # DO NOTHING returns no row for a key that was there: none is counted
        inserted, updated = int(inserted) - int(existing), int(updated) + int(existing)
    counts.inserted += int(inserted)
    counts.updated += int(updated)

    if stage.keep:
        # Rows with values not sent (unchanged TOAST): update in place, keeping those values.
        sets = []
        for j in others:
            if j in stage.keep:
                sets.append(
                    sql.SQL("{c} = CASE WHEN {u} THEN t.{c} ELSE {v} END").format(
                        c=col(j), u=staged("u", j), v=staged("c", j)
                    )
                )
            else:
                sets.append(sql.SQL("{} = {}").format(col(j), staged("c", j)))
        match = sql.SQL(" AND ").join(
            sql.SQL("t.{} = {}").format(col(p), staged("c", p)) for p in ident
        )
        if sets:
            cursor = _run(
                conn,
                sql.SQL("UPDATE {t} t SET {sets} FROM {s} s WHERE ({keep}) AND {m}").format(
                    t=table.sql,
                    sets=sql.SQL(", ").join(sets),
                    s=stage.upserts,
                    keep=keep_any,
                    m=match,
                ),
                what,
            )
            (wanted,) = conn.execute(
                sql.SQL("SELECT count(*) FROM {} s WHERE {}").format(stage.upserts, keep_any)
            ).fetchone()  # type: ignore[misc]
            counts.updated += cursor.rowcount
            counts.missing += int(wanted) - cursor.rowcount


def _apply_ordered(conn: psycopg.Connection[Any], stage: _Staged, counts: TableApplyCounts) -> None:
    """Changes of a table without identity, replayed in commit order. Each UPDATE or DELETE
    touches exactly one row equal to the old row (found first, then touched by its
    ``tableoid`` and ``ctid``), so duplicate rows stay duplicates, as on the source. The
    ``tableoid`` matters in a partitioned table, whose partitions each have a row at ``(0,1)``:
    by ``ctid`` alone, one DELETE would remove the row of every partition there. The
    function's variables are named ``pgcdc_*``: PL/pgSQL takes a bare name for its variable,
    so a user's column named like one (``c``, ``n``) would make the statements ambiguous."""
    rel, target = stage.net.relation, stage.target
    what = f"the changes of table {rel.table}"
    if stage.direct is not None:
        with _applying(conn, what):
            counts.inserted += copy_into(conn, rel.table.sql, stage.direct)
        return
    if stage.ordered is None:
        return
    names = rel.names
    cols = sql.SQL(", ").join(sql.Identifier(n) for n in names)

    def r(prefix: str, j: int) -> sql.Composable:
        return sql.SQL("pgcdc_r.{}").format(sql.Identifier(f"{prefix}{j}"))

    if stage.all_inserts:
        inserted = _run(
            conn,
            sql.SQL(
                "INSERT INTO {t} ({cols}) OVERRIDING SYSTEM VALUE SELECT {vals} FROM {s} "
                "ORDER BY ord"
            ).format(
                t=rel.table.sql,
                cols=cols,
                vals=sql.SQL(", ").join(sql.Identifier(f"c{j}") for j in range(len(names))),
                s=stage.ordered,
            ),
            what,
        ).rowcount
        counts.inserted += inserted
        return

    matches = []
    for j, name in enumerate(names):
        column = target.columns[name]
        if column.has_equality:
            test = sql.SQL("x.{} IS NOT DISTINCT FROM {}").format(sql.Identifier(name), r("o", j))
        else:  # json, point, ...: no equality operator; the text forms are what was sent
            test = sql.SQL("x.{}::text IS NOT DISTINCT FROM {}::text").format(
                sql.Identifier(name), r("o", j)
            )
        if j in stage.old_missing:
            test = sql.SQL("({} OR {})").format(r("m", j), test)
        matches.append(test)
    find = sql.SQL(
        "SELECT x.tableoid, x.ctid INTO pgcdc_o, pgcdc_c FROM {t} x WHERE {m} LIMIT 1;"
    ).format(t=rel.table.sql, m=sql.SQL(" AND ").join(matches))
    sets = []
    for j, name in enumerate(names):
        if j in stage.keep:
            sets.append(
                sql.SQL("{c} = CASE WHEN {u} THEN t.{c} ELSE {v} END").format(
                    c=sql.Identifier(name), u=r("u", j), v=r("c", j)
                )
            )
        else:
            sets.append(sql.SQL("{} = {}").format(sql.Identifier(name), r("c", j)))
    body = sql.SQL(
        """
DECLARE pgcdc_r record; pgcdc_n int8; pgcdc_ins int8 := 0; pgcdc_upd int8 := 0;
  pgcdc_del int8 := 0; pgcdc_miss int8 := 0; pgcdc_o oid; pgcdc_c tid;
BEGIN
  FOR pgcdc_r IN SELECT * FROM {s} ORDER BY ord LOOP
    IF pgcdc_r.op = 'I' THEN
      INSERT INTO {t} ({cols}) OVERRIDING SYSTEM VALUE VALUES ({vals});
      pgcdc_ins := pgcdc_ins + 1;
    ELSIF pgcdc_r.op = 'U' THEN
      {find}
      UPDATE {t} t SET {sets} WHERE t.tableoid = pgcdc_o AND t.ctid = pgcdc_c;
      GET DIAGNOSTICS pgcdc_n = ROW_COUNT;
      pgcdc_upd := pgcdc_upd + pgcdc_n; pgcdc_miss := pgcdc_miss + 1 - pgcdc_n;
    ELSIF pgcdc_r.op = 'D' THEN
      {find}
      DELETE FROM {t} t WHERE t.tableoid = pgcdc_o AND t.ctid = pgcdc_c;
      GET DIAGNOSTICS pgcdc_n = ROW_COUNT;
      pgcdc_del := pgcdc_del + pgcdc_n; pgcdc_miss := pgcdc_miss + 1 - pgcdc_n;
    END IF;
  END LOOP;
  RETURN ARRAY[pgcdc_ins, pgcdc_upd, pgcdc_del, pgcdc_miss];
END
"""
    ).format(
        s=stage.ordered,
        t=rel.table.sql,
        cols=cols,
        vals=sql.SQL(", ").join(r("c", j) for j in range(len(names))),
        sets=sql.SQL(", ").join(sets),
        find=find,
    )
    function = sql.Identifier("pg_temp", f"{stage.ordered_name}_fn")
    conn.execute(
        sql.SQL("CREATE FUNCTION {}() RETURNS int8[] LANGUAGE plpgsql AS {}").format(
            function, sql.Literal(body.as_string(conn))
        )
    )
    (totals,) = _run(conn, sql.SQL("SELECT {}()").format(function), what).fetchone()  # type: ignore[misc]
    conn.execute(sql.SQL("DROP FUNCTION {}()").format(function))
    counts.inserted += int(totals[0])
    counts.updated += int(totals[1])
    counts.deleted += int(totals[2])
    counts.missing += int(totals[3])
