"""``model.sig`` files written by the real model_signing 1.0.1 and 1.1.1 (``tests/vectors/model_signing``,
SOURCE.md: how each was made), checked by ``kvgraft-verify oms`` and by the real model_signing 1.1.1;
and model_signing's ``--no-ignore-git-paths`` on ``kvgraft oms sign`` and ``kvgraft-verify oms``.

model_signing 1.0.x writes the signer's key itself (``publicKey.rawBytes`` and ``keyDetails``),
where 1.1 writes a hint: ``kvgraft-verify oms`` refused every 1.0.x signature as "pre-1.0".
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvgraft.cli import main as kvgraft_main
from kvgraft.verifier import (
    BadSignatureError,
    ModelManifestMismatchError,
    ModelSignatureFormatError,
    TrustedKeys,
    UnknownKeyError,
    load_public_key,
    trusted_key,
    verify_model_signature,
)
from kvgraft.verifier.cli import main as verify_main

from .oms_helpers import key_files, model_signing

MS = Path(__file__).resolve().parents[1] / "vectors" / "model_signing"
SIGS = MS / "signatures"
#: Each signature of ``model/``, by the tool release that wrote it, and its key.
MODEL_SIGS = [("1.0.1", "p256"), ("1.0.1", "p384"), ("1.1.1", "p256"), ("1.1.1", "p384")]
#: The signatures of ``model-git/`` that sign its ``.github/notes.txt``.
GIT_SIGS = ["model-git.model_signing-1.0.1-p256.sig", "model-git.model_signing-1.1.1-no-ignore-git-paths-p256.sig"]


def _verify(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, dict[str, Any], str]:
    code = verify_main(["--json", "oms", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def _trust(key: str) -> TrustedKeys:
    return TrustedKeys((trusted_key("signer", load_public_key(MS / f"{key}.pub")),))


def _edited(tmp_path: Path, name: str, edit: Any) -> Path:
    bundle = json.loads((SIGS / name).read_bytes())
    edit(bundle)
    out = tmp_path / name
    out.write_text(json.dumps(bundle))
    return out


@pytest.mark.parametrize(("release", "key"), MODEL_SIGS, ids=[f"{r}-{k}" for r, k in MODEL_SIGS])
def test_model_signing_1_0_regression_rawbytes_key_signatures_verify_as_1_1s_do(
        release: str, key: str, capsys: pytest.CaptureFixture[str]) -> None:
    sig = SIGS / f"model_signing-{release}-{key}.sig"
    layout = json.loads(sig.read_bytes())["verificationMaterial"]["publicKey"]
    assert set(layout) == ({"rawBytes", "keyDetails"} if release == "1.0.1" else {"hint"})  # the vector is what it says
    code, result, err = _verify(capsys, MS / "model", "--signature", sig, "--public-key", MS / f"{key}.pub")
    assert code == 0, err
    assert result["files"] == ["config.json", "sub/tokenizer.txt", "weights.bin"]
    assert result["summary"].startswith(f"OK: {MS / 'model'}: model.sig over 3 file(s) signed by ")
    # The real model_signing 1.1.1 accepts the same signature (1.0.x's with a warning).
    r = model_signing("verify", "key", MS / "model", "--signature", sig, "--public_key", MS / f"{key}.pub")
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "Verification succeeded", r.stderr


def test_a_1_0_signature_is_refused_when_the_directory_changed(tmp_path: Path) -> None:
    d = tmp_path / "model"
    shutil.copytree(MS / "model", d)
    (d / "weights.bin").write_bytes(b"other weights\n")
    with pytest.raises(ModelManifestMismatchError, match="^weights.bin in .* has sha256 .*, but .* signs 9f660517"):
        verify_model_signature(d, _trust("p256"), signature=SIGS / "model_signing-1.0.1-p256.sig")


def test_a_1_0_signatures_own_key_only_names_the_key_it_is_not_trusted(tmp_path: Path) -> None:
    # rawBytes is not signed: it picks a trusted key, as a hint does, and is never trusted itself.
    sig = SIGS / "model_signing-1.0.1-p256.sig"
    _, other = key_files(tmp_path, "p256")
    with pytest.raises(UnknownKeyError, match="signed by the key whose PEM has sha256 f5bc033dade43c68"):
        verify_model_signature(MS / "model", TrustedKeys((trusted_key("other", load_public_key(other)),)), signature=sig)
    # Swap in the P-384 signer's key: that trusted key is picked, and the P-256 signature fails under it.
    p384 = base64.b64encode((MS / "p384.pub").read_bytes()).decode()
    swapped = _edited(tmp_path, sig.name, lambda b: b["verificationMaterial"]["publicKey"].update(
        rawBytes=p384, keyDetails="PKIX_ECDSA_P384_SHA_384"))
    with pytest.raises(BadSignatureError, match="by trusted key 'signer' does not verify over its statement"):
        verify_model_signature(MS / "model", _trust("p384"), signature=swapped)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda k: k.update(keyDetails="PKIX_ECDSA_P521_SHA_512"),
     "keyDetails 'PKIX_ECDSA_P521_SHA_512' is not a key type checked here, only PKIX_ECDSA_P256_SHA_256 or "
     "PKIX_ECDSA_P384_SHA_384"),
    (lambda k: k.update(keyDetails="PKIX_ECDSA_P384_SHA_384"),
     "rawBytes holds an ECDSA P-256 key, but keyDetails says PKIX_ECDSA_P384_SHA_384"),
    (lambda k: k.update(rawBytes="not base64!"), "rawBytes is not base64 of a PEM public key"),
    (lambda k: k.update(rawBytes=base64.b64encode(b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n").decode()),
     "rawBytes is not base64 of a PEM public key"),
    (lambda k: k.update(rawBytes="A" * 6000), "String should have at most 5464 characters"),
    (lambda k: k.pop("rawBytes"), "has neither a hint (model_signing 1.1 and later) nor rawBytes (1.0.x): a pre-1.0"),
    (lambda k: k.update(hint="00" * 32), "holds both a hint (model_signing 1.1) and rawBytes or keyDetails (1.0.x)"),
], ids=["p521", "details-mismatch", "not-base64", "not-a-key", "too-long", "no-key", "both"])
def test_a_1_0_key_that_is_not_one_checked_here_is_refused_by_name(tmp_path: Path, edit: Any, message: str) -> None:
    sig = _edited(tmp_path, "model_signing-1.0.1-p256.sig", lambda b: edit(b["verificationMaterial"]["publicKey"]))
    with pytest.raises(ModelSignatureFormatError) as e:
        verify_model_signature(MS / "model", _trust("p256"), signature=sig)
    assert "verificationMaterial.publicKey" in e.value.message and message in e.value.message, e.value.message


@pytest.mark.parametrize("name", GIT_SIGS)
def test_git_paths_the_signer_signed_are_checked_with_no_ignore_git_paths(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    sig, d, key = SIGS / name, MS / "model-git", MS / "p256.pub"
    code, result, err = _verify(capsys, d, "--signature", sig, "--public-key", key, "--no-ignore-git-paths")
    assert code == 0, err
    assert result["files"] == [".github/notes.txt", "config.json", "sub/tokenizer.txt", "weights.bin"]
    assert verify_main(["oms", str(d), "--signature", str(sig), "--public-key", str(key)]) == 1
    err = capsys.readouterr().err
    assert err == (f"kvgraft-verify: ModelManifestMismatchError: {d} lacks .github/notes.txt, signed by {sig} (hint: the "
                   "signer signed the git paths too (model_signing --no-ignore-git-paths, or model_signing 1.0.x run from "
                   "outside the directory): check them with --no-ignore-git-paths)\n")
    # model_signing 1.1.1 says the same, both ways.
    ms = model_signing("verify", "key", d, "--signature", sig, "--public_key", key)
    assert ms.returncode == 1 and "Missing files in model 'model-git': .github/notes.txt" in ms.stderr, ms.stderr
    ms = model_signing("verify", "key", d, "--no-ignore-git-paths", "--signature", sig, "--public_key", key)
    assert ms.returncode == 0, ms.stderr


def test_kvgraft_oms_sign_no_ignore_git_paths_signs_them_as_model_signing_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    private, public = key_files(tmp_path, "p256")
    d = tmp_path / "model-git"
    shutil.copytree(MS / "model-git", d)
    assert kvgraft_main(["--json", "oms", "sign", str(d), "--key", str(private), "--no-ignore-git-paths"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["files"] == [".github/notes.txt", "config.json", "sub/tokenizer.txt", "weights.bin"]
    assert f"'kvgraft-verify oms {d} --no-ignore-git-paths --public-key KEY.pub'" in out["summary"]
    statement = json.loads(base64.b64decode(json.loads((d / "model.sig").read_bytes())["dsseEnvelope"]["payload"]))
    assert statement["predicate"]["serialization"]["ignore_paths"] == ["model.sig"]
    # The same manifest model_signing 1.1.1 signs with the option.
    ms_statement = json.loads(base64.b64decode(json.loads((SIGS / GIT_SIGS[1]).read_bytes())["dsseEnvelope"]["payload"]))
    assert statement["predicate"]["resources"] == sorted(ms_statement["predicate"]["resources"], key=lambda r: r["name"])
    assert model_signing("verify", "key", d, "--no-ignore-git-paths", "--signature", d / "model.sig",
                         "--public_key", public).returncode == 0
    code, result, err = _verify(capsys, d, "--public-key", public, "--no-ignore-git-paths")
    assert code == 0 and result["files"][0] == ".github/notes.txt", err
    # A changed git file is caught now; by default it is not signed, so not checked.
    (d / ".github" / "notes.txt").write_text("changed\n")
    with pytest.raises(ModelManifestMismatchError, match=r"^\.github/notes\.txt in .* has sha256"):
        verify_model_signature(d, TrustedKeys((trusted_key("k", load_public_key(public)),)), ignore_git_paths=False)
