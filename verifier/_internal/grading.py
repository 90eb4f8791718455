"""Datasets, answer extraction, grading and lm-evaluation-harness hashes.

The engine grades with this same code (it imports ``kvgraft.verifier``), so an honest record's
grades and the verifier's re-grades agree to the byte. No torch, no engine: standard library
and ``kvgraft.schemas`` only.

Three dataset kinds, detected from each line's fields:

- ``aime``: ``{"prompt": str, "answer": int}``; the reference is the integer.
- ``gsm8k``: ``{"question": str, "answer": str}`` whose answer ends with ``#### <number>``;
  the reference is that number, the worked solution is the text before ``####``.
- ``qa``: ``{"question": str, "answer": str | int}`` for user-supplied problem sets; the
  reference is the normalized number when the answer is numeric, else the stripped string.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvgraft.schemas import DocumentError, Sha256Digest, Sha256Hex, parse_json, sha256_bytes

from .errors import MalformedInputError
from .files import read_input

DatasetKind = Literal["aime", "gsm8k", "qa"]
KINDS: tuple[DatasetKind, ...] = ("aime", "gsm8k", "qa")

#: A dataset file larger than this is refused before reading: the bundled ones are a few MiB.
MAX_DATASET_BYTES = 256 << 20

# A number as models and GSM8K write it: optional sign, optional "$", digits with optional
# thousands commas, optional decimals. Commas are only taken between digits so that
# "5, 6" reads as two numbers; a sign must touch its digits so that "16 - 3" is 16 and 3.
_NUMBER = re.compile(r"-?(?:\$\s?)?\d+(?:,\d{3})*(?:\.\d+)?")
_WHOLE_NUMBER = re.compile(r"\s*-?\s?\$?\s?\d+(?:,\d{3})*(?:\.\d+)?\s*\.?\s*")
_BOXED = "\\boxed{"
_ANSWER_MARK = "####"


def normalize_number(text: str) -> str | None:
    """The canonical form of a number written as text, or None when ``text`` is not one number.

    Strips whitespace, ``$``, thousands commas, a trailing sentence period, trailing zero
    decimals (``18.00`` -> ``18``) and leading zeros (``070`` -> ``70``); keeps a ``-`` sign
    (``-0`` -> ``0``).
    """
    if not _WHOLE_NUMBER.fullmatch(text):
        return None
    s = text.strip().rstrip(".").strip().replace("$", "").replace(",", "").replace(" ", "")
    negative = s.startswith("-")
    s = s.removeprefix("-")
    whole, _, frac = s.partition(".")
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    out = whole + ("." + frac if frac else "")
    return "-" + out if negative and out != "0" else out


def _boxed_contents(text: str) -> list[str]:
    """Every ``\\boxed{...}`` body in order, with nested braces balanced."""
    found: list[str] = []
    start = text.find(_BOXED)
    while start != -1:
        i = start + len(_BOXED)
        depth = 1
        j = i
        while j < len(text) and depth:
            if text[j] == "{":
                depth += 1
            elif text[j] == "}":
                depth -= 1
            j += 1
        if depth == 0:
            found.append(text[i : j - 1])
        start = text.find(_BOXED, i)
    return found


def _last_number(text: str, *, integer: bool = False) -> str | None:
    for match in reversed(_NUMBER.findall(text)):
        value = normalize_number(match)
        if value is not None and (not integer or "." not in value):
            return value
    return None


def _is_integer(value: str | None) -> bool:
    return value is not None and "." not in value


def extract_answer(kind: str, text: str) -> str | None:
    """The normalized final answer in a model's ``text``, or None when it holds none.

    AIME: the last ``\\boxed{...}`` holding an integer, else the last integer in the text.
    GSM8K and qa: the number after the last ``####``, else the last ``\\boxed{...}``, else the
    last number in the text (qa also accepts a non-numeric answer after ``####`` or in a box,
    stripped). Numbers are normalized with ``normalize_number``.
    """
    if kind == "aime":
        for body in reversed(_boxed_contents(text)):
            value = normalize_number(body)
            if _is_integer(value):
                return value
        return _last_number(text, integer=True)
    if kind not in ("gsm8k", "qa"):
        raise MalformedInputError(f"unknown dataset kind {kind!r}", hint=f"use one of {', '.join(KINDS)}")
    mark = text.rfind(_ANSWER_MARK)
    if mark != -1:
        tail = text[mark + len(_ANSWER_MARK) :]
        match = _NUMBER.search(tail)
        if match is not None:
            return normalize_number(match.group())
        if kind == "qa":
            line = tail.strip().split("\n", 1)[0].strip()
            if line:
                return line
    boxes = _boxed_contents(text)
    if boxes:
        body = boxes[-1]
        value = normalize_number(body)
        if value is not None:
            return value
        if kind == "qa" and body.strip():
            return body.strip()
    return _last_number(text)


def _reference_of(kind: DatasetKind, doc: dict[str, Any]) -> str | None:
    answer = doc["answer"]
    if kind == "aime":
        return normalize_number(str(answer))
    if kind == "gsm8k":
        tail = answer[answer.rfind(_ANSWER_MARK) + len(_ANSWER_MARK) :]
        return normalize_number(tail)
    text = str(answer)
    return normalize_number(text) or text.strip()


def _kind_of(doc: object, line: int, path: Path) -> DatasetKind:
    where = f"line {line} of dataset {path.name}"
    if not isinstance(doc, dict):
        raise MalformedInputError(f"{where} is not a JSON object")
    answer = doc.get("answer")
    if "prompt" in doc and "question" not in doc:
        if not isinstance(doc["prompt"], str) or not isinstance(answer, int) or isinstance(answer, bool):
            raise MalformedInputError(f'{where} looks like AIME but is not {{"prompt": str, "answer": int}}')
        return "aime"
    if "question" in doc:
        if not isinstance(doc["question"], str):
            raise MalformedInputError(f"{where}: question is {type(doc['question']).__name__}, not a string")
        if isinstance(answer, str) and _ANSWER_MARK in answer:
            if normalize_number(answer[answer.rfind(_ANSWER_MARK) + len(_ANSWER_MARK) :]) is None:
                raise MalformedInputError(f"{where}: the answer's text after the last #### is not a number")
            return "gsm8k"
        if isinstance(answer, str) or (isinstance(answer, int) and not isinstance(answer, bool)):
            if not str(answer).strip():
                raise MalformedInputError(f"{where} has an empty answer")
            return "qa"
        raise MalformedInputError(f"{where}: answer is {type(answer).__name__}, not a string or integer")
    raise MalformedInputError(
        f"{where} has fields {sorted(doc)}; expected prompt+answer (AIME) or question+answer (GSM8K, qa)"
    )


@dataclass(frozen=True)
class Dataset:
    """A problem set read from a JSONL file: its name, kind, digest and documents."""

    name: str
    kind: DatasetKind
    digest: Sha256Digest
    docs: tuple[dict[str, Any], ...]

    def __len__(self) -> int:
        return len(self.docs)

    def _doc(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self.docs):
            raise MalformedInputError(f"doc {index} is outside dataset {self.name}, which holds {len(self.docs)} docs")
        return self.docs[index]

    def question(self, index: int) -> str:
        """The problem text of doc ``index`` (AIME's ``prompt``, else ``question``)."""
        doc = self._doc(index)
        return str(doc["prompt"] if self.kind == "aime" else doc["question"])

    def reference(self, index: int) -> str:
        """The normalized reference answer of doc ``index``, comparable with ``extract_answer``."""
        value = _reference_of(self.kind, self._doc(index))
        if value is None:  # _kind_of refused such docs on load; this guards hand-made Datasets.
            raise MalformedInputError(f"doc {index} of {self.name} has no usable reference answer")
        return value

    def solution(self, index: int) -> str | None:
        """GSM8K's worked solution (the answer text before ``####``), else None."""
        if self.kind != "gsm8k":
            return None
        answer: str = self._doc(index)["answer"]
        return answer[: answer.rfind(_ANSWER_MARK)].rstrip()

    def target(self, index: int) -> str:
        """What lm-evaluation-harness calls the target: ``str(doc["answer"])``."""
        return str(self._doc(index)["answer"])


def load_dataset(path: Path) -> Dataset:
    """Read a JSONL dataset strictly: every line one JSON object of one kind.

    Raises ``MalformedInputError`` naming the line and the fault.
    """
    data = read_input(path, "dataset", limit=MAX_DATASET_BYTES)
    if not data.strip():
        raise MalformedInputError(f"dataset {path} is empty")
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the final newline ends the last line; it does not start an empty one
    docs: list[dict[str, Any]] = []
    kind: DatasetKind | None = None
    for number, raw in enumerate(lines, start=1):
        try:
            doc = parse_json(raw, what=f"line {number} of dataset {path.name}")
        except DocumentError as e:
            raise MalformedInputError(str(e), hint="each line must be one JSON object") from e
        line_kind = _kind_of(doc, number, path)
        if kind is not None and line_kind != kind:
            raise MalformedInputError(f"line {number} of dataset {path.name} is a {line_kind} item, but earlier lines are {kind}")
        kind = line_kind
        docs.append(doc)
    if kind is None:  # unreachable after the emptiness check; keeps the type narrow
        raise MalformedInputError(f"dataset {path} has no items")
    return Dataset(name=path.name, kind=kind, digest=sha256_bytes(data), docs=tuple(docs))


@dataclass(frozen=True)
class Grade:
    """The answer extracted from an output and whether it equals the reference."""

    extracted: str | None
    correct: bool


def grade(dataset: Dataset, index: int, output: str) -> Grade:
    """Grade ``output`` against doc ``index``: correct exactly when the extracted answer equals
    the normalized reference."""
    reference = dataset.reference(index)
    extracted = extract_answer(dataset.kind, output)
    return Grade(extracted=extracted, correct=extracted is not None and extracted == reference)


@dataclass(frozen=True)
class HarnessHashes:
    """lm-evaluation-harness's per-sample hashes (bare sha256 hex)."""

    doc_hash: Sha256Hex
    prompt_hash: Sha256Hex
    target_hash: Sha256Hex


def hash_string(text: str) -> Sha256Hex:
    """sha256 hex of the UTF-8 text, as lm-evaluation-harness's ``hash_string``."""
    return Sha256Hex(hashlib.sha256(text.encode("utf-8")).hexdigest())


def _handle_non_serializable(o: object) -> object:
    # lm_eval.utils.handle_non_serializable, without numpy: sets become lists, the rest str.
    if isinstance(o, set):
        return list(o)
    return str(o)


def harness_hashes(doc: dict[str, Any], prompt: str, target: str) -> HarnessHashes:
    """The doc, prompt and target hashes exactly as lm-evaluation-harness logs them.

    See docs/records.md for the harness source these follow.
    """
    doc_text = json.dumps(doc, indent=2, default=_handle_non_serializable, ensure_ascii=False)
    return HarnessHashes(
        doc_hash=hash_string(doc_text),
        prompt_hash=hash_string(prompt),
        target_hash=hash_string(str(target)),
    )
