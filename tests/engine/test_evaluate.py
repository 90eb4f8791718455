"""Evaluations on the tiny model: batched decoding answers as one-at-a-time does, a stopped run
resumes from its journal (and refuses another run's), and the fixed-entry control grafts one
chosen entry before every problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvgraft.engine import EvaluationError, LoadedModel, journal_path, run_eval, trust_signer
from kvgraft.engine._internal.library import Library, clean_solution
from kvgraft.schemas import DeterminismProfile, EvaluationItem
from kvgraft.verifier import load_dataset

REPO = Path(__file__).resolve().parents[2]
GSM8K_TEST = REPO / "data" / "datasets" / "gsm8k_test.jsonl"
GSM8K_TRAIN = REPO / "data" / "datasets" / "gsm8k_train.jsonl"
BUDGET = 8


class Stopped(Exception):
    """What a test raises to stop an evaluation mid-run, as a crash or ^C would."""


def _subset(tmp_path: Path, source: Path, n: int) -> Path:
    path = tmp_path / source.name
    path.write_text("".join(source.read_text().splitlines(keepends=True)[:n]))
    return path


def _outputs(record: Path) -> list[str]:
    return [json.loads(line)["output"] for line in (record / "outputs.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def test_set(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _subset(tmp_path_factory.mktemp("data"), GSM8K_TEST, 5)


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory: pytest.TempPathFactory, tiny: LoadedModel, profile: DeterminismProfile, key: Path,
                  test_set: Path) -> Path:
    out = tmp_path_factory.mktemp("eval") / "one"
    run_eval(tiny, profile, test_set, out, key=key, max_new_tokens=BUDGET)
    return out


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory, tiny: LoadedModel, profile: DeterminismProfile, key: Path) -> Library:
    base = tmp_path_factory.mktemp("library")
    dataset = load_dataset(_subset(base, GSM8K_TRAIN, 3))
    lib = Library.create(base / "lib", tiny, profile, kind=dataset.kind, key=key)
    for i in range(3):
        assert lib.deposit(dataset, i, clean_solution(dataset.solution(i) or "") + f"\nThe answer is {dataset.reference(i)}.",
                           key=key) is not None
    return Library.open(base / "lib", tiny, profile, trusted=trust_signer(key))


def test_batched_eval_answers_as_one_at_a_time(tmp_path: Path, tiny: LoadedModel, profile: DeterminismProfile, key: Path,
                                               test_set: Path, one_at_a_time: Path) -> None:
    run = run_eval(tiny, profile, test_set, tmp_path / "batched", key=key, max_new_tokens=BUDGET, batch=3)
    assert _outputs(tmp_path / "batched") == _outputs(one_at_a_time)
    settings = run.statement.predicate.settings
    assert settings["batch"] == 3 and settings["mode"] == "base"
    assert settings["cut_off"] == sum(i.decode_tokens == BUDGET for i in run.statement.predicate.items)
    assert not journal_path(tmp_path / "batched").exists()


@pytest.mark.parametrize("batch", [1, 2])
def test_a_stopped_eval_resumes_from_its_journal(tmp_path: Path, tiny: LoadedModel, profile: DeterminismProfile, key: Path,
                                                 test_set: Path, one_at_a_time: Path, batch: int) -> None:
    out = tmp_path / "e"
    seen: list[int] = []

    def stop_after_two(n: int, total: int, item: EvaluationItem) -> None:
        seen.append(item.doc_id)
        if len(seen) == 2:
            raise Stopped

    with pytest.raises(Stopped):
        run_eval(tiny, profile, test_set, out, key=key, max_new_tokens=BUDGET, batch=batch, on_item=stop_after_two)
    assert not out.exists()
    journal = journal_path(out)
    assert len(journal.read_text().splitlines()) == 1 + 2  # the header, then the two finished items
    again: list[int] = []
    run = run_eval(tiny, profile, test_set, out, key=key, max_new_tokens=BUDGET, batch=batch,
                   on_item=lambda n, total, item: again.append(item.doc_id))
    assert sorted(seen + again) == list(range(5))  # nothing answered twice, nothing left out
    assert [i.doc_id for i in run.statement.predicate.items] == list(range(5))
    if batch == 1:
        assert _outputs(out) == _outputs(one_at_a_time)
    assert not journal.exists()


def test_a_journal_line_cut_short_by_a_crash_is_dropped(tmp_path: Path, tiny: LoadedModel, profile: DeterminismProfile,
                                                         key: Path, test_set: Path, one_at_a_time: Path) -> None:
    out = tmp_path / "e"

    def stop_at_three(n: int, total: int, item: EvaluationItem) -> None:
        if n == 2:
            raise Stopped

    with pytest.raises(Stopped):
        run_eval(tiny, profile, test_set, out, key=key, max_new_tokens=BUDGET, on_item=stop_at_three)
    journal = journal_path(out)
    with journal.open("ab") as f:
        f.write(b'{"doc_id": 3, "prompt": "half a li')
    run_eval(tiny, profile, test_set, out, key=key, max_new_tokens=BUDGET)
    assert _outputs(out) == _outputs(one_at_a_time)


def test_the_journal_of_another_evaluation_is_refused(tmp_path: Path, tiny: LoadedModel, profile: DeterminismProfile,
                                                       key: Path, test_set: Path) -> None:
    out = tmp_path / "e"

    def stop_at_once(n: int, total: int, item: EvaluationItem) -> None:
        raise Stopped

    with pytest.raises(Stopped):
        run_eval(tiny, profile, test_set, out, key=key, max_new_tokens=BUDGET, on_item=stop_at_once)
    before = journal_path(out).read_bytes()
    with pytest.raises(EvaluationError, match=r"e\.journal\.jsonl is the journal of another evaluation") as e:
        run_eval(tiny, profile, test_set, out, key=key, max_new_tokens=BUDGET + 1)
    assert "delete" in (e.value.hint or "") and "or choose another --out" in (e.value.hint or "")
    assert journal_path(out).read_bytes() == before and not out.exists()


def test_the_fixed_entry_is_grafted_before_every_problem(tmp_path: Path, tiny: LoadedModel, profile: DeterminismProfile,
                                                         key: Path, test_set: Path, library: Library) -> None:
    chosen = library.entries[1]
    run = run_eval(tiny, profile, test_set, tmp_path / "f", key=key, library=library, fixed_entry=chosen.artifact,
                   max_new_tokens=BUDGET, batch=2)
    p = run.statement.predicate
    assert {i.library_entry for i in p.items} == {chosen.artifact} and p.library_artifacts == [chosen.artifact]
    assert p.settings["mode"] == "fixed" and p.settings["library_entry_fixed"] == chosen.artifact
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "f" / "outputs.jsonl").read_text().splitlines()]
    problem = library.load_entry(chosen).statement.predicate.source_text.text or ""
    assert all(problem in prompt for prompt in prompts)
    test = load_dataset(test_set)
    assert all(prompt.endswith(test.question(n).strip() + "\nSolution: Let's think step by step.")
               for n, prompt in enumerate(prompts))


def test_a_fixed_entry_not_in_the_library_is_refused(tmp_path: Path, tiny: LoadedModel, profile: DeterminismProfile,
                                                     key: Path, test_set: Path, library: Library) -> None:
    from kvgraft.schemas import Sha256Digest

    missing = Sha256Digest("sha256:" + "0" * 64)
    with pytest.raises(EvaluationError, match=rf"library .*lib holds no entry {missing}") as e:
        run_eval(tiny, profile, test_set, tmp_path / "f", key=key, library=library, fixed_entry=missing)
    assert "index.jsonl" in (e.value.hint or "")
    with pytest.raises(EvaluationError, match="no --library was given"):
        run_eval(tiny, profile, test_set, tmp_path / "f", key=key, fixed_entry=library.entries[0].artifact)
    assert not (tmp_path / "f").exists() and not journal_path(tmp_path / "f").exists()


def test_batch_below_one_is_refused(tmp_path: Path, tiny: LoadedModel, profile: DeterminismProfile, key: Path,
                                    test_set: Path) -> None:
    with pytest.raises(EvaluationError, match="--batch 0 is not positive") as e:
        run_eval(tiny, profile, test_set, tmp_path / "e", key=key, batch=0)
    assert "--batch 16" in (e.value.hint or "")


def test_a_copied_library_still_serves_the_fixed_entry(tmp_path: Path, tiny: LoadedModel, profile: DeterminismProfile,
                                                       key: Path, test_set: Path, library: Library) -> None:
    # The entry is named by its artifact's digest, not its path: a moved library answers the same.
    shutil.copytree(library.directory, tmp_path / "moved")
    moved = Library.open(tmp_path / "moved", tiny, profile, trusted=trust_signer(key))
    a = run_eval(tiny, profile, test_set, tmp_path / "a", key=key, library=library, fixed_entry=library.entries[0].artifact,
                 max_new_tokens=BUDGET)
    b = run_eval(tiny, profile, test_set, tmp_path / "b", key=key, library=moved, fixed_entry=library.entries[0].artifact,
                 max_new_tokens=BUDGET)
    assert _outputs(tmp_path / "a") == _outputs(tmp_path / "b")
    assert a.statement.predicate.items == b.statement.predicate.items


@pytest.mark.parametrize(("line", "names"), [
    (b'{"doc_id": 99}\n', "(fields decode_tokens, energy_method, entry"),
    (b'{"decode_tokens": 1, "doc_id": 77, "energy_method": "estimated", "entry": null, "joules": 0.1, "output": "x", '
     b'"prompt": "p", "prompt_tokens": 3, "seconds": 0.5, "stopped_by": "eos"}\n', "(doc 77 is not drawn)"),
    (b'{"decode_tokens": "1", "doc_id": 0, "energy_method": "estimated", "entry": null, "joules": 0.1, "output": "x", '
     b'"prompt": "p", "prompt_tokens": 3, "seconds": 0.5, "stopped_by": "eos"}\n', "(fields decode_tokens)"),
    (b"[1, 2]\n", "(fields (not an object))"),
])
def test_a_journal_line_that_is_not_a_finished_item_is_refused(tmp_path: Path, tiny: LoadedModel, profile: DeterminismProfile,
                                                                key: Path, test_set: Path, line: bytes, names: str) -> None:
    out = tmp_path / "e"

    def stop_at_once(n: int, total: int, item: EvaluationItem) -> None:
        raise Stopped

    with pytest.raises(Stopped):
        run_eval(tiny, profile, test_set, out, key=key, max_new_tokens=BUDGET, on_item=stop_at_once)
    with journal_path(out).open("ab") as f:
        f.write(line)
    with pytest.raises(EvaluationError, match=r"e\.journal\.jsonl line 3 is not a finished item of this evaluation") as e:
        run_eval(tiny, profile, test_set, out, key=key, max_new_tokens=BUDGET)
    assert names in str(e.value) and "delete" in (e.value.hint or "")


def test_a_library_eval_counts_answer_kinds_and_grafts_only_above_the_threshold(
        tmp_path: Path, tiny: LoadedModel, profile: DeterminismProfile, key: Path, library: Library) -> None:
    from kvgraft.engine._internal.evaluate import eval_command

    train = GSM8K_TRAIN.read_text().splitlines()
    paraphrase = json.loads(train[2])
    paraphrase["question"] += " Please answer quickly."
    unrelated = json.loads(GSM8K_TEST.read_text().splitlines()[0])
    data = tmp_path / "mixed.jsonl"
    data.write_text(train[0] + "\n" + train[1] + "\n" + json.dumps(paraphrase) + "\n" + json.dumps(unrelated) + "\n")
    run = run_eval(tiny, profile, data, tmp_path / "e", key=key, library=library, max_new_tokens=4)
    p = run.statement.predicate
    assert (p.settings["recalled"], p.settings["assisted"], p.settings["unassisted"]) == (2, 1, 1)
    assert p.settings["graft_threshold"] == library.graft_threshold == 0.66
    assert p.items[3].library_entry is None  # below the threshold: the instruction alone
    command = eval_command(run.statement, data, library.directory)
    assert command[command.index("--graft-threshold") + 1] == "0.66"
    # Threshold 0 grafts the most similar entry at any score, as evaluations before issue 39 did.
    anything = Library.open(library.directory, tiny, profile, trusted=library.trusted, graft_threshold=0.0)
    p0 = run_eval(tiny, profile, data, tmp_path / "e0", key=key, library=anything, max_new_tokens=4).statement.predicate
    assert (p0.settings["assisted"], p0.settings["unassisted"]) == (2, 0) and p0.items[3].library_entry is not None
    del p0.settings["graft_threshold"]  # a record from before the threshold replays with 0
    assert "0.0" in eval_command(run.statement.model_copy(update={"predicate": p0}), data, library.directory)


def test_a_sampled_eval_is_reproducible_from_its_seed_and_records_it(
        tmp_path: Path, tiny: LoadedModel, profile: DeterminismProfile, key: Path, test_set: Path, one_at_a_time: Path) -> None:
    from kvgraft.engine import Sampling
    from kvgraft.engine._internal.evaluate import eval_command

    sampling = Sampling(1.0, 0.9, 5)
    a = run_eval(tiny, profile, test_set, tmp_path / "a", key=key, max_new_tokens=BUDGET, sampling=sampling)
    run_eval(tiny, profile, test_set, tmp_path / "b", key=key, max_new_tokens=BUDGET, sampling=sampling)
    assert _outputs(tmp_path / "a") == _outputs(tmp_path / "b") != _outputs(one_at_a_time)
    s = a.statement.predicate.settings
    assert (s["temperature"], s["top_p"], s["sample_seed"]) == (1.0, 0.9, 5)
    command = eval_command(a.statement, test_set, None)
    assert command[command.index("--sample-seed") + 1] == "5" and command[command.index("--top-p") + 1] == "0.9"
    # Problem D is drawn with seed + D: an item does not depend on which others ran (two drawn at random).
    run_eval(tiny, profile, test_set, tmp_path / "c", key=key, max_new_tokens=BUDGET, sampling=sampling, limit=2, seed=4)
    by_doc = {json.loads(line)["doc_id"]: json.loads(line)["output"] for line in (tmp_path / "a" / "outputs.jsonl").read_text().splitlines()}
    drawn = [json.loads(line) for line in (tmp_path / "c" / "outputs.jsonl").read_text().splitlines()]
    assert [d["doc_id"] for d in drawn] != [0, 1] and all(d["output"] == by_doc[d["doc_id"]] for d in drawn)
    # Greedy records carry no sampling settings (what they always were).
    assert "sample_seed" not in run_eval(tiny, profile, test_set, tmp_path / "g", key=key, max_new_tokens=2).statement.predicate.settings
