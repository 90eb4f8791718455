"""``kvgraft-verify eval``: records built with the real signing code over the real datasets are
accepted, and every altered byte, hash, grade or aggregate is refused naming what differs.

The builders here are shared with test_replay.py and test_audit.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgraft.schemas import (
    DatasetRef,
    DeterminismProfile,
    EvaluationAggregates,
    EvaluationItem,
    EvaluationPredicate,
    EvaluationStatement,
    ModelRef,
    Statement,
    Subject,
    SubjectDigest,
    hex_of,
    sha256_bytes,
)
from kvgraft.verifier import (
    ClaimMismatchError,
    DigestMismatchError,
    MalformedInputError,
    SubjectMismatchError,
    TrustedKeys,
    UnknownKeyError,
    envelope_json,
    ephemeral_signing_key,
    grade,
    harness_hashes,
    load_dataset,
    sign_statement,
    trusted_key,
)
from kvgraft.verifier._internal.evaluation import OutputLine, output_hash, outputs_file_bytes, verify_evaluation_record
from kvgraft.verifier.cli import ExitCode, main

REPO = Path(__file__).resolve().parents[2]
DATASETS = REPO / "data" / "datasets"
GSM8K = DATASETS / "gsm8k_test.jsonl"
AIME = DATASETS / "aime2025.jsonl"


# --- builders ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Publisher:
    """A signing key and the trusted-keys file that trusts it."""

    key: Ed25519PrivateKey
    trusted: TrustedKeys
    trust_file: Path


def make_publisher(directory: Path, name: str = "alice") -> Publisher:
    """A fresh Ed25519 publisher with its trusted-keys file written under ``directory``."""
    key = Ed25519PrivateKey.generate()
    trusted = TrustedKeys((trusted_key(name, key.public_key()),))
    directory.mkdir(parents=True, exist_ok=True)
    trust_file = directory / f"{name}-trusted-keys.json"
    trust_file.write_text(json.dumps(trusted.to_json()))
    return Publisher(key, trusted, trust_file)


def model_ref() -> ModelRef:
    """The model named by test records."""
    return ModelRef(name="tiny-llama-test", weights_digest=sha256_bytes(b"weights"), config_digest=sha256_bytes(b"config"))


def profile() -> DeterminismProfile:
    """The profile named by test records."""
    return DeterminismProfile(
        name="cpu-fp32", exactness="own-position", device_kind="cpu", device_fingerprint="x86_64",
        dtype="float32", torch_version="2.13.0", transformers_version="5.0.0", threads=1,
        attention_implementation="eager", matmul_tiling="default", deterministic_algorithms=True,
    )


def sign_to(path: Path, statement: Statement, publisher: Publisher) -> bytes:
    """Sign ``statement`` with the publisher's key, write the envelope to ``path``; return its bytes."""
    with ephemeral_signing_key(publisher.key) as signer:
        data = envelope_json(sign_statement(statement, [signer]))
    path.write_bytes(data)
    return data


def subject(name: str, data: bytes) -> Subject:
    """The in-toto subject of a file ``name`` holding ``data``."""
    return Subject(name=name, digest=SubjectDigest(sha256=hex_of(sha256_bytes(data))))


def answers(dataset_path: Path, docs: list[int]) -> list[tuple[int, str]]:
    """Model-like outputs for ``docs``: right for even positions, wrong for odd ones."""
    ds = load_dataset(dataset_path)
    out = []
    for n, doc in enumerate(docs):
        ref = ds.reference(doc)
        value = ref if n % 2 == 0 else str(int(ref) + 1)
        text = f"Let me think step by step.\nSo the answer is \\boxed{{{value}}}" if ds.kind == "aime" else f"Working it out.\n#### {value}"
        out.append((doc, text))
    return out


