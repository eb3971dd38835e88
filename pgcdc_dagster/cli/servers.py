"""The warm processes (``pgcdc spark``, ``pgcdc server``) and ``pgcdc demo``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..engine.settings import ReplicationSettings
from .output import CliError


def cmd_spark(args: argparse.Namespace) -> int:
    """Start, stop or show the warm Spark Connect server recorded in the store (see
    :mod:`pgcdc_dagster.engine.spark.server`)."""
    from ..engine.spark import server as spark_server

    store = ReplicationSettings.from_env(require_servers=False).store_path  # only the store
    if args.action == "start":
        store.mkdir(parents=True, exist_ok=True)
        server, started = spark_server.start(store, args.master)
        state = "started" if started else "already running"
        print(f"Spark Connect server {state} at {server.url} (pid {server.pid})")
    elif args.action == "stop":
        stopped = spark_server.stop(store)
        print(f"stopped {stopped.url}" if stopped else "no Spark Connect server was running")
    else:
        found = spark_server.running(store)
        print(f"running at {found.url} (pid {found.pid})" if found else "not running")
    return 0


def cmd_server(args: argparse.Namespace) -> int:
    """Start, stop or show the warm command server (see :mod:`pgcdc_dagster.launcher`)."""
    from .. import server_client

    try:
        if args.action == "start":
            if server_client.server_mode() == "off":
                raise CliError("PGCDC_SERVER=off: commands would not use the server; unset it")
            status = server_client.start_server(wait_s=60.0)
            assert status is not None  # with a wait: the status, or ServerUnavailable
            print(_server_line(status))
        elif args.action == "stop":
            reply = server_client.ask("stop")
            running = reply["commands_running"]
            print(
                f"stopped the command server (pid {reply['pid']})"
                + (f"; {running} command(s) under way finish first" if running else "")
            )
        elif args.json:
            print(json.dumps(server_client.ask("status")))
        else:
            print(_server_line(server_client.ask("status")))
    except server_client.ServerUnavailable as exc:
        if args.action == "start":
            raise CliError(str(exc)) from None
        print("no command server is running")
    return 0


def _server_line(status: dict[str, Any]) -> str:
    return (
        f"command server running (pid {status['pid']}): {status['commands_served']} command(s) "
        f"served, {status['commands_running']} running, stops after {status['idle_s']:.0f} s idle"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo.run import run_demo

    return run_demo(ui=args.ui, seconds=args.seconds, tps=args.tps)
