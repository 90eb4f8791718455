"""Keyid interop with securesystemslib (the real library, pinned in the ``dev`` extra), both ways,
for Ed25519, ECDSA P-256 and P-384 (docs/trusted-keys.md, "Keyids and securesystemslib").

(a) An envelope securesystemslib signs verifies with ``kvgraft-verify envelope`` and
    ``verify_envelope`` given a trusted-keys file holding the same public key: kvgraft tries every
    trusted key, so securesystemslib's own keyid in the signature does not matter.
(b) An envelope kvgraft signs verifies with securesystemslib's ``Envelope.verify`` given an
    ``SSlibKey`` made from the PEM with kvgraft's keyid; with securesystemslib's default keyid the
    keyid match fails and so does the verification (the claim the docs make).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Literal

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from securesystemslib import exceptions as sslib_errors
from securesystemslib.dsse import Envelope as SslibEnvelope
from securesystemslib.formats import encode_canonical
from securesystemslib.signer import CryptoSigner, SSlibKey

from kvgraft.cli import main as kvgraft_main
from kvgraft.verifier import keyid_of, load_trusted_keys, parse_envelope, parse_public_key, verify_envelope
from kvgraft.verifier.cli import main as verify_main

SslibType = Literal["ed25519", "p256", "p384"]
KEY_TYPES: tuple[SslibType, ...] = ("ed25519", "p256", "p384")
#: securesystemslib's name of each key type and its scheme (what SSlibKey.from_crypto picks by default).
SSLIB_SCHEME = {
    "ed25519": ("ed25519", "ed25519"),
    "p256": ("ecdsa", "ecdsa-sha2-nistp256"),
    "p384": ("ecdsa", "ecdsa-sha2-nistp384"),
}
PREDICATE_TYPE = "https://example.com/note/v1"


def _statement(subject: Path) -> bytes:
    digest = hashlib.sha256(subject.read_bytes()).hexdigest()
    statement = {
        "_type": "https://in-toto.io/Statement/v1",
        "subject": [{"name": subject.name, "digest": {"sha256": digest}}],
        "predicateType": PREDICATE_TYPE,
        "predicate": {"note": "signed by securesystemslib"},
    }
    return json.dumps(statement).encode()


def _crypto_key(key_type: SslibType) -> Ed25519PrivateKey | ec.EllipticCurvePrivateKey:
    if key_type == "ed25519":
        return Ed25519PrivateKey.generate()
    return ec.generate_private_key(ec.SECP256R1() if key_type == "p256" else ec.SECP384R1())


@pytest.mark.parametrize("key_type", KEY_TYPES)
def test_securesystemslib_signs_kvgraft_verifies(tmp_path: Path, capsys: pytest.CaptureFixture[str], key_type: SslibType) -> None:
    artifact = tmp_path / "artifact"
    artifact.mkdir()
    (artifact / "kv.safetensors").write_bytes(b"\x07" * 4096)
    private = _crypto_key(key_type)
    signer = CryptoSigner(private)  # securesystemslib's default keyid for the key
    assert (signer.public_key.keytype, signer.public_key.scheme) == SSLIB_SCHEME[key_type]
    envelope = SslibEnvelope(_statement(artifact / "kv.safetensors"), "application/vnd.in-toto+json", {})
    envelope.sign(signer)
    (artifact / "statement.dsse.json").write_text(json.dumps(envelope.to_dict()))

    pem = private.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "sslib.pub").write_bytes(pem)
    assert kvgraft_main(["keys", "trust", "--file", str(tmp_path / "trust.json"), "--name", "sslib",
                         "--public-key", str(tmp_path / "sslib.pub")]) == 0
    capsys.readouterr()

    code = verify_main(["envelope", str(artifact / "statement.dsse.json"), "--trusted-keys", str(tmp_path / "trust.json"),
                        "--artifact-dir", str(artifact)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("OK: ") and "signed by sslib" in out and "1 subject file(s) match" in out

    parsed = parse_envelope((artifact / "statement.dsse.json").read_bytes())
    trusted = load_trusted_keys(tmp_path / "trust.json")
    # The signature carries securesystemslib's keyid, not kvgraft's: kvgraft matches by trying keys.
    assert parsed.signatures[0].keyid == signer.public_key.keyid != trusted.keys[0].keyid
    assert [k.name for k in verify_envelope(parsed, trusted).signers] == ["sslib"]


@pytest.mark.parametrize("key_type", KEY_TYPES)
def test_kvgraft_signs_securesystemslib_verifies(tmp_path: Path, capsys: pytest.CaptureFixture[str], key_type: SslibType) -> None:
    (tmp_path / "data.bin").write_bytes(b"the data")
    (tmp_path / "pred.json").write_text('{"note": "signed by kvgraft"}')
    assert kvgraft_main(["keys", "generate", "--out", str(tmp_path / "k.pem"), "--type", key_type]) == 0
    assert kvgraft_main(["sign", "--key", str(tmp_path / "k.pem"), "--subject", str(tmp_path / "data.bin"),
                         "--predicate-type", PREDICATE_TYPE, "--predicate", str(tmp_path / "pred.json"),
                         "--out", str(tmp_path / "env.dsse.json")]) == 0
    capsys.readouterr()
    pem = (tmp_path / "k.pem.pub").read_bytes()
    kvgraft_keyid = keyid_of(parse_public_key(pem))
    envelope = SslibEnvelope.from_dict(json.loads((tmp_path / "env.dsse.json").read_text()))
    assert list(envelope.signatures) == [kvgraft_keyid]

    # With kvgraft's keyid (the docs' recipe) securesystemslib finds and verifies the signature.
    public = serialization.load_pem_public_key(pem)
    key = SSlibKey.from_crypto(public, keyid=kvgraft_keyid)  # type: ignore[arg-type]
    assert (key.keytype, key.scheme) == SSLIB_SCHEME[key_type]
    assert envelope.verify([key], 1) == {kvgraft_keyid: key}

    # The keyid rule itself: sha256 of the raw key (Ed25519) or of the uncompressed point (ECDSA).
    if key_type == "ed25519":
        raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    else:
        raw = public.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
    assert kvgraft_keyid == hashlib.sha256(raw).hexdigest()

    # securesystemslib's default keyid is sha256 of its canonical key JSON: another number, so its
    # keyid-matching verification does not even try the (valid) signature.
    default = SSlibKey.from_crypto(public)  # type: ignore[arg-type]
    keytype, scheme = SSLIB_SCHEME[key_type]
    canonical = encode_canonical({"keytype": keytype, "scheme": scheme, "keyval": default.keyval})
    assert isinstance(canonical, str)
    assert default.keyid == hashlib.sha256(canonical.encode()).hexdigest() != kvgraft_keyid
    with pytest.raises(sslib_errors.VerificationError, match="Found: 0, Expected 1"):
        envelope.verify([default], 1)

    # And a changed payload byte is refused by securesystemslib with kvgraft's keyid too.
    assert b"signed by kvgraft" in envelope.payload
    envelope.payload = envelope.payload.replace(b"signed by kvgraft", b"signed by kvgrafT")
    with pytest.raises(sslib_errors.VerificationError, match="Found: 0, Expected 1"):
        envelope.verify([key], 1)