def build_eval(
    directory: Path,
    dataset_path: Path,
    outputs: list[tuple[int, str]],
    publisher: Publisher,
    *,
    edit_item: Callable[[int, dict[str, Any]], None] | None = None,
    edit_aggregates: Callable[[dict[str, Any]], None] | None = None,
    edit_lines: Callable[[list[OutputLine]], list[OutputLine]] | None = None,
) -> Path:
    """Write an honest evaluation record (then apply the edits a dishonest producer would make)."""
    ds = load_dataset(dataset_path)
    directory.mkdir(parents=True)
    lines = [OutputLine(doc, f"Q: {ds.question(doc)}\nA:", text) for doc, text in outputs]
    items = []
    for k, line in enumerate(lines):
        h = harness_hashes(ds.docs[line.doc_id], line.prompt, ds.target(line.doc_id))
        g = grade(ds, line.doc_id, line.output)
        item: dict[str, Any] = {
            "doc_id": line.doc_id, "doc_hash": h.doc_hash, "prompt_hash": h.prompt_hash, "target_hash": h.target_hash,
            "output_hash": output_hash(line.output), "extracted_answer": g.extracted, "correct": g.correct,
            "prompt_tokens": 10 + k, "decode_tokens": 3 + 2 * k, "library_entry": None,
        }
        if edit_item is not None:
            edit_item(k, item)
        items.append(EvaluationItem(**item))
    right = sum(i.correct for i in items)
    aggregates: dict[str, Any] = {
        "items": len(items), "correct": right, "accuracy": right / len(items) if items else 0.0,
        "prompt_tokens": sum(i.prompt_tokens for i in items), "decode_tokens": sum(i.decode_tokens for i in items),
    }
    if edit_aggregates is not None:
        edit_aggregates(aggregates)
    if edit_lines is not None:
        lines = edit_lines(lines)
    data = outputs_file_bytes(lines)
    (directory / "outputs.jsonl").write_bytes(data)
    statement = EvaluationStatement(
        subject=[subject("outputs.jsonl", data)],
        predicate=EvaluationPredicate(
            model=model_ref(), profile=profile(), dataset=DatasetRef(name=ds.name, digest=ds.digest),
            settings={"max_new_tokens": 16}, items=items, aggregates=EvaluationAggregates(**aggregates),
            outputs_digest=sha256_bytes(data),
        ),
    )
    sign_to(directory / "record.dsse.json", statement, publisher)
    return directory


# --- tests ---------------------------------------------------------------------------------

GSM_DOCS = [0, 5, 17, 3]


@pytest.fixture
def alice(tmp_path: Path) -> Publisher:
    return make_publisher(tmp_path / "keys")


def test_honest_gsm8k_record_verifies_with_recomputed_aggregates(tmp_path: Path, alice: Publisher) -> None:
    rec = build_eval(tmp_path / "rec", GSM8K, answers(GSM8K, GSM_DOCS), alice)
    got = verify_evaluation_record(rec, load_dataset(GSM8K), alice.trusted)
    a = got.statement.predicate.aggregates
    assert (a.items, a.correct) == (len(GSM_DOCS), len(GSM_DOCS[::2]))
    assert a.accuracy == a.correct / a.items
    assert got.signers == ("alice",)


def test_honest_aime_record_verifies(tmp_path: Path, alice: Publisher) -> None:
    rec = build_eval(tmp_path / "rec", AIME, answers(AIME, [0, 1, 2]), alice)
    got = verify_evaluation_record(rec, load_dataset(AIME), alice.trusted)
    assert [i.correct for i in got.statement.predicate.items] == [True, False, True]


def test_an_altered_output_byte_is_refused(tmp_path: Path, alice: Publisher) -> None:
    rec = build_eval(tmp_path / "rec", GSM8K, answers(GSM8K, GSM_DOCS), alice)
    data = (rec / "outputs.jsonl").read_bytes()
    (rec / "outputs.jsonl").write_bytes(data.replace(b"Working", b"WorKing", 1))
    with pytest.raises(SubjectMismatchError, match=r"outputs\.jsonl has digest sha256:[0-9a-f]{64}, but the statement says"):
        verify_evaluation_record(rec, load_dataset(GSM8K), alice.trusted)


def test_an_output_changed_before_signing_fails_its_output_hash(tmp_path: Path, alice: Publisher) -> None:
    def swap(lines: list[OutputLine]) -> list[OutputLine]:
        return [lines[0], OutputLine(lines[1].doc_id, lines[1].prompt, lines[1].output + " "), *lines[2:]]

    rec = build_eval(tmp_path / "rec", GSM8K, answers(GSM8K, GSM_DOCS), alice, edit_lines=swap)
    with pytest.raises(ClaimMismatchError, match=rf"item 1 \(doc {GSM_DOCS[1]}\): output_hash claimed [0-9a-f]{{64}}, recomputed [0-9a-f]{{64}} from outputs\.jsonl"):
        verify_evaluation_record(rec, load_dataset(GSM8K), alice.trusted)


def test_a_changed_prompt_fails_its_prompt_hash(tmp_path: Path, alice: Publisher) -> None:
    def reprompt(lines: list[OutputLine]) -> list[OutputLine]:
        return [*lines[:2], OutputLine(lines[2].doc_id, "a different prompt", lines[2].output), *lines[3:]]

    rec = build_eval(tmp_path / "rec", GSM8K, answers(GSM8K, GSM_DOCS), alice, edit_lines=reprompt)
    with pytest.raises(ClaimMismatchError, match=rf"item 2 \(doc {GSM_DOCS[2]}\): prompt_hash claimed"):
        verify_evaluation_record(rec, load_dataset(GSM8K), alice.trusted)


