"""Running the real OpenSSF model signing tool (``model_signing`` 1.1.1, PyPI ``model-signing``, in
the ``dev`` extra) from tests, and making ECDSA key files for it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from kvgraft.verifier import KeyType, generate_private_key, save_private_key, save_public_key

#: model_signing hashes a few small files in well under a second; a hung run fails instead.
_TIMEOUT_S = 120


def model_signing(*args: object) -> subprocess.CompletedProcess[str]:
    """``python -m model_signing ARGS`` (argv list: no shell), its output captured."""
    if importlib.util.find_spec("model_signing") is None:
        pytest.fail("model_signing is not installed: pip install -e '.[dev]' (it pins model-signing==1.1.1)")
    return subprocess.run(
        [sys.executable, "-m", "model_signing", *map(str, args)],
        capture_output=True, text=True, timeout=_TIMEOUT_S, check=False,
    )


def ms_verify(directory: Path, public_key: Path, signature: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``model_signing verify key DIR --signature SIG --public_key PUB`` (SIG defaults to DIR/model.sig)."""
    sig = directory / "model.sig" if signature is None else signature
    return model_signing("verify", "key", directory, "--signature", sig, "--public_key", public_key)


def ms_accepts(directory: Path, public_key: Path, signature: Path | None = None) -> None:
    """The real ``model_signing verify key`` accepts: exit 0 and its success line."""
    r = ms_verify(directory, public_key, signature)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "Verification succeeded", r.stdout


def ms_refuses(directory: Path, public_key: Path, says: str, signature: Path | None = None) -> None:
    """The real ``model_signing verify key`` refuses: exit 1, its failure line, and ``says`` in it
    (model_signing prints a Python list of messages: repr may escape the quotes around a name)."""
    r = ms_verify(directory, public_key, signature)
    assert r.returncode == 1, r.stdout
    assert "Verification failed with error: " in r.stderr and "Verification succeeded" not in r.stdout, r.stderr
    assert says in r.stderr.replace("\\'", "'"), r.stderr


def ms_sign(directory: Path, private_key: Path, *extra: object) -> None:
    """``model_signing sign key DIR --private_key KEY --signature DIR/model.sig [EXTRA]``; must succeed."""
    r = model_signing("sign", "key", directory, "--private_key", private_key, "--signature", directory / "model.sig", *extra)
    assert r.returncode == 0, r.stderr
    assert "Signing succeeded" in r.stdout


def key_files(directory: Path, key_type: KeyType) -> tuple[Path, Path]:
    """A fresh private key of ``key_type`` (PEM, unencrypted) and its public key beside it."""
    private = directory / f"{key_type}.pem"
    key = generate_private_key(key_type)
    save_private_key(key, private)
    save_public_key(key.public_key(), private.with_name(private.name + ".pub"))
    return private, private.with_name(private.name + ".pub")
