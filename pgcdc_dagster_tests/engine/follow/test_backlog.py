"""The backlog of ranges waiting for their run: bounded memory, order kept, nothing left."""

from __future__ import annotations

import queue

import pytest

from pgcdc_dagster.engine.follow.backlog import Backlog
from pgcdc_dagster.engine.follow.follower import END


def test_past_its_memory_a_backlog_waits_on_disk_and_gives_back_in_order():
    waiting = Backlog(kept=3)
    taken = []
    for n in range(10):
        waiting.put({"range": n, "tables": {"t": n * 2}})
        assert waiting.in_memory <= 3
        if n % 4 == 3:  # the consumer takes one now and then: new items queue behind the file
            taken.append(waiting.get(timeout=0)["range"])
    waiting.put(END)
    assert waiting.qsize() == 9 and waiting.spilled == 8  # 3 to 9, and END
    while (item := waiting.get(timeout=0)) is not END:  # END stays itself through the file
        taken.append(item["range"])
        assert waiting.in_memory <= 3
    assert taken == list(range(10))
    assert waiting.qsize() == 0 and waiting._file is not None and waiting._file.tell() == 0
    with pytest.raises(queue.Empty):
        waiting.get(timeout=0.05)
    waiting.put("after")  # drained: back to memory, the file emptied
    assert waiting.in_memory == 1 and waiting.get(timeout=0) == "after"
    for n in range(5):
        waiting.put(n)
    waiting.close()
    assert waiting._file is None
