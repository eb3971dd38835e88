"""Signals and workers: a follow stopped at a range boundary by SIGTERM or SIGINT, its run on a
worker thread so the signals stay the command's, and the range lock taken before Dagster
loads (the head start)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ..engine.settings import ReplicationSettings
from ..runner import run_job

_stop_requested = False


@contextlib.contextmanager
def stops_at_boundary() -> Iterator[None]:
    """SIGTERM and SIGINT stop the follow at a range boundary (exit 0): the first one sets the
    stop, a second one interrupts as usual."""

    from ..engine.follow.follower import stop_all

    def handler(signum: int, frame: Any) -> None:
        global _stop_requested
        if _stop_requested:
            raise KeyboardInterrupt
        _stop_requested = True
        stop_all(f"stopped by {signal.Signals(signum).name}")  # a head start's follower too
        print(
            f"pgcdc: {signal.Signals(signum).name}: stopping at the next range boundary",
            file=sys.stderr,
        )

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_in_worker(run_config: dict[str, Any]) -> Any:
    """Run the follow job on a worker thread: Dagster installs its own SIGINT/SIGTERM handlers
    only on the main thread (they turn a signal into an interrupted, failed step), so here the
    signals stay ours (:func:`stops_at_boundary`), and a stop reaches the follower once it
    runs."""
    from ..defs.storage_outage import given_up
    from ..engine.follow.follower import stop_all

    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["result"] = run_job("follow", run_config=run_config)
        except BaseException as exc:  # re-raised on the main thread
            outcome["error"] = exc

    worker = threading.Thread(target=work, name="pgcdc-follow-run", daemon=True)
    worker.start()
    while worker.is_alive():
        if _stop_requested:
            stop_all("stopped by a signal")  # again each turn: the follower may start late
        if (gone := given_up()) is not None:
            raise gone  # the follower has stopped; Dagster cannot record the run's end
        worker.join(timeout=0.2)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["result"]


@contextlib.contextmanager
def lock_and_start(settings: ReplicationSettings, kind: str, start: Any) -> Iterator[bool]:
    """Take the range lock and ``start()`` the work at once, before Dagster is even imported;
    the run adopts both (see :mod:`pgcdc_dagster.engine.control.head_start`). Yields whether it did:
    with the lock held elsewhere it does nothing, and :func:`clear_the_way` waits as usual.
    On the way out it waits for the work to end (adopted or not) before the lock goes."""
    from ..engine.control.head_start import adopt
    from ..engine.control.range_lock import RangeBusyError, command_holder, range_lock

    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(
                range_lock(settings.target_dsn, settings.slot, command_holder(), lend=True)
            )
        except RangeBusyError:
            yield False
            return
        work = start()
        try:
            yield True
        finally:
            adopt(kind, settings.slot)  # not adopted if the run never started: it ends here
            work.close("the command ended")  # the run has closed it when it ran


def stop_requested() -> bool:
    """Whether SIGTERM or SIGINT asked the command to stop."""
    return _stop_requested
