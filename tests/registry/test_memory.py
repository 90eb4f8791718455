"""Memory stays flat in the blob size: a 210 MiB blob up and down through the real server."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from .conftest import Key, leftovers, registry_cli, running_server

MIB = 1 << 20
SIZE = 210 * MIB
#: The limit the acceptance criteria set: resident memory within 50 MB of idle.
LIMIT = 50 * 1000 * 1000


def _chunks() -> Iterator[bytes]:
    # Deterministic and never held whole: one 1 MiB block, stamped with its index.
    block = hashlib.sha256(b"seed").digest() * (MIB // 32)
    for i in range(SIZE // MIB):
        yield i.to_bytes(8, "little") + block[8:]


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Sampler:
    """Samples a process's RSS every 20 ms in a thread while the block runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss(self.pid))
            time.sleep(0.02)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_a_200_mb_blob_keeps_server_memory_flat(tmp_path: Path, keys: dict[str, Key]) -> None:
    digest = hashlib.sha256()
    for chunk in _chunks():
        digest.update(chunk)
    ref = "sha256:" + digest.hexdigest()
    data = tmp_path / "data"
    started = time.monotonic()
    with running_server(data) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        r = registry_cli("--json", "token", "create", "--data", data, "--publisher", "alice", "--key", keys["alice"].pub_path)
        assert r.returncode == 0, r.stderr
        token = json.loads(r.stdout)["token"]
        auth = {"Authorization": f"Bearer {token}"}
        # Warm every code path on a small blob first, so idle means "ready", not "not yet imported".
        small = b"warm-up" * 1000
        small_ref = "sha256:" + hashlib.sha256(small).hexdigest()
        assert client.put(f"/v1/blobs/{small_ref}", content=small, headers=auth).status_code == 201
        assert client.get(f"/v1/blobs/{small_ref}").content == small
        time.sleep(0.5)
        idle = _rss(server.pid)

        with Sampler(server.pid) as up:
            r = client.put(f"/v1/blobs/{ref}", content=_chunks(), headers={**auth, "Content-Length": str(SIZE)})
        assert r.status_code == 201, r.text
        assert leftovers(data) == []

        got = hashlib.sha256()
        received = 0
        with Sampler(server.pid) as down, client.stream("GET", f"/v1/blobs/{ref}") as response:
            assert response.status_code == 200
            assert response.headers["content-length"] == str(SIZE)
            for chunk in response.iter_bytes(MIB):
                got.update(chunk)
                received += len(chunk)
        assert received == SIZE and "sha256:" + got.hexdigest() == ref

        tail = client.get(f"/v1/blobs/{ref}", headers={"Range": f"bytes={SIZE - 100}-"})
        assert tail.status_code == 206 and len(tail.content) == 100

    elapsed = time.monotonic() - started
    report = (
        f"idle {idle / MIB:.1f} MiB, peak while uploading {up.peak / MIB:.1f} MiB (+{(up.peak - idle) / MIB:.1f}), "
        f"peak while downloading {down.peak / MIB:.1f} MiB (+{(down.peak - idle) / MIB:.1f}), {elapsed:.1f} s"
    )
    print(report)  # noqa: T201 - the figures are the test's report (pytest -s shows them)
    assert down.peak - idle < LIMIT, report
    assert up.peak - idle < LIMIT, report
