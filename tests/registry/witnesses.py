"""Helpers for tests with real witnesses: ``kvgraft witness serve`` processes on 127.0.0.1, registry
data directories whose log key is known before the registry first starts, and witness policies."""

from __future__ import annotations

import base64
import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgraft.verifier import (
    Checkpoint,
    MerkleTree,
    WitnessKey,
    ephemeral_signing_key,
    format_vkey,
    generate_private_key,
    hash_leaf,
    parse_signed_note,
    save_private_key,
    sign_checkpoint,
)

from .conftest import Key, KvgraftProcess, free_port

#: The origin every test registry here is started with (``kvgraft serve --origin``).
ORIGIN = "witness-test.example/log"

T = TypeVar("T")


@dataclass(frozen=True)
class LogKey:
    """A registry's log key, made before its data directory is first served."""

    private: Ed25519PrivateKey
    origin: str = ORIGIN

    @property
    def vkey(self) -> str:
        return format_vkey(self.origin, self.private.public_key())


def registry_data(data: Path) -> LogKey:
    """A new data directory holding a registry key (0600), so the log's vkey is known in advance."""
    data.mkdir(mode=0o700, parents=True)
    key = generate_private_key()
    assert isinstance(key, Ed25519PrivateKey)
    save_private_key(key, data / "registry-key.pem")
    return LogKey(key)


class WitnessServer(KvgraftProcess):
    """``kvgraft witness serve`` in a subprocess on 127.0.0.1; always stopped by ``stop``."""

    what = "witness"

    def __init__(self, key: Key, name: str, state: Path, logs: Sequence[str], log: Path) -> None:
        self.key, self.name, self.state = key, name, state
        port = free_port()
        super().__init__(
            ["witness", "serve", "--key", str(key.path), "--name", name, "--state", str(state), "--port", str(port),
             "--log-level", "info", *[arg for vkey in logs for arg in ("--log", vkey)]],
            log, port,
        )

    @property
    def witness_key(self) -> WitnessKey:
        return WitnessKey(self.name, self.key.private.public_key())

    @property
    def option(self) -> str:
        """``--witness`` for ``kvgraft serve``: VKEY=URL."""
        return f"{self.witness_key.vkey}={self.url}"

    def ready(self) -> bool:
        return httpx.options(self.url + "/add-checkpoint", timeout=2).status_code == 204

    def add_checkpoint(self, body: bytes) -> httpx.Response:
        return httpx.post(self.url + "/add-checkpoint", content=body, timeout=30)


@contextlib.contextmanager
def running_witness(key: Key, name: str, state: Path, logs: Sequence[str]) -> Iterator[WitnessServer]:
    """A started, answering witness; stopped when the block ends, whatever happens."""
    server = WitnessServer(key, name, state, logs, state.parent / f"witness-{os.getpid()}-{time.monotonic_ns()}.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


#: A scripted witness's answer to one add-checkpoint body: (status, content type, body).
Answer = tuple[int, str, bytes]


@contextlib.contextmanager
def scripted_witness(answer: Callable[[bytes], Answer]) -> Iterator[str]:
    """A real HTTP server on 127.0.0.1 answering each ``POST /add-checkpoint`` with ``answer(body)``
    (a witness that lies, or fails on cue); yields its URL and is shut down when the block ends."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            status, media, content = answer(body)
            self.send_response(status)
            self.send_header("Content-Type", media)
            self.send_header("Content-Length", str(len(content)))
            self.end_headers()
            self.wfile.write(content)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    serving = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    serving.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        serving.join(timeout=10)


def policy_file(path: Path, witnesses: Sequence[WitnessServer], needed: int) -> Path:
    """A c2sp.org/tlog-policy file: the witnesses as w1, w2, ..., ``needed`` of them required."""
    lines = [f"witness w{i} {w.witness_key.vkey} {w.url}" for i, w in enumerate(witnesses, start=1)]
    names = " ".join(f"w{i}" for i in range(1, len(witnesses) + 1))
    lines += [f"group witnesses {needed} {names}", "quorum witnesses"]
    path.write_text("\n".join(lines) + "\n")
    return path


def cosigners(note: bytes, witnesses: Sequence[WitnessServer]) -> list[str]:
    """The names of ``witnesses`` that have a signature line on ``note`` (unverified: a count)."""
    mine = {(w.name, w.witness_key.key_id) for w in witnesses}
    return sorted(s.name for s in parse_signed_note(note).signatures if (s.name, s.key_id) in mine)


def wait_for(check: Callable[[], T | None], what: str, timeout: float = 60) -> T:
    """Poll ``check`` until it returns something, or fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


class FakeLog:
    """A log played by the test: leaves, a key, signed checkpoints and add-checkpoint bodies."""

    def __init__(self, origin: str = "fake.example/log", leaves: int = 0) -> None:
        self.key = LogKey(Ed25519PrivateKey.generate(), origin)
        self.tree = MerkleTree()
        self.grow(leaves)

    def grow(self, n: int, tag: bytes = b"leaf") -> None:
        for _ in range(n):
            self.tree.append(hash_leaf(tag + str(self.tree.size).encode()))

    def note(self, size: int | None = None) -> bytes:
        n = self.tree.size if size is None else size
        with ephemeral_signing_key(self.key.private) as k:
            return sign_checkpoint(Checkpoint(self.key.origin, n, self.tree.root(n)), self.key.origin, k)

    def note_with_root(self, size: int, root: bytes) -> bytes:
        """A checkpoint signed by this log's key with any root (a lie the log tells)."""
        with ephemeral_signing_key(self.key.private) as k:
            return sign_checkpoint(Checkpoint(self.key.origin, size, root), self.key.origin, k)

    def body(self, old: int, size: int | None = None, *, proof: list[bytes] | None = None) -> bytes:
        n = self.tree.size if size is None else size
        hashes = self.tree.consistency_proof(old, n) if proof is None else proof
        lines = "".join(base64.b64encode(h).decode() + "\n" for h in hashes)
        return f"old {old}\n{lines}\n".encode() + self.note(n)

