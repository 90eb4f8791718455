"""Shared fixtures: where the test vectors live, and small helpers every package's tests use."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: The DSSE and Sigstore vectors, copied into the repository (tests/vectors/README.md: sources, licences).
VECTORS = REPO / "tests" / "vectors"


@pytest.fixture(scope="session")
def vectors() -> Path:
    """``tests/vectors/``: ``dsse/`` and ``sigstore/`` (for tests only)."""
    if not (VECTORS / "dsse" / "vectors.json").is_file():
        raise RuntimeError(f"{VECTORS} is incomplete: the test vectors are part of the repository")
    return VECTORS
