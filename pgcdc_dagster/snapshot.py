"""The base snapshot: the initial copy of the replicated tables, consistent with the slot.

Modelled on pgcopydb's ``clone``; Spark schedules the data copy. The data flow::

    source                                                            target
    ──────                                                            ──────
    CREATE_REPLICATION_SLOT ... (SNAPSHOT 'export')  ─ slot S, snapshot X, consistent point C
      (replication connection kept idle: X stays importable)
    pg_dump --section=pre-data --snapshot=X ──► TOC filtered to what the tables
                                                need and the target lacks ──► psql (1 txn)
    plan: every table (or leaf partition) cut
          into ctid block ranges of ~N rows
    Spark task per range:                                             per range, one txn:
      BEGIN REPEATABLE READ READ ONLY;                                COPY t (cols) FROM STDIN
      SET TRANSACTION SNAPSHOT 'X';    COPY data, unparsed,  ──►        (FORMAT binary)
                                       in 128 KiB batches
      COPY (SELECT cols FROM t WHERE ctid range) TO STDOUT (binary)
    close the replication connection (X ends)
    pg_dump --section=post-data -t tables ──► filtered the same way ──► psql (indexes, keys)
                                                                      replication origin
                                                                      pgcdc_<slot> := C

Why this is consistent: every range is read in snapshot X, which holds exactly the
transactions that committed up to C, and the slot streams exactly those committing after C
(see :mod:`pgcdc_dagster.slot`). The target's replication origin is set to C, so apply starts
right after the copy. A range is one target transaction: a failed task leaves nothing behind and
Spark may retry it; a task Spark believes failed after its commit (executor lost between commit
and report) would duplicate its rows, which is why the orchestration refuses to copy into a
populated target and a failed copy needs ``resnapshot``.

Schema, decided: the pre-data dump is taken of the *schemas* the tables need (``pg_dump -n``,
plus ``-e`` for extensions), and its table of contents is then cut down to the dependency
closure of the tables, computed from ``pg_depend`` inside the snapshot: enum, domain, composite
and range types of the columns, functions of defaults and checks, sequences, collations, the
schemas, extensions owning a type (``CREATE EXTENSION IF NOT EXISTS``), and what those need in
turn; foreign keys do not pull in the tables they reference. Objects that already exist on the
target are left out, so pre-data and post-data create what is missing and never replace or alter
anything: a pre-created target schema is kept, and a re-snapshot into truncated tables works.
Foreign keys whose referenced table is not on the target are skipped (and reported). Comments,
ownership, privileges, tablespaces, security labels, publications and subscriptions are not
copied.

Throughput (2 cores, source, target and Spark on one machine, 1M rows, medians of 3): 1.2M
rows/s for pgbench_accounts and 0.87M rows/s for a table of bigint/text/numeric/timestamptz/
bool/jsonb, on par with ``psql -c 'COPY ... TO STDOUT' | psql -c 'COPY ... FROM STDIN'``.

Credentials: pg_dump and psql receive the connection through ``PG*`` environment variables,
never through their command line (visible in ``ps``), and their error output is redacted.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote

import psycopg
from psycopg import errors, pq, sql

from pgcdc_dagster.connect import (
    ConnectError,
    connect,
    describe_dsn,
    libpq_tool_environment,
    redact,
)
from pgcdc_dagster.identifiers import TableName
from pgcdc_dagster.lsn import Lsn
from pgcdc_dagster.pg_cluster import find_bindir

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "DEFAULT_ROWS_PER_TASK",
    "BaseSnapshotResult",
    "CopyTask",
    "RangeCopyResult",
    "SchemaRestoreResult",
    "SnapshotError",
    "TableCopyResult",
    "TableRange",
    "TargetNotEmptyError",
    "copy_range",
    "copy_schema_post_data",
    "copy_schema_pre_data",
    "copy_tables",
    "plan_table_ranges",
    "replication_origin_name",
    "snapshot_export_path",
    "sync_sequences",
    "take_base_snapshot",
]

DEFAULT_ROWS_PER_TASK = 500_000
"""About one to two seconds of COPY per task: big enough that task start-up (two connections, a
snapshot import) is noise, small enough that a large table spreads over every core."""

CopyFormat = Literal["binary", "text", "csv"]
SNAPSHOT_MANIFEST = "_SNAPSHOT.json"
EXPORT_FORMAT_VERSION = 1


class SnapshotError(RuntimeError):
    """The base snapshot could not be taken; the message names the object and the fix."""


class TargetNotEmptyError(SnapshotError):
    """The target already holds rows in tables the base snapshot would copy into."""


# ─── results ────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class TableRange:
    """One unit of copy work: the rows of ``source`` whose ctid lies in
    ``[start_block, end_block)`` (``None`` = unbounded), written into ``table`` on the target.

    ``source`` differs from ``table`` only for a leaf partition of a partitioned ``table``: ctids
    exist per leaf, and writing through the root lets the target route rows to its own
    partitions. The last range of a relation is always open-ended, so rows on pages added after
    planning (by a HOT chain, say) are never missed.
    """

    table: TableName
    source: TableName
    columns: tuple[str, ...]
    start_block: int | None
    end_block: int | None
    estimated_rows: int


@dataclass(frozen=True)
class CopyTask:
    """What a Spark task needs to copy one :class:`TableRange`: plain, picklable values only.

    The connection strings are excluded from ``repr`` so a task that ends up in a log or a
    Spark error message does not carry a password with it.
    """

    range: TableRange
    source_dsn: str = field(repr=False)
    target_dsn: str = field(repr=False)
    snapshot_name: str | None
    copy_format: CopyFormat = "binary"
    export_dir: str | None = None
    """When set, the rows are also written as Parquet into this folder (CSV is then the wire
    format, teed into the Parquet writer)."""
    column_types: tuple[str, ...] = ()


@dataclass(frozen=True)
class RangeCopyResult:
    """What one task copied. ``copy_format`` is the format that worked (after any fallback)."""

    table: TableName
    start_block: int | None
    rows: int
    bytes: int
    seconds: float
    copy_format: str
    parquet_file: str | None = None


@dataclass(frozen=True)
class TableCopyResult:
    """One table's copy: rows and wire bytes summed over its ranges; ``seconds`` is the sum of
    the task durations (busy time, not wall time: ranges run in parallel)."""

    table: TableName
    rows: int
    bytes: int
    seconds: float
    tasks: int = 1
    copy_formats: tuple[str, ...] = ()


@dataclass(frozen=True)
class SchemaRestoreResult:
    """What a schema section did on the target, by object identity (``pg_identify_object``)."""

    section: str
    created: tuple[str, ...]
    already_present: tuple[str, ...]
    skipped: tuple[str, ...]
    """Objects deliberately not created, with the reason (a foreign key to a missing table)."""
    seconds: float


@dataclass(frozen=True)
class BaseSnapshotResult:
    slot_name: str
    snapshot_name: str
    consistent_point: Lsn
    origin_name: str
    publication: str
    tables: tuple[TableCopyResult, ...]
    pre_data: SchemaRestoreResult
    post_data: SchemaRestoreResult
    sequences: dict[str, int]
    seconds: float
    copy_seconds: float
    export_path: str | None = None

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables)


def replication_origin_name(slot_name: str) -> str:
    """The target's replication origin that records how far the apply has got for ``slot_name``.

    The base snapshot creates it at the consistent point; the apply advances it with every
    transaction it commits, so it is the one durable answer to "what has been applied".
    """
    return f"pgcdc_{slot_name}"


def _run_tool(argv: Sequence[str], dsn: str, *, role: str, what: str) -> str:
    """Run a libpq tool against ``dsn``; its stdout, or :class:`SnapshotError` with redacted
    stderr."""
    try:
        env, extra = libpq_tool_environment(dsn)
    except ConnectError as exc:
        raise SnapshotError(str(exc)) from None
    done = subprocess.run(
        [*argv, *extra],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        message = redact(done.stderr.strip(), dsn) or f"exit status {done.returncode}"
        raise SnapshotError(f"{what} on the {role} {describe_dsn(dsn)} failed: {message}")
    return done.stdout


def _binary(name: str) -> str:
    """``pg_dump``/``pg_restore``/``psql`` of the server installation (the newest major on the
    machine, so it can dump every older server), else the one on the PATH."""
    with contextlib.suppress(Exception):
        candidate = find_bindir() / name
        if candidate.exists():
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise SnapshotError(
            f"{name} not found next to the PostgreSQL server binaries nor on the PATH: "
            "install the PostgreSQL client (apt-get install postgresql-client-15)"
        )
    return found


def _pattern(schema: str, name: str | None = None) -> str:
    """A pg_dump ``-t``/``-n`` pattern matching exactly this name: inside double quotes the
    pattern characters ``* ? .`` and regular-expression characters are literal."""
    parts = [schema] if name is None else [schema, name]
    return ".".join('"' + part.replace('"', '""') + '"' for part in parts)


# ─── snapshot transactions ───────────────────────────────────────────────────────────────────


@contextlib.contextmanager
def _snapshot_transaction(
    conn: psycopg.Connection[Any], snapshot_name: str | None
) -> Iterator[psycopg.Connection[Any]]:
    """A REPEATABLE READ READ ONLY transaction that sees ``snapshot_name`` (or, without one, a
    snapshot of its own). ``SET TRANSACTION SNAPSHOT`` must be the transaction's first statement,
    which is why this owns the BEGIN."""
    saved = (conn.isolation_level, conn.read_only)
    conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
    conn.read_only = True
    try:
        with conn.transaction():
            if snapshot_name is not None:
                try:
                    conn.execute(
                        sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(snapshot_name))
                    )
                except (errors.UndefinedObject, errors.InvalidParameterValue) as exc:
                    raise SnapshotError(
                        f"cannot import snapshot {snapshot_name}: "
                        f"{(exc.diag.message_primary or str(exc)).strip()}: the exporting "
                        "replication connection must stay open and idle until every copy "
                        "connection has imported it; take the base snapshot again"
                    ) from None
            yield conn
    finally:
        if not conn.closed:  # a failed COPY closes its connection (see _stream_copy_out)
            conn.isolation_level, conn.read_only = saved


# ─── schema: dependency closure and filtered pg_dump sections ─────────────────────────────────

_RESOLVE_TABLES = """
SELECT u.schema, u.name, c.oid, c.relkind
FROM unnest(%s::text[], %s::text[]) WITH ORDINALITY AS u(schema, name, position)
LEFT JOIN pg_namespace n ON n.nspname = u.schema
LEFT JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = u.name
ORDER BY u.position
"""

_CLOSURE = """
WITH RECURSIVE closure(classid, objid) AS (
    SELECT 'pg_class'::regclass::oid, t.oid FROM unnest(%s::oid[]) AS t(oid)
  UNION
    SELECT step.classid, step.objid
    FROM closure c
    CROSS JOIN LATERAL (
        -- what an object needs: its schema, types, functions, collations, owning extension,
        -- and the object it is an internal part of
        SELECT d.refclassid, d.refobjid FROM pg_depend d
        WHERE d.classid = c.classid AND d.objid = c.objid AND d.deptype IN ('n', 'i', 'e')
      UNION ALL
        -- what belongs to an object: its internal parts (row and array types, identity
        -- sequences, composite relations) and automatic members (defaults, check constraints,
        -- owned sequences, indexes, triggers); not foreign keys, which would drag in the tables
        -- they reference
        SELECT d.classid, d.objid FROM pg_depend d
        WHERE d.refclassid = c.classid AND d.refobjid = c.objid
          AND (d.deptype = 'i'
               OR (d.deptype = 'a' AND NOT EXISTS (
                   SELECT 1 FROM pg_constraint fk
                   WHERE d.classid = 'pg_constraint'::regclass AND fk.oid = d.objid
                     AND fk.contype = 'f')))
    ) AS step(classid, objid)
)
SELECT c.classid, c.objid,
       CASE WHEN c.classid = 'pg_namespace'::regclass
            THEN (SELECT nspname FROM pg_namespace WHERE oid = c.objid) END,
       CASE WHEN c.classid = 'pg_extension'::regclass
            THEN (SELECT extname FROM pg_extension WHERE oid = c.objid) END
