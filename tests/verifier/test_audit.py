"""``kvgraft-verify audit``: a whole report folder (artifact, exactness record, evaluations,
pre-registered replay, summary claims, one signed checkpoint) built with the real signing and
log code; every number confirmed on the honest folder, and each tampering refuted by name
while the other records are still confirmed."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvgraft.schemas import (
    ExactnessPredicate,
    ExactnessSample,
    ExactnessStatement,
    ExactnessSummary,
    LogitsFiles,
    canonical_json,
    sha256_bytes,
)
from kvgraft.verifier import (
    AuditReport,
    UnknownKeyError,
    audit_report,
    compare_logits,
    load_dataset,
    load_trusted_keys,
    logits_file_name,
)
from kvgraft.verifier.cli import ExitCode, main

from ..schemas.fixtures import kv_artifact_statement
from .test_eval import AIME, GSM8K, Publisher, answers, build_eval, make_publisher, model_ref, profile, sign_to, subject
from .test_replay import Log, scenario

GSM_DOCS = [0, 5, 17, 3]
AIME_DOCS = [0, 1, 2]


def build_exactness(directory: Path, publisher: Publisher) -> None:
    """An own-position exactness record over two samples whose logits are bitwise equal."""
    rng = np.random.default_rng(7)
    samples, files = [], {}
    for index in range(2):
        logits = rng.standard_normal((3, 11)).astype("<f4")
        data = logits.tobytes()
        digest = sha256_bytes(data)
        files[logits_file_name(digest)] = data
        got = compare_logits(logits, logits.copy())
        samples.append(ExactnessSample(
            index=index, prefix_artifact=sha256_bytes(b"prefix"), prefix_tokens=4,
            continuation_digest=sha256_bytes(canonical_json([1, 2, 3])), continuation_tokens=3,
            fresh_logits_sha256=digest, graft_logits_sha256=digest, bitwise_equal=True,
            kl_divergence=got.kl_divergence, argmax_agreement=got.argmax_agreement,
            logits_files=LogitsFiles(fresh=digest, graft=digest),
        ))
    (directory / "logits").mkdir(parents=True)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    statement = ExactnessStatement(
        subject=[subject(name, data) for name, data in sorted(files.items())],
        predicate=ExactnessPredicate(
            model=model_ref(), profile=profile(), level="own-position", vocab_size=11, seed=7, samples=samples,
            summary=ExactnessSummary(samples=2, bitwise_equal=2, argmax_agree_all=2, max_kl_divergence=0.0, mean_argmax_agreement=1.0),
        ),
    )
    sign_to(directory / "record.dsse.json", statement, publisher)


def build_report(
    root: Path,
    *,
    edit_item: Callable[[int, dict[str, Any]], None] | None = None,
    edit_aggregates: Callable[[dict[str, Any]], None] | None = None,
    claims: list[dict[str, Any]] | None = None,
    replay_first: bool = False,
) -> Path:
    """A complete report folder; the edits make the GSM8K evaluation's producer dishonest."""
    pub = make_publisher(root / "keys")
    report = root / "report"
    report.mkdir()
    shutil.copy(pub.trust_file, report / "trusted-keys.json")
    (report / "datasets").mkdir()
    for ds in (GSM8K, AIME):
        shutil.copy(ds, report / "datasets" / ds.name)
    log = Log()
    logged: list[tuple[int, Path]] = []

    art = report / "artifacts" / "prefix"
    art.mkdir(parents=True)
    (art / "kv.safetensors").write_bytes(b"tensors")  # the fixture statement's subject bytes
    logged.append((log.append(sign_to(art / "statement.dsse.json", kv_artifact_statement(), pub)), art))

    ex = report / "exactness" / "tiny"
    build_exactness(ex, pub)
    logged.append((log.append((ex / "record.dsse.json").read_bytes()), ex))

    gsm = build_eval(report / "evaluations" / "gsm8k", GSM8K, answers(GSM8K, GSM_DOCS), pub,
                     edit_item=edit_item, edit_aggregates=edit_aggregates)
    logged.append((log.append((gsm / "record.dsse.json").read_bytes()), gsm))
    build_eval(report / "evaluations" / "aime", AIME, answers(AIME, AIME_DOCS), pub)

    # Last: the replay scenario publishes the final checkpoint and writes its own two proofs.
    scenario(report, publisher=pub, log=log, prereg_name="pre-registrations/p1", replay_name="replays/r1", replay_first=replay_first)
    for index, d in logged:
        log.write_proof(index, d / "log.json")
    # The auditor's own copy of the registry key, from outside the folder (see ``audit``).
    shutil.copy(report / "registry-key.pub.pem", root / "keys" / "registry-key.pub.pem")
    if claims is not None:
        (report / "summary.json").write_text(json.dumps({"claims": claims}))
    return report


