"""The registry client end to end: ``kvgraft publish``, ``pull`` and ``mirror`` against real
server processes (``kvgraft serve`` on 127.0.0.1, bounded, always stopped), with artifacts,
a chain and an exactness record made by the engine's tiny model."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgraft.cli import main as client_main
from kvgraft.registry.client import (
    EnvelopeSignatureError,
    EvidenceError,
    LocalFilesError,
    MirrorDivergedError,
    RegistryAuthError,
    RegistryClient,
    RegistryNotFoundError,
    mirror,
    publish,
    pull,
)
from kvgraft.schemas import canonical_model
from kvgraft.verifier import (
    TrustedKeys,
    envelope_json,
    ephemeral_signing_key,
    load_trusted_keys,
    sign_envelope,
    trusted_key,
)
from kvgraft.verifier.cli import main as verify_main

from .conftest import REPO, Key, leftovers, make_key, pre_registration, registry_cli, running_server


@dataclass(frozen=True)
class Made:
    """Artifacts and a record written by the engine, signed with alice's key."""

    root: Path
    child: Path
    record: Path
    trust: Path
    model: Any
    profile: Any

    def kv(self, directory: Path) -> str:
        return "sha256:" + hashlib.sha256((directory / "kv.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory, keys: dict[str, Key]) -> Iterator[Made]:
    """A root artifact, its child and a 2-sample exactness record from tiny-llama-test."""
    base = tmp_path_factory.mktemp("made")
    with pytest.MonkeyPatch.context() as mp:
        # capture records each artifact in $KVGRAFT_HOME/index: keep that out of the user's home.
        mp.setenv("KVGRAFT_HOME", str(base / "home"))
        from kvgraft.engine import capture, current_profile, load_artifact, load_model, trust_signer
        from kvgraft.engine._internal.exactness import run_exactness

        model, profile = load_model("tiny-llama-test"), current_profile()
        alice = keys["alice"].path
        capture(model, profile, "Natalia sold clips to 48 of her friends in April.", base / "art" / "root", key=alice)
        parent = load_artifact(base / "art" / "root", model, profile, trusted=trust_signer(alice))
        capture(model, profile, " In May she sold half as many.", base / "art" / "child", key=alice, parent=parent)
        run_exactness(model, profile, base / "rec" / "exact", samples=2, key=alice, max_tokens=40, progress=False)
        trust = base / "trust.json"
        alice_public = keys["alice"].private.public_key()
        trust.write_text(json.dumps(TrustedKeys((trusted_key("alice", alice_public),), 1).to_json()))
        yield Made(base / "art" / "root", base / "art" / "child", base / "rec" / "exact", trust, model, profile)


def _token(data: Path, publisher: str, key: Key) -> str:
    r = registry_cli("--json", "token", "create", "--data", data, "--publisher", publisher, "--key", key.pub_path)
    assert r.returncode == 0, r.stderr
    return str(json.loads(r.stdout)["token"])


def _cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, dict[str, Any], str]:
    code = client_main(["--json", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def _one_line_failure(code: int, out: dict[str, Any], err: str, *needles: str) -> None:
    assert code == 1 and out["ok"] is False, out
    assert err.count("\n") == 1 and err.startswith("kvgraft: "), err
    for needle in needles:
        assert needle in err, err


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _no_staging_left(parent: Path) -> None:
    assert [p.name for p in parent.iterdir() if ".pull-" in p.name] == []


def test_publish_list_pull_restart(
    tmp_path: Path, made: Made, keys: dict[str, Key], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    pulled = tmp_path / "pulled"
    root_kv, child_kv = made.kv(made.root), made.kv(made.child)
    with running_server(data) as server:
        token = _token(data, "alice", keys["alice"])
        registry_pub = data / "registry-key.pub.pem"

        # A child whose parent is not on the registry: said clearly, with the digest, unless the
        # client may publish the parent it finds locally first.
        code, out, err = _cli(capsys, "publish", "--registry", server.url, "--token", token, "--no-parents", made.child)
        _one_line_failure(code, out, err, "ParentNotPublishedError", root_kv, "publish the parent first")
        code, out, err = _cli(capsys, "publish", "--registry", server.url, "--token", token, made.child)
        assert code == 0, err
        assert [p["artifact_digest"] for p in out["parents"]] == [root_kv] and out["parents"][0]["log_index"] == 0
        assert (out["artifact_digest"], out["log_index"], out["tree_size"], out["created"]) == (child_kv, 1, 2, True)
        assert out["blobs"]["uploaded"] == [child_kv] and out["blobs"]["skipped"] == []
        assert out["registry_key"]["trust"] == "trust-on-first-use"
        envelope = (made.child / "statement.dsse.json").read_bytes()
        assert out["entry_digest"] == "sha256:" + hashlib.sha256(envelope).hexdigest()

        # Resume: the registry already has one of the record's blobs (an upload that broke off
        # after it); only the others are sent.
        record_files = sorted((made.record / "logits").iterdir())
        assert len(record_files) >= 2
        first = record_files[0]
        with RegistryClient(server.url, token=token) as client:
            digest = "sha256:" + first.stem
            assert client.put_blob(digest, iter([first.read_bytes()]), first.stat().st_size) is True
            result = publish(client, made.record, registry_key_file=registry_pub)
        assert (result.kind, result.log_index, result.tree_size, result.created) == ("record", 2, 3, True)
        assert result.skipped == (digest,) and len(result.uploaded) == len(record_files) - 1
        assert result.registry_key.trust == "pinned"
        # Publishing again sends nothing and gets the same entry back.
        code, out, err = _cli(capsys, "publish", "--registry", server.url, "--token", token, made.record)
        assert code == 0 and out["created"] is False and out["log_index"] == 2, err
        assert out["blobs"]["uploaded"] == [] and len(out["blobs"]["skipped"]) == len(record_files)
        # Without a token, or with a made-up one, nothing is published.
        code, out, err = _cli(capsys, "publish", "--registry", server.url, "--token", "kvgr_nope", made.root)
        _one_line_failure(code, out, err, "RegistryAuthError", "401")

        # List.
        with RegistryClient(server.url) as client:
            assert [a["digest"] for a in client.list_artifacts()] == [root_kv, child_kv]
            assert [a["digest"] for a in client.list_artifacts(parent=root_kv)] == [child_kv]
            assert [r["kind"] for r in client.list_records()] == ["exactness"]
            assert [e["log_index"] for e in client.iter_entries()] == [0, 1, 2]

        # Pull the chain: byte-identical files, accepted by kvgraft-verify, graftable by the engine.
        out_dir = pulled / "child"
        code, out, err = _cli(capsys, "pull", "--registry", server.url, child_kv, "--out", out_dir,
                              "--trusted-keys", made.trust, "--registry-key", registry_pub, "--with-parents")
        assert code == 0, err
        assert out["signature_checked"] is True and out["signers"] == ["alice"] and out["log_index"] == 1
        assert [p["artifact_digest"] for p in out["parents"]] == [root_kv]
        assert _files(out_dir) == _files(made.child)
        assert _files(pulled / "child.parent-1") == _files(made.root)
        _no_staging_left(pulled)
        assert verify_main(["envelope", str(out_dir / "statement.dsse.json"), "--trusted-keys", str(made.trust),
                            "--artifact-dir", str(out_dir)]) == 0
        assert "1 subject file(s) match" in capsys.readouterr().out
        from kvgraft.engine import load_artifact

        # With an empty local index the engine finds the parent only as the pulled sibling.
        monkeypatch.setenv("KVGRAFT_HOME", str(tmp_path / "empty-home"))
        loaded = load_artifact(out_dir, made.model, made.profile, trusted=load_trusted_keys(made.trust))
        assert loaded.parent is not None and loaded.parent.directory == pulled / "child.parent-1"

        # Without trusted keys the output says the signature was not checked.
        code, out, err = _cli(capsys, "pull", "--registry", server.url, root_kv, "--out", pulled / "root-unchecked")
        assert code == 0 and out["signature_checked"] is False, err
        assert "signature NOT checked" in out["summary"]

        with RegistryClient(server.url) as client:
            # Signed by a key the caller does not trust: refused, nothing written.
            bob_trust = TrustedKeys((trusted_key("bob", keys["bob"].private.public_key()),), 1)
            with pytest.raises(EnvelopeSignatureError, match="none of the envelope's 1 signature"):
                pull(client, child_kv, pulled / "untrusted", trusted_keys=bob_trust)
            assert not (pulled / "untrusted").exists()
            # Checkpoints not signed by the pinned key: refused.
            with pytest.raises(EvidenceError, match="does not verify with registry key"):
                pull(client, child_kv, pulled / "wrong-key", registry_key_file=keys["bob"].pub_path)
            assert not (pulled / "wrong-key").exists()
            with pytest.raises(RegistryNotFoundError, match="404"):
                pull(client, "sha256:" + "0" * 64, pulled / "nothing")
            with pytest.raises(LocalFilesError, match="already exists"):
                pull(client, root_kv, out_dir)
            _no_staging_left(pulled)

        # A blob altered inside the server's data directory: the server re-hashes small blobs it
        # serves, so it quarantines this one and answers 404; the pull is refused, nothing appears.
        # (The client's own digest check against bytes altered in transit: tests/reliability/test_tamper.py.)
        blob = data / "blobs" / "sha256" / root_kv.removeprefix("sha256:")
        original = blob.read_bytes()
        blob.chmod(0o600)
        blob.write_bytes(bytes([original[0] ^ 1]) + original[1:])
        code, out, err = _cli(capsys, "pull", "--registry", server.url, root_kv, "--out", pulled / "tampered")
        _one_line_failure(code, out, err, "RegistryNotFoundError", "quarantine")
        with RegistryClient(server.url) as client, pytest.raises(RegistryNotFoundError, match="quarantine"):
            pull(client, child_kv, pulled / "tampered-chain", with_parents=True)
        assert not (pulled / "tampered").exists() and not (pulled / "tampered-chain").exists()
        assert not (pulled / "tampered-chain.parent-1").exists()
        _no_staging_left(pulled)
        blob.write_bytes(original)

    # Restart: everything is still there and the proofs still verify.
    assert leftovers(data) == []
    with running_server(data) as server, RegistryClient(server.url) as client:
        again = pull(client, child_kv, pulled / "after-restart", trusted_keys=load_trusted_keys(made.trust),
                     registry_key_file=data / "registry-key.pub.pem")
        assert (again.log_index, again.tree_size) == (1, 3)
        assert _files(pulled / "after-restart") == _files(made.child)
        code, out, err = _cli(capsys, "pull", "--registry", server.url, root_kv, "--out", pulled / "root-after")
        assert code == 0 and out["tree_size"] == 3 and out["registry_key"]["trust"] == "trust-on-first-use", err


def _blob_digests(client: httpx.Client) -> list[str]:
    digests = []
    for item in client.get("/v1/entries").json()["items"]:
        digests += [s["digest"] for s in item["subjects"]]
    return sorted(set(digests))


def test_mirror_is_byte_identical_and_proved(tmp_path: Path, made: Made, keys: dict[str, Key], capsys: pytest.CaptureFixture[str]) -> None:
    alice = keys["alice"]
    with running_server(tmp_path / "src") as src, running_server(tmp_path / "dst") as dst:
        with RegistryClient(src.url, token=_token(tmp_path / "src", "alice", alice)) as client:
            for directory in (made.child, made.record):
                publish(client, directory)  # the child brings its parent first: 3 entries
        # On the target, the mirror's tokens: bob's own, and one bound to alice's key.
        bob_token = _token(tmp_path / "dst", "bob", keys["bob"])
        mirror_token = _token(tmp_path / "dst", "mirror", alice)

        # A token not bound to the source publisher's key: the first entry is refused, saying why.
        code, out, err = _cli(capsys, "mirror", "--from", src.url, "--to", dst.url, "--token", bob_token)
        _one_line_failure(code, out, err, "RegistryAuthError", "refused source entry 0", "bind a token")
        # Tokens are tried in turn on key-not-bound; the blob the failed run copied is skipped.
        code, out, err = _cli(capsys, "mirror", "--from", src.url, "--to", dst.url, "--token", bob_token,
                              "--token", mirror_token, "--registry-key-from", tmp_path / "src" / "registry-key.pub.pem",
                              "--registry-key-to", tmp_path / "dst" / "registry-key.pub.pem")
        assert code == 0, err
        assert (out["start_size"], out["copied_size"], out["copied_entries"], out["target_size"]) == (0, 3, 3, 3)
        assert out["blobs_skipped"] == 1 and len(out["blobs_copied"]) == 1 + len(list((made.record / "logits").iterdir()))
        assert out["source_root"] == out["target_root_at_copied"] == out["target_root"]
        assert out["source_key"]["trust"] == out["target_key"]["trust"] == "pinned"

        # Byte-identical, compared through the API of each.
        with httpx.Client(base_url=src.url, timeout=30) as s, httpx.Client(base_url=dst.url, timeout=30) as d:
            for i in range(3):
                assert s.get(f"/v1/entries/{i}/envelope").content == d.get(f"/v1/entries/{i}/envelope").content
            assert _blob_digests(s) == _blob_digests(d)
            for digest in _blob_digests(s):
                assert s.get(f"/v1/blobs/{digest}").content == d.get(f"/v1/blobs/{digest}").content
            assert s.get("/v1/log/checkpoint").text.split("\n")[1:3] == d.get("/v1/log/checkpoint").text.split("\n")[1:3]
            assert d.get("/v1/entries/0").json()["entry"]["publisher"] == "mirror"

        # Re-running copies nothing; a new source entry is copied alone.
        code, out, err = _cli(capsys, "mirror", "--from", src.url, "--to", dst.url, "--token", mirror_token)
        assert code == 0 and out["copied_entries"] == 0 and out["blobs_copied"] == [], err
        with RegistryClient(src.url, token=_token(tmp_path / "src", "alice", alice)) as client:
            # Re-signed bytes make a new entry: publish the root's tensors under a second envelope.
            second = tmp_path / "second"
            second.mkdir()
            (second / "kv.safetensors").write_bytes((made.root / "kv.safetensors").read_bytes())
            (second / "statement.dsse.json").write_bytes((made.root / "statement.dsse.json").read_bytes() + b"\n")
            assert publish(client, second).log_index == 3
        with RegistryClient(src.url) as s, RegistryClient(dst.url, token=mirror_token) as d:
            result = mirror(s, d)
            assert (result.start_size, result.copied_entries, result.copied_size, result.target_size) == (3, 1, 4, 4)
            assert result.blobs_copied == () and result.blobs_skipped == 1

            # Something published to the target directly: it still extends the source at 4 ...
            with RegistryClient(dst.url, token=mirror_token) as direct:
                third = tmp_path / "third"
                third.mkdir()
                (third / "kv.safetensors").write_bytes((made.root / "kv.safetensors").read_bytes())
                (third / "statement.dsse.json").write_bytes((made.root / "statement.dsse.json").read_bytes() + b"\n\n")
                assert publish(direct, third).log_index == 4
            result = mirror(s, d)
            assert result.copied_entries == 0 and result.target_size == 5 and result.notes
            # ... but once the source grows too, the two logs differ at 5: not a mirror any more.
            with RegistryClient(src.url, token=_token(tmp_path / "src", "alice", alice)) as client:
                fourth = tmp_path / "fourth"
                fourth.mkdir()
                (fourth / "kv.safetensors").write_bytes((made.root / "kv.safetensors").read_bytes())
                (fourth / "statement.dsse.json").write_bytes((made.root / "statement.dsse.json").read_bytes() + b" ")
                assert publish(client, fourth).log_index == 4
            with pytest.raises(MirrorDivergedError, match="the first 5 entries of"):
                mirror(s, d)
            with pytest.raises(RegistryAuthError, match="401"):
                with RegistryClient(dst.url, token="kvgr_nope") as bad:
                    publish(bad, made.root)


def test_client_imports_stay_light() -> None:
    # `kvgraft` must start without the registry extra: the CLI module imports no httpx, and the
    # client imports neither the server's frameworks nor its modules.
    code = (
        "import sys\n"
        "import kvgraft.cli\n"
        "assert 'httpx' not in sys.modules, 'kvgraft.cli imported httpx'\n"
        "import kvgraft.registry.client\n"
        "bad = [m for m in ('litestar', 'duckdb', 'uvicorn', 'torch', 'kvgraft.registry._internal.service') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": ""})
    assert r.returncode == 0, r.stderr


def test_bad_inputs_fail_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _cli(capsys, "publish", "--registry", "ftp://x", "--token", "t", tmp_path)
    _one_line_failure(code, out, err, "is not a registry URL")
    code, out, err = _cli(capsys, "publish", "--registry", "http://127.0.0.1:9", "--token", "t", tmp_path)
    _one_line_failure(code, out, err, "LocalFilesError", "holds neither statement.dsse.json nor record.dsse.json")
    code, out, err = _cli(capsys, "pull", "--registry", "http://127.0.0.1:9", "sha256:abc", "--out", tmp_path / "x")
    _one_line_failure(code, out, err, "is neither a digest nor a short one")
    code, out, err = _cli(capsys, "pull", "--registry", "http://127.0.0.1:9", "sha256:" + "a" * 64, "--out", tmp_path / "x")
    _one_line_failure(code, out, err, "RegistryUnavailableError")
    assert not (tmp_path / "x").exists()
    # A subject name that would leave the directory is refused before anything is sent.
    evil = tmp_path / "evil"
    evil.mkdir()
    key = make_key(tmp_path, "k")
    statement = json.loads(canonical_model(pre_registration(b"dataset")))
    statement["subject"][0]["name"] = "../outside.jsonl"
    with ephemeral_signing_key(key.private) as signer:
        (evil / "record.dsse.json").write_bytes(envelope_json(sign_envelope(json.dumps(statement).encode(), [signer])))
    with RegistryClient("http://127.0.0.1:9") as client, pytest.raises(LocalFilesError, match="relative path"):
        publish(client, evil, registry_key_file=key.pub_path)


def test_blobs_stream_in_flat_memory(tmp_path: Path, keys: dict[str, Key]) -> None:
    # A 48 MiB subject through publish, mirror and download: the client's own allocations stay
    # a few chunks (1 MiB each), whatever the blob's size.
    import tracemalloc

    alice = keys["alice"]
    record = tmp_path / "record"
    record.mkdir()
    dataset = record / "dataset.jsonl"
    h = hashlib.sha256()
    with dataset.open("wb") as f:
        for i in range(48):
            chunk = hashlib.sha256(str(i).encode()).digest() * 32768
            h.update(chunk)
            f.write(chunk)
    statement = pre_registration(b"")
    statement = statement.model_copy(update={"subject": [statement.subject[0].model_copy(
        update={"digest": statement.subject[0].digest.model_copy(update={"sha256": h.hexdigest()})})]})
    (record / "record.dsse.json").write_bytes(alice.sign(statement))
    digest = "sha256:" + h.hexdigest()
    limit = 16 << 20

    def peak(fn: Any) -> Any:
        tracemalloc.start()
        try:
            result = fn()
            return result, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    with running_server(tmp_path / "src") as src, running_server(tmp_path / "dst") as dst:
        with RegistryClient(src.url, token=_token(tmp_path / "src", "alice", alice)) as s, \
                RegistryClient(dst.url, token=_token(tmp_path / "dst", "alice", alice)) as d:
            published, used = peak(lambda: publish(s, record))
            assert published.uploaded == (digest,) and used < limit, used
            mirrored, used = peak(lambda: mirror(s, d))
            assert mirrored.blobs_copied == (digest,) and mirrored.bytes_copied == 48 << 20 and used < limit, used
            size, used = peak(lambda: d.download_blob(digest, tmp_path / "back"))
            assert size == 48 << 20 and used < limit, used
    assert (tmp_path / "back").read_bytes() == dataset.read_bytes()
