"""The one connection helper, and the rule that no credential ever leaves it.

Connection strings come from the environment and may hold passwords. Every error raised here
names the server by host, port, database and user only; the conninfo itself is never echoed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from .errors import PgcdcError


class ConnectError(PgcdcError):
    """A server could not be reached or refused us; the message is safe to log."""


class ServerGoneError(ConnectError):
    """A server went away (crash, restart, network) in the middle of a step."""


class ServerUnavailableError(ConnectError):
    """A server could not be reached or would not take a connection now (down, restarting,
    out of connection slots, a network failure): a condition that passes, unlike a wrong
    password, a missing database or a refused role (plain :class:`ConnectError`)."""


_LASTING = (
    "password authentication failed",
    "no password supplied",
    "does not exist",
    "no pg_hba.conf entry",
    "permission denied",
    "not permitted to log in",
    "certificate",
    "invalid ",
)
"""What a connection refused for a reason that a retry does not change says."""


def unavailable(exc: BaseException) -> bool:
    """Whether ``exc`` says a server is away for now (:class:`ServerGoneError` in the middle
    of a step, :class:`ServerUnavailableError` at a connection, or a connection lost where no
    step named its server: :func:`connection_lost`): what a long-lived follow rides through by
    retrying, where every other error ends it."""
    return isinstance(exc, ServerGoneError | ServerUnavailableError) or connection_lost(exc)


_SERVER_AWAY_STATES = ("57P01", "57P02", "57P03")
"""``admin_shutdown``, ``crash_shutdown``, ``cannot_connect_now``: the server is stopping,
restarting after a crash, or not yet taking sessions."""


def connection_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is psycopg's word that the server went away: the connection broke with no
    SQLSTATE (libpq's "server closed the connection unexpectedly"), a class 08 connection
    exception, or the server shutting down or starting up. Why: a query outside any
    :func:`server_errors` (a check between ranges, the set-up of a new session) meets a server
    crash as such an error, and a follow must ride it through as it rides the same crash met
    inside an apply; a timeout, a lock not granted or a statement's own error is not one."""
    if not isinstance(exc, psycopg.OperationalError):
        return False
    state = exc.sqlstate
    return state is None or state.startswith("08") or state in _SERVER_AWAY_STATES


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

    Every session speaks :data:`CLIENT_ENCODING` whatever the DSN says, and sets
    :data:`SESSION_DEFAULTS` before the options it was given and :data:`SESSION_SETTINGS`
    after them (see there).
    """
    extra: dict[str, Any] = {
        "application_name": "pgcdc_dagster",
        **kwargs,
        "client_encoding": CLIENT_ENCODING,
    }
    given = given_options(dsn, kwargs.get("options"))
    extra["options"] = session_options(dsn, given)
    if replication:
        extra["replication"] = "database"
        autocommit = True
    try:
        conn = psycopg.connect(dsn, autocommit=autocommit, **extra)
    except psycopg.OperationalError as exc:
        # libpq's lines: what failed, then a hint ("Is the server running...?"), per host tried.
        reason = redact(" ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip()), dsn)
        hint = ""
        if "password authentication failed" in reason or "no password supplied" in reason:
            hint = ": check the user and password in the connection string's environment variable"
        lasting = any(marker in str(exc) for marker in _LASTING)
        raise (ConnectError if lasting else ServerUnavailableError)(
            f"cannot connect to the {role} PostgreSQL {describe_dsn(dsn)}: {reason}{hint}"
        ) from None
    newer = [
        sql.SQL("SET {} = 0").format(sql.Identifier(name))
        for since, name in NEWER_TIMEOUTS
        if conn.info.server_version >= since and name not in given
    ]
    if newer:
        try:
            conn.execute(sql.SQL("; ").join(newer))
            if not autocommit:
                conn.commit()  # a session setting made in a transaction lasts only if it commits
        except psycopg.OperationalError as exc:  # the server went away just after it let us in
            conn.close()
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ServerUnavailableError(
                f"cannot connect to the {role} PostgreSQL {describe_dsn(dsn)}: {redact(first, dsn)}"
            ) from None
    return conn


NEWER_TIMEOUTS = (
    (140000, "idle_session_timeout"),
    (140000, "client_connection_check_interval"),
    (170000, "transaction_timeout"),
)
"""The timeouts of newer servers (the server version that has each), set to 0 as
:data:`SESSION_DEFAULTS` are unless the connection's own options name them; by a ``SET`` after
connecting, because a startup option a server does not know refuses the connection (a ``SET``
costs a connection less than reading ``pg_settings`` for where each came from; see
``benchmarks/HISTORY.md``, ``benchmarks/catchup_cli.py``, and "Sessions: their settings and
set-up").

Why: ``idle_session_timeout`` (PostgreSQL 14) ends a session idle outside a transaction, as
the range lock's is for as long as a snapshot or a follow runs, and the follower's target
session between ranges of an idle source: with 1 s of it on the target, ``pgcdc snapshot``
fails ("terminating connection due to idle-session timeout"), and so does a snapshot longer
than a production setting of minutes. ``transaction_timeout`` (17) would end a copy's or a
range's transaction the same way (tested on 18). ``client_connection_check_interval`` (14)
would abort a statement whose client it finds gone: the apply's final message, the origin's
mark with its COMMIT (:func:`~.apply.origin.marked_commit`), must run whole once sent. The
libpq tools (``pg_dump``, the ``psql`` copy pairs) are not covered: they
never idle outside a transaction, and on 17 a long copy would meet ``transaction_timeout``."""


CLIENT_ENCODING = "UTF8"
"""The client encoding of every session and libpq tool the engine starts.

Why: the engine handles text as UTF-8 bytes (pgoutput values go into Arrow strings, Arrow
strings go into COPY and into inline literals, ``pg_restore --list`` names are matched with
catalog names), and PostgreSQL converts between a session's client encoding and the database's
both ways: pgoutput's values too, in the session that reads the slot (``café`` in a LATIN1
database peeks as ``636166e9`` under LATIN1 and ``636166c3a9`` under UTF8). Left to the default
(the database's own encoding), a LATIN1 source fails its snapshot on a table named ``größe``
(``pg_restore --list`` output read as UTF-8), and would fail on its first non-ASCII change.
Native logical replication does the same: its subscriber asks the publisher for its own
database's encoding. What cannot be converted (a character the target's encoding lacks; bytes
that are not UTF-8 in a ``SQL_ASCII`` database, which PostgreSQL never converts) fails with the
server's error, as it does natively."""

