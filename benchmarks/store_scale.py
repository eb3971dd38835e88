"""What the output store's size costs the paths a follow and a command take (engine only).

A follow stores a range every few hundred milliseconds and the retention keeps a week of them:
millions of folders. This writes a chain of ``--ranges`` ranges by hand (``--step`` bytes of WAL
each, one transaction each: ``harness.write_store``, as the retention benchmark does, in the
layout of the code under test), then times, each from a fresh :class:`OutputStore` (nothing
cached), median of ``--repeat``:

* ``write_next_s``: storing the next range (a writer, one manifest, the fsyncs, the rename):
  what a follow pays per range;
* ``decide_s``: what comes next (:func:`decide`, the target's origin at the last commit): what
  every command and every follow session (after an outage of its servers) pays first;
* ``last_stored_s``: the chain's last range (:meth:`last_stored`, the slot's confirmation at
  each command's start);
* ``prune_idle_s``: a prune that finds nothing old enough (every 10 minutes, in a follow);
* ``count_s``: how many ranges the chain holds (``pgcdc status``).

Run it against other code (for example the commit before a change) by running the copy of this
file in that checkout. Usage: ``.venv/bin/python benchmarks/store_scale.py [--ranges 300000]
[--step 16384] [--repeat 5] [--json F]``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # this checkout's code, whatever the virtualenv installed
sys.path.insert(0, str(REPO / "benchmarks"))

import harness  # noqa: E402

from pgcdc_dagster.engine.control.next_step import decide  # noqa: E402
from pgcdc_dagster.engine.lsn import Lsn, LsnRange  # noqa: E402
from pgcdc_dagster.engine.store.output_store import OutputStore  # noqa: E402
from pgcdc_dagster.engine.store.retention import prune  # noqa: E402
from pgcdc_dagster_tests.support.stores import range_manifest  # noqa: E402


def timed(repeat: int, call: Callable[[], Any]) -> float:
    runs = []
    for _ in range(repeat):
        began = time.perf_counter()
        call()
        runs.append(time.perf_counter() - began)
    return round(harness.median(runs), 4)  # type: ignore[arg-type]


def main() -> None:
    parser = harness.argument_parser(__doc__, profile=None, repeat=5, json=True)
    parser.add_argument("--ranges", type=int, default=300_000)
    parser.add_argument("--step", type=lambda v: int(v, 0), default=0x4000)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pgcdc-store-scale-"))
    try:
        root = work / "store"
        began = time.perf_counter()
        last = harness.write_store(root, args.ranges, 3600, step=args.step)
        report: dict[str, Any] = {
            "ranges": args.ranges,
            "step": args.step,
            "write_store_s": round(time.perf_counter() - began, 1),
        }
        end = OutputStore(root).chain_end()

        def write_next() -> None:
            nonlocal end, last
            nxt = Lsn(int(end) + args.step)
            last = Lsn(int(nxt) - 0x100)
            with OutputStore(root).writer(LsnRange(end, nxt)) as writer:
                writer.commit(range_manifest(str(end), str(nxt), str(last)))
            end = nxt

        report["write_next_s"] = timed(args.repeat, write_next)
        beyond = Lsn(int(end) + 0x100_0000)
        report["decide_s"] = timed(
            args.repeat, lambda: decide(OutputStore(root), last, None, beyond, 0x100_0000)
        )
        report["last_stored_s"] = timed(args.repeat, lambda: OutputStore(root).last_stored())
        report["prune_idle_s"] = timed(
            args.repeat, lambda: prune(OutputStore(root), last, 10 * 86400.0)
        )
        store = OutputStore(root)
        counted = getattr(store, "chain_count", lambda: len(store.chain_ranges()))
        report["count_s"] = timed(args.repeat, counted)
        report["counted"] = counted()
        harness.emit_report(report, args.json, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
