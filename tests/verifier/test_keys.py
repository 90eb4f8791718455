"""Keys (Ed25519, ECDSA P-256, P-384): generation, PEM round trips with and without passphrase,
the keyid convention, refused key types, signing and verifying, and trusted-keys files."""

from __future__ import annotations

import hashlib
import json
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgraft.verifier import (
    KEY_TYPES,
    BadSignatureError,
    KeyFileError,
    KeyType,
    TrustedKeys,
    UnsupportedKeyTypeError,
    ephemeral_signing_key,
    generate_private_key,
    key_type_of,
    keyid_of,
    load_private_key,
    load_public_key,
    open_signing_key,
    parse_public_key,
    parse_trusted_keys,
    public_key_pem,
    require_ed25519,
    save_private_key,
    save_public_key,
    trusted_key,
    verify_signature,
)


def test_keyid_is_sha256_of_raw_public_key() -> None:
    key = generate_private_key()
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert keyid_of(key.public_key()) == hashlib.sha256(raw).hexdigest()


def test_rfc8032_key_a_has_a_stable_keyid() -> None:
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


# --- ECDSA P-256 and P-384 beside Ed25519 ---------------------------------------------------


@pytest.mark.parametrize("key_type", KEY_TYPES)
def test_generate_save_load_sign_verify_per_type(tmp_path: Path, key_type: KeyType) -> None:
    key = generate_private_key(key_type)
    assert key_type_of(key) == key_type and key_type_of(key.public_key()) == key_type
    save_private_key(key, tmp_path / "k.pem", b"pw")
    save_public_key(key.public_key(), tmp_path / "k.pem.pub")
    public = load_public_key(tmp_path / "k.pem.pub")
    assert key_type_of(public) == key_type
    assert keyid_of(public) == keyid_of(key.public_key())
    with open_signing_key(tmp_path / "k.pem", b"pw") as signer:
        assert signer.key_type == key_type and signer.keyid == keyid_of(public)
        sig = signer.sign(b"message")
    verify_signature(public, sig, b"message")
    with pytest.raises(BadSignatureError, match=r"signature does not verify with key [0-9a-f]{16}\.\.\. over these bytes"):
        verify_signature(public, sig, b"messagE")
    with pytest.raises(BadSignatureError):
        verify_signature(public, b"\x30\x02garbage", b"message")


@pytest.mark.parametrize(("key_type", "curve", "digest"), [("p256", ec.SECP256R1(), hashes.SHA256()), ("p384", ec.SECP384R1(), hashes.SHA384())])
def test_ecdsa_signatures_are_der_with_the_curves_hash(key_type: KeyType, curve: ec.EllipticCurve, digest: hashes.HashAlgorithm) -> None:
    key = generate_private_key(key_type)
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == curve.name
    with ephemeral_signing_key(key) as signer:
        sig = signer.sign(b"m")
    # cryptography verifies DER (X9.62 Ecdsa-Sig-Value) with the named hash: what DSSE tools expect.
    key.public_key().verify(sig, b"m", ec.ECDSA(digest))
    assert sig[0] == 0x30  # a DER SEQUENCE, not a raw r||s


def test_keyid_convention_vectors() -> None:
    """Ed25519: sha256 of the 32 raw bytes; ECDSA: sha256 of the uncompressed point 0x04||X||Y."""
    ed = Ed25519PrivateKey.from_private_bytes(bytes(range(32))).public_key()
    assert keyid_of(ed) == hashlib.sha256(ed.public_bytes_raw()).hexdigest()
    for curve, size in [(ec.SECP256R1(), 32), (ec.SECP384R1(), 48)]:
        public = ec.derive_private_key(12345, curve).public_key()
        numbers = public.public_numbers()
        point = b"\x04" + numbers.x.to_bytes(size, "big") + numbers.y.to_bytes(size, "big")
        assert len(point) == 1 + 2 * size
        assert keyid_of(public) == hashlib.sha256(point).hexdigest()
        # The id is of the key, not of its PEM wrapping.
        assert keyid_of(parse_public_key(public_key_pem(public))) == keyid_of(public)


