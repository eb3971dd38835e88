"""Progress of long work, for people: the engine publishes, whoever listens shows it.

A snapshot of 1 TB or a catch-up of a day's backlog must not be silent. The engine publishes
:class:`SnapshotProgress` (about once a second during the copy, and at each phase) and
:class:`FollowProgress` (after every range) to the listeners registered in this process: the
CLI draws them (a live display on a terminal, plain lines otherwise) and a Dagster run logs
them every few seconds. Nothing is decided on them, and with no listener nothing is measured.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from .catalog import rows_per_block
from .connect import connect
from .identifiers import TableName


@dataclass
class TableProgress:
    table: str
    rows: int = 0
    estimated_rows: int = 0
    bytes: int = 0
    """Bytes of the table on the target so far (its heap, as the copy writes it; reckoned from
    its rows while a frozen load's truncate hides the heap, see :meth:`CopyWatcher._measure`)."""
    estimated_bytes: int = 0
    """The source table's size: what the copy is heading for (an estimate)."""


@dataclass
class SnapshotProgress:
    phase: str
    """``slot`` (its creation waits for the source's open transactions, see
    :mod:`.source.slot_wait`), ``schema``, ``copy``, ``keys`` (post-data: indexes, constraints) or
    ``done``; around the copy of a table a resume continues, ``changed keys``, ``kept rows`` and
    ``changed rows`` (:mod:`.snapshot.continued`); ``compare`` and ``repair`` for a verify."""
    elapsed_s: float
    tables: list[TableProgress] = field(default_factory=list)
    mb_per_s: float = 0.0
    note: str = ""
    """What the phase waits for, when it waits (``slot``), or what it does (a step outside the
    copy's rows, a repair's count)."""
    work: str = "snapshot"
    """Whose copy: ``snapshot`` (the base snapshot), ``add-table`` (tables added later) or
    ``resync`` (tables copied again: ``pgcdc resync``, the rest of a resumed snapshot)."""

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables)

    @property
    def estimated_rows(self) -> int:
        return sum(t.estimated_rows for t in self.tables)

    @property
    def copied_bytes(self) -> int:
        return sum(t.bytes for t in self.tables)

    @property
    def estimated_bytes(self) -> int:
        return sum(t.estimated_bytes for t in self.tables)

    @property
    def eta_s(self) -> float | None:
        remaining = self.estimated_bytes - self.copied_bytes
        if self.phase != "copy" or self.mb_per_s <= 0 or remaining <= 0:
            return None
        return remaining / (self.mb_per_s * 1e6)

    def line(self) -> str:
        if self.note:
            return f"{self.work} {self.phase}: {self.note}, {self.elapsed_s:.0f} s"
        eta = f", ETA {self.eta_s:.0f} s" if self.eta_s is not None else ""
        return (
            f"{self.work} {self.phase}: {self.rows:,}/~{self.estimated_rows:,} rows, "
            f"{self.copied_bytes / 1e6:,.1f}/~{self.estimated_bytes / 1e6:,.1f} MB, "
            f"{self.mb_per_s:,.1f} MB/s{eta}, {self.elapsed_s:.0f} s"
        )


@dataclass
class FollowProgress:
    ranges: int
    transactions: int
    changes: int
    elapsed_s: float
    changes_per_s: float
    """Over the last few seconds."""
    lag_bytes: int | None
    """The source's WAL not yet received when the last range was cut."""
    range_key: str | None = None
    """The range this report follows (``None``: a report of an outage)."""
    note: str = ""
    """What a follow riding through an outage says (a server went away and when it tries
    again, or that the servers are back), or one that made way for ``pgcdc add-table``."""
    retrying: bool = False
    """Waiting for a server that went away (the phase ``retrying``, shown at once)."""
    waiting_for: str = ""
    """Whom the follow made way for, or what it waits for instead of following: a phase of its
    own for each, so each is shown at once."""

    @property
    def phase(self) -> str:
        """``retrying`` while waiting for a server, ``waiting for ...`` while it made way,
        ``noted: <note>`` for a report that the servers are back, that the source failed over
        or that it goes on (a phase of its own for each note, so a throttled log shows every
        one at once), else ``follow``."""
        if self.waiting_for:
            return f"waiting for {self.waiting_for}"
        return "retrying" if self.retrying else f"noted: {self.note}" if self.note else "follow"

    def line(self) -> str:
        lag = "-" if self.lag_bytes is None else f"{self.lag_bytes / 1e6:,.1f} MB"
        note = f"; {self.note}" if self.note else ""
        return (
            f"follow: {self.ranges:,} ranges, {self.transactions:,} transactions, "
            f"{self.changes:,} changes, {self.changes_per_s:,.0f} changes/s, lag {lag}, "
            f"{self.elapsed_s:.0f} s{note}"
        )


