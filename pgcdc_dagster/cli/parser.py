"""The argument parser: every command, its options and help. The CLI reference
(``docs/reference/cli.md``) is generated from it."""

from __future__ import annotations

import argparse

from .catchup import cmd_catchup, cmd_follow
from .compare import cmd_recover, cmd_verify
from .manage import cmd_add_table, cmd_cutover, cmd_finish, cmd_prune
from .servers import cmd_demo, cmd_server, cmd_spark
from .snapshot import cmd_snapshot
from .status import cmd_status


def _asks_for_the_range(p: argparse.ArgumentParser) -> None:
    """The options of a command that needs the range to itself for a while (add-table,
    cutover, finish): a running follow makes way for it."""
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--wait",
        type=float,
        default=120.0,
        help="seconds to wait for the range (a running follow makes way in about a second)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pgcdc", description="PostgreSQL to PostgreSQL replication as Dagster assets."
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("snapshot", help="materialise base_snapshot (the initial copy)")
    p.add_argument("--resnapshot", action="store_true", help="re-copy a populated target")
    p.add_argument("--json", action="store_true", help="the snapshot's metadata, as JSON")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for a run in flight")
    p.set_defaults(func=cmd_snapshot)
    p = sub.add_parser("catchup", help="receive and apply up to endpos (follow with an endpos)")
    p.add_argument("--endpos", default="current", help="an LSN X/Y, or 'current' (default)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for a run in flight")
    p.set_defaults(func=cmd_catchup)
    p = sub.add_parser(
        "follow",
        help="receive and apply continuously, until SIGTERM/SIGINT; without --endpos it waits "
        "out a source, target or Dagster storage that went away (PGCDC_FOLLOW_RETRY, default "
        "10m)",
    )
    p.add_argument("--endpos", default=None, help="stop at this LSN X/Y, or 'current'")
    p.add_argument("--json", action="store_true")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for a run in flight")
    p.set_defaults(func=cmd_follow)
    p = sub.add_parser("status", help="slot positions, lag, last range, replay LSN")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser(
        "verify",
        help="compare every table on source and target at one consistent point, chunk by "
        "chunk, while the replication goes on (a follow makes way for a moment)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--repair",
        action="store_true",
        help="replace the differing chunks on the target with the source's rows, then compare "
        "those tables again (the repair job)",
    )
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the range")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser(
        "recover",
        help="after the slot was lost (invalidated or dropped): create it anew and copy only "
        "the rows changed since the target's position (or, where that cannot be trusted, the "
        "chunks that differ)",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--wait", type=float, default=120.0, help="seconds to wait for the range")
    p.add_argument(
        "--chunk-rows",
        type=int,
        default=None,
        help="about how many rows a compared chunk holds (default 100000); a differing one is "
        "copied whole",
    )
    p.add_argument(
        "--every-row",
        action="store_true",
        help="compare every row of every table chunk by chunk, not only the rows changed since "
        "the target's position (for a target that may have been written to)",
    )
    p.set_defaults(func=cmd_recover)
    p = sub.add_parser(
        "cutover",
        help="catch up to endpos, copy sequence values, compare every table (a follow makes way)",
    )
    p.add_argument("--endpos", default="current", help="LSN X/Y or 'current' (default)")
    _asks_for_the_range(p)
    p.set_defaults(func=cmd_cutover)
    p = sub.add_parser(
        "finish",
        help="end the replication: drop the source's slot and the target's origin",
    )
    p.add_argument(
        "--abandon",
        action="store_true",
        help="end it though the target lacks changes the source published (they are lost)",
    )
    _asks_for_the_range(p)
    p.set_defaults(func=cmd_finish)
    p = sub.add_parser("prune", help="remove applied ranges older than the store's retention")
    p.add_argument("--retention", help="instead of PGCDC_STORE_RETENTION: 7d, 12h, 30m, 0")
    p.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_prune)
    for name, what in (
        ("add-table", "add tables to the running replication: copied as of now, their changes "
         "from then"),
        ("resync", "copy replicated tables again while replication goes on (a drifted table's "
         "repair)"),
    ):  # fmt: skip
        p = sub.add_parser(name, help=what)
        p.add_argument("tables", nargs="+", help="schema.table (or table, in public)")
        _asks_for_the_range(p)
        p.set_defaults(func=cmd_add_table)
    p = sub.add_parser("spark", help="a warm local Spark Connect server every run then uses")
    p.add_argument("action", choices=["start", "stop", "status"])
    p.add_argument("--master", default="local[*]", help="the server's master (local[*])")
    p.set_defaults(func=cmd_spark)
    p = sub.add_parser("server", help="the warm process commands run in (PGCDC_SERVER=off: none)")
    p.add_argument("action", choices=["start", "stop", "status"])
    p.add_argument("--json", action="store_true", help="status as JSON (pid, commands served)")
    p.set_defaults(func=cmd_server)
    p = sub.add_parser("demo", help="the embedded default: local clusters, workload, cutover")
    p.add_argument("--ui", action="store_true", help="leave the webserver running afterwards")
    p.add_argument("--seconds", type=float, default=20.0, help="workload duration")
    p.add_argument("--tps", type=int, default=300, help="workload transactions per second")
    p.set_defaults(func=cmd_demo)
    return parser
