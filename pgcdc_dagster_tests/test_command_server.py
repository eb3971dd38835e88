"""``pgcdc`` commands run in a warm command server's child (:mod:`pgcdc_dagster.launcher`):
they must behave exactly as in their own process, die with it, and never run stale code."""

from __future__ import annotations

import os
import pty
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psycopg
import pytest

from pgcdc_dagster import server_client
from pgcdc_dagster.engine.processes import stat_fields
from pgcdc_dagster_tests.support.procs import descendants, gone, nice

PGCDC = str(Path(sys.executable).parent / "pgcdc")


@pytest.fixture
def server(monkeypatch):
    """A warm server of its own (a private directory; short: a socket path has 108 bytes)."""
    directory = tempfile.mkdtemp(prefix="pgcdc-srv-")
    monkeypatch.setenv("PGCDC_SERVER", "auto")
    monkeypatch.setenv("PGCDC_SERVER_DIR", directory)
    started = subprocess.run([PGCDC, "server", "start"], capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    pid = server_client.ask("status")["pid"]
    yield pid
    subprocess.run([PGCDC, "server", "stop"], capture_output=True, check=True)
    assert gone(pid, 10)


def _served() -> int:
    return int(server_client.ask("status")["commands_served"])


def test_commands_run_warm_with_their_own_terminal_directory_and_environment(
    server, cli_env, tmp_path, monkeypatch
):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.setenv("PGCDC_STORE", "relative-store")  # resolved in the command's directory
    before = _served()
    master, slave = pty.openpty()
    snap = subprocess.Popen([PGCDC, "snapshot"], cwd=work, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    drawn = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the terminal's other side closed
            break
        if not chunk:
            break
        drawn += chunk
    out, _ = snap.communicate(timeout=300)
    os.close(master)
    text = drawn.decode(errors="replace")
    assert snap.returncode == 0, text
    assert "\x1b[" in text and "public.items" in text  # rich drew on the passed terminal
    assert out.decode().startswith("base snapshot taken: consistent point ")
    assert (work / "relative-store").is_dir()

    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        conn.execute("INSERT INTO items SELECT g, 'n' FROM generate_series(1001, 1100) g")
    caught = subprocess.run([PGCDC, "catchup"], cwd=work, capture_output=True, text=True)
    assert caught.returncode == 0, caught.stderr
    assert "pgcdc: follow: 1 ranges, 1 transactions, 100 changes" in caught.stderr
    assert "\x1b[" not in caught.stderr  # a pipe stays a pipe
    assert _served() == before + 2
    with psycopg.connect(cli_env["PGCDC_TARGET_DSN"]) as conn:
        assert conn.execute("SELECT count(*) FROM items").fetchone() == (200,)


@pytest.mark.parametrize(
    "args,unset",
    [(["status"], "PGCDC_SOURCE_DSN"), (["bogus"], None), (["--help"], None)],
)
def test_exit_status_and_output_are_the_command_s_own(server, args, unset):
    env = {k: v for k, v in os.environ.items() if k != unset}
    here = subprocess.run([PGCDC, *args], env={**env, "PGCDC_SERVER": "off"},
                          capture_output=True, text=True)  # fmt: skip
    before = _served()
    warm = subprocess.run([PGCDC, *args], env=env, capture_output=True, text=True)
    assert _served() == before + 1
    assert (warm.returncode, warm.stdout, warm.stderr) == (here.returncode, here.stdout,
                                                           here.stderr)  # fmt: skip
    assert here.returncode == (0 if args == ["--help"] else 2)


def _forked_child(parent: int, what: str) -> int:
    """The child ``parent`` forked (the same program: the server's command child, or that
    child's follower process), once it exists."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for pid, command in descendants(parent).items():
            fields = stat_fields(pid)
            if "command_server" in command and fields is not None and int(fields[1]) == parent:
                return pid
        time.sleep(0.05)
    raise AssertionError(f"no {what} under process {parent}")


def _command_child(server_pid: int) -> int:
    """The server's child running the command just started."""
    return _forked_child(server_pid, "command child of the server")


def test_signals_reach_the_command_and_it_dies_with_its_process(server, cli_env):
    taken = subprocess.run([PGCDC, "snapshot"], capture_output=True, text=True)
    assert taken.returncode == 0, taken.stderr

    def limited() -> None:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (900, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )

    follow = subprocess.Popen(["nice", "-n", "7", PGCDC, "follow"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, preexec_fn=limited)  # fmt: skip
    child = _command_child(server)
    time.sleep(3)  # under way: the follower is running
    # It runs at its process's niceness and within its limits, not the server's.
    assert nice(child) == 7
    limits = Path(f"/proc/{child}/limits").read_text()
    assert any(
        ln.startswith("Max open files") and ln.split()[3] == "900" for ln in limits.splitlines()
    )
    follow.send_signal(signal.SIGTERM)
    out, err = follow.communicate(timeout=60)
    assert follow.returncode == 0, err
    assert "SIGTERM: stopping at the next range boundary" in err
    assert out.startswith("stopped at a range boundary")
    assert gone(child, 10)

    follow = subprocess.Popen([PGCDC, "follow"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)  # fmt: skip
    child = _command_child(server)
    follower = _forked_child(child, "follower process")  # warm too, a process of its own
    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        conn.execute("INSERT INTO items SELECT g, 'n' FROM generate_series(2001, 2050) g")
    time.sleep(2)
    follow.kill()  # SIGKILL: the command's own process cannot pass anything on
    follow.wait()
    assert gone(child, 5), "the command ran on after its process was killed"
    assert gone(follower, 5), "the follower ran on without the command that held the lock"

    # The next plain command resumes from the durable state: each row exactly once.
    caught = subprocess.run([PGCDC, "catchup"], capture_output=True, text=True)
    assert caught.returncode == 0, caught.stderr
    with psycopg.connect(cli_env["PGCDC_TARGET_DSN"]) as conn:
        assert conn.execute("SELECT count(*), count(DISTINCT id) FROM items").fetchone() == (
            150,
            150,
        )


def _next_server() -> dict:
    """The status of the server a command left behind (it starts as that command exits)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            return server_client.ask("status")
        except server_client.ServerUnavailable:
            time.sleep(0.2)
    raise AssertionError("no new server after a command ran without one")


def test_a_command_outlives_its_server_and_still_reports(server, cli_env):
    """The server killed outright while a command runs in its child: the command goes on,
    signals still reach it, and it still reports its own exit status."""
    taken = subprocess.run([PGCDC, "snapshot"], capture_output=True, text=True)
    assert taken.returncode == 0, taken.stderr
    follow = subprocess.Popen([PGCDC, "follow"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)  # fmt: skip
    child = _command_child(server)
    time.sleep(2)
    os.kill(server, signal.SIGKILL)
    assert gone(server, 5)
    time.sleep(1)
    assert not gone(child, 0.1)
    follow.send_signal(signal.SIGTERM)
    out, err = follow.communicate(timeout=60)
    assert follow.returncode == 0, err
    assert out.startswith("stopped at a range boundary")
    assert gone(child, 10)

    # The dead server's socket is left behind: the next command runs in its own process, and
    # the server it leaves takes over the dead one's lock and socket.
    assert server_client.server_paths().socket.exists()
    ran = subprocess.run([PGCDC, "--help"], capture_output=True, text=True)
    assert ran.returncode == 0
    assert _next_server()["pid"] != server


def test_a_server_never_runs_changed_code(server):
    with server_client.connected(5) as conn:
        request = {"op": "run", "argv0": "pgcdc", "argv": ["status"], "env": {}, "cwd": "/",
                   "umask": 0o22, "fingerprint": "0" * 64}  # fmt: skip
        server_client.send_message(conn, request, [0, 1, 2])
        reply, _ = server_client.receive_message(conn)
    assert reply == {"stale": True}
    assert gone(server, 10)
    assert not server_client.server_paths().socket.exists()

    # The next command runs in its own process, then leaves a server with the current code.
    ran = subprocess.run([PGCDC, "server", "status"], capture_output=True, text=True)
    assert ran.stdout.strip() == "no command server is running"
    ran = subprocess.run([PGCDC, "--help"], capture_output=True, text=True)
    assert ran.returncode == 0
    status = _next_server()
    assert status["pid"] != server and status["commands_served"] == 0


def test_an_idle_server_goes_away(monkeypatch):
    monkeypatch.setenv("PGCDC_SERVER_DIR", tempfile.mkdtemp(prefix="pgcdc-srv-"))
    monkeypatch.setenv("PGCDC_SERVER_IDLE_S", "1")
    monkeypatch.setenv("PGCDC_SERVER", "auto")
    started = subprocess.run([PGCDC, "server", "start"], capture_output=True, text=True)
    assert started.returncode == 0, started.stderr
    pid = server_client.ask("status")["pid"]
    assert gone(pid, 10)
    assert not server_client.server_paths().socket.exists()


def test_messages_that_arrive_in_one_read_are_all_delivered():
    """A quick command's child sends its ``pid`` and its ``exit`` back to back: the client may
    read both at once, and must not lose the second (it would report no exit status)."""
    import socket

    ours, theirs = socket.socketpair()
    with ours, theirs:
        server_client.send_message(theirs, {"pid": 123})
        server_client.send_message(theirs, {"exit": 0})
        theirs.shutdown(socket.SHUT_WR)
        time.sleep(0.1)  # both frames are in our receive buffer before the first read
        replies = server_client.MessageReader(ours)
        assert [replies.next(), replies.next(), replies.next()] == [{"pid": 123}, {"exit": 0}, None]
