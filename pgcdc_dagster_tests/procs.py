"""Live processes, from ``/proc``, for tests that kill some and check what is left."""

import time
from pathlib import Path

from pgcdc_dagster.engine.processes import pid_running, stat_fields


def gone(pid: int, within_s: float) -> bool:
    """Whether ``pid`` has exited within ``within_s`` (a zombie counts: it runs no more; the
    engine's own answer, :func:`~pgcdc_dagster.engine.processes.pid_running`)."""
    deadline = time.monotonic() + within_s
    while True:
        if not pid_running(pid):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def nice(pid: int) -> int:
    fields = stat_fields(pid)
    assert fields is not None, f"process {pid} is gone"
    return int(fields[16])


def descendants(root: int) -> dict[int, str]:
    """Every live descendant of ``root``: pid -> command line."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = stat_fields(int(entry.name))
        try:
            commands[int(entry.name)] = (
                (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            )
        except OSError:
            continue
        if fields is not None:
            parents[int(entry.name)] = int(fields[1])
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found[child] = commands.get(child, "")
                frontier.append(child)
    return found