SESSION_SETTINGS = (
    "-c jit=off -c DateStyle=ISO -c IntervalStyle=postgres -c extra_float_digits=3 "
    "-c row_security=off -c xmloption=content"
)
"""What every session and libpq tool the engine starts sets, after the options it was given.

* ``jit=off``: this project's own queries are catalog reads and set-based statements whose
  plans PostgreSQL's estimates can push past ``jit_above_cost`` (an ``unnest`` of the table
  oids is estimated at 100 rows, a set-returning function at 1,000) although they touch a few
  hundred rows: with hundreds of published tables, JIT compilation is nearly all of the
  preflight's one query (see ``benchmarks/HISTORY.md``, ``benchmarks/many_tables.py`` and
  "Sessions: their settings and set-up"). Nothing here scans enough rows for compiled
  expressions to pay back.
* The value formats, as native logical replication sets them on its walsender session: text
  values cross from the source's output functions to the target's input functions, and both
  follow the session's settings, the slot's decoded changes included. Left to a database's or
  role's own (``ALTER DATABASE ... SET DateStyle = 'SQL, DMY'``, ``extra_float_digits = 0``),
  a change of ``2026-03-04`` arrives as ``04/03/2026`` and the target, in ``ISO, MDY``, stores
  April 3rd; a ``float8`` of ``0.30000000000000004`` arrives as ``0.3``. ``DateStyle=ISO``
  (unambiguous year-month-day, read the same under every ``DateStyle``),
  ``IntervalStyle=postgres`` and ``extra_float_digits=3`` (every float exact) make the text
  mean one value on both sides. ``xmloption=content`` (as in pg_dump's scripts): an ``xml``
  value may be a fragment (``abc<b/>``), which a database set to ``DOCUMENT`` refuses to read.
* ``row_security=off``, as pg_dump sets it: a read or write that a row-level security policy
  would filter fails instead. Left on, a role under a policy has the base snapshot copy only
  the rows the policy shows it, without a word, while the change stream, which no policy
  filters, carries them all. The source's preflight names the fix first
  (:mod:`.source.preflight`)."""


SESSION_DEFAULTS = (
    "-c statement_timeout=0 -c lock_timeout=0 -c idle_in_transaction_session_timeout=0"
)
"""What every session and libpq tool the engine starts sets *before* the options it was
given, so that a DSN's own ``options`` or ``PGOPTIONS`` may still set them, but not a database's
or role's settings (``ALTER DATABASE ... SET``), which are meant for its applications.

Why: a copy, a merge or a held snapshot of this project runs as long as the data needs, as
pg_dump's and pg_restore's sessions do, which set the same three to 0. With 500 ms of each on
the database, a source's ends the connection that exported the snapshot while the copies start
("invalid snapshot identifier"), and a target's cancels the copy of any table that takes longer.
Only settings every supported server knows (9.6 and later) go here: an unknown one in the
startup packet refuses the connection (``idle_session_timeout``, 14 and later, is not set for
that reason)."""


