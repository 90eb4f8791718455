"""Re-check an evaluation record offline: hashes, grades and aggregates from its outputs file.

A record directory holds ``record.dsse.json`` (the signed EvaluationStatement), its only
subject ``outputs.jsonl``, and optionally ``log.json`` (its inclusion proof). The layout and
every check are in docs/records.md. The engine writes outputs files and aggregates with the
functions here, so an honest record re-checks to the byte.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvgraft.schemas import (
    LOG_PROOF_FILE,
    OUTPUTS_FILE,
    RECORD_FILE,
    DocumentError,
    EvaluationAggregates,
    EvaluationItem,
    EvaluationStatement,
    Sha256Digest,
    Sha256Hex,
    canonical_json,
    parse_json,
    sha256_bytes,
)

from .dsse import parse_envelope, verify_statement_envelope
from .errors import ClaimMismatchError, DigestMismatchError, MalformedInputError
from .files import read_input
from .grading import Dataset, grade, harness_hashes, hash_string
from .keys import TrustedKeys
from .subjects import verify_subjects

#: An outputs file larger than this is refused before reading.
MAX_OUTPUTS_BYTES = 512 << 20
#: The same bound as read_envelope's: records list a few hundred bytes per item.
MAX_ENVELOPE_BYTES = 64 << 20
_OUTPUT_KEYS = frozenset({"doc_id", "prompt", "output"})


@dataclass(frozen=True)
class OutputLine:
    """One line of an outputs file: the dataset doc, the prompt sent, the text generated."""

    doc_id: int
    prompt: str
    output: str


def output_hash(output: str) -> Sha256Hex:
    """sha256 hex of the UTF-8 output text (an item's ``output_hash``)."""
    return hash_string(output)


def outputs_file_bytes(lines: Sequence[OutputLine]) -> bytes:
    """The exact bytes of an outputs file: RFC 8785 JSON per line, each ending in ``\\n``."""
    return b"".join(
        canonical_json({"doc_id": line.doc_id, "prompt": line.prompt, "output": line.output}) + b"\n" for line in lines
    )


def parse_outputs(data: bytes, *, what: str) -> list[OutputLine]:
    """Parse an outputs file strictly: every line canonical JSON with exactly doc_id, prompt,
    output, and a final newline. Raises ``MalformedInputError`` naming the line."""
    if not data:
        return []
    if not data.endswith(b"\n"):
        raise MalformedInputError(f"{what} does not end with a newline", hint="pass the file the producer wrote, unmodified")
    lines: list[OutputLine] = []
    for number, raw in enumerate(data[:-1].split(b"\n"), start=1):
        where = f"line {number} of {what}"
        try:
            doc = parse_json(raw, what=where)
        except DocumentError as e:
            raise MalformedInputError(str(e)) from e
        if not isinstance(doc, dict) or set(doc) != _OUTPUT_KEYS:
            got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
            raise MalformedInputError(f"{where} must be an object with exactly doc_id, prompt and output; got {got}")
        doc_id, prompt, output = doc["doc_id"], doc["prompt"], doc["output"]
        if isinstance(doc_id, bool) or not isinstance(doc_id, int) or doc_id < 0:
            raise MalformedInputError(f"{where}: doc_id {doc_id!r} is not a non-negative integer")
        if not isinstance(prompt, str) or not isinstance(output, str):
            raise MalformedInputError(f"{where}: prompt and output must be strings")
        if canonical_json(doc) != raw:
            # Hashes are over these bytes: a second spelling of the same JSON would be a second
            # file with the same claims, so only the canonical one is accepted.
            raise MalformedInputError(f"{where} is not RFC 8785 canonical JSON", hint="outputs files are written canonically; pass it unmodified")
        lines.append(OutputLine(doc_id, prompt, output))
    return lines


def read_outputs(path: Path, what: str) -> tuple[bytes, list[OutputLine]]:
    """Read and parse an outputs file; return its bytes and lines."""
    data = read_input(path, what, limit=MAX_OUTPUTS_BYTES)
    return data, parse_outputs(data, what=f"{what} {path}")


def evaluation_aggregates(items: Sequence[EvaluationItem]) -> EvaluationAggregates:
    """The aggregates of ``items`` exactly as the verifier recomputes them."""
    correct = sum(1 for item in items if item.correct)
    return EvaluationAggregates(
        items=len(items),
        correct=correct,
        accuracy=correct / len(items) if items else 0.0,
        prompt_tokens=sum(item.prompt_tokens for item in items),
        decode_tokens=sum(item.decode_tokens for item in items),
    )


def _show(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)


def _check_item(k: int, item: EvaluationItem, line: OutputLine, dataset: Dataset) -> None:
    where = f"item {k} (doc {item.doc_id})"
    if line.doc_id != item.doc_id:
        raise ClaimMismatchError(f"item {k}: doc_id claimed {item.doc_id}, but line {k + 1} of {OUTPUTS_FILE} is doc {line.doc_id}")
    if item.doc_id >= len(dataset):
        raise ClaimMismatchError(f"{where}: doc_id is outside dataset {dataset.name}, which holds {len(dataset)} docs")
    hashes = harness_hashes(dataset.docs[item.doc_id], line.prompt, dataset.target(item.doc_id))
    recomputed = {
        "doc_hash": hashes.doc_hash,
        "target_hash": hashes.target_hash,
        "prompt_hash": hashes.prompt_hash,
        "output_hash": output_hash(line.output),
    }
    source = {"doc_hash": "the dataset doc", "target_hash": "the dataset doc", "prompt_hash": OUTPUTS_FILE, "output_hash": OUTPUTS_FILE}
    for field, value in recomputed.items():
        claimed = getattr(item, field)
        if claimed != value:
            raise ClaimMismatchError(f"{where}: {field} claimed {claimed}, recomputed {value} from {source[field]}")
    got = grade(dataset, item.doc_id, line.output)
    reference = dataset.reference(item.doc_id)
    if item.extracted_answer != got.extracted:
        raise ClaimMismatchError(
            f"{where}: extracted_answer claimed {_show(item.extracted_answer)}, re-extracted {_show(got.extracted)}"
        )
    if item.correct != got.correct:
        raise ClaimMismatchError(
            f"{where}: correct claimed {_show(item.correct)}, re-graded {_show(got.correct)} "
            f"(extracted {_show(got.extracted)}, reference {_show(reference)})"
        )


@dataclass(frozen=True)
class VerifiedEvaluation:
    """A verified evaluation record: the statement, its signers and its dataset."""

    statement: EvaluationStatement
    signers: tuple[str, ...]
    dataset: Dataset
    envelope_bytes: bytes


def _pick_dataset(datasets: Dataset | Mapping[Sha256Digest, Dataset], name: str, digest: Sha256Digest) -> Dataset:
    if isinstance(datasets, Dataset):
        if datasets.digest != digest:
            raise DigestMismatchError(
                f"dataset {datasets.name} has digest {datasets.digest}, but the record evaluated {name} with digest {digest}",
                hint="pass the dataset file the evaluation ran on, unmodified",
            )
        return datasets
    found = datasets.get(digest)
    if found is None:
        raise MalformedInputError(
            f"no dataset with digest {digest} is available; the record evaluated {name}",
            hint="put the dataset file the evaluation ran on, unmodified, beside the record",
        )
    return found


def verify_evaluation_record(
    directory: Path, datasets: Dataset | Mapping[Sha256Digest, Dataset], trusted: TrustedKeys
) -> VerifiedEvaluation:
    """Verify an evaluation record directory against its dataset; return what was verified.

    ``datasets`` is the dataset (its digest must be the record's) or a digest -> dataset map.
    Re-computes every hash, re-grades every output and recounts every aggregate; raises
    ``ClaimMismatchError`` naming the item, field, claimed and recomputed values.
    """
    record = directory / RECORD_FILE
    envelope_bytes = read_input(record, "evaluation record", limit=MAX_ENVELOPE_BYTES)
    verified, statement = verify_statement_envelope(parse_envelope(envelope_bytes, source=f"envelope {record}"), trusted)
    if not isinstance(statement, EvaluationStatement):
        raise MalformedInputError(f"{record} is a {statement.predicate_type} statement, not an evaluation record")
    p = statement.predicate
    names = [s.name for s in statement.subject]
    if names != [OUTPUTS_FILE]:
        raise ClaimMismatchError(f"the evaluation's subjects are {names}; an evaluation record's only subject is {OUTPUTS_FILE}")
    verify_subjects(statement, directory, exclude=[record, directory / LOG_PROOF_FILE])
    data, lines = read_outputs(directory / OUTPUTS_FILE, "outputs file")
    got = sha256_bytes(data)
    if got != p.outputs_digest:
        raise ClaimMismatchError(f"outputs_digest claimed {p.outputs_digest}, but {OUTPUTS_FILE} has digest {got}")
    dataset = _pick_dataset(datasets, p.dataset.name, p.dataset.digest)
    if len(lines) != len(p.items):
        raise ClaimMismatchError(f"the record lists {len(p.items)} items, but {OUTPUTS_FILE} has {len(lines)} lines")
    for k, (item, line) in enumerate(zip(p.items, lines, strict=True)):
        _check_item(k, item, line, dataset)
    want = evaluation_aggregates(p.items)
    for field in ("items", "correct", "accuracy", "prompt_tokens", "decode_tokens"):
        claimed, value = getattr(p.aggregates, field), getattr(want, field)
        if claimed != value:
            raise ClaimMismatchError(f"aggregate {field} claimed {claimed!r}, recomputed {value!r}")
    return VerifiedEvaluation(statement, tuple(k.name for k in verified.signers), dataset, envelope_bytes)
