"""``pgcdc``: the command line, a thin layer that runs everything through Dagster.

Every command that changes something launches a run of a job of
``pgcdc_dagster.definitions:defs`` against the Dagster instance of ``DAGSTER_HOME``, so each
run shows in the UI beside the sensor's. Errors are one line (``--debug`` for the traceback).

One module per command group, as pgcopydb has one ``cli_*.c`` per group: :mod:`.snapshot`,
:mod:`.catchup` (catchup, follow), :mod:`.status`, :mod:`.compare` (verify, recover),
:mod:`.manage` (cutover, prune, add-table, resync, finish), :mod:`.servers` (spark, server,
demo); the argument parser (:mod:`.parser`, which the CLI reference is generated from), what
they print (:mod:`.output`), and signals and workers (:mod:`.signals`).
"""

from __future__ import annotations

import sys

from ..engine.errors import PgcdcError
from ..engine.settings import SettingsError
from .output import CliError
from .parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, SettingsError) as exc:
        print(f"pgcdc: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if args.debug:
            raise
        from ..defs.storage_outage import as_storage_error

        shown = as_storage_error(exc)  # Dagster's storage away: one line whatever raised it
        if isinstance(shown, PgcdcError):
            print(f"pgcdc: {shown}", file=sys.stderr)
        else:
            print(f"pgcdc: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