def given_options(dsn: str, options: str | None = None) -> str:
    """The ``options`` a session is given: ``options``, else the DSN's, else ``PGOPTIONS``
    (which libpq reads only when none is given)."""
    if options is not None:
        return options
    try:
        given = conninfo_to_dict(dsn).get("options")
    except psycopg.ProgrammingError:
        given = None
    return str(given) if given is not None else os.environ.get("PGOPTIONS", "")


def session_options(dsn: str, options: str | None = None) -> str:
    """The session's ``options``: :data:`SESSION_DEFAULTS`, then those given
    (:func:`given_options`), then :data:`SESSION_SETTINGS`, which win."""
    given = given_options(dsn, options)
    return " ".join(part for part in (SESSION_DEFAULTS, given, SESSION_SETTINGS) if part)


@contextmanager
def server_errors(role: str, dsn: str) -> Iterator[None]:
    """Turn a connection lost mid-step into one line naming the server and what to do.

    Nothing durable is half done when that happens (a range is stored, a transaction applied,
    or neither), so the fix is always to bring the server back and run the step again.
    """
    try:
        yield
    except psycopg.OperationalError as exc:
        lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
        reason = redact(lines[0] if lines else type(exc).__name__, dsn)
        raise ServerGoneError(
            f"lost the connection to the {role} PostgreSQL {describe_dsn(dsn)}: {reason}: check "
            "that the server is up, then run the catch-up again (nothing is lost: it resumes "
            "from the output store and the target's replication origin)"
        ) from exc


# -- libpq command-line tools (pg_dump, psql, pgbench; found by .postgres_installs) ----------


_LIBPQ_ENVIRONMENT = {
    "host": "PGHOST",
    "hostaddr": "PGHOSTADDR",
    "port": "PGPORT",
    "dbname": "PGDATABASE",
    "user": "PGUSER",
    "password": "PGPASSWORD",
    "passfile": "PGPASSFILE",
    "service": "PGSERVICE",
    "options": "PGOPTIONS",
    "application_name": "PGAPPNAME",
    "client_encoding": "PGCLIENTENCODING",
    "connect_timeout": "PGCONNECT_TIMEOUT",
    "sslmode": "PGSSLMODE",
    "requiressl": "PGREQUIRESSL",
    "sslcompression": "PGSSLCOMPRESSION",
    "sslcert": "PGSSLCERT",
    "sslkey": "PGSSLKEY",
    "sslrootcert": "PGSSLROOTCERT",
    "sslcrl": "PGSSLCRL",
    "sslcrldir": "PGSSLCRLDIR",
    "sslsni": "PGSSLSNI",
    "requirepeer": "PGREQUIREPEER",
    "ssl_min_protocol_version": "PGSSLMINPROTOCOLVERSION",
    "ssl_max_protocol_version": "PGSSLMAXPROTOCOLVERSION",
    "gssencmode": "PGGSSENCMODE",
    "krbsrvname": "PGKRBSRVNAME",
    "gsslib": "PGGSSLIB",
    "target_session_attrs": "PGTARGETSESSIONATTRS",
    "channel_binding": "PGCHANNELBINDING",
    "require_auth": "PGREQUIREAUTH",
    "load_balance_hosts": "PGLOADBALANCEHOSTS",
}
_SECRET_PARAMETERS = frozenset({"password", "sslpassword"})


def libpq_tool_environment(dsn: str) -> tuple[dict[str, str], list[str]]:
    """The environment and the extra arguments that make a libpq tool connect as ``dsn`` does.

    Everything with a ``PG*`` variable goes into the environment; the rare parameter without one
    (keepalives, say) goes into a ``--dbname`` conninfo, which is safe because no secret lacks a
    variable except ``sslpassword``, which is refused.
    """
    params = {key: str(value) for key, value in conninfo_to_dict(dsn).items() if value is not None}
    params["client_encoding"] = CLIENT_ENCODING  # pg_dump's archive too (see there)
    params["options"] = session_options(dsn)
    env = {"PGAPPNAME": "pgcdc_dagster"}
    leftover: dict[str, str] = {}
    for key, value in params.items():
        if key in _LIBPQ_ENVIRONMENT:
            env[_LIBPQ_ENVIRONMENT[key]] = value
        elif key in _SECRET_PARAMETERS:
            raise ConnectError(
                f"connection parameter {key} of {describe_dsn(dsn)} cannot be handed to a libpq "
                "tool (pg_dump, psql, pgbench) without showing it on its command line: use a "
                "client key without a passphrase, or a service file (PGSERVICEFILE)"
            )
        else:
            leftover[key] = value
    if not leftover:
        return env, []
    if "dbname" in params:
        leftover["dbname"] = params["dbname"]
    return env, [f"--dbname={make_conninfo(**leftover)}"]
