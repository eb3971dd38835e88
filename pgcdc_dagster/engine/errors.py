"""The engine's errors: one base class, so every caller can tell "a problem the user must act
on" (one line: the object, the problem, the fix) from a bug (a traceback).

Messages never carry a connection string or a password: servers are named by
:func:`~pgcdc_dagster.engine.connect.describe_dsn` only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psycopg


class PgcdcError(RuntimeError):
    """A problem the user must act on; ``str()`` is one line that names the fix."""


class ApplyError(PgcdcError):
    """A range cannot be applied; the message names the object, the problem and the fix."""


class OriginError(ApplyError):
    """The target's replication origin is missing, unset or held by another session."""


_FIXES = {
    "22P05": "the target database's encoding cannot hold this character: replicate into a "
    "database created with ENCODING 'UTF8'",
}
"""The fix for a server error a value can cause on the target, by SQLSTATE, where we know
one (``22P05``: untranslatable character)."""


def server_message(exc: psycopg.Error) -> str:
    """The server's own message for ``exc`` (psycopg's text when the server sent none)."""
    return (exc.diag.message_primary or str(exc)).strip()


def server_reason(exc: psycopg.Error, otherwise: str | None = None) -> str:
    """The server's reason for ``exc`` in one line: its message, its detail, and the fix
    where :data:`_FIXES` knows it (``otherwise``, when given, where it does not)."""
    reason = server_message(exc)
    if exc.diag.message_detail:
        reason += f" ({exc.diag.message_detail})"
    fix = _FIXES.get(exc.sqlstate or "", otherwise)
    return f"{reason}; {fix}" if fix else reason
