"""The pre-registered capability experiment (issue 39) end to end on a real small model
(smollm2-135m under llamacpp-cpu), 4 GSM8K test problems, k = 2: scripts/capability_v2.py writes
and logs the design in a real registry on 127.0.0.1, runs the three arms, logs them, and
``kvgraft-verify eval --design`` accepts each; a record that departs from its design, or was
logged before it, is refused with a message naming why. The decision rules without a model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgraft.verifier.cli import main as verify_main

from ..registry.conftest import registry_cli, running_server

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "capability_v2.py"
TEST = REPO / "data" / "datasets" / "gsm8k_test.jsonl"
SMALL = ("--model", "smollm2-135m", "--profile", "llamacpp-cpu", "--size", "4", "--seed", "7", "--k", "2", "--budget", "40",
         "--batch", "4")


def test_decide_is_plurality_ties_to_the_grafted_answer_then_the_first() -> None:
    from kvgraft.verifier import compose, decide
    from kvgraft.verifier._internal.design import NO_DECISION, _redecide

    assert decide(["3", "5", "5", None]) == "5"
    assert decide(["3", "5"]) == "3"  # a tie goes to the answer given first
    assert decide(["3", "5"], "5") == "5"  # ...and to the grafted answer before that
    assert decide(["3", "3", "3", "5"], "5") == "3"  # the grafted answer is one vote, not a veto
    assert decide([None, None]) is None and decide([None], "2") == "2"
    # A problem with no decision holds no digit the grader could take for an answer.
    text = compose([None, "no numbers here"], None, None)
    assert text.endswith(NO_DECISION) and not any(c.isdigit() for c in text)
    written = compose(["a \\boxed{4}", None, "c \\boxed{5}"], "b \\boxed{5}\n\nmore", "5")
    assert written.endswith("[decision] #### 5")
    # The verifier reads back what was written: the stated decision and the rule's over the listed answers.
    assert _redecide("gsm8k", written, "doc 0") == ("5", "5")
    assert _redecide("gsm8k", written.replace("#### 5", "#### 4"), "doc 0") == ("4", "5")
    assert _redecide("gsm8k", compose([None], "x \\boxed{7}", "7"), "doc 0") == ("7", "7")
    assert _redecide("gsm8k", text, "doc 0") == (None, None)


def test_a_design_whose_comparison_names_no_arm_is_refused() -> None:
    from pydantic import ValidationError

    from kvgraft.schemas import DesignAnalysis, DesignArm, DesignComparison, DesignSplit, ExperimentDesign

    with pytest.raises(ValidationError, match="comparison names arm 'flywheel', which is not among the arms"):
        ExperimentDesign(
            test=DesignSplit(name="t", digest="sha256:" + "0" * 64, doc_ids=[1, 2], rule="r"),
            arms=[DesignArm(name="base", description="d", settings={})], k=2, budget=8, decision_rule="r",
            analysis=DesignAnalysis(test="mcnemar-exact-two-sided", alpha=0.01, interval="wilson-95",
                                    comparisons=[DesignComparison(first="base", second="flywheel")]))


def _script(*argv: str | Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "scripts")}
    proc = subprocess.run([sys.executable, str(SCRIPT), *map(str, argv)], capture_output=True, text=True, env=env, timeout=1800,
                          check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _verify(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str]:
    code = verify_main([*map(str, argv)])
    out, err = capsys.readouterr()
    return code, out + err


def test_the_preregistered_experiment_runs_verifies_and_refuses_departures(tmp_path: Path, key: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from kvgraft.engine import (
        Library,
        current_profile,
        load_model_for,
        run_eval,
        trust_signer,
        worked_solution,
        write_design,
    )
    from kvgraft.registry.client import RegistryClient, registry_key
    from kvgraft.registry.report import write_log_proofs
    from kvgraft.schemas import DesignRef, PreRegistrationStatement, sha256_bytes, statement_unverified
    from kvgraft.verifier import load_dataset, read_envelope

    out, work = tmp_path / "out", tmp_path / "work"
    common = (*SMALL, "--out", out, "--work", work, "--key", key)
    _script(*common, "--only", "design,library")
    # The design is logged, and no test output exists yet: the library came from the train split alone.
    assert (out / "design" / "record.dsse.json").exists() and not (out / "arms").exists()
    design = statement_unverified(read_envelope(out / "design" / "record.dsse.json"), what="design")
    assert isinstance(design, PreRegistrationStatement) and design.predicate.design is not None
    d = design.predicate.design
    assert len(d.test.doc_ids) == 4 and d.k == 2 and [a.name for a in d.arms] == ["base", "self-consistency@2", "flywheel"]
    assert design.predicate.expected_output_hashes == {}

    # A 135M model confirms few train answers in 40 tokens: the train split's own worked solutions are
    # deposited too (still grader-confirmed), so that the flywheel's graft path runs here.
    profile = current_profile("llamacpp-cpu")
    model = load_model_for("smollm2-135m", profile)
    train = load_dataset(REPO / "data" / "datasets" / "gsm8k_train.jsonl")
    library = Library.open(work / "library", model, profile, trusted=trust_signer(key, None, name="k"))
    assert d.train is not None
    for doc in d.train.doc_ids:
        assert library.deposit(train, doc, worked_solution(train, doc) or "", key=key) is not None

    _script(*common, "--only", "base,vote,flywheel,publish,table")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["preregistration"].endswith("design") and summary["missing"] == []
    assert set(summary["arms"]) == {"base", "self-consistency@2", "flywheel"}
    for row in summary["arms"].values():
        assert row["n"] == 4 and 0 <= row["correct"] <= 4 and row["decode_tokens"] > 0 and "follows its design" in row["verified"]
    # The flywheel decoded the same samples as self-consistency, and more only where they split.
    sc, fly = summary["arms"]["self-consistency@2"], summary["arms"]["flywheel"]
    extra = [f["decode_tokens"] - s["decode_tokens"] for f, s in zip(
        json.loads(statement_json(out / "arms" / "flywheel"))["items"],
        json.loads(statement_json(out / "arms" / "self-consistency@2"))["items"], strict=True)]
    assert all(x >= 0 for x in extra) and extra.count(0) == fly["unanimous"] == sc["unanimous"]
    assert fly["grafted"] == 4 - fly["unanimous"] >= 1, fly  # every split problem got a verified entry grafted
    fly_items = json.loads(statement_json(out / "arms" / "flywheel"))["items"]
    assert [i["library_entry"] is not None for i in fly_items] == [x > 0 for x in extra]  # grafted exactly where split
    assert (out / "arms" / "flywheel" / "outputs.jsonl").read_text().count("[decision]") == 4
    assert set(summary["pairs"]) == {"flywheel - self-consistency@2", "flywheel - base", "self-consistency@2 - base"}
    assert "McNemar" in (out / "README.md").read_text()

    trusted, checkpoint, reg_key = out / "trusted-keys.json", out / "checkpoint.txt", out / "registry-key.pub.pem"
    pins = ("--trusted-keys", trusted, "--checkpoint", checkpoint, "--registry-key", reg_key)
    code, text = _verify(capsys, "eval", out / "arms" / "flywheel", "--dataset", TEST, "--design", out / "design", *pins)
    assert code == 0 and "arm flywheel follows its design" in text, text
    # An arm's record checked without its design is refused, not passed on its grades alone.
    code, text = _verify(capsys, "eval", out / "arms" / "base", "--dataset", TEST, "--trusted-keys", trusted)
    assert code == 1 and "names design sha256:" in text and "needs --design DIR" in text, text

    # Two records that do not count, logged in the same registry.
    envelope = (out / "design" / "record.dsse.json").read_bytes()
    departed = tmp_path / "departed"
    run_eval(model, profile, TEST, departed, key=key, max_new_tokens=16, limit=4, seed=7, batch=4,
             design=DesignRef(envelope_digest=sha256_bytes(envelope), arm="base"))
    late_design, early = tmp_path / "late-design", tmp_path / "early"
    write_design(late_design, d, model=model, profile=profile, dataset_path=TEST, command=["a", "later", "design"], key=key)
    late = sha256_bytes((late_design / "record.dsse.json").read_bytes())
    run_eval(model, profile, TEST, early, key=key, max_new_tokens=40, limit=4, seed=7, batch=4,
             design=DesignRef(envelope_digest=late, arm="base"))
    data = work / "registry"
    with running_server(data) as server:
        r = registry_cli("--json", "token", "create", "--data", data, "--publisher", "kvgraft-capability", "--key", f"{key}.pub")
        assert r.returncode == 0, r.stderr
        token = json.loads(r.stdout)["token"]
        for directory in (departed, early, late_design):  # the early record before its design
            p = registry_cli("--json", "publish", "--registry", server.url, "--token", token, "--registry-key", reg_key, directory)
            assert p.returncode == 0, p.stderr
        with RegistryClient(server.url) as client:
            write_log_proofs(client, registry_key(client, reg_key), [out / "design", departed, early, late_design],
                             tmp_path / "checkpoint.txt")
    pins = ("--trusted-keys", trusted, "--checkpoint", tmp_path / "checkpoint.txt", "--registry-key", reg_key)
    code, text = _verify(capsys, "eval", departed, "--dataset", TEST, "--design", out / "design", *pins)
    assert code == 1 and "arm 'base' departs from its design: setting max_new_tokens is 16, the design registers 40" in text, text
    code, text = _verify(capsys, "eval", early, "--dataset", TEST, "--design", late_design, *pins)
    assert code == 1 and "the evaluation was logged before its design" in text, text
    code, text = _verify(capsys, "eval", departed, "--dataset", TEST, "--design", late_design, *pins)
    assert code == 1 and "is an arm of design" in text and "pass the design the record names" in text, text

    # A second design once test output exists is refused: the design comes first.
    proc = subprocess.run([sys.executable, str(SCRIPT), *SMALL, "--out", tmp_path / "out2", "--work", work, "--key", key,
                           "--only", "design"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO / "scripts")},
                          timeout=600, check=False, cwd=REPO)
    assert proc.returncode == 1 and "test output exists already" in proc.stderr, proc.stderr[-2000:]


def statement_json(record: Path) -> str:
    """The predicate of ``record`` as JSON text (read, not verified: the verifier did that above)."""
    from kvgraft.schemas import payload_unverified

    return json.dumps(json.loads(payload_unverified((record / "record.dsse.json").read_bytes()))["predicate"])
