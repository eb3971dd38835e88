"""What an apply reports: its outcome, and per table what it inserted, updated and deleted."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from ..errors import ApplyError
from ..identifiers import TableName
from ..spark.executors import SparkApp


class ApplyStatus(StrEnum):
    """What applying a range did."""

    APPLIED = "applied"
    ALREADY_APPLIED = "already_applied"
    """The origin was already at or past the range's last commit: nothing written."""
    EMPTY = "empty"
    """The range holds no transaction: nothing to write."""


class ApplyGapError(ApplyError):
    """Changes between the target's origin progress and the range's start were not applied."""


@dataclass
class TableApplyCounts:
    changes: int = 0
    net_rows: int = 0
    truncated: bool = False
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    missing: int = 0
    """Updates/deletes whose row the target did not have (skipped)."""


@dataclass
class ApplyResult:
    range_key: str
    status: ApplyStatus
    replay_lsn: str | None
    """The origin's progress after this call: what the target has applied."""
    previous_lsn: str | None
    """The origin's progress before this call."""
    tables: dict[str, TableApplyCounts] = field(default_factory=dict)
    schema_changes: list[str] = field(default_factory=list)
    """The source's DDL the range showed, as carried out on the target (:mod:`.ddl`): one
    line per step, each beginning with its table."""
    reshaped: list[str] = field(default_factory=list)
    """The tables whose shape the range's DDL changed (or that were copied again for it)."""
    renamed_tables: list[tuple[TableName, TableName]] = field(default_factory=list)
    """``(before, now)`` of every table the range's DDL renamed."""
    changes: int = 0
    net_rows: int = 0
    compaction_path: str | None = None
    staged_by: str = "driver"
    """Who COPYed the net rows into staging tables: ``driver`` (this process, inside the apply
    transaction), ``driver, N partition(s)`` (this process, inside it too, one key-hash
    partition at a time; :mod:`.partitioned_staging`) or ``spark executors`` (before it;
    :mod:`.spark_staging`)."""
    spark_app: SparkApp | None = None
    """The Spark application whose executors staged the range (``staged_by`` ``spark
    executors``)."""
    spark_tasks: int = 0
    """The Spark tasks that staged it."""
    compaction_seconds: float = 0.0
    staging_seconds: float = 0.0
    apply_seconds: float = 0.0
    seconds: float = 0.0
    in_commit_order: list[str] = field(default_factory=list)
    """Tables whose net rows a unique key of the target refused, applied change by change in
    the source's order instead (see :func:`apply_range`)."""
    warnings: list[str] = field(default_factory=list)
    """Lines to show the user about how the range was applied (a range Spark's executors
    could not read, staged on the driver instead)."""
    held_back: list[str] = field(default_factory=list)
    """Tables being added whose changes in the range were held back for their add
    (:func:`apply_added_changes`)."""
