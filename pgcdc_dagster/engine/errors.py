"""The engine's errors: one base class, so every caller can tell "a problem the user must act
on" (one line: the object, the problem, the fix) from a bug (a traceback).

Messages never carry a connection string or a password: servers are named by
:func:`~pgcdc_dagster.engine.connect.describe_dsn` only.
"""

from __future__ import annotations


class PgcdcError(RuntimeError):
    """A problem the user must act on; ``str()`` is one line that names the fix."""


class ApplyError(PgcdcError):
    """A range cannot be applied; the message names the object, the problem and the fix."""


class OriginError(ApplyError):
    """The target's replication origin is missing, unset or held by another session."""
