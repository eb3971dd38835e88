"""The engine's progress in a Dagster run's log: one line every few seconds (and at every phase
change of a snapshot), so a long run says how far it is in the UI too."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..engine import progress

LOG_EVERY_S = 5.0


@contextlib.contextmanager
def logged(context: Any) -> Iterator[None]:
    state = {"last": 0.0, "phase": ""}
    lock = threading.Lock()

    def listener(report: progress.Progress) -> None:
        phase = getattr(report, "phase", "follow")
        now = time.monotonic()
        with lock:
            if phase == state["phase"] and now - float(state["last"]) < LOG_EVERY_S:
                return
            state["phase"], state["last"] = phase, now
        context.log.info(report.line())

    with progress.listening(listener):
        yield
