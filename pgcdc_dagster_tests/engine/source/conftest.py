"""Fixtures of the source stage's tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest


@pytest.fixture
def source(source_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection to a fresh source database (``source_dsn``)."""
    with psycopg.connect(source_dsn, autocommit=True) as conn:
        yield conn
