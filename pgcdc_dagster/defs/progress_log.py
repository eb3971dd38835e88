"""The engine's progress in a Dagster run's log: one line every few seconds (and at every phase
change of a snapshot), so a long run says how far it is in the UI too."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ..engine import progress

LOG_EVERY_S = 5.0


@contextlib.contextmanager
def logged(context: Any) -> Iterator[None]:
    with progress.listening(progress.throttled(context.log.info, LOG_EVERY_S)):
        yield
