"""Check that a directory holds exactly a statement's subjects: none missing, none extra,
every digest equal. A ``model.sig`` beside them (``MODEL_SIG_FILE``, an OpenSSF model signing
signature of the directory) is not an extra file; ``oms.verify_model_signature`` checks it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from kvgraft.schemas import MODEL_SIG_FILE, Statement, prefixed, sha256_file

from .errors import MalformedInputError, SubjectMismatchError


def _files_under(directory: Path, exclude: set[Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted(directory.rglob("*")):
        if path.resolve() in exclude:
            continue
        rel = path.relative_to(directory).as_posix()
        if path.is_symlink():
            raise SubjectMismatchError(
                f"{rel} in {directory} is a symbolic link; subjects must be regular files",
                hint="copy the real file into the directory",
            )
        if path.is_file():
            found[rel] = path
    return found


def verify_subjects(statement: Statement, directory: Path, *, exclude: Iterable[Path] = ()) -> list[str]:
    """Verify that ``directory`` holds exactly the statement's subjects; return their names.

    ``exclude`` lists files that sit beside the subjects but are not among them (the envelope);
    a top-level ``model.sig`` that is not a subject is always passed over. Raises
    ``SubjectMismatchError`` naming each missing, extra or altered file.
    """
    if not directory.exists():
        raise MalformedInputError(f"artifact directory {directory} does not exist")
    if not directory.is_dir():
        raise MalformedInputError(f"{directory} is not a directory", hint="pass the artifact's directory")
    expected = {s.name: prefixed(s.digest.sha256) for s in statement.subject}
    beside = [*exclude, *([directory / MODEL_SIG_FILE] if MODEL_SIG_FILE not in expected else [])]
    files = _files_under(directory, {p.resolve() for p in beside})

    missing = sorted(set(expected) - set(files))
    extra = sorted(set(files) - set(expected))
    if missing:
        raise SubjectMismatchError(f"{directory} lacks subject(s) {', '.join(missing)} named by the statement")
    if extra:
        raise SubjectMismatchError(
            f"{directory} holds file(s) {', '.join(extra)} that the statement does not name",
            hint="remove the extra files, or check that this is the right directory",
        )
    for name, want in expected.items():
        got = sha256_file(files[name])
        if got != want:
            raise SubjectMismatchError(f"{name} has digest {got}, but the statement says {want}")
    return sorted(expected)