def audit(report_dir: Path) -> AuditReport:
    """Audit with the publisher's and the registry's keys from outside the folder (``keys/``
    beside it), as an auditor does."""
    keys = report_dir.parent / "keys"
    return audit_report(
        report_dir, trusted_keys=load_trusted_keys(keys / "alice-trusted-keys.json"), registry_key=keys / "registry-key.pub.pem"
    )


def outside_options(report_dir: Path) -> list[str]:
    """``audit``'s keys as ``kvgraft-verify audit`` options."""
    keys = report_dir.parent / "keys"
    return ["--trusted-keys", str(keys / "alice-trusted-keys.json"), "--registry-key", str(keys / "registry-key.pub.pem")]


def _lines(report: AuditReport) -> list[str]:
    return [line.render() for line in report.lines]


def _refuted(report: AuditReport, what: str) -> str:
    hits = [line.render() for line in report.refuted if line.what == what]
    assert hits, _lines(report)
    return hits[0]


def test_an_honest_report_confirms_every_number(tmp_path: Path) -> None:
    ds = load_dataset(GSM8K)
    right = len(GSM_DOCS[::2])
    claims = [
        {"what": "GSM8K accuracy", "value": right / len(GSM_DOCS), "source": "evaluations/gsm8k", "field": "aggregates.accuracy"},
        {"what": "GSM8K dataset", "value": ds.digest, "source": "evaluations/gsm8k", "field": "dataset.digest"},
        {"what": "replay reproduced", "value": True, "source": "replays/r1", "field": "reproduced"},
        {"what": "first item correct", "value": True, "source": "evaluations/gsm8k", "field": "items.0.correct"},
    ]
    report = audit(build_report(tmp_path, claims=claims))
    lines = _lines(report)
    assert report.refuted == (), lines
    for expected in (
        f"CONFIRMED evaluations/gsm8k items {len(GSM_DOCS)}",
        f"CONFIRMED evaluations/gsm8k correct {right}",
        f"CONFIRMED evaluations/gsm8k accuracy {right / len(GSM_DOCS)!r}",
        f"CONFIRMED evaluations/aime items {len(AIME_DOCS)}",
        "CONFIRMED exactness/tiny bitwise_equal 2",
        "CONFIRMED replays/r1 reproduced true",
        "CONFIRMED replays/r1 outputs 3",
        f"CONFIRMED GSM8K accuracy {right / len(GSM_DOCS)!r}",
        "CONFIRMED replay reproduced true",
        "CONFIRMED first item correct true",
    ):
        assert expected in lines, (expected, lines)
    # every logged envelope's inclusion was checked
    for d in ("artifacts/prefix", "exactness/tiny", "evaluations/gsm8k", "pre-registrations/p1", "replays/r1"):
        assert any(line.startswith(f"CONFIRMED {d} log inclusion, index ") for line in lines), (d, lines)
    report.require_all_confirmed()


def test_a_flipped_grade_is_refused_and_the_rest_still_confirmed(tmp_path: Path) -> None:
    def flip(k: int, item: dict[str, Any]) -> None:
        if k == 1:
            item["correct"] = True

    report = audit(build_report(tmp_path, edit_item=flip))
    line = _refuted(report, "evaluations/gsm8k")
    assert f"ClaimMismatchError: item 1 (doc {GSM_DOCS[1]}): correct claimed true, re-graded false" in line
    assert f"CONFIRMED evaluations/aime items {len(AIME_DOCS)}" in _lines(report)
    assert len(report.refuted) == 1
    with pytest.raises(Exception, match=r"refuted 1 of \d+ checks, first evaluations/gsm8k: ClaimMismatchError: item 1"):
        report.require_all_confirmed()


def test_an_altered_aggregate_is_refused(tmp_path: Path) -> None:
    def inflate(a: dict[str, Any]) -> None:
        a["decode_tokens"] -= 1

    report = audit(build_report(tmp_path, edit_aggregates=inflate))
    assert "ClaimMismatchError: aggregate decode_tokens claimed" in _refuted(report, "evaluations/gsm8k")


