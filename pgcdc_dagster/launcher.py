"""The ``pgcdc`` command's entry point: hand the command to a warm command server when one is
up, else run it in this process (and leave a server behind for the next command).

Why: Dagster, its PostgreSQL storage and this project's definitions cost a fresh process about
1.5 CPU-s of imports before a run can start, every command (measured on the 2-core reference
machine: ``pgcdc snapshot`` of pgbench scale 10 took 2.7 s, of which 1.9 s is the engine's
work alone in a fresh process). A command server (:mod:`.command_server`) pays that once: it
imports everything, then forks one child per command. The child is a new process with the
modules already loaded that runs exactly :func:`pgcdc_dagster.cli.main`, with this command's
arguments, environment, working directory, umask and standard streams (passed as file
descriptors, so a terminal stays a terminal).

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
import hashlib
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
LOCAL_COMMANDS = frozenset({"server", "demo"})
"""Commands that always run in this process and leave no server behind: ``server`` manages
the server itself; ``demo`` owns throwaway clusters and is meant to leave nothing running."""
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
DEFAULT_IDLE_S = 900.0
SERVER_ENV = (
    "PATH",
    "HOME",
    "LANG",
    "TMPDIR",
    "VIRTUAL_ENV",
    "PYTHONPATH",
    "JAVA_HOME",
    "SPARK_HOME",
    "SPARK_LOCAL_IP",
    "XDG_RUNTIME_DIR",
    "PGCDC_SERVER_DIR",
    "PGCDC_SERVER_IDLE_S",
)
"""What the server's own environment keeps of the command that starts it (plus ``LC_*``): no
DSN, password or other secret lives on in a long-lived process; each command's child gets its
command's whole environment."""


class ServerUnavailable(Exception):
    """No usable server: the command runs in this process."""


# -- where a server lives ------------------------------------------------------------------


@dataclass(frozen=True)
class ServerPaths:
    socket: Path
    lock: Path
    log: Path


def server_paths() -> ServerPaths:
    """One server per interpreter and installed copy of this package (a virtualenv, a checkout
    on ``PYTHONPATH``): a server never runs another copy's code. The directory is
    ``PGCDC_SERVER_DIR``, else ``$XDG_RUNTIME_DIR/pgcdc``, else ``/tmp/pgcdc-<uid>``."""
    base = os.environ.get("PGCDC_SERVER_DIR")
    if not base:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        base = os.path.join(runtime, "pgcdc") if runtime else f"/tmp/pgcdc-{os.getuid()}"
    directory = Path(base)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = directory.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ServerUnavailable(f"{directory} is not private to this user")
    name = hashlib.sha256(f"{sys.executable}\0{PACKAGE_DIR}".encode()).hexdigest()[:12]
    stem = directory / f"server-{name}"
    return ServerPaths(
        stem.with_suffix(".sock"), stem.with_suffix(".lock"), stem.with_suffix(".log")
    )


def code_fingerprint() -> str:
    """Changes whenever code a command would run may have changed: this package's sources,
    the packages installed beside it, the interpreter."""
    import sysconfig

    newest = max(p.stat().st_mtime_ns for p in PACKAGE_DIR.rglob("*.py"))
    installed = os.stat(sysconfig.get_paths()["purelib"]).st_mtime_ns
    text = f"{sys.executable}\0{sys.version}\0{PACKAGE_DIR}\0{newest}\0{installed}"
    return hashlib.sha256(text.encode()).hexdigest()


# -- the wire: 4-byte length, JSON ---------------------------------------------------------


def send_message(
    conn: socket.socket, message: dict[str, Any], fds: list[int] | None = None
) -> None:
    data = json.dumps(message).encode()
    frame = struct.pack("!I", len(data)) + data
    if fds:
        sent = socket.send_fds(conn, [frame], fds)
        if sent < len(frame):  # (a peer that already answered and closed refuses even b"")
            conn.sendall(frame[sent:])
    else:
        conn.sendall(frame)


class MessageReader:
    """The messages of one connection, in order. Several can arrive in one read (a quick
    command's ``pid`` and ``exit``): what follows a message stays buffered for the next."""

    def __init__(self, conn: socket.socket, want_fds: int = 0) -> None:
        self.conn = conn
        self.want_fds = want_fds
        self.fds: list[int] = []
        self.buffer = bytearray()

    def next(self) -> dict[str, Any] | None:
        """The next message; ``None`` at the end of the stream."""
        while True:
            if len(self.buffer) >= 4:
                (length,) = struct.unpack("!I", self.buffer[:4])
                if len(self.buffer) >= 4 + length:
                    message = json.loads(self.buffer[4 : 4 + length])
                    del self.buffer[: 4 + length]
                    return message
            if self.want_fds:  # descriptors come with the first bytes of their message
                data, fds, _, _ = socket.recv_fds(self.conn, 65536, self.want_fds)
                self.fds += fds
                self.want_fds = 0
            else:
                data = self.conn.recv(65536)
            if not data:
                return None
            self.buffer += data


