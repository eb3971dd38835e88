"""Talking to the warm command server (:mod:`.command_server`): where it lives, the wire, and
running one command in its child. Used by the ``pgcdc`` entry point (:mod:`.launcher`), the
server itself and ``pgcdc server``.

It imports the standard library only, as the entry point does: every command pays for what it
imports before it knows whether a server will run it. For the same reason it is the one place
that reads the ``PGCDC_SERVER*`` variables (:func:`server_mode`, :func:`server_idle_s`,
:func:`server_paths`), rather than :mod:`.engine.settings`, whose validation needs pydantic.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
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


def server_mode() -> str:
    """``PGCDC_SERVER``: ``auto`` (the default: commands run in the server's child when one is
    up) or ``off`` (every command in its own process); anything else is refused by the
    entry point."""
    return os.environ.get("PGCDC_SERVER", "auto")


def server_idle_s() -> float:
    """``PGCDC_SERVER_IDLE_S``: how long a server without a command lives on."""
    return float(os.environ.get("PGCDC_SERVER_IDLE_S") or DEFAULT_IDLE_S)


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
