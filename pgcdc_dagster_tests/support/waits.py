"""Waiting in a test for what it checks (a row, a lock, a process), never for a fixed time."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable


def wait_for(
    condition: Callable[[], object],
    what: str,
    timeout: float = 90.0,
    alive: subprocess.Popen[str] | None = None,
) -> None:
    """Wait until ``condition()`` is true; fail naming ``what`` after ``timeout`` seconds, or at
    once if the process ``alive`` ended meanwhile."""
    deadline = time.monotonic() + timeout
    while not condition():
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"{what}: the process ended first (exit {alive.returncode})")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
