"""Regression tests for issue 37's surface findings (subject names, audit trust, trailers, the S3
budget, ``serve --data``, tampered local copies, file modes, messages), each named after its bug."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgraft.schemas import DocumentError, canonical_json, check_subject_names, parse_statement
from kvgraft.verifier import envelope_json, ephemeral_signing_key, sign_envelope
from tests.registry.conftest import Key, artifact, harness

# --- subject names that cannot be files ------------------------------------------------------------

#: (subject names, what the refusal says): each was accepted (201) and then broke `kvgraft report`.
BAD_SUBJECTS = {
    "file-and-folder": (["kv.safetensors", "x", "x/y"], "is a file, and subject 'x/y' needs it to be a folder"),
    "envelope-name": (["kv.safetensors", "statement.dsse.json"], "takes the place of statement.dsse.json"),
    "log-proof-name": (["kv.safetensors", "log.json/a"], "takes the place of log.json"),
    "long-component": (["kv.safetensors", "a" * 300], "has a part of 300 bytes; the limit is 255"),
    "nul": (["kv.safetensors", "a\0b"], "holds a NUL, control character or backslash"),
    "2000-levels": (["kv.safetensors", "/".join(["d"] * 2000)], "bytes long; the limit is 1024"),
    "deep": (["kv.safetensors", "/".join(["d"] * 17)], "is 17 levels deep; the limit is 16"),
    "case-clash": (["kv.safetensors", "Kv.Safetensors"], "are the same file on some file systems"),
}


def _raw_envelope(key: Key, names: list[str]) -> bytes:
    """A signed artifact envelope whose statement names ``names`` (built as raw JSON: the typed
    model refuses them)."""
    statement = json.loads(canonical_json(artifact("names").statement.model_dump(mode="json", by_alias=True)))
    statement["subject"] = [{"name": n, "digest": {"sha256": "ab" * 32}} for n in names]
    with ephemeral_signing_key(key.private) as signer:
        return envelope_json(sign_envelope(json.dumps(statement).encode(), [signer]))


@pytest.mark.parametrize(("names", "message"), BAD_SUBJECTS.values(), ids=BAD_SUBJECTS.keys())
def test_publish_regression_subject_names_that_cannot_be_files_were_201(
    tmp_path: Path, rkeys: dict[str, Key], names: list[str], message: str
) -> None:
    # Was: 201, after which `kvgraft report` over the entry failed (a RecursionError traceback for
    # 2,000 levels). Now the one subject-name rule refuses it at publish: 422 naming the problem.
    with harness(tmp_path / "data", rkeys) as reg:
        r = reg.publish(_raw_envelope(rkeys["alice"], names))
        assert r.status_code == 422, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
        assert message in r.json()["detail"], r.json()
        assert reg.client.get("/v1/entries").json()["items"] == []


@pytest.mark.parametrize(("names", "message"), BAD_SUBJECTS.values(), ids=BAD_SUBJECTS.keys())
def test_subject_name_rule_regression_one_rule_for_parse_and_writers(names: list[str], message: str) -> None:
    # The same rule refuses the statement when parsed (every reader) and the names themselves
    # (every writer: the staged-directory writer and the client's paths call it too).
    with pytest.raises(DocumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_subject_names(names)
    statement = json.loads(canonical_json(artifact("names").statement.model_dump(mode="json", by_alias=True)))
    statement["subject"] = [{"name": n, "digest": {"sha256": "ab" * 32}} for n in names]
    with pytest.raises(DocumentError, match="subject"):
        parse_statement(json.dumps(statement).encode())


def test_subject_name_rule_regression_real_names_still_pass() -> None:
    check_subject_names(["kv.safetensors", "logits/" + "ab" * 32 + ".f32", "outputs.jsonl", "model.sig"])
