"""Counting the calls of a real method: for tests that a path does without it."""

from __future__ import annotations

from typing import Any

import pytest


class CallCount:
    """Wraps ``owner.name`` (a class's or an object's method) for the test: still called,
    counted in :attr:`count`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
        self.count = 0
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