Progress = SnapshotProgress | FollowProgress
Listener = Callable[[Progress], None]

_listeners: list[Listener] = []
_lock = threading.Lock()


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Receive every progress report published in this process while inside."""
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)


def forward_only(listener: Listener) -> None:
    """In a forked child: forget the parent's listeners (its display is not ours to draw on)
    and its lock (a parent thread may have held it at the fork); hand every report to
    ``listener`` instead."""
    global _lock
    _lock = threading.Lock()
    _listeners[:] = [listener]


def active() -> bool:
    return bool(_listeners)


def publish(progress: Progress) -> None:
    """Hand ``progress`` to every listener; a listener's failure never stops the work."""
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        with contextlib.suppress(Exception):
            listener(progress)


STEADY_EVERY_S = 60.0
"""How often a plain log shows a follow that keeps up (see :func:`throttled`)."""
STEADY_LAG_BYTES = 1024 * 1024
"""A follow keeps up while less WAL than this waits unreceived when it cuts a range."""


def throttled(emit: Callable[[str], None], every_s: float) -> Listener:
    """A listener that hands ``emit`` a report's line at most every ``every_s`` seconds, and at
    once whenever the phase changes (a snapshot's ``schema``/``copy``/``keys``/``done``, an
    outage and the end of it): what a plain log wants, whether a terminal without a live
    display or a Dagster run's log.

    A follow that keeps up (:data:`STEADY_LAG_BYTES`) is shown every :data:`STEADY_EVERY_S`
    instead: it runs for weeks, and a line every 5 s is 17,280 a day in the run's event log
    (nothing prunes it) or in the command's log file, saying the same thing; a backlog being
    caught up is shown every ``every_s``."""
    last_phase, last_at = "", 0.0
    lock = threading.Lock()

    def listener(report: Progress) -> None:
        nonlocal last_phase, last_at
        phase = getattr(report, "phase", "follow")
        steady = (
            isinstance(report, FollowProgress)
            and report.lag_bytes is not None
            and report.lag_bytes < STEADY_LAG_BYTES
        )
        interval = max(every_s, STEADY_EVERY_S) if steady else every_s
        now = time.monotonic()
        with lock:
            if phase == last_phase and now - last_at < interval:
                return
            last_phase, last_at = phase, now
        emit(report.line())

    return listener


# -- the snapshot copy, watched from the target ---------------------------------------------

_TARGET_ROWS = """
SELECT c.oid, n.nspname, c.relname,
       CASE WHEN NOT EXISTS (SELECT FROM pg_locks l
                             WHERE l.locktype = 'relation' AND l.relation = c.oid
                               AND l.database = (SELECT oid FROM pg_database
                                                 WHERE datname = current_database())
                               AND l.mode = 'AccessExclusiveLock')
            THEN pg_table_size(c.oid) END,
       coalesce(s.n_tup_ins, 0),
       coalesce((SELECT sum(p.tuples_processed) FROM pg_stat_progress_copy p
                 WHERE p.relid = c.oid AND p.command = 'COPY FROM'), 0)
FROM pg_class c
JOIN pg_namespace n ON n.oid = c.relnamespace
LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
WHERE (n.nspname, c.relname) IN (SELECT * FROM unnest(%s::text[], %s::text[]))
"""

_SOURCE_SIZES = """
SELECT n.nspname, c.relname, c.reltuples, c.relpages,
       pg_relation_size(c.oid) / current_setting('block_size')::int,
       current_setting('block_size')::int,
       ARRAY(SELECT t.typlen FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
             WHERE a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
               AND a.attgenerated = ''),  -- the columns the planner sizes: those copied
       pg_table_size(c.oid)
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE (n.nspname, c.relname) IN (SELECT * FROM unnest(%s::text[], %s::text[]))
"""


