"""Live processes, from ``/proc``, for tests that kill some and check what is left."""

import contextlib
import os
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


class MemoryCap:
    """A memory limit the kernel enforces on a process tree: a cgroup of its own (v1's memory
    controller, or v2's), which every process started with :meth:`preexec` and all its
    descendants join; past the limit the kernel reclaims, then OOM-kills one of them.

    Where no cgroup can be made (no memory controller, or no right to write it),
    :attr:`enforced` is false and the test says so: a peak read from ``/proc`` is no limit."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.path: Path | None = None
        self.version = 0
        name = f"pgcdc-test-{os.getpid()}-{time.monotonic_ns()}"
        for version, root, limit_file in (
            (1, Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes"),
            (2, Path("/sys/fs/cgroup"), "memory.max"),
        ):
            try:
                if version == 2 and "memory" not in (root / "cgroup.controllers").read_text():
                    continue
                path = root / name
                path.mkdir()
                (path / limit_file).write_text(str(limit_bytes))
            except OSError:
                continue
            self.path, self.version = path, version
            if version == 1:  # no swap to escape to
                with contextlib.suppress(OSError):
                    (path / "memory.memsw.limit_in_bytes").write_text(str(limit_bytes))
            break

    @property
    def enforced(self) -> bool:
        return self.path is not None

    def preexec(self) -> None:
        """For ``subprocess.Popen(preexec_fn=...)``: the child joins the cgroup before it runs
        anything, so its whole tree is held to the limit."""
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        """The most the tree held at once (its page cache included), in bytes."""
        assert self.path is not None
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        return int((self.path / name).read_text())

    def oom_kills(self) -> int:
        assert self.path is not None
        if self.version == 1:
            text = (self.path / "memory.oom_control").read_text()
        else:
            text = (self.path / "memory.events").read_text()
        for line in text.splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def close(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                self.path.rmdir()

    def __enter__(self) -> "MemoryCap":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
