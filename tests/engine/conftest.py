"""Engine fixtures: a persistent model cache for the session, the tiny model, a signing key."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: Converted models are cached here across test runs (keyed by GGUF sha256, so never stale).
TEST_HOME = REPO / ".pytest-kvgraft-home"


@pytest.fixture(scope="session", autouse=True)
def kvgraft_home() -> Iterator[Path]:
    """Point $KVGRAFT_HOME at the repository's test cache for the whole session."""
    old = os.environ.get("KVGRAFT_HOME")
    os.environ["KVGRAFT_HOME"] = str(TEST_HOME)
    TEST_HOME.mkdir(exist_ok=True)
    yield TEST_HOME
    if old is None:
        os.environ.pop("KVGRAFT_HOME", None)
    else:
        os.environ["KVGRAFT_HOME"] = old


@pytest.fixture(scope="session")
def tiny():  # type: ignore[no-untyped-def]
    """The seeded 2-layer Llama."""
    from kvgraft.engine import load_model

    return load_model("tiny-llama-test")


@pytest.fixture(scope="session")
def profile():  # type: ignore[no-untyped-def]
    """The default profile on this machine."""
    from kvgraft.engine import current_profile

    return current_profile()


@pytest.fixture(scope="session")
def key(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh Ed25519 private key file."""
    from kvgraft.verifier import generate_private_key, save_private_key, save_public_key

    path = tmp_path_factory.mktemp("keys") / "k.pem"
    k = generate_private_key()
    save_private_key(k, path)
    save_public_key(k.public_key(), path.with_name("k.pem.pub"))
    return path
