"""Named crash points, armed by one environment variable: free when it is unset.

The failpoint pattern of TiKV and FoundationDB: the engine calls :func:`failpoint` at the
instructions where a crash matters (between two durable steps), and a test arms one of them::

    PGCDC_FAILPOINT=receive.after_store pgcdc catchup      # SIGKILLed right there

``PGCDC_FAILPOINT`` holds ``name`` or ``name=action``, several separated by ``;``. Actions:

``kill`` (the default)
    SIGKILL this process: no ``finally``, no ``atexit``, no flush, as an OOM kill or a power cut
    would leave it (the servers still see the connection drop).
``kill-group``
    SIGKILL this process's whole process group (a CLI with its Spark JVM and Python workers).
``sleep(S)``
    Pause S seconds, so a test can crash a server under a running step.
``kill@N`` / ``sleep(S)@N``
    Only on the N-th time the point is reached in this process (counting from 1).

The variable is read once per process, so an unset variable costs one dictionary lookup per
call. Every point the engine declares is listed in :data:`POINTS`; arming an unknown name is an
error, so a renamed point cannot silently stop a crash test from crashing.
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass

from .errors import PgcdcError

ENV = "PGCDC_FAILPOINT"

POINTS: dict[str, str] = {
    "failover.after_drop": "after a failover: the ranges past the switch point dropped, the "
    "chain's timeline not yet recorded",
    "receive.after_store": "a range is durably stored; the slot is not advanced yet",
    "receive.fetching": "a range's changes are being read from the slot",
    "receive.streamed": "a block of a transaction streamed before its COMMIT is being spooled",
    "receive.streamed_commit": "a streamed transaction committed; its spool is being written "
    "into its range, a chunk at a time (hit before each; not stored yet), the slot not confirmed "
    "past it",
    "catchup.before_apply": "the slot is advanced past a stored range; nothing applied yet",
    "apply.staging": "a partition of a big range is staged (a Spark worker committed its part "
    "of the shared staging tables, or this process staged one inside the apply transaction)",
    "apply.in_transaction": "inside the apply transaction, rows written, not committed",
    "apply.after_commit": "the range and the origin are committed; Dagster has not recorded it",
    "follow.recording": "a follow run is recording a range it took (applied, not yet recorded)",
    "snapshot.after_marker": "the store says a snapshot is under way; nothing else done",
    "snapshot.after_slot": "the slot and its exported snapshot exist; nothing copied",
    "snapshot.copying": "the table copy is under way (rows already on the target)",
    "snapshot.range_copied": "a copy task of the driver committed its range or bundle and its "
    "record; others may be copying",
    "snapshot.after_copy": "every row is copied; indexes and keys not built",
    "snapshot.after_post_data": "indexes and keys built; the origin not set",
    "snapshot.after_origin": "the origin is at the consistent point; the store not told",
    "add.after_begin": "the store says tables are being added; nothing else done",
    "add.after_copy": "an added table's rows and keys are on the target; the store not told",
    "add.before_range": "an added table's held-back changes are applied up to the origin as it "
    "stood, without the range; the range not taken, the store not told",
    "add.after_held_back": "an added table's held-back changes are applied, the last with the "
    "range; the store not told",
    "finish.after_record": "the store records the replication ended; slot and origin not dropped",
    "sensor.after_register": "the sensor registered a range partition; no run requested",
    "store.uploaded": "an object store's range: its files uploaded, its manifest not yet put",
    "store.renamed": "a range renamed into its bucket and synced; its writer's emptied scratch "
    "folder not yet removed, the slot not yet advanced (an object store's: its manifest put)",
    "prune.recorded": "a prune recorded where the chain now begins; no range removed yet",
    "prune.removing": "a prune took its ranges out of the store (hidden); none deleted yet",
    "partitions.forgetting": "a batch of partitions and their history deleted from Dagster's "
    "storage; the next batches not yet",
    "copy.before_commit": "a copy range's rows and record are written on the target, not "
    "committed (in the process that copies it: the driver's, or a Spark worker's)",
    "continue.after_delete": "a continued table's changed keys are deleted from its kept ranges; "
    "its other blocks are not copied yet",
    "recover.after_begin": "the chain says recovering; the lost slot is not dropped yet",
    "recover.changed_in_transaction": "a part's changed rows are written on the target, "
    "not committed",
    "recover.after_changed": "a part's changed rows are copied again; other parts are not yet",
    "recover.deleted_in_transaction": "a table's deleted keys are removed on the target, "
    "not committed",
    "recover.after_deleted": "a table's deleted keys are removed; other tables' are not yet",
    "recover.after_chunk": "a differing chunk is replaced on the target; others are not yet",
    "repair.in_transaction": "a chunk's or a whole table's replacement is written on the target "
    "(the table truncated, the source's rows copied in), not committed",
    "recover.after_origin": "the origin is at the recovery's point; the chain not complete yet",
}
"""Every crash point of the engine and what is durable when it fires."""


class FailpointError(PgcdcError, ValueError):
    """``PGCDC_FAILPOINT`` names a point that does not exist or an unknown action."""


@dataclass(frozen=True)
class _Armed:
    action: str
    seconds: float
    on_hit: int | None


_ACTION = re.compile(r"^(kill|kill-group|sleep\((?P<s>[0-9.]+)\))(?:@(?P<n>[0-9]+))?$")
_armed: dict[str, _Armed] | None = None
_hits: dict[str, int] = {}


def _parse(text: str) -> dict[str, _Armed]:
    armed: dict[str, _Armed] = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        name, _, action = item.partition("=")
        name, action = name.strip(), (action.strip() or "kill")
        if name not in POINTS:
            raise FailpointError(
                f"{ENV}: unknown failpoint {name!r}; known points: {', '.join(sorted(POINTS))}"
            )
        match = _ACTION.match(action)
        if match is None:
            raise FailpointError(
                f"{ENV}: unknown action {action!r} for {name}: use kill, kill-group or "
                "sleep(SECONDS), optionally followed by @N (the N-th hit only)"
            )
        seconds = float(match.group("s") or 0)
        kind = "sleep" if action.startswith("sleep") else match.group(1)
        hit = match.group("n")
        armed[name] = _Armed(kind, seconds, int(hit) if hit else None)
    return armed


def failpoint(name: str) -> None:
    """Crash (or pause) here if ``PGCDC_FAILPOINT`` arms ``name``; otherwise do nothing."""
    global _armed
    if _armed is None:
        _armed = _parse(os.environ.get(ENV, ""))
    if not _armed:
        return
    if name not in POINTS:
        raise FailpointError(f"failpoint {name!r} is not declared in failpoints.POINTS")
    armed = _armed.get(name)
    if armed is None:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if armed.on_hit is not None and _hits[name] != armed.on_hit:
        return
    if armed.action == "sleep":
        time.sleep(armed.seconds)
    elif armed.action == "kill-group":
        os.killpg(os.getpgid(0), signal.SIGKILL)
    else:
        os.kill(os.getpid(), signal.SIGKILL)


def armed(name: str) -> bool:
    """Whether ``name`` is armed: for points that need a watcher (a thread that notices the
    moment to fire), so the watcher costs nothing when the variable is unset."""
    global _armed
    if _armed is None:
        _armed = _parse(os.environ.get(ENV, ""))
    return name in _armed


def reset() -> None:
    """Forget the parsed variable and the hit counts (tests that change it in-process)."""
    global _armed
    _armed = None
    _hits.clear()