def test_a_flipped_grade_is_refused_naming_extracted_and_reference(tmp_path: Path, alice: Publisher) -> None:
    ds = load_dataset(GSM8K)
    wrong = answers(GSM8K, GSM_DOCS)[1][1].rsplit(" ", 1)[1]

    def flip(k: int, item: dict[str, Any]) -> None:
        if k == 1:
            item["correct"] = True

    rec = build_eval(tmp_path / "rec", GSM8K, answers(GSM8K, GSM_DOCS), alice, edit_item=flip)
    with pytest.raises(
        ClaimMismatchError,
        match=rf'item 1 \(doc {GSM_DOCS[1]}\): correct claimed true, re-graded false \(extracted "{wrong}", reference "{ds.reference(GSM_DOCS[1])}"\)',
    ):
        verify_evaluation_record(rec, ds, alice.trusted)


def test_a_changed_extracted_answer_is_refused(tmp_path: Path, alice: Publisher) -> None:
    def lie(k: int, item: dict[str, Any]) -> None:
        if k == 3:
            item["extracted_answer"] = "12345"

    rec = build_eval(tmp_path / "rec", GSM8K, answers(GSM8K, GSM_DOCS), alice, edit_item=lie)
    with pytest.raises(ClaimMismatchError, match=r'item 3 \(doc 3\): extracted_answer claimed "12345", re-extracted "'):
        verify_evaluation_record(rec, load_dataset(GSM8K), alice.trusted)


@pytest.mark.parametrize("field", ["accuracy", "correct", "items", "prompt_tokens", "decode_tokens"])
def test_an_altered_aggregate_is_refused(tmp_path: Path, alice: Publisher, field: str) -> None:
    def inflate(a: dict[str, Any]) -> None:
        a[field] = 1.0 if field == "accuracy" else a[field] + 1

    rec = build_eval(tmp_path / "rec", GSM8K, answers(GSM8K, GSM_DOCS), alice, edit_aggregates=inflate)
    with pytest.raises(ClaimMismatchError, match=rf"aggregate {field} claimed .*, recomputed "):
        verify_evaluation_record(rec, load_dataset(GSM8K), alice.trusted)


@pytest.mark.parametrize("field", ["doc_hash", "target_hash"])
def test_a_wrong_harness_hash_is_refused(tmp_path: Path, alice: Publisher, field: str) -> None:
    other = harness_hashes({"question": "?", "answer": "#### 1"}, "p", "t")

    def swap(k: int, item: dict[str, Any]) -> None:
        if k == 0:
            item[field] = getattr(other, field)

    rec = build_eval(tmp_path / "rec", GSM8K, answers(GSM8K, GSM_DOCS), alice, edit_item=swap)
    with pytest.raises(ClaimMismatchError, match=rf"item 0 \(doc 0\): {field} claimed {getattr(other, field)}, recomputed [0-9a-f]{{64}} from the dataset doc"):
        verify_evaluation_record(rec, load_dataset(GSM8K), alice.trusted)


def test_an_altered_dataset_line_is_refused(tmp_path: Path, alice: Publisher) -> None:
    rec = build_eval(tmp_path / "rec", GSM8K, answers(GSM8K, GSM_DOCS), alice)
    lines = GSM8K.read_bytes().split(b"\n")
    lines[17] = re.sub(rb"#### (\d+)", lambda m: b"#### " + str(int(m.group(1)) + 1).encode(), lines[17])
    changed = tmp_path / "gsm8k_test.jsonl"
    changed.write_bytes(b"\n".join(lines))
    with pytest.raises(DigestMismatchError, match=r"dataset gsm8k_test\.jsonl has digest sha256:[0-9a-f]{64}, but the record evaluated gsm8k_test\.jsonl with digest"):
        verify_evaluation_record(rec, load_dataset(changed), alice.trusted)


def test_a_doc_id_outside_the_dataset_is_refused(tmp_path: Path, alice: Publisher) -> None:
    n = len(load_dataset(AIME))

    def shift(lines: list[OutputLine]) -> list[OutputLine]:
        return [OutputLine(n + 4, line.prompt, line.output) for line in lines]

    def renumber(k: int, item: dict[str, Any]) -> None:
        item["doc_id"] = n + 4

    rec = build_eval(tmp_path / "rec", AIME, answers(AIME, [0]), alice, edit_lines=shift, edit_item=renumber)
    with pytest.raises(ClaimMismatchError, match=rf"item 0 \(doc {n + 4}\): doc_id is outside dataset aime2025\.jsonl, which holds {n} docs"):
        verify_evaluation_record(rec, load_dataset(AIME), alice.trusted)


