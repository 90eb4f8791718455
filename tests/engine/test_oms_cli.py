"""``kvgraft oms sign`` on real kvgraft directories (an artifact captured from the tiny model, an
exactness record, a library entry), checked by the real ``model_signing verify key`` and by
``kvgraft-verify``: accepted as signed, refused after one changed byte, an extra file or a
missing file, each tool naming the file. The kvgraft checks of those directories still pass
with ``model.sig`` beside their files."""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvgraft.cli import main
from kvgraft.verifier.cli import main as verify_main

from ..verifier.oms_helpers import ms_accepts, ms_refuses

REPO = Path(__file__).resolve().parents[2]


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, dict[str, Any], str]:
    code = main(["--json", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, json.loads(out.strip().splitlines()[-1]), err


def _verify(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, dict[str, Any], str]:
    code = verify_main(["--json", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def _flip_first_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def signed_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One artifact, one exactness record and one library entry made by kvgraft with an Ed25519
    key, each then given a model.sig by ``kvgraft oms sign`` with a P-256 key."""
    tmp = tmp_path_factory.mktemp("oms")
    capsys_free = _Quiet()
    key, oms_key = tmp / "ed.pem", tmp / "p256.pem"
    assert capsys_free.run("keys", "generate", "--out", key)[0] == 0
    code, gen = capsys_free.run("keys", "generate", "--type", "p256", "--out", oms_key)
    assert code == 0, gen
    trust = tmp / "trusted-keys.json"
    assert capsys_free.run("keys", "trust", "--file", trust, "--name", "publisher", "--public-key", f"{key}.pub")[0] == 0
    assert capsys_free.run("keys", "trust", "--file", trust, "--name", "oms", "--public-key", f"{oms_key}.pub")[0] == 0

    (tmp / "p.txt").write_text("Some verified knowledge.\n")
    code, out = capsys_free.run("capture", "--model", "tiny-llama-test", "--text-file", tmp / "p.txt", "--out", tmp / "artifact", "--key", key)
    assert code == 0, out
    code, out = capsys_free.run("exactness", "--model", "tiny-llama-test", "--samples", "1", "--max-prefix-tokens", "40",
                                "--out", tmp / "record", "--key", key)
    assert code == 0, out
    dataset = tmp / "gsm8k.jsonl"
    dataset.write_text((REPO / "data" / "datasets" / "gsm8k_train.jsonl").read_text().splitlines(keepends=True)[0])
    code, out = capsys_free.run("library", "deposit", "--model", "tiny-llama-test", "--dataset", dataset, "--library", tmp / "lib",
                                "--key", key)
    assert code == 0, out
    (entry,) = sorted((tmp / "lib" / "entries").iterdir())

    dirs = {"artifact": tmp / "artifact", "record": tmp / "record", "entry": entry}
    signed: dict[str, list[str]] = {}
    for name, d in dirs.items():
        code, result = capsys_free.run("oms", "sign", "--key", oms_key, d)
        assert code == 0, result
        assert result["signature"] == str(d / "model.sig") and result["key_type"] == "p256"
        signed[name] = result["files"]
    envelope = json.loads((dirs["artifact"] / "statement.dsse.json").read_text())
    artifact_kv = "sha256:" + json.loads(base64.b64decode(envelope["payload"]))["subject"][0]["digest"]["sha256"]
    return {"dirs": dirs, "files": signed, "key": key, "oms_key": oms_key, "pub": Path(f"{oms_key}.pub"), "trust": trust,
            "artifact_kv": artifact_kv}


class _Quiet:
    """Run ``kvgraft --json`` in-process outside a test (module fixtures have no capsys)."""

    def run(self, *argv: object) -> tuple[int, dict[str, Any]]:
        import contextlib
        import io

        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            code = main(["--json", *map(str, argv)])
        return code, json.loads(out.getvalue().strip().splitlines()[-1])


def test_signed_directories_verify_with_model_signing_and_kvgraft(signed_dirs: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    dirs, pub, trust = signed_dirs["dirs"], signed_dirs["pub"], signed_dirs["trust"]
    assert signed_dirs["files"]["artifact"] == ["kv.safetensors", "statement.dsse.json"]
    assert signed_dirs["files"]["entry"] == ["kv.safetensors", "statement.dsse.json"]
    record_files = signed_dirs["files"]["record"]
    assert record_files[-1] == "record.dsse.json" and all(f.startswith("logits/") for f in record_files[:-1])

    for d in dirs.values():
        ms_accepts(d, pub)
        code, result, err = _verify(capsys, "oms", d, "--public-key", pub)
        assert code == 0, err
        assert result["signer"]["name"] == str(pub)

    # kvgraft's own checks accept model.sig beside the files, and check it with the same keys.
    for name in ("artifact", "entry"):
        code, result, err = _verify(capsys, "envelope", dirs[name] / "statement.dsse.json", "--trusted-keys", trust,
                                    "--artifact-dir", dirs[name])
        assert code == 0, err
        assert result["subjects_checked"] == ["kv.safetensors"] and result["token_digest"] == "matches"
        assert result["model_sig"]["signer"]["name"] == "oms"
        assert "model.sig over 2 file(s) signed by oms (ECDSA P-256" in result["summary"]
    code, result, err = _verify(capsys, "exactness", dirs["record"], "--trusted-keys", trust)
    assert code == 0, err
    question = dirs["artifact"].parent / "q.txt"
    question.write_text("A question?")
    code, result, err = _run(capsys, "graft", "--artifact", dirs["artifact"], "--text-file", question, "--trusted-keys", trust)
    assert code == 0, err


Change = Callable[[Path], str]


def _changed_byte(d: Path) -> str:
    name = "kv.safetensors" if (d / "kv.safetensors").exists() else "record.dsse.json"
    _flip_first_byte(d / name)
    return name


def _extra_file(d: Path) -> str:
    (d / "notes.txt").write_text("not signed")
    return "notes.txt"


def _missing_file(d: Path) -> str:
    name = "statement.dsse.json" if (d / "statement.dsse.json").exists() else "record.dsse.json"
    (d / name).unlink()
    return name


@pytest.mark.parametrize("which", ["artifact", "record", "entry"])
@pytest.mark.parametrize(
    ("change", "ms_says", "we_say"),
    [(_changed_byte, "Hash mismatch for '{name}'", "{name} in "),
     (_extra_file, "Extra files found in model '{model}': {name}", "holds {name}, not signed by"),
     (_missing_file, "Missing files in model '{model}': {name}", "lacks {name}, signed by")],
    ids=["changed-byte", "extra-file", "missing-file"],
)
def test_both_tools_refuse_a_changed_directory(signed_dirs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               which: str, change: Change, ms_says: str, we_say: str) -> None:
    d = tmp_path / signed_dirs["dirs"][which].name
    shutil.copytree(signed_dirs["dirs"][which], d)
    name = change(d)
    ms_refuses(d, signed_dirs["pub"], ms_says.format(name=name, model=d.name))
    code, result, err = _verify(capsys, "oms", d, "--public-key", signed_dirs["pub"])
    assert code == 1 and result["error"] == "ModelManifestMismatchError"
    assert we_say.format(name=name) in result["message"] and len(err.splitlines()) == 1


def test_oms_sign_refusals(signed_dirs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "artifact"
    shutil.copytree(signed_dirs["dirs"]["artifact"], d)
    before = (d / "model.sig").read_bytes()
    code, result, err = _run(capsys, "oms", "sign", "--key", signed_dirs["oms_key"], d)
    assert code == 1 and result["error"] == "CliError" and "already exists" in result["message"] and "--force" in result["message"]
    assert (d / "model.sig").read_bytes() == before
    code, result, err = _run(capsys, "oms", "sign", "--key", signed_dirs["oms_key"], d, "--force")
    assert code == 0, err
    ms_accepts(d, signed_dirs["pub"])

    # model_signing verifies ECDSA keys only: an Ed25519 key is refused before anything is written.
    (d / "model.sig").unlink()
    code, result, err = _run(capsys, "oms", "sign", "--key", signed_dirs["key"], d)
    assert code == 1 and result["error"] == "UnsupportedKeyTypeError"
    assert "kvgraft keys generate --type p256" in result["message"] and len(err.splitlines()) == 1
    assert not (d / "model.sig").exists()
    code, result, err = _run(capsys, "oms", "sign", "--key", signed_dirs["oms_key"], tmp_path / "nowhere")
    assert code == 1 and result["error"] == "ModelDirectoryError" and "does not exist" in result["message"]


def test_model_sig_beside_stops_no_kvgraft_command(signed_dirs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: with only the publisher's key trusted (not the key that wrote model.sig),
    ``kvgraft-verify envelope --artifact-dir`` refused an artifact because of the model.sig beside
    it. Now it reports the model.sig unchecked; ``ask`` loads library entries that hold one;
    ``publish`` sends only the statement's subjects and ``pull`` verifies what it fetched."""
    from ..registry.conftest import registry_cli, running_server

    dirs, key = signed_dirs["dirs"], signed_dirs["key"]
    only = tmp_path / "publisher-only.json"
    assert main(["keys", "trust", "--file", str(only), "--name", "publisher", "--public-key", f"{key}.pub"]) == 0
    capsys.readouterr()
    code, result, err = _verify(capsys, "envelope", dirs["artifact"] / "statement.dsse.json", "--trusted-keys", only,
                                "--artifact-dir", dirs["artifact"])
    assert code == 0, err
    assert result["subjects_checked"] == ["kv.safetensors"] and result["token_digest"] == "matches"
    assert result["model_sig"]["checked"] is False
    assert "none of the 0 trusted ECDSA key(s) (1 trusted in all)" in result["model_sig"]["reason"]

    question = json.loads((REPO / "data" / "datasets" / "gsm8k_train.jsonl").read_text().splitlines()[0])["question"]
    code, ans, err = _run(capsys, "ask", "--library", dirs["entry"].parent.parent, "--question", question, "--trusted-keys", only)
    assert code == 0, err
    assert ans["method"] == "exact"

    data = tmp_path / "registry"
    with running_server(data) as server:
        r = registry_cli("--json", "token", "create", "--data", data, "--publisher", "alice", "--key", f"{key}.pub")
        assert r.returncode == 0, r.stderr
        token = json.loads(r.stdout)["token"]
        code, pub, err = _run(capsys, "publish", "--registry", server.url, "--token", token, "--registry-key",
                              data / "registry-key.pub.pem", dirs["artifact"])
        assert code == 0, err
        assert pub["blobs"]["uploaded"] == [signed_dirs["artifact_kv"]]  # the subjects only: model.sig stays local
        out = tmp_path / "pulled"
        code, pulled, err = _run(capsys, "pull", "--registry", server.url, pub["artifact_digest"], "--out", out,
                                 "--trusted-keys", only, "--registry-key", data / "registry-key.pub.pem")
        assert code == 0, err
        assert pulled["signature_checked"] is True
        assert sorted(p.name for p in out.iterdir()) == ["kv.safetensors", "statement.dsse.json"]
