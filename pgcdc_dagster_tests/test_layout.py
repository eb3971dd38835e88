"""The package's layout as docs/architecture.md describes it: a row for every module and
folder, and none for one that is gone (the same check the docs' strict build makes, here so
that ``make test`` fails on a module added or moved without its line)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _hook():
    spec = importlib.util.spec_from_file_location(
        "docs_reference", REPO / "docs/hooks/reference.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_page_lists_every_module_of_the_package_and_no_other():
    hook = _hook()
    hook.check_layout((REPO / "docs/architecture.md").read_text(encoding="utf-8"))


def test_a_module_missing_from_the_page_is_named(tmp_path):
    hook = _hook()
    page = (REPO / "docs/architecture.md").read_text(encoding="utf-8")
    row = next(line for line in page.splitlines() if "`pgcdc_dagster/runner.py`" in line)
    with pytest.raises(hook.PluginError, match=r"not described: pgcdc_dagster/runner\.py"):
        hook.check_layout(page.replace(row + "\n", ""))
