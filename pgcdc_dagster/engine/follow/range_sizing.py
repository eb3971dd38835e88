"""How a follow cuts a backlog into ranges, and when it reads by stream: the policy, apart from
the follower's state machine that applies it (:mod:`.follower`). The measurements behind each
choice: ``benchmarks/HISTORY.md``, "The follow's range shaping"."""

from __future__ import annotations

from typing import Any

import psycopg

from ..lsn import Lsn
from ..settings import MiB

FIRST_RANGE_BYTES = 4 * MiB
"""The first range's WAL on a backlog of one to two ranges (then doubling): small enough to be
received in a fraction of a second, so the applier starts then instead of after a whole capped
range."""


PEEK_MAX_RANGES = 4
"""The rest of a backlog, after its first range (its first two when they are cut small), is
read by peeks of at most this many capped ranges' WAL, cut into ranges as they stream. A peek
per range decodes the WAL again from the slot's restart point every time (PostgreSQL 15 moves
it only at running-xacts records, about every 15 s of the WAL's writing time), so a peek of
several ranges decodes that head once. Not one peek for all of a big backlog: the source
decodes a whole peek before its first row comes back (the receiver waits that long, the
applier works through the queue meanwhile), and the slot is advanced only at a peek's end, so
the source keeps that much more WAL."""


STREAM_WITHIN_BYTES = 1 * MiB
"""A follow without an endpos reads by stream when at most this far behind the source's flush
(and not in a backlog); further behind, by peeks, faster on a backlog
(``benchmarks/slot_reading.py``)."""


DECODED_AGAIN_BYTES = 256 * MiB
"""Past this much WAL decoded again before each peek, a peek spans at least as much (see
:meth:`Follower._receive_rest`). Below it, the restart point's usual lag (it moves at
running-xacts records, about every 15 s of WAL) leaves the spans as they are. The case
behind it is ``benchmarks/resync.py``'s widening step: a table rewrite in one big transaction,
which fixed spans decoded again for each of their ranges (see ``benchmarks/HISTORY.md``,
``benchmarks/resync.py``)."""


def decoded_again(conn: psycopg.Connection[Any], slot: str, start: Lsn) -> int:
    """WAL bytes a peek from ``start`` decodes again before it: from the slot's restart point
    (which PostgreSQL keeps before the oldest transaction still open there) to ``start``."""
    row = conn.execute(
        "SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,)
    ).fetchone()
    if row is None or row[0] is None:
        return 0
    return max(0, int(start) - int(Lsn.parse(row[0])))


def backlog_range_bytes(previous: int | None, remaining: int, cap: int) -> int:
    """WAL for the next range of a backlog: ``remaining`` bytes are flushed and not received,
    ``previous`` is the size of the range just cut if it was cut by size (``None`` for the
    first, or after the receiver caught up), ``cap`` is ``follow_range_bytes``.

    A backlog that fits in one range (and every live range) is one range: its endpos outcome
    then describes the endpos itself. A backlog of up to two ranges is where receive and apply
    overlap worst: they overlap only between ranges, the first range is received with the
    applier idle and the last applied with the receiver idle. So there the first range is small
    (:data:`FIRST_RANGE_BYTES`), each next one doubles (per-range costs, a target transaction
    and the run's events, shrink as ranges grow), and none takes more than half of what remains
    (the last one is small again). A bigger backlog is cut at ``cap``: those two idle ends are
    a small part of it, and every range more costs its target transaction and the run's
    events (more small ranges are no faster and cost the source more CPU).
    Never above ``cap``, so a small cap keeps its meaning. After a backlog's first range (its
    first two when they are cut small), the rest is read by peeks of at most
    :data:`PEEK_MAX_RANGES` ranges (:meth:`Follower._receive_rest`), which re-decode from the
    restart point less often than a peek per range. The measurements behind each choice:
    ``benchmarks/HISTORY.md``, "The follow's range shaping"."""
    if previous is None:
        if remaining <= cap or remaining > 2 * cap:
            return cap
    elif previous == cap:
        return cap
    grown = FIRST_RANGE_BYTES if previous is None else 2 * previous
    tail = max(FIRST_RANGE_BYTES, (remaining + 1) // 2)
    return min(cap, grown, tail)
