"""The engine's command line: models list, capture/graft/fresh JSON, exit codes, and the
exactness record re-checked by kvgraft-verify (accepted, then refused when tampered)."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvgraft.cli import main
from kvgraft.schemas import canonical_json
from kvgraft.verifier import ephemeral_signing_key, load_private_key, sign_envelope
from kvgraft.verifier.cli import main as verify_main


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, dict[str, Any] | None, str]:
    code = main(["--json", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out.strip() else None), err


def test_models_list(capsys: pytest.CaptureFixture[str]) -> None:
    code, result, _ = _run(capsys, "models", "list")
    assert code == 0 and result is not None
    names = {m["name"]: m for m in result["models"]}
    assert set(names) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "tiny-llama-test"}
    assert names["gemma3-270m"]["window"] == 32768 and names["gemma3-270m"]["architecture"] == "gemma3"
    assert names["smollm2-135m"]["fingerprint"].startswith("gguf sha256:b179c952")
    assert names["qwen2.5-coder-0.5b"]["architecture"] == "qwen2" and names["qwen2.5-coder-0.5b"]["installed"] is True
    assert names["qwen2.5-coder-1.5b"]["fingerprint"] == "gguf sha256:cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert names["tiny-llama-test"]["cached"] is True
    # A model that is not installed says how to install it, in the table too.
    for m in names.values():
        assert (m["install_hint"] is None) == m["installed"]
        if not m["installed"]:
            assert f"{m['name']} is not installed: run 'kvgraft models install {m['name']}'" in result["summary"]


def test_models_install_needs_names_or_default(capsys: pytest.CaptureFixture[str]) -> None:
    code, result, _ = _run(capsys, "models", "install")
    assert code == 1 and result is not None and result["error"] == "CliError"
    assert result["message"] == ("name the models to install, or pass --default (the models make install installs) "
                                 "(hint: e.g. kvgraft models install qwen2.5-coder-1.5b)")
    code, result, _ = _run(capsys, "models", "install", "no-such-model")
    assert code == 1 and result is not None and result["error"] == "UnknownModelError"
    # make install installed the default models: nothing to do, nothing downloaded.
    code, result, _ = _run(capsys, "models", "install", "--default")
    assert code == 0 and result is not None
    assert result["installed"] == {"smollm2-135m": [], "gemma3-270m": [], "qwen2.5-coder-0.5b": []}


def test_capture_graft_fresh_agree(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p.txt").write_text("Some verified knowledge.\n")
    (tmp_path / "c.txt").write_text("A question about it?")
    code, cap, err = _run(capsys, "capture", "--model", "tiny-llama-test", "--text-file", tmp_path / "p.txt", "--out", tmp_path / "a")
    assert code == 0, err
    # Captured with the local key (no --key): grafting it needs the user to say it trusts that key.
    code, g, err = _run(capsys, "graft", "--artifact", tmp_path / "a", "--text-file", tmp_path / "c.txt", "--trust-local-key")
    assert code == 0, err
    code, f, err = _run(capsys, "fresh", "--model", "tiny-llama-test", "--prefix-file", tmp_path / "p.txt", "--text-file", tmp_path / "c.txt")
    assert code == 0, err
    assert g is not None and f is not None
    for field in ("logits_sha256", "argmax", "prefix_tokens", "continuation_tokens", "positions"):
        assert g[field] == f[field], field
    assert g["positions"] == [26, 46]
    code, gen, err = _run(capsys, "generate", "--artifact", tmp_path / "a", "--text-file", tmp_path / "c.txt", "--max-new-tokens", "3",
                          "--trust-local-key")
    assert code == 0 and gen is not None and 1 <= gen["decode_tokens"] <= 3


@pytest.mark.parametrize(
    ("damage", "error", "message"),
    [
        (lambda a: (a / "kv.safetensors").write_bytes(b"x" + (a / "kv.safetensors").read_bytes()[1:]), "ArtifactError", "has digest"),
        (lambda a: (a / "statement.dsse.json").write_text("{"), "ArtifactError", "not valid JSON"),
        (lambda a: (a / "statement.dsse.json").unlink(), "CliError", "has no statement.dsse.json"),
    ],
)
def test_bad_artifacts_exit_1_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: Any, error: str, message: str) -> None:
    (tmp_path / "p.txt").write_text("prefix")
    assert _run(capsys, "capture", "--model", "tiny-llama-test", "--text-file", tmp_path / "p.txt", "--out", tmp_path / "a")[0] == 0
    damage(tmp_path / "a")
    code, result, err = _run(capsys, "graft", "--artifact", tmp_path / "a", "--text-file", tmp_path / "p.txt", "--trust-local-key")
    assert code == 1 and result is not None and result["ok"] is False
    assert result["error"] == error and message in result["message"]
    assert len(err.splitlines()) == 1


def test_bad_text_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00")
    for path, message in ((tmp_path / "empty.txt", "is empty"), (tmp_path / "bin.txt", "is not UTF-8"), (tmp_path / "none.txt", "does not exist"), (tmp_path, "is a directory")):
        code, result, _ = _run(capsys, "capture", "--model", "tiny-llama-test", "--text-file", path, "--out", tmp_path / "x")
        assert code == 1 and result is not None and message in result["message"]
        assert not (tmp_path / "x").exists()
    code, result, _ = _run(capsys, "capture", "--model", "no-such-model", "--text-file", tmp_path / "empty.txt", "--out", tmp_path / "x")
    assert code == 1 and result is not None and result["error"] == "InputTextError"


def test_unknown_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "p.txt").write_text("x")
    code, result, _ = _run(capsys, "capture", "--model", "gpt-9", "--text-file", tmp_path / "p.txt", "--out", tmp_path / "x")
    assert code == 1 and result is not None and result["error"] == "UnknownModelError" and "known: smollm2-135m" in result["message"]


def test_exactness_record_verifies_and_tampering_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], key: Path) -> None:
    code, result, err = _run(capsys, "exactness", "--model", "tiny-llama-test", "--samples", "3", "--out", tmp_path / "rec",
                             "--max-prefix-tokens", "80", "--key", key)
    assert code == 0, err
    assert result is not None and result["bitwise_equal"] == 3 and result["max_kl_divergence"] == 0.0
    assert _run(capsys, "keys", "trust", "--file", tmp_path / "trust.json", "--name", "me", "--public-key", key.with_name("k.pem.pub"))[0] == 0
    assert verify_main(["exactness", str(tmp_path / "rec"), "--trusted-keys", str(tmp_path / "trust.json")]) == 0
    assert "3/3 bitwise equal" in capsys.readouterr().out

    # A claim changed and re-signed by the same key: the signature holds, the recount does not.
    forged = tmp_path / "forged"
    shutil.copytree(tmp_path / "rec", forged)
    env = json.loads((forged / "record.dsse.json").read_text())
    statement = json.loads(base64.b64decode(env["payload"]))
    statement["predicate"]["samples"][1]["argmax_agreement"] = 0.5
    with ephemeral_signing_key(load_private_key(key)) as signer:
        new = sign_envelope(canonical_json(statement), [signer])
    (forged / "record.dsse.json").write_text(new.model_dump_json(by_alias=True))
    assert verify_main(["exactness", str(forged), "--trusted-keys", str(tmp_path / "trust.json")]) == 1
    assert "ClaimMismatchError: sample 1 claims argmax agreement 0.5; recomputed 1.0" in capsys.readouterr().err

    # One flipped byte in a logits file.
    flipped = tmp_path / "flipped"
    shutil.copytree(tmp_path / "rec", flipped)
    logits = next((flipped / "logits").iterdir())
    data = bytearray(logits.read_bytes())
    data[0] ^= 1
    logits.write_bytes(bytes(data))
    assert verify_main(["exactness", str(flipped), "--trusted-keys", str(tmp_path / "trust.json")]) == 1
    assert "SubjectMismatchError" in capsys.readouterr().err
