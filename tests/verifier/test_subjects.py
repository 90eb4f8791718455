"""in-toto subjects on disk: exact match, no missing, no extra, digests equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvgraft.schemas import Statement, Subject, SubjectDigest, hex_of, sha256_bytes
from kvgraft.verifier import MalformedInputError, SubjectMismatchError, verify_subjects


def _statement(files: dict[str, bytes]) -> Statement:
    return Statement(
        subject=[Subject(name=n, digest=SubjectDigest(sha256=hex_of(sha256_bytes(b)))) for n, b in files.items()],
        predicate_type="https://example.com/t/v1",
        predicate={},
    )


@pytest.fixture
def artifact(tmp_path: Path) -> tuple[Path, Statement]:
    files = {"kv.safetensors": b"\x00" * 100, "sub/notes.txt": b"hello"}
    for name, data in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    (tmp_path / "statement.dsse.json").write_text("{}")
    return tmp_path, _statement(files)


def test_exact_match(artifact: tuple[Path, Statement]) -> None:
    d, st = artifact
    assert verify_subjects(st, d, exclude=[d / "statement.dsse.json"]) == ["kv.safetensors", "sub/notes.txt"]


def test_envelope_not_excluded_is_extra(artifact: tuple[Path, Statement]) -> None:
    d, st = artifact
    with pytest.raises(SubjectMismatchError, match="holds file.s. statement.dsse.json that the statement does not name"):
        verify_subjects(st, d)


def test_missing(artifact: tuple[Path, Statement]) -> None:
    d, st = artifact
    (d / "sub" / "notes.txt").unlink()
    with pytest.raises(SubjectMismatchError, match="lacks subject.s. sub/notes.txt"):
        verify_subjects(st, d, exclude=[d / "statement.dsse.json"])


def test_one_flipped_byte(artifact: tuple[Path, Statement]) -> None:
    d, st = artifact
    data = bytearray((d / "kv.safetensors").read_bytes())
    data[50] ^= 1
    (d / "kv.safetensors").write_bytes(bytes(data))
    with pytest.raises(SubjectMismatchError, match="kv.safetensors has digest sha256:.*but the statement says"):
        verify_subjects(st, d, exclude=[d / "statement.dsse.json"])


def test_symlink_is_refused(artifact: tuple[Path, Statement], tmp_path_factory: pytest.TempPathFactory) -> None:
    d, st = artifact
    outside = tmp_path_factory.mktemp("outside") / "x"
    outside.write_bytes(b"hello")
    (d / "sub" / "notes.txt").unlink()
    (d / "sub" / "notes.txt").symlink_to(outside)
    with pytest.raises(SubjectMismatchError, match="is a symbolic link"):
        verify_subjects(st, d, exclude=[d / "statement.dsse.json"])


def test_not_a_directory(artifact: tuple[Path, Statement]) -> None:
    d, st = artifact
    with pytest.raises(MalformedInputError, match="is not a directory"):
        verify_subjects(st, d / "kv.safetensors")
    with pytest.raises(MalformedInputError, match="does not exist"):
        verify_subjects(st, d / "nope")
