"""The engine's progress in a Dagster run's log: one line every few seconds (and at every phase
change of a snapshot), so a long run says how far it is in the UI too.

The lines are written by a thread of their own: a progress report is published by the thread
doing the work (a follower's, or the reader of a forked follower's reports, which also carries
its finished ranges), and a write to Dagster's storage may take seconds when the storage is
slow, or about 6 s and then fail while it is away (dagster-postgres' own retries, see
:mod:`.storage_outage`). The work must never wait for that. So lines queue here, at most
:data:`QUEUED_LINES` of them (the oldest go first: each line says where the work stands), and a
line that cannot be written is dropped.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ..engine import progress

LOG_EVERY_S = 5.0
QUEUED_LINES = 100
DRAIN_S = 5.0
"""How long the end of the work waits for queued lines to be written."""


class LogLines:
    """Lines handed to ``emit`` on a thread of their own, in order; see the module docstring."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self._emit = emit
        self._lines: collections.deque[str] = collections.deque(maxlen=QUEUED_LINES)
        self._ready = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._write, name="pgcdc-progress-log", daemon=True)
        self._thread.start()

    def put(self, line: str) -> None:
        with self._ready:
            self._lines.append(line)
            self._ready.notify()

    def close(self) -> None:
        """Write what is queued (for at most :data:`DRAIN_S`), then stop the thread."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(DRAIN_S)

    def drop(self) -> None:
        """Forget what is queued and stop the thread (the storage is gone for good)."""
        with self._ready:
            self._lines.clear()
            self._closed = True
            self._ready.notify()

    def _write(self) -> None:
        while True:
            with self._ready:
                while not self._lines and not self._closed:
                    self._ready.wait()
                if not self._lines:
                    return
                line = self._lines.popleft()
            with contextlib.suppress(Exception):  # the storage is away: the line is dropped
                self._emit(line)


@contextlib.contextmanager
def logged(context: Any) -> Iterator[LogLines]:
    lines = LogLines(context.log.info)
    try:
        with progress.listening(progress.throttled(lines.put, LOG_EVERY_S)):
            yield lines
    finally:
        lines.close()
