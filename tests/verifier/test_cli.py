"""``kvgraft-verify`` end to end, in-process: DSSE vectors, artifacts on disk, malformed input.

Every failure must be exit 1 with exactly one line on stderr and no traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgraft.cli import main as kvgraft_main
from kvgraft.verifier import TrustedKeys, key_type_of, keyid_of, parse_public_key, trusted_key
from kvgraft.verifier.cli import ExitCode, main

from .test_dsse import VECTOR_IDS


def _run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_failure(code: int, err: str, error: str, message: str) -> None:
    assert code == ExitCode.FAILED
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"kvgraft-verify: {error}: "), lines[0]
    assert message in lines[0], lines[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("vector_id", VECTOR_IDS)
def test_dsse_vectors_through_the_command_line(
    vectors: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], vector_id: str
) -> None:
    doc = json.loads((vectors / "dsse" / "vectors.json").read_text())
    vector = next(v for v in doc["vectors"] if v["id"] == vector_id)
    keys = {n: Ed25519PrivateKey.from_private_bytes(bytes.fromhex(k["seed"])) for n, k in doc["keys"].items()}
    trust = TrustedKeys(
        tuple(trusted_key(n, keys[n].public_key()) for n in vector["trustedKeys"]),
        vector["threshold"],
        payload_types=tuple(vector["supportedPayloadTypes"]),
    )
    (tmp_path / "keys.json").write_text(json.dumps(trust.to_json()))
    (tmp_path / "env.json").write_text(json.dumps(vector["envelope"]), encoding="utf-8")
    code, out, err = _run(capsys, "envelope", tmp_path / "env.json", "--trusted-keys", tmp_path / "keys.json", "--dsse-only")
    if vector["expect"] == "accept":
        assert code == ExitCode.OK, err
        assert out.startswith("OK: DSSE envelope")
    else:
        assert code == ExitCode.FAILED
        assert len(err.splitlines()) == 1


def _signed_artifact(tmp_path: Path, capsys: pytest.CaptureFixture[str], key_type: str = "ed25519") -> dict[str, Path]:
    art = tmp_path / "artifact"
    art.mkdir()
    (art / "kv.safetensors").write_bytes(b"\x01\x02" * 1000)
    (tmp_path / "pred.json").write_text('{"note": "x"}')
    assert kvgraft_main(["keys", "generate", "--out", str(tmp_path / "k.pem"), "--type", key_type]) == 0
    assert kvgraft_main(["keys", "trust", "--file", str(tmp_path / "trust.json"), "--name", "alice",
                         "--public-key", str(tmp_path / "k.pem.pub")]) == 0
    assert kvgraft_main(["sign", "--key", str(tmp_path / "k.pem"), "--subject", str(art / "kv.safetensors"),
                         "--predicate-type", "https://example.com/note/v1", "--predicate", str(tmp_path / "pred.json"),
                         "--out", str(art / "statement.dsse.json")]) == 0
    capsys.readouterr()
    return {"dir": art, "env": art / "statement.dsse.json", "trust": tmp_path / "trust.json"}


def test_signed_artifact_verifies_and_json_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _signed_artifact(tmp_path, capsys)
    code, out, err = _run(capsys, "envelope", a["env"], "--trusted-keys", a["trust"], "--artifact-dir", a["dir"])
    assert code == 0, err
    assert out == out.splitlines()[0] + "\n"
    assert "signed by alice" in out and "1 subject file(s) match" in out
    code, out, _ = _run(capsys, "--json", "envelope", a["env"], "--trusted-keys", a["trust"])
    result: dict[str, Any] = json.loads(out)
    assert code == 0 and result["ok"] is True
    assert result["predicate_type"] == "https://example.com/note/v1"
    assert result["subjects"] == ["kv.safetensors"]


@pytest.mark.parametrize(("key_type", "label"), [("p256", "ECDSA P-256"), ("p384", "ECDSA P-384")])
def test_an_ecdsa_key_generates_signs_and_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key_type: str, label: str
) -> None:
    a = _signed_artifact(tmp_path, capsys, key_type)
    pem = (tmp_path / "k.pem.pub").read_bytes()
    public = parse_public_key(pem)
    assert key_type_of(public) == key_type
    envelope = json.loads(a["env"].read_text())
    assert envelope["signatures"][0]["keyid"] == keyid_of(public)
    code, out, err = _run(capsys, "envelope", a["env"], "--trusted-keys", a["trust"], "--artifact-dir", a["dir"])
    assert code == 0, err
    assert "signed by alice" in out and "1 subject file(s) match" in out
    # The --json output of the key commands names the type.
    assert kvgraft_main(["--json", "keys", "generate", "--out", str(tmp_path / "k2.pem"), "--type", key_type]) == 0
    generated = json.loads(capsys.readouterr().out)
    assert generated["type"] == key_type and label in generated["summary"]
    # An untrusted key of another type does not verify it.
    other = TrustedKeys((trusted_key("eve", Ed25519PrivateKey.generate().public_key()),))
    (tmp_path / "eve.json").write_text(json.dumps(other.to_json()))
    code, _, err = _run(capsys, "envelope", a["env"], "--trusted-keys", tmp_path / "eve.json")
    _one_line_failure(code, err, "UnknownKeyError", "none of the envelope's 1 signature(s) verifies")
    # A changed byte of the subject is refused as for Ed25519.
    (a["dir"] / "kv.safetensors").write_bytes(b"\x01\x03" * 1000)
    code, _, err = _run(capsys, "envelope", a["env"], "--trusted-keys", a["trust"], "--artifact-dir", a["dir"])
    _one_line_failure(code, err, "SubjectMismatchError", "kv.safetensors has digest")


def test_tampered_tensor_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _signed_artifact(tmp_path, capsys)
    data = bytearray((a["dir"] / "kv.safetensors").read_bytes())
    data[7] ^= 0x80
    (a["dir"] / "kv.safetensors").write_bytes(bytes(data))
    code, _, err = _run(capsys, "envelope", a["env"], "--trusted-keys", a["trust"], "--artifact-dir", a["dir"])
    _one_line_failure(code, err, "SubjectMismatchError", "kv.safetensors has digest")


def test_json_failure_object(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _signed_artifact(tmp_path, capsys)
    (a["dir"] / "extra.bin").write_bytes(b"")
    code, out, _ = _run(capsys, "--json", "envelope", a["env"], "--trusted-keys", a["trust"], "--artifact-dir", a["dir"])
    assert code == 1
    assert json.loads(out) == {"ok": False, "error": "SubjectMismatchError", "message": json.loads(out)["message"]}
    assert "extra.bin" in json.loads(out)["message"]


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 2])


def _replace_json(p: Path, **fields: Any) -> None:
    doc = json.loads(p.read_text())
    doc.update(fields)
    p.write_text(json.dumps(doc))


MALFORMED: list[tuple[str, Any, str, str]] = [
    ("env", lambda p: p.write_text("not json at all"), "MalformedInputError", "is not valid JSON"),
    ("env", _truncate, "MalformedInputError", "is not valid JSON"),
    ("env", lambda p: p.write_text("[]"), "MalformedInputError", "must be a JSON object"),
    ("env", lambda p: _replace_json(p, signatures="x"), "MalformedInputError", "signatures: Input should be a valid list"),
    ("env", lambda p: _replace_json(p, payload=12), "MalformedInputError", "payload: Input should be a valid string"),
    ("env", lambda p: _replace_json(p, payload="%%%%"), "MalformedInputError", "is not valid base64"),
    ("env", lambda p: _replace_json(p, payload="e30="), "BadSignatureError", "does not verify"),
    ("env", lambda p: _replace_json(p, payloadType="text/plain"), "UnsupportedPayloadTypeError", "'text/plain' is not an in-toto statement"),
    ("env", lambda p: p.write_bytes(b"\xff" * 10), "MalformedInputError", "not UTF-8"),
    ("env", lambda p: (p.unlink(), p.mkdir()), "MalformedInputError", "is a directory"),
    ("env", lambda p: p.unlink(), "MalformedInputError", "does not exist"),
    ("trust", lambda p: p.write_text("{}"), "KeyFileError", "Field required"),
    ("trust", _truncate, "KeyFileError", "is not valid JSON"),
    ("trust", lambda p: (p.unlink(), p.mkdir()), "KeyFileError", "is a directory"),
    ("trust", lambda p: _replace_json(p, threshold="1"), "KeyFileError", "threshold: Input should be a valid integer"),
]


@pytest.mark.parametrize(("target", "damage", "error", "message"), MALFORMED, ids=[f"{t}-{m}" for t, _, _, m in MALFORMED])
def test_malformed_input_is_one_line_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, damage: Any, error: str, message: str
) -> None:
    a = _signed_artifact(tmp_path, capsys)
    damage(a[target])
    code, _, err = _run(capsys, "envelope", a["env"], "--trusted-keys", a["trust"], "--artifact-dir", a["dir"])
    _one_line_failure(code, err, error, message)


def test_invalid_statement_inside_a_good_signature(tmp_path: Path, capsys: pytest.CaptureFixture[str], vectors: Path) -> None:
    # The DSSE vector's payload is signed but is not a complete in-toto statement.
    doc = json.loads((vectors / "dsse" / "vectors.json").read_text())
    vector = doc["vectors"][0]
    key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(doc["keys"]["A"]["seed"]))
    (tmp_path / "keys.json").write_text(json.dumps(TrustedKeys((trusted_key("A", key.public_key()),)).to_json()))
    (tmp_path / "env.json").write_text(json.dumps(vector["envelope"]))
    code, _, err = _run(capsys, "envelope", tmp_path / "env.json", "--trusted-keys", tmp_path / "keys.json")
    _one_line_failure(code, err, "MalformedInputError", "subject: Field required")


def test_a_file_where_the_artifact_directory_belongs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = _signed_artifact(tmp_path, capsys)
    code, _, err = _run(capsys, "envelope", a["env"], "--trusted-keys", a["trust"], "--artifact-dir", a["env"])
    _one_line_failure(code, err, "MalformedInputError", "is not a directory")