def test_items_and_outputs_lines_must_correspond(tmp_path: Path, alice: Publisher) -> None:
    rec = build_eval(tmp_path / "rec", GSM8K, answers(GSM8K, GSM_DOCS), alice, edit_lines=lambda lines: lines[:-1])
    with pytest.raises(ClaimMismatchError, match=rf"the record lists {len(GSM_DOCS)} items, but outputs\.jsonl has {len(GSM_DOCS) - 1} lines"):
        verify_evaluation_record(rec, load_dataset(GSM8K), alice.trusted)


def test_a_record_by_an_untrusted_key_is_refused(tmp_path: Path, alice: Publisher) -> None:
    mallory = make_publisher(tmp_path / "mallory", "mallory")
    rec = build_eval(tmp_path / "rec", GSM8K, answers(GSM8K, GSM_DOCS), mallory)
    with pytest.raises(UnknownKeyError, match="none of the envelope's 1 signature"):
        verify_evaluation_record(rec, load_dataset(GSM8K), alice.trusted)


def test_a_non_canonical_outputs_file_is_refused(tmp_path: Path, alice: Publisher) -> None:
    rec = tmp_path / "rec"
    rec.mkdir()
    data = b'{"output": "x", "doc_id": 0, "prompt": "p"}\n'
    (rec / "outputs.jsonl").write_bytes(data)
    ds = load_dataset(GSM8K)
    statement = EvaluationStatement(
        subject=[subject("outputs.jsonl", data)],
        predicate=EvaluationPredicate(
            model=model_ref(), profile=profile(), dataset=DatasetRef(name=ds.name, digest=ds.digest), settings={}, items=[],
            aggregates=EvaluationAggregates(items=0, correct=0, accuracy=0.0, prompt_tokens=0, decode_tokens=0),
            outputs_digest=sha256_bytes(data),
        ),
    )
    sign_to(rec / "record.dsse.json", statement, alice)
    with pytest.raises(MalformedInputError, match=r"line 1 of outputs file .* is not RFC 8785 canonical JSON"):
        verify_evaluation_record(rec, ds, alice.trusted)


# --- command line --------------------------------------------------------------------------


def _run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_eval_ok_and_json(tmp_path: Path, alice: Publisher, capsys: pytest.CaptureFixture[str]) -> None:
    rec = build_eval(tmp_path / "rec", GSM8K, answers(GSM8K, GSM_DOCS), alice)
    code, out, err = _run(capsys, "eval", rec, "--dataset", GSM8K, "--trusted-keys", alice.trust_file)
    assert code == ExitCode.OK, err
    assert out.count("\n") == 1 and out.startswith("OK: evaluation of tiny-llama-test on gsm8k_test.jsonl, signed by alice")
    assert f"{len(GSM_DOCS[::2])}/{len(GSM_DOCS)} correct" in out
    code, out, err = _run(capsys, "--json", "eval", rec, "--dataset", GSM8K, "--trusted-keys", alice.trust_file)
    doc = json.loads(out)
    assert code == ExitCode.OK and doc["ok"] is True
    assert (doc["items"], doc["correct"], doc["accuracy"]) == (len(GSM_DOCS), len(GSM_DOCS[::2]), len(GSM_DOCS[::2]) / len(GSM_DOCS))


def test_cli_eval_tampered_grade_is_one_line_exit_1(tmp_path: Path, alice: Publisher, capsys: pytest.CaptureFixture[str]) -> None:
    def flip(k: int, item: dict[str, Any]) -> None:
        if k == 0:
            item["correct"] = False

    rec = build_eval(tmp_path / "rec", GSM8K, answers(GSM8K, GSM_DOCS), alice, edit_item=flip)
    code, out, err = _run(capsys, "eval", rec, "--dataset", GSM8K, "--trusted-keys", alice.trust_file)
    assert code == ExitCode.FAILED and out == ""
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("kvgraft-verify: ClaimMismatchError: item 0 (doc 0): correct claimed false, re-graded true")
    code, out, err = _run(capsys, "--json", "eval", rec, "--dataset", GSM8K, "--trusted-keys", alice.trust_file)
    assert code == ExitCode.FAILED and json.loads(out)["error"] == "ClaimMismatchError"


def test_cli_eval_usage_error_is_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["eval", "somewhere"])
    assert e.value.code == ExitCode.USAGE
    assert "--dataset" in capsys.readouterr().err
