"""The ranges a follower has applied and its run has not yet recorded: a queue whose memory
stays bounded however far the recording falls behind.

Why: a follower never waits for its run's records (Dagster's storage going away is ridden
through, see ``defs/storage_outage.py``), so the ranges it applies meanwhile wait in this queue.
Each holds its watermarks, counts and per-table apply figures, and with
``PGCDC_FOLLOW_RETRY=forever`` an outage of Dagster's storage has no end: a day of it at
5 ranges a second is 432,000 ranges, which a plain queue would hold in memory however many
there are (see ``benchmarks/backlog_memory.py`` and its entry in ``benchmarks/HISTORY.md``).

How: the first :data:`BACKLOG_KEPT` items wait in memory; past them, items are pickled to an
unlinked temporary file and read back in order once the memory has room, so memory stays
bounded and the disk holds each waiting item once, for the cost of pickling each and reading
it back (the figures: ``benchmarks/backlog_memory.py`` in ``benchmarks/HISTORY.md``). The file
has no name: it is gone when the queue is closed or its process ends, however it ends (a crash
loses nothing durable: the records are a view, and the next run records its own ranges).

What must hold: items come out in the order they went in (memory first, then the file, and
nothing new overtakes the file while it holds items); items must pickle (a follow's finished
ranges do: they already cross a pipe from a forked follower); one thread puts, one gets.
"""

from __future__ import annotations

import collections
import pickle
import queue
import tempfile
import threading
from typing import IO, Any

BACKLOG_KEPT = 1000
"""Items a backlog keeps in memory, the rest waiting on disk: few enough that a follow's ranges
take little memory (see ``benchmarks/backlog_memory.py``)."""


class Backlog:
    """A FIFO queue with :meth:`put` and :meth:`get` as :class:`queue.Queue` has them, that
    holds at most ``kept`` items in memory and the rest in an unlinked temporary file."""

    def __init__(self, kept: int | None = None) -> None:
        self.kept = BACKLOG_KEPT if kept is None else max(1, kept)
        self._memory: collections.deque[Any] = collections.deque()
        self._file: IO[bytes] | None = None
        self._read_at = 0
        self._on_disk = 0
        self._ready = threading.Condition()
        self.spilled = 0
        """Items that went through the file, in all (for reports and tests)."""

    def put(self, item: Any) -> None:
        with self._ready:
            if self._on_disk or len(self._memory) >= self.kept:
                self._spill(item)
            else:
                self._memory.append(item)
            self._ready.notify()

    def get(self, timeout: float | None = None) -> Any:
        """The oldest item; :class:`queue.Empty` if none came within ``timeout`` seconds."""
        with self._ready:
            if not self._memory and not self._on_disk:
                self._ready.wait(timeout)
            if not self._memory and self._on_disk:
                self._refill()
            if not self._memory:
                raise queue.Empty
            return self._memory.popleft()

    def qsize(self) -> int:
        with self._ready:
            return len(self._memory) + self._on_disk

    @property
    def in_memory(self) -> int:
        with self._ready:
            return len(self._memory)

    def close(self) -> None:
        """Drop what waits on disk (the file goes with it)."""
        with self._ready:
            if self._file is not None:
                self._file.close()
                self._file = None
            self._on_disk = 0

    def _spill(self, item: Any) -> None:
        if self._file is None:
            self._file = tempfile.TemporaryFile(prefix="pgcdc-backlog-")  # noqa: SIM115 (kept open)
            self._read_at = 0
        self._file.seek(0, 2)
        pickle.dump(item, self._file, protocol=pickle.HIGHEST_PROTOCOL)
        self._on_disk += 1
        self.spilled += 1

    def _refill(self) -> None:
        """Read back, in order, as many items as memory keeps; an emptied file is truncated,
        so a backlog that drains between outages does not keep the disk of the last one."""
        assert self._file is not None
        self._file.seek(self._read_at)
        while self._on_disk and len(self._memory) < self.kept:
            self._memory.append(pickle.load(self._file))
            self._on_disk -= 1
        self._read_at = self._file.tell()
        if not self._on_disk:
            self._file.seek(0)
            self._file.truncate()
            self._read_at = 0
