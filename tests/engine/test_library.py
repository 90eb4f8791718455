"""The knowledge library, in-process, on the seeded tiny model (fast) and on SmolLM2 (the real recall)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvgraft.verifier import load_dataset

REPO = Path(__file__).resolve().parents[2]
AIME = REPO / "data" / "datasets" / "aime2025.jsonl"
GSM8K_TRAIN = REPO / "data" / "datasets" / "gsm8k_train.jsonl"


def _subset(tmp_path: Path, source: Path, n: int, name: str | None = None) -> Path:
    path = tmp_path / (name or source.name)
    path.write_text("".join(source.read_text().splitlines(keepends=True)[:n]))
    return path


@pytest.fixture(scope="module")
def built_library(tmp_path_factory: pytest.TempPathFactory, tiny, profile, key: Path) -> tuple[Path, Path]:  # type: ignore[no-untyped-def]
    """Four GSM8K train problems deposited once for the module; tests get a copy."""
    from kvgraft.engine._internal.library import Library, clean_solution

    base = tmp_path_factory.mktemp("library")
    dataset = load_dataset(_subset(base, GSM8K_TRAIN, 4))
    lib = Library.create(base / "lib", tiny, profile, kind=dataset.kind, key=key)
    for i in range(4):
        solution = clean_solution(dataset.solution(i) or "") + f"\nThe answer is {dataset.reference(i)}."
        assert lib.deposit(dataset, i, solution, key=key) is not None
    return base / "lib", base / GSM8K_TRAIN.name


@pytest.fixture()
def tiny_library(tmp_path: Path, built_library: tuple[Path, Path], tiny, profile, key: Path):  # type: ignore[no-untyped-def]
    from kvgraft.engine import trust_signer
    from kvgraft.engine._internal.library import Library

    shutil.copytree(built_library[0], tmp_path / "lib")
    return Library.open(tmp_path / "lib", tiny, profile, trusted=trust_signer(key)), load_dataset(built_library[1])


def test_deposit_writes_chained_entries_and_an_index(tiny_library) -> None:  # type: ignore[no-untyped-def]
    lib, dataset = tiny_library
    lines = [json.loads(x) for x in (lib.directory / "index.jsonl").read_text().splitlines()]
    assert [x["doc_index"] for x in lines] == [0, 1, 2, 3]
    prefix = lib.prefix()
    for e in lib.entries:
        art = lib.load_entry(e)
        assert art.parent is not None and art.parent.kv_digest == prefix.kv_digest
        assert art.statement.predicate.positions.start == prefix.statement.predicate.positions.end
        assert "Problem: " + dataset.question(e.doc_index).strip() in art.statement.predicate.source_text.text
    assert lib.stored_tokens == sum(e.tokens for e in lib.entries) > 0


def test_deposit_refuses_a_wrong_answer_and_is_idempotent(tiny_library, key: Path) -> None:  # type: ignore[no-untyped-def]
    lib, dataset = tiny_library
    n = len(list((lib.directory / "entries").iterdir()))
    wrong = dataset.solution(0) or ""
    assert lib.deposit(dataset, 0, wrong + "\nThe answer is 99999.", key=key) == lib.entries[0]  # already there
    fresh = _subset(lib.directory.parent, GSM8K_TRAIN, 6, "g6.jsonl")
    d6 = load_dataset(fresh)
    assert lib.deposit(d6, 5, "So the total is 99999.", key=key) is None
    assert len(list((lib.directory / "entries").iterdir())) == n  # nothing written for the refusal


def test_lookup_exact_then_similar(tiny_library) -> None:  # type: ignore[no-untyped-def]
    lib, dataset = tiny_library
    q = dataset.question(2)
    hit = lib.lookup("  " + q.upper() + "\n")
    assert hit is not None and hit.method == "exact" and hit.entry.doc_index == 2
    near = lib.lookup(q.replace("?", "? Please be quick."))
    assert near is not None and near.method == "similar" and near.entry.doc_index == 2 and 0 < near.score < 1
    assert lib.lookup("zzzz qqqq") is None


def test_ask_recall_is_bounded_and_accounts_tokens(tiny_library) -> None:  # type: ignore[no-untyped-def]
    lib, dataset = tiny_library
    answer = lib.ask(dataset.question(1))
    assert answer.method == "exact" and answer.entry == lib.entries[1].artifact
    assert 1 <= answer.decode_tokens <= 16
    assert answer.prompt_tokens == len(lib.model.tokenizer.encode("The final answer to the problem above is \\boxed{", first=False))
    assert answer.energy_method in ("measured", "estimated") and answer.energy_joules > 0
    assert answer.prompt.endswith("\\boxed{") and dataset.question(1).strip() in answer.prompt


def test_reopen_and_tampering_are_caught(tiny_library, tiny, profile) -> None:  # type: ignore[no-untyped-def]
    from kvgraft.engine import ArtifactError, LibraryError
    from kvgraft.engine._internal.library import Library

    lib, dataset = tiny_library
    again = Library.open(lib.directory, tiny, profile, trusted=lib.trusted)
    assert [e.artifact for e in again.entries] == [e.artifact for e in lib.entries]
    kv = lib.directory / lib.entries[0].directory / "kv.safetensors"
    data = bytearray(kv.read_bytes())
    data[-1] ^= 1
    kv.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="has digest .* but the statement says"):
        again.ask(dataset.question(0))
    with pytest.raises(LibraryError, match=f"was deposited under the profile {profile.name}, not other") as e:
        Library.open(lib.directory, tiny, profile.model_copy(update={"name": "other"}), trusted=lib.trusted)
    assert e.value.hint is not None and e.value.hint.startswith(f"pass --profile {profile.name}"), e.value.hint


def test_interrupted_index_line_is_ignored_and_garbage_is_refused(tiny_library, tiny, profile) -> None:  # type: ignore[no-untyped-def]
    from kvgraft.engine import LibraryError
    from kvgraft.engine._internal.library import Library

    lib, _ = tiny_library
    index = lib.directory / "index.jsonl"
    with index.open("ab") as f:
        f.write(b'{"problem_hash": "ab')  # a deposit killed mid-write
    assert len(Library.open(lib.directory, tiny, profile, trusted=lib.trusted).entries) == 4
    index.write_bytes(index.read_bytes().rsplit(b"\n", 1)[0] + b"\n" + b'{"nope": 1}\n')
    with pytest.raises(LibraryError, match="line 5 is not a library entry"):
        Library.open(lib.directory, tiny, profile, trusted=lib.trusted)


def test_not_a_library(tmp_path: Path, tiny, profile, key: Path) -> None:  # type: ignore[no-untyped-def]
    from kvgraft.engine import LibraryError
    from kvgraft.engine._internal.library import Library

    with pytest.raises(LibraryError, match="is not a library"):
        Library.open(tmp_path, tiny, profile, insecure_skip_verify=True)
    (tmp_path / "x").write_text("x")
    with pytest.raises(LibraryError, match="exists and is not empty"):
        Library.create(tmp_path, tiny, profile, kind="gsm8k", key=key)


@pytest.mark.slow
def test_smollm2_answers_deposited_aime_problems_in_few_tokens(tmp_path: Path, profile, key: Path) -> None:  # type: ignore[no-untyped-def]
    """The acceptance check on the real model: a deposited problem comes back right, in <= 16 tokens."""
    from kvgraft.engine import load_model
    from kvgraft.engine._internal.library import Library

    model = load_model("smollm2-135m")
    dataset = load_dataset(_subset(tmp_path, AIME, 4))
    lib = Library.create(tmp_path / "lib", model, profile, kind=dataset.kind, key=key)
    for i in range(4):
        assert lib.deposit(dataset, i, f"The answer key gives \\boxed{{{dataset.reference(i)}}}.", key=key) is not None
    for i in range(4):
        answer = lib.ask(dataset.question(i))
        assert (answer.method, answer.answer) == ("exact", dataset.reference(i)), answer
        assert answer.decode_tokens <= 16


# --- answer kinds (issue 39) -------------------------------------------------------------------------


def test_answer_kinds_regression_a_guess_is_never_shown_as_a_verified_answer(tiny_library) -> None:  # type: ignore[no-untyped-def]
    # Was: "What is 2+2?" got an unrelated entry grafted at similarity 0.2, and the last number of
    # a decode cut off by the budget came back as `answer`, in the shape of a verified recall.
    from kvgraft.engine._internal.library import GRAFT_THRESHOLD

    lib, dataset = tiny_library
    # A deposited problem: recalled, the verified answer (right even though the tiny model's restating is noise).
    recalled = lib.ask(dataset.question(2))
    assert (recalled.kind, recalled.method, recalled.finished) == ("recalled", "exact", True)
    assert recalled.answer == dataset.reference(2) and recalled.text == "\\boxed{" + dataset.reference(2) + "}"
    assert 1 <= recalled.decode_tokens <= 16 and recalled.to_json()["kind"] == "recalled"
    # Unrelated questions: nothing grafted, the model alone; never recalled.
    for question in ("What is 2+2?", "Write a haiku about the sea.", "How many clips are there?"):
        answer = lib.ask(question, max_new_tokens=4)
        assert (answer.kind, answer.method, answer.entry) == ("unassisted", "none", None), question
        assert answer.score < GRAFT_THRESHOLD and answer.context_tokens > answer.prompt_tokens  # the instruction only
        # Cut off by the budget: no answer extracted from the unfinished text.
        assert (answer.finished, answer.stopped_by, answer.answer) == (False, "max_new_tokens", None), question
    # A paraphrase of a deposited problem: its verified entry assists; the answer is the model's.
    assisted = lib.ask(dataset.question(0) + " Please answer quickly.", max_new_tokens=3)
    assert (assisted.kind, assisted.method, assisted.entry) == ("assisted", "similar", lib.entries[0].artifact)
    assert assisted.score >= GRAFT_THRESHOLD and assisted.answer is None and not assisted.finished


def test_graft_threshold_is_the_librarys_and_refuses_nonsense(tiny_library, tiny, profile) -> None:  # type: ignore[no-untyped-def]
    from kvgraft.engine import LibraryError
    from kvgraft.engine._internal.library import Library

    lib, dataset = tiny_library
    question = dataset.question(0) + " Please answer quickly."
    strict = Library.open(lib.directory, tiny, profile, trusted=lib.trusted, graft_threshold=1.0)
    plan = strict.plan(question, strict.lookup(question), max_new_tokens=2)
    assert plan.hit is None and plan.kind == "unassisted" and 0.9 < plan.best_score < 1.0
    assert strict.ask(dataset.question(0)).kind == "recalled"  # an exact hit is never thresholded
    with pytest.raises(LibraryError, match="graft threshold 1.5 is not a similarity between 0 and 1") as e:
        Library.open(lib.directory, tiny, profile, trusted=lib.trusted, graft_threshold=1.5)
    assert e.value.hint is not None and "the calibrated one" in e.value.hint


def test_graft_threshold_calibration_holds(tmp_path: Path) -> None:
    """The committed threshold, measured by its calibration script on held-out paraphrases and unrelated questions."""
    import subprocess
    import sys

    out = tmp_path / "threshold.json"
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "calibrate_graft_threshold.py"), "--deposited", "300",
                        "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    held_out = json.loads(out.read_text())["held_out_at_library_threshold"]
    assert held_out["precision"] >= 0.98 and held_out["recall"] >= 0.9, held_out
    assert held_out["by_kind"]["everyday_grafted"] == 0 and held_out["by_kind"]["aime2025_grafted"] == 0, held_out
