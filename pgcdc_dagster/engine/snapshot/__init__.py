"""The base snapshot: the initial copy of the replicated tables, consistent with the slot.

Modelled on pgcopydb's ``clone``; Spark schedules the data copy. The data flow::

    source                                                            target
    ──────                                                            ──────
    CREATE_REPLICATION_SLOT ... (SNAPSHOT 'export')  ─ slot S, snapshot X, consistent point C
      (replication connection kept idle: X stays importable)
    pg_dump --section=pre-data --snapshot=X ──► TOC filtered to what the tables
                                                need and the target lacks ──► psql (1 txn)
    plan: every table (or leaf partition) cut
          into ctid block ranges of ~N rows
    Spark task per range:                                             per range, one txn:
      BEGIN REPEATABLE READ READ ONLY;                                COPY t (cols) FROM STDIN
      SET TRANSACTION SNAPSHOT 'X';    COPY data, unparsed,  ──►        (FORMAT binary)
                                       in 128 KiB batches
      COPY (SELECT cols FROM t WHERE ctid range) TO STDOUT (binary)
    close the replication connection (X ends)
    pg_dump --section=post-data -t tables ──► filtered the same way ──► psql (indexes, keys)
                                                                      replication origin
                                                                      pgcdc_<slot> := C

Why this is consistent: every range is read in snapshot X, which holds exactly the
transactions that committed up to C, and the slot streams exactly those committing after C
(see :mod:`pgcdc_dagster.engine.source.slot`). The target's replication origin is set to C, so apply
starts right after the copy. A range is one target transaction, which also records it
(:mod:`.copied_ranges`): a failed task leaves nothing behind and Spark may retry it; a task
Spark believes failed after its commit (executor lost between commit and report) is refused
when run again (the record's key), instead of duplicating its rows. A snapshot killed or
failing during its copy is resumed by the next one from those records (:mod:`.resume`).

Schema, decided: the pre-data dump is taken of the *schemas* the tables need (``pg_dump -n``,
plus ``-e`` for extensions), and its table of contents is then cut down to the dependency
closure of the tables, computed from ``pg_depend`` inside the snapshot: enum, domain, composite
and range types of the columns, functions of defaults and checks, sequences, collations, the
schemas, extensions owning a type (``CREATE EXTENSION IF NOT EXISTS``), and what those need in
turn; foreign keys do not pull in the tables they reference. Objects that already exist on the
target are left out, so pre-data and post-data create what is missing and never replace or alter
anything: a pre-created target schema is kept, and a re-snapshot into truncated tables works.
Foreign keys whose referenced table is not on the target are skipped (and reported). Comments,
ownership, privileges, tablespaces, security labels, publications and subscriptions are not
copied.

Throughput: on par with ``psql -c 'COPY ... TO STDOUT' | psql -c 'COPY ... FROM STDIN'``, for
pgbench_accounts and for a table of mixed types (see ``benchmarks/snapshot.py`` and
``benchmarks/HISTORY.md``).

Credentials: pg_dump and psql receive the connection through ``PG*`` environment variables,
never through their command line (visible in ``ps``), and their error output is redacted.

Modules: :mod:`.base` takes the snapshot (guards, slot, order of the steps), :mod:`.schema` the
pg_dump sections, :mod:`.copy` plans ranges and runs one copy task, :mod:`.scheduling` runs the
tasks on Spark, :mod:`.export` writes the optional Parquet export, :mod:`.common` holds what
they share.
"""

from .added import AddedTablesResult, add_tables
from .base import take_base_snapshot
from .common import (
    DEFAULT_ROWS_PER_TASK,
    BaseSnapshotResult,
    CopyTask,
    RangeCopyResult,
    SchemaRestoreResult,
    SnapshotError,
    TableCopyResult,
    TableRange,
    TargetNotEmptyError,
)
from .copy import copy_range, merge_ranges, plan_table_ranges
from .export import snapshot_export_path
from .scheduling import copy_tables
from .schema import copy_schema_post_data, copy_schema_pre_data

__all__ = [
    "DEFAULT_ROWS_PER_TASK",
    "AddedTablesResult",
    "BaseSnapshotResult",
    "CopyTask",
    "RangeCopyResult",
    "SchemaRestoreResult",
    "SnapshotError",
    "TableCopyResult",
    "TableRange",
    "TargetNotEmptyError",
    "add_tables",
    "copy_range",
    "copy_schema_post_data",
    "copy_schema_pre_data",
    "copy_tables",
    "merge_ranges",
    "plan_table_ranges",
    "snapshot_export_path",
    "take_base_snapshot",
]
