"""The followers running in this process, so a signal handler can stop them all at their next
range boundary (:func:`stop_all`)."""

from __future__ import annotations

import threading

from .results import Following

_active: set[Following] = set()


active_lock = threading.RLock()
"""Reentrant: :func:`stop_all` runs in signal handlers, which may interrupt a holder on the
same (main) thread."""


def stop_all(reason: str) -> int:
    """Stop every follower running in this process at its next range boundary (a signal
    handler's job: it only sets events). Returns how many there were."""
    with active_lock:
        followers = list(_active)
    for follower in followers:
        follower.stop(reason)
    return len(followers)


def track(follower: Following) -> None:
    """Let :func:`stop_all` reach ``follower`` until :func:`untrack`."""
    with active_lock:
        _active.add(follower)


def untrack(follower: Following) -> None:
    with active_lock:
        _active.discard(follower)
