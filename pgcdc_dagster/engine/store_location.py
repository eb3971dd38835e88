"""Where the output store lives: ``PGCDC_STORE`` read as a local path or a URL.

A local path or a ``file://`` URL is a folder of this machine (or one every process mounts at
the same path). ``s3://bucket/prefix`` is an S3 bucket (AWS, or any S3-compatible server
through ``AWS_ENDPOINT_URL``: MinIO, Ceph, ...), see :mod:`.store.object_store`. The other object
stores' schemes (``gs://``, ``abfs://``, ...) are refused in one line, never taken for a local
folder (``Path("s3://b")`` would be the folder ``s3:/b`` under the working directory).

A URL carries no secret: credentials come from the cloud's own chain (``AWS_*`` variables, the
shared config files, an instance role), and a URL holding a user or password is refused.
"""

from __future__ import annotations

import hashlib
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

OBJECT_SCHEMES = ("s3",)
"""The object stores the store can live on."""

WORK_FOLDER = Path(".pgcdc/work")
"""Under the working directory, the local folder of an object store's scratch (a range being
written, transactions spooled ahead of their COMMIT, the warm Spark server's record): one
subfolder per store URL."""


class StoreLocationError(ValueError):
    """``PGCDC_STORE`` names no place the store can live."""


@dataclass(frozen=True)
class StoreLocation:
    """A parsed ``PGCDC_STORE``: a local folder (``path``), or an object store's bucket and
    key prefix (``scheme`` ``s3``)."""

    scheme: str
    path: Path | None = None
    bucket: str = ""
    prefix: str = ""
    """Keys under the bucket start with it; empty or ending with ``/``."""

    @property
    def is_local(self) -> bool:
        return self.scheme == "file"

    @property
    def url(self) -> str:
        """The store's URL, for people and for the UI (it holds no secret)."""
        if self.path is not None:
            return self.path.as_uri()
        return f"{self.scheme}://{self.bucket}/{self.prefix}"

    def key(self, *parts: str) -> str:
        """The object key of ``parts`` under the store's prefix."""
        return self.prefix + "/".join(parts)

    def object_url(self, key: str) -> str:
        return f"{self.scheme}://{self.bucket}/{key}"

    @property
    def work_folder(self) -> Path:
        """The local folder this process keeps the store's scratch in: the store itself when
        it is local, else a folder of its own under :data:`WORK_FOLDER`."""
        if self.path is not None:
            return self.path
        digest = hashlib.sha256(self.url.encode()).hexdigest()[:12]
        return (WORK_FOLDER / f"{self.bucket}-{digest}").resolve()


def parse_location(value: str) -> StoreLocation:
    """``PGCDC_STORE`` as a :class:`StoreLocation`; :class:`StoreLocationError` naming the fix
    for a URL that names no usable store."""
    found = _URL.match(value)
    if found is None:
        return StoreLocation("file", path=Path(value).resolve())
    scheme = found.group(1).lower()
    parts = urllib.parse.urlparse(value)
    if scheme == "file":
        if not parts.path:
            raise StoreLocationError(f"{value} names no path: write file:///absolute/path")
        return StoreLocation("file", path=Path(urllib.parse.unquote(parts.path)).resolve())
    if scheme not in OBJECT_SCHEMES:
        raise StoreLocationError(
            f"a {scheme}:// output store is not supported yet: use s3://bucket/prefix (AWS or "
            "any S3-compatible server, through AWS_ENDPOINT_URL), a local path, or a folder "
            "every process mounts (file://)"
        )
    if parts.username or parts.password or "@" in parts.netloc:
        raise StoreLocationError(
            f"PGCDC_STORE holds credentials in its URL ({scheme}://...@...): take them out; "
            "they come from the AWS_* variables or the cloud's own configuration"
        )
    bucket = parts.netloc
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", bucket):
        raise StoreLocationError(
            f"{scheme}://{bucket}/ names no valid bucket (3 to 63 lower-case letters, digits, "
            "dots and hyphens): write s3://bucket/prefix"
        )
    prefix = parts.path.strip("/")
    return StoreLocation(scheme, bucket=bucket, prefix=f"{prefix}/" if prefix else "")
