"""The source's identity and WAL timeline: which server history an LSN belongs to.

An LSN names a place in one history of the cluster's WAL. When a standby is promoted it starts
a new timeline at the *switch point*: the end of the last WAL record it had replayed. Below
that point the old and new timelines hold the same records; above it, the same LSNs hold
different ones (the old primary's last transactions, which the standby never received, are on
no timeline the new primary knows). So a position read from the source (a stored range's end,
the target's origin) is only meaningful together with the timeline it was read on, and after a
promotion only up to the switch point.

``IDENTIFY_SYSTEM`` names the cluster (``systemid``, the same on a primary and every standby
made from it by a base backup) and its current timeline; ``TIMELINE_HISTORY`` returns a
timeline's history file, one line for every earlier timeline of its ancestry:
``<timeline>\\t<switch point>\\t<reason>``. Both are replication commands: the source's role has
the ``REPLICATION`` attribute already (slots need it), so no other privilege is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from ..connect import connect
from ..lsn import Lsn

__all__ = ["SourceSystem", "identify_system", "switch_point"]


@dataclass(frozen=True)
class SourceSystem:
    """What ``IDENTIFY_SYSTEM`` says of the source."""

    system_id: str
    """The cluster's identifier: shared by a primary and its physical standbys."""
    timeline: int
    position: Lsn
    """The WAL flushed (a primary) or replayed (a standby) when asked."""


def identify_system(dsn: str) -> SourceSystem:
    """The source's identity and current timeline, on a replication connection of its own."""
    with connect(dsn, role="source", replication=True) as conn:
        return identify(conn)


def identify(conn: psycopg.Connection[Any]) -> SourceSystem:
    """:func:`identify_system` on an open replication connection."""
    row = conn.execute("IDENTIFY_SYSTEM").fetchone()
    assert row is not None
    system_id, timeline, position = row[0], row[1], row[2]
    return SourceSystem(str(system_id), int(timeline), Lsn.parse(str(position)))


def switch_point(conn: psycopg.Connection[Any], current: int, ended: int) -> Lsn | None:
    """Where timeline ``ended`` ended in the history of timeline ``current`` (the source's
    present one, ``ended < current``): every WAL record below it is on both. ``None`` when
    ``ended`` is not an ancestor of ``current`` (another branch): nothing is known to be
    shared. ``conn`` is a replication connection."""
    if ended >= current:
        return None
    row = conn.execute(f"TIMELINE_HISTORY {int(current)}").fetchone()
    assert row is not None
    content = row[1]
    text = bytes(content).decode() if isinstance(content, bytes | memoryview) else str(content)
    return history_switch_point(text, ended)


def history_switch_point(history: str, ended: int) -> Lsn | None:
    """The switch point of timeline ``ended`` in a timeline history file's text (comments
    start with ``#``); ``None`` when it is not listed."""
    for line in history.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) >= 2 and fields[0].isdigit() and int(fields[0]) == ended:
            return Lsn.parse(fields[1])
    return None
