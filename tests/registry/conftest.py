"""Registry test fixtures: keys, signed statements, an in-process app, and a real server process
(``KvgraftProcess`` and ``free_port`` are tests/processes.py's, re-exported for the registry's tests)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgraft.schemas import (
    DatasetRef,
    DeterminismProfile,
    ExactnessPredicate,
    ExactnessSample,
    ExactnessStatement,
    ExactnessSummary,
    KvArtifactPredicate,
    KvArtifactStatement,
    ModelRef,
    PositionRange,
    PreRegistrationPredicate,
    PreRegistrationRef,
    PreRegistrationStatement,
    ReplayPredicate,
    ReplayStatement,
    SourceText,
    Statement,
    Subject,
    SubjectDigest,
    TokenSpan,
    canonical_json,
    hex_of,
    sha256_bytes,
)
from kvgraft.verifier import (
    KeyType,
    PrivateKey,
    envelope_json,
    ephemeral_signing_key,
    generate_private_key,
    public_key_pem,
    save_private_key,
    save_public_key,
    sign_statement,
)

from ..processes import KvgraftProcess, free_port

REPO = Path(__file__).resolve().parents[2]


# --- keys --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Key:
    """A signing key with its files on disk."""

    name: str
    private: PrivateKey
    path: Path
    pub_path: Path

    @property
    def pem(self) -> str:
        return public_key_pem(self.private.public_key()).decode("ascii")

    def sign(self, statement: Statement) -> bytes:
        """The envelope file bytes, as kvgraft writes them."""
        with ephemeral_signing_key(self.private) as signer:
            return envelope_json(sign_statement(statement, [signer]))


def make_key(directory: Path, name: str, key_type: KeyType = "ed25519") -> Key:
    key = generate_private_key(key_type)
    path = directory / f"{name}.pem"
    save_private_key(key, path)
    save_public_key(key.public_key(), directory / f"{name}.pem.pub")
    return Key(name, key, path, directory / f"{name}.pem.pub")


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Key]:
    """alice and bob (registered in most tests) and eve (never registered)."""
    d = tmp_path_factory.mktemp("keys")
    return {n: make_key(d, n) for n in ("alice", "bob", "eve")}


# --- statements --------------------------------------------------------------------------------


def profile(name: str = "cpu-fp32") -> DeterminismProfile:
    return DeterminismProfile(
        name=name, exactness="own-position", device_kind="cpu", device_fingerprint="test-cpu", dtype="float32",
        torch_version="2.13.0", transformers_version="5.24.0", threads=1, attention_implementation="eager",
        matmul_tiling="default", deterministic_algorithms=True,
    )


def model_ref(name: str = "tiny-llama-test") -> ModelRef:
    return ModelRef(name=name, weights_digest=sha256_bytes(name.encode()), config_digest=sha256_bytes(b"config"))


def subject(name: str, data: bytes) -> Subject:
    return Subject(name=name, digest=SubjectDigest(sha256=hex_of(sha256_bytes(data))))


@dataclass(frozen=True)
class Artifact:
    """A KV artifact for tests: tensors bytes and the statement about them."""

    tensors: bytes
    statement: KvArtifactStatement

    @property
    def digest(self) -> str:
        return sha256_bytes(self.tensors)


def artifact(
    text: str = "knowledge",
    *,
    parent: Artifact | None = None,
    model: str = "tiny-llama-test",
    profile_name: str = "cpu-fp32",
    salt: bytes = b"",
) -> Artifact:
    """A KV artifact statement about fresh tensor bytes (unique per text, parent and salt)."""
    tensors = b"KVTENSORS:" + hashlib.sha256(text.encode() + (parent.tensors if parent else b"") + salt).digest() * 64
    start = parent.statement.predicate.positions.end if parent else 0
    ids = [len(w) for w in text.split()] or [0]
    statement = KvArtifactStatement(
        subject=[subject("kv.safetensors", tensors)],
        predicate=KvArtifactPredicate(
            model=model_ref(model), tokenizer_digest=sha256_bytes(b"tok"), profile=profile(profile_name),
            parent=parent.digest if parent else None, chain_key=sha256_bytes(tensors + b"chain"),
            tokens=TokenSpan(ids=ids, digest=sha256_bytes(canonical_json(ids))),
            positions=PositionRange(start=start, end=start + len(ids)),
            source_text=SourceText(digest=sha256_bytes(text.encode()), text=text),
            next_token_logits_digest=sha256_bytes(b"logits"), engine_versions={"kvgraft": "0.1.0"},
            created="2026-11-29T12:00:00Z",
        ),
    )
    return Artifact(tensors, statement)


def exactness_record(prefix: Artifact, logits: bytes) -> ExactnessStatement:
    """An exactness record over one sample grafted from ``prefix``; ``logits`` is its subject file."""
    d = sha256_bytes(logits)
    return ExactnessStatement(
        subject=[subject("logits/sample-0.f32", logits)],
        predicate=ExactnessPredicate(
            model=model_ref(), profile=profile(), level="own-position", vocab_size=8, seed=0,
            samples=[
                ExactnessSample(
                    index=0, prefix_artifact=prefix.digest, prefix_tokens=3, continuation_digest=sha256_bytes(b"c"),
                    continuation_tokens=1, fresh_logits_sha256=d, graft_logits_sha256=d, bitwise_equal=True,
                    kl_divergence=0.0, argmax_agreement=1.0,
                )
            ],
            summary=ExactnessSummary(samples=1, bitwise_equal=1, argmax_agree_all=1, max_kl_divergence=0.0, mean_argmax_agreement=1.0),
        ),
    )


def pre_registration(dataset: bytes) -> PreRegistrationStatement:
    return PreRegistrationStatement(
        subject=[subject("dataset.jsonl", dataset)],
        predicate=PreRegistrationPredicate(
            model=model_ref(), profile=profile(), dataset=DatasetRef(name="gsm8k", digest=sha256_bytes(dataset)),
            command=["kvgraft", "replay"], settings={"max_new_tokens": 8},
            expected_output_hashes={"0": hex_of(sha256_bytes(b"out"))}, expected_outputs_digest=sha256_bytes(b"outs"),
        ),
    )


def replay(outputs: bytes, pre_digest: str, pre_index: int) -> ReplayStatement:
    return ReplayStatement(
        subject=[subject("outputs.jsonl", outputs)],
        predicate=ReplayPredicate(
            pre_registration=PreRegistrationRef(envelope_digest=pre_digest, log_index=pre_index),
            output_hashes={"0": hex_of(sha256_bytes(b"out"))}, outputs_digest=sha256_bytes(outputs), reproduced=True,
        ),
    )


def tampered(envelope: bytes) -> bytes:
    """``envelope`` with its statement's source text changed after signing (signature kept)."""
    import base64

    doc = json.loads(envelope)
    payload = json.loads(base64.b64decode(doc["payload"]))
    payload["predicate"]["source_text"]["text"] = "altered"
    doc["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
    return json.dumps(doc).encode()


def blob_path(data_dir: Path, data: bytes) -> Path:
    return data_dir / "blobs" / "sha256" / hashlib.sha256(data).hexdigest()


def leftovers(data_dir: Path) -> list[Path]:
    """Files under blobs/tmp (there must be none once a request has finished)."""
    tmp = data_dir / "blobs" / "tmp"
    return sorted(tmp.iterdir()) if tmp.exists() else []


# --- an in-process registry --------------------------------------------------------------------


@dataclass
class Harness:
    """An app over a temp data dir, with a test client and admin access."""

    client: Any
    data: Path
    admin_secret: str
    tokens: dict[str, str] = field(default_factory=dict)

    def admin(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        return self.client.request(method, path, json=body, headers={"Authorization": f"Bearer {self.admin_secret}"})

    def make_token(self, publisher: str, *keys: Key) -> tuple[str, str]:
        """A new token for ``publisher`` bound to ``keys``: (token, token id)."""
        r = self.admin("POST", "/v1/admin/tokens", {"publisher": publisher, "public_keys_pem": [k.pem for k in keys]})
        assert r.status_code == 201, r.text
        return r.json()["token"], r.json()["token_id"]

    def auth(self, publisher: str = "alice") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[publisher]}"}

    def put_blob(self, data: bytes, publisher: str = "alice") -> httpx.Response:
        return self.client.put(f"/v1/blobs/{sha256_bytes(data)}", content=data, headers=self.auth(publisher))

    def publish(self, envelope: bytes, publisher: str = "alice") -> httpx.Response:
        return self.client.post("/v1/entries", content=envelope, headers=self.auth(publisher))

    def publish_artifact(self, art: Artifact, key: Key, publisher: str = "alice") -> dict[str, Any]:
        assert self.put_blob(art.tensors, publisher).status_code in (200, 201)
        r = self.publish(key.sign(art.statement), publisher)
        assert r.status_code == 201, r.text
        return dict(r.json())


@contextlib.contextmanager
def harness(data: Path, keys: dict[str, Key], **settings: Any) -> Iterator[Harness]:
    from litestar.testing import TestClient

    from kvgraft.registry import RegistrySettings, create_app

    app = create_app(data, RegistrySettings(**settings))
    with TestClient(app) as client:
        secret = json.loads((data / "admin.json").read_text())["secret"]
        h = Harness(client, data, secret)
        h.tokens["alice"] = h.make_token("alice", keys["alice"])[0]
        h.tokens["bob"] = h.make_token("bob", keys["bob"])[0]
        yield h


# --- the metadata database: DuckDB (the default) or a real PostgreSQL server ------------------

#: The backends the registry suites run against (``backend``); a module pins one by defining its own fixture.
BACKENDS = ("duckdb", "postgres")


@pytest.fixture(scope="session")
def postgres() -> Iterator[Any]:
    """One real PostgreSQL server for the session (tests/registry/postgres.py); each test makes its own database."""
    from tests.registry.postgres import postgres_server

    with postgres_server() as server:
        yield server


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """Which metadata database a registry fixture uses."""
    return str(request.param)


@pytest.fixture
def database(backend: str, request: pytest.FixtureRequest) -> str | None:
    """``RegistrySettings.database`` for ``backend``: None (DuckDB in the data dir) or a fresh PostgreSQL database's URL."""
    if backend == "duckdb":
        return None
    return str(request.getfixturevalue("postgres").database())


@pytest.fixture
def reg(tmp_path: Path, keys: dict[str, Key], database: str | None) -> Iterator[Harness]:
    """An in-process registry with tokens for alice (alice's key) and bob (bob's key), on each backend."""
    with harness(tmp_path / "data", keys, database=database) as h:
        yield h


# --- a real server process ---------------------------------------------------------------------


def registry_cli(*args: str | Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``python -m kvgraft ARGS`` (the ``kvgraft`` command), bounded in time."""
    return subprocess.run(
        [sys.executable, "-m", "kvgraft", *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


class Server(KvgraftProcess):
    """``kvgraft serve`` in a subprocess on 127.0.0.1; always stopped by ``stop``."""

    what = "server"

    def __init__(self, data: Path, log: Path, *extra: str) -> None:
        self.data = data
        port = free_port()
        # --init: a test's data directory may not exist yet (kvgraft serve refuses a missing one without it).
        super().__init__(["serve", "--data", str(data), "--init", "--port", str(port), "--log-level", "warning", *extra], log, port)

    def ready(self) -> bool:
        return httpx.get(self.url + "/v1/log/checkpoint", timeout=2).status_code == 200

    @property
    def pid(self) -> int:
        return self.proc.pid


@contextlib.contextmanager
def running_server(data: Path, *extra: str) -> Iterator[Server]:
    """A started, answering server over ``data``; stopped when the block ends, whatever happens."""
    server = Server(data, data.parent / f"server-{os.getpid()}-{time.monotonic_ns()}.log", *extra)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
