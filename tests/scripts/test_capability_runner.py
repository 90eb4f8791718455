"""scripts/capability_v2.py's journal rule: a journal another profile began is set aside, never
mixed in; one this profile began is resumed from."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def runner() -> ModuleType:
    sys.path.insert(0, str(SCRIPTS))
    try:
        spec = importlib.util.spec_from_file_location("capability_v2", SCRIPTS / "capability_v2.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(SCRIPTS))
    return module


def _journal(path: Path, profile: dict[str, object]) -> None:
    header = {"format": "kvgraft-eval-journal/v1", "run": {"profile": profile, "doc_ids": [1]}}
    path.write_text(json.dumps(header) + "\n" + json.dumps({"doc_id": 1}) + "\n")


def test_a_journal_begun_on_another_machine_is_set_aside_not_refused(runner: ModuleType, tmp_path: Path) -> None:
    from kvgraft.engine import current_profile

    here = current_profile("cpu-fp32-sdpa")
    elsewhere = {**here.model_dump(mode="json"), "device_fingerprint": "another CPU"}
    journal = tmp_path / "base.journal.jsonl"
    _journal(journal, elsewhere)
    body = journal.read_bytes()
    runner.set_aside_foreign(journal, here)
    assert not journal.exists()
    (aside,) = tmp_path.glob("base.*.set-aside.jsonl")
    assert aside.read_bytes() == body  # kept whole


def test_a_journal_begun_here_stays_to_resume_from(runner: ModuleType, tmp_path: Path) -> None:
    from kvgraft.engine import current_profile

    here = current_profile("cpu-fp32-sdpa")
    journal = tmp_path / "samples.journal.jsonl"
    _journal(journal, here.model_dump(mode="json"))
    runner.set_aside_foreign(journal, here)
    assert journal.exists()
    assert list(tmp_path.glob("*.set-aside.jsonl")) == []
    runner.set_aside_foreign(tmp_path / "none.journal.jsonl", here)  # no journal: nothing to do
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples.journal.jsonl"]
