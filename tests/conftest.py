"""Shared fixtures: where ../shared lives, and small helpers every package's tests use."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def shared() -> Path:
    """The ``shared/`` folder beside the repository (vectors and data, for tests only)."""
    if not (SHARED / "vectors").is_dir():
        raise RuntimeError(f"{SHARED} is missing: tests read vectors from ../shared beside the repository")
    return SHARED
