"""What a Dagster user sees, read through the GraphQL API the UI itself uses, after the commands
a user runs: ``pgcdc snapshot``, a catch-up of a few ranges, ``pgcdc cutover`` and the
``slot_health`` job, on real clusters, with the shipped ``dagster.yaml`` on PostgreSQL storage.

The code location is loaded in this process under ``workspace.yaml``'s location name, as the
webserver would load it, and asked what its pages show: each check's state against its asset's
latest materialisation (the UI's "Not evaluated" is a check whose latest result is older than
the asset's latest materialisation), the runs under each job, where each run is drawn in the
Overview timeline (its repository origin), and each table's storage identity.
"""

from __future__ import annotations

import itertools

import psycopg
import yaml

from pgcdc_dagster.engine.lsn import LsnRange
from pgcdc_dagster_tests.test_cli import REPO, run_cli

ASSETS = """
query {
  assetNodes {
    assetKey { path }
    metadataEntries { label ... on TextMetadataEntry { text } }
    assetChecksOrError {
      ... on AssetChecks {
        checks {
          name
          canExecuteIndividually
          executionForLatestMaterialization { status }
        }
      }
    }
  }
}
"""

JOB_RUNS = """
query ($selector: PipelineSelector!) {
  pipelineOrError(params: $selector) {
    __typename
    ... on Pipeline { runs { runId status } }
  }
}
"""

RUNS = """
query {
  runsOrError {
    ... on Runs {
      results {
        runId
        pipelineName
        repositoryOrigin { repositoryLocationName repositoryName }
        tags { key value }
      }
    }
  }
}
"""


def graphql(context, query: str, variables: dict | None = None) -> dict:
    from dagster_graphql.test.utils import execute_dagster_graphql

    result = execute_dagster_graphql(context.create_request_context(), query, variables)
    assert not result.errors, result.errors
    return result.data


def test_the_ui_shows_checks_evaluated_runs_under_their_jobs_and_tables_apart(
    cli_env, capsys, monkeypatch
):
    from dagster._core.remote_origin import InProcessCodeLocationOrigin
    from dagster._core.types.loadable_target_origin import LoadableTargetOrigin
    from dagster._core.workspace.context import WorkspaceProcessContext
    from dagster._core.workspace.load_target import InProcessWorkspaceLoadTarget

    from pgcdc_dagster.defs import instance as instance_module
    from pgcdc_dagster.defs.instance import LOCATION_NAME, REPOSITORY_NAME, dagster_instance
    from pgcdc_dagster.defs.partitions import LSN_RANGES
    from pgcdc_dagster.runner import launched_by as launched_by_here
    from pgcdc_dagster.runner import run_job

    monkeypatch.setattr(instance_module, "_instance", None)
    workspace = yaml.safe_load((REPO / "workspace.yaml").read_text())
    assert workspace["load_from"][0]["python_module"]["location_name"] == LOCATION_NAME

    assert run_cli(capsys, "snapshot")[0] == 0
    source = cli_env["PGCDC_SOURCE_DSN"]
    for n in range(3):
        with psycopg.connect(source, autocommit=True) as conn:
            conn.execute("INSERT INTO items VALUES (%s, 'new')", (1000 + n,))
            conn.execute("UPDATE items SET name = 'changed' WHERE id = %s", (n + 1,))
        assert run_cli(capsys, "catchup")[0] == 0
    code, _, err = run_cli(capsys, "cutover")
    assert code == 0, err
    assert run_job("slot_health").success

    instance = dagster_instance()
    origin = InProcessCodeLocationOrigin(
        LoadableTargetOrigin(module_name="pgcdc_dagster.definitions", attribute="defs"),
        location_name=LOCATION_NAME,
    )
    with WorkspaceProcessContext(instance, InProcessWorkspaceLoadTarget(origin)) as context:
        nodes = {tuple(n["assetKey"]["path"]): n for n in graphql(context, ASSETS)["assetNodes"]}

        # Every check shows its latest result as current, and passed on an equal target.
        states = {
            (key, check["name"]): (check["executionForLatestMaterialization"] or {}).get("status")
            for key, node in nodes.items()
            for check in node["assetChecksOrError"]["checks"]
        }
        target = ("target", "public", "items")
        for key, name in [
            (target, "no_gap"),
            (target, "target_matches_source"),
            (("replication_slot",), "slot_health"),
            (("replication_slot",), "replicated_tables"),
            (("replication_slot",), "store_retention"),
            (("replication_slot",), "slot_survives_failover"),
            (("cutover",), "data_consistency"),
        ]:
            assert states.pop((key, name)) == "SUCCEEDED", (key, name)
        assert states == {}  # no check left out of the list above
        checks = nodes[target]["assetChecksOrError"]["checks"]
        consistency = next(c for c in checks if c["name"] == "target_matches_source")
        assert consistency["canExecuteIndividually"] == "CAN_EXECUTE"

        # The source's and the target's table are two storages, not one "linked asset".
        def table_name(key: tuple[str, ...]) -> str:
            entries = nodes[key]["metadataEntries"]
            return next(e["text"] for e in entries if e["label"] == "dagster/table_name")

        source_name, target_name = table_name(("source", "public", "items")), table_name(target)
        assert source_name != target_name
        assert source_name.endswith(".public.items") and target_name.endswith(".public.items")

        # The commands' runs are listed under their jobs, and drawn in the Overview timeline.
        for job in ("snapshot", "follow", "cutover_job", "slot_health"):
            selector = {
                "pipelineName": job,
                "repositoryName": REPOSITORY_NAME,
                "repositoryLocationName": LOCATION_NAME,
            }
            listed = graphql(context, JOB_RUNS, {"selector": selector})["pipelineOrError"]
            assert listed["__typename"] == "Pipeline", listed
            assert listed["runs"] and all(r["status"] == "SUCCESS" for r in listed["runs"]), job
        runs = graphql(context, RUNS)["runsOrError"]["results"]
        assert runs and all(
            r["repositoryOrigin"]
            == {"repositoryLocationName": LOCATION_NAME, "repositoryName": REPOSITORY_NAME}
            for r in runs
        ), [r["pipelineName"] for r in runs if not r["repositoryOrigin"]]
        # Each says who launched it (the Runs list's "Launched by"), not "Manually launched".
        launched_by = [{t["key"]: t["value"] for t in r["tags"]}.get("dagster/user") for r in runs]
        assert set(launched_by) == {launched_by_here()}, launched_by

    # Partition keys are the X/Y form every other screen shows (a search for an LSN finds
    # them), listed in LSN order, each range starting where the one before ended.
    keys = instance.get_dynamic_partitions(LSN_RANGES)
    ranges = [LsnRange.from_partition_key(k) for k in keys]
    assert keys == [f"{r.start}-{r.end}" for r in ranges]
    assert len(ranges) >= 3 and all(a.end == b.start for a, b in itertools.pairwise(ranges))


