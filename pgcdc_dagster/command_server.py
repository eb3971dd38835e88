"""The warm command server: imports Dagster, its storage and this project once, then runs each
``pgcdc`` command handed to it (see :mod:`.launcher`) in a forked child.

What must hold:

* the server forks while it is a single Python thread that has opened nothing but its own
  sockets and lock: no database connection, no Dagster instance, no Spark session exists
  before a fork, so a child starts as clean as a fresh process, only with its modules loaded
  (the only other threads are the native ones pyarrow's allocator and numpy's BLAS start at
  import, both of which handle fork);
* a child takes its command's environment, directory, umask, argv and standard streams before
  any of our code runs, closes everything of the server's, and reports its own exit status; the
  server reports a death by signal, the one status a child cannot send;
* a child dies at once when its command's process does (see :func:`_die_with_client`);
* one server per lock file: a second one started meanwhile exits at once; ``stop``, a stale
  fingerprint or the idle timeout release the lock and the socket at once, and the server ends
  when the commands it runs have ended.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import selectors
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

from . import launcher, server_client
from .engine.processes import fresh_standard_streams

PRELOAD = (
    "pgcdc_dagster.cli",
    "pgcdc_dagster.definitions",
    "pgcdc_dagster.engine.control.pipeline",
    "pgcdc_dagster.engine.follow.follower",
    "pgcdc_dagster.engine.snapshot",
    "pgcdc_dagster.runner",
    "pgcdc_dagster.defs.instance",
    "pgcdc_dagster.defs.jobs",
    "dagster",
    "dagster._core.storage.event_log",
    "dagster._core.storage.runs",
    "dagster._core.storage.schedules",
    "dagster_postgres",
    "sqlalchemy.dialects.postgresql.psycopg2",
    "psycopg2",
    # what Dagster imports lazily on a command's path (instance, run, compute logs): the
    # modules a snapshot's child would import itself (their cost: benchmarks/HISTORY.md, "A
    # command's start-up and teardown")
    "dagster._core.instance.factory",
    "dagster._core.instance.runs.run_domain",
    "dagster._core.execution.execute_in_process",
    "dagster._core.executor.in_process",
    "dagster._core.secrets.env_file",
    "dagster._core.storage.local_compute_log_manager",
    "dagster._core.storage.root",
    "dagster._core.system_config.composite_descent",
    "dagster._core.definitions.external_asset",
    "dagster._core.definitions.repository_definition.repository_data_builder",
    "upath",
    "upath.core",
    "upath.implementations.local",
    "zstandard",
    "psycopg2.extras",
    "dagster._core.execution.plan.active",
    "pgcdc_dagster.engine.source.preflight",
    "pgcdc_dagster.engine.source.publication",
    # what the engine's first Arrow calls import: pa.array() asks pandas whether its input is a
    # pandas object, importing it in the middle of a follow's first range, which waits for it
    "pandas",
    "pyarrow.pandas_compat",
    "pyarrow.dataset",
    "numpy.ma",
)
"""What every command would import first. A module missing here (or gone from a later Dagster)
is imported by the child that needs it, as in a fresh process: a cost, never a fault."""


class _Server:
    def __init__(self, fingerprint: str, idle_s: float) -> None:
        self.fingerprint = fingerprint
        self.idle_s = idle_s
        self.paths = server_client.server_paths()
        self.lock_fd: int | None = None
        self.listener: socket.socket | None = None
        self.children: dict[int, socket.socket] = {}
        self.served = 0
        self.started = time.time()
        self.last_activity = time.monotonic()
        self.wake_r, self.wake_w = socket.socketpair()
        self.selector = selectors.DefaultSelector()

    # -- life ----------------------------------------------------------------------------

    def take_lock(self) -> bool:
        fd = os.open(self.paths.lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.lock_fd = fd
        return True

    def listen(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.paths.socket.unlink()  # a dead server's: we hold the lock
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.paths.socket))
        os.chmod(self.paths.socket, 0o600)
        listener.listen(64)
        self.listener = listener
        self.last_activity = time.monotonic()  # idle from now, not from before the imports

    def close_door(self) -> None:
        """No new commands: the socket and the lock go now (a new server may start at once);
        the commands under way finish and report as usual."""
        if self.listener is not None:
            self.selector.unregister(self.listener)
            self.listener.close()
            self.listener = None
            with contextlib.suppress(FileNotFoundError):
                self.paths.socket.unlink()
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def run(self) -> None:
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, _note_signal)
        self.wake_w.setblocking(False)
        signal.set_wakeup_fd(self.wake_w.fileno())
        self.selector.register(self.wake_r, selectors.EVENT_READ)
        assert self.listener is not None
        self.selector.register(self.listener, selectors.EVENT_READ)
        while self.listener is not None or self.children:
            timeout = None
            if self.listener is not None and not self.children:
                timeout = max(0.0, self.last_activity + self.idle_s - time.monotonic())
            events = self.selector.select(timeout)
            if not events and self.listener is not None and not self.children:
                self.close_door()  # idle: nothing to finish
                continue
            for key, _ in events:
                if key.fileobj is self.wake_r:
                    self.on_signals()
                elif self.listener is not None and key.fileobj is self.listener:
                    self.accept()
        self.wake_r.close()
        self.wake_w.close()

    def on_signals(self) -> None:
        received = self.wake_r.recv(4096)
        self.reap()
        if any(signum in received for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)):
            self.close_door()

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            self.last_activity = time.monotonic()
            if conn is None:
                continue
            if os.WIFSIGNALED(status):  # the child could not say so itself
                signum = os.WTERMSIG(status)
                with contextlib.suppress(OSError):
                    reply = {"exit": 128 + signum, "signal": signal.Signals(signum).name}
                    server_client.send_message(conn, reply)
            conn.close()

    # -- one connection ------------------------------------------------------------------

    def accept(self) -> None:
        assert self.listener is not None
        conn, _ = self.listener.accept()
        self.last_activity = time.monotonic()
        fds: list[int] = []
        try:
            conn.settimeout(5.0)
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)
            uid = int.from_bytes(creds[4:8], sys.byteorder)
            request, fds = server_client.receive_message(conn, want_fds=3)
            if uid != os.getuid() or request is None:
                conn.close()
                return
            op = request.get("op")
            if op == "status":
                server_client.send_message(conn, self.status())
            elif op == "stop":
                server_client.send_message(conn, {"stopping": True, **self.status()})
                self.close_door()
            elif op == "run" and len(fds) == 3:
                if request.get("fingerprint") != self.fingerprint:
                    server_client.send_message(conn, {"stale": True})
                    self.close_door()
                else:
                    self.fork(conn, request, fds)
                    return  # the connection now belongs to the child (and to reap)
            conn.close()
        except (OSError, ValueError):
            conn.close()
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def status(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "started": self.started,
            "commands_served": self.served,
            "commands_running": len(self.children),
            "idle_s": self.idle_s,
            "accepting": self.listener is not None,
        }

    def fork(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
        pid = os.fork()
        if pid == 0:
            try:
                self.become_command(conn, request, fds)
            except BaseException:
                traceback.print_exc()  # on the command's stderr, if it got that far
            finally:
                os._exit(70)  # become_command exits itself; this is for its failures
        self.served += 1
        self.children[pid] = conn

    def become_command(self, conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
        """In the child: shed the server, take the command's process state, run it, exit."""
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if self.listener is not None:
            self.listener.close()
        if self.lock_fd is not None:
            os.close(self.lock_fd)
        self.selector.close()
        self.wake_r.close()
        self.wake_w.close()
        for other in self.children.values():
            other.close()
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        fresh_standard_streams()
        os.environ.clear()
        os.environ.update(request["env"])
        time.tzset()
        os.chdir(request["cwd"])
        os.umask(int(request["umask"]))
        _limits_of_the_command(request)
        sys.argv = [request["argv0"], *request["argv"]]
        conn.settimeout(None)
        server_client.send_message(conn, {"pid": os.getpid()})
        threading.Thread(target=_die_with_client, args=(conn,), daemon=True).start()

        code = launcher.run_main(list(request["argv"]))
        with contextlib.suppress(OSError):
            server_client.send_message(conn, {"exit": code})
        os._exit(code)


