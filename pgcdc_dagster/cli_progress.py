"""Live progress for the command line: a display on a terminal, plain lines otherwise.

The engine publishes progress (:mod:`pgcdc_dagster.engine.progress`); this draws it on stderr
while a command's run executes in this process. On a terminal, rich draws one bar per table of
a snapshot (bytes against the source table's size, rows, MB/s, ETA) or a status line for a
follow; elsewhere (a log file, CI) a plain line every ``PLAIN_EVERY_S`` seconds and at every
phase change, so a long copy is never silent.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TextIO

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from .engine import progress as engine_progress

PLAIN_EVERY_S = 5.0


@contextlib.contextmanager
def shown(stream: TextIO | None = None) -> Iterator[None]:
    """Show the engine's progress on ``stream`` (stderr) while inside."""
    stream = stream or sys.stderr
    if stream.isatty():
        with _live(stream) as listener, engine_progress.listening(listener):
            yield
    else:

        def line(text: str) -> None:
            print(f"pgcdc: {text}", file=stream, flush=True)

        with engine_progress.listening(engine_progress.throttled(line, PLAIN_EVERY_S)):
            yield


@contextlib.contextmanager
def _live(stream: TextIO) -> Iterator[engine_progress.Listener]:
    bars = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[detail]}"),
        console=Console(file=stream),
        transient=False,
    )
    tasks: dict[str, TaskID] = {}

    def task(key: str, description: str) -> TaskID:
        if key not in tasks:
            tasks[key] = bars.add_task(description, total=None, detail="")
        return tasks[key]

    def listener(report: engine_progress.Progress) -> None:
        if isinstance(report, engine_progress.SnapshotProgress):
            overall = task("snapshot", report.work)
            bars.update(
                overall,
                description=f"{report.work}: {report.phase}",
                total=report.estimated_bytes or None,
                completed=report.copied_bytes,
                detail=escape(report.note)
                if report.note
                else f"{report.rows:,}/~{report.estimated_rows:,} rows",
            )
            for table in report.tables:
                bars.update(
                    task(table.table, f"  {escape(table.table)}"),
                    total=table.estimated_bytes or None,
                    completed=table.bytes,
                    detail=f"{table.rows:,}/~{table.estimated_rows:,} rows",
                )
        else:
            bars.update(task("follow", "follow"), detail=escape(report.line()))

    with bars:
        yield listener
