"""Whether a process of this machine still runs: the one answer for a run's worker (named by a
Dagster run tag) and for the warm Spark server (named in the store's record); and the standard
streams a forked child must rebuild.

A pid alone is not a name: pids are recycled, so a process is named ``host:pid:start``, its
start time in clock ticks since boot (field 22 of ``/proc/<pid>/stat``), and a process that has
exited but was not yet reaped by its parent (a zombie) counts as gone: it runs no code and holds
no lock.
"""

from __future__ import annotations

import io
import os
import socket
import sys


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[0]`` the state, ``[1]`` the
    parent, ``[16]`` the niceness, ``[19]`` the start time); ``None`` when the process is gone or
    a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if not fields or fields[0] == "Z" else fields


def pid_running(pid: int) -> bool:
    """Whether ``pid`` names a running process (not a zombie) now."""
    return pid > 0 and stat_fields(pid) is not None


def identity(pid: int | None = None) -> str:
    """``host:pid:start`` of a running process of this machine (this one by default)."""
    pid = os.getpid() if pid is None else pid
    fields = stat_fields(pid)
    start = fields[19] if fields is not None and len(fields) > 19 else "?"
    return f"{socket.gethostname()}:{pid}:{start}"


def alive(name: str | None) -> bool | None:
    """Whether the process named by :func:`identity` still runs; ``None`` when it cannot be
    told from here (another host, or no name)."""
    if not name:
        return None
    host, _, rest = name.partition(":")
    pid_text, _, start = rest.partition(":")
    if host != socket.gethostname() or not pid_text.isdigit():
        return None
    return start != "?" and identity(int(pid_text)) == name


def fresh_standard_streams() -> None:
    """In a forked child: new Python objects for the standard streams over descriptors 0, 1
    and 2, buffered as a fresh process buffers them (stdout by lines on a terminal, in blocks
    otherwise; stderr by lines). The inherited objects may hold a lock a thread of the parent
    had taken at the fork, and may wrap descriptors the child has since replaced."""
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), line_buffering=os.isatty(1), errors="strict"
    )
    sys.stderr = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), line_buffering=True, errors="backslashreplace"
    )
