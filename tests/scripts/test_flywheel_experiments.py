"""The flywheel experiments script's own reading of a library's index."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def _script() -> object:
    sys.path.insert(0, str(SCRIPTS))  # its sibling modules (experiment_stats, experiment_keys)
    try:
        spec = importlib.util.spec_from_file_location("flywheel_experiments", SCRIPTS / "flywheel_experiments.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(SCRIPTS))


def test_u2028_regression_an_entry_whose_problem_holds_a_line_separator_is_one_entry(tmp_path: Path) -> None:
    # The bug: str.splitlines split an index line at a raw U+2028 inside a problem's text, and
    # the 87x widening run died on half a JSON object.
    rows = [{"problem": "Carter\u2028drives 14 hours.", "tokens": 262, "doc_index": 2630},
            {"problem": "Next\x85one", "tokens": 148, "doc_index": 2631}]
    lines = [json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows]
    # A deposit cut off mid-line leaves a last line without its newline: it does not count.
    (tmp_path / "index.jsonl").write_bytes(b"".join(lines) + b'{"problem": "cut')
    entries = _script().index_entries(tmp_path)  # type: ignore[attr-defined]
    assert entries == rows
