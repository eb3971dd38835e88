"""How often a plain log (a log file, a Dagster run's log) shows the engine's progress."""

from __future__ import annotations

from pgcdc_dagster.engine.progress import STEADY_LAG_BYTES, FollowProgress, throttled


def follow_report(lag_bytes: int | None, note: str = "", retrying: bool = False) -> FollowProgress:
    return FollowProgress(
        ranges=1,
        transactions=1,
        changes=4,
        elapsed_s=1.0,
        changes_per_s=4.0,
        lag_bytes=lag_bytes,
        note=note,
        retrying=retrying,
    )


def test_a_follow_that_keeps_up_is_shown_once_a_minute_and_a_backlog_at_every_turn():
    """A follow runs for weeks: while it keeps up, its plain lines come once a minute (1,440
    a day against 17,280 at the 5 s a backlog gets); a change of phase (an outage, its end)
    is shown at once whatever the pace."""
    lines: list[str] = []
    listener = throttled(lines.append, 0.0)
    listener(follow_report(0))
    listener(follow_report(STEADY_LAG_BYTES - 1))
    assert len(lines) == 1  # keeping up: the next line is a minute away
    listener(follow_report(STEADY_LAG_BYTES))
    listener(follow_report(50 * STEADY_LAG_BYTES))
    assert len(lines) == 3  # a backlog: every report (every_s is 0 here)
    listener(follow_report(0, note="source went away; trying again in 0.5 s", retrying=True))
    listener(follow_report(0, note="the servers are back after 2.0 s"))
    assert len(lines) == 5 and "the servers are back" in lines[-1]
