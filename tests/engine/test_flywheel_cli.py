"""The flywheel's commands end to end on the tiny model: deposit, ask, eval, pre-registration,
replay and report against a real registry server on 127.0.0.1, each checked by the standalone
verifier; and the commands' one-line refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvgraft.cli import main
from kvgraft.verifier.cli import main as verify_main

from ..registry.conftest import registry_cli, running_server

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "data" / "datasets"


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, dict[str, Any], str]:
    code = main(["--json", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, json.loads(out.strip().splitlines()[-1]), err


def _verify(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, str]:
    code = verify_main([*map(str, argv)])
    out, err = capsys.readouterr()
    return code, out + err


@pytest.fixture()
def trust(tmp_path: Path, key: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    path = tmp_path / "trusted-keys.json"
    assert main(["keys", "trust", "--file", str(path), "--name", "alice", "--public-key", str(key.with_name("k.pem.pub"))]) == 0
    capsys.readouterr()
    return path


def _subset(tmp_path: Path, source: Path, n: int) -> Path:
    path = tmp_path / source.name
    path.write_text("".join(source.read_text().splitlines(keepends=True)[:n]))
    return path


def test_deposit_ask_eval_prereg_replay_report_audit(tmp_path: Path, key: Path, trust: Path, capsys: pytest.CaptureFixture[str]) -> None:
    train = _subset(tmp_path, DATA / "gsm8k_train.jsonl", 3)
    data = tmp_path / "registry"
    with running_server(data) as server:
        r = registry_cli("--json", "token", "create", "--data", data, "--publisher", "alice", "--key", key.with_name("k.pem.pub"))
        assert r.returncode == 0, r.stderr
        token = json.loads(r.stdout)["token"]
        pin = ["--registry", server.url, "--token", token, "--registry-key", data / "registry-key.pub.pem"]
        lib = tmp_path / "lib"

        code, dep, err = _run(capsys, "library", "deposit", "--model", "tiny-llama-test", "--dataset", train,
                              "--library", lib, "--key", key, *pin)
        assert code == 0, err
        assert (dep["deposited"], dep["refused"], dep["published"]) == (3, [], 4)  # the prefix and 3 entries

        question = json.loads(train.read_text().splitlines()[1])["question"]
        code, ans, err = _run(capsys, "ask", "--library", lib, "--question", question, "--trusted-keys", trust)
        assert code == 0, err
        assert ans["method"] == "exact" and 1 <= ans["decode_tokens"] <= 16 and ans["energy_method"] in ("measured", "estimated")

        ev = tmp_path / "eval"
        code, res, err = _run(capsys, "eval", "--model", "tiny-llama-test", "--dataset", train, "--library", lib,
                              "--max-new-tokens", "8", "--out", ev, "--key", key, "--trusted-keys", trust)
        assert code == 0, err
        assert res["items"] == 3 and res["decode_tokens"] <= 3 * 16
        code, out = _verify(capsys, "eval", ev, "--dataset", train, "--trusted-keys", trust)
        assert code == 0 and "every hash, grade and aggregate recomputed" in out, out

        prereg, replay = tmp_path / "prereg", tmp_path / "replay"
        code, pr, err = _run(capsys, "prereg", "--eval", ev, "--dataset", train, "--library", lib, "--out", prereg, "--key", key, *pin)
        assert code == 0, err
        code, rp, err = _run(capsys, "replay", "--pre-registration", prereg, "--out", replay, "--key", key, *pin,
                             "--trusted-keys", trust)
        assert code == 0, err
        assert rp["reproduced"] is True and rp["pre_registration_log_index"] == pr["log_index"] < rp["replay_log_index"]
        code, out = _verify(capsys, "replay", replay, "--pre-registration", prereg, "--trusted-keys", trust,
                            "--checkpoint", rp["checkpoint"], "--registry-key", data / "registry-key.pub.pem")
        assert code == 0, out

        code, pub, err = _run(capsys, "publish", *pin, ev)
        assert code == 0, err
        report = tmp_path / "report"
        code, rep, err = _run(capsys, "report", "--registry", server.url, "--registry-key", data / "registry-key.pub.pem",
                              "--out", report, "--trusted-keys", trust, "--dataset", train)
        assert code == 0, err
        assert rep["entries"] == {"artifacts": 4, "pre-registrations": 1, "replays": 1, "evaluations": 1}
    outside = ("--trusted-keys", trust, "--registry-key", data / "registry-key.pub.pem")
    code, out = _verify(capsys, "audit", report, *outside)
    assert code == 0, out
    assert "REFUTED" not in out and "accuracy" in out and "reproduced" in out

    # One flipped grade in the pulled evaluation: the audit names it.
    rec = next((report / "evaluations").iterdir())
    outputs = rec / "outputs.jsonl"
    lines = outputs.read_bytes().splitlines(keepends=True)
    first = json.loads(lines[0])
    first["output"] += " 12345"
    from kvgraft.schemas import canonical_json

    outputs.write_bytes(canonical_json(first) + b"\n" + b"".join(lines[1:]))
    code, out = _verify(capsys, "audit", report, *outside)
    assert code == 1 and "REFUTED" in out, out


def test_base_eval_record_verifies_and_altered_outputs_are_refused(tmp_path: Path, key: Path, trust: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    aime = _subset(tmp_path, DATA / "aime2025.jsonl", 2)
    ev = tmp_path / "eval"
    code, res, err = _run(capsys, "eval", "--model", "tiny-llama-test", "--dataset", aime, "--max-new-tokens", "4", "--out", ev, "--key", key)
    assert code == 0, err
    assert res["items"] == 2 and res["decode_tokens"] <= 8 and res["prompt_tokens"] > 100
    assert _verify(capsys, "eval", ev, "--dataset", aime, "--trusted-keys", trust)[0] == 0
    altered = tmp_path / "altered"
    shutil.copytree(ev, altered)
    (altered / "outputs.jsonl").write_bytes((altered / "outputs.jsonl").read_bytes().replace(b'"output":"', b'"output":"7', 1))
    code, out = _verify(capsys, "eval", altered, "--dataset", aime, "--trusted-keys", trust)
    assert code == 1 and "outputs.jsonl" in out, out
    # Writing over an existing record is refused, and nothing is changed.
    before = (ev / "record.dsse.json").read_bytes()
    code, res, err = _run(capsys, "eval", "--model", "tiny-llama-test", "--dataset", aime, "--max-new-tokens", "4", "--out", ev, "--key", key)
    assert code == 1 and "already exists and is not an empty directory" in err
    assert (ev / "record.dsse.json").read_bytes() == before


def test_refusals_are_one_line(tmp_path: Path, key: Path, capsys: pytest.CaptureFixture[str]) -> None:
    aime = _subset(tmp_path, DATA / "aime2025.jsonl", 2)
    code, res, err = _run(capsys, "library", "deposit", "--model", "tiny-llama-test", "--dataset", aime, "--library", tmp_path / "l", "--key", key)
    assert code == 1 and "holds no worked solutions" in err and "--solutions-from-key" in err
    assert err.count("\n") == 1
    code, res, err = _run(capsys, "ask", "--library", tmp_path / "nowhere", "--question", "2+2?")
    assert code == 1 and "is not a library" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "x"}\n')
    code, res, err = _run(capsys, "eval", "--model", "tiny-llama-test", "--dataset", bad, "--out", tmp_path / "e", "--key", key)
    assert code == 1 and err.startswith("kvgraft: ") and err.count("\n") == 1, err
    assert not (tmp_path / "e").exists()


def test_eval_batch_and_library_entry_on_the_command_line(tmp_path: Path, key: Path, trust: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    gsm8k = _subset(tmp_path, DATA / "gsm8k_test.jsonl", 3)
    train = tmp_path / "train.jsonl"
    train.write_text("".join((DATA / "gsm8k_train.jsonl").read_text().splitlines(keepends=True)[:2]))
    lib = tmp_path / "lib"
    code, res, err = _run(capsys, "library", "deposit", "--model", "tiny-llama-test", "--dataset", train, "--library", lib, "--key", key)
    assert code == 0 and res["deposited"] == 2, err
    entry = json.loads((lib / "index.jsonl").read_text().splitlines()[1])["artifact"]
    ev = tmp_path / "fixed"
    code, res, err = _run(capsys, "eval", "--model", "tiny-llama-test", "--dataset", gsm8k, "--library", lib, "--library-entry", entry,
                          "--batch", "2", "--max-new-tokens", "4", "--out", ev, "--key", key, "--trusted-keys", trust)
    assert code == 0 and res["items"] == 3, err
    assert _verify(capsys, "eval", ev, "--dataset", gsm8k, "--trusted-keys", trust)[0] == 0
    from kvgraft.engine._internal.evaluate import eval_command, read_record
    from kvgraft.schemas import EvaluationStatement

    _, statement = read_record(ev, EvaluationStatement)
    command = eval_command(statement, gsm8k, lib)
    assert command[command.index("--library-entry") + 1] == entry and command[command.index("--batch") + 1] == "2"
    # Refusals: no library for the entry, a malformed digest.
    code, res, err = _run(capsys, "eval", "--model", "tiny-llama-test", "--dataset", gsm8k, "--library-entry", entry,
                          "--out", tmp_path / "e", "--key", key)
    assert code == 1 and "no --library was given" in err and "pass --library DIR" in err and err.count("\n") == 1, err
    code, res, err = _run(capsys, "eval", "--model", "tiny-llama-test", "--dataset", gsm8k, "--library", lib, "--library-entry", "abc",
                          "--out", tmp_path / "e", "--key", key, "--trusted-keys", trust)
    assert code == 1 and "--library-entry: 'abc' is not a sha256 digest" in err, err
    assert not (tmp_path / "e").exists()


def test_eval_library_profile_conflict_regression_a_conflicting_profile_or_model_is_refused_not_ignored(
        tmp_path: Path, key: Path, trust: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Was: `eval --library DIR --profile P` ran under the library's profile and ignored P unsaid,
    # so a record could claim a profile the user did not ask for.
    train = tmp_path / "train.jsonl"
    train.write_text("".join((DATA / "gsm8k_train.jsonl").read_text().splitlines(keepends=True)[:1]))
    lib = tmp_path / "lib"
    code, res, err = _run(capsys, "library", "deposit", "--model", "tiny-llama-test", "--dataset", train, "--library", lib,
                          "--profile", "cpu-fp32-sdpa", "--key", key)
    assert code == 0 and res["deposited"] == 1, err
    common = ["--dataset", train, "--library", lib, "--max-new-tokens", "2", "--out", tmp_path / "e", "--key", key, "--trusted-keys", trust]
    code, res, err = _run(capsys, "eval", "--model", "tiny-llama-test", "--profile", "eager", *common)
    assert code == 1 and "was deposited under the profile cpu-fp32-sdpa, not cpu-fp32" in err, err
    assert "pass --profile cpu-fp32-sdpa (a library's state grafts only under its own profile)" in err and err.count("\n") == 1, err
    code, res, err = _run(capsys, "eval", "--model", "smollm2-135m", *common)
    assert code == 1 and "holds tiny-llama-test state, not smollm2-135m" in err and "pass --model tiny-llama-test" in err, err
    assert not (tmp_path / "e").exists()
    # The library's own profile, by name or alias, is no conflict.
    code, res, err = _run(capsys, "eval", "--model", "tiny-llama-test", "--profile", "sdpa", *common)
    assert code == 0 and res["items"] == 1, err


def test_ask_json_kinds_regression_deposited_questions_are_recalled_and_unrelated_ones_never(
        tmp_path: Path, key: Path, trust: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Was: an unrelated question came back with `answer` set from a grafted AIME entry, in the same
    # shape as a verified recall (issue 39).
    train = _subset(tmp_path, DATA / "gsm8k_train.jsonl", 3)
    lib = tmp_path / "lib"
    code, dep, err = _run(capsys, "library", "deposit", "--model", "tiny-llama-test", "--dataset", train, "--library", lib,
                          "--key", key)
    assert code == 0 and dep["deposited"] == 3, err
    for row in map(json.loads, train.read_text().splitlines()):
        code, ans, err = _run(capsys, "ask", "--library", lib, "--question", row["question"], "--trusted-keys", trust)
        assert code == 0, err
        assert (ans["kind"], ans["answer"], ans["finished"]) == ("recalled", row["answer"].rsplit("#### ", 1)[1], True)
        assert 1 <= ans["decode_tokens"] <= 16 and ans["text"] == "\\boxed{" + ans["answer"] + "}"
        assert ans["summary"].startswith(f"recalled (verified): {ans['answer']} ")
    for question in ("What is the capital of France?", "Write a haiku about the sea.", "How many legs does a spider have?"):
        code, ans, err = _run(capsys, "ask", "--library", lib, "--question", question, "--max-new-tokens", "6",
                              "--trusted-keys", trust)
        assert code == 0, err
        assert (ans["kind"], ans["entry"]) == ("unassisted", None) and ans["summary"].startswith(("unverified answer: ", "no answer: "))
        assert "recalled" not in ans["summary"]


def test_eval_sampling_options_on_the_command_line(tmp_path: Path, key: Path, trust: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    gsm8k = _subset(tmp_path, DATA / "gsm8k_test.jsonl", 2)
    common = ["--model", "tiny-llama-test", "--dataset", gsm8k, "--max-new-tokens", "4", "--key", key]
    code, res, err = _run(capsys, "eval", *common, "--temperature", "0.8", "--out", tmp_path / "e")
    assert code == 1 and "reproducible only from its seed" in err and "pass --sample-seed N" in err and err.count("\n") == 1, err
    code, res, err = _run(capsys, "eval", *common, "--top-p", "0.5", "--out", tmp_path / "e")
    assert code == 1 and "--temperature is 0 (greedy decoding)" in err, err
    code, res, err = _run(capsys, "eval", *common, "--temperature", "3", "--sample-seed", "1", "--out", tmp_path / "e")
    assert code == 1 and "temperature 3.0 is not between 0 and 2" in err, err
    assert not (tmp_path / "e").exists()
    ev = tmp_path / "sampled"
    code, res, err = _run(capsys, "eval", *common, "--temperature", "0.8", "--top-p", "0.9", "--sample-seed", "3", "--out", ev)
    assert code == 0 and res["items"] == 2, err
    assert _verify(capsys, "eval", ev, "--dataset", gsm8k, "--trusted-keys", trust)[0] == 0
    settings = json.loads(__import__("base64").b64decode(json.loads((ev / "record.dsse.json").read_text())["payload"]))["predicate"]["settings"]
    assert (settings["temperature"], settings["top_p"], settings["sample_seed"]) == (0.8, 0.9, 3)