def test_an_altered_output_byte_is_refused(tmp_path: Path) -> None:
    report_dir = build_report(tmp_path)
    out = report_dir / "evaluations" / "aime" / "outputs.jsonl"
    out.write_bytes(out.read_bytes().replace(b"step by step", b"step by steq", 1))
    report = audit(report_dir)
    assert "SubjectMismatchError: outputs.jsonl has digest" in _refuted(report, "evaluations/aime")


def test_a_wrong_summary_claim_is_refused(tmp_path: Path) -> None:
    right = len(GSM_DOCS[::2]) / len(GSM_DOCS)
    claims = [{"what": "GSM8K accuracy", "value": 0.9, "source": "evaluations/gsm8k", "field": "aggregates.accuracy"}]
    report = audit(build_report(tmp_path, claims=claims))
    assert _refuted(report, "GSM8K accuracy") == (
        f"REFUTED GSM8K accuracy: ClaimMismatchError: the summary claims 0.9, but evaluations/gsm8k aggregates.accuracy is {right!r}"
    )


def test_a_claim_about_a_refuted_record_is_refused(tmp_path: Path) -> None:
    def lie(a: dict[str, Any]) -> None:
        a["accuracy"] = 1.0

    claims = [{"what": "GSM8K accuracy", "value": 1.0, "source": "evaluations/gsm8k", "field": "aggregates.accuracy"}]
    report = audit(build_report(tmp_path, edit_aggregates=lie, claims=claims))
    assert "its source evaluations/gsm8k is not a record that verified" in _refuted(report, "GSM8K accuracy")


def test_a_missing_proof_is_refused(tmp_path: Path) -> None:
    report_dir = build_report(tmp_path)
    (report_dir / "pre-registrations" / "p1" / "log.json").unlink()
    report = audit(report_dir)
    assert "LogProofError: the pre-registration has no inclusion proof" in _refuted(report, "replays/r1")
    assert "has no inclusion proof" in _refuted(report, "pre-registrations/p1 log inclusion")


def test_a_swapped_log_order_is_refused(tmp_path: Path) -> None:
    report = audit(build_report(tmp_path, replay_first=True))
    assert "ClaimMismatchError: replay logged before its pre-registration" in _refuted(report, "replays/r1")


def test_a_proof_of_another_entry_is_refused(tmp_path: Path) -> None:
    report_dir = build_report(tmp_path)
    shutil.copy(report_dir / "artifacts" / "prefix" / "log.json", report_dir / "evaluations" / "gsm8k" / "log.json")
    report = audit(report_dir)
    assert "LogProofError: evaluations/gsm8k/record.dsse.json: the inclusion proof for leaf 0" in _refuted(report, "evaluations/gsm8k log inclusion")


def test_an_altered_dataset_line_is_refused(tmp_path: Path) -> None:
    report_dir = build_report(tmp_path)
    ds = report_dir / "datasets" / GSM8K.name
    ds.write_bytes(ds.read_bytes().replace(b"#### 18", b"#### 19", 1))
    report = audit(report_dir)
    assert "MalformedInputError: no dataset with digest" in _refuted(report, "evaluations/gsm8k")


def test_altered_logits_are_refused(tmp_path: Path) -> None:
    report_dir = build_report(tmp_path)
    victim = sorted((report_dir / "exactness" / "tiny" / "logits").iterdir())[0]
    data = bytearray(victim.read_bytes())
    data[0] ^= 1
    victim.write_bytes(bytes(data))
    line = _refuted(audit(report_dir), "exactness/tiny")
    assert f"SubjectMismatchError: logits/{victim.name} has digest" in line
    assert "kvgraft-audit-" not in line  # the temporary copy's path never leaks into the report


# --- command line --------------------------------------------------------------------------


def test_cli_audit_prints_one_line_per_number_and_exit_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report_dir = build_report(tmp_path)
    assert main(["audit", str(report_dir), *outside_options(report_dir)]) == ExitCode.OK
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert err == ""
    assert all(line.startswith("CONFIRMED ") for line in lines[:-1]), lines
    assert lines[-1] == f"OK: audit of {report_dir}: all {len(lines) - 1} checks confirmed"
    assert main(["--json", "audit", str(report_dir), *outside_options(report_dir)]) == ExitCode.OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["refuted"] == [] and len(doc["confirmed"]) == len(lines) - 1