def _pem_private(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


@pytest.mark.parametrize(
    ("key", "named"),
    [
        (ec.generate_private_key(ec.SECP521R1()), "an ECDSA key on curve secp521r1"),
        (ec.generate_private_key(ec.SECP256K1()), "an ECDSA key on curve secp256k1"),
        (rsa.generate_private_key(public_exponent=65537, key_size=2048), "an RSA key"),
    ],
    ids=["secp521r1", "secp256k1", "rsa"],
)
def test_other_curves_and_algorithms_are_refused(tmp_path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey, named: str) -> None:
    supported = r"supported keys are Ed25519, ECDSA P-256 \(secp256r1\) or ECDSA P-384 \(secp384r1\)"
    path = tmp_path / "k.pem"
    path.write_bytes(_pem_private(key))
    with pytest.raises(UnsupportedKeyTypeError, match=f"private key file {path} holds {named}; {supported}") as info:
        load_private_key(path)
    assert "kvgraft keys generate --type" in str(info.value)
    public_pem = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (tmp_path / "k.pub").write_bytes(public_pem)
    with pytest.raises(UnsupportedKeyTypeError, match=f"holds {named}; {supported}"):
        load_public_key(tmp_path / "k.pub")
    doc = {"version": 1, "keys": [{"name": "x", "public_key_pem": public_pem.decode()}]}
    with pytest.raises(KeyFileError, match=f"key 'x' holds {named}"):
        parse_trusted_keys(json.dumps(doc).encode())


def test_note_keys_stay_ed25519() -> None:
    ed = generate_private_key().public_key()
    assert require_ed25519(ed, "k") is ed
    with pytest.raises(UnsupportedKeyTypeError, match="the registry key is an ECDSA P-256 key; C2SP signed notes") as info:
        require_ed25519(generate_private_key("p256").public_key(), "the registry key")
    assert "--type ed25519" in str(info.value)


def test_trusted_keys_file_with_mixed_types() -> None:
    keys = [generate_private_key(t).public_key() for t in KEY_TYPES]
    trust = TrustedKeys(tuple(trusted_key(t, k) for t, k in zip(KEY_TYPES, keys, strict=True)), threshold=3)
    parsed = parse_trusted_keys(json.dumps(trust.to_json()).encode())
    assert [key_type_of(k.public_key) for k in parsed.keys] == list(KEY_TYPES)
    assert [k.keyid for k in parsed.keys] == [keyid_of(k) for k in keys]


def _spki_pem(der: bytes) -> bytes:
    import base64

    return b"-----BEGIN PUBLIC KEY-----\n" + base64.encodebytes(der) + b"-----END PUBLIC KEY-----\n"


def test_ecdsa_public_key_encodings_keep_one_keyid_and_refuse_a_forged_curve() -> None:
    """A P-256 key in a compressed-point SPKI, or with its curve spelled out (explicit parameters),
    is the same key with the same keyid; explicit parameters with another generator (CVE-2020-0601,
    "CurveBall") are refused, not taken for P-256."""
    public = ec.derive_private_key(424242, ec.SECP256R1()).public_key()
    compressed = public.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.CompressedPoint)
    spki_prefix = bytes.fromhex("3039301306072a8648ce3d020106082a8648ce3d030107032200")
    assert keyid_of(parse_public_key(_spki_pem(spki_prefix + compressed))) == keyid_of(public)

    # SubjectPublicKeyInfo with explicit prime-field parameters of P-256 (SEC 1, ECParameters).
    def explicit(generator: bytes) -> bytes:
        p = bytes.fromhex("ffffffff00000001000000000000000000000000ffffffffffffffffffffffff")
        a = bytes.fromhex("ffffffff00000001000000000000000000000000fffffffffffffffffffffffc")
        b = bytes.fromhex("5ac635d8aa3a93e7b3ebbd55769886bc651d06b0cc53b0f63bce3c3e27d2604b")
        n = bytes.fromhex("ffffffff00000000ffffffffffffffffbce6faada7179e84f3b9cac2fc632551")

        def tlv(tag: int, body: bytes) -> bytes:
            size = len(body)
            length = bytes([size]) if size < 128 else bytes([0x81, size]) if size < 256 else bytes([0x82, size >> 8, size & 0xFF])
            return bytes([tag]) + length + body

        field_id = tlv(0x30, bytes.fromhex("06072a8648ce3d0101") + tlv(0x02, b"\x00" + p))
        curve = tlv(0x30, tlv(0x04, a) + tlv(0x04, b))
        params = tlv(0x30, tlv(0x02, b"\x01") + field_id + curve + tlv(0x04, generator) + tlv(0x02, b"\x00" + n) + tlv(0x02, b"\x01"))
        algorithm = tlv(0x30, bytes.fromhex("06072a8648ce3d0201") + params)
        point = public.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)
        return _spki_pem(tlv(0x30, algorithm + tlv(0x03, b"\x00" + point)))

    def point_of(k: int) -> bytes:
        return ec.derive_private_key(k, ec.SECP256R1()).public_key().public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
        )

    same = parse_public_key(explicit(point_of(1)))
    assert key_type_of(same) == "p256" and keyid_of(same) == keyid_of(public)
    with pytest.raises(KeyFileError, match="is not a PEM public key"):
        parse_public_key(explicit(point_of(2)))


def test_ecdsa_signatures_must_be_strict_der_and_high_s_is_accepted() -> None:
    """DER only (no trailing byte, no long-form length, no raw r||s, no r out of range). Both s and
    n - s verify, as in securesystemslib, Sigstore and model_signing, which do not normalise s:
    refusing high s would refuse half their signatures. Nothing in kvgraft uses a signature's
    bytes as an identity, so this malleability gains a forger nothing."""
    from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature

    key = generate_private_key("p256")
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    public = key.public_key()
    with ephemeral_signing_key(key) as signer:
        sig = signer.sign(b"m")
    r, s = decode_dss_signature(sig)
    n = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
    verify_signature(public, encode_dss_signature(r, n - s), b"m")
    long_form = b"\x30\x81" + sig[1:]
    for bad in (sig + b"\x00", long_form, r.to_bytes(32, "big") + s.to_bytes(32, "big"), encode_dss_signature(r + n, s)):
        with pytest.raises(BadSignatureError, match="ECDSA P-256 signature does not verify"):
            verify_signature(public, bad, b"m")
