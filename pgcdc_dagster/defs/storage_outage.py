"""Dagster's own storage going away: named in one line, and ridden through by a follow run.

Why: Dagster's records are a view of the replication for people (progress lives in the slot,
the store and the target's origin), but a follow run writes to them for every range.
dagster-postgres retries a connection five times over about 6 s, so a storage server down for
longer (a restart, a failover) would end the follow with ``DagsterPostgresException: too many
retries for DB connection``, a line that names neither the server nor the fix (see
``benchmarks/HISTORY.md``, ``benchmarks/freshness.py --storage-outage 15``).

What must hold:

- A follow run goes on receiving and applying while the storage is away: its follower does not
  wait for the run's events (the ranges it finishes wait for :class:`StorageRide` in a
  backlog whose memory is bounded, past which they wait on disk: ``engine/follow/backlog.py``), and
  the run's progress log lines are written from a thread of their own
  (:mod:`.progress_log`), so a slow or absent storage never holds the follower.
- Each write is tried again, with growing pauses, until the storage answers; a range's events
  resume from the first one not written, so none is recorded twice. The wait is bounded by
  ``PGCDC_FOLLOW_RETRY``, the budget a follow has for any of its servers; past it the run
  ends with :class:`StorageUnavailableError`, and nothing is lost: the next follow goes on
  from the durable state and records its own ranges.
- Messages name the storage by host, port and database, never by its URL (it may hold a
  password).
- The ride covers the run's own writes from its first line (``following slot ...``) on.
  Dagster's writes before it (the run's and the step's start) cannot be retried from here: an
  outage then fails the run in one line naming the storage
  (:func:`~pgcdc_dagster.runner.failure_text`), while the follower the command started ends
  at a boundary; the next command or the sensor's next run goes on.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from ..engine.errors import PgcdcError
from ..engine.follow.outage_clock import OutageClock

T = TypeVar("T")


class StorageUnavailableError(PgcdcError):
    """Dagster's storage cannot be reached; the message names it (no secret) and the fix."""


