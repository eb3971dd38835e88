"""The follow run's recording, beside a follower in a process of its own."""

from __future__ import annotations

import os
import threading
import time

from pgcdc_dagster.defs.following import RECORDING_NICENESS, yield_to_the_follower


def test_the_recording_thread_alone_yields_the_cpu_to_the_follower() -> None:
    """The thread that records the run's events lowers its own priority (a Linux thread's nice
    value, read back from the kernel); the process's other threads keep theirs."""
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: dict[str, int] = {}

    def record() -> None:
        thread = threading.get_native_id()
        seen["before"] = os.getpriority(os.PRIO_PROCESS, thread)
        yield_to_the_follower()
        seen["after"] = os.getpriority(os.PRIO_PROCESS, thread)

    recorder = threading.Thread(target=record)
    recorder.start()
    recorder.join()
    assert seen["after"] == min(19, seen["before"] + RECORDING_NICENESS) > seen["before"]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main


def test_a_run_whose_records_trail_paces_its_follower_until_they_catch_up() -> None:
    """Past ``PACE_AFTER_S`` of trail the follower is asked for ranges no closer than
    ``PACED_CUT_S``; once the records are within ``PACE_UNTIL_S`` it is let go, once each."""
    from pgcdc_dagster.defs.following import (
        PACE_AFTER_S,
        PACE_UNTIL_S,
        PACED_CUT_S,
        RecordPace,
    )
    from pgcdc_dagster.engine.follow.follower import Followed

    asked: list[float] = []

    class Paced:
        def pace(self, min_cut_s: float) -> None:
            asked.append(min_cut_s)

    pace = RecordPace(Paced(), PACED_CUT_S)  # type: ignore[arg-type]

    def applied(seconds_ago: float) -> Followed:
        return Followed(None, None, time.monotonic() - seconds_ago)  # type: ignore[arg-type]

    pace.note(applied(PACE_AFTER_S / 2))
    assert asked == []
    pace.note(applied(PACE_AFTER_S + 1))
    pace.note(applied(PACE_AFTER_S + 2))
    assert asked == [PACED_CUT_S]
    pace.note(applied((PACE_UNTIL_S + PACE_AFTER_S) / 2))
    assert asked == [PACED_CUT_S]
    pace.note(applied(PACE_UNTIL_S / 2))
    assert asked == [PACED_CUT_S, 0.0]
    pace.note(applied(PACE_UNTIL_S / 2))
    assert asked == [PACED_CUT_S, 0.0]  # once each
