"""Live processes, from ``/proc``, for tests that kill some and check what is left."""

from pathlib import Path


def descendants(root: int) -> dict[int, str]:
    """Every live descendant of ``root``: pid -> command line."""
    parents: dict[int, int] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = (
                (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            )
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found[child] = commands.get(child, "")
                frontier.append(child)
    return found
