"""How a long-lived follow paces its waits for a server that went away, and counts them.

One clock per kind of outage a follow rides through: its source and target
(:class:`~.follower.Follower`), and Dagster's storage (``defs/storage_outage.py``). Both wait
0.5 s after the first failure, then try every second, and give up once the outage is
``PGCDC_FOLLOW_RETRY`` old. Every second, not a growing pause: a try is one connection, and a
failover is over when the standby is promoted, which no pause can foresee, and a growing
pause would find the promoted standby up to that pause late (``benchmarks/failover.py``).

What must hold: an outage begins at its first failed try (or earlier, when the caller knows
the try itself took seconds) and ends once, when the server answers again or the follow
stops; ``total_s`` counts every ended outage.
"""

from __future__ import annotations

import time

RETRY_FIRST_S = 0.5
RETRY_MAX_S = 1.0
"""A follow that lost a server tries again after 0.5 s, then every second."""


class OutageClock:
    """The outages of one kind of server: how many, how long in all, and the current one."""

    def __init__(self, budget_s: float | None) -> None:
        self.budget_s = budget_s
        """How old an outage may grow before the follow gives up (``None``: never)."""
        self.count = 0
        self.total_s = 0.0
        self._since: float | None = None
        self._pause = RETRY_FIRST_S

    @property
    def under_way(self) -> bool:
        return self._since is not None

    def failed(self, began: float | None = None) -> tuple[float, float]:
        """A try failed: the seconds the current outage has lasted (one begins now, or at
        ``began``, if none is under way) and the pause before the next try."""
        now = time.monotonic()
        if self._since is None:
            self._since = now if began is None else began
            self._pause = RETRY_FIRST_S
            self.count += 1
        pause = self._pause
        self._pause = min(RETRY_MAX_S, pause * 2)
        return now - self._since, pause

    def spent(self, away_s: float) -> bool:
        """Whether an outage that old is past the budget."""
        return self.budget_s is not None and away_s >= self.budget_s

    def ended(self) -> float | None:
        """End the current outage (the server answered, or the follow stops): its seconds,
        added to :attr:`total_s`; ``None`` when none was under way."""
        if self._since is None:
            return None
        away = time.monotonic() - self._since
        self._since = None
        self.total_s = round(self.total_s + away, 3)
        return away
