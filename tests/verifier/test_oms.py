"""OpenSSF model signing (``model.sig``) against the real ``model_signing`` 1.1.1 tool, both ways:
kvgraft signs and model_signing verifies; model_signing signs and kvgraft verifies; both refuse a
changed byte, an extra file and a missing file, naming it. Then kvgraft's own strictness: the
bundle's shape, the key, the limits, links, and ``kvgraft-verify envelope --artifact-dir`` with a
``model.sig`` beside the subjects."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvgraft.schemas import Statement, Subject, SubjectDigest, hex_of, sha256_file
from kvgraft.verifier import (
    BadSignatureError,
    KeyType,
    ModelDirectoryError,
    ModelManifestMismatchError,
    ModelSignatureFormatError,
    ThresholdNotMetError,
    TrustedKeys,
    UnknownKeyError,
    UnsupportedKeyTypeError,
    check_model_signature_beside,
    envelope_json,
    generate_private_key,
    key_hint,
    load_public_key,
    open_signing_key,
    sign_model_directory,
    sign_statement,
    trusted_key,
    verify_model_signature,
)
from kvgraft.verifier.cli import main as verify_main

from .oms_helpers import key_files, ms_accepts, ms_refuses, ms_sign

EC_TYPES: tuple[KeyType, ...] = ("p256", "p384")


def _model(root: Path) -> Path:
    """A directory that exercises the walk: nesting, hidden files, component order, git paths."""
    d = root / "model"
    (d / "a").mkdir(parents=True)
    (d / "a" / "b").write_bytes(b"nested")
    (d / "a.txt").write_bytes(b"beside")  # "a/b" sorts before "a.txt": by path component
    (d / ".hidden").write_bytes(b"hidden files are signed")
    (d / "logits").mkdir()
    (d / "logits" / "0.f32").write_bytes(bytes(range(256)) * 4)
    (d / ".gitignore").write_text("ignored by both tools\n")
    (d / ".git").mkdir()
    (d / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    return d


def _signed_subject_dir(root: Path, directory: str, subject: str, data: bytes, envelope: str, private: Path) -> Path:
    """``root/directory`` holding one file ``subject`` and ``envelope``, a statement over it signed by ``private``."""
    d = root / directory
    d.mkdir()
    (d / subject).write_bytes(data)
    statement = Statement(
        subject=[Subject(name=subject, digest=SubjectDigest(sha256=hex_of(sha256_file(d / subject))))],
        predicate_type="https://example.com/test/v1", predicate={},
    )
    with open_signing_key(private) as signer:
        (d / envelope).write_bytes(envelope_json(sign_statement(statement, [signer])))
    return d


def _sign(directory: Path, private: Path) -> None:
    with open_signing_key(private) as signer:
        (directory / "model.sig").write_bytes(sign_model_directory(directory, signer).bundle)


def _trust(public: Path) -> TrustedKeys:
    return TrustedKeys((trusted_key("signer", load_public_key(public)),))


def _statement(sig: Path) -> dict[str, Any]:
    bundle = json.loads(sig.read_bytes())
    statement: dict[str, Any] = json.loads(base64.b64decode(bundle["dsseEnvelope"]["payload"]))
    return statement


# --- kvgraft signs, model_signing verifies ---------------------------------------------------------


@pytest.mark.parametrize("key_type", EC_TYPES)
def test_kvgraft_signature_verifies_with_model_signing(tmp_path: Path, key_type: KeyType) -> None:
    private, public = key_files(tmp_path, key_type)
    d = _model(tmp_path)
    _sign(d, private)
    ms_accepts(d, public)
    verified = verify_model_signature(d, _trust(public))
    assert verified.files == (".hidden", "a/b", "a.txt", "logits/0.f32")
    assert verified.model_name == "model"

    bundle = json.loads((d / "model.sig").read_bytes())
    assert bundle["mediaType"] == "application/vnd.dev.sigstore.bundle.v0.3+json"
    assert bundle["verificationMaterial"] == {"publicKey": {"hint": key_hint(load_public_key(public))}, "tlogEntries": []}
    assert bundle["dsseEnvelope"]["payloadType"] == "application/vnd.in-toto+json"
    assert [s["keyid"] for s in bundle["dsseEnvelope"]["signatures"]] == [""]


@pytest.mark.parametrize("key_type", EC_TYPES)
def test_both_tools_write_the_same_statement(tmp_path: Path, key_type: KeyType) -> None:
    # Same directory, signed by each tool: the same subject digest, resources (in order) and
    # serialization; only the JSON text differs (canonical JSON against protobuf's indented JSON).
    private, _ = key_files(tmp_path, key_type)
    d = _model(tmp_path)
    _sign(d, private)
    ours = _statement(d / "model.sig")
    ms_sign(d, private)
    theirs = _statement(d / "model.sig")
    assert ours["subject"] == theirs["subject"]
    assert ours["predicate"]["resources"] == theirs["predicate"]["resources"]
    assert [r["name"] for r in ours["predicate"]["resources"]] == [".hidden", "a/b", "a.txt", "logits/0.f32"]
    for statement in (ours, theirs):
        serialization = statement["predicate"]["serialization"]
        # model_signing lists its ignored paths in set order, which varies from run to run.
        serialization["ignore_paths"] = sorted(serialization["ignore_paths"])
    assert ours == theirs


@pytest.mark.parametrize(
    ("change", "ms_says", "we_say"),
    [
        (lambda d: (d / "a" / "b").write_bytes(b"nestee"), "Hash mismatch for 'a/b'", "a/b in "),
        (lambda d: (d / "extra.bin").write_bytes(b"x"), "Extra files found in model 'model': extra.bin", "holds extra.bin, not signed by"),
        (lambda d: (d / "logits" / "0.f32").unlink(), "Missing files in model 'model': logits/0.f32", "lacks logits/0.f32, signed by"),
        (lambda d: (d / ".hidden").write_bytes(b"Hidden files are signed"), "Hash mismatch for '.hidden'", ".hidden in "),
    ],
    ids=["changed-byte", "extra-file", "missing-file", "changed-hidden-file"],
)
def test_both_tools_refuse_a_changed_directory(tmp_path: Path, change: Any, ms_says: str, we_say: str) -> None:
    private, public = key_files(tmp_path, "p256")
    d = _model(tmp_path)
    _sign(d, private)
    change(d)
    ms_refuses(d, public, ms_says)
    with pytest.raises(ModelManifestMismatchError) as e:
        verify_model_signature(d, _trust(public))
    assert we_say in str(e.value)


def test_git_paths_are_not_signed_by_either_tool(tmp_path: Path) -> None:
    private, public = key_files(tmp_path, "p256")
    d = _model(tmp_path)
    _sign(d, private)
    (d / ".gitignore").write_text("changed\n")
    (d / ".git" / "HEAD").write_text("changed\n")
    ms_accepts(d, public)
    verify_model_signature(d, _trust(public))


# --- model_signing signs, kvgraft verifies ---------------------------------------------------------


@pytest.mark.parametrize("key_type", EC_TYPES)
def test_model_signing_signature_verifies_with_kvgraft(tmp_path: Path, key_type: KeyType, capsys: pytest.CaptureFixture[str]) -> None:
    private, public = key_files(tmp_path, key_type)
    d = _model(tmp_path)
    ms_sign(d, private)
    assert verify_main(["--json", "oms", str(d), "--public-key", str(public)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is True and result["verified"] == "model_signing"
    assert result["files"] == [".hidden", "a/b", "a.txt", "logits/0.f32"]
    assert sorted(result["ignore_paths"]) == [".git", ".gitattributes", ".github", ".gitignore", "model.sig"]

    (d / "a.txt").write_bytes(b"Beside")
    assert verify_main(["oms", str(d), "--public-key", str(public)]) == 1
    err = capsys.readouterr().err
    assert "ModelManifestMismatchError: a.txt in " in err and "but " in err and len(err.splitlines()) == 1


def test_signed_ignore_paths_are_honoured(tmp_path: Path) -> None:
    private, public = key_files(tmp_path, "p384")
    d = _model(tmp_path)
    ms_sign(d, private, "--ignore-paths", d / "logits")
    assert "logits" in _statement(d / "model.sig")["predicate"]["serialization"]["ignore_paths"]
    (d / "logits" / "new.f32").write_bytes(b"not signed, and not checked: the signer said so")
    ms_accepts(d, public)
    verified = verify_model_signature(d, _trust(public))
    assert verified.files == (".hidden", "a/b", "a.txt")
    # What the signer left unchecked is said, not hidden behind "every file matches".
    assert verified.unsigned_paths == ("logits",)
    assert verified.describe().endswith(", leaving out logits as signed")


def test_signature_outside_the_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    private, public = key_files(tmp_path, "p256")
    d = _model(tmp_path)
    with open_signing_key(private) as signer:
        (tmp_path / "elsewhere.sig").write_bytes(sign_model_directory(d, signer).bundle)
    ms_accepts(d, public, tmp_path / "elsewhere.sig")
    assert verify_main(["oms", str(d), "--signature", str(tmp_path / "elsewhere.sig"), "--public-key", str(public)]) == 0
    assert "over 4 file(s) signed by" in capsys.readouterr().out


def test_trusted_keys_file_picks_the_key_by_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    private, public = key_files(tmp_path, "p256")
    d = _model(tmp_path)
    ms_sign(d, private)
    other = generate_private_key("p384").public_key()
    ed = generate_private_key("ed25519").public_key()
    trust = TrustedKeys((trusted_key("ed", ed), trusted_key("other", other), trusted_key("alice", load_public_key(public))))
    (tmp_path / "trust.json").write_text(json.dumps(trust.to_json()))
    assert verify_main(["oms", str(d), "--trusted-keys", str(tmp_path / "trust.json")]) == 0
    assert "signed by alice (ECDSA P-256" in capsys.readouterr().out


# --- what kvgraft refuses ----------------------------------------------------------------------------


def test_an_unknown_key_is_refused(tmp_path: Path) -> None:
    private, _ = key_files(tmp_path, "p256")
    d = _model(tmp_path)
    _sign(d, private)
    stranger = TrustedKeys((trusted_key("stranger", generate_private_key("p256").public_key()),))
    with pytest.raises(UnknownKeyError, match="none of the 1 trusted ECDSA key"):
        verify_model_signature(d, stranger)


def test_a_hint_naming_another_key_is_a_bad_signature(tmp_path: Path) -> None:
    private, _ = key_files(tmp_path, "p256")
    d = _model(tmp_path)
    _sign(d, private)
    victim = generate_private_key("p256").public_key()
    bundle = json.loads((d / "model.sig").read_bytes())
    bundle["verificationMaterial"]["publicKey"]["hint"] = key_hint(victim)
    (d / "model.sig").write_text(json.dumps(bundle))
    with pytest.raises(BadSignatureError, match="by trusted key 'victim' does not verify"):
        verify_model_signature(d, TrustedKeys((trusted_key("victim", victim),)))


def test_an_altered_statement_is_a_bad_signature(tmp_path: Path) -> None:
    private, public = key_files(tmp_path, "p256")
    d = _model(tmp_path)
    _sign(d, private)
    (d / "extra.bin").write_bytes(b"x")
    bundle = json.loads((d / "model.sig").read_bytes())
    statement = _statement(d / "model.sig")
    statement["predicate"]["serialization"]["ignore_paths"].append("extra.bin")
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
    (d / "model.sig").write_text(json.dumps(bundle))
    ms_refuses(d, public, "")  # cryptography's InvalidSignature carries no text: the failure line is all it prints
    with pytest.raises(BadSignatureError, match="by trusted key 'signer' does not verify over its statement"):
        verify_model_signature(d, _trust(public))


def _edit(sig: Path, edit: Any) -> None:
    bundle = json.loads(sig.read_bytes())
    edit(bundle)
    sig.write_text(json.dumps(bundle))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda b: b.update(mediaType="application/vnd.dev.sigstore.bundle+json;version=0.2"), "mediaType"),
        (lambda b: b["verificationMaterial"].update(tlogEntries=[{"logIndex": "1"}]), "carries no transparency-log entries"),
        (lambda b: b["verificationMaterial"].pop("publicKey") and b["verificationMaterial"].update(certificate={"rawBytes": "AA=="}),
         "holds certificate but no publicKey"),
        (lambda b: b["verificationMaterial"]["publicKey"].pop("hint"), "pre-1.0 model_signing signature"),
        (lambda b: b["verificationMaterial"]["publicKey"].update(rawBytes="AA=="), "rawBytes"),
        (lambda b: b["dsseEnvelope"]["signatures"].append(b["dsseEnvelope"]["signatures"][0]), "has 2 signatures"),
        (lambda b: b.update(extra=1), "extra: Extra inputs are not permitted"),
    ],
    ids=["media-type", "tlog-entries", "certificate", "no-hint", "raw-bytes", "two-signatures", "unknown-field"],
)
def test_malformed_bundles_are_refused(tmp_path: Path, edit: Any, message: str) -> None:
    private, public = key_files(tmp_path, "p256")
    d = _model(tmp_path)
    _sign(d, private)
    _edit(d / "model.sig", edit)
    with pytest.raises(ModelSignatureFormatError) as e:
        verify_model_signature(d, _trust(public))
    assert message in str(e.value)


def test_not_json_and_too_large_are_refused(tmp_path: Path) -> None:
    _, public = key_files(tmp_path, "p256")
    d = _model(tmp_path)
    (d / "model.sig").write_text("{")
    with pytest.raises(ModelSignatureFormatError, match="not valid JSON"):
        verify_model_signature(d, _trust(public))
    with (d / "model.sig").open("wb") as f:
        f.truncate(16 * 1024 * 1024 + 1)
    with pytest.raises(ModelSignatureFormatError, match="more than the 16777216"):
        verify_model_signature(d, _trust(public))
    (d / "model.sig").unlink()
    with pytest.raises(ModelSignatureFormatError, match="does not exist"):
        verify_model_signature(d, _trust(public))


@pytest.mark.parametrize(
    ("serialization", "message"),
    [
        ({"method": "shards"}, "serialization method 'shards' is not checked here"),
        ({"method": "files", "hashing_algorithm": "blake2"}, "hash type 'blake2b' is not checked here"),
    ],
)
def test_other_serializations_by_model_signing_are_refused(tmp_path: Path, serialization: dict[str, str], message: str) -> None:
    # Signed by the real library (its Python API: the CLI has no option for these).
    import model_signing

    private, public = key_files(tmp_path, "p256")
    d = _model(tmp_path)
    hashing = model_signing.hashing.Config()
    if serialization["method"] == "shards":
        hashing = hashing.use_shard_serialization()
    else:
        hashing = hashing.use_file_serialization(hashing_algorithm=serialization["hashing_algorithm"])  # type: ignore[arg-type]
    model_signing.signing.Config().use_elliptic_key_signer(private_key=private).set_hashing_config(hashing).sign(d, d / "model.sig")
    # (model_signing's own `verify key` command refuses these too: it hashes by files with sha256.)
    ms_refuses(d, public, "Signature mismatch: ")
    with pytest.raises(ModelSignatureFormatError, match=message):
        verify_model_signature(d, _trust(public))


def test_ed25519_keys_cannot_sign_a_model_sig(tmp_path: Path) -> None:
    private, _ = key_files(tmp_path, "ed25519")
    with open_signing_key(private) as signer, pytest.raises(UnsupportedKeyTypeError) as e:
        sign_model_directory(_model(tmp_path), signer)
    assert "kvgraft keys generate --type p256" in str(e.value)


def test_a_threshold_above_one_is_refused(tmp_path: Path) -> None:
    private, public = key_files(tmp_path, "p256")
    d = _model(tmp_path)
    _sign(d, private)
    two = TrustedKeys((trusted_key("a", load_public_key(public)), trusted_key("b", generate_private_key("p256").public_key())), 2)
    with pytest.raises(ThresholdNotMetError, match="holds one signature, but the trusted keys require 2"):
        verify_model_signature(d, two)
    one = TrustedKeys(two.keys, 2, {"https://model_signing/signature/v1.0": 1})
    verify_model_signature(d, one)


def test_links_special_files_and_limits_are_refused(tmp_path: Path) -> None:
    private, public = key_files(tmp_path, "p256")
    d = _model(tmp_path)
    _sign(d, private)
    (d / "link").symlink_to(d / "a.txt")
    for run in (lambda: verify_model_signature(d, _trust(public)), lambda: _sign(d, private)):
        with pytest.raises(ModelDirectoryError, match="link in .* is a symbolic link"):
            run()
    ms_refuses(d, public, "because it is a symlink")  # model_signing refuses links too
    (d / "link").unlink()
    os.mkfifo(d / "fifo")
    with pytest.raises(ModelDirectoryError, match="fifo in .* is neither a regular file nor a folder"):
        verify_model_signature(d, _trust(public))
    (d / "fifo").unlink()
    with pytest.raises(ModelDirectoryError, match="more than 5 files and folders"):
        verify_model_signature(d, _trust(public), max_entries=5)
    deep = d / "x"
    for i in range(33):
        deep = deep / str(i)
    deep.mkdir(parents=True)
    with pytest.raises(ModelDirectoryError, match="more than 32 folders deep"):
        verify_model_signature(d, _trust(public))
    with pytest.raises(ModelDirectoryError, match="does not exist"):
        verify_model_signature(tmp_path / "nowhere", _trust(public))


def test_an_empty_directory_is_not_signed(tmp_path: Path) -> None:
    private, _ = key_files(tmp_path, "p256")
    (tmp_path / "empty" / "folder").mkdir(parents=True)
    with open_signing_key(private) as signer, pytest.raises(ModelDirectoryError, match="holds no files to sign"):
        sign_model_directory(tmp_path / "empty", signer)


# --- model.sig beside a statement's subjects ------------------------------------------------------


def test_envelope_artifact_dir_accepts_and_checks_model_sig(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    private, public = key_files(tmp_path, "p256")
    d = _signed_subject_dir(tmp_path, "record", "outputs.bin", b"the record's only subject", "record.dsse.json", private)
    trust = tmp_path / "trust.json"
    trust.write_text(json.dumps(_trust(public).to_json()))
    argv = ["--json", "envelope", str(d / "record.dsse.json"), "--trusted-keys", str(trust), "--artifact-dir", str(d)]
    assert verify_main(argv) == 0
    assert "model_sig" not in json.loads(capsys.readouterr().out)

    _sign(d, private)
    ms_accepts(d, public)
    assert verify_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["subjects_checked"] == ["outputs.bin"]
    assert result["model_sig"]["checked"] is True
    assert result["model_sig"]["files"] == ["outputs.bin", "record.dsse.json"]
    assert "model.sig over 2 file(s) signed by signer" in result["summary"]

    # Only model.sig is let through: any other file beside the subjects is still refused.
    (d / "notes.txt").write_text("x")
    assert verify_main(argv) == 1
    assert "SubjectMismatchError" in capsys.readouterr().out
    (d / "notes.txt").unlink()
    # A model.sig by a trusted key that does not verify fails the whole check.
    good = (d / "model.sig").read_bytes()
    _edit(d / "model.sig", lambda b: b["dsseEnvelope"]["signatures"][0].update(sig=base64.b64encode(b"0" * 70).decode()))
    assert verify_main(argv) == 1
    failed = json.loads(capsys.readouterr().out)
    assert failed["error"] == "BadSignatureError" and "by trusted key 'signer' does not verify" in failed["message"]
    # So does one by a trusted key whose manifest the directory no longer matches.
    (d / "model.sig").write_bytes(good)
    (d / "record.dsse.json").write_bytes((d / "record.dsse.json").read_bytes().replace(b'"payload"', b'"payload" '))
    assert verify_main(argv) == 1
    failed = json.loads(capsys.readouterr().out)
    assert failed["error"] == "ModelManifestMismatchError" and "record.dsse.json in " in failed["message"]


def _resign(sig: Path, private: Path, edit: Any) -> None:
    """Edit the signed statement and sign it again with ``private``: a trusted signer's own odd
    manifest, to show what the verifier refuses even when the signature holds."""
    from kvgraft.verifier import pae

    bundle = json.loads(sig.read_bytes())
    statement = _statement(sig)
    edit(statement)
    payload = json.dumps(statement).encode()
    with open_signing_key(private) as signer:
        signature = signer.sign(pae("application/vnd.in-toto+json", payload))
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(payload).decode()
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(signature).decode()
    sig.write_text(json.dumps(bundle))


def _rehash(statement: dict[str, Any]) -> None:
    import hashlib

    h = hashlib.sha256()
    for r in statement["predicate"]["resources"]:
        h.update(bytes.fromhex(r["digest"]))
    statement["subject"][0]["digest"]["sha256"] = h.hexdigest()


def _add_resource(name: str) -> Any:
    def edit(statement: dict[str, Any]) -> None:
        statement["predicate"]["resources"].append({"name": name, "algorithm": "sha256", "digest": "0" * 64})
        _rehash(statement)

    return edit


def _set_ignore(paths: list[str]) -> Any:
    return lambda statement: statement["predicate"]["serialization"].update(ignore_paths=paths)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_add_resource("a/b"), "lists 'a/b' twice"),
        (_add_resource("../outside"), "resource name '../outside' is not a plain relative path"),
        (_add_resource("/etc/passwd"), "resource name '/etc/passwd' is not a plain relative path"),
        (_add_resource("a//b"), "resource name 'a//b' is not a plain relative path"),
        (_set_ignore(["."]), "ignored path '.' is not a plain relative path"),
        (_set_ignore(["a/../.."]), "ignored path 'a/../..' is not a plain relative path"),
        (_set_ignore(["x"] * 257), "at most 256 items"),
    ],
    ids=["duplicate-name", "dot-dot-name", "absolute-name", "empty-part", "ignore-dot", "ignore-dot-dot", "too-many-ignored"],
)
def test_a_trusted_signers_odd_manifest_is_refused(tmp_path: Path, edit: Any, message: str) -> None:
    private, public = key_files(tmp_path, "p256")
    d = _model(tmp_path)
    _sign(d, private)
    _resign(d / "model.sig", private, edit)
    with pytest.raises(ModelSignatureFormatError) as e:
        verify_model_signature(d, _trust(public))
    assert message in str(e.value)


def test_a_manifest_of_no_file_is_refused(tmp_path: Path) -> None:
    # model_signing signs a directory whose only files it ignores, and verifies the empty manifest
    # for any such directory; kvgraft refuses a signature that signs nothing.
    private, public = key_files(tmp_path, "p256")
    d = tmp_path / "nothing"
    d.mkdir()
    (d / ".gitignore").write_text("*\n")
    ms_sign(d, private)
    assert _statement(d / "model.sig")["predicate"]["resources"] == []
    ms_accepts(d, public)
    with pytest.raises(ModelSignatureFormatError, match="signs no file: a model.sig must sign at least one file"):
        verify_model_signature(d, _trust(public))


def _in_thread(run: Any) -> BaseException | None:
    """Run ``run`` in a daemon thread; fail (rather than hang the suite) if it does not return in 30 s."""
    import threading

    caught: list[BaseException] = []

    def body() -> None:
        try:
            run()
        except BaseException as e:  # noqa: BLE001 - handed back to the test
            caught.append(e)

    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive(), "the check waited or read without end"
    return caught[0] if caught else None


def test_a_model_sig_that_is_a_link_or_a_pipe_is_refused_unread(tmp_path: Path) -> None:
    """A stranger's directory whose model.sig points at /dev/zero, or is a pipe, must not make the
    verifier read forever or wait for a writer (``--artifact-dir`` reads model.sig unasked)."""
    _, public = key_files(tmp_path, "p256")
    d = _model(tmp_path)
    (d / "model.sig").symlink_to("/dev/zero")
    for run in (lambda: verify_model_signature(d, _trust(public)), lambda: check_model_signature_beside(d, _trust(public))):
        e = _in_thread(run)
        assert isinstance(e, ModelDirectoryError) and "model.sig is a symbolic link" in str(e), e
    (d / "model.sig").unlink()
    os.mkfifo(d / "model.sig")
    e = _in_thread(lambda: verify_model_signature(d, _trust(public)))
    assert isinstance(e, ModelDirectoryError) and "is not a regular file (a pipe, socket or device)" in str(e), e
    (d / "model.sig").unlink()
    # A --signature outside the directory may be a link (the caller chose it), but only to a file.
    (tmp_path / "outside.sig").symlink_to("/dev/zero")
    e = _in_thread(lambda: verify_model_signature(d, _trust(public), signature=tmp_path / "outside.sig"))
    assert isinstance(e, ModelDirectoryError) and "is not a regular file" in str(e), e


def test_a_folder_swapped_for_a_link_after_the_walk_is_refused(tmp_path: Path) -> None:
    """Files are opened beneath their folder's descriptor with O_NOFOLLOW at every step: a folder
    replaced by a link to a look-alike between the walk and the read is refused, not followed."""
    from kvgraft.verifier._internal.oms import _hash_file, _ignore_set, _walk

    d = _model(tmp_path)
    files = _walk(d, _ignore_set([".git"]), 100)
    assert files["logits/0.f32"] == ("logits", "0.f32")
    decoy = tmp_path / "decoy"
    (d / "logits").rename(decoy)
    (d / "logits").symlink_to(decoy)
    with pytest.raises(ModelDirectoryError, match="logits in .* changed while it was read"):
        _hash_file(d, files["logits/0.f32"])
    (d / "logits").unlink()
    (d / "logits").mkdir()
    (d / "logits" / "0.f32").symlink_to(decoy / "0.f32")
    with pytest.raises(ModelDirectoryError, match="logits/0.f32 in .* changed while it was read"):
        _hash_file(d, files["logits/0.f32"])


def test_envelope_artifact_dir_passes_over_a_model_sig_by_an_untrusted_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: a directory whose statement verifies was refused by ``--artifact-dir`` because
    a model.sig beside it was signed by a key the verifier does not trust (a model hub's, say).
    As DSSE passes over signatures by unknown keys, it is now reported unchecked; the statement's
    subjects are checked as before."""
    ours, _ = key_files(tmp_path, "p256")
    hub_dir = tmp_path / "hub"
    hub_dir.mkdir()
    hub, hub_pub = key_files(hub_dir, "p384")
    d = _signed_subject_dir(tmp_path, "artifact", "kv.bin", b"tensors", "statement.dsse.json", ours)
    ms_sign(d, hub)  # the real tool, with a key we do not trust
    ms_accepts(d, hub_pub)
    trust = tmp_path / "trust.json"
    trust.write_text(json.dumps(_trust(ours.with_name(ours.name + ".pub")).to_json()))
    argv = ["--json", "envelope", str(d / "statement.dsse.json"), "--trusted-keys", str(trust), "--artifact-dir", str(d)]
    assert verify_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["subjects_checked"] == ["kv.bin"]
    assert result["model_sig"]["checked"] is False
    assert "none of the 1 trusted ECDSA key(s)" in result["model_sig"]["reason"]
    assert "; model.sig not checked: " in result["summary"]
    # Trusting the hub's key too makes it checked, in full.
    both = TrustedKeys((*_trust(ours.with_name(ours.name + ".pub")).keys, trusted_key("hub", load_public_key(hub_pub))))
    trust.write_text(json.dumps(both.to_json()))
    assert verify_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model_sig"]["checked"] is True and result["model_sig"]["signer"]["name"] == "hub"
    assert "model.sig over 2 file(s) signed by hub (ECDSA P-384" in result["summary"]


def test_envelope_artifact_dir_passes_over_a_model_sig_kvgraft_cannot_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: a keyless (certificate) model.sig beside an artifact refused the whole check."""
    private, public = key_files(tmp_path, "p256")
    d = _signed_subject_dir(tmp_path, "artifact", "kv.bin", b"tensors", "statement.dsse.json", private)
    _sign(d, private)
    _edit(d / "model.sig", lambda b: b["verificationMaterial"].pop("publicKey") and b["verificationMaterial"].update(
        certificate={"rawBytes": "AA=="}))
    trust = tmp_path / "trust.json"
    trust.write_text(json.dumps(_trust(public).to_json()))
    assert verify_main(["--json", "envelope", str(d / "statement.dsse.json"), "--trusted-keys", str(trust), "--artifact-dir", str(d)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model_sig"]["checked"] is False and "holds certificate but no publicKey" in result["model_sig"]["reason"]
    # The command that requires a model.sig still refuses it.
    assert verify_main(["--json", "oms", str(d), "--trusted-keys", str(trust)]) == 1
    assert json.loads(capsys.readouterr().out)["error"] == "ModelSignatureFormatError"