class CopyWatcher:
    """Publishes :class:`SnapshotProgress` once a second while the tables are copied.

    Rows on the target are the committed inserts of the table (``pg_stat_user_tables``, taken
    relative to the start) plus the rows of the COPYs still running (``pg_stat_progress_copy``),
    so Spark's tasks and the driver's are seen alike, from outside them."""

    def __init__(
        self,
        source_dsn: str,
        target_dsn: str,
        tables: Sequence[TableName],
        started: float,
        work: str = "snapshot",
    ) -> None:
        self.target_dsn = target_dsn
        self.work = work
        self.names = ([t.schema for t in tables], [t.name for t in tables])
        self.started = started
        self.estimates: dict[str, tuple[int, int]] = {}
        self.baseline: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: tuple[float, int] | None = None
        self._waiting = ""
        self._flowing_since = time.monotonic()
        self._copy_rate: float | None = None
        """The copy's average MB/s, from its first row flowing to its end: what the lines of
        the phases after it show."""
        if active():
            with connect(source_dsn, role="source", autocommit=True) as src:
                for schema, name, tuples, pages, blocks, block, typlens, size in src.execute(
                    _SOURCE_SIZES, self.names
                ):
                    rows = int(blocks * rows_per_block(tuples, pages, block, typlens))
                    self.estimates[str(TableName(schema, name))] = (rows, int(size))

    def phase(self, phase: str) -> None:
        if not active():
            return
        if self._thread is None and not self._stop.is_set():
            # Before the copy: nothing copied yet (a re-snapshot's tables still count the
            # inserts of the copy before; the baseline is taken as the copy starts).
            elapsed = time.monotonic() - self.started
            publish(SnapshotProgress(phase, elapsed, self._ahead(), work=self.work))
        else:
            publish(self._measure(phase))

    def note(self, phase: str, note: str) -> None:
        """A step of the copy's work outside a phase of rows (a continued table's changed keys,
        :mod:`.snapshot.continued`), said as it begins."""
        if active():
            elapsed = time.monotonic() - self.started
            publish(SnapshotProgress(phase, elapsed, note=note, work=self.work))

    def _ahead(self) -> list[TableProgress]:
        return [
            TableProgress(key, 0, rows, 0, size) for key, (rows, size) in self.estimates.items()
        ]

    def waiting(self, note: str) -> None:
        """What the copy waits for before its rows flow (Spark starting on a cluster, its
        executors being checked), said in the copy's lines instead of a rate of 0 MB/s; an
        empty ``note`` once the rows flow."""
        self._waiting = note
        if not note:
            self._flowing_since = time.monotonic()
        if active() and note:
            self._publish_copy()

    def __enter__(self) -> CopyWatcher:
        self._flowing_since = time.monotonic()
        if active():
            self.baseline = {t.table: t.rows for t in self._measure("copy").tables}
            elapsed = time.monotonic() - self.started
            publish(SnapshotProgress("copy", elapsed, self._ahead(), work=self.work))
            self._thread = threading.Thread(target=self._run, name="pgcdc-copy-progress")
            self._thread.daemon = True
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            final = self._measure("copy")
            flowed = time.monotonic() - self._flowing_since
            self._copy_rate = final.copied_bytes / flowed / 1e6 if flowed > 0 else 0.0
            final.mb_per_s = self._copy_rate
            publish(final)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self._publish_copy()

    def _publish_copy(self) -> None:
        """One reading of the copy, saying what it waits for while it waits (a reading lost
        to a busy server is just a gap in the lines)."""
        with contextlib.suppress(Exception):
            reading = self._measure("copy")
            reading.note = self._waiting
            publish(reading)

    def _measure(self, phase: str) -> SnapshotProgress:
        """One reading of the target. A table loaded frozen is truncated first, in the copy's
        transaction: its size cannot be read until that commits (``pg_table_size`` would wait
        for the truncate's lock, and sees the old, empty file anyway), so its bytes are then
        reckoned from its rows; ``lock_timeout`` keeps a reading that races the truncate from
        waiting out the whole copy."""
        tables = []
        with connect(self.target_dsn, role="target", autocommit=True) as tgt:
            tgt.execute("SET lock_timeout = 200")
            rows = tgt.execute(_TARGET_ROWS, self.names)
            for _, schema, name, size, inserted, in_flight in rows:
                key = str(TableName(schema, name))
                est_rows, est_bytes = self.estimates.get(key, (0, 0))
                done = int(inserted) + int(in_flight) - self.baseline.get(key, 0)
                if size is None:
                    size = est_bytes * min(1.0, done / est_rows) if est_rows > 0 else 0
                tables.append(TableProgress(key, done, est_rows, int(size), est_bytes))
        now = time.monotonic()
        copied = sum(t.bytes for t in tables)
        rate = 0.0
        if phase != "copy" and self._copy_rate is not None:
            rate = self._copy_rate  # after the copy: what it averaged
        elif self._last is not None and now > self._last[0]:
            rate = max(0.0, (copied - self._last[1]) / (now - self._last[0]) / 1e6)
        self._last = (now, copied)
        return SnapshotProgress(phase, now - self.started, tables, rate, work=self.work)