def test_an_idle_follow_records_no_partition_and_says_it_is_alive(cli_env, capsys, monkeypatch):
    """A follow with nothing to apply yields an ``Idle`` every ``idle_s`` (the engine). Its
    run records a range that holds no transaction as no partition (the partitions are the
    ranges with changes), and says it is alive, with its lag and where the target stands,
    as an observation of ``decoded_changes`` at most every ``HEARTBEAT_S``."""
    import threading

    from dagster import AssetKey

    from pgcdc_dagster.defs import following
    from pgcdc_dagster.defs import instance as instance_module
    from pgcdc_dagster.defs.instance import dagster_instance
    from pgcdc_dagster.defs.partitions import LSN_RANGES
    from pgcdc_dagster.engine.follow.backlog import Backlog
    from pgcdc_dagster.engine.follow.follower import END, Idle, done_ranges
    from pgcdc_dagster.runner import run_job

    done = Backlog()
    threading.Timer(1.0, done.put, (END,)).start()
    beats = list(done_ranges(done, (KeyboardInterrupt,), lambda reason: None, idle_s=0.3))
    assert 2 <= len(beats) <= 4 and all(isinstance(b, Idle) and b.seconds >= 0.3 for b in beats)

    monkeypatch.setattr(instance_module, "_instance", None)
    monkeypatch.setattr(following, "HEARTBEAT_S", 0.0)
    assert run_cli(capsys, "snapshot")[0] == 0
    with psycopg.connect(cli_env["PGCDC_SOURCE_DSN"], autocommit=True) as conn:
        # WAL that publishes nothing: pgoutput sends no logical message unless asked to.
        conn.execute("SELECT pg_logical_emit_message(true, 'pgcdc-test', repeat('x', 1000))")
    config = {"ops": {"follow_stream": {"config": {"endpos": "current"}}}}
    result = run_job("follow", run_config=config)
    assert result.success
    instance = dagster_instance()
    assert instance.get_dynamic_partitions(LSN_RANGES) == []
    records = instance.fetch_observations(AssetKey("decoded_changes"), 1000).records
    beats = [
        r.asset_observation
        for r in records
        if r.event_log_entry.run_id == result.run_id
        and "heartbeat" in (r.asset_observation.description or "")
    ]
    assert beats, "no heartbeat recorded"
    meta = {k: v.value for k, v in beats[0].metadata.items()}
    assert int(meta["source_lag_bytes"]) >= 0 and "/" in meta["replay_lsn"]
    assert "/" in meta["slot_confirmed_lsn"] and meta["idle_s"] >= 0.0