def _limits_of_the_command(request: dict[str, Any]) -> None:
    """The command process's niceness and resource limits, as far as this process may take
    them (lower is always allowed; above the server's own hard limit is not)."""
    import resource

    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, 0, int(request["nice"]))
    for name, (soft, hard) in request["rlimits"].items():
        which = getattr(resource, name, None)
        if which is not None:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(which, (soft, hard))


def _note_signal(signum: int, frame: object) -> None:
    """Only wakes the loop (through the wakeup fd); the loop decides."""


def _die_with_client(conn: socket.socket) -> None:
    """The command's own process is this child's only reason to run: when it goes (its end of
    the socket closes, as it does even on SIGKILL), this child goes at once too, as it would
    have died with it had it run there."""
    while True:
        try:
            data = conn.recv(4096)
        except OSError:
            data = b""
        if not data:
            os.kill(os.getpid(), signal.SIGKILL)


def serve() -> int:
    fingerprint = server_client.code_fingerprint()  # before the imports: a later change is stale
    idle_s = server_client.server_idle_s()
    server = _Server(fingerprint, idle_s)
    if not server.take_lock():
        return 0  # another server runs, or is starting
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            print(f"not preloaded: {name}: {exc}", flush=True)
    server.listen()
    print(f"pgcdc command server {os.getpid()} listening at {server.paths.socket}", flush=True)
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(serve())
