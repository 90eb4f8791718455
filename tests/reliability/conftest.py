"""Reliability fixtures: the scale (bounded in make test, heavy in make reliability) and the figures.

``KVGRAFT_RELIABILITY=heavy`` (set by ``scripts/reliability.py``) raises every count: more
hypothesis examples, more crash rounds, a longer load. Each test adds what it measured to
``figures``; when ``KVGRAFT_RELIABILITY_OUT`` names a file, the figures are written there as
JSON at the end of the session, which is how the runner prints them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

# backend, database and postgres are fixtures: the crash and load suites run on both metadata backends.
from tests.registry.conftest import Key, backend, database, make_key, postgres  # noqa: F401


@dataclass(frozen=True)
class Scale:
    """How hard each reliability test pushes."""

    name: str
    #: hypothesis examples per in-process parser property
    parser_examples: int
    #: hypothesis examples per HTTP property against the real server
    http_examples: int
    crash_rounds: int
    #: artifacts uploaded and published concurrently in each crash round
    crash_writes: int
    load_seconds: float
    load_clients: int


BOUNDED = Scale("bounded", parser_examples=150, http_examples=60, crash_rounds=3, crash_writes=50, load_seconds=10, load_clients=32)
HEAVY = Scale("heavy", parser_examples=2000, http_examples=400, crash_rounds=50, crash_writes=60, load_seconds=60, load_clients=32)


@pytest.fixture(scope="session")
def scale() -> Scale:
    """BOUNDED, or HEAVY when KVGRAFT_RELIABILITY=heavy."""
    return HEAVY if os.environ.get("KVGRAFT_RELIABILITY") == "heavy" else BOUNDED


class Figures:
    """Measured figures, by section; written as JSON when the session ends."""

    def __init__(self) -> None:
        self.data: dict[str, dict[str, Any]] = {}

    def add(self, section: str, **values: Any) -> None:
        """Record ``values`` under ``section`` (later values for the same name replace earlier ones)."""
        self.data.setdefault(section, {}).update(values)

    def count(self, section: str, name: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``name`` of ``section``."""
        sec = self.data.setdefault(section, {})
        sec[name] = int(sec.get(name, 0)) + n


@pytest.fixture(scope="session")
def figures(scale: Scale) -> Iterator[Figures]:
    """The session's figures; written to $KVGRAFT_RELIABILITY_OUT at the end, if set."""
    f = Figures()
    f.add("scale", name=scale.name)
    yield f
    out = os.environ.get("KVGRAFT_RELIABILITY_OUT")
    if out:
        Path(out).write_text(json.dumps(f.data, indent=2, sort_keys=True) + "\n")


@pytest.fixture(scope="session")
def rkeys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Key]:
    """alice and bob (given tokens in the tests) and eve (never registered)."""
    d = tmp_path_factory.mktemp("rkeys")
    return {n: make_key(d, n) for n in ("alice", "bob", "eve")}
