"""The optional Parquet export of the base snapshot into the store (``PGCDC_SNAPSHOT_PARQUET``)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

from ..identifiers import TableName
from ..lsn import Lsn
from .common import (
    EXPORT_FORMAT_VERSION,
    SNAPSHOT_MANIFEST,
    CopyTask,
    RangeCopyResult,
    TableCopyResult,
    TableRange,
)

# ─── Parquet export ──────────────────────────────────────────────────────────────────────────

_ARROW_TYPES = {"int2": "int16", "int4": "int32", "int8": "int64", "bool": "bool"}
"""Types stored typed; every other value is kept as PostgreSQL's text form (as the change store
does), which loses nothing and needs no per-type parsing."""


def snapshot_export_path(store: str | os.PathLike[str], table: TableName) -> Path:
    """``<store>/snapshot/<schema>.<table>/``, each part percent-encoded (dots included) so any
    identifier maps to one folder name and back."""

    def encode(part: str) -> str:
        return quote(part, safe="").replace(".", "%2E")

    return Path(store) / "snapshot" / f"{encode(table.schema)}.{encode(table.name)}"


def _arrow_type_names(task: CopyTask) -> list[str]:
    return [_ARROW_TYPES.get(typname, "string") for typname in task.column_types]


def write_parquet(task: CopyTask, csv_blocks: list[bytearray]) -> str:
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    assert task.export_dir is not None
    names = list(task.range.columns)
    types = {n: pa.type_for_alias(t) for n, t in zip(names, _arrow_type_names(task), strict=True)}
    schema = pa.schema([pa.field(n, types[n]) for n in names])
    if csv_blocks:
        table = pacsv.read_csv(
            pa.py_buffer(b"".join(csv_blocks)),
            read_options=pacsv.ReadOptions(column_names=names, block_size=1 << 24),
            parse_options=pacsv.ParseOptions(newlines_in_values=True),
            convert_options=pacsv.ConvertOptions(
                column_types=types,
                null_values=[""],
                strings_can_be_null=True,
                quoted_strings_can_be_null=False,
                true_values=["t"],
                false_values=["f"],
            ),
        )
    else:
        table = schema.empty_table()
    start = task.range.start_block or 0
    leaf = str(task.range.source).encode().hex()
    path = Path(task.export_dir) / f"part-{leaf}-{start:010d}.parquet"
    pq.write_table(table, path)
    return str(path)


def publish_export(
    store: str | os.PathLike[str],
    staging: Path,
    summary: Sequence[TableCopyResult],
    by_table: dict[TableName, list[RangeCopyResult]],
    ranges: Sequence[TableRange],
    column_types: dict[TableName, dict[str, str]],
    snapshot_name: str | None,
    consistent_point: Lsn,
) -> None:
    """Stamp each table's folder and move it into place; the manifest is written last, so a
    folder is complete exactly when it has one."""
    columns = {r.table: r.columns for r in ranges}
    for result in summary:
        final = snapshot_export_path(store, result.table)
        folder = staging / final.name
        manifest = {
            "format_version": EXPORT_FORMAT_VERSION,
            "schema": result.table.schema,
            "table": result.table.name,
            "consistent_point": str(consistent_point),
            "snapshot_name": snapshot_name,
            "rows": result.rows,
            "columns": [
                {
                    "name": c,
                    "pg_type": column_types[result.table][c],
                    "arrow_type": _ARROW_TYPES.get(column_types[result.table][c], "string"),
                }
                for c in columns.get(result.table, ())
            ],
            "files": sorted(
                Path(r.parquet_file).name for r in by_table[result.table] if r.parquet_file
            ),
        }
        (folder / SNAPSHOT_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        if final.exists():
            shutil.rmtree(final)
        folder.rename(final)
    shutil.rmtree(staging, ignore_errors=True)
