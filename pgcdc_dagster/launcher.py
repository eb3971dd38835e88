"""The ``pgcdc`` command's entry point: hand the command to a warm command server when one is
up, else run it in this process (and leave a server behind for the next command).

Why: a fresh process imports Dagster, its PostgreSQL storage and this project's definitions
before a run can start, every command, and for a small snapshot or catch-up those imports are a
large part of the whole (see ``benchmarks/HISTORY.md``, "A command's start-up and teardown";
``benchmarks/catchup_cli.py`` and ``benchmarks/snapshot.py`` compare cold and warm). A command
server (:mod:`.command_server`) pays that once: it imports everything, then forks one child per
command. The child is a new process with the modules already loaded that runs exactly
:func:`pgcdc_dagster.cli.main`, with this command's arguments, environment, working directory,
umask and standard streams (passed as file descriptors, so a terminal stays a terminal).

What must hold:

* the command behaves as if it ran here: its exit status is this process's, SIGINT, SIGTERM,
  SIGHUP and SIGQUIT sent to this process reach it (job control does not: Ctrl-Z stops this
  process, not the command), and it runs at this process's niceness
  and within its resource limits (``ulimit``; a limit above the server's own cannot be
  raised). It does not run in this process's cgroup: under a service manager that limits
  memory or CPU by cgroup (a systemd unit's ``MemoryMax=``), set ``PGCDC_SERVER=off``;
* if this process dies, even by SIGKILL, the command dies at once with it (the child kills
  itself when this end of the socket closes): a crash stays a crash, which the design survives;
* code that changed since the server started never runs: the server refuses a command whose
  :func:`code_fingerprint` differs from its own, and exits; the command then runs here;
* only this user's commands reach a server: its directory is private (0700, owned by us), and
  the server checks the peer's uid;
* this module imports the standard library only: every command pays for what it imports.

``PGCDC_SERVER=off`` turns all of it off: every command runs in its own process, as before.
The server exits after ``PGCDC_SERVER_IDLE_S`` (default 900) seconds without a command;
``pgcdc server stop`` stops it at once (commands under way finish).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

from .server_client import ServerUnavailable, run_on_server, server_mode, start_server

LOCAL_COMMANDS = frozenset({"server", "demo"})
"""Commands that always run in this process and leave no server behind: ``server`` manages
the server itself; ``demo`` owns throwaway clusters and is meant to leave nothing running."""


def run_main(argv: list[str]) -> int:
    """:func:`pgcdc_dagster.cli.main`, its exit status (argparse's ``SystemExit`` included),
    with the streams flushed: what this process or a server's child then exits with."""
    from .cli import main

    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: --help, a usage error (its message already printed)
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    from .defs.storage_outage import given_up

    if given_up() is None:
        # Not after a run gave up on Dagster's storage: its worker thread may be inside a
        # handler, failing to write the run's end for seconds, and shutdown waits for it.
        logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    return code


def _command_of(argv: list[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def entry() -> None:
    """The ``pgcdc`` command. After a command run here: leave without the interpreter's
    teardown. Tearing down the modules Dagster, SQLAlchemy and PySpark load takes a large part
    of a short command (see ``benchmarks/HISTORY.md``, "A command's start-up and teardown") and
    has nothing left to do: every run record and every byte of the store was written and synced
    before ``main`` returned, a local Spark JVM exits when its parent goes, and a process killed
    at any instruction is the case the whole design already survives."""
    argv = sys.argv[1:]
    mode = server_mode()
    if mode not in ("auto", "off"):
        print(f"pgcdc: PGCDC_SERVER={mode!r}: use 'auto' (the default) or 'off'", file=sys.stderr)
        os._exit(2)
    served = mode == "auto" and _command_of(argv) not in LOCAL_COMMANDS
    if served:
        with contextlib.suppress(ServerUnavailable):
            os._exit(run_on_server(argv))
    code = run_main(argv)
    if served:
        with contextlib.suppress(Exception):  # a convenience for the next command, never an error
            start_server()
    os._exit(code)
