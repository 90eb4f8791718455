"""Red-team regressions for the client, the CLI and the engine's local files (issue 14 follow-up).

Each test is named after a bug found by playing a hostile user (files under ``$KVGRAFT_HOME``
and in a library) or a lying registry (an entry whose statement names more than the tensors).
Every case must end in one ``KvgraftError``-style refusal, in bounded memory, writing nothing.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvgraft.engine import MAX_INDEX_LINE_BYTES, LibraryError, read_index, read_meta
from kvgraft.registry.client import EvidenceError
from kvgraft.registry.client.store import find_local_artifact
from kvgraft.schemas import StagedDirectory, artifact_candidates
from kvgraft.verifier import SigningKey, envelope_json, generate_private_key, sign_statement
from tests.registry.conftest import artifact, subject

DIGEST = "sha256:" + "ab" * 32

ENTRY: dict[str, Any] = {
    "answer": "72", "artifact": DIGEST, "dataset": "train.jsonl", "directory": "entries/1cfeb3aa3aa8986d",
    "doc_index": 0, "problem": "How many?", "problem_hash": "1cfeb3aa3aa8986d" + "0" * 48, "tokens": 3,
}


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVGRAFT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


# --- the local index pointer -------------------------------------------------------------------------


@pytest.mark.parametrize("pointer", [b"\xff\xfe not utf-8", b"/tmp/a\0b", b"/x" * (64 << 10)])
def test_non_utf8_or_nul_or_huge_local_index_pointer_is_skipped_not_a_traceback(
    home: Path, tmp_path: Path, pointer: bytes
) -> None:
    # Was: UnicodeDecodeError (a traceback from graft, capture --parent and publish) for a
    # pointer that is not UTF-8, and a whole-file read of any size.
    (home / "index").mkdir(parents=True)
    (home / "index" / ("ab" * 32)).write_bytes(pointer)
    (tmp_path / "work" / "child").mkdir(parents=True)
    (tmp_path / "work" / "sibling").mkdir()
    near = tmp_path / "work" / "child"
    assert artifact_candidates(DIGEST, near) == [tmp_path / "work" / "child", tmp_path / "work" / "sibling"]
    assert find_local_artifact(DIGEST, near) is None


# --- the library's files -----------------------------------------------------------------------------


def _index(lib: Path, *lines: bytes) -> None:
    lib.mkdir(exist_ok=True)
    (lib / "index.jsonl").write_bytes(b"".join(lines))


@pytest.mark.parametrize(
    "field,value", [("problem_hash", 5), ("problem", ["a"]), ("tokens", "x"), ("tokens", True), ("directory", None)]
)
def test_library_index_entry_with_a_field_of_the_wrong_type_is_a_library_error_not_a_traceback(
    tmp_path: Path, field: str, value: object
) -> None:
    # Was: TypeError / AttributeError tracebacks from ask and eval (entry.problem_hash[:16], .lower()).
    _index(tmp_path / "lib", json.dumps({**ENTRY, field: value}).encode() + b"\n")
    with pytest.raises(LibraryError, match=f"line 1 is not a library entry: {field} of the wrong type"):
        list(read_index(tmp_path / "lib"))


def test_u2028_regression_an_entry_whose_problem_holds_a_line_separator_is_one_entry(tmp_path: Path) -> None:
    # The bug: the widening script read the index with str.splitlines, which split a line at a
    # raw U+2028 inside a problem's text, and the 87x run died on half a JSON object. The
    # script now reads it with read_index, which splits at "\n" only.
    rows = [{**ENTRY, "problem": "Carter\u2028drives 14 hours.", "doc_index": 2630},
            {**ENTRY, "problem": "Next\x85one", "doc_index": 2631}]
    # A deposit cut off mid-line leaves a last line without its newline: it does not count.
    _index(tmp_path / "lib", *(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows), b'{"problem": "cut')
    entries = list(read_index(tmp_path / "lib"))
    assert [e.to_json() for e in entries] == rows


def test_library_index_line_of_a_gigabyte_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    # Was: the whole line read into memory (a 1 GiB line: a MemoryError traceback under a limit).
    lib = tmp_path / "lib"
    _index(lib, json.dumps(ENTRY).encode() + b"\n")
    with (lib / "index.jsonl").open("ab") as f:
        f.truncate(1 << 30)  # sparse: a 1 GiB second line of NULs, no newline
    with pytest.raises(LibraryError, match="line 2 is longer than"):
        list(read_index(lib))
    (lib / "index.jsonl").write_bytes(b'{"a": "' + b"x" * MAX_INDEX_LINE_BYTES + b'"}\n')
    with pytest.raises(LibraryError, match="line 1 is longer than"):
        list(read_index(lib))


def test_library_json_of_a_gigabyte_is_refused_without_reading_it_whole(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    with (lib / "library.json").open("wb") as f:
        f.truncate(1 << 30)
    with pytest.raises(LibraryError, match="library.json is longer than"):
        read_meta(lib)


# --- a lying registry: a statement about more than the tensors -----------------------------------------


def test_pull_refuses_a_statement_naming_more_than_kv_safetensors_before_fetching_a_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Was: every subject of a logged statement was downloaded (up to a 64 MiB envelope's worth:
    # hundreds of thousands of blobs and files) although the engine loads only kv.safetensors.
    a = artifact("knowledge")
    many = [*a.statement.subject, *(subject(f"extra/{i}.bin", str(i).encode()) for i in range(1000))]
    statement = a.statement.model_copy(update={"subject": many})
    envelope = envelope_json(sign_statement(statement, [SigningKey(generate_private_key())]))
    pull_module = importlib.import_module("kvgraft.registry.client.pull")
    monkeypatch.setattr(pull_module, "verify_entry_evidence", lambda *a, **k: (0, SimpleNamespace(size=1)))
    fetched: list[str] = []
    client = SimpleNamespace(
        url="http://127.0.0.1:1",
        artifact=lambda d: SimpleNamespace(entry=SimpleNamespace(digest=DIGEST), inclusion_proof=None, checkpoint=None),
        envelope=lambda d: envelope,
        download_blob=lambda d, path, **k: fetched.append(d) or 0,
    )
    staged = StagedDirectory(tmp_path / "out", tag="pull")
    try:
        with pytest.raises(EvidenceError, match="names 1001 subjects"):
            pull_module._stage(client, a.digest, staged, None, None, False)
    finally:
        staged.discard()
    assert fetched == [] and not (tmp_path / "out").exists()
