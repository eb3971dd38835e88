"""Exact row counts of the target tables after each apply, without counting each time.

``dagster/row_count`` must be exact to mean anything, and ``count(*)`` of a large table after
every range would cost more than the range. So a table's count is carried from range to range:
the apply says what it did (rows inserted and deleted; after a TRUNCATE, what was inserted), and
the count is exact at the origin's progress it was taken at (``pgcdc/applied_through``). When
the last known count is not at the progress this apply started from (a range applied by a run
that died before Dagster recorded it, or no count yet), the table is counted once, with a time
limit, and carried on from there. The first apply after a base snapshot starts from the
snapshot's rows per table, exact at its consistent point (where the origin starts): a
``count(*)`` of every table of a freshly copied target would read it all again, on the server
the catch-up applies to, while it applies (``benchmarks/HISTORY.md``). These counts are for
people to read; nothing is decided on them.
"""

from __future__ import annotations

from collections.abc import Sequence

import psycopg
from dagster import DagsterInstance, EventLogEntry, TableMetadataValue

from ..engine.apply.results import ApplyResult, ApplyStatus
from ..engine.catalog import count_rows
from ..engine.connect import ConnectError, connect
from ..engine.identifiers import TableName
from ..engine.settings import ReplicationSettings
from .keys import BASE_SNAPSHOT_KEY, target_key
from .metadata import APPLIED_THROUGH, CONSISTENT_POINT, COPIED_TABLES, ROW_COUNT

COUNT_TIMEOUT_S = 5.0


class TargetRowCounts:
    """The running exact row count of every target table, for one run."""

    def __init__(
        self, instance: DagsterInstance, settings: ReplicationSettings, tables: Sequence[TableName]
    ) -> None:
        self.instance = instance
        self.settings = settings
        self.tables = tables
        """Read at each apply: a follow adds the tables added while it runs."""
        self.known: dict[TableName, tuple[int, str]] = {}
        """table -> (rows, the origin's progress they are exact at)."""

    def after(self, applied: ApplyResult) -> dict[TableName, int | None]:
        """Each table's row count once ``applied`` is committed (``None``: not known)."""
        start = applied.previous_lsn
        stale = []
        counts: dict[TableName, int | None] = {}
        recorded = self._recorded([t for t in self.tables if t not in self.known], start)
        for table in self.tables:
            known = self.known.get(table) or recorded.get(table)
            if known is None or known[1] != start:
                stale.append(table)
                continue
            rows = known[0]
            done = applied.tables.get(str(table))
            if done is not None and applied.status == ApplyStatus.APPLIED:
                rows = (0 if done.truncated else rows) + done.inserted - done.deleted
            counts[table] = rows
        if stale:
            try:
                with connect(self.settings.target_dsn, role="target", autocommit=True) as conn:
                    counts.update(count_rows(conn, stale, COUNT_TIMEOUT_S))
            except (ConnectError, psycopg.OperationalError):
                # The target went away after the apply (a follow rides that through): the
                # counts are not known this time, which is no reason to stop recording.
                counts.update(dict.fromkeys(stale))
        for table, rows in counts.items():
            if rows is not None and applied.replay_lsn is not None:
                self.known[table] = (rows, applied.replay_lsn)
            else:
                self.known.pop(table, None)
        return counts

    def _recorded(
        self, tables: Sequence[TableName], start: str | None
    ) -> dict[TableName, tuple[int, str]]:
        """The counts in the tables' latest materialisations, with the progress each is exact
        at, or the base snapshot's where that is exact at ``start`` and theirs is not (the
        first apply after it, a re-snapshot's included); one read of Dagster's storage for
        all the tables: a read per table made the first range's events slow with hundreds of
        tables (see ``benchmarks/HISTORY.md``, ``benchmarks/many_tables.py`` and "Many
        tables")."""
        if not tables:
            return {}
        keys = [target_key(t) for t in tables]
        events = self.instance.get_latest_materialization_events([*keys, BASE_SNAPSHOT_KEY])
        snapshot = _snapshot_rows(events.get(BASE_SNAPSHOT_KEY), start)
        found: dict[TableName, tuple[int, str]] = {}
        for table in tables:
            event = events.get(target_key(table))
            materialization = event.asset_materialization if event else None
            rows = materialization.metadata.get(ROW_COUNT) if materialization else None
            through = materialization.metadata.get(APPLIED_THROUGH) if materialization else None
            if rows is not None and through is not None:
                found[table] = (int(rows.value), str(through.value))  # type: ignore[arg-type]
            if table in snapshot and (table not in found or found[table][1] != start):
                found[table] = (snapshot[table], str(start))
        return found


def _snapshot_rows(event: EventLogEntry | None, start: str | None) -> dict[TableName, int]:
    """Each table's rows in the base snapshot ``event`` recorded, when its consistent point is
    ``start``: the copy is then all the target holds of the table (a resumed copy's rows kept
    from its killed attempt included)."""
    materialization = event.asset_materialization if event else None
    if materialization is None or start is None:
        return {}
    point = materialization.metadata.get(CONSISTENT_POINT)
    copied = materialization.metadata.get(COPIED_TABLES)
    if point is None or str(point.value) != start or not isinstance(copied, TableMetadataValue):
        return {}
    rows: dict[TableName, int] = {}
    for record in copied.records:
        data = record.data
        if isinstance(data.get("table"), str) and isinstance(data.get("rows"), int):
            kept = data.get("kept_rows")
            rows[TableName.parse(data["table"])] = data["rows"] + (
                kept if isinstance(kept, int) else 0
            )
    return rows
