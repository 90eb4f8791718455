"""DSSE: the DSSE protocol vectors (tests/vectors/dsse), signing round trips (Ed25519, ECDSA P-256 and
P-384), thresholds over mixed key types, and malformed envelopes."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgraft.verifier import (
    KEY_TYPES,
    BadSignatureError,
    KeyType,
    MalformedInputError,
    ThresholdNotMetError,
    TrustedKeys,
    UnknownKeyError,
    UnsupportedPayloadTypeError,
    VerificationError,
    ephemeral_signing_key,
    generate_private_key,
    pae,
    parse_envelope,
    parse_trusted_keys,
    public_key_pem,
    sign_envelope,
    trusted_key,
    verify_envelope,
)


def _vectors(vectors: Path) -> dict[str, Any]:
    return json.loads((vectors / "dsse" / "vectors.json").read_text())


def _keys(doc: dict[str, Any]) -> dict[str, Ed25519PrivateKey]:
    return {name: Ed25519PrivateKey.from_private_bytes(bytes.fromhex(k["seed"])) for name, k in doc["keys"].items()}


def _trust(doc: dict[str, Any], vector: dict[str, Any]) -> TrustedKeys:
    keys = _keys(doc)
    return TrustedKeys(
        keys=tuple(trusted_key(n, keys[n].public_key()) for n in vector["trustedKeys"]),
        threshold=vector["threshold"],
        payload_types=tuple(vector["supportedPayloadTypes"]),
    )


VECTOR_IDS = [
    "single-signature", "url-safe-base64", "payload-type-swapped", "non-ascii-payload-type",
    "empty-payload", "empty-payload-type", "threshold-two-distinct-keys",
    "threshold-two-one-key-twice", "threshold-two-without-keyids",
]


def test_all_nine_vectors_are_known(vectors: Path) -> None:
    assert [v["id"] for v in _vectors(vectors)["vectors"]] == VECTOR_IDS


@pytest.mark.parametrize("vector_id", VECTOR_IDS)
def test_vector(vectors: Path, vector_id: str) -> None:
    doc = _vectors(vectors)
    vector = next(v for v in doc["vectors"] if v["id"] == vector_id)
    keys = _keys(doc)
    # The public keys in the file are the seeds' keys: a check on the fixture itself.
    for name, k in doc["keys"].items():
        assert keys[name].public_key().public_bytes_raw().hex() == k["public"]
    envelope = parse_envelope(json.dumps(vector["envelope"]).encode())
    payload = base64.urlsafe_b64decode(vector["envelope"]["payload"].replace("+", "-").replace("/", "_") + "==")
    # The expected PAE is what was signed; for the swapped type it is the original type's PAE.
    if vector_id != "payload-type-swapped":
        assert pae(envelope.payload_type, payload).hex() == vector["pae"]
    trust = _trust(doc, vector)
    if vector["expect"] == "accept":
        verified = verify_envelope(envelope, trust)
        assert verified.payload == payload
        assert len(verified.signers) >= vector["threshold"]
    else:
        with pytest.raises(VerificationError) as info:
            verify_envelope(envelope, trust)
        expected = {
            "payload-type-swapped": UnknownKeyError,
            "empty-payload-type": UnsupportedPayloadTypeError,
            "threshold-two-one-key-twice": ThresholdNotMetError,
        }[vector_id]
        assert type(info.value) is expected


def test_swapped_type_fails_because_pae_differs(vectors: Path) -> None:
    doc = _vectors(vectors)
    vector = next(v for v in doc["vectors"] if v["id"] == "payload-type-swapped")
    env = parse_envelope(json.dumps(vector["envelope"]).encode())
    with pytest.raises(UnknownKeyError, match="none of the envelope's 1 signature"):
        verify_envelope(env, _trust(doc, vector))


def test_pae_counts_bytes_not_characters() -> None:
    assert pae("é", b"x") == b"DSSEv1 2 \xc3\xa9 1 x"
    assert pae("t", b"") == b"DSSEv1 1 t 0 "


def test_sign_then_verify_round_trip_and_one_flipped_bit_fails() -> None:
    key = Ed25519PrivateKey.generate()
    trust = TrustedKeys((trusted_key("alice", key.public_key()),))
    with ephemeral_signing_key(key) as signer:
        env = sign_envelope(b'{"hello": "world"}', [signer])
    assert env.signatures[0].keyid == trust.keys[0].keyid
    assert verify_envelope(env, trust).payload == b'{"hello": "world"}'

    sig = bytearray(base64.b64decode(env.signatures[0].sig))
    sig[5] ^= 0x01
    bad = env.model_copy(update={"signatures": [env.signatures[0].model_copy(update={"sig": base64.b64encode(bytes(sig)).decode()})]})
    with pytest.raises(BadSignatureError, match="does not verify over this payload"):
        verify_envelope(bad, trust)

    other = env.model_copy(update={"payload": base64.b64encode(b'{"hello": "w0rld"}').decode()})
    with pytest.raises(BadSignatureError):
        verify_envelope(other, trust)


def test_untrusted_signer_is_unknown_key() -> None:
    with ephemeral_signing_key(Ed25519PrivateKey.generate()) as mallory:
        env = sign_envelope(b"{}", [mallory])
    trust = TrustedKeys((trusted_key("alice", Ed25519PrivateKey.generate().public_key()),))
    with pytest.raises(UnknownKeyError, match="trusted key"):
        verify_envelope(env, trust)


def test_signing_after_the_block_is_refused() -> None:
    with ephemeral_signing_key(Ed25519PrivateKey.generate()) as signer:
        pass
    with pytest.raises(VerificationError, match="after its 'with' block closed"):
        signer.sign(b"x")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (b"not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"payload": 3, "payloadType": "t", "signatures": [{"sig": ""}]}', "payload: Input should be a valid string"),
        (b'{"payload": "", "payloadType": "t", "signatures": []}', "signatures"),
        (b'{"payload": "", "payloadType": "t"}', "signatures: Field required"),
        (b'{"payload": "", "payload": "", "payloadType": "t", "signatures": [{"sig": ""}]}', "duplicate key 'payload'"),
        (b"\xff\xfe", "not UTF-8"),
        (b'{"payload": "' + b"[" * 100, "not valid JSON"),
        (b"[" * 100 + b"]" * 100, "nests deeper"),
        (b'{"payload": NaN}', "NaN is not valid JSON"),
    ],
)
def test_malformed_envelopes_are_named(text: bytes, message: str) -> None:
    with pytest.raises(MalformedInputError, match=message):
        parse_envelope(text)


@pytest.mark.parametrize(
    ("payload", "message"),
    [("a", "wrong length or padding"), ("ab+_", "mixes the standard and URL-safe"), ("a b=", "not valid base64"), ("ab===", "wrong length or padding")],
)
def test_bad_base64_is_malformed(payload: str, message: str) -> None:
    env = parse_envelope(json.dumps({"payload": payload, "payloadType": "application/vnd.in-toto+json", "signatures": [{"sig": "AA=="}]}).encode())
    trust = TrustedKeys((trusted_key("a", Ed25519PrivateKey.generate().public_key()),))
    with pytest.raises(MalformedInputError, match=message):
        verify_envelope(env, trust)


@pytest.mark.parametrize("key_type", KEY_TYPES)
def test_round_trip_per_key_type_through_a_trusted_keys_file(key_type: KeyType) -> None:
    key = generate_private_key(key_type)
    doc = {"version": 1, "keys": [{"name": "alice", "public_key_pem": public_key_pem(key.public_key()).decode()}]}
    trust = parse_trusted_keys(json.dumps(doc).encode())
    with ephemeral_signing_key(key) as signer:
        env = sign_envelope(b'{"a": 1}', [signer])
    assert env.signatures[0].keyid == trust.keys[0].keyid
    assert verify_envelope(env, trust).signers == trust.keys
    tampered = env.model_copy(update={"payload": base64.b64encode(b'{"a": 2}').decode()})
    with pytest.raises(BadSignatureError, match="does not verify over this payload"):
        verify_envelope(tampered, trust)


def test_mixed_ed25519_and_p256_meet_threshold_two() -> None:
    ed, p256, p384 = (generate_private_key(t) for t in KEY_TYPES)
    trust = TrustedKeys((trusted_key("ed", ed.public_key()), trusted_key("p256", p256.public_key())), threshold=2)
    with ephemeral_signing_key(ed) as a, ephemeral_signing_key(p256) as b:
        both = sign_envelope(b"{}", [a, b])
        only_ed = sign_envelope(b"{}", [a])
    assert {k.name for k in verify_envelope(both, trust).signers} == {"ed", "p256"}
    with pytest.raises(ThresholdNotMetError, match=r"1 distinct trusted key\(s\) signed \(ed\); 2 are required"):
        verify_envelope(only_ed, trust)
    # A third, untrusted P-384 signature does not count; without keyid hints every key is still tried.
    with ephemeral_signing_key(p384) as c, ephemeral_signing_key(p256) as b2, ephemeral_signing_key(ed) as a2:
        hintless = sign_envelope(b"{}", [c, b2, a2])
    hintless = hintless.model_copy(update={"signatures": [sg.model_copy(update={"keyid": ""}) for sg in hintless.signatures]})
    assert len(verify_envelope(hintless, trust).signers) == 2