FROM closure c
"""

_ADDRESSES = """
SELECT o.classid, o.objid, a.type, a.object_names, a.object_args, i.identity
FROM unnest(%s::oid[], %s::oid[]) AS o(classid, objid)
CROSS JOIN LATERAL pg_identify_object_as_address(o.classid, o.objid, 0) AS a
CROSS JOIN LATERAL pg_identify_object(o.classid, o.objid, 0) AS i
"""

_COMPANION_ENTRIES = """
SELECT s.oid, 'SEQUENCE OWNED BY ' || n.nspname || ' ' || s.relname || ' '
              || pg_get_userbyid(s.relowner), d.refobjid
FROM pg_class s
JOIN pg_namespace n ON n.oid = s.relnamespace
JOIN pg_depend d ON d.classid = 'pg_class'::regclass AND d.objid = s.oid
                 AND d.refclassid = 'pg_class'::regclass AND d.deptype = 'a'
WHERE s.relkind = 'S' AND s.oid = ANY(%(oids)s::oid[])
UNION ALL
SELECT p.oid, 'TABLE ATTACH ' || n.nspname || ' ' || p.relname || ' '
              || pg_get_userbyid(p.relowner), i.inhparent
FROM pg_class p
JOIN pg_namespace n ON n.oid = p.relnamespace
JOIN pg_inherits i ON i.inhrelid = p.oid
WHERE p.relispartition AND p.oid = ANY(%(oids)s::oid[])
"""
"""TOC entries pg_dump writes without a catalog id, in ``pg_restore --list`` form, for the
relation they complete (``SEQUENCE OWNED BY``, a partition's ``TABLE ATTACH``), each with the
relation it ties to (the owning table, the parent)."""

_FOREIGN_KEY_TARGETS = """
SELECT c.oid, c.confrelid, a.type, a.object_names, a.object_args, i.identity
FROM pg_constraint c
CROSS JOIN LATERAL pg_identify_object_as_address('pg_class'::regclass, c.confrelid, 0) AS a
CROSS JOIN LATERAL pg_identify_object('pg_class'::regclass, c.confrelid, 0) AS i
WHERE c.contype = 'f' AND c.oid = ANY(%s::oid[])
"""

_SYSTEM_SCHEMAS = frozenset({"pg_catalog", "pg_toast", "information_schema"})
_TOC_LINE = re.compile(r"^(\d+); (\d+) (\d+) (.*)$")


@dataclass(frozen=True)
class _TocEntry:
    line: str
    classid: int
    objid: int
    rest: str
    """Description, schema, name and owner, separated by spaces (ambiguous when names hold
    spaces: only ever compared against a string built the same way)."""


@dataclass(frozen=True)
class _Address:
    type: str
    names: list[str]
    args: list[str]
    identity: str


def _resolve_oids(
    conn: psycopg.Connection[Any], tables: Sequence[TableName]
) -> dict[TableName, int]:
    rows = conn.execute(
        _RESOLVE_TABLES, ([t.schema for t in tables], [t.name for t in tables])
    ).fetchall()
    missing = [str(TableName(s, n)) for s, n, oid, _ in rows if oid is None]
    if missing:
        raise SnapshotError(
            f"table(s) {', '.join(missing)} do not exist on the source: check the table list"
        )
    return {TableName(s, n): int(oid) for s, n, oid, _ in rows}


def _read_toc(archive: Path, dsn: str) -> list[_TocEntry]:
    listing = _run_tool(
        [_binary("pg_restore"), "--list", str(archive)],
        dsn,
        role="source",
        what="pg_restore --list",
    )
    entries = []
    for line in listing.splitlines():
        match = _TOC_LINE.match(line)
        if match:
            dump_id, classid, objid, rest = match.groups()
            del dump_id
            entries.append(_TocEntry(line, int(classid), int(objid), rest))
    return entries


def _addresses(
    conn: psycopg.Connection[Any], objects: Iterable[tuple[int, int]]
) -> dict[tuple[int, int], _Address]:
    keys = sorted(set(objects))
    rows = conn.execute(_ADDRESSES, ([k[0] for k in keys], [k[1] for k in keys])).fetchall()
    return {
        (int(c), int(o)): _Address(t, list(names or []), list(args or []), identity)
        for c, o, t, names, args, identity in rows
    }


def _present_on_target(conn: psycopg.Connection[Any], address: _Address) -> bool:
    """Whether the target has an object at the same address (same kind, same qualified name and
    argument types). Each probe runs in its own (sub)transaction: a missing object is an
    error, which must not abort the others."""
    try:
        with conn.transaction():
            conn.execute(
                "SELECT pg_get_object_address(%s, %s::text[], %s::text[])",
                (address.type, address.names, address.args),
            )
    except psycopg.Error as exc:
        state = exc.sqlstate or ""
        if state.startswith("42") or state == "3F000":  # undefined object / schema, bad name
            return False
        raise
    return True


def _dump_archive(
    source_dsn: str, archive: Path, section: str, snapshot_name: str | None, selection: list[str]
) -> None:
    argv = [
        _binary("pg_dump"),
        "--format=custom",
        "--schema-only",
        f"--section={section}",
        "--no-owner",
        "--no-privileges",
        "--no-publications",
        "--no-subscriptions",
        "--no-tablespaces",
        "--no-security-labels",
        "--no-comments",
        f"--file={archive}",
        *selection,
    ]
    if snapshot_name is not None:
        argv.append(f"--snapshot={snapshot_name}")
    _run_tool(argv, source_dsn, role="source", what=f"pg_dump --section={section}")


def _restore_entries(
    archive: Path, entries: Sequence[_TocEntry], source_dsn: str, target_dsn: str
) -> None:
    """Replay ``entries`` of ``archive`` on the target in one transaction (psql, because
    pg_restore's scripts may hold psql meta-commands such as ``\\restrict``)."""
    if not entries:
        return
    listfile = archive.with_suffix(".list")
    listfile.write_text("".join(entry.line + "\n" for entry in entries))
    script = archive.with_suffix(".sql")
    _run_tool(
        [
            _binary("pg_restore"),
            f"--use-list={listfile}",
            "--no-owner",
            "--no-privileges",
            "--no-tablespaces",
            "--no-security-labels",
            "--no-comments",
            "--no-publications",
            "--no-subscriptions",
            f"--file={script}",
            str(archive),
        ],
        source_dsn,
        role="source",
        what="pg_restore",
    )
    _run_tool(
        [
            _binary("psql"),
            "--no-psqlrc",
            "--quiet",
            "--set=ON_ERROR_STOP=1",
            "--single-transaction",
            f"--file={script}",
        ],
        target_dsn,
        role="target",
        what="psql (restoring the schema)",
    )


def copy_schema_pre_data(
    source_dsn: str,
    target_dsn: str,
    tables: Sequence[TableName],
    snapshot_name: str | None,
) -> SchemaRestoreResult:
    """Create on the target what the tables need before their rows arrive: schemas, types,
    functions, sequences and the tables themselves (with defaults and check constraints, not
    indexes or keys). Reads the source as of ``snapshot_name`` when given.

    Only the dependency closure of ``tables`` is created (see the module docstring), and only
    what the target lacks; a table that already exists is left exactly as it is.
    """
    started = time.perf_counter()
    with (
        connect(source_dsn, role="source", autocommit=True) as src,
        _snapshot_transaction(src, snapshot_name),
    ):
        oids = _resolve_oids(src, tables)
        closure_rows = src.execute(_CLOSURE, (list(oids.values()),)).fetchall()
        closure = {(int(c), int(o)) for c, o, _, _ in closure_rows}
        schemas = sorted({s for _, _, s, _ in closure_rows if s} - _SYSTEM_SCHEMAS)
        extensions = sorted({e for _, _, _, e in closure_rows if e} - {"plpgsql"})
        companion_rows = src.execute(
            _COMPANION_ENTRIES, {"oids": [o for c, o in closure if c == _PG_CLASS]}
        ).fetchall()
        with tempfile.TemporaryDirectory(prefix="pgcdc-predata-") as tmp:
            archive = Path(tmp) / "pre-data.dump"
            selection = [f"--schema={_pattern(s)}" for s in schemas]
            selection += [f"--extension={_pattern(e)}" for e in extensions]
            _dump_archive(source_dsn, archive, "pre-data", snapshot_name, selection)
            toc = _read_toc(archive, source_dsn)
            wanted = [e for e in toc if (e.classid, e.objid) in closure]
            addresses = _addresses(src, [(e.classid, e.objid) for e in wanted])
            with connect(target_dsn, role="target", autocommit=True) as tgt:
                created, present = _split_by_presence(tgt, wanted, addresses)
            kept_ids = {(e.classid, e.objid) for e in created}
            companions = {
                rest
                for oid, rest, tied_to in companion_rows
                if (_PG_CLASS, int(oid)) in kept_ids and (_PG_CLASS, int(tied_to)) in closure
            }
            selected = [
                e
                for e in toc
                if (e.classid, e.objid) in kept_ids or (e.classid == 0 and e.rest in companions)
            ]
            _restore_entries(archive, selected, source_dsn, target_dsn)
    return SchemaRestoreResult(
        section="pre-data",
        created=tuple(_identity(addresses, e) for e in created),
        already_present=tuple(_identity(addresses, e) for e in present),
        skipped=(),
        seconds=time.perf_counter() - started,
    )


_PG_CLASS = 1259  # the catalogs' own oids, fixed by initdb
_PG_CONSTRAINT = 2606


def _identity(addresses: dict[tuple[int, int], _Address], entry: _TocEntry) -> str:
    address = addresses.get((entry.classid, entry.objid))
    return address.identity if address is not None else entry.rest


def _split_by_presence(
    tgt: psycopg.Connection[Any],
    entries: Sequence[_TocEntry],
    addresses: dict[tuple[int, int], _Address],
) -> tuple[list[_TocEntry], list[_TocEntry]]:
    missing, present = [], []
    for entry in entries:
        address = addresses.get((entry.classid, entry.objid))
        if address is not None and _present_on_target(tgt, address):
            present.append(entry)
        else:
            missing.append(entry)
    return missing, present


def copy_schema_post_data(
    source_dsn: str,
    target_dsn: str,
    tables: Sequence[TableName],
    snapshot_name: str | None = None,
) -> SchemaRestoreResult:
    """Create the tables' indexes, primary/unique/exclusion keys, foreign keys, triggers, rules
    and policies on the target, once the rows are in (building an index once is far cheaper than
    maintaining it row by row).

    What already exists on the target is kept. A foreign key is created only when the table it
    references exists on the target; otherwise it is listed in ``skipped``. Trigger functions
    were created by pre-data (they are in the tables' dependency closure).
    """
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pgcdc-postdata-") as tmp:
        archive = Path(tmp) / "post-data.dump"
        selection = ["--strict-names", *(f"--table={_pattern(t.schema, t.name)}" for t in tables)]
        _dump_archive(source_dsn, archive, "post-data", snapshot_name, selection)
        toc = [e for e in _read_toc(archive, source_dsn) if e.classid != 0]
        with (
            connect(source_dsn, role="source", autocommit=True) as src,
            _snapshot_transaction(src, snapshot_name),
            connect(target_dsn, role="target", autocommit=True) as tgt,
        ):
            existing = {
                TableName(s, n)
                for s, n, oid, _ in tgt.execute(
                    _RESOLVE_TABLES, ([t.schema for t in tables], [t.name for t in tables])
                ).fetchall()
                if oid is not None
            }
            absent = [str(t) for t in tables if t not in existing]
            if absent:
                raise SnapshotError(
                    f"table(s) {', '.join(absent)} do not exist on the target, so their indexes "
                    "and keys cannot be created: run copy_schema_pre_data for them first"
                )
            addresses = _addresses(src, [(e.classid, e.objid) for e in toc])
            references = {
                int(oid): _Address(t, list(n or []), list(a or []), identity)
                for oid, _, t, n, a, identity in src.execute(
                    _FOREIGN_KEY_TARGETS, ([e.objid for e in toc if e.classid == _PG_CONSTRAINT],)
                ).fetchall()
            }
            missing, present = _split_by_presence(tgt, toc, addresses)
            selected, skipped = [], []
            for entry in missing:
                referenced = references.get(entry.objid)
                if referenced is not None and not _present_on_target(tgt, referenced):
                    identity = _identity(addresses, entry)
                    skipped.append(
                        f"{identity}: references {referenced.identity}, which is not on the "
                        "target (add it to the replicated tables to keep the foreign key)"
                    )
                else:
                    selected.append(entry)
        _restore_entries(archive, selected, source_dsn, target_dsn)
    return SchemaRestoreResult(
        section="post-data",
        created=tuple(_identity(addresses, e) for e in selected),
        already_present=tuple(_identity(addresses, e) for e in present),
        skipped=tuple(skipped),
        seconds=time.perf_counter() - started,
    )


# ─── planning ─────────────────────────────────────────────────────────────────────────────────

_RELATIONS = """
SELECT u.position, leaf.oid, ln.nspname, leaf.relname, leaf.relkind,
       leaf.relpages, leaf.reltuples,
       pg_relation_size(leaf.oid) / current_setting('block_size')::bigint,
       current_setting('block_size')::int
FROM unnest(%s::oid[]) WITH ORDINALITY AS u(root, position)
JOIN pg_class root ON root.oid = u.root
CROSS JOIN LATERAL (
    SELECT root.oid WHERE root.relkind <> 'p'
    UNION ALL
    SELECT t.relid FROM pg_partition_tree(root.oid) t WHERE t.isleaf AND root.relkind = 'p'
) AS l(oid)
JOIN pg_class leaf ON leaf.oid = l.oid
JOIN pg_namespace ln ON ln.oid = leaf.relnamespace
ORDER BY u.position, leaf.oid
"""

_COLUMNS = """
SELECT a.attrelid, a.attname, format_type(a.atttypid, a.atttypmod),
       coalesce(base.typname, t.typname), t.typlen
FROM pg_attribute a
JOIN pg_type t ON t.oid = a.atttypid
LEFT JOIN pg_type base ON base.oid = t.typbasetype  -- a domain is exported as its base type
WHERE a.attrelid = ANY(%s::oid[]) AND a.attnum > 0 AND NOT a.attisdropped
  AND a.attgenerated = ''
ORDER BY a.attrelid, a.attnum
"""

_ASSUMED_VARLENA_WIDTH = 32
_TUPLE_OVERHEAD = 24 + 4  # heap tuple header + line pointer


def plan_table_ranges(
    conn: psycopg.Connection[Any],
    tables: Sequence[TableName],
    snapshot_name: str | None,
    target_rows_per_task: int = DEFAULT_ROWS_PER_TASK,
) -> list[TableRange]:
    """Cut every table into ctid block ranges of about ``target_rows_per_task`` rows each.

    Rows per block come from the planner statistics (``reltuples / relpages``) and, for a table
    never analysed, from the column widths; the block count is the relation's current size.
    Estimates only decide the balance of the tasks, never which rows are copied: the ranges
    tile ``[0, ∞)`` without gap or overlap, so every row visible in the snapshot is copied once.
    A partitioned table is planned leaf by leaf. Generated columns are left out of ``columns``
    (the target computes them). ``conn`` must not be inside a transaction.
    """
    if target_rows_per_task < 1:
        raise ValueError("target_rows_per_task must be at least 1")
    with _snapshot_transaction(conn, snapshot_name):
        oids = _resolve_oids(conn, tables)
        relations = conn.execute(_RELATIONS, (list(oids.values()),)).fetchall()
        column_rows = conn.execute(_COLUMNS, (list(oids.values()),)).fetchall()
    columns: dict[int, list[tuple[str, str, str, int]]] = {}
    for relid, name, type_text, typname, typlen in column_rows:
        columns.setdefault(int(relid), []).append((name, type_text, typname, int(typlen)))
    roots = list(oids.items())
    ranges: list[TableRange] = []
    for position, _, schema, name, relkind, relpages, reltuples, blocks, block_size in relations:
        table, root_oid = roots[int(position) - 1]
        if relkind not in ("r", "m"):
            raise SnapshotError(
                f"{TableName(schema, name)} is a relation of kind {relkind!r}, not a table: "
                "only tables (and partitioned tables) can be copied"
            )
        cols = columns.get(root_oid, [])
        if reltuples > 0 and relpages > 0:
            rows_per_block = reltuples / relpages
        else:
            width = sum(t[3] if t[3] > 0 else _ASSUMED_VARLENA_WIDTH for t in cols)
            rows_per_block = max(1.0, 0.9 * block_size / (width + _TUPLE_OVERHEAD))
        estimated = int(blocks * rows_per_block)
        pieces = min(int(blocks), math.ceil(estimated / target_rows_per_task))
        source = TableName(schema, name)
        column_names = tuple(c[0] for c in cols)
        if pieces <= 1:
            ranges.append(TableRange(table, source, column_names, None, None, estimated))
            continue
        step = math.ceil(blocks / pieces)
        starts = list(range(0, int(blocks), step))
        for i, start in enumerate(starts):
            end = starts[i + 1] if i + 1 < len(starts) else None
            span = (end if end is not None else blocks) - start
            ranges.append(
                TableRange(
                    table,
                    source,
                    column_names,
                    start if i else None,
                    end,
                    int(span * rows_per_block),
                )
            )
    return ranges


# ─── the copy task (runs on Spark workers) ──────────────────────────────────────────────────


def _select_statement(task: CopyTask, copy_format: str) -> sql.Composed:
    rng = task.range
    columns = sql.SQL(", ").join(sql.Identifier(c) for c in rng.columns)
    conditions: list[sql.Composable] = []
    if rng.start_block is not None:
        conditions.append(sql.SQL("ctid >= {}::tid").format(sql.Literal(f"({rng.start_block},0)")))
    if rng.end_block is not None:
        conditions.append(sql.SQL("ctid < {}::tid").format(sql.Literal(f"({rng.end_block},0)")))
    where = sql.SQL(" WHERE ") + sql.SQL(" AND ").join(conditions) if conditions else sql.SQL("")
    return sql.SQL("COPY (SELECT {} FROM ONLY {}{}) TO STDOUT (FORMAT {})").format(
        columns, rng.source.sql, where, sql.SQL(copy_format)
    )


def _insert_statement(task: CopyTask, copy_format: str) -> sql.Composed:
    rng = task.range
    return sql.SQL("COPY {} ({}) FROM STDIN (FORMAT {})").format(
        rng.table.sql,
        sql.SQL(", ").join(sql.Identifier(c) for c in rng.columns),
        sql.SQL(copy_format),
    )


COPY_BATCH_BYTES = 128 * 1024
"""How much COPY data is gathered before one write to the target: PostgreSQL sends one message
per row, and handing each to the target separately costs more than the copy itself."""


def _stream_copy_out(
    conn: psycopg.Connection[Any], statement: sql.Composed, sink: Callable[[bytearray], None]
) -> int:
    """Run a ``COPY ... TO STDOUT`` and hand its data to ``sink`` in batches of about
    :data:`COPY_BATCH_BYTES`; returns the row count the server reports.

    This talks to libpq directly: psycopg's ``Copy`` reads one row message per Python-level
    call, which made a 1M-row range take 1.5 s where ``psql | psql`` takes 0.63 s; with blocking
    ``PQgetCopyData`` and batched writes it takes 0.65 s. If anything fails mid-stream the
    connection is closed, since it is stuck in COPY state and holds nothing worth keeping.
    """
    pgconn = conn.pgconn
    pgconn.send_query(statement.as_bytes(conn))
    first = pgconn.get_result()
    if first is None or first.status != pq.ExecStatus.COPY_OUT:
        while pgconn.get_result() is not None:
            pass
        if first is not None and first.status == pq.ExecStatus.FATAL_ERROR:
            raise errors.error_from_result(first, encoding=conn.info.encoding)
        raise SnapshotError(f"COPY TO STDOUT did not start a copy: {statement.as_string(conn)}")
    try:
        batch = bytearray()
        while True:
            size, data = pgconn.get_copy_data(0)
            if size < 0:
                break
            batch += data
            if len(batch) >= COPY_BATCH_BYTES:
                sink(batch)
                batch = bytearray()
        if batch:
            sink(batch)
    except BaseException:
        conn.close()
        raise
    rows = 0
    while (result := pgconn.get_result()) is not None:
        if result.status != pq.ExecStatus.COMMAND_OK:
            raise errors.error_from_result(result, encoding=conn.info.encoding)
        rows = int(result.command_tuples or 0)
    return rows


def _copy_once(task: CopyTask, copy_format: str) -> tuple[int, int, list[bytearray]]:
    """One attempt at a range: the source's COPY data goes to the target unparsed.

    Both sessions speak UTF8 so that text values cross unchanged whatever the two databases'
    encodings. The target session commits asynchronously: a crash loses the range, and a crash
    mid-snapshot means a new snapshot anyway.
    """
    kept: list[bytearray] = []
    nbytes = 0
    with (
        connect(task.source_dsn, role="source", client_encoding="UTF8") as src,
        connect(task.target_dsn, role="target", client_encoding="UTF8") as tgt,
    ):
        tgt.execute("SET synchronous_commit = off")
        with (
            _snapshot_transaction(src, task.snapshot_name),
            tgt.cursor().copy(_insert_statement(task, copy_format)) as inp,
        ):

            def forward(batch: bytearray) -> None:
                nonlocal nbytes
                inp.write(batch)
                nbytes += len(batch)
                if task.export_dir is not None:
                    kept.append(batch)

            rows = _stream_copy_out(src, _select_statement(task, copy_format), forward)
        tgt.commit()
    return rows, nbytes, kept


_BINARY_MISMATCH = (
    errors.UndefinedFunction,  # no binary send/receive function for a type
    errors.InvalidBinaryRepresentation,  # the target reads fewer bytes than were sent
    errors.ProtocolViolation,  # ... or more ("insufficient data left in message")
)


def copy_range(task: CopyTask) -> RangeCopyResult:
    """Copy one range in one target transaction; the function every Spark task runs.

    Binary COPY is tried first (no text conversion on either side); a type without binary
    input/output functions, or whose binary form the target reads differently, makes the range
    start over in text format. Nothing is committed on the target unless the whole range is.
    """
    started = time.perf_counter()
    if task.export_dir is not None:
        attempts: tuple[str, ...] = ("csv",)
    elif task.copy_format == "binary":
        attempts = ("binary", "text")
    else:
        attempts = (task.copy_format,)
    rows, nbytes, used = 0, 0, attempts[-1]
    kept: list[bytearray] = []
    for attempt, copy_format in enumerate(attempts):
        try:
            rows, nbytes, kept = _copy_once(task, copy_format)
            used = copy_format
            break
        except _BINARY_MISMATCH as exc:
            if attempt + 1 == len(attempts):
                raise _range_error(task, exc) from None
        except psycopg.Error as exc:
            raise _range_error(task, exc) from None
    parquet_file = None
    if task.export_dir is not None:
        parquet_file = _write_parquet(task, kept)
    return RangeCopyResult(
        table=task.range.table,
        start_block=task.range.start_block,
        rows=rows,
        bytes=nbytes,
        seconds=time.perf_counter() - started,
        copy_format=used,
        parquet_file=parquet_file,
    )


def _range_error(task: CopyTask, exc: psycopg.Error) -> SnapshotError:
    rng = task.range
    return SnapshotError(
        f"copying {rng.source} into {rng.table} (blocks {rng.start_block or 0} to "
        f"{'the end' if rng.end_block is None else rng.end_block}) failed: "
        f"{(exc.diag.message_primary or str(exc)).strip()}"
    )


def _run_group(group: Sequence[CopyTask]) -> list[RangeCopyResult]:
    """The tasks Spark gave one partition, one after the other (this is how ``parallelism``
    bounds the number of simultaneous copies)."""
    return [copy_range(task) for task in group]


def _run_group_row(groups: Sequence[Sequence[CopyTask]], index: int) -> list[dict[str, Any]]:
    """Python-UDF form of :func:`_run_group` for Spark Connect sessions (no RDD API there)."""
    return [
        {
            "schema": r.table.schema,
            "name": r.table.name,
            "start_block": r.start_block,
            "rows": r.rows,
            "bytes": r.bytes,
            "seconds": r.seconds,
            "copy_format": r.copy_format,
            "parquet_file": r.parquet_file,
        }
        for r in _run_group(groups[index])
    ]


# ─── Parquet export ──────────────────────────────────────────────────────────────────────────

_ARROW_TYPES = {"int2": "int16", "int4": "int32", "int8": "int64", "bool": "bool"}
"""Types stored typed; every other value is kept as PostgreSQL's text form (as the change store
does), which loses nothing and needs no per-type parsing."""


def snapshot_export_path(store: str | os.PathLike[str], table: TableName) -> Path:
    """``<store>/snapshot/<schema>.<table>/``, each part percent-encoded (dots included) so any
    identifier maps to one folder name and back."""

    def encode(part: str) -> str:
        return quote(part, safe="").replace(".", "%2E")

    return Path(store) / "snapshot" / f"{encode(table.schema)}.{encode(table.name)}"


def _arrow_type_names(task: CopyTask) -> list[str]:
    return [_ARROW_TYPES.get(typname, "string") for typname in task.column_types]


def _write_parquet(task: CopyTask, csv_blocks: list[bytearray]) -> str:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    assert task.export_dir is not None
    names = list(task.range.columns)
    types = {n: pa.type_for_alias(t) for n, t in zip(names, _arrow_type_names(task), strict=True)}
    schema = pa.schema([pa.field(n, types[n]) for n in names])
    if csv_blocks:
        table = pacsv.read_csv(
            pa.py_buffer(b"".join(csv_blocks)),
            read_options=pacsv.ReadOptions(column_names=names, block_size=1 << 24),
            parse_options=pacsv.ParseOptions(newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(
                column_types=types,
                null_values=[""],
                strings_can_be_null=True,
                quoted_strings_can_be_null=False,
                true_values=["t"],
                false_values=["f"],
            ),
        )
    else:
        table = schema.empty_table()
    start = task.range.start_block or 0
    leaf = str(task.range.source).encode().hex()
    path = Path(task.export_dir) / f"part-{leaf}-{start:010d}.parquet"
    pq.write_table(table, path)
    return str(path)


# ─── scheduling on Spark ──────────────────────────────────────────────────────────────────────


def _groups(tasks: Sequence[CopyTask], parallelism: int | None) -> list[list[CopyTask]]:
    """One group per Spark partition, largest tasks first; with ``parallelism`` below the task
    count, tasks are dealt greedily to the least-loaded of ``parallelism`` groups."""
    ordered = sorted(tasks, key=lambda t: t.range.estimated_rows, reverse=True)
    if parallelism is None or parallelism >= len(ordered):
        return [[t] for t in ordered]
    groups: list[list[CopyTask]] = [[] for _ in range(max(1, parallelism))]
    loads = [0] * len(groups)
    for task in ordered:
        i = loads.index(min(loads))
        groups[i].append(task)
        loads[i] += max(1, task.range.estimated_rows)
    return groups


def _run_on_spark(
    spark: SparkSession, groups: list[list[CopyTask]], scheduler: str
) -> list[RangeCopyResult]:
    from pgcdc_dagster.spark_session import is_connect_session

    use_rdd = scheduler == "rdd" or (scheduler == "auto" and not is_connect_session(spark))
    if use_rdd:
        sc = spark.sparkContext
        sc.setJobDescription("pgcdc base snapshot: copy table ranges")
        return list(sc.parallelize(groups, len(groups)).flatMap(_run_group).collect())
    # Spark Connect has no sparkContext: one row per group, each row handled by a
    # nondeterministic Python UDF (so the optimizer never runs it twice or drops it).
    from pyspark.sql import functions as F
    from pyspark.sql.types import (
        ArrayType,
        DoubleType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    result_type = ArrayType(
        StructType(
            [
                StructField("schema", StringType()),
                StructField("name", StringType()),
                StructField("start_block", LongType()),
                StructField("rows", LongType()),
                StructField("bytes", LongType()),
                StructField("seconds", DoubleType()),
                StructField("copy_format", StringType()),
                StructField("parquet_file", StringType()),
            ]
        )
    )
    with warnings.catch_warnings():
        # pyspark tries to read a pandas-UDF kind off the type hints; this is a plain UDF.
        warnings.simplefilter("ignore", UserWarning)
        run = F.udf(
            functools.partial(_run_group_row, groups), result_type, useArrow=False
        ).asNondeterministic()
    frame = spark.range(len(groups), numPartitions=len(groups)).select(run("id").alias("r"))
    results = []
    for row in frame.collect():
        for r in row["r"]:
            results.append(
                RangeCopyResult(
                    table=TableName(r["schema"], r["name"]),
                    start_block=r["start_block"],
                    rows=r["rows"],
                    bytes=r["bytes"],
                    seconds=r["seconds"],
                    copy_format=r["copy_format"],
                    parquet_file=r["parquet_file"],
                )
            )
    return results


def _task_failure(exc: BaseException) -> str:
    """The Python error line of a failed Spark task, without the JVM stack around it."""
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if "Error:" in ln or "Exception:" in ln]
    python_lines = [ln for ln in lines if not ln.startswith(("org.", "java.", "at ", "py4j"))]
    return (python_lines or lines or [text.strip().splitlines()[0] if text.strip() else ""])[-1]


def copy_tables(
    spark: SparkSession,
    source_dsn: str,
    target_dsn: str,
    snapshot_name: str | None,
    tables: Sequence[TableName],
    *,
    parallelism: int | None = None,
    target_rows_per_task: int = DEFAULT_ROWS_PER_TASK,
    copy_format: CopyFormat = "binary",
    export_store: str | os.PathLike[str] | None = None,
    consistent_point: Lsn | None = None,
    scheduler: Literal["auto", "rdd", "dataframe"] = "auto",
) -> list[TableCopyResult]:
    """Copy the rows of ``tables`` as of ``snapshot_name`` into the same-named target tables.

    Spark runs one task per ctid range (:func:`plan_table_ranges`); ``parallelism`` caps how
    many run at once (each holds one source and one target connection), otherwise Spark's
    cores are the cap. The snapshot must stay importable until this returns. ``snapshot_name``
    ``None`` lets every task read the latest data: consistent per range only, for sources that
    nobody writes to.

    ``export_store`` also writes each table as Parquet under
    :func:`snapshot_export_path`, stamped with ``consistent_point`` in ``_SNAPSHOT.json``
    (written last: a folder without it is incomplete). The copy then uses CSV on the wire so the
    same bytes feed the target and the Parquet writer; the folder must be reachable by every
    Spark worker. It is off by default because it is not cheap: measured on 1M rows it added
    46 % (pgbench_accounts) and 93 % (mixed types) to the copy time, against a 30 % budget.

    ``scheduler``: ``rdd`` (classic sessions), ``dataframe`` (a plain Python UDF over
    ``spark.range``, one row per group of tasks: the only way on Spark Connect, which has no
    ``sparkContext``), ``auto`` picks by session kind. The ``dataframe`` path is tested on a
    classic session; it has not been run against a Connect server here (the Connect client
    needs pandas, which the project does not install).
    """
    if export_store is not None and consistent_point is None:
        raise ValueError("export_store needs the consistent_point to stamp the export with")
    if not tables:
        return []
    with connect(source_dsn, role="source", autocommit=True) as src:
        ranges = plan_table_ranges(src, tables, snapshot_name, target_rows_per_task)
        column_types = _column_type_names(src, tables, snapshot_name)
    staging: Path | None = None
    if export_store is not None:
        staging = Path(export_store) / "snapshot" / f".tmp-{uuid.uuid4().hex}"
        for table in tables:
            (staging / snapshot_export_path(export_store, table).name).mkdir(parents=True)
    tasks = [
        CopyTask(
            range=rng,
            source_dsn=source_dsn,
            target_dsn=target_dsn,
            snapshot_name=snapshot_name,
            copy_format=copy_format,
            export_dir=(
                None
                if staging is None or export_store is None
                else str(staging / snapshot_export_path(export_store, rng.table).name)
            ),
            column_types=tuple(column_types[rng.table][c] for c in rng.columns),
        )
        for rng in ranges
    ]
    try:
        results = _run_on_spark(spark, _groups(tasks, parallelism), scheduler)
    except Exception as exc:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, SnapshotError):
            raise
        message = redact(redact(_task_failure(exc), source_dsn), target_dsn)
        raise SnapshotError(f"the table copy failed in a Spark task: {message}") from exc
    by_table: dict[TableName, list[RangeCopyResult]] = {t: [] for t in tables}
    for result in results:
        by_table.setdefault(result.table, []).append(result)
    summary = [
        TableCopyResult(
            table=table,
            rows=sum(r.rows for r in parts),
            bytes=sum(r.bytes for r in parts),
            seconds=sum(r.seconds for r in parts),
            tasks=len(parts),
            copy_formats=tuple(sorted({r.copy_format for r in parts})),
        )
        for table, parts in by_table.items()
    ]
    if staging is not None and export_store is not None and consistent_point is not None:
        _publish_export(
            export_store,
            staging,
            summary,
            by_table,
            ranges,
            column_types,
            snapshot_name,
            consistent_point,
        )
    return summary


def _column_type_names(
    conn: psycopg.Connection[Any], tables: Sequence[TableName], snapshot_name: str | None
) -> dict[TableName, dict[str, str]]:
    with _snapshot_transaction(conn, snapshot_name):
        oids = _resolve_oids(conn, tables)
        rows = conn.execute(_COLUMNS, (list(oids.values()),)).fetchall()
    by_oid = {oid: table for table, oid in oids.items()}
    types: dict[TableName, dict[str, str]] = {t: {} for t in tables}
    for relid, name, _, typname, _ in rows:
        types[by_oid[int(relid)]][name] = typname
    return types


def _publish_export(
    store: str | os.PathLike[str],
    staging: Path,
    summary: Sequence[TableCopyResult],
    by_table: dict[TableName, list[RangeCopyResult]],
    ranges: Sequence[TableRange],
    column_types: dict[TableName, dict[str, str]],
    snapshot_name: str | None,
    consistent_point: Lsn,
) -> None:
    """Stamp each table's folder and move it into place; the manifest is written last, so a
    folder is complete exactly when it has one."""
    columns = {r.table: r.columns for r in ranges}
    for result in summary:
        final = snapshot_export_path(store, result.table)
        folder = staging / final.name
        manifest = {
            "format_version": EXPORT_FORMAT_VERSION,
            "schema": result.table.schema,
            "table": result.table.name,
            "consistent_point": str(consistent_point),
            "snapshot_name": snapshot_name,
            "rows": result.rows,
            "columns": [
                {
                    "name": c,
                    "pg_type": column_types[result.table][c],
                    "arrow_type": _ARROW_TYPES.get(column_types[result.table][c], "string"),
                }
                for c in columns.get(result.table, ())
            ],
            "files": sorted(
                Path(r.parquet_file).name for r in by_table[result.table] if r.parquet_file
            ),
        }
        (folder / SNAPSHOT_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        folder.rename(final)
    shutil.rmtree(staging, ignore_errors=True)


# ─── sequences ────────────────────────────────────────────────────────────────────────────────

_SET_SEQUENCES = """
SELECT n.nspname, c.relname, setval(c.oid::regclass, u.value, u.called)
FROM unnest(%s::text[], %s::text[], %s::int8[], %s::bool[]) AS u(schema, name, value, called)
JOIN pg_namespace n ON n.nspname = u.schema
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = u.name AND c.relkind = 'S'
"""


def sync_sequences(source_dsn: str, target_dsn: str) -> dict[str, int]:
    """Give every target sequence that also exists on the source the source's position.

    Logical replication does not carry sequence values, so without this a target promoted to
    primary would hand out keys the source already used. Read in one query, set in one
    statement; a sequence never called on the source is reset to its start (``is_called``
    false). Sequences missing on the target are ignored. Returns the value set per sequence
    (display name ``schema.name``).
    """
    with connect(source_dsn, role="source", autocommit=True) as src:
        rows = src.execute(
            "SELECT schemaname, sequencename, coalesce(last_value, start_value), "
            "last_value IS NOT NULL FROM pg_sequences"
        ).fetchall()
    if not rows:
        return {}
    with connect(target_dsn, role="target") as tgt:
        done = tgt.execute(
            _SET_SEQUENCES,
            (
                [r[0] for r in rows],
                [r[1] for r in rows],
                [r[2] for r in rows],
                [r[3] for r in rows],
            ),
        ).fetchall()
        tgt.commit()
    return {str(TableName(schema, name)): int(value) for schema, name, value in done}


# ─── orchestration ────────────────────────────────────────────────────────────────────────────


def _populated_tables(
    conn: psycopg.Connection[Any], tables: Sequence[TableName]
) -> tuple[list[TableName], list[TableName]]:
    """The tables of ``tables`` that exist on the target, and those of them holding rows."""
    rows = conn.execute(
        _RESOLVE_TABLES, ([t.schema for t in tables], [t.name for t in tables])
    ).fetchall()
    existing = [TableName(s, n) for s, n, oid, _ in rows if oid is not None]
    if not existing:
        return [], []
    probe = sql.SQL(" UNION ALL ").join(
        sql.SQL("SELECT {} WHERE EXISTS (SELECT FROM {})").format(sql.Literal(i), t.sql)
        for i, t in enumerate(existing)
    )
    populated = [existing[int(i)] for (i,) in conn.execute(probe).fetchall()]
    return existing, populated


def _reset_target(target_dsn: str, existing: Sequence[TableName], origin_name: str) -> None:
    with connect(target_dsn, role="target") as tgt:
        if existing:
            try:
                tgt.execute(
                    sql.SQL("TRUNCATE {}").format(sql.SQL(", ").join(t.sql for t in existing))
                )
            except errors.FeatureNotSupported as exc:
                raise SnapshotError(
                    f"cannot truncate the target tables for --resnapshot: "
                    f"{(exc.diag.message_primary or str(exc)).strip()}: other target tables "
                    "reference them by foreign key; add those tables to the replicated set or "
                    "drop the foreign keys"
                ) from None
        tgt.execute(
            "SELECT pg_replication_origin_drop(roname) FROM pg_replication_origin "
            "WHERE roname = %s",
            (origin_name,),
        )
        tgt.commit()


def _set_origin(target_dsn: str, origin_name: str, consistent_point: Lsn) -> None:
    """Create the target's origin if needed and put it at ``consistent_point``: the apply
    resumes strictly after it. (``pg_replication_origin_advance`` may move backwards, which a
    re-snapshot relies on.)"""
    with connect(target_dsn, role="target") as tgt:
        tgt.execute(
            "SELECT pg_replication_origin_create(%s) "
            "WHERE NOT EXISTS (SELECT FROM pg_replication_origin WHERE roname = %s)",
            (origin_name, origin_name),
        )
        tgt.execute(
            "SELECT pg_replication_origin_advance(%s, %s::pg_lsn)",
            (origin_name, str(consistent_point)),
        )
        tgt.commit()


def take_base_snapshot(
    source_dsn: str,
    target_dsn: str,
    slot_name: str,
    publication: str,
    tables: Sequence[TableName] | None,
    *,
    spark: SparkSession,
    resnapshot: bool = False,
    parallelism: int | None = None,
    target_rows_per_task: int = DEFAULT_ROWS_PER_TASK,
    copy_format: CopyFormat = "binary",
    export_store: str | os.PathLike[str] | None = None,
    sync_sequence_values: bool = True,
) -> BaseSnapshotResult:
    """Take the base snapshot: publication, slot with exported snapshot, schema, rows, keys,
    and the target's replication origin at the slot's consistent point.

    Refuses to copy into target tables that already hold rows (the copy would duplicate them)
    unless ``resnapshot``, which first drops the slot, truncates the target tables and drops the
    origin: a clean restart. If anything fails after the slot was created, the slot is dropped
    again (it would retain WAL for a snapshot nobody can finish); the target then holds a
    partial copy, and the next attempt needs ``resnapshot``.
    """
    from pgcdc_dagster.preflight import check_source
    from pgcdc_dagster.slot import create_slot_with_snapshot, drop_slot, ensure_publication

    started = time.perf_counter()
    origin_name = replication_origin_name(slot_name)
    with connect(source_dsn, role="source", autocommit=True) as src:
        slot_exists = (
            src.execute(
                "SELECT FROM pg_replication_slots WHERE slot_name = %s", (slot_name,)
            ).fetchone()
            is not None
        )
        resolved = check_source(src, tables, free_slots_needed=0 if slot_exists else 1)
    with connect(target_dsn, role="target", autocommit=True) as tgt:
        existing, populated = _populated_tables(tgt, resolved)
    if populated and not resnapshot:
        names = ", ".join(str(t) for t in populated)
        raise TargetNotEmptyError(
            f"target table(s) {names} already hold rows: a base snapshot would duplicate them; "
            "rerun with --resnapshot to truncate them (and drop the replication slot "
            f"{slot_name} and origin {origin_name}) and copy everything again"
        )
    if slot_exists and not resnapshot:
        raise SnapshotError(
            f"replication slot {slot_name} already exists on the source: it belongs to an "
            "earlier base snapshot; keep replicating from it, or start over with "
            "--resnapshot (drops the slot, truncates the target tables)"
        )
    if resnapshot:
        with connect(source_dsn, role="source", autocommit=True) as src:
            drop_slot(src, slot_name, missing_ok=True)
        _reset_target(target_dsn, existing, origin_name)

    with connect(source_dsn, role="source", autocommit=True) as src:
        ensure_publication(src, publication, resolved)

    exported = create_slot_with_snapshot(source_dsn, slot_name)
    slot = exported.slot
    try:
        with exported:
            pre_data = copy_schema_pre_data(source_dsn, target_dsn, resolved, slot.snapshot_name)
            copy_started = time.perf_counter()
            copies = copy_tables(
                spark,
                source_dsn,
                target_dsn,
                slot.snapshot_name,
                resolved,
                parallelism=parallelism,
                target_rows_per_task=target_rows_per_task,
                copy_format=copy_format,
                export_store=export_store,
                consistent_point=slot.consistent_point,
            )
            copy_seconds = time.perf_counter() - copy_started
        post_data = copy_schema_post_data(source_dsn, target_dsn, resolved)
        sequences = sync_sequences(source_dsn, target_dsn) if sync_sequence_values else {}
        _set_origin(target_dsn, origin_name, slot.consistent_point)
    except BaseException:
        exported.close()
        with (
            contextlib.suppress(Exception),
            connect(source_dsn, role="source", autocommit=True) as src,
        ):
            drop_slot(src, slot_name, missing_ok=True)
        raise
    return BaseSnapshotResult(
        slot_name=slot.name,
        snapshot_name=slot.snapshot_name,
        consistent_point=slot.consistent_point,
        origin_name=origin_name,
        publication=publication,
        tables=tuple(copies),
        pre_data=pre_data,
        post_data=post_data,
        sequences=sequences,
        seconds=time.perf_counter() - started,
        copy_seconds=copy_seconds,
        export_path=None if export_store is None else str(Path(export_store) / "snapshot"),
    )