def receive_message(
    conn: socket.socket, want_fds: int = 0
) -> tuple[dict[str, Any] | None, list[int]]:
    """The first message of a connection and the descriptors that came with it."""
    reader = MessageReader(conn, want_fds)
    return reader.next(), reader.fds


@contextlib.contextmanager
def connected(timeout: float | None = None) -> Iterator[socket.socket]:
    paths = server_paths()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(timeout)
        try:
            conn.connect(str(paths.socket))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ServerUnavailable("no server is running") from exc
        yield conn
    finally:
        conn.close()


def ask(op: str, timeout: float = 5.0) -> dict[str, Any]:
    """A control request (``status``, ``stop``) and the server's reply."""
    with connected(timeout) as conn:
        send_message(conn, {"op": op})
        reply, _ = receive_message(conn)
    if reply is None:
        raise ServerUnavailable("the server closed the connection")
    return reply


# -- running a command there -----------------------------------------------------------------


def run_on_server(argv: list[str]) -> int:
    """Run ``argv`` in a child of the warm server; its exit status. Raises
    :class:`ServerUnavailable` while nothing has started, so the command can run here."""
    child: list[int] = []
    pending: list[int] = []

    def forward(signum: int, frame: object) -> None:
        del frame
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child[0], signum)
        else:
            pending.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED_SIGNALS}
    try:
        with connected() as conn:
            umask = os.umask(0)
            os.umask(umask)
            request = {
                "op": "run",
                "argv0": sys.argv[0],
                "argv": argv,
                "env": dict(os.environ),
                "cwd": os.getcwd(),
                "umask": umask,
                "nice": os.getpriority(os.PRIO_PROCESS, 0),
                "rlimits": _rlimits(),
                "fingerprint": code_fingerprint(),
            }
            send_message(conn, request, [0, 1, 2])
            replies = MessageReader(conn)
            while True:
                reply = replies.next()
                if reply is None:
                    if not child:
                        raise ServerUnavailable("the server closed the connection")
                    print(
                        "pgcdc: the command's process ended without an exit status",
                        file=sys.stderr,
                    )
                    return 1
                if reply.get("stale"):
                    raise ServerUnavailable("the server runs older code; it is stopping")
                if "pid" in reply:
                    child.append(int(reply["pid"]))
                    for signum in pending:
                        forward(signum, None)
                if "exit" in reply:
                    if reply.get("signal"):
                        print(
                            f"pgcdc: the command was killed by {reply['signal']}", file=sys.stderr
                        )
                    return int(reply["exit"])
    except OSError as exc:
        if child:
            raise
        raise ServerUnavailable(str(exc)) from exc
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _rlimits() -> dict[str, tuple[int, int]]:
    import resource

    return {
        name: resource.getrlimit(getattr(resource, name))
        for name in dir(resource)
        if name.startswith("RLIMIT_")
    }


def start_server(wait_s: float = 0.0) -> dict[str, Any] | None:
    """Start a server in the background (a new session, its own log), unless one runs or is
    starting (the server's lock decides). ``wait_s``: wait until it answers, up to that long,
    and return its status."""
    paths = server_paths()
    env = {k: v for k, v in os.environ.items() if k in SERVER_ENV or k.startswith("LC_")}
    with open(paths.log, "ab") as log:
        subprocess.Popen(
            [sys.executable, "-m", "pgcdc_dagster.command_server"],
            cwd=PACKAGE_DIR.parent,  # sys.path[0]: this copy of the package
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ServerUnavailable, OSError):
            return ask("status", timeout=1.0)
        time.sleep(0.1)
    if wait_s:
        raise ServerUnavailable(f"the server did not answer within {wait_s:.0f} s; see {paths.log}")
    return None


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
    teardown. Tearing down the modules Dagster, SQLAlchemy and PySpark load takes about a
    second (measured: a caught-up ``pgcdc catchup`` 3.6 s with it, 2.6 s without) and has
    nothing left to do: every run record and every byte of the store was written and synced
    before ``main`` returned, a local Spark JVM exits when its parent goes, and a process
    killed at any instruction is the case the whole design already survives."""
    argv = sys.argv[1:]
    mode = os.environ.get("PGCDC_SERVER", "auto")
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