def storage_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` (or an error it was raised from) says Dagster's SQL storage could not be
    reached or dropped the connection: dagster-postgres giving up its own retries, or
    SQLAlchemy's operational and interface errors (a refused, reset or closed connection), or
    the driver's own, unwrapped (Dagster writes some events on the DB-API connection itself: a
    kept connection the server dropped fails there with psycopg2's ``server closed the
    connection unexpectedly``). Errors of the statements themselves (a missing table, a
    constraint) are not. The pool giving up on reconnecting at checkout (a server that drops
    each new connection while it restarts) says ``This connection is closed`` in an
    ``InvalidRequestError``: that too."""
    from sqlalchemy import exc as sa

    return any(
        type(seen).__name__ == "DagsterPostgresException"
        or isinstance(seen, sa.OperationalError | sa.InterfaceError | sa.DisconnectionError)
        or (isinstance(seen, sa.DBAPIError) and seen.connection_invalidated)
        or (isinstance(seen, sa.InvalidRequestError) and str(seen) == CHECKOUT_GAVE_UP)
        or (
            type(seen).__module__.startswith("psycopg2")
            and type(seen).__name__ in {"OperationalError", "InterfaceError"}
        )
        for seen in _raised_from(exc)
    )


CHECKOUT_GAVE_UP = "This connection is closed"
"""SQLAlchemy's pool, when a checkout found its connections dead twice over
(``_ConnectionFairy._checkout``: ``Reconnection attempts exhausted on checkout``)."""


def _raised_from(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, then the error it was raised from or while handling, and so on."""
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__cause__ or seen.__context__


def _storage_url() -> Any:
    """``DAGSTER_POSTGRES_URL`` parsed (SQLAlchemy's URL), ``None`` when unset or unreadable."""
    url = os.environ.get("DAGSTER_POSTGRES_URL")
    if not url:
        return None
    try:
        from sqlalchemy.engine import make_url

        return make_url(url)
    except Exception:
        return None


def storage_name() -> str:
    """Dagster's storage as a message may name it: ``postgresql at host:port/database``."""
    parsed = _storage_url()
    if parsed is None:
        return "Dagster's storage (DAGSTER_POSTGRES_URL)"
    return (
        f"Dagster's storage (postgresql at {parsed.host or 'localhost'}:{parsed.port or 5432}"
        f"/{parsed.database or ''}, DAGSTER_POSTGRES_URL)"
    )


def unreachable_now(timeout_s: float = 3.0) -> str | None:
    """One try at Dagster's PostgreSQL storage, without dagster-postgres' retries (about 6 s
    each time it connects): libpq's first line when it cannot be reached, else ``None``
    (reached, or not PostgreSQL). For a command that reports on things when they are broken
    (``pgcdc status``) and must not wait on the storage to say so."""
    parsed = _storage_url()
    if parsed is None:
        return None
    try:
        import psycopg

        with psycopg.connect(
            host=parsed.host or "localhost",
            port=parsed.port or 5432,
            user=parsed.username or "",
            password=parsed.password or "",
            dbname=parsed.database or "",
            connect_timeout=max(1, round(timeout_s)),
        ):
            return None
    except Exception as exc:  # any failure: named by libpq's line, never the URL
        return _first_line(str(exc))


def storage_problem(exc: BaseException) -> str:
    """libpq's first line of what went wrong (``connection refused``, ``the database system is
    shutting down``), from ``exc`` or the errors it was raised from."""
    for seen in _raised_from(exc):
        original = getattr(seen, "orig", None)
        if original is not None:
            return _first_line(str(original))
        if type(seen).__module__.startswith("psycopg2"):
            return _first_line(str(seen))
    return _first_line(str(exc))


def _first_line(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "no answer"
    # psycopg2 says: connection to server at "127.0.0.1", port 5433 failed: Connection refused
    return line.split(" failed: ", 1)[-1].strip()


def unreachable_error(exc: BaseException, waited_s: float | None = None) -> StorageUnavailableError:
    """The one line for a command or run that cannot reach the storage."""
    return StorageUnavailableError(unreachable_line(storage_problem(exc), waited_s))


def unreachable_line(problem: str, waited_s: float | None = None) -> str:
    """:func:`unreachable_error`'s line, for ``problem`` (libpq's first line)."""
    waited = f" for {waited_s:.0f} s (PGCDC_FOLLOW_RETRY)" if waited_s is not None else ""
    return (
        f"{storage_name()} cannot be reached{waited}: {problem}. Start it or fix "
        "DAGSTER_POSTGRES_URL, then run the command again: the replication's progress is in "
        "the slot, the store and the target's origin, so nothing was lost"
    )


def recorded_storage_problem(error: Any) -> str | None:
    """libpq's first line when a run's recorded error (Dagster's serialised error, with its
    causes) is dagster-postgres giving up on the storage; ``None`` for any other error."""
    chain = []
    while error is not None:
        chain.append(error)
        error = error.cause or error.context
    if not any(seen.cls_name == "DagsterPostgresException" for seen in chain):
        return None
    return _first_line(chain[-1].message)


class StorageRide:
    """Writes of a long-lived run to Dagster's storage, each tried until the storage answers
    (see the module docstring). ``budget_s``: how long an outage may last (``None``: for ever;
    0: not at all). ``note``: where the run says the storage went away and came back while
    its own log cannot take it (the terminal of a command, the run worker's stderr)."""

    def __init__(
        self,
        budget_s: float | None,
        note: Callable[[str], None] | None = None,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.outages = OutageClock(budget_s)
        self.note = note or _to_stderr
        self.stopping = stopping
        self.back_notes: list[str] = []
        """What to write in the run's log once it takes writes again (the outages it missed)."""

    def write(self, call: Callable[[], T]) -> T:
        """``call()``, tried again while it fails because the storage is away."""
        while True:
            tried_at = time.monotonic()
            try:
                result = call()
            except Exception as exc:
                if not storage_unreachable(exc):
                    raise
                self._wait(exc, tried_at)
                continue
            away = self.outages.ended()
            if away is not None:
                line = f"{storage_name()} is back after {away:.1f} s"
                self.note(line)
                self.back_notes.append(line)
            return result

    def _wait(self, exc: BaseException, tried_at: float) -> None:
        """Wait before the next try; an outage counts from the start of its first failed try
        (dagster-postgres retried for seconds before giving up)."""
        if self.stopping():
            raise StorageUnavailableError(
                f"{storage_name()} cannot be reached: {storage_problem(exc)}; the follow "
                "stopped as asked while it was away, so the ranges it applied meanwhile are on "
                "the target and in its origin but not in Dagster (the next run's ranges are)"
            ) from exc
        away, pause = self.outages.failed(began=tried_at)
        if self.outages.spent(away):
            raise unreachable_error(exc, away) from exc
        self.note(
            f"{storage_name()} cannot be reached: {storage_problem(exc)}; the follow goes on "
            f"applying, and records its ranges' events when it is back (trying again in "
            f"{pause:g} s, {away:.0f} s away)"
        )
        deadline = time.monotonic() + pause
        while time.monotonic() < deadline and not self.stopping():
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


class QuietRetries(logging.Filter):
    """Drops dagster-postgres' warnings about its connection retries (five a failed write,
    each with libpq's message and SQLAlchemy's pointer to its docs) from the root logger of a
    process of ours: there, what the storage's outage means is said in one line, by
    :class:`StorageRide` or by the command's error."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Retrying failed database connection")


class QuietLostResets(logging.Filter):
    """Drops SQLAlchemy's ``Exception during reset or similar`` (an error with a traceback)
    when what failed was giving back a connection the storage had already dropped: the
    outage is said in one line elsewhere, and the traceback would read as a crash. A reset
    that fails for any other reason still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("Exception during reset"):
            return True
        failed = record.exc_info[1] if record.exc_info else None
        return failed is None or not _connection_lost(failed)


def _connection_lost(exc: BaseException) -> bool:
    """Whether the DB-API error ``exc`` says the connection is gone: what
    :func:`storage_unreachable` says, or the socket's own error."""
    return storage_unreachable(exc) or any(
        isinstance(seen, ConnectionError) for seen in _raised_from(exc)
    )


_QUIET = QuietRetries()
_QUIET_RESETS = QuietLostResets()
POOL_LOGGERS = ("sqlalchemy.pool.impl.NullPool", "sqlalchemy.pool.impl.QueuePool")
"""Where SQLAlchemy's pools of Dagster's storage log (a filter applies at the logger a record
is made at, not at its parents): dagster-postgres uses ``NullPool``."""


def quiet_storage_retries() -> None:
    """Install :class:`QuietRetries` on this process's root logger, and
    :class:`QuietLostResets` on SQLAlchemy's pool loggers (idempotent)."""
    root = logging.getLogger()
    if _QUIET not in root.filters:
        root.addFilter(_QUIET)
    for name in POOL_LOGGERS:
        pool = logging.getLogger(name)
        if _QUIET_RESETS not in pool.filters:
            pool.addFilter(_QUIET_RESETS)


def _to_stderr(line: str) -> None:
    print(f"pgcdc: {line}", file=sys.stderr, flush=True)


_given_up: list[StorageUnavailableError] = []


def give_up(exc: StorageUnavailableError) -> None:
    """Say that a run of this process ended on ``exc`` with its work stopped at a boundary:
    the command that started it need not wait for Dagster to fail at recording the failure
    (dagster-postgres' retries, about 6 s for each of the run's last events)."""
    _given_up.append(exc)


def given_up() -> StorageUnavailableError | None:
    """What :func:`give_up` was handed, if anything."""
    return _given_up[0] if _given_up else None


def as_storage_error(exc: BaseException) -> BaseException:
    """For a command's error line: the :class:`StorageUnavailableError` ``exc`` is or was
    raised from (a run that ended on it, then could not record its failure), or a new one when
    ``exc`` says the storage is away; otherwise ``exc`` itself."""
    for seen in _raised_from(exc):
        if isinstance(seen, StorageUnavailableError):
            return seen
    return unreachable_error(exc) if storage_unreachable(exc) else exc
