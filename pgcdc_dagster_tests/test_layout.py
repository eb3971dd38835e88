"""The package's layout as docs/architecture.md describes it: a row for every module and
folder, and none for one that is gone (the same check the docs' strict build makes, here so
that ``make test`` fails on a module added or moved without its line)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
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


ENGINE = REPO / "pgcdc_dagster/engine"
ENGINE_TESTS = REPO / "pgcdc_dagster_tests/engine"

# Engine modules (under pgcdc_dagster/engine/) that no test of their own folder imports, each
# covered only through other modules, and where; every other module must be imported by a test
# of its folder.
STORE_ROOM = "a room of output_store, through OutputStore: store/test_store.py, test_retention.py"
COVERED_THROUGH_OTHERS: dict[str, str] = {
    "apply/held_back.py": "an added table's held-back changes: snapshot/test_added.py",
    "apply/indexes_aside.py": "set aside by a repair replacing a table whole: test_recover.py",
    "apply/sequences.py": "synced by every snapshot: snapshot/test_snapshot.py",
    "apply/spark_staging.py": "apply_range on Spark: apply/test_apply.py, test_spark_cluster.py",
    "apply/target_tables.py": "the target's tables as apply_range reads them: apply/test_apply.py",
    "compaction/partitions.py": "routed and compacted from a real range: apply/test_apply.py",
    "compaction/object_reader.py": "a range on S3 read by a cluster's executors: "
    "test_spark_cluster.py",
    "compaction/spark.py": "routed by Spark from a real range: apply/test_apply.py",
    "compare/consistent_pair.py": "the pair compare_online takes: compare/test_verify_online.py",
    "compare/recover.py": "`pgcdc recover` end to end: test_recover.py, test_failover.py",
    "control/adding.py": "through pipeline's names: snapshot/test_added.py, test_cli.py",
    "control/agreement.py": "through pipeline's names: test_cli.py, defs/test_end_to_end.py",
    "control/failover.py": "a catch-up across a failover of the source: test_failover.py",
    "control/sessions.py": "through pipeline's names, opened by every step's test",
    "control/snapshot_step.py": "through pipeline.take_snapshot: snapshot/, test_resume.py",
    "control/head_start.py": "a command's head start: test_cli.py, follow/test_follow.py",
    "control/status.py": "`pgcdc status`: test_cli.py, test_resume.py, test_failover.py",
    "failpoints.py": "armed by the crash tests: test_resume.py, snapshot/test_added.py and others",
    "follow/outage_clock.py": "a follow's outages: follow/test_follow.py, test_resume.py",
    "follow/registry.py": "a follow stopped by SIGTERM: test_cli.py, test_resume.py",
    "source/standby.py": "decoding on a hot standby, its promotion: test_failover.py",
    "postgres_installs.py": "other majors' tools: test_versions.py, test_failover.py",
    "settings.py": "every end-to-end test's settings; their refusals: test_cli.py, defs/",
    "snapshot/added.py": "tables added, via pipeline.add_tables: snapshot/test_added.py",
    "snapshot/copied_ranges.py": "what a killed snapshot copied: test_resume.py, test_published.py",
    "snapshot/resume.py": "a killed snapshot resumed: test_resume.py, test_published.py",
    "source/failover.py": "whether the slot survives a failover: test_failover.py",
    "source/slot_wait.py": "what a new slot waits for, via create_slot: source/test_slot.py",
    "source/stream.py": "the follow's streaming receive, via Follower: follow/test_follow.py",
    "source/timeline.py": "the source's timeline across a promotion: test_failover.py",
    "spark/java.py": "the JVM of every Spark session: spark/test_spark_connect.py",
    "spark/probe.py": "run by check_executors: spark/test_spark_connect.py, test_spark_cluster.py",
    "store/chain.py": STORE_ROOM,
    "store/layout.py": STORE_ROOM,
    "store/range_writer.py": STORE_ROOM,
}


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def _imported(test_file: Path) -> set[str]:
    """The modules ``test_file`` imports, anywhere in it: each ``import a.b``; each ``from a
    import b`` as ``a`` and, of the engine, as ``b`` where it is a module, or as the module
    that defines ``b`` (a name ``a`` re-exports counts for the module it comes from)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(test_file.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            if not node.module.startswith("pgcdc_dagster.engine"):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                value = getattr(module, alias.name, None)
                if value is None:  # a submodule not imported yet: Python imports it
                    found.add(f"{node.module}.{alias.name}")
                elif inspect.ismodule(value):
                    found.add(value.__name__)
                elif getattr(value, "__module__", None):
                    found.add(value.__module__)
    return found


def test_every_engine_module_is_imported_by_a_test_of_its_mirrored_folder():
    """``pgcdc_dagster/engine/<stage>/<module>.py`` is tested in
    ``pgcdc_dagster_tests/engine/<stage>/``, a top-level engine module in
    ``pgcdc_dagster_tests/engine/`` itself: a test file there imports it, or it is listed in
    :data:`COVERED_THROUGH_OTHERS` with the reason. Every test folder mirrors a subpackage."""
    stages = {p.parent.name for p in ENGINE.glob("*/__init__.py")}
    folders = {p.name for p in ENGINE_TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= stages, f"test folders of no engine subpackage: {sorted(folders - stages)}"
    assert all((ENGINE_TESTS / f / "__init__.py").is_file() for f in folders)

    untested, listed_but_tested = [], []
    for path in sorted(ENGINE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        relative = str(path.relative_to(ENGINE))
        tests = ENGINE_TESTS / path.parent.relative_to(ENGINE)
        imported = any(_module_name(path) in _imported(t) for t in tests.glob("test_*.py"))
        if relative in COVERED_THROUGH_OTHERS:
            if imported:
                listed_but_tested.append(relative)
        elif not imported:
            untested.append(relative)
    gone = [m for m in COVERED_THROUGH_OTHERS if not (ENGINE / m).is_file()]
    assert untested == [], f"no test of its folder imports: {untested}"
    assert listed_but_tested == [], f"exempt, yet a test of its folder imports: {listed_but_tested}"
    assert gone == [], f"exempt, yet no such module: {gone}"


MOST_LINES = 750
"""A module past this many lines holds more than one job, unless :data:`LONG_MODULES` says why
it is one."""

LONG_MODULES: dict[str, str] = {
    "pgcdc_dagster/engine/apply/ddl.py": (
        "planning a change by attnum, carrying it out and recording the new shape are one "
        'transaction\'s work and one invariant (its docstring, "Why one module")'
    ),
    "pgcdc_dagster/engine/follow/follower.py": (
        "the follow's thread state machine (sessions, outages, the applier, making way for "
        "add-table): its states share the follower's fields, and a split would pass them around"
    ),
    "pgcdc_dagster_tests/test_resume.py": (
        "the crash tests of the commands end to end, on one site fixture per test: a SIGKILL at "
        "each durable step of every command, grouped by command"
    ),
    "pgcdc_dagster_tests/engine/follow/test_follow.py": (
        "the follower's behaviours on one pair of shared clusters, one test each"
    ),
    "pgcdc_dagster_tests/engine/snapshot/test_snapshot.py": (
        "the snapshot's behaviours on one pair of shared clusters, one test each"
    ),
    "pgcdc_dagster_tests/engine/apply/test_apply.py": (
        "apply_range's behaviours on one pair of shared clusters, one test each"
    ),
    "pgcdc_dagster_tests/engine/snapshot/test_added.py": (
        "add-table and resync on one pair of shared clusters, their crash tests among them"
    ),
    "pgcdc_dagster_tests/test_cli.py": "every command's output and refusals, one test each",
    "benchmarks/harness.py": (
        "what every benchmark needs (clusters, the native peer, the CPU meter, the equality "
        "check, the median, the report) in one place, so no benchmark imports another"
    ),
    "benchmarks/spark_paths.py": (
        "one benchmark comparing every Spark path (local, Connect, standalone cluster) on the "
        "same data in the same run"
    ),
}


def test_no_module_is_longer_than_its_job_without_a_reason():
    """Every Python module of the package, the tests and the benchmarks stays within
    :data:`MOST_LINES` lines, or is listed in :data:`LONG_MODULES` with the reason."""
    lengths = {
        str(path.relative_to(REPO)): len(path.read_text(encoding="utf-8").splitlines())
        for folder in ("pgcdc_dagster", "pgcdc_dagster_tests", "benchmarks")
        for path in (REPO / folder).rglob("*.py")
    }
    long = sorted(m for m, n in lengths.items() if n > MOST_LINES and m not in LONG_MODULES)
    listed_short = sorted(m for m in LONG_MODULES if lengths.get(m, 0) <= MOST_LINES)
    assert long == [], f"over {MOST_LINES} lines with no reason in LONG_MODULES: {long}"
    assert listed_short == [], f"in LONG_MODULES, yet short or gone: {listed_short}"
