"""A real S3 API server for tests: ``moto_server`` (from pip), serving S3 over HTTP in memory on
a loopback port, reached the way a user reaches MinIO or any S3-compatible server: through
``AWS_ENDPOINT_URL`` and the ``AWS_*`` credentials.

The server checks credentials as S3 does (``INITIAL_NO_AUTH_ACTION_COUNT``: after the three
IAM calls that make a user, its access key and its policy, every request must be signed by
that key), so wrong credentials are refused for real (``SignatureDoesNotMatch``).

What must hold: ``moto[server]`` is installed (the dev extra); moto enforces ``If-None-Match``
and ``If-Match`` on PutObject (5.2.5 and later), which the store's commit relies on.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REGION = "us-east-1"


@dataclass
class S3Server:
    """A running ``moto_server`` and the environment that reaches it."""

    endpoint: str
    process: subprocess.Popen[bytes]
    key_id: str = ""
    secret: str = ""

    @property
    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret,
            "AWS_DEFAULT_REGION": REGION,
        }

    def client(self, service: str = "s3"):  # type: ignore[no-untyped-def]
        import boto3

        return boto3.client(
            service,
            endpoint_url=self.endpoint,
            aws_access_key_id=self.key_id or "setup",
            aws_secret_access_key=self.secret or "setup",
            region_name=REGION,
        )

    def _make_user(self) -> None:
        """The three unsigned calls the server allows: a user, its key, a policy."""
        iam = self.client("iam")
        iam.create_user(UserName="pgcdc")
        key = iam.create_access_key(UserName="pgcdc")["AccessKey"]
        everything = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
        }
        iam.put_user_policy(
            UserName="pgcdc", PolicyName="all", PolicyDocument=json.dumps(everything)
        )
        self.key_id, self.secret = key["AccessKeyId"], key["SecretAccessKey"]

    def new_bucket(self) -> str:
        """A bucket of its own for one test (S3 names: lower case, 3+ characters)."""
        name = f"pgcdc-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2")
        return [
            item["Key"]
            for page in pages.paginate(Bucket=bucket, Prefix=prefix)
            for item in page.get("Contents", [])
        ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def s3_server(command: Callable[[int], list[str]] | None = None) -> Iterator[S3Server]:
    """``moto_server`` on a free loopback port, stopped at exit. ``command``: the server's
    command line for a port instead (moto's application served another way: with each
    request counted, ``benchmarks/object_store.py``)."""
    binary = shutil.which("moto_server", path=str(Path(sys.executable).parent))
    if binary is None:
        raise RuntimeError("moto_server is not installed: pip install 'moto[server]'")
    port = _free_port()
    process = subprocess.Popen(
        command(port) if command else [binary, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3"},
    )
    server = S3Server(f"http://127.0.0.1:{port}", process)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on port {port}") from None
                time.sleep(0.05)
        server._make_user()
        yield server
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextlib.contextmanager
def s3_server_reached() -> Iterator[S3Server]:
    """:func:`s3_server`, with this process's ``AWS_*`` variables reaching it meanwhile (as a
    command's do), restored at exit."""
    with s3_server() as server:
        saved = {k: os.environ.get(k) for k in server.env}
        os.environ.update(server.env)
        try:
            yield server
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
