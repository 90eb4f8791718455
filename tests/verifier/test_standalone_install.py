"""The verifier installs and runs alone: a fresh venv with the base install holds no torch,
transformers, litestar or duckdb, and ``kvgraft-verify`` works there on the DSSE and Sigstore vectors."""

from __future__ import annotations

import json
import os
import subprocess
import venv
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgraft.verifier import TrustedKeys, trusted_key

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("torch", "transformers", "litestar", "duckdb")


@pytest.fixture(scope="module")
def verifier_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtual environment holding ``pip install <repo>`` with no extras."""
    root = tmp_path_factory.mktemp("verifier-only")
    venv.EnvBuilder(with_pip=True, clear=True).create(root / "venv")
    py = root / "venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    subprocess.run(
        [str(py), "-m", "pip", "install", "--quiet", str(REPO)],
        check=True, env=env, cwd=root, timeout=900,
    )
    return root / "venv" / "bin"


def _run(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([*args], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_no_heavy_packages_and_import_torch_fails(verifier_env: Path, tmp_path: Path) -> None:
    py = str(verifier_env / "python")
    listed = _run(verifier_env, py, "-m", "pip", "list", "--format=json", cwd=tmp_path)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert "kvgraft" in names
    assert not names & set(FORBIDDEN), names & set(FORBIDDEN)
    for mod in FORBIDDEN:
        probe = _run(verifier_env, py, "-c", f"import {mod}", cwd=tmp_path)
        assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr, (mod, probe.stderr)
    # The verifier's own modules import nothing heavy either.
    check = _run(verifier_env, py, "-c",
                 "import sys, kvgraft.verifier, kvgraft.verifier.cli, kvgraft.schemas;"
                 f"bad = [m for m in {FORBIDDEN!r} if m in sys.modules]; print(bad); sys.exit(bool(bad))",
                 cwd=tmp_path)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.slow
def test_kvgraft_verify_runs_the_dsse_vectors_there(verifier_env: Path, tmp_path: Path, vectors: Path) -> None:
    doc = json.loads((vectors / "dsse" / "vectors.json").read_text())
    keys = {n: Ed25519PrivateKey.from_private_bytes(bytes.fromhex(k["seed"])) for n, k in doc["keys"].items()}
    results = {}
    for vector in doc["vectors"]:
        trust = TrustedKeys(
            tuple(trusted_key(n, keys[n].public_key()) for n in vector["trustedKeys"]),
            vector["threshold"],
            payload_types=tuple(vector["supportedPayloadTypes"]),
        )
        (tmp_path / "keys.json").write_text(json.dumps(trust.to_json()))
        (tmp_path / "env.json").write_text(json.dumps(vector["envelope"]))
        proc = _run(verifier_env, str(verifier_env / "kvgraft-verify"), "envelope", "env.json",
                    "--trusted-keys", "keys.json", "--dsse-only", cwd=tmp_path)
        assert "Traceback" not in proc.stderr
        results[vector["id"]] = "accept" if proc.returncode == 0 else "reject"
    assert results == {v["id"]: v["expect"] for v in doc["vectors"]}


@pytest.mark.slow
def test_kvgraft_verify_checks_a_sigstore_bundle_there(verifier_env: Path, tmp_path: Path, vectors: Path) -> None:
    vectors = vectors / "sigstore"
    base = [str(verifier_env / "kvgraft-verify"), "verify-bundle", "--bundle", str(vectors / "bundle_v3_github.whl.sigstore"),
            "--certificate-identity", "https://github.com/trailofbits/rfc8785.py/.github/workflows/release.yml@refs/tags/v0.1.2",
            "--certificate-oidc-issuer", "https://token.actions.githubusercontent.com"]
    ok = _run(verifier_env, *base, str(vectors / "bundle_v3_github.whl"), cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    (tmp_path / "changed.whl").write_bytes(b"x" + (vectors / "bundle_v3_github.whl").read_bytes()[1:])
    bad = _run(verifier_env, *base, str(tmp_path / "changed.whl"), cwd=tmp_path)
    assert bad.returncode == 1 and len(bad.stderr.splitlines()) == 1 and "Traceback" not in bad.stderr


@pytest.mark.slow
def test_kvgraft_verify_eval_and_audit_run_there(verifier_env: Path, tmp_path: Path) -> None:
    from .test_audit import build_report
    from .test_eval import GSM8K

    report = build_report(tmp_path)
    record = report / "evaluations" / "gsm8k"
    verify = str(verifier_env / "kvgraft-verify")
    ok = _run(verifier_env, verify, "eval", str(record), "--dataset", str(GSM8K), "--trusted-keys",
              str(report / "trusted-keys.json"), cwd=tmp_path)
    assert ok.returncode == 0 and ok.stdout.startswith("OK: evaluation of "), ok.stderr
    from .test_audit import outside_options

    audited = _run(verifier_env, verify, "audit", str(report), *outside_options(report), cwd=tmp_path)
    assert audited.returncode == 0 and "REFUTED" not in audited.stdout, audited.stdout + audited.stderr
    out = record / "outputs.jsonl"
    out.write_bytes(out.read_bytes().replace(b"Working", b"working", 1))
    bad = _run(verifier_env, verify, "eval", str(record), "--dataset", str(GSM8K), "--trusted-keys",
               str(report / "trusted-keys.json"), cwd=tmp_path)
    assert bad.returncode == 1 and len(bad.stderr.splitlines()) == 1 and "outputs.jsonl has digest" in bad.stderr