def test_cli_audit_refuted_is_exit_1_with_one_stderr_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def flip(k: int, item: dict[str, Any]) -> None:
        if k == 0:
            item["extracted_answer"] = None

    report_dir = build_report(tmp_path, edit_item=flip)
    assert main(["audit", str(report_dir), *outside_options(report_dir)]) == ExitCode.FAILED
    out, err = capsys.readouterr()
    assert "REFUTED evaluations/gsm8k: ClaimMismatchError: item 0 (doc 0): extracted_answer claimed null" in out
    assert err.splitlines() == [f"kvgraft-verify: AuditRefuted: audit of {report_dir}: 1 refuted, {out.count('CONFIRMED ')} confirmed"]


def test_cli_audit_of_an_empty_folder_is_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["audit", str(tmp_path / "empty")]) == ExitCode.FAILED
    out, err = capsys.readouterr()
    assert "REFUTED empty: no records to audit" in out
    assert len(err.splitlines()) == 1


def test_cli_audit_of_a_missing_folder_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", str(tmp_path / "nowhere")]) == ExitCode.FAILED
    err = capsys.readouterr().err
    assert err.startswith("kvgraft-verify: MalformedInputError: report folder ") and len(err.splitlines()) == 1


# --- trust from outside the folder (issue 37) ------------------------------------------------------


def test_audit_regression_keys_inside_the_folder_were_trusted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Was: the folder's own trusted-keys.json and registry-key.pub.pem were the audit's trust, so
    # a forger's key labelled "alice" beside the forger's records gave "CONFIRMED ... signed by
    # alice" and exit 0. Now what rests only on keys from inside the folder is UNCONFIRMED.
    forged = build_report(tmp_path / "forger")
    report = audit_report(forged)
    lines = _lines(report)
    assert report.refuted == (), lines
    assert "UNCONFIRMED artifacts/prefix signed by alice" in lines
    assert any(line.startswith("UNCONFIRMED replays/r1 log order") for line in lines), lines
    assert report.inside_keys == ("trusted-keys.json", "registry-key.pub.pem")
    # Only plain file digests (the datasets) are confirmed without outside keys.
    assert report.confirmed and all(line.what.startswith("datasets/") for line in report.confirmed), lines
    with pytest.raises(UnknownKeyError, match="rest only on trusted-keys.json and registry-key.pub.pem from inside the folder"):
        report.require_all_confirmed()

    assert main(["audit", str(forged)]) == ExitCode.FAILED
    out, err = capsys.readouterr()
    assert "CONFIRMED artifacts/prefix signed by" not in out.replace("UNCONFIRMED", "")
    assert out.splitlines()[-1].startswith(f"UNCONFIRMED: audit of {forged}: ")
    assert err.startswith(f"kvgraft-verify: AuditUnconfirmed: audit of {forged}: ") and len(err.splitlines()) == 1
    assert "pass --trusted-keys FILE (the publishers' keys, from them) and --registry-key PEM" in err

    # With the real alice's keys from outside, the forger's signatures are refused by name.
    real = make_publisher(tmp_path / "real")
    assert main(["audit", str(forged), "--trusted-keys", str(real.trust_file)]) == ExitCode.FAILED
    out, err = capsys.readouterr()
    assert "REFUTED artifacts/prefix: UnknownKeyError: " in out
    assert "CONFIRMED artifacts/prefix signed by" not in out
    assert err.startswith("kvgraft-verify: AuditRefuted: ")


def test_audit_regression_registry_key_inside_the_folder_was_trusted(tmp_path: Path) -> None:
    report_dir = build_report(tmp_path)
    keys = tmp_path / "keys"
    # Publisher keys from outside, the registry key only from inside: the log checks are unconfirmed.
    report = audit_report(report_dir, trusted_keys=load_trusted_keys(keys / "alice-trusted-keys.json"))
    assert report.refuted == ()
    assert report.inside_keys == ("registry-key.pub.pem",)
    assert "CONFIRMED artifacts/prefix signed by alice" in _lines(report)
    assert any(line.render().startswith("UNCONFIRMED artifacts/prefix log inclusion, index") for line in report.unconfirmed)
    with pytest.raises(UnknownKeyError, match="rest only on registry-key.pub.pem from inside the folder"):
        report.require_all_confirmed()
    # A forger's checkpoint and registry key in the folder are refused against the real key.
    Log().publish(report_dir)
    report = audit(report_dir)
    assert "LogProofError" in _refuted(report, "checkpoint.txt")
    assert not any("log inclusion" in line.what for line in report.confirmed)
