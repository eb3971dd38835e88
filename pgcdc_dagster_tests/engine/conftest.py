"""Fixtures of the engine's tests, in every stage's folder."""

from __future__ import annotations

import pytest

from pgcdc_dagster.engine.apply import staging


@pytest.fixture(params=["inline", "temp_tables"])
def staged(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """Both ways the merge reads a table's net rows: inline in its statements (few rows, the
    default in these tests) and from temporary tables (past ``INLINE_MAX_VALUES``, here 0).
    Returns the limit in force."""
    if request.param == "temp_tables":
        monkeypatch.setattr(staging, "INLINE_MAX_VALUES", 0)
    return staging.INLINE_MAX_VALUES
