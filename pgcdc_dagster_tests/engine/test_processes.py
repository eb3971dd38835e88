"""A process is named by host, pid and start time, and a zombie is gone (real processes)."""

import subprocess
import sys
import time
from pathlib import Path

from pgcdc_dagster.engine.processes import alive, identity, pid_running


def test_a_process_is_alive_until_it_exits_even_unreaped_and_a_recycled_pid_is_not_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        name = identity(child.pid)
        assert alive(name) is True and pid_running(child.pid)
        host, pid, start = name.split(":")
        assert alive(f"{host}:{pid}:{int(start) + 1}") is False  # same pid, another process
        assert alive(f"elsewhere:{pid}:{start}") is None  # cannot be told from here
        assert alive(None) is None
    finally:
        child.kill()
    deadline = time.monotonic() + 10
    while pid_running(child.pid):  # killed, not reaped yet: a zombie, which runs nothing
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert Path(f"/proc/{child.pid}").exists()  # still there, as a zombie
    assert child.poll() is not None  # only now reaped
    assert alive(name) is False
    assert identity().startswith(f"{host}:")  # this process
