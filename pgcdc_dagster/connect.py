"""The one connection helper, and the rule that no credential ever leaves it.

Connection strings come from the environment and may hold passwords. Every error raised here
names the server by host, port, database and user only; the conninfo itself is never echoed.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict


class ConnectError(RuntimeError):
    """A server could not be reached or refused us; the message is safe to log."""


def describe_dsn(dsn: str) -> str:
    """``user@host:port/dbname`` for messages: everything but secrets."""
    try:
        parts = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparseable connection string>"
    host = parts.get("host") or parts.get("hostaddr") or "localhost"
    return f"{parts.get('user', '')}@{host}:{parts.get('port', 5432)}/{parts.get('dbname', '')}"


def redact(text: str, dsn: str) -> str:
    """Remove the password of ``dsn`` from ``text`` wherever it appears."""
    try:
        password = conninfo_to_dict(dsn).get("password")
    except psycopg.ProgrammingError:
        password = None
    if password:
        text = text.replace(str(password), "********")
    return text


def connect(
    dsn: str,
    *,
    role: str = "database",
    autocommit: bool = False,
    replication: bool = False,
    **kwargs: Any,
) -> psycopg.Connection[Any]:
    """Open a connection; ``role`` says what it is for in error messages ("source", ...).

    ``replication=True`` opens a ``replication=database`` walsender connection, the only kind
    that can create a slot with an exported snapshot.
    """
    extra: dict[str, Any] = {"application_name": "pgcdc_dagster", **kwargs}
    if replication:
        extra["replication"] = "database"
        autocommit = True
    try:
        return psycopg.connect(dsn, autocommit=autocommit, **extra)
    except psycopg.OperationalError as exc:
        reason = redact(str(exc).strip().splitlines()[-1] if str(exc).strip() else "", dsn)
        hint = ""
        if "password authentication failed" in reason or "no password supplied" in reason:
            hint = ": check the user and password in the connection string's environment variable"
        raise ConnectError(
            f"cannot connect to the {role} PostgreSQL {describe_dsn(dsn)}: {reason}{hint}"
        ) from None
