"""The schema: pg_dump's table of contents cut to what the tables need and the target lacks.

Pre-data (types, sequences, tables) goes before the copy, post-data (indexes, keys) after it;
objects already on the target are never replaced.

Why one module: both sections walk the same table of contents with the same test of what the
target already holds (:func:`_present_on_target`), and an entry's address is read one way for
both; they differ only in which entries they restore.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from ..connect import connect
from ..identifiers import TableName
from ..postgres_installs import Installation, tools_for
from .common import (
    RESOLVE_TABLES,
    SchemaRestoreResult,
    SnapshotError,
    dump_pattern,
    resolve_oids,
    run_tool,
    snapshot_transaction,
)

# ─── schema: dependency closure and filtered pg_dump sections ─────────────────────────────────

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


def _read_toc(archive: Path, dsn: str, tools: Installation) -> list[_TocEntry]:
    listing = run_tool(
        [tools.tool("pg_restore"), "--list", str(archive)],
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
    source_dsn: str,
    archive: Path,
    section: str,
    snapshot_name: str | None,
    selection: list[str],
    tools: Installation,
) -> None:
    argv = [
        tools.tool("pg_dump"),
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
    run_tool(argv, source_dsn, role="source", what=f"pg_dump --section={section}")


def _restore_entries(
    archive: Path,
    entries: Sequence[_TocEntry],
    source_dsn: str,
    target_dsn: str,
    tools: Installation,
) -> None:
    """Replay ``entries`` of ``archive`` on the target in one transaction (psql, because
    pg_restore's scripts may hold psql meta-commands such as ``\\restrict``)."""
    if not entries:
        return
    listfile = archive.with_suffix(".list")
    listfile.write_text("".join(entry.line + "\n" for entry in entries))
    script = archive.with_suffix(".sql")
    run_tool(
        [
            tools.tool("pg_restore"),
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
    _drop_unknown_settings(script, target_dsn)
    try:
        run_tool(
            [
                tools.tool("psql"),
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
    except SnapshotError as exc:
        refused = _refused_entry(script, str(exc))
        if refused is None:
            raise
        what, error = refused
        raise SnapshotError(
            f"the target refused {what} as pg_dump {tools.version} wrote it from the source: "
            f"{error}; create it on the target in a form the target accepts (what the target "
            "already has is kept), then run the snapshot again"
        ) from None


_SCRIPT_SETTING = re.compile(r"^SET (\w+) = .*;$")


def _drop_unknown_settings(script: Path, target_dsn: str) -> None:
    """Comment out the script's ``SET name = value;`` lines for settings the target does not
    know. pg_restore writes its session settings for the source's major (PostgreSQL 17 and
    later: ``SET transaction_timeout = 0``), and an older target refuses the whole script for
    one unknown setting. A setting the target lacks cannot matter there."""
    with connect(target_dsn, role="target", autocommit=True) as tgt:
        known = {name for (name,) in tgt.execute("SELECT name FROM pg_settings").fetchall()}
    text = script.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    changed = False
    for i, line in enumerate(lines):
        match = _SCRIPT_SETTING.match(line)
        if match and match.group(1) not in known:
            lines[i] = "-- not known to the target: " + line
            changed = True
    if changed:
        script.write_text("".join(lines), encoding="utf-8")


_PSQL_ERROR = re.compile(r"psql:[^\n]*?:(\d+): ERROR:\s*([^\n]*)")
_ENTRY_HEADER = re.compile(r"^-- Name: (.*?); Type: (.*?); Schema: (.*?);")
_VIRTUAL_COLUMN = re.compile(r"GENERATED ALWAYS AS \(.*\)(?!\s*STORED)\s*(,|$)", re.MULTILINE)


def _refused_entry(script: Path, failure: str) -> tuple[str, str] | None:
    """The object whose statement the target refused (``TABLE public.orders``), from the
    entry header pg_restore writes above each object's statements, and the server's error
    with a hint where the cause is known; ``None`` when psql's message names no line of
    ``script``. Why: a target older than the source may refuse syntax a newer pg_dump writes,
    and the user must know which object to create by hand, and how."""
    match = _PSQL_ERROR.search(failure)
    if match is None:
        return None
    failed_line, error = int(match.group(1)), match.group(2).strip()
    what: str | None = None
    statement: list[str] = []
    with script.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if number > failed_line:
                break
            if header := _ENTRY_HEADER.match(line):
                name, kind, schema = header.groups()
                what = f"{kind} {name}" if schema == "-" else f"{kind} {schema}.{name}"
                statement = []
            statement.append(line)
    if what is None:
        return None
    if _VIRTUAL_COLUMN.search("".join(statement)):
        error += (
            " (a virtual generated column, new in PostgreSQL 18: on an older target, declare "
            "it STORED, which replicates the same)"
        )
    return what, error


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
    what the target lacks; a table that already exists is left exactly as it is. No
    ``tables``, nothing (``pg_dump`` without a table would dump them all).
    """
    if not tables:
        return SchemaRestoreResult("pre-data", (), (), (), 0.0)
    started = time.perf_counter()
    with (
        connect(source_dsn, role="source", autocommit=True) as src,
        snapshot_transaction(src, snapshot_name),
    ):
        tools = tools_for(src.info.server_version)
        oids = resolve_oids(src, tables)
        closure_rows = src.execute(_CLOSURE, (list(oids.values()),)).fetchall()
        closure = {(int(c), int(o)) for c, o, _, _ in closure_rows}
        schemas = sorted({s for _, _, s, _ in closure_rows if s} - _SYSTEM_SCHEMAS)
        extensions = sorted({e for _, _, _, e in closure_rows if e} - {"plpgsql"})
        companion_rows = src.execute(
            _COMPANION_ENTRIES, {"oids": [o for c, o in closure if c == _PG_CLASS]}
        ).fetchall()
        with tempfile.TemporaryDirectory(prefix="pgcdc-predata-") as tmp:
            archive = Path(tmp) / "pre-data.dump"
            selection = [f"--schema={dump_pattern(s)}" for s in schemas]
            selection += [f"--extension={dump_pattern(e)}" for e in extensions]
            _dump_archive(source_dsn, archive, "pre-data", snapshot_name, selection, tools)
            toc = _read_toc(archive, source_dsn, tools)
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
            _restore_entries(archive, selected, source_dsn, target_dsn, tools)
    return SchemaRestoreResult(
        section="pre-data",
        created=tuple(_identity(addresses, e) for e in created),
        already_present=tuple(_identity(addresses, e) for e in present),
        skipped=(),
        seconds=time.perf_counter() - started,
        tools=tools.describe(),
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
    known = [a for e in entries if (a := addresses.get((e.classid, e.objid))) is not None]
    found = _present_all(tgt, known)
    missing, present = [], []
    for entry in entries:
        address = addresses.get((entry.classid, entry.objid))
        if address is not None and found[_key(address)]:
            present.append(entry)
        else:
            missing.append(entry)
    return missing, present


_PRESENT_SETTING = "pgcdc.present"

_PRESENT_ALL = """
DECLARE
    e jsonb;
    found text := '';
BEGIN
    FOR e IN SELECT * FROM jsonb_array_elements({addresses}::jsonb) LOOP
        BEGIN
            PERFORM pg_get_object_address(
                e->>'type',
                ARRAY(SELECT jsonb_array_elements_text(e->'names')),
                ARRAY(SELECT jsonb_array_elements_text(e->'args')));
            found := found || '1';
        EXCEPTION WHEN others THEN
            IF SQLSTATE LIKE '42%' OR SQLSTATE = '3F000' THEN
                found := found || '0';
            ELSE
                RAISE;
            END IF;
        END;
    END LOOP;
    PERFORM set_config({setting}, found, false);
END
"""


def _key(address: _Address) -> tuple[str, tuple[str, ...], tuple[str, ...]]:
    return address.type, tuple(address.names), tuple(address.args)


def _present_all(
    tgt: psycopg.Connection[Any], addresses: Sequence[_Address]
) -> dict[tuple[str, tuple[str, ...], tuple[str, ...]], bool]:
    """:func:`_present_on_target` for every address, in one statement: a
    ``DO`` block that probes each in a subtransaction of its own and leaves the answers in a
    session setting. Without PL/pgSQL on the target (or the right to use it), one probe after
    the other.

    Why: a probe is three round trips, and the snapshot runs beside the command's import of
    Dagster, so every round trip also waits for Python's GIL: with hundreds of small tables,
    one probe after the other takes more of ``pgcdc snapshot`` than the copy of the rows (see
    ``benchmarks/HISTORY.md``, ``benchmarks/many_tables.py`` and "Many tables")."""
    if not addresses:
        return {}
    listed = json.dumps([{"type": a.type, "names": a.names, "args": a.args} for a in addresses])
    body = sql.SQL(_PRESENT_ALL).format(
        addresses=sql.Literal(listed), setting=sql.Literal(_PRESENT_SETTING)
    )
    try:
        with tgt.transaction():
            tgt.execute(sql.SQL("DO {}").format(sql.Literal(body.as_string(tgt))))
            row = tgt.execute("SELECT current_setting(%s)", (_PRESENT_SETTING,)).fetchone()
    except (psycopg.errors.UndefinedObject, psycopg.errors.InsufficientPrivilege):
        # no PL/pgSQL on the target, or no USAGE on it for this role
        return {_key(a): _present_on_target(tgt, a) for a in addresses}
    answers = str(row[0]) if row is not None else ""
    if len(answers) != len(addresses):
        raise SnapshotError(
            f"the target answered {len(answers)} of {len(addresses)} object lookups"
        )
    return {_key(a): flag == "1" for a, flag in zip(addresses, answers, strict=True)}


def copy_schema_post_data(
    source_dsn: str,
    target_dsn: str,
    tables: Sequence[TableName],
    snapshot_name: str | None = None,
    *,
    foreign_keys: bool = True,
) -> SchemaRestoreResult:
    """Create the tables' indexes, primary/unique/exclusion keys, foreign keys, triggers, rules
    and policies on the target, once the rows are in (building an index once is far cheaper than
    maintaining it row by row). ``foreign_keys=False``: not the foreign keys (tables copied at
    another point than the target's others, see :mod:`.foreign_keys`).

    What already exists on the target is kept. A foreign key is created only when the table it
    references exists on the target; otherwise it is listed in ``skipped``. Trigger functions
    were created by pre-data (they are in the tables' dependency closure).

    A partitioned table's keys and indexes are its partitions' too: pg_dump creates the
    parent's ``ONLY`` (invalid until every partition's own is attached), each partition's, and
    an ``INDEX ATTACH`` entry for each (:func:`_partition_entries`). Without the partitions'
    share, a partitioned table's primary key stayed invalid on the target, and the apply
    refused its first range: no unique index to match rows by.

    No ``tables``, nothing to do (``pg_dump`` without a table would dump them all).
    """
    if not tables:
        return SchemaRestoreResult("post-data", (), (), (), 0.0)
    started = time.perf_counter()
    with (
        connect(source_dsn, role="source", autocommit=True) as src,
        snapshot_transaction(src, snapshot_name),
        connect(target_dsn, role="target", autocommit=True) as tgt,
        tempfile.TemporaryDirectory(prefix="pgcdc-postdata-") as tmp,
    ):
        tools = tools_for(src.info.server_version)
        existing = _on_target(tgt, tables)
        absent = [str(t) for t in tables if t not in existing]
        if absent:
            raise SnapshotError(
                f"table(s) {', '.join(absent)} do not exist on the target, so their indexes "
                "and keys cannot be created: run copy_schema_pre_data for them first"
            )
        partitions = _partitions(src, tables)
        there = _on_target(tgt, partitions)  # a target's own partitioning is left as it is
        partitions = {t: oid for t, oid in partitions.items() if t in there}
        archive = Path(tmp) / "post-data.dump"
        selection = [
            "--strict-names",
            *(f"--table={dump_pattern(t.schema, t.name)}" for t in (*tables, *partitions)),
        ]
        _dump_archive(source_dsn, archive, "post-data", snapshot_name, selection, tools)
        listed = _read_toc(archive, source_dsn, tools)
        toc = [e for e in listed if e.classid != 0]
        addresses = _addresses(src, [(e.classid, e.objid) for e in toc])
        references = {
            int(oid): _Address(t, list(n or []), list(a or []), identity)
            for oid, _, t, n, a, identity in src.execute(
                _FOREIGN_KEY_TARGETS, ([e.objid for e in toc if e.classid == _PG_CONSTRAINT],)
            ).fetchall()
        }
        if not foreign_keys:
            toc = [e for e in toc if e.objid not in references]
        missing, present = _split_by_presence(tgt, toc, addresses)
        on_target = _present_all(
            tgt, [references[e.objid] for e in missing if e.objid in references]
        )
        created, skipped = [], []
        for entry in missing:
            referenced = references.get(entry.objid)
            if referenced is not None and not on_target[_key(referenced)]:
                identity = _identity(addresses, entry)
                skipped.append(
                    f"{identity}: references {referenced.identity}, which is not on the "
                    "target (add it to the replicated tables to keep the foreign key)"
                )
            else:
                created.append(entry)
        attaches = _partition_entries(src, list(partitions.values()), created)
        kept = {(e.classid, e.objid) for e in created}
        selected = [  # in the archive's order: an index before its attachment
            e
            for e in listed
            if (e.classid, e.objid) in kept or (e.classid == 0 and e.rest in attaches)
        ]
        _restore_entries(archive, selected, source_dsn, target_dsn, tools)
    return SchemaRestoreResult(
        section="post-data",
        created=tuple(_identity(addresses, e) for e in selected),
        already_present=tuple(_identity(addresses, e) for e in present),
        skipped=tuple(skipped),
        seconds=time.perf_counter() - started,
        tools=tools.describe(),
    )


def _on_target(tgt: psycopg.Connection[Any], tables: Iterable[TableName]) -> set[TableName]:
    """Those of ``tables`` that exist on the target."""
    listed = list(tables)
    return {
        TableName(s, n)
        for s, n, oid, _ in tgt.execute(
            RESOLVE_TABLES, ([t.schema for t in listed], [t.name for t in listed])
        ).fetchall()
        if oid is not None
    }


_PARTITIONS = """
SELECT n.nspname, c.relname, c.oid
FROM unnest(%s::oid[]) AS t(oid)
CROSS JOIN LATERAL pg_partition_tree(t.oid) AS p
JOIN pg_class c ON c.oid = p.relid
JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE p.relid <> t.oid
ORDER BY n.nspname, c.relname
"""


def _partitions(src: psycopg.Connection[Any], tables: Sequence[TableName]) -> dict[TableName, int]:
    """Every partition, at every level, of those of ``tables`` that are partitioned."""
    oids = resolve_oids(src, tables)
    return {
        TableName(s, n): int(oid)
        for s, n, oid in src.execute(_PARTITIONS, (list(oids.values()),)).fetchall()
    }


_INDEX_ATTACHES = """
SELECT 'INDEX ATTACH ' || n.nspname || ' ' || ci.relname || ' ' || pg_get_userbyid(ci.relowner),
       ARRAY[ci.oid, i.inhparent], ARRAY[con.oid, pcon.oid]
FROM pg_index x
JOIN pg_class ci ON ci.oid = x.indexrelid
JOIN pg_namespace n ON n.oid = ci.relnamespace
JOIN pg_inherits i ON i.inhrelid = ci.oid
LEFT JOIN pg_constraint con ON con.conindid = ci.oid AND con.conrelid = x.indrelid
                            AND con.contype IN ('p', 'u', 'x')
LEFT JOIN pg_constraint pcon ON pcon.conindid = i.inhparent AND pcon.contype IN ('p', 'u', 'x')
WHERE x.indrelid = ANY(%s::oid[])
"""
"""The ``INDEX ATTACH`` entries pg_dump writes (without a catalog id) for partitions' indexes,
in ``pg_restore --list`` form, with the index and the parent's index (``pg_class``) and the
keys they back (``pg_constraint``), either of which creates them."""


def _partition_entries(
    src: psycopg.Connection[Any], partitions: Sequence[int], created: Sequence[_TocEntry]
) -> set[str]:
    """The ``INDEX ATTACH`` entries to replay: those whose partition index or parent index
    this restore creates (both already on the target: attached already, or not ours)."""
    if not partitions:
        return set()
    made = {(e.classid, e.objid) for e in created}
    return {
        rest
        for rest, indexes, keys in src.execute(_INDEX_ATTACHES, (list(partitions),)).fetchall()
        if any((_PG_CLASS, int(o)) in made for o in indexes if o is not None)
        or any((_PG_CONSTRAINT, int(o)) in made for o in keys if o is not None)
    }
