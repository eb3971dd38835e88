"""Forgetting, in Dagster's storage, the ranges the output store no longer holds.

A range the store's retention removed (or that a dead run registered and never stored) goes
from the ``lsn_ranges`` partitions, and on PostgreSQL storage its history goes too: the
materialisations of its partition (``decoded_changes`` and every target table) and its
``no_gap`` evaluations. Without that, Dagster's storage would keep growing after the store
stopped: after ``make demo``, Dagster's event log held more than the store itself, and a follow
at 1,000 tps, storing 5 ranges a second, would add gigabytes a day of history nobody prunes (see
``benchmarks/HISTORY.md``, "``pgcdc prune`` after ``make demo``" and "Dagster's history of the
ranges").

Dagster's public calls cannot do it: ``delete_dynamic_partition`` deletes one key per
transaction, far slower than a thousand keys in one statement (see ``benchmarks/HISTORY.md``,
``benchmarks/retention.py``), and ``wipe_asset_partitions`` is not implemented by its SQL
storages. So the rows are deleted here, in one transaction per thousand keys, from the tables
Dagster's own calls write, through its SQLAlchemy table definitions
(``dagster._core.storage.event_log.schema``), and only rows of this project's assets
(``decoded_changes`` and ``target/...``) for those keys.
On another storage (Dagster's local SQLite keeps events in a file per run) only the partitions
are deleted, through the public call; so it is when the table definitions cannot be imported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dagster import DagsterInstance

from ..engine.failpoints import failpoint
from .keys import DECODED_CHANGES_KEY
from .partitions import LSN_RANGES

BATCH = 1000


def forget_partitions(instance: DagsterInstance, keys: Sequence[str]) -> None:
    """Delete the ``lsn_ranges`` partitions ``keys`` and, on PostgreSQL storage, their
    history (see the module docstring)."""
    if not keys:
        return
    storage = instance.event_log_storage
    try:
        from dagster._core.storage.event_log.schema import (
            AssetCheckExecutionsTable,
            AssetEventTagsTable,
            AssetKeyTable,
            DynamicPartitionsTable,
            SqlEventLogStorageTable,
        )
        from dagster_postgres.event_log.event_log import PostgresEventLogStorage

        on_postgres = isinstance(storage, PostgresEventLogStorage)
    except ImportError:
        on_postgres = False
    if not on_postgres:
        for key in keys:
            instance.delete_dynamic_partition(LSN_RANGES, key)
        return
    events, tags, checks = SqlEventLogStorageTable, AssetEventTagsTable, AssetCheckExecutionsTable
    partitions = DynamicPartitionsTable
    with storage.index_transaction() as conn:
        ours = _our_asset_keys(conn, AssetKeyTable)
    for i in range(0, len(keys), BATCH):
        batch = list(keys[i : i + BATCH])
        with storage.index_transaction() as conn:
            if ours:
                checked = conn.execute(
                    checks.delete()
                    .where(checks.c.asset_key.in_(ours))
                    .where(checks.c.partition.in_(batch))
                    .returning(checks.c.evaluation_event_storage_id)
                ).fetchall()
                ids = [row[0] for row in checked if row[0] is not None]
                materialised = conn.execute(
                    events.delete()
                    .where(events.c.asset_key.in_(ours))
                    .where(events.c.dagster_event_type == "ASSET_MATERIALIZATION")
                    .where(events.c.partition.in_(batch))
                    .returning(events.c.id)
                ).fetchall()
                ids += [row[0] for row in materialised]
                for j in range(0, len(ids), BATCH):
                    some = ids[j : j + BATCH]
                    conn.execute(tags.delete().where(tags.c.event_id.in_(some)))
                    conn.execute(events.delete().where(events.c.id.in_(some)))
            conn.execute(
                partitions.delete()
                .where(partitions.c.partitions_def_name == LSN_RANGES)
                .where(partitions.c.partition.in_(batch))
            )
        failpoint("partitions.forgetting")


def _our_asset_keys(conn: Any, table: Any) -> list[str]:
    """This project's partitioned asset keys as the storage writes them (``decoded_changes``
    and every ``target/...`` it has recorded), so each delete runs on Dagster's index by asset
    key, event type and partition, never over the whole event log."""
    decoded = DECODED_CHANGES_KEY.to_string()
    rows = conn.execute(
        table.select()
        .with_only_columns(table.c.asset_key)
        .where((table.c.asset_key == decoded) | table.c.asset_key.like('["target", %'))
    ).fetchall()
    return [row[0] for row in rows]
