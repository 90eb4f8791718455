"""The registry client against a lying registry (issue 14, findings 4, 7 and 10's client part).

A hostile registry is played by a small HTTP server of this module on 127.0.0.1 (a thread,
answers written byte for byte): endless and deep JSON, endless and oversized blobs, a drip of
one byte at a time, listings whose cursor never ends, and checkpoints signed with a real
registry's key for another tree. The honest registry is the real ``kvgraft serve``. Every case
ends in one ``RegistryClientError`` (one line and exit 1 on the command line), quickly, in
bounded memory, with nothing written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.parse
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgraft.cli import main as client_main
from kvgraft.registry.client import (
    NO_MEMORY,
    BlobDigestError,
    CheckpointMemory,
    ClientLimits,
    DiskFullError,
    ListingError,
    LogForkError,
    RegistryClient,
    RegistryResponseError,
    RegistryUnavailableError,
    ResponseTooLargeError,
    publish,
    registry_key,
)
from kvgraft.verifier import (
    Checkpoint,
    MerkleTree,
    SigningKey,
    ephemeral_signing_key,
    format_vkey,
    generate_private_key,
    keyid_of,
    load_private_key,
    merkle_root,
    public_key_pem,
    sign_checkpoint,
)
from tests.registry.conftest import REPO, Key, artifact, running_server
from tests.reliability.mounts import cannot_mount
from tests.reliability.servers import make_token

# --- a hostile registry ------------------------------------------------------------------------

Route = Callable[["_Handler", dict[str, str]], None]


class _Handler(BaseHTTPRequestHandler):
    server: _Hostile

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        return None

    def _dispatch(self) -> None:
        parts = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(parts.query))
        self.server.requests.append(f"{self.command} {parts.path}")
        for prefix, route in self.server.routes.items():
            if parts.path == prefix or (prefix.endswith("/") and parts.path.startswith(prefix)):
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    route(self, query)
                self.close_connection = True
                return
        self.send_raw(404, b'{"title": "Not Found", "detail": "no such thing"}', "application/problem+json")

    do_GET = do_HEAD = do_POST = do_PUT = _dispatch

    def send_raw(
        self, status: int, body: bytes, content_type: str = "application/json", *, length: int | None = None
    ) -> None:
        """One whole answer, Content-Length ``length`` (default: the body's)."""
        head = (
            f"HTTP/1.1 {status} X\r\nContent-Type: {content_type}\r\nConnection: close\r\n"
            f"Content-Length: {len(body) if length is None else length}\r\n\r\n"
        )
        self.wfile.write(head.encode() + (b"" if self.command == "HEAD" else body))
        self.wfile.flush()

    def send_endless(
        self,
        first: bytes,
        repeat: bytes,
        content_type: str = "application/json",
        *,
        length: int | None = None,
        pause: float = 0.0,
        limit_s: float = 30.0,
    ) -> None:
        """Headers, ``first``, then ``repeat`` until the client hangs up (or ``limit_s``)."""
        head = f"HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nConnection: close\r\n"
        head += f"Content-Length: {length}\r\n" if length is not None else ""
        self.wfile.write(head.encode() + b"\r\n" + first)
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            self.wfile.write(repeat)
            self.wfile.flush()
            self.server.sent += len(repeat)
            if pause:
                time.sleep(pause)


class _Hostile(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.routes: dict[str, Route] = {}
        self.requests: list[str] = []
        self.sent = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture
def hostile() -> Iterator[_Hostile]:
    server = _Hostile()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class FakeLog:
    """A log served by the hostile registry: its own leaves, signed with ``key`` under ``origin``
    (a fresh key, or a real registry's own, to fork it), with honest proofs of its own tree."""

    def __init__(self, key: SigningKey, origin: str, leaves: list[bytes], size: int | None = None) -> None:
        self.key, self.origin, self.leaves = key, origin, leaves
        self.size = len(leaves) if size is None else size

    def note(self, size: int) -> bytes:
        return sign_checkpoint(
            Checkpoint(origin=self.origin, size=size, root_hash=merkle_root(self.leaves[:size])), self.origin, self.key
        )

    def install(self, server: _Hostile) -> None:
        def key_doc(h: _Handler, q: dict[str, str]) -> None:
            # A whole LogKey document: the client reads every answer with the shared wire models.
            public = self.key.public_key
            doc = {"origin": self.origin, "public_key_pem": public_key_pem(public).decode(), "keyid": str(keyid_of(public)),
                   "vkey": format_vkey(self.origin, public), "tree_size": self.size}
            h.send_raw(200, json.dumps(doc).encode())

        def checkpoint(h: _Handler, q: dict[str, str]) -> None:
            h.send_raw(200, self.note(int(q.get("tree_size", self.size))), "text/plain; charset=utf-8")

        def consistency(h: _Handler, q: dict[str, str]) -> None:
            old, new = int(q["old"]), int(q.get("new", self.size))
            if new > self.size or old > new:
                h.send_raw(
                    400, b'{"title": "Bad Request", "detail": "tree size beyond the log"}', "application/problem+json"
                )
                return
            hashes = [p.hex() for p in MerkleTree(self.leaves[:new]).consistency_proof(old)]
            h.send_raw(200, json.dumps({"old_size": old, "new_size": new, "hashes": hashes}).encode())

        server.routes.update(
            {"/v1/log/key": key_doc, "/v1/log/checkpoint": checkpoint, "/v1/log/proof/consistency": consistency}
        )


def _fresh_log(size: int, seed: str = "fake") -> FakeLog:
    leaves = [hashlib.sha256(f"{seed}-{i}".encode()).digest() for i in range(size)]
    return FakeLog(SigningKey(generate_private_key()), f"hostile.example/{seed}", leaves)


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Remembered checkpoints (and the rest of $KVGRAFT_HOME) stay in the test's directory."""
    monkeypatch.setenv("KVGRAFT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, dict[str, Any], str]:
    code = client_main(["--json", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def _one_line_failure(code: int, out: dict[str, Any], err: str, *needles: str) -> None:
    assert code == 1 and out["ok"] is False, out
    assert err.count("\n") == 1 and err.startswith("kvgraft: ") and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err


DIGEST = "sha256:" + "ab" * 32


# --- finding 7: sizes ----------------------------------------------------------------------------


def test_endless_json_answer_is_refused_at_max_json_bytes_in_bounded_memory(
    hostile: _Hostile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hostile.routes["/v1/log/key"] = lambda h, q: h.send_endless(b'{"origin": "', b"x" * 65536)
    tracemalloc.start()
    try:
        with RegistryClient(hostile.url, limits=ClientLimits(max_json_bytes=4 << 20), memory=NO_MEMORY) as client:
            with pytest.raises(ResponseTooLargeError, match=r"sent more than 4194304 bytes for a JSON answer"):
                registry_key(client, None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 24 << 20, peak
    # The command line: the default limit (64 MiB), one line, exit 1, nothing written.
    code, out, err = _cli(capsys, "pull", "--registry", hostile.url, DIGEST, "--out", tmp_path / "out")
    _one_line_failure(code, out, err, "ResponseTooLargeError", "more than 67108864 bytes")
    assert not (tmp_path / "out").exists()


def test_json_answer_announcing_more_than_the_limit_is_refused_unread(hostile: _Hostile) -> None:
    hostile.routes["/v1/log/key"] = lambda h, q: h.send_raw(200, b"{}", length=1 << 40)
    with (
        RegistryClient(hostile.url, memory=NO_MEMORY) as client,
        pytest.raises(ResponseTooLargeError, match="announced 1099511627776 bytes"),
    ):
        registry_key(client, None)


def test_answer_of_the_wrong_shape_is_one_malformed_answer_line(
    hostile: _Hostile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The wire models are strict: a string for an integer, a boolean for an index, or a missing
    # member is the registry's fault, said in one line naming the field, never a coercion.
    log = _fresh_log(3)
    log.install(hostile)
    key_doc = {"origin": log.origin, "public_key_pem": public_key_pem(log.key.public_key).decode(),
               "keyid": "k", "vkey": "v", "tree_size": "3"}
    hostile.routes["/v1/log/key"] = lambda h, q: h.send_raw(200, json.dumps(key_doc).encode())
    code, out, err = _cli(capsys, "pull", "--registry", hostile.url, DIGEST, "--out", tmp_path / "out")
    _one_line_failure(code, out, err, "RegistryResponseError", "sent a malformed answer", "tree_size")
    hostile.routes["/v1/entries"] = lambda h, q: h.send_raw(
        200, json.dumps({"items": [{"log_index": True}], "next_cursor": None}).encode()
    )
    with (
        RegistryClient(hostile.url, memory=NO_MEMORY) as client,
        pytest.raises(RegistryResponseError, match=r"the page does not have the registry's shape: items\.0\.log_index"),
    ):
        list(client.iter_entries())
    assert not (tmp_path / "out").exists()


def test_pull_of_200000_deep_json_ends_in_one_line(
    hostile: _Hostile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    hostile.routes["/v1/log/key"] = lambda h, q: h.send_raw(200, deep)
    code, out, err = _cli(capsys, "pull", "--registry", hostile.url, DIGEST, "--out", tmp_path / "out")
    _one_line_failure(code, out, err, "ResponseTooLargeError", "nested too deeply")
    # Deep but within what Python parses: refused by the depth limit.
    hostile.routes["/v1/log/key"] = lambda h, q: h.send_raw(200, b'{"a": ' + b"[" * 500 + b"]" * 500 + b"}")
    with (
        RegistryClient(hostile.url, memory=NO_MEMORY) as client,
        pytest.raises(ResponseTooLargeError, match="more than 64 levels deep"),
    ):
        registry_key(client, None)
    assert not (tmp_path / "out").exists()


def test_endless_blob_stops_at_its_content_length_and_nothing_is_kept(hostile: _Hostile, tmp_path: Path) -> None:
    url = f"/v1/blobs/{DIGEST}"
    # Content-Length 1 MiB, then bytes without end: exactly 1 MiB is read, then refused by its hash.
    hostile.routes[url] = lambda h, q: h.send_endless(b"", b"\0" * 65536, "application/octet-stream", length=1 << 20)
    dest = tmp_path / "blob"
    started = time.monotonic()
    with RegistryClient(hostile.url, memory=NO_MEMORY) as client:
        with pytest.raises(BlobDigestError, match=r"served 1048576 bytes for blob"):
            client.download_blob(DIGEST, dest)
        assert not dest.exists()
        # No Content-Length at all (a stream without end): refused before a byte is written.
        hostile.routes[url] = lambda h, q: h.send_endless(b"", b"\0" * 65536, "application/octet-stream")
        with pytest.raises(Exception, match="without a Content-Length") as info:
            client.download_blob(DIGEST, dest)
        assert type(info.value).__name__ == "RegistryResponseError"
        assert not dest.exists()
        # More than --max-blob-bytes announced: refused before a byte is read.
        hostile.routes[url] = lambda h, q: h.send_raw(200, b"", "application/octet-stream", length=1 << 50)
        with pytest.raises(ResponseTooLargeError, match="announced a blob of 1125899906842624 bytes"):
            client.download_blob(DIGEST, dest)
        assert not dest.exists()
    assert time.monotonic() - started < 20


def test_blob_larger_than_the_free_disk_is_refused_before_a_byte_is_written(hostile: _Hostile, tmp_path: Path) -> None:
    size = shutil.disk_usage(tmp_path).free + (1 << 40)
    hostile.routes[f"/v1/blobs/{DIGEST}"] = lambda h, q: h.send_raw(200, b"", "application/octet-stream", length=size)
    dest = tmp_path / "blob"
    with (
        RegistryClient(hostile.url, limits=ClientLimits(max_blob_bytes=1 << 62), memory=NO_MEMORY) as client,
        pytest.raises(DiskFullError, match=rf"needs {size} bytes in {tmp_path}, which has \d+ bytes free"),
    ):
        client.download_blob(DIGEST, dest)
    assert not dest.exists()


# --- finding 7: pace -----------------------------------------------------------------------------


def test_drip_feed_is_cut_at_the_total_deadline(
    hostile: _Hostile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One byte every 0.3 s: every read succeeds well within the timeout, so only a deadline for
    # the whole request can end it (before, `--timeout` bounded each read and this ran forever).
    hostile.routes["/v1/log/key"] = lambda h, q: h.send_endless(b'{"origin": "', b"x", pause=0.3)
    started = time.monotonic()
    with (
        RegistryClient(hostile.url, timeout=2.0, memory=NO_MEMORY) as client,
        pytest.raises(RegistryUnavailableError, match="did not complete within its deadline of 2 s"),
    ):
        registry_key(client, None)
    assert 1.5 < time.monotonic() - started < 4.0
    # The headers dripped, one byte at a time.
    status = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    hostile.routes["/v1/log/key"] = lambda h, q: h.send_endless(b"", status[:1], pause=0.3)
    started = time.monotonic()
    code, out, err = _cli(
        capsys, "pull", "--registry", hostile.url, "--timeout", "2", DIGEST, "--out", tmp_path / "out"
    )
    _one_line_failure(code, out, err, "RegistryUnavailableError", "did not complete within its deadline of 2 s")
    assert time.monotonic() - started < 4.0
    # A blob's deadline is the timeout plus its size at --min-rate: 2 s + 64 KiB at 64 KiB/s.
    hostile.routes[f"/v1/blobs/{DIGEST}"] = lambda h, q: h.send_endless(
        b"", b"\0", "application/octet-stream", length=65536, pause=0.3
    )
    started = time.monotonic()
    with (
        RegistryClient(hostile.url, limits=ClientLimits(timeout=2.0, min_rate=65536), memory=NO_MEMORY) as client,
        pytest.raises(RegistryUnavailableError, match="did not complete within its deadline of 3 s"),
    ):
        client.download_blob(DIGEST, tmp_path / "blob")
    assert 2.5 < time.monotonic() - started < 5.0
    assert not (tmp_path / "blob").exists()


# --- finding 7: listings -------------------------------------------------------------------------


def _endless_pages(kind: str) -> Route:
    counter = iter(range(10**9))

    def route(h: _Handler, q: dict[str, str]) -> None:
        n = next(counter)
        if kind == "same-cursor":
            page = {"items": [{"log_index": 0}], "next_cursor": "again"}
        elif kind == "same-index":
            page = {"items": [{"log_index": 0}], "next_cursor": f"c{n}"}
        else:  # fresh cursors and indexes for ever
            page = {"items": [{"log_index": n}], "next_cursor": f"c{n}"}
        h.send_raw(200, json.dumps(page).encode())

    return route


def test_listing_whose_cursor_never_ends_stops_with_an_error(hostile: _Hostile) -> None:
    with RegistryClient(hostile.url, memory=NO_MEMORY) as client:
        hostile.routes["/v1/entries"] = _endless_pages("same-cursor")
        with pytest.raises(ListingError, match="sent the cursor 'again' again on page 2"):
            list(client.iter_entries())
        hostile.routes["/v1/entries"] = _endless_pages("same-index")
        with pytest.raises(ListingError, match="listed log index 0 after 0 on page 2: a listing must advance"):
            list(client.iter_entries())
    hostile.routes["/v1/entries"] = _endless_pages("fresh")
    with RegistryClient(hostile.url, limits=ClientLimits(max_pages=50), memory=NO_MEMORY) as client:
        with pytest.raises(ListingError, match="still listing after 50 pages"):
            list(client.iter_entries())
        hostile.routes["/v1/entries"] = _endless_pages("fresh")
        assert [e["log_index"] for e in client.iter_entries(below=5)] == [0, 1, 2, 3, 4]
    hostile.routes["/v1/artifacts"] = _endless_pages("fresh")
    with (
        RegistryClient(hostile.url, limits=ClientLimits(max_items=20), memory=NO_MEMORY) as client,
        pytest.raises(ListingError, match="listed more than 20 items"),
    ):
        list(client.list_artifacts())


def test_report_on_a_listing_that_never_ends_stops_in_one_line(
    hostile: _Hostile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvgraft.cli import main as kvgraft_main

    _fresh_log(4).install(hostile)
    hostile.routes["/v1/entries"] = _endless_pages("same-cursor")
    code = kvgraft_main(["--json", "report", "--registry", hostile.url, "--out", str(tmp_path / "report")])
    out, err = capsys.readouterr()
    _one_line_failure(code, json.loads(out), err, "ListingError", "again")
    assert not (tmp_path / "report").exists() and not list(tmp_path.glob(".report*"))
    assert hostile.requests.count("GET /v1/entries") == 2


def test_mirror_on_a_listing_that_never_ends_stops_in_one_line(
    hostile: _Hostile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The source claims 5 entries; the target (a second hostile server, its own key) holds the
    # first 2 with the same roots, so the mirror lists the source and meets a cursor that repeats.
    source = _fresh_log(5)
    source.install(hostile)
    hostile.routes["/v1/entries"] = _endless_pages("same-cursor")
    target_server = _Hostile()
    thread = threading.Thread(target=target_server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        FakeLog(SigningKey(generate_private_key()), "hostile.example/target", source.leaves[:2]).install(target_server)
        code, out, err = _cli(capsys, "mirror", "--from", hostile.url, "--to", target_server.url, "--token", "t")
        _one_line_failure(code, out, err, "ListingError", "sent the cursor 'again' again")
        assert not [r for r in target_server.requests if not r.startswith("GET /v1/log/")]
    finally:
        target_server.shutdown()
        target_server.server_close()
        thread.join(timeout=10)


# --- finding 10 (client): full disk, memory --------------------------------------------------------


def _publish_artifact(
    tmp_path: Path, url: str, token: str, key: Key, text: str, size: int = 0, *, remember: bool = True
) -> tuple[str, Path]:
    """An artifact directory (tensors of ``size`` bytes when given), published; (digest, dir)."""
    from tests.registry.conftest import subject

    art = artifact(text)
    tensors = art.tensors if not size else (art.tensors * (size // len(art.tensors) + 1))[:size]
    statement = art.statement.model_copy(update={"subject": [subject("kv.safetensors", tensors)]})
    directory = tmp_path / f"art-{hashlib.sha256(text.encode()).hexdigest()[:8]}"
    directory.mkdir()
    (directory / "kv.safetensors").write_bytes(tensors)
    (directory / "statement.dsse.json").write_bytes(key.sign(statement))
    with RegistryClient(url, token=token, memory=None if remember else NO_MEMORY) as client:
        publish(client, directory)
    return "sha256:" + hashlib.sha256(tensors).hexdigest(), directory


def test_pull_onto_a_full_disk_ends_in_one_line_and_leaves_nothing(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    if shutil.which("unshare") is None:
        cannot_mount("unshare(1) is not installed")
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {tmp_path} && umount {tmp_path}"],
        capture_output=True,
        timeout=30,
    )
    if probe.returncode != 0:
        cannot_mount(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.decode(errors='replace')[:200]}")
    small = tmp_path / "small"
    small.mkdir()
    with running_server(tmp_path / "data") as server:
        token, _ = make_token(server, "alice", rkeys["alice"])
        # 62 KiB of tensors fit the free space of a 64 KiB tmpfs (checked first), and then the
        # envelope does not: ENOSPC mid-pull. A 1 MiB blob is refused before a byte is written.
        fits, _ = _publish_artifact(tmp_path, server.url, token, rkeys["alice"], "fills the disk", 62 << 10)
        big, _ = _publish_artifact(tmp_path, server.url, token, rkeys["alice"], "too big for the disk", 1 << 20)
        for digest, needle in ((fits, "no space left on the device of"), (big, "bytes free")):
            script = 'mount -t tmpfs -o size=64k tmpfs "$0" && "$@"; echo "rc=$?"; ls -A "$0"'
            r = subprocess.run(
                [
                    "unshare",
                    "-rm",
                    "sh",
                    "-c",
                    script,
                    str(small),
                    sys.executable,
                    "-m",
                    "kvgraft",
                    "--json",
                    "pull",
                    "--registry",
                    server.url,
                    digest,
                    "--out",
                    str(small / "out"),
                ],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=REPO,
                env={**os.environ},
            )
            lines = r.stdout.splitlines()
            assert json.loads(lines[0])["ok"] is False and "DiskFullError" in lines[0], r.stdout + r.stderr
            assert lines[1] == "rc=1" and lines[2:] == [], r.stdout  # nothing left on the small disk
            assert r.stderr.count("\n") == 1 and needle in r.stderr and str(small) in r.stderr, r.stderr
            assert "Traceback" not in r.stderr


def test_pull_out_of_memory_ends_in_one_line(hostile: _Hostile, tmp_path: Path) -> None:
    # 48 MiB of "[]," is within --max-json-bytes but needs ~1 GiB of list objects: with the
    # address space capped the parse fails with MemoryError, which must still be one line.
    hostile.routes["/v1/log/key"] = lambda h, q: h.send_raw(200, b"[" + b"[]," * (16 << 20) + b"[]]")
    code = (
        "import resource, sys\n"
        "from kvgraft.cli import main\n"
        "import kvgraft.registry.client, httpx, httpcore, h11\n"
        "resource.setrlimit(resource.RLIMIT_AS, (600 << 20, 600 << 20))\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "--json",
            "pull",
            "--registry",
            hostile.url,
            DIGEST,
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "does not fit in memory" in r.stderr or "ran out of memory" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


# --- finding 4 (client): remembered checkpoints ------------------------------------------------------


def _memory_file(home: Path) -> dict[str, Any]:
    files = sorted((home / "checkpoints").glob("*.json"))
    assert len(files) == 1, files
    return dict(json.loads(files[0].read_text()))


def test_forked_registry_with_the_same_key_is_refused_as_a_split_view_or_rollback(
    tmp_path: Path, home: Path, rkeys: dict[str, Key], capsys: pytest.CaptureFixture[str]
) -> None:
    alice = rkeys["alice"]
    data, old_copy = tmp_path / "data", tmp_path / "data-old"
    with running_server(data) as server:
        token, _ = make_token(server, "alice", alice)
        first, _ = _publish_artifact(tmp_path, server.url, token, alice, "the first entry")
        second, _ = _publish_artifact(tmp_path, server.url, token, alice, "the second entry")
    shutil.copytree(data, old_copy)  # the operator's old copy: the same key, the same two entries
    with running_server(data) as server:
        third, _ = _publish_artifact(tmp_path, server.url, token, alice, "the third entry")
        code, out, err = _cli(capsys, "pull", "--registry", server.url, third, "--out", tmp_path / "pulled-3")
        assert code == 0, err
        remembered = _memory_file(home)
        assert remembered["tree_size"] == 3 and remembered["format"] == "kvgraft-checkpoint-memory/v1"
        # An honest registry that grows is accepted: the consistency proof 3 -> 4 is checked.
        _publish_artifact(tmp_path, server.url, token, alice, "the fourth entry")
        code, out, err = _cli(capsys, "pull", "--registry", server.url, first, "--out", tmp_path / "pulled-1")
        assert code == 0 and _memory_file(home)["tree_size"] == 4, err
    with running_server(old_copy) as forked:
        # Rolled back: its latest checkpoint is at 2 < 4.
        with RegistryClient(forked.url) as client:
            with pytest.raises(
                LogForkError, match=r"possible rollback: .* is at tree size 2, but this machine verified tree size 4"
            ):
                client.signed_head(registry_key(client, None))
        # An entry it still holds comes with a checkpoint at 2 that it cannot prove a prefix of 4.
        code, out, err = _cli(capsys, "pull", "--registry", forked.url, second, "--out", tmp_path / "pulled-2")
        _one_line_failure(code, out, err, "LogForkError", "possible rollback or split view", "tree size 4")
        # Forked: two new entries under the same key make another tree of size 4.
        ftoken, _ = make_token(forked, "alice", alice)
        _publish_artifact(tmp_path, forked.url, ftoken, alice, "a forked third entry", remember=False)
        other, _ = _publish_artifact(tmp_path, forked.url, ftoken, alice, "a forked fourth entry", remember=False)
        code, out, err = _cli(capsys, "pull", "--registry", forked.url, other, "--out", tmp_path / "pulled-fork")
        _one_line_failure(code, out, err, "LogForkError", "possible split view", "at tree size 4", "remembered in")
        assert "remove the remembered checkpoint file" in err
        # publish checks its answer's checkpoint too: size 5 of the fork does not extend size 4.
        with pytest.raises(LogForkError, match="possible split view: .* is not proved to extend"):
            _publish_artifact(tmp_path, forked.url, ftoken, alice, "a forked fifth entry")
    remembered_now = _memory_file(home)
    assert remembered_now["tree_size"] == 4 and remembered_now["root_hash"] != remembered["root_hash"]
    for name in ("pulled-2", "pulled-fork"):
        assert not (tmp_path / name).exists()


def test_a_pinned_key_accepted_a_log_restarted_under_a_new_origin_regression_origin_not_pinned(
    tmp_path: Path, home: Path, rkeys: dict[str, Key], capsys: pytest.CaptureFixture[str]
) -> None:
    """Was: the checkpoint memory is per (key, origin), and nothing tied a key to its origin. The
    operator kept the key and the URL, started the log again under a new --origin holding 1 of
    its 6 entries, and 'pull --registry-key' (or a trust-on-first-use pull) exited 0 and said
    nothing. Now a known key under a new origin is a LogForkError, unless --accept-new-origin."""
    alice = rkeys["alice"]
    old, new = tmp_path / "data-old", tmp_path / "data-new"
    with running_server(old, "--origin", "registry.example/kvgraft") as server:
        token, _ = make_token(server, "alice", alice)
        digests = [_publish_artifact(tmp_path, server.url, token, alice, f"entry {i}", remember=False)[0] for i in range(6)]
        pem = old / "registry-key.pub.pem"
        code, out, err = _cli(capsys, "pull", "--registry", server.url, "--registry-key", pem, digests[0], "--out",
                              tmp_path / "pulled-old")
        assert code == 0 and _memory_file(home)["tree_size"] == 6, err
    # The same key, a new log under another origin, holding only the first entry.
    new.mkdir(mode=0o700)
    for name in ("registry-key.pem", "registry-key.pub.pem"):
        shutil.copy2(old / name, new / name)
    with running_server(new, "--origin", "registry.example/kvgraft-v2") as restarted:
        ntoken, _ = make_token(restarted, "alice", alice)
        (tmp_path / "v2").mkdir()
        _publish_artifact(tmp_path / "v2", restarted.url, ntoken, alice, "entry 0", remember=False)
        for pinned in (("--registry-key", pem), ()):
            code, out, err = _cli(capsys, "pull", "--registry", restarted.url, *pinned, digests[0], "--out",
                                  tmp_path / "pulled-new")
            _one_line_failure(
                code, out, err, "LogForkError", "possible log restart", "signs log 'registry.example/kvgraft-v2'",
                "verified that key's log as 'registry.example/kvgraft'", "tree size 6", "--accept-new-origin",
            )
            assert not (tmp_path / "pulled-new").exists()
        assert _memory_file(home)["origin"] == "registry.example/kvgraft"  # nothing remembered for the new origin
        # Accepted on purpose: the new origin is remembered beside the old one.
        code, out, err = _cli(capsys, "pull", "--registry", restarted.url, "--registry-key", pem, "--accept-new-origin",
                              digests[0], "--out", tmp_path / "pulled-new")
        assert code == 0, err
        origins = sorted(json.loads(f.read_text())["origin"] for f in (home / "checkpoints").glob("*.json"))
        assert origins == ["registry.example/kvgraft", "registry.example/kvgraft-v2"]
        with RegistryClient(restarted.url) as client:  # now known: no flag needed
            head, _ = client.signed_head(registry_key(client, pem))
        assert head.size == 1


def test_a_squatter_logged_first_owned_the_tensors_regression_first_claimant_owns(
    tmp_path: Path, rkeys: dict[str, Key], capsys: pytest.CaptureFixture[str]
) -> None:
    """Was: whoever first logged a statement about a tensor digest owned it. The API and the pages
    showed the squatter's text, and 'pull DIGEST --trusted-keys' (the real signer's) took the
    squatter's entry and refused it. Now pull asks for the entry its trusted keys signed, and the
    API and the pages name every claim (``?signer=KEYID`` picks one)."""
    from kvgraft.verifier import TrustedKeys, trusted_key

    alice, mallory = rkeys["alice"], rkeys["bob"]
    real = artifact("the real text")
    squat = artifact("a squatter's text")
    squat = type(squat)(real.tensors, squat.statement.model_copy(update={"subject": real.statement.subject}))
    trust = tmp_path / "alice-trusted.json"
    trust.write_text(json.dumps(TrustedKeys((trusted_key("alice", alice.private.public_key()),), 1).to_json()))
    with running_server(tmp_path / "data") as server:
        alice_token, _ = make_token(server, "alice", alice)
        mallory_token, _ = make_token(server, "mallory", mallory)
        for token, key, art in ((mallory_token, mallory, squat), (alice_token, alice, real)):
            auth = {"Authorization": f"Bearer {token}"}
            put = httpx.put(f"{server.url}/v1/blobs/{real.digest}", content=real.tensors, headers=auth, timeout=30)
            assert put.status_code in (200, 201), put.text
            r = httpx.post(f"{server.url}/v1/entries", content=key.sign(art.statement), headers=auth, timeout=30)
            assert r.status_code == 201, r.text
        alice_id, mallory_id = str(keyid_of(alice.private.public_key())), str(keyid_of(mallory.private.public_key()))

        # The real signer's pull gets the real entry (entry 1), its signature verified.
        code, out, err = _cli(capsys, "pull", "--registry", server.url, real.digest, "--trusted-keys", trust,
                              "--out", tmp_path / "pulled")
        assert code == 0, err
        assert out["log_index"] == 1 and out["signers"] == ["alice"] and out["signature_checked"] is True
        pulled = json.loads((tmp_path / "pulled" / "statement.dsse.json").read_text())
        assert pulled == json.loads(alice.sign(real.statement))

        # The API names every claim with its signers; ?signer= picks the one a key signed.
        doc = httpx.get(f"{server.url}/v1/artifacts/{real.digest}", timeout=10).json()
        assert doc["entry"]["log_index"] == 0 and doc["other_entries"] == [
            {"log_index": 1, "digest": doc["other_entries"][0]["digest"], "publisher": "alice", "keyids": [alice_id]}
        ]
        mine = httpx.get(f"{server.url}/v1/artifacts/{real.digest}", params={"signer": alice_id}, timeout=10).json()
        assert mine["entry"]["log_index"] == 1 and mine["statement"]["predicate"]["source_text"]["text"] == "the real text"
        assert [o["keyids"] for o in mine["other_entries"]] == [[mallory_id]]
        missing = httpx.get(f"{server.url}/v1/artifacts/{real.digest}", params={"signer": "ab" * 32}, timeout=10)
        assert missing.status_code == 404 and "2 entries by other keys claim these tensors" in missing.json()["detail"]
        bad = httpx.get(f"{server.url}/v1/artifacts/{real.digest}", params={"signer": "alice"}, timeout=10)
        assert bad.status_code == 400 and "is not a key id" in bad.json()["detail"]

        # The page says the tensors are claimed twice, and shows the claim the query's signer made.
        page = httpx.get(f"{server.url}/artifacts/{real.digest}", timeout=10).text
        assert "2 entries by different signers claim these tensors" in page and f"?signer={alice_id}" in page
        page = httpx.get(f"{server.url}/artifacts/{real.digest}", params={"signer": alice_id}, timeout=10).text
        assert "the real text" in page and "a squatter&#39;s text" not in page and "a squatter's text" not in page


def test_checkpoint_forged_with_the_registry_key_is_refused(
    hostile: _Hostile, tmp_path: Path, home: Path, rkeys: dict[str, Key], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvgraft.cli import main as kvgraft_main

    alice = rkeys["alice"]
    with running_server(tmp_path / "data") as server:
        token, _ = make_token(server, "alice", alice)
        digest, _ = _publish_artifact(tmp_path, server.url, token, alice, "an honest entry")
        _publish_artifact(tmp_path, server.url, token, alice, "another honest entry")
        code, out, err = _cli(capsys, "pull", "--registry", server.url, digest, "--out", tmp_path / "pulled")
        assert code == 0, err
        origin = httpx.get(server.url + "/v1/log/key", timeout=30).json()["origin"]
    assert _memory_file(home)["tree_size"] == 2
    # Whoever holds the registry's key serves a longer tree that does not start with the real one.
    with ephemeral_signing_key(load_private_key(tmp_path / "data" / "registry-key.pem")) as key:
        forged = FakeLog(key, origin, [hashlib.sha256(b"forged %d" % i).digest() for i in range(5)])
        forged.install(hostile)
        code = kvgraft_main(["--json", "report", "--registry", hostile.url, "--out", str(tmp_path / "report")])
        out, err = capsys.readouterr()
        _one_line_failure(
            code, json.loads(out), err, "LogForkError", "possible split view", "is not proved to extend", "tree size 2"
        )
        assert not (tmp_path / "report").exists()
        # The same size with another root.
        forged.leaves = forged.leaves[:2]
        forged.size = 2
        with (
            RegistryClient(hostile.url) as client,
            pytest.raises(LogForkError, match="possible split view: .* at tree size 2"),
        ):
            client.signed_head(registry_key(client, None))
    # Nothing forged was remembered.
    assert _memory_file(home)["tree_size"] == 2


def test_damaged_checkpoint_memory_is_an_error_not_a_reset(hostile: _Hostile, home: Path) -> None:
    log = _fresh_log(3)
    log.install(hostile)
    with RegistryClient(hostile.url) as client:
        key = registry_key(client, None)
        client.signed_head(key)
        path = CheckpointMemory.default().path(key.keyid, log.origin)
        path.write_text(path.read_text().replace('"tree_size": 3', '"tree_size": 9').replace("\u2014", "-")[:-40])
        with pytest.raises(Exception, match="is damaged or not signed") as info:
            client.signed_head(key)
        assert type(info.value).__name__ == "CheckpointMemoryError"
