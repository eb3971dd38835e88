"""The object store's few calls, each failure named in one line: a thin layer over boto3.

Why boto3 and not a file-system layer: the store's commit protocol needs conditional writes
(a manifest created only if absent, ``If-None-Match: *``; the chain record replaced only if
unchanged, ``If-Match`` on its ETag). pyarrow's file systems have none; fsspec's s3fs passes
``IfMatch`` through undocumented, with an error that cannot be told from others. boto3 has
both since 1.35.69. The driver reads a range's Parquet whole, in one request
(:meth:`~.object_store.ObjectOutputStore.open_part`); Spark's executors read it with pyarrow's
own S3 file system (:func:`reader_filesystem`): they need pyarrow only.

Credentials and endpoint come from AWS's standard chain (``AWS_ACCESS_KEY_ID``...,
``AWS_PROFILE``, an instance role; ``AWS_ENDPOINT_URL`` for MinIO and other S3-compatible
servers), which boto3 and pyarrow both read; no message here carries a secret.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..store_location import StoreLocation
from .errors import StoreError

DELETE_BATCH = 1000
"""Keys one ``DeleteObjects`` call takes (S3's limit)."""


class ObjectChangedError(StoreError):
    """A conditional write lost: the object changed since it was read (another writer)."""


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: float
    """Seconds since the epoch."""


def endpoint() -> str | None:
    """The S3 endpoint AWS's chain names (``AWS_ENDPOINT_URL_S3``, else ``AWS_ENDPOINT_URL``);
    ``None``: AWS's own."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


class S3Objects:
    """The calls the store makes on its bucket (``location``: an ``s3://`` store)."""

    def __init__(self, location: StoreLocation) -> None:
        self.location = location
        self.bucket = location.bucket
        self.client = _client()

    # -- reads --------------------------------------------------------------------------------

    def get(self, key: str) -> tuple[bytes, str] | None:
        """The object's bytes and ETag; ``None`` when there is none."""
        with self._named(key, missing_ok=True) as missing:
            answer = self.client.get_object(Bucket=self.bucket, Key=key)
            return answer["Body"].read(), str(answer["ETag"])
        assert missing
        return None

    def head(self, key: str) -> ObjectInfo | None:
        with self._named(key, missing_ok=True) as missing:
            answer = self.client.head_object(Bucket=self.bucket, Key=key)
            return ObjectInfo(key, int(answer["ContentLength"]), answer["LastModified"].timestamp())
        assert missing
        return None

    def objects(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under ``prefix``, in key order."""
        pages = self.client.get_paginator("list_objects_v2")
        with self._named(prefix):
            for page in pages.paginate(Bucket=self.bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    yield ObjectInfo(
                        item["Key"], int(item["Size"]), item["LastModified"].timestamp()
                    )

    def folders(self, prefix: str) -> list[str]:
        """The names of the "folders" directly under ``prefix`` (common prefixes of ``/``),
        sorted."""
        pages = self.client.get_paginator("list_objects_v2")
        names = []
        with self._named(prefix):
            for page in pages.paginate(Bucket=self.bucket, Prefix=prefix, Delimiter="/"):
                for common in page.get("CommonPrefixes", []):
                    names.append(common["Prefix"][len(prefix) :].rstrip("/"))
        return sorted(names)

    # -- writes -------------------------------------------------------------------------------

    def put(self, key: str, data: bytes) -> str:
        with self._named(key):
            return str(self.client.put_object(Bucket=self.bucket, Key=key, Body=data)["ETag"])
        raise AssertionError("unreachable")

    def put_new(self, key: str, data: bytes) -> bool:
        """Create ``key`` only if no object has it (``If-None-Match: *``); whether it did."""
        try:
            with self._named(key):
                self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
                return True
        except ObjectChangedError:
            return False
        raise AssertionError("unreachable")

    def put_if(self, key: str, data: bytes, etag: str | None) -> str:
        """Replace ``key`` only if it still has ``etag`` (``None``: only if it does not exist);
        its new ETag. :class:`ObjectChangedError` if another writer changed it first."""
        condition = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
        with self._named(key):
            answer = self.client.put_object(Bucket=self.bucket, Key=key, Body=data, **condition)
            return str(answer["ETag"])
        raise AssertionError("unreachable")

    def upload(self, path: Path, key: str) -> None:
        """Upload a local file (in parts when big, several at once)."""
        with self._named(key):
            self.client.upload_file(str(path), self.bucket, key)

    def delete(self, keys: Iterable[str]) -> None:
        batch: list[str] = []
        for key in keys:
            batch.append(key)
            if len(batch) == DELETE_BATCH:
                self._delete(batch)
                batch = []
        if batch:
            self._delete(batch)

    def _delete(self, keys: list[str]) -> None:
        with self._named(keys[0]):
            self.client.delete_objects(
                Bucket=self.bucket,
                Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True},
            )

    # -- pyarrow --------------------------------------------------------------------------------

    def check(self) -> None:
        """Reach the bucket and list it once: a missing bucket, refused credentials or an
        endpoint that does not answer fail here, in one line, before anything is written."""
        with self._named(self.location.prefix):
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.location.prefix, MaxKeys=1)

    # -- errors ---------------------------------------------------------------------------------

    def _named(self, key: str, *, missing_ok: bool = False) -> _Named:
        return _Named(self, key, missing_ok)


class _Named:
    """Turns boto3's exceptions into one line naming the problem and the fix (a context
    manager; with ``missing_ok``, a missing object is swallowed and the ``as`` target says
    so)."""

    def __init__(self, objects: S3Objects, key: str, missing_ok: bool) -> None:
        self.objects, self.key, self.missing_ok = objects, key, missing_ok

    def __enter__(self) -> bool:
        return True

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None:
            return False
        from botocore import exceptions as boto

        where = f"the output store {self.objects.location.url}"
        bucket = self.objects.bucket
        if isinstance(exc, boto.NoCredentialsError):
            raise StoreError(
                f"no credentials for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE), or run where an instance role applies"
            ) from None
        if isinstance(exc, boto.EndpointConnectionError | boto.ConnectTimeoutError):
            raise StoreError(
                f"cannot reach the object store of {where} at "
                f"{endpoint() or 'AWS'}: check AWS_ENDPOINT_URL and the network; nothing was "
                "stored, and the next command goes on from where this one stopped"
            ) from None
        if not isinstance(exc, boto.ClientError):
            return False
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
            raise ObjectChangedError(
                f"{self.key} in {where} was changed by another writer meanwhile: run the "
                "command again (one pgcdc command at a time writes a store)"
            ) from None
        if code in ("NoSuchKey", "404", "NotFound") and self.missing_ok:
            return True
        if code == "NoSuchBucket":
            raise StoreError(
                f"the bucket {bucket} of {where} does not exist: create it, or fix PGCDC_STORE"
            ) from None
        if code in (
            "InvalidAccessKeyId",
            "SignatureDoesNotMatch",
            "AccessDenied",
            "InvalidToken",
            "ExpiredToken",
            "403",
        ):
            raise StoreError(
                f"{where} refused the credentials ({code}): check AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY (or the role), and their rights on bucket {bucket}"
            ) from None
        raise StoreError(f"{where} failed on {self.key}: {code or status} ({exc})") from None


_CLIENTS: dict[tuple[str, ...], Any] = {}
_CLIENTS_GUARD = threading.Lock()

_CHAIN_VARIABLES = (
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
)


def _client() -> Any:
    """One S3 client per process and AWS setting (a client is thread-safe and costs tens of
    milliseconds to make; a store is opened many times per command). Made from a session of its
    own, so a changed ``AWS_*`` variable gets a client that reads it (boto3's default session
    keeps the credentials it first found). The key holds a digest of the variables, never
    their values."""
    import boto3
    from botocore.config import Config

    values = "\0".join(os.environ.get(name, "") for name in _CHAIN_VARIABLES)
    key = (hashlib.sha256(values.encode()).hexdigest(),)
    with _CLIENTS_GUARD:
        client = _CLIENTS.get(key)
        if client is None:
            client = boto3.session.Session().client(
                "s3",
                config=Config(
                    connect_timeout=5,
                    read_timeout=60,
                    retries={"max_attempts": 4, "mode": "standard"},
                ),
            )
            _CLIENTS[key] = client
    return client


def reader_options() -> dict[str, str]:
    """What pyarrow's S3 file system needs beyond AWS's chain, to be shipped to Spark's
    executors (whose Python may not see the driver's variables): the endpoint and region,
    never a credential."""
    options = {}
    if endpoint():
        options["endpoint_override"] = str(endpoint())
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        options["region"] = region
    return options


def reader_filesystem(options: dict[str, str]) -> Any:
    """pyarrow's S3 file system with ``options`` (:func:`reader_options`)."""
    from pyarrow import fs

    return fs.S3FileSystem(**options)
