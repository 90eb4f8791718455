"""``kvgraft-verify envelope --artifact-dir [--parent-dir]`` recomputes a KV artifact's token digest
and chain key offline (no engine, no torch), and names the mismatch with its own error class."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgraft.schemas import (
    KV_FILE,
    STATEMENT_FILE,
    KvArtifactStatement,
    PositionRange,
    Sha256Digest,
    Subject,
    SubjectDigest,
    TokenSpan,
    chain_key,
    hex_of,
    sha256_bytes,
    token_digest,
    write_staged_directory,
)
from kvgraft.verifier import (
    ChainKeyMismatchError,
    DigestMismatchError,
    TokenDigestMismatchError,
    TrustedKeys,
    envelope_json,
    ephemeral_signing_key,
    sign_statement,
    trusted_key,
    verify_artifact_lineage,
)
from kvgraft.verifier.cli import ExitCode

from ..schemas.fixtures import kv_artifact_statement
from .test_cli import _one_line_failure as _refused
from .test_cli import _run

_KEY = Ed25519PrivateKey.generate()


@dataclass(frozen=True)
class Artifact:
    directory: Path
    statement: KvArtifactStatement

    @property
    def envelope(self) -> Path:
        return self.directory / STATEMENT_FILE


def _statement(ids: list[int], start: int, parent: KvArtifactStatement | None, tensors: bytes) -> KvArtifactStatement:
    base = kv_artifact_statement()
    p = base.predicate
    parent_key = parent.predicate.chain_key if parent else None
    parent_digest = Sha256Digest("sha256:" + parent.subject[0].digest.sha256) if parent else None
    predicate = p.model_copy(update={
        "parent": parent_digest,
        "chain_key": chain_key(parent_key, p.model, p.tokenizer_digest, p.profile, ids),
        "tokens": TokenSpan(ids=ids, digest=token_digest(ids)),
        "positions": PositionRange(start=start, end=start + len(ids)),
    })
    subject = [Subject(name=KV_FILE, digest=SubjectDigest(sha256=hex_of(sha256_bytes(tensors))))]
    return base.model_copy(update={"subject": subject, "predicate": predicate})


def _signed(statement: KvArtifactStatement, key: Ed25519PrivateKey = _KEY) -> bytes:
    with ephemeral_signing_key(key) as signer:
        return envelope_json(sign_statement(statement, [signer]))


def _write(directory: Path, statement: KvArtifactStatement, tensors: bytes, key: Ed25519PrivateKey = _KEY) -> Artifact:
    write_staged_directory(directory, {KV_FILE: tensors, STATEMENT_FILE: _signed(statement, key)})
    return Artifact(directory, statement)


@pytest.fixture
def chain(tmp_path: Path) -> tuple[Artifact, Artifact, Path]:
    """A root over [0, 3) and its child over [3, 5), signed by the trusted key; the trusted-keys file."""
    root = _write(tmp_path / "root", _statement([1, 2, 3], 0, None, b"root"), b"root")
    child = _write(tmp_path / "child", _statement([4, 5], 3, root.statement, b"child"), b"child")
    trust = tmp_path / "trust.json"
    trust.write_text(json.dumps(TrustedKeys((trusted_key("alice", _KEY.public_key()),)).to_json()))
    return root, child, trust


def test_a_root_is_checked_without_its_parent(chain: tuple[Artifact, Artifact, Path], capsys: pytest.CaptureFixture[str]) -> None:
    root, _, trust = chain
    code, out, err = _run(capsys, "envelope", root.envelope, "--trusted-keys", trust, "--artifact-dir", root.directory)
    assert code == ExitCode.OK, err
    assert "token digest matches; chain key matches (root)" in out
    code, out, err = _run(capsys, "--json", "envelope", root.envelope, "--trusted-keys", trust,
                          "--artifact-dir", root.directory)
    doc = json.loads(out)
    assert (doc["token_digest"], doc["chain_key"]) == ("matches", "root")


def test_a_child_is_checked_against_its_parent_dir(chain: tuple[Artifact, Artifact, Path], capsys: pytest.CaptureFixture[str]) -> None:
    root, child, trust = chain
    code, out, err = _run(capsys, "envelope", child.envelope, "--trusted-keys", trust, "--artifact-dir", child.directory)
    assert code == ExitCode.OK, err
    assert "token digest matches; chain key not checked (pass --parent-dir" in out
    code, out, err = _run(capsys, "envelope", child.envelope, "--trusted-keys", trust, "--artifact-dir", child.directory,
                          "--parent-dir", root.directory)
    assert code == ExitCode.OK, err
    assert f"chain key matches its parent sha256:{root.statement.subject[0].digest.sha256}" in out


def _resign(a: Artifact, change: Callable[[KvArtifactStatement], KvArtifactStatement], tensors: bytes) -> Artifact:
    """Re-sign ``a`` with the trusted key after ``change``: a signer who made a wrong statement."""
    statement = change(a.statement)
    a.envelope.write_bytes(_signed(statement))
    (a.directory / KV_FILE).write_bytes(tensors)
    return Artifact(a.directory, statement)


def test_a_signed_but_wrong_token_digest_is_refused(chain: tuple[Artifact, Artifact, Path], capsys: pytest.CaptureFixture[str]) -> None:
    root, _, trust = chain

    def wrong(s: KvArtifactStatement) -> KvArtifactStatement:
        tokens = TokenSpan(ids=s.predicate.tokens.ids, digest=token_digest([9, 9, 9]))
        return s.model_copy(update={"predicate": s.predicate.model_copy(update={"tokens": tokens})})

    _resign(root, wrong, b"root")
    code, _, err = _run(capsys, "envelope", root.envelope, "--trusted-keys", trust, "--artifact-dir", root.directory)
    _refused(code, err, "TokenDigestMismatchError", "3 token ids hash to")


def test_a_signed_but_wrong_chain_key_is_refused(chain: tuple[Artifact, Artifact, Path], capsys: pytest.CaptureFixture[str]) -> None:
    root, child, trust = chain

    def wrong(s: KvArtifactStatement) -> KvArtifactStatement:
        return s.model_copy(update={"predicate": s.predicate.model_copy(update={"chain_key": sha256_bytes(b"x")})})

    _resign(child, wrong, b"child")
    code, _, err = _run(capsys, "envelope", child.envelope, "--trusted-keys", trust, "--artifact-dir", child.directory)
    assert code == ExitCode.OK, err  # without its parent a child's chain key cannot be recomputed
    code, _, err = _run(capsys, "envelope", child.envelope, "--trusted-keys", trust, "--artifact-dir", child.directory,
                        "--parent-dir", root.directory)
    _refused(code, err, "ChainKeyMismatchError", "recomputed from its parent")
    _resign(root, wrong, b"root")
    code, _, err = _run(capsys, "envelope", root.envelope, "--trusted-keys", trust, "--artifact-dir", root.directory)
    _refused(code, err, "ChainKeyMismatchError", "recomputed from the root")
    # A parent whose own chain key is wrong is refused as the parent, before the child is compared.
    code, _, err = _run(capsys, "envelope", child.envelope, "--trusted-keys", trust, "--artifact-dir", child.directory,
                        "--parent-dir", root.directory)
    _refused(code, err, "ChainKeyMismatchError", f"the parent artifact {root.directory}: the chain key")


def test_the_parent_dir_must_be_the_named_parent(chain: tuple[Artifact, Artifact, Path], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _, child, trust = chain
    other = _write(tmp_path / "other", _statement([7, 8, 9], 0, None, b"other"), b"other")
    code, _, err = _run(capsys, "envelope", child.envelope, "--trusted-keys", trust, "--artifact-dir", child.directory,
                        "--parent-dir", other.directory)
    _refused(code, err, "ChainKeyMismatchError", "the parent given is about kv.safetensors")
    code, _, err = _run(capsys, "envelope", other.envelope, "--trusted-keys", trust, "--artifact-dir", other.directory,
                        "--parent-dir", child.directory)
    _refused(code, err, "ChainKeyMismatchError", "is a root (no parent)")


def test_the_parent_must_be_signed_and_whole(chain: tuple[Artifact, Artifact, Path], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    root, child, trust = chain
    (root.directory / KV_FILE).write_bytes(b"altered")
    code, _, err = _run(capsys, "envelope", child.envelope, "--trusted-keys", trust, "--artifact-dir", child.directory,
                        "--parent-dir", root.directory)
    _refused(code, err, "SubjectMismatchError", "kv.safetensors has digest")
    forged = _write(tmp_path / "forged", root.statement, b"root", key=Ed25519PrivateKey.generate())
    code, _, err = _run(capsys, "envelope", child.envelope, "--trusted-keys", trust, "--artifact-dir", child.directory,
                        "--parent-dir", forged.directory)
    _refused(code, err, "UnknownKeyError", "")


def test_parent_dir_needs_an_artifact_dir(chain: tuple[Artifact, Artifact, Path], capsys: pytest.CaptureFixture[str]) -> None:
    root, child, trust = chain
    code, _, err = _run(capsys, "envelope", child.envelope, "--trusted-keys", trust, "--parent-dir", root.directory)
    _refused(code, err, "MalformedInputError", "needs --artifact-dir")


def test_lineage_errors_are_digest_mismatches(chain: tuple[Artifact, Artifact, Path]) -> None:
    root, child, _ = chain
    assert issubclass(TokenDigestMismatchError, DigestMismatchError)
    assert issubclass(ChainKeyMismatchError, DigestMismatchError)
    assert verify_artifact_lineage(child.statement, root.statement).chain_key == "parent"
    assert verify_artifact_lineage(root.statement).chain_key == "root"
    moved = child.statement.model_copy(update={"predicate": child.statement.predicate.model_copy(
        update={"positions": PositionRange(start=4, end=6)})})
    with pytest.raises(ChainKeyMismatchError, match="starts at position 4, but its parent ends at 3"):
        verify_artifact_lineage(moved, root.statement)
