"""Sequence values: logical replication does not carry them, so they are copied."""

from __future__ import annotations

from ..connect import connect
from ..identifiers import TableName

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
