"""Work a command starts before its Dagster run exists, for the run to take over.

Why: a ``pgcdc`` command pays seconds to import Dagster, open its instance and create the run
before the run's first step (``benchmarks/catchup_cli.py``), and the work does not depend on
any of it: progress lives in the slot, the store and the origin, and the run only
records it. So the command takes the range lock at once, lends it to its run
(:func:`~.range_lock.range_lock` with ``lend=True``), starts the work here, and the run's step
:func:`adopt`\\ s it and reports it as its own. When the lock is taken elsewhere there is no
head start: the command waits for the holder as before.

What must hold: the work started here is exactly what the run would have started (same
settings, same endpos or options), it runs under the lent lock, and whoever started it waits
for it to end before releasing the lock, adopted or not. A process killed in between is a
crash like any other: the next command resumes from the durable state.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")


class HeadStart(Protocol):
    """Work started for a run to take over: a follower, a :class:`Background` call. Whoever
    started it closes it (waits for it to end) before the range lock goes, adopted or not."""

    def close(self, reason: str) -> None: ...


_started: dict[tuple[str, str], HeadStart] = {}
_lock = threading.Lock()


def offer(kind: str, slot: str, work: HeadStart) -> None:
    """Make ``work`` (a started follower, a :class:`Background` call) adoptable by this
    process's run of ``kind`` for ``slot``."""
    with _lock:
        _started[(kind, slot)] = work


def adopt(kind: str, slot: str) -> HeadStart | None:
    """The work :func:`offer`\\ ed for ``kind`` and ``slot``, once; ``None`` if there is none.
    The run of that kind narrows it to what it knows how to take over."""
    with _lock:
        return _started.pop((kind, slot), None)


class Background(Generic[T]):
    """A call running on its own thread; :meth:`result` waits for it and returns its value or
    raises its error, in the caller's thread."""

    def __init__(self, call: Callable[[], T], name: str) -> None:
        self._value: T | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(call,), name=name, daemon=True)
        self._thread.start()

    def _run(self, call: Callable[[], T]) -> None:
        try:
            self._value = call()
        except BaseException as exc:  # handed to result()'s caller
            self._error = exc

    def running(self) -> bool:
        return self._thread.is_alive()

    def close(self, reason: str) -> None:
        """Wait for the call to end (it cannot be stopped halfway; its error, if any, was
        reported by whoever adopted it, or is dropped with a run that never started)."""
        del reason
        while self._thread.is_alive():
            self._thread.join(timeout=0.2)

    def result(self, poll_s: float = 0.2) -> T:
        """Wait (in short joins, so signals and Dagster's interrupts reach the caller)."""
        while self._thread.is_alive():
            self._thread.join(timeout=poll_s)
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]
