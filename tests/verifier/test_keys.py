"""Ed25519 keys: generation, PEM round trips with and without passphrase, and trusted-keys files."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ec import SECP256R1
from cryptography.hazmat.primitives.asymmetric.ec import generate_private_key as ec_key

from kvgraft.verifier import (
    KeyFileError,
    TrustedKeys,
    generate_private_key,
    keyid_of,
    load_private_key,
    load_public_key,
    open_signing_key,
    parse_trusted_keys,
    public_key_pem,
    save_private_key,
    save_public_key,
    trusted_key,
)


def test_keyid_is_sha256_of_raw_public_key() -> None:
    key = generate_private_key()
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert keyid_of(key.public_key()) == hashlib.sha256(raw).hexdigest()


def test_rfc8032_key_a_has_a_stable_keyid() -> None:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    a = Ed25519PrivateKey.from_private_bytes(bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60"))
    raw = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
    assert keyid_of(a.public_key()) == hashlib.sha256(raw).hexdigest()


def test_save_load_round_trip_with_passphrase(tmp_path: Path) -> None:
    key = generate_private_key()
    path = tmp_path / "k.pem"
    save_private_key(key, path, b"correct horse")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert b"ENCRYPTED" in path.read_bytes()
    loaded = load_private_key(path, b"correct horse")
    assert keyid_of(loaded.public_key()) == keyid_of(key.public_key())
    with pytest.raises(KeyFileError, match="is encrypted: give its passphrase"):
        load_private_key(path)
    with pytest.raises(KeyFileError, match="passphrase is wrong"):
        load_private_key(path, b"wrong")
    with open_signing_key(path, b"correct horse") as signer:
        sig = signer.sign(b"m")
    key.public_key().verify(sig, b"m")


def test_unencrypted_key_given_a_passphrase(tmp_path: Path) -> None:
    path = tmp_path / "k.pem"
    save_private_key(generate_private_key(), path)
    with pytest.raises(KeyFileError, match="is not encrypted: give no passphrase"):
        load_private_key(path, b"x")


def test_never_overwrites_a_key(tmp_path: Path) -> None:
    path = tmp_path / "k.pem"
    save_private_key(generate_private_key(), path)
    before = path.read_bytes()
    with pytest.raises(KeyFileError, match="already exists"):
        save_private_key(generate_private_key(), path)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.pem"]  # no temp file left


@pytest.mark.parametrize(
    ("content", "message"),
    [(b"", "not a PEM private key"), (b"-----BEGIN PRIVATE KEY-----\ntruncated", "not a PEM private key")],
)
def test_bad_private_key_files(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "k.pem"
    path.write_bytes(content)
    with pytest.raises(KeyFileError, match=message):
        load_private_key(path)


def test_wrong_algorithm_and_paths(tmp_path: Path) -> None:
    ec = ec_key(SECP256R1())
    p = tmp_path / "ec.pem"
    p.write_bytes(ec.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with pytest.raises(KeyFileError, match="not an Ed25519 key"):
        load_private_key(p)
    with pytest.raises(KeyFileError, match="is a directory"):
        load_private_key(tmp_path)
    with pytest.raises(KeyFileError, match="does not exist"):
        load_public_key(tmp_path / "missing.pem")


def test_public_key_round_trip(tmp_path: Path) -> None:
    key = generate_private_key()
    save_public_key(key.public_key(), tmp_path / "k.pub")
    assert keyid_of(load_public_key(tmp_path / "k.pub")) == keyid_of(key.public_key())


def test_trusted_keys_round_trip_and_thresholds() -> None:
    a, b = generate_private_key().public_key(), generate_private_key().public_key()
    trust = TrustedKeys((trusted_key("a", a), trusted_key("b", b)), threshold=1, thresholds={"https://kvgraft.dev/evaluation/v1": 2})
    parsed = parse_trusted_keys(json.dumps(trust.to_json()).encode())
    assert [k.keyid for k in parsed.keys] == [k.keyid for k in trust.keys]
    assert parsed.threshold_for("https://kvgraft.dev/evaluation/v1") == 2
    assert parsed.threshold_for("https://kvgraft.dev/kv-artifact/v1") == 1


def _doc(**over: object) -> bytes:
    key = generate_private_key().public_key()
    doc = {"version": 1, "keys": [{"name": "a", "public_key_pem": public_key_pem(key).decode()}], "threshold": 1}
    doc.update(over)
    return json.dumps(doc).encode()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"{", "is not valid JSON"),
        (_doc(threshold=2), "threshold 2 for threshold cannot be met by 1 key"),
        (_doc(version=2), "version: Input should be less than or equal to 1"),
        (_doc(keys=[]), "keys: List should have at least 1 item"),
        (_doc(keys=[{"name": "a", "public_key_pem": "nope"}]), "key 'a' is not a PEM public key"),
        (_doc(surprise=True), "surprise: Extra inputs are not permitted"),
    ],
)
def test_bad_trusted_keys_files(data: bytes, message: str) -> None:
    with pytest.raises(KeyFileError, match=message):
        parse_trusted_keys(data)


def test_trusted_keys_keyid_must_match() -> None:
    key = generate_private_key().public_key()
    doc = {"version": 1, "keys": [{"name": "a", "keyid": "0" * 64, "public_key_pem": public_key_pem(key).decode()}]}
    with pytest.raises(KeyFileError, match="but its public key has keyid"):
        parse_trusted_keys(json.dumps(doc).encode())


def test_same_key_twice_is_refused() -> None:
    pem = public_key_pem(generate_private_key().public_key()).decode()
    doc = {"version": 1, "keys": [{"name": "a", "public_key_pem": pem}, {"name": "b", "public_key_pem": pem}]}
    with pytest.raises(KeyFileError, match="the same public key twice"):
        parse_trusted_keys(json.dumps(doc).encode())
