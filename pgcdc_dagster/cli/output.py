"""What the commands print: one line per fact, or JSON; the one-line usage error.

Every command reports through these, so a summary, a table's verdict and a failure read the
same whichever command printed them."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..engine.errors import PgcdcError
from ..engine.lsn import LsnRange

if TYPE_CHECKING:
    from ..engine.identifiers import TableName


class CliError(PgcdcError):
    """A usage problem, reported as one line and exit status 2."""


def print_summary(args: argparse.Namespace, summary: dict[str, Any], headline: str) -> None:
    if args.json:
        print(json.dumps(summary, indent=2))
        return
    last = summary.get("last_range") or {}
    key = last.get("range_key")
    print(
        f"{headline}; last range {LsnRange.from_key(key).partition_key if key else '-'} outcome "
        f"{last.get('endpos_outcome', '-')}, transform_lsn {last.get('transform_lsn', '-')}, "
        f"replay_lsn {summary.get('replay_lsn')}"
    )


def print_status(args: argparse.Namespace, status: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        width = max(len(k) for k in status)
        for key, value in status.items():
            print(f"{key.ljust(width)}  {value}")


def metadata_value(entry: Any) -> Any:
    """A metadata entry's plain value (``None`` for an absent one)."""
    return None if entry is None else entry.value


def print_tables(tables: list[dict[str, Any]], stale: Sequence[TableName]) -> None:
    """A line a table compared (``ok``, ``DIFF``), and one a table no longer published."""
    from ..defs.metadata import no_longer_published

    for t in tables:
        mark = "ok  " if t["equal"] else "DIFF"
        if t["missing_on"] == "target":
            print(f"{mark} {t['table']}: not on the target (pgcdc add-table {t['table']})")
            continue
        rows = f"source {t['source_rows']} rows, target {t['target_rows']} rows"
        fix = "" if t["equal"] else f" (pgcdc resync {t['table']} copies it again)"
        chunks = f", {t['chunks']} chunks" if t.get("chunks", 1) > 1 else ""
        print(f"{mark} {t['table']}: {rows}{chunks}{fix}")
        for line in t.get("differing_chunks", []):
            print(f"       chunk {line}")
    for table in stale:
        print(f"STALE {no_longer_published(table)}")


def refuse_differing(tables: Sequence[dict[str, Any]], stale: Sequence[TableName]) -> None:
    differing = [t["table"] for t in tables if not t["equal"]]
    if differing or stale:
        names = ", ".join([*differing, *map(str, stale)])
        # A table on both sides that differs is repaired by copying it again.
        both = [t["table"] for t in tables if not t["equal"] and t.get("missing_on") is None]
        fix = f": pgcdc resync {' '.join(both)} copies them again" if both else ""
        raise CliError(f"tables differ between source and target: {names}{fix}")


def repaired_lines(result: Any) -> list[str]:
    """A line per table a repair run replaced chunks of."""
    lines = []
    for event in result.get_asset_observation_events() if result.success else []:
        observation = event.asset_observation_data.asset_observation
        meta = observation.metadata
        if "repaired_at" not in meta:  # not a table's (a recovery's own observation)
            continue
        lines.append(
            f"REPAIRED {observation.asset_key.to_user_string()}: "
            f"{meta['chunks_repaired'].value} chunk(s) at {meta['repaired_at'].value}, "
            f"{meta['rows_deleted'].value} row(s) deleted, {meta['rows_copied'].value} copied"
        )
    return lines


def on_spark(meta: dict[str, Any], did: str) -> str:
    """``; Spark application <id> <did> (UI <url>)`` when Spark did some of the work."""
    app = meta.get("spark_application_id")
    if not app:
        return ""
    ui = meta.get("spark_ui")
    return f"; Spark application {app} {did}" + (f" (UI {ui})" if ui else "")
