"""Grading: the real datasets load strictly, answers are extracted and normalized as documented
(docs/records.md), and the harness hashes follow lm-evaluation-harness's definitions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kvgraft.verifier import (
    MalformedInputError,
    extract_answer,
    grade,
    harness_hashes,
    load_dataset,
    normalize_number,
)

REPO = Path(__file__).resolve().parents[2]
DATASETS = REPO / "data" / "datasets"
GSM8K = DATASETS / "gsm8k_test.jsonl"
AIME = DATASETS / "aime2025.jsonl"


@pytest.mark.parametrize(("path", "kind"), [(AIME, "aime"), (GSM8K, "gsm8k"), (DATASETS / "gsm8k_train.jsonl", "gsm8k")])
def test_real_datasets_load(path: Path, kind: str) -> None:
    data = path.read_bytes()
    raw = [json.loads(line) for line in data.decode().splitlines()]
    ds = load_dataset(path)
    assert (ds.name, ds.kind, len(ds)) == (path.name, kind, len(raw))
    assert ds.digest == "sha256:" + hashlib.sha256(data).hexdigest()
    assert list(ds.docs) == raw
    for i in (0, len(raw) // 2, len(raw) - 1):
        assert ds.target(i) == str(raw[i]["answer"])
        if kind == "aime":
            assert ds.question(i) == raw[i]["prompt"] and ds.reference(i) == str(raw[i]["answer"])
            assert ds.solution(i) is None
        else:
            worked, _, final = raw[i]["answer"].rpartition("####")
            assert ds.question(i) == raw[i]["question"]
            assert ds.reference(i) == final.strip().replace(",", "")
            assert ds.solution(i) == worked.rstrip() and "####" not in ds.solution(i)


def test_every_gsm8k_worked_answer_grades_correct() -> None:
    ds = load_dataset(GSM8K)
    wrong = [i for i in range(len(ds)) if not grade(ds, i, ds.docs[i]["answer"]).correct]
    assert wrong == []


def test_every_aime_answer_boxed_grades_correct_and_off_by_one_does_not() -> None:
    ds = load_dataset(AIME)
    for i in range(len(ds)):
        answer = ds.docs[i]["answer"]
        assert grade(ds, i, f"so the answer is \\boxed{{{answer}}}.").correct
        g = grade(ds, i, f"\\boxed{{{answer + 1}}}")
        assert g == type(g)(extracted=str(answer + 1), correct=False)


@pytest.mark.parametrize(
    ("kind", "text", "expected"),
    [
        ("aime", "thus \\boxed{070}", "70"),
        ("aime", "\\boxed{1,000} and later \\boxed{x^2}", "1000"),
        ("aime", "\\boxed{\\frac{1}{2}} so maybe 33", "33"),
        ("aime", "first 12, then 3.5", "12"),
        ("aime", "no digits here", None),
        ("gsm8k", "She pays $1,200.00 in total.\n#### $1,200.00", "1200"),
        ("gsm8k", "#### 5\nthen more text with 7", "5"),
        ("gsm8k", "The answer is \\boxed{-3}. Check: 4", "-3"),
        ("gsm8k", "It costs 18 dollars, so 18.", "18"),
        ("gsm8k", "-0.50 is the change", "-0.5"),
        ("gsm8k", "16 - 3 - 4", "4"),
        ("gsm8k", "a loss of -$5", "-5"),
        ("gsm8k", "nothing", None),
        ("qa", "#### Paris\n", "Paris"),
        ("qa", "I think \\boxed{ Lyon }", "Lyon"),
        ("qa", "the total is 1,024", "1024"),
    ],
)
def test_extract_answer(kind: str, text: str, expected: str | None) -> None:
    assert extract_answer(kind, text) == expected


@pytest.mark.parametrize(("text", "expected"), [("007", "7"), ("-0", "0"), ("$2.50", "2.5"), (" 18.00 ", "18"), ("1 2", None), ("abc", None)])
def test_normalize_number(text: str, expected: str | None) -> None:
    assert normalize_number(text) == expected


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(MalformedInputError, match="unknown dataset kind 'mmlu'"):
        extract_answer("mmlu", "#### 3")


def test_harness_hashes_follow_lm_evaluation_harness() -> None:
    ds = load_dataset(GSM8K)
    doc = ds.docs[0]  # holds a non-ASCII apostrophe: ensure_ascii=False changes the hash
    prompt = f"Question: {ds.question(0)}\nAnswer:"

    def sha(text: str) -> str:
        return hashlib.sha256(text.encode("utf-8")).hexdigest()

    h = harness_hashes(doc, prompt, ds.target(0))
    assert h.doc_hash == sha(json.dumps(doc, indent=2, ensure_ascii=False))
    assert h.doc_hash != sha(json.dumps(doc, indent=2))
    assert h.prompt_hash == sha(prompt)
    assert h.target_hash == sha(doc["answer"])
    aime = load_dataset(AIME)
    assert harness_hashes(aime.docs[0], "p", aime.target(0)).target_hash == sha(str(aime.docs[0]["answer"]))


def test_user_qa_dataset(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text('{"question": "Capital of France?", "answer": " Paris "}\n{"question": "2+2?", "answer": 4}\n{"question": "Cost?", "answer": "$1,000"}\n')
    ds = load_dataset(path)
    assert ds.kind == "qa"
    assert [ds.reference(i) for i in range(3)] == ["Paris", "4", "1000"]
    assert grade(ds, 0, "The capital is #### Paris").correct
    assert not grade(ds, 0, "#### paris").correct
    assert grade(ds, 1, "2+2 = 4").correct
    assert grade(ds, 2, "it costs \\boxed{1000}").correct


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", r"dataset .*mine\.jsonl is empty"),
        (b'{"prompt": "p", "answer": 1}\n\n{"prompt": "q", "answer": 2}\n', r"line 2 of dataset mine\.jsonl is not valid JSON"),
        (b'{"prompt": "p", "answer": 1, "answer": 2}\n', r"line 1 of dataset mine\.jsonl: duplicate key 'answer'"),
        (b'{"prompt": "p", "answer": "7"}\n', r'line 1 of dataset mine\.jsonl looks like AIME but is not \{"prompt": str, "answer": int\}'),
        (b'{"prompt": "p", "answer": 7}\n{"question": "q", "answer": "#### 3"}\n', r"line 2 of dataset mine\.jsonl is a gsm8k item, but earlier lines are aime"),
        (b'{"question": "q", "answer": "#### three"}\n', r"line 1 of dataset mine\.jsonl: the answer's text after the last #### is not a number"),
        (b'[1, 2]\n', r"line 1 of dataset mine\.jsonl is not a JSON object"),
        (b'{"text": "q"}\n', r"line 1 of dataset mine\.jsonl has fields \['text'\]"),
        (b'{"question": "q", "answer": NaN}\n', r"line 1 of dataset mine\.jsonl: NaN is not valid JSON"),
    ],
)
def test_malformed_datasets_are_refused(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / "mine.jsonl").write_bytes(content)
    with pytest.raises(MalformedInputError, match=message):
        load_dataset(tmp_path / "mine.jsonl")


def test_a_doc_outside_the_dataset_is_refused() -> None:
    ds = load_dataset(AIME)
    with pytest.raises(MalformedInputError, match=rf"doc {len(ds)} is outside dataset aime2025\.jsonl, which holds {len(ds)} docs"):
        grade(ds, len(ds), "\\boxed{1}")
