"""``kvgraft-verify verify-bundle``: the sigstore-conformance command line, on every
EXPECTATIONS.md row and its mutations, exit 0 or exit 1 with one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvgraft.verifier.cli import main

from .bundle_helpers import ACCEPT, Vector, sigstore_vectors

REJECT_AT_LOAD = [
    "bundle_v3_no_signed_time.txt",
    "bundle_invalid_version.txt",
    "bundle_no_cert_v1.txt",
    "bundle_no_log_entry.txt",
    "bundle_no_checkpoint.txt",
]


@pytest.fixture(scope="module")
def vectors() -> Path:
    """tests/vectors/sigstore, as in test_bundles_vectors.py."""
    return sigstore_vectors()


def _argv(vectors: Path, v: Vector, artifact: str | None = None, *, identity: str | None = None, root: str | None = None) -> list[str]:
    argv = ["verify-bundle", "--bundle", str(vectors / v.bundle),
            "--certificate-identity", identity or v.identity, "--certificate-oidc-issuer", v.issuer]
    if root is not None:
        argv += ["--trusted-root", root]
    elif v.staging:
        argv.append("--staging")
    art = artifact or (v.artifact if v.artifact.startswith("sha256:") else str(vectors / v.artifact))
    return [*argv, art]


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str], error: str) -> None:
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(f"kvgraft-verify: {error}"), err


@pytest.mark.parametrize("v", ACCEPT, ids=lambda v: v.bundle)
def test_accepting_rows(vectors: Path, capsys: pytest.CaptureFixture[str], v: Vector) -> None:
    assert main(_argv(vectors, v)) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("OK: ")


@pytest.mark.parametrize("v", ACCEPT, ids=lambda v: v.bundle)
def test_mutations_through_the_command_line(vectors: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], v: Vector) -> None:
    if not v.artifact.startswith("sha256:"):
        changed = tmp_path / "artifact"
        data = bytearray((vectors / v.artifact).read_bytes())
        data[len(data) // 2] ^= 0x01
        changed.write_bytes(bytes(data))
        _refused(capsys, _argv(vectors, v, str(changed)), "DigestMismatchError")
    else:
        _refused(capsys, _argv(vectors, v, "sha256:" + "0" * 64), "DigestMismatchError")
    _refused(capsys, _argv(vectors, v, identity="someone@example.com"), "IdentityMismatchError")
    other = "trusted_root.sigstore.dev.json" if v.staging else "trusted_root.sigstage.dev.json"
    _refused(capsys, _argv(vectors, v, root=str(vectors / other)), "UntrustedRootError")


def test_cve_2022_36056_is_refused(vectors: Path, capsys: pytest.CaptureFixture[str]) -> None:
    v = Vector("bundle_cve_2022_36056.txt", "bundle_cve_2022_36056.txt.sigstore", True, "william@yossarian.net", "https://github.com/login/oauth")
    _refused(capsys, _argv(vectors, v), "LogEntryError")


@pytest.mark.parametrize("artifact", REJECT_AT_LOAD)
def test_reject_at_load(vectors: Path, capsys: pytest.CaptureFixture[str], artifact: str) -> None:
    bundle = next(p.name for p in vectors.iterdir() if p.name.startswith(artifact + ".sigstore"))
    v = Vector(artifact, bundle, True, "a@tny.town", "https://github.com/login/oauth")
    _refused(capsys, _argv(vectors, v), "MalformedInputError")


def test_digest_argument_and_a_file_named_like_a_digest(vectors: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    v = ACCEPT[0]
    import hashlib

    digest = "sha256:" + hashlib.sha256((vectors / v.artifact).read_bytes()).hexdigest()
    assert main(_argv(vectors, v, digest)) == 0
    capsys.readouterr()
    # A malformed "sha256:..." that names an existing file is that file (conformance protocol).
    monkeypatch.chdir(tmp_path)
    shutil.copy(vectors / v.artifact, tmp_path / "sha256:not-a-digest")
    assert main(_argv(vectors, v, "sha256:not-a-digest")) == 0


def test_key_and_identity_together_are_refused(vectors: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    v = ACCEPT[0]
    (tmp_path / "k.pem").write_text("-----BEGIN PUBLIC KEY-----\n-----END PUBLIC KEY-----\n")
    argv = _argv(vectors, v)
    _refused(capsys, [*argv[:-1], "--key", str(tmp_path / "k.pem"), argv[-1]], "MalformedInputError: verify-bundle got both --key")


@pytest.mark.parametrize("damage", ["not json", "", "{\"mediaType\": 3}"])
def test_malformed_bundles(vectors: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str) -> None:
    (tmp_path / "b.json").write_text(damage)
    v = ACCEPT[0]
    argv = _argv(vectors, v)
    argv[2] = str(tmp_path / "b.json")
    _refused(capsys, argv, "MalformedInputError")
    argv[2] = str(tmp_path)
    _refused(capsys, argv, "MalformedInputError")
