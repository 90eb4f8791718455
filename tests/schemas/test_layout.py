"""The torch-free artifact contract: file names, home and local index, binding hashes, unverified
reading, and the one staged-directory and single-file writers (fsync of files, dir and parent)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgraft.schemas import (
    KV_FILE,
    REPORT_FOLDERS,
    STATEMENT_FILE,
    DirectoryExistsError,
    DocumentError,
    Envelope,
    KvArtifactStatement,
    KvgraftError,
    SchemaError,
    Signature,
    StagedDirectory,
    artifact_candidates,
    canonical_json,
    canonical_model,
    chain_key,
    kvgraft_home,
    local_index_path,
    payload_unverified,
    remember_artifact,
    sha256_bytes,
    statement_unverified,
    token_digest,
    write_atomic,
    write_staged_directory,
)

from .fixtures import kv_artifact_statement


def test_file_names_are_the_documented_ones() -> None:
    assert (KV_FILE, STATEMENT_FILE) == ("kv.safetensors", "statement.dsse.json")
    assert REPORT_FOLDERS["https://kvgraft.dev/kv-artifact/v1"] == ("artifacts", STATEMENT_FILE)
    assert {folder for folder, _ in REPORT_FOLDERS.values()} == {
        "artifacts", "exactness", "evaluations", "pre-registrations", "replays"}


def test_the_contract_imports_without_torch() -> None:
    code = "import sys, kvgraft.schemas; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- home and the local index ---------------------------------------------------------------------


def test_kvgraft_home_is_the_variable_or_the_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVGRAFT_HOME", str(tmp_path / "h"))
    assert kvgraft_home() == tmp_path / "h"
    monkeypatch.setenv("KVGRAFT_HOME", "")
    assert kvgraft_home() == Path.home() / ".cache" / "kvgraft"
    monkeypatch.delenv("KVGRAFT_HOME")
    assert kvgraft_home() == Path.home() / ".cache" / "kvgraft"


def test_the_local_index_points_and_siblings_follow(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVGRAFT_HOME", str(tmp_path / "home"))
    digest = sha256_bytes(b"tensors")
    elsewhere = tmp_path / "far" / "parent"
    elsewhere.mkdir(parents=True)
    near = tmp_path / "here" / "child"
    for name in ("b", "a"):
        (near.parent / name).mkdir(parents=True)
    assert artifact_candidates(digest, near) == [near.parent / "a", near.parent / "b"]
    remember_artifact(elsewhere, digest)
    assert local_index_path(digest) == tmp_path / "home" / "index" / digest.removeprefix("sha256:")
    assert local_index_path(digest).read_text() == str(elsewhere.resolve())
    assert artifact_candidates(digest, near) == [elsewhere.resolve(), near.parent / "a", near.parent / "b"]
    # A missing neighbourhood is no candidates, not an error.
    assert artifact_candidates(sha256_bytes(b"other"), tmp_path / "nowhere" / "x") == []


# --- binding hashes ------------------------------------------------------------------------------


def test_token_digest_is_the_sha256_of_canonical_ids() -> None:
    assert token_digest([1, 2, 3]) == "sha256:" + hashlib.sha256(b"[1,2,3]").hexdigest()
    assert token_digest((1, 2, 3)) == token_digest([1, 2, 3])
    assert token_digest([]) == "sha256:" + hashlib.sha256(b"[]").hexdigest()


def test_chain_key_follows_its_documented_formula() -> None:
    p = kv_artifact_statement().predicate
    h = hashlib.sha256()
    h.update(b"\0" * 32)
    h.update(hashlib.sha256(canonical_model(p.model)).digest())
    h.update(bytes.fromhex(p.tokenizer_digest.removeprefix("sha256:")))
    h.update(hashlib.sha256(canonical_model(p.profile)).digest())
    h.update(canonical_json(p.tokens.ids))
    root = chain_key(None, p.model, p.tokenizer_digest, p.profile, p.tokens.ids)
    assert root == "sha256:" + h.hexdigest()
    child = chain_key(root, p.model, p.tokenizer_digest, p.profile, [4])
    assert child != chain_key(None, p.model, p.tokenizer_digest, p.profile, [4])
    assert child != chain_key(sha256_bytes(b"another parent"), p.model, p.tokenizer_digest, p.profile, [4])


# --- reading without verifying ----------------------------------------------------------------------


def _envelope(payload: bytes, *, urlsafe: bool = False) -> Envelope:
    encode = base64.urlsafe_b64encode if urlsafe else base64.b64encode
    return Envelope(payload=encode(payload).decode(), payload_type="application/vnd.in-toto+json",
                    signatures=[Signature(sig="bm90IGEgc2lnbmF0dXJl")])


def test_statement_unverified_reads_bytes_and_envelopes_without_any_signature_check() -> None:
    statement = kv_artifact_statement()
    env = _envelope(canonical_model(statement))
    raw = env.model_dump_json(by_alias=True).encode()
    for source in (env, raw, _envelope(canonical_model(statement), urlsafe=True)):
        got = statement_unverified(source)
        assert isinstance(got, KvArtifactStatement) and got == statement
    assert payload_unverified(raw) == canonical_model(statement)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"not json", "is not valid JSON"),
        (b"[1]", "is not a DSSE envelope"),
        (b'{"payloadType": "x"}', "is not a DSSE envelope"),
        (b'{"payload": 3}', "must be a base64 string"),
        (b'{"payload": "!!"}', "is not valid base64"),
        (b'{"payload": "ab+_"}', "mixes the standard and URL-safe"),
        (json.dumps({"payload": base64.b64encode(b'{"a": 1}').decode()}).encode(), "statement in stored"),
    ],
)
def test_statement_unverified_refuses_what_is_not_a_statement(raw: bytes, message: str) -> None:
    with pytest.raises(DocumentError, match=message) as e:
        statement_unverified(raw, what="stored")
    assert isinstance(e.value, SchemaError) and isinstance(e.value, KvgraftError)


# --- writers ------------------------------------------------------------------------------------------


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Path]]:
    """Every path fsynced while the test runs (resolved through /proc/self/fd)."""
    seen: list[Path] = []
    real = os.fsync

    def spy(fd: int) -> None:
        seen.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    yield seen


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name fsynced descriptors")
def test_staged_directory_fsyncs_every_file_the_directory_and_the_parent(tmp_path: Path, fsynced: list[Path]) -> None:
    out = tmp_path / "parent" / "art"
    assert write_staged_directory(out, {KV_FILE: b"kv", "logits/ab.f32": b"\0" * 8, STATEMENT_FILE: b"{}"}) == out
    assert (out / KV_FILE).read_bytes() == b"kv" and (out / "logits" / "ab.f32").read_bytes() == b"\0" * 8
    # Files are fsynced where they were written (the staged directory), then it and the parent.
    names = [p.name for p in fsynced]
    assert {KV_FILE, "ab.f32", STATEMENT_FILE, "logits"} <= set(names)
    assert fsynced[-1] == out.parent
    staged = {p for p in fsynced if p.name.startswith(".art.tmp-")}
    assert len(staged) == 1
    assert sorted(p.name for p in out.parent.iterdir()) == ["art"]


def test_staged_directory_refuses_an_existing_target_and_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "art"
    out.mkdir()
    with pytest.raises(DirectoryExistsError, match="already exists"):
        write_staged_directory(out, {KV_FILE: b"kv"})
    (out / "x").write_bytes(b"")
    with pytest.raises(DirectoryExistsError, match="not an empty directory"):
        write_staged_directory(out, {KV_FILE: b"kv"}, replace_empty=True)
    (out / "x").unlink()
    write_staged_directory(out, {KV_FILE: b"kv"}, replace_empty=True)
    assert [p.name for p in out.iterdir()] == [KV_FILE]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_staged_directory_cleans_up_on_failure_and_on_a_late_rival(tmp_path: Path) -> None:
    out = tmp_path / "rec"
    with pytest.raises(RuntimeError), StagedDirectory(out) as stage:
        stage.write("record.dsse.json", b"{}")
        raise RuntimeError("signing failed")
    assert list(tmp_path.iterdir()) == []
    stage = StagedDirectory(out)
    stage.write("a", b"1")
    (out / "other").mkdir(parents=True)  # someone else wrote the target meanwhile
    with pytest.raises(DirectoryExistsError):
        stage.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rec"] and (out / "other").is_dir()


@pytest.mark.parametrize("name", ["", "/abs", "../up", "a/../b", "a//b", "./a"])
def test_staged_directory_writes_only_plain_relative_names(tmp_path: Path, name: str) -> None:
    with pytest.raises(DocumentError, match="plain relative"), StagedDirectory(tmp_path / "d") as stage:
        stage.write(name, b"x")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc to name fsynced descriptors")
def test_write_atomic_replaces_with_its_mode_and_fsyncs_the_directory(tmp_path: Path, fsynced: list[Path]) -> None:
    path = tmp_path / "sub" / "signed-head.json"
    write_atomic(path, b"old", 0o600)
    write_atomic(path, b"new", 0o644)
    assert path.read_bytes() == b"new" and path.stat().st_mode & 0o777 == 0o644
    assert fsynced[-1] == path.parent
    assert [p.name for p in path.parent.iterdir()] == ["signed-head.json"]
