"""Ending a replication once the target has taken over (``pgcdc finish``).

A slot keeps every WAL segment from its confirmed position on, for as long as it exists: one left
behind after a migration fills the old source's disk, however idle it is, and the target's
replication origin holds one of the target's origin states. So the end drops both, after it has
recorded in the store's chain that the replication is finished
(:attr:`~..store.output_store.Chain.finished_at`), so that nothing starts it again: a follow that
made way for the end stops (:mod:`..follow.follower`), the slot sensor requests no run, and
:mod:`.checks <pgcdc_dagster.defs.checks>` report it finished, not broken.

The end refuses while the target lacks a change the source published (stored ranges not
applied, or transactions in the slot not received): those would be lost with the slot. ``pgcdc
cutover`` takes them; ``abandon`` drops them knowingly.

Crash anywhere: the chain's record comes first and each drop is idempotent, so the next end does
what is left. The publication stays: it may be the user's, other slots may read it, and it costs
nothing once no slot does; the result names it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from ..apply.ddl import drop_records
from ..apply.origin import drop_origin
from ..apply.xid_bounds import drop_bounds
from ..connect import connect, server_errors
from ..errors import PgcdcError
from ..failpoints import failpoint
from ..lsn import Lsn
from ..settings import ReplicationSettings
from ..source.slot import drop_slot, released
from .pipeline import adding_not_done, expected_origin_progress, origin_progress, store_of
from .range_lock import range_lock_or_way


class FinishRefusedError(PgcdcError):
    """The target lacks changes the source published: ending now would lose them."""


@dataclass(frozen=True)
class FinishResult:
    finished_at: Lsn | None
    """The target's origin when the end was recorded (``None``: it had none)."""
    slot_dropped: bool
    origin_dropped: bool
    publication: str
    """Left in place (see the module docstring)."""


_PENDING = """
SELECT count(*) FROM pg_logical_slot_peek_binary_changes(%(slot)s, NULL, 1,
    'proto_version', '1', 'publication_names', %(publication)s)
"""
"""Rows of the slot's first transaction not yet confirmed, if any: pgoutput (PostgreSQL 15)
sends nothing for a transaction without a published change, so any row is one the target
lacks."""


def finish(
    settings: ReplicationSettings, holder: str, wait_s: float, *, abandon: bool = False
) -> FinishResult:
    """End the replication of ``settings.slot`` (see the module docstring), with the range
    to itself (a running follow makes way, then stops)."""
    store = store_of(settings)
    with range_lock_or_way(settings.target_dsn, settings.slot, holder, wait_s):
        chain = store.chain()
        if chain is None or not chain.complete:
            raise FinishRefusedError(
                f"there is no replication of slot {settings.slot} to finish in the output store "
                f"{store.where}: nothing was snapshotted there"
            )
        applied = origin_progress(settings)
        if chain.finished_at is None:
            if not abandon:
                _refuse_if_behind(settings, applied)
                if (refusal := adding_not_done(chain)) is not None:
                    raise FinishRefusedError(
                        f"{refusal}, or pgcdc finish --abandon to end the replication without them"
                    )
            assert chain.consistent_point is not None  # a complete chain has one
            store.record_finished(applied or chain.consistent_point)
        failpoint("finish.after_record")
        with (
            server_errors("source", settings.source_dsn),
            connect(settings.source_dsn, role="source", autocommit=True) as src,
        ):
            had_slot = _slot_exists(src, settings.slot)
            drop_slot(src, settings.slot, wait_seconds=5.0)
        with (
            server_errors("target", settings.target_dsn),
            connect(settings.target_dsn, role="target") as tgt,
        ):
            had_origin = applied is not None
            drop_origin(tgt, settings.origin)
            drop_bounds(tgt, settings.slot)
            drop_records(tgt)
            tgt.commit()
        finished = store.chain()
    return FinishResult(
        finished.finished_at if finished else None, had_slot, had_origin, settings.publication
    )


def _slot_exists(src: psycopg.Connection[Any], slot: str) -> bool:
    row = src.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    return row.fetchone() is not None


def _refuse_if_behind(settings: ReplicationSettings, applied: Lsn | None) -> None:
    expected = expected_origin_progress(settings)
    if expected is not None and (applied is None or applied < expected):
        raise FinishRefusedError(
            f"the target has not applied every stored range (its origin is at {applied}, the "
            f"stored ranges end with the commit at {expected}): run pgcdc cutover first, or "
            "pgcdc finish --abandon to end the replication without them"
        )
    with (
        server_errors("source", settings.source_dsn),
        connect(settings.source_dsn, role="source", autocommit=True) as src,
    ):
        if not _slot_exists(src, settings.slot):
            return  # gone already (dropped by hand): nothing left in it
        released(src, settings.slot)  # the stream of a follow killed a moment ago
        (pending,) = src.execute(  # type: ignore[misc]
            _PENDING, {"slot": settings.slot, "publication": settings.publication}
        ).fetchone()
    if pending:
        raise FinishRefusedError(
            f"the slot {settings.slot} holds published changes the target has not received: "
            "stop the application's writes, run pgcdc cutover, then finish; or pgcdc finish "
            "--abandon to end the replication without them"
        )
