"""The tamper matrix: one byte changed in each region of a published artifact and its log
evidence, and every consumer that reads that region refuses it.

A real tiny-llama-test artifact is captured and signed by alice, published to a real server with
two other entries (so the inclusion proof has hashes), and pulled back verified. Then, for each
region (tensor data, safetensors header, statement payload, signature, inclusion proof,
checkpoint), one byte is changed where each consumer reads it: ``pull`` through a registry
answer altered in transit, ``kvgraft graft`` and ``kvgraft-verify`` on the files on disk.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgraft.cli import main as kvgraft_main
from kvgraft.registry.client import (
    BlobDigestError,
    EvidenceError,
    RegistryClient,
    RegistryClientError,
    publish,
    pull,
)
from kvgraft.verifier import TrustedKeys, load_trusted_keys, trusted_key
from kvgraft.verifier.cli import main as verify_main
from tests.registry.conftest import Key, artifact, running_server
from tests.reliability.conftest import Figures
from tests.reliability.hostile import flip_byte
from tests.reliability.servers import make_token, post_entry, put_blob

REPO = Path(__file__).resolve().parents[2]
TEST_HOME = REPO / ".pytest-kvgraft-home"
KV, STATEMENT = "kv.safetensors", "statement.dsse.json"


@dataclass
class Published:
    url: str
    token: str
    art: Path
    trust: Path
    trust_keys: TrustedKeys
    registry_pub: Path
    continuation: Path
    kv_digest: str
    work: Path


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory, rkeys: dict[str, Key]) -> Iterator[Published]:
    work = tmp_path_factory.mktemp("tamper")
    with pytest.MonkeyPatch.context() as mp:
        # The converted tiny model is cached here, as for the engine tests.
        mp.setenv("KVGRAFT_HOME", str(TEST_HOME))
        TEST_HOME.mkdir(exist_ok=True)
        alice = rkeys["alice"]
        (work / "prefix.txt").write_text("The registry keeps signed knowledge.\n")
        (work / "continuation.txt").write_text("What does it keep?")
        code = kvgraft_main(["--json", "capture", "--model", "tiny-llama-test", "--text-file", str(work / "prefix.txt"),
                             "--out", str(work / "art"), "--key", str(alice.path)])
        assert code == 0
        trust = TrustedKeys((trusted_key("alice", alice.private.public_key()),), 1)
        (work / "trust.json").write_text(json.dumps(trust.to_json()))
        with running_server(work / "data", "--log-level", "warning") as server:
            token, _ = make_token(server, "alice", alice)
            with httpx.Client(base_url=server.url, timeout=60) as c:
                for text in ("before", "after"):
                    other = artifact(f"another entry {text}")
                    assert put_blob(c, token, other.tensors).status_code == 201
                    assert post_entry(c, token, alice.sign(other.statement)).status_code == 201
                    if text == "before":
                        with RegistryClient(server.url, token=token) as client:
                            result = publish(client, work / "art", registry_key_file=server.data / "registry-key.pub.pem")
            yield Published(
                url=server.url, token=token, art=work / "art", trust=work / "trust.json", trust_keys=load_trusted_keys(work / "trust.json"),
                registry_pub=server.data / "registry-key.pub.pem", continuation=work / "continuation.txt",
                kv_digest=result.artifact_digest, work=work,
            )


# --- the regions, as byte changes ------------------------------------------------------------


def _header_length(kv: bytes) -> int:
    return int.from_bytes(kv[:8], "little")


def tensor_data(kv: bytes) -> bytes:
    n = _header_length(kv)
    return flip_byte(kv, 8 + n + (len(kv) - 8 - n) // 2)


def safetensors_header(kv: bytes) -> bytes:
    # A digit of the header JSON (a shape or an offset), so the file still parses.
    n = _header_length(kv)
    header = kv[8 : 8 + n]
    i = next(i for i in range(len(header) // 2, len(header)) if chr(header[i]).isdigit())
    return kv[: 8 + i] + (b"7" if header[i : i + 1] != b"7" else b"3") + kv[8 + i + 1 :]


def _envelope_field(envelope: bytes, change: Callable[[dict[str, Any]], None]) -> bytes:
    doc = json.loads(envelope)
    change(doc)
    return json.dumps(doc).encode()


def statement_payload(envelope: bytes) -> bytes:
    def change(doc: dict[str, Any]) -> None:
        payload = base64.b64decode(doc["payload"])
        i = payload.index(b'"text"')  # the source text: still JSON, another claim
        doc["payload"] = base64.b64encode(flip_byte(payload, i + 10)).decode()

    return _envelope_field(envelope, change)


def signature(envelope: bytes) -> bytes:
    def change(doc: dict[str, Any]) -> None:
        sig = base64.b64decode(doc["signatures"][0]["sig"])
        doc["signatures"][0]["sig"] = base64.b64encode(flip_byte(sig, len(sig) // 2)).decode()

    return _envelope_field(envelope, change)


def _flip_hex(value: str) -> str:
    return ("1" if value[0] != "1" else "2") + value[1:]


def inclusion_proof(doc: dict[str, Any]) -> dict[str, Any]:
    assert doc["hashes"], "the inclusion proof has no hashes to alter"
    return {**doc, "hashes": [_flip_hex(doc["hashes"][0]), *doc["hashes"][1:]]}


def checkpoint(note: str) -> str:
    lines = note.split("\n")
    root = base64.b64decode(lines[2])
    lines[2] = base64.b64encode(flip_byte(root, 0)).decode()
    return "\n".join(lines)


# --- pull: the registry's answer altered in transit --------------------------------------------


class Tamper(httpx.BaseTransport):
    """A transport that passes requests to the server and alters the answers ``match`` picks."""

    def __init__(self, match: Callable[[httpx.Request], bool], change: Callable[[bytes], bytes]) -> None:
        self._inner = httpx.HTTPTransport()
        self._match = match
        self._change = change
        self.altered = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self._inner.handle_request(request)
        if not self._match(request) or response.status_code != 200:
            return response
        body = response.read()
        response.close()
        self.altered += 1
        headers = [(k, v) for k, v in response.headers.items() if k.lower() not in ("content-length", "content-encoding")]
        return httpx.Response(200, headers=headers, content=self._change(body), request=request)


def _json_change(f: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[bytes], bytes]:
    return lambda body: json.dumps(f(json.loads(body))).encode()


def _artifact_doc(change: Callable[[dict[str, Any]], None]) -> Callable[[bytes], bytes]:
    def apply(doc: dict[str, Any]) -> dict[str, Any]:
        change(doc)
        return doc

    return _json_change(apply)


PULL_CASES: list[tuple[str, Callable[[httpx.Request], bool], Callable[[bytes], bytes], type[RegistryClientError], str]] = [
    ("tensor data", lambda r: r.url.path.startswith("/v1/blobs/"), tensor_data, BlobDigestError, "that hash to"),
    ("safetensors header", lambda r: r.url.path.startswith("/v1/blobs/"), safetensors_header, BlobDigestError, "that hash to"),
    ("statement payload", lambda r: r.url.path.endswith("/envelope"), statement_payload, EvidenceError, "sha256"),
    ("signature", lambda r: r.url.path.endswith("/envelope"), signature, EvidenceError, "sha256"),
    ("inclusion proof", lambda r: r.url.path.startswith("/v1/artifacts/"),
     _artifact_doc(lambda d: d.update(inclusion_proof=inclusion_proof(d["inclusion_proof"]))), EvidenceError, "inclusion"),
    ("checkpoint", lambda r: r.url.path.startswith("/v1/artifacts/"),
     _artifact_doc(lambda d: d.update(checkpoint=checkpoint(d["checkpoint"]))), EvidenceError, "checkpoint"),
]


def test_untampered_pull_graft_and_verify_accept(published: Published, capsys: pytest.CaptureFixture[str]) -> None:
    """The baseline: without a change, every consumer accepts (so the refusals below mean something)."""
    out = published.work / "pulled-ok"
    with RegistryClient(published.url) as client:
        result = pull(client, published.kv_digest, out, trusted_keys=published.trust_keys, registry_key_file=published.registry_pub)
    assert result.directory == out and (out / KV).read_bytes() == (published.art / KV).read_bytes()
    assert _graft(published, published.art, capsys)["ok"] is not False
    assert _verify(["envelope", str(published.art / STATEMENT), "--trusted-keys", str(published.trust),
                    "--artifact-dir", str(published.art)], capsys)["ok"] is True


@pytest.mark.parametrize(("region", "match", "change", "error", "message"), PULL_CASES, ids=[c[0] for c in PULL_CASES])
def test_pull_refuses(
    published: Published, figures: Figures, region: str, match: Callable[[httpx.Request], bool], change: Callable[[bytes], bytes],
    error: type[RegistryClientError], message: str,
) -> None:
    out = published.work / f"pulled-{region.replace(' ', '-')}"
    transport = Tamper(match, change)
    figures.count("tamper", "tried")
    with RegistryClient(published.url, transport=transport) as client, pytest.raises(error, match=message):
        pull(client, published.kv_digest, out, trusted_keys=published.trust_keys, registry_key_file=published.registry_pub)
    assert transport.altered >= 1
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.pull-")]
    figures.count("tamper", "refused")
    figures.count("tamper", "pull_refused")


# --- graft and kvgraft-verify: the files on disk altered ---------------------------------------


def _graft(published: Published, art: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    old = os.environ.get("KVGRAFT_HOME")
    os.environ["KVGRAFT_HOME"] = str(TEST_HOME)
    try:
        code = kvgraft_main(["--json", "graft", "--artifact", str(art), "--text-file", str(published.continuation),
                             "--trusted-keys", str(published.trust)])
    finally:
        if old is None:
            os.environ.pop("KVGRAFT_HOME", None)
        else:
            os.environ["KVGRAFT_HOME"] = old
    out, _ = capsys.readouterr()
    result = json.loads(out)
    assert (code == 0) == (result.get("ok") is not False)
    return dict(result)


def _verify(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code = verify_main(["--json", *argv])
    out, _ = capsys.readouterr()
    result = dict(json.loads(out))
    result["ok"] = code == 0
    return result


FILE_CASES: list[tuple[str, str, Callable[[bytes], bytes], str, str, str, str]] = [
    # region, file, change, graft error, graft message, verify error, verify message
    ("tensor data", KV, tensor_data, "ArtifactError", "has digest", "SubjectMismatchError", KV),
    ("safetensors header", KV, safetensors_header, "ArtifactError", "has digest", "SubjectMismatchError", KV),
    ("statement payload", STATEMENT, statement_payload, "ArtifactSignatureError", "does not verify", "BadSignatureError", "does not verify"),
    ("signature", STATEMENT, signature, "ArtifactSignatureError", "does not verify", "BadSignatureError", "does not verify"),
]


@pytest.mark.parametrize(
    ("region", "name", "change", "graft_error", "graft_message", "verify_error", "verify_message"), FILE_CASES, ids=[c[0] for c in FILE_CASES]
)
def test_graft_and_verify_refuse(
    published: Published, figures: Figures, capsys: pytest.CaptureFixture[str], region: str, name: str, change: Callable[[bytes], bytes],
    graft_error: str, graft_message: str, verify_error: str, verify_message: str,
) -> None:
    art = published.work / f"tampered-{region.replace(' ', '-')}"
    shutil.copytree(published.art, art)
    (art / name).write_bytes(change((art / name).read_bytes()))

    figures.count("tamper", "tried")
    g = _graft(published, art, capsys)
    assert g["ok"] is False and g["error"] == graft_error and graft_message in g["message"], g
    figures.count("tamper", "refused")
    figures.count("tamper", "graft_refused")

    figures.count("tamper", "tried")
    v = _verify(["envelope", str(art / STATEMENT), "--trusted-keys", str(published.trust), "--artifact-dir", str(art)], capsys)
    assert v["ok"] is False and v["error"] == verify_error and verify_message in v["message"], v
    figures.count("tamper", "refused")
    figures.count("tamper", "verify_refused")


@pytest.mark.parametrize("region", ["inclusion proof", "checkpoint", "statement payload"])
def test_verify_log_refuses(published: Published, figures: Figures, capsys: pytest.CaptureFixture[str], region: str) -> None:
    d = published.work / f"log-{region.replace(' ', '-')}"
    d.mkdir()
    doc = httpx.get(f"{published.url}/v1/artifacts/{published.kv_digest}", timeout=30).json()
    envelope = httpx.get(published.url + doc["entry"]["envelope_url"], timeout=30).content
    proof, note = doc["inclusion_proof"], doc["checkpoint"]
    argv = ["log", "--checkpoint", str(d / "checkpoint"), "--registry-key", str(published.registry_pub),
            "--inclusion", str(d / "proof.json"), str(d / "entry.dsse.json")]
    # Untampered, the evidence verifies; then one region changes.
    (d / "checkpoint").write_text(note)
    (d / "proof.json").write_text(json.dumps(proof))
    (d / "entry.dsse.json").write_bytes(envelope)
    assert _verify(argv, capsys)["ok"] is True
    if region == "inclusion proof":
        (d / "proof.json").write_text(json.dumps(inclusion_proof(proof)))
    elif region == "checkpoint":
        (d / "checkpoint").write_text(checkpoint(note))
    else:
        (d / "entry.dsse.json").write_bytes(statement_payload(envelope))
    figures.count("tamper", "tried")
    v = _verify(argv, capsys)
    assert v["ok"] is False and v["error"] == "LogProofError", v
    figures.count("tamper", "refused")
    figures.count("tamper", "verify_refused")
