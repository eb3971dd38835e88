"""Replication in this process, as the engine's end-to-end tests run it: the settings of a
fresh slot and store, a catch-up under the range lock, and every table compared."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from pgcdc_dagster.engine.compare import verify
from pgcdc_dagster.engine.control import pipeline
from pgcdc_dagster.engine.lsn import Lsn
from pgcdc_dagster.engine.settings import ReplicationSettings


def settings_for(
    source_dsn: str, target_dsn: str, tmp_path: Path, prefix: str, **overrides: Any
) -> ReplicationSettings:
    """A slot of its own (``prefix`` and a random tail) and a store under ``tmp_path``."""
    return ReplicationSettings(
        source_dsn=source_dsn,
        target_dsn=target_dsn,
        slot=f"{prefix}_{uuid.uuid4().hex[:8]}",
        store=str(tmp_path / "store"),
        **overrides,
    )


def catch_up(
    settings: ReplicationSettings, endpos: Lsn | str = "current", spark: Any = None
) -> list[Any]:
    """Every step to ``endpos`` (``current``: the source's position now), in this process
    (``spark``: for the ranges of at least ``settings.spark_min_changes``); each step's
    ``(received, applied)``."""
    target = pipeline.resolve_endpos(settings, endpos) if isinstance(endpos, str) else endpos
    with pipeline.range_lock(settings):
        return list(
            pipeline.catch_up(
                settings,
                target,
                run_step=lambda step: pipeline.run_step_in_process(settings, step, spark),
            )
        )


def equal_tables(settings: ReplicationSettings) -> list[tuple[str, bool]]:
    """Each replicated table and whether the target's equals the source's."""
    comparisons = verify.compare_tables(settings, pipeline.replicated_tables(settings))
    return [(str(c.table), c.equal) for c in comparisons]
