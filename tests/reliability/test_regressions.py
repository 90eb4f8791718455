"""Regression tests for the bugs the hostile inputs found, each named after its bug."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from kvgraft.engine import KvFileError
from kvgraft.engine._internal.kvfile import deserialize
from kvgraft.schemas import DocumentError, parse_statement
from kvgraft.verifier import MalformedInputError, parse_envelope
from tests.registry.conftest import Key, harness


def _kv(header: bytes, body: bytes = b"") -> bytes:
    return struct.pack("<Q", len(header)) + header + body


def test_kvfile_deeply_nested_header_raised_recursion_error() -> None:
    # Was: json.loads recursed until RecursionError escaped deserialize.
    header = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(KvFileError, match=r"nested \d+ levels deep"):
        deserialize(_kv(header))


def test_kvfile_nesting_inside_strings_is_not_counted() -> None:
    header = b'{"__metadata__":{"note":"[[[[{{{{"}}'
    tensors, metadata = deserialize(_kv(header + b" " * (-len(header) % 8)))
    assert tensors == {}
    assert metadata == {"note": "[[[[{{{{"}


def test_kvfile_huge_integer_in_header_raised_value_error() -> None:
    # Was: int() past sys.get_int_max_str_digits() raised a bare ValueError.
    header = b'{"t":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}'
    with pytest.raises(KvFileError, match="unreadable header"):
        deserialize(_kv(header, b"\0" * 4))


def test_kvfile_unhashable_dtype_raised_type_error() -> None:
    # Was: `info["dtype"] not in _BY_NAME` with a list raised TypeError: unhashable type.
    header = b'{"t":{"dtype":["F32"],"shape":[1],"data_offsets":[0,4]}}'
    with pytest.raises(KvFileError, match="unsupported dtype"):
        deserialize(_kv(header, b"\0" * 4))


def test_kvfile_duplicate_name_message_had_two_hints() -> None:
    header = b'{"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    with pytest.raises(KvFileError, match="duplicate tensor name 't'") as info:
        deserialize(_kv(header, b"\0" * 4))
    assert str(info.value).count("(hint:") == 1


def test_kvfile_falsy_metadata_was_accepted_as_empty() -> None:
    with pytest.raises(KvFileError, match="__metadata__ must map strings to strings"):
        deserialize(_kv(b'{"__metadata__":0}    '))


def test_statement_with_huge_integer_raised_value_error() -> None:
    # Was: parse_json let json.loads' ValueError for a 5000-digit integer escape.
    with pytest.raises(DocumentError, match="number too long to read"):
        parse_statement(b'{"_type":' + b"1" * 5000 + b"}")
    with pytest.raises(MalformedInputError, match="number too long to read"):
        parse_envelope(b'{"payloadType":"x","payload":"","signatures":[' + b"7" * 5000 + b"]}", source="envelope")


def test_registry_envelope_with_huge_integer_was_500(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    # Was: the ValueError reached the app's catch-all handler: 500 instead of 400.
    with harness(tmp_path / "data", rkeys) as reg:
        r = reg.publish(b'{"payloadType":"application/vnd.in-toto+json","payload":' + b"1" * 5000 + b',"signatures":[]}')
        assert r.status_code == 400, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
        assert r.json()["type"].endswith("/malformed-envelope")
        assert "number too long to read" in r.json()["detail"]


@pytest.mark.parametrize(
    ("document", "message"),
    [(b"9" * 5000, "number too long to read"), (b"[" * 100_000 + b"]" * 100_000, "nests deeper than 64 levels")],
    ids=["huge-integer", "deep-nesting"],
)
def test_sigstore_bundle_huge_integer_or_deep_nesting_escaped_as_value_or_recursion_error(
    tmp_path: Path, document: bytes, message: str
) -> None:
    # Was: the bundle reader caught only UnicodeDecodeError and JSONDecodeError.
    from kvgraft.verifier._internal.bundles import CertificateIdentity, verify_bundle

    bundle = tmp_path / "b.sigstore.json"
    bundle.write_bytes(document)
    with pytest.raises(MalformedInputError, match=message):
        verify_bundle(bundle, "sha256:" + "0" * 64, CertificateIdentity("a@b", "https://issuer"))


def test_checkpoint_tree_size_past_128_bits_was_500(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    # Was: DuckDB raised InvalidInputException for the huge parameter; the app answered 500.
    with harness(tmp_path / "data", rkeys) as reg:
        for size in ("9" * 400, str(2**128), "-" + "9" * 60):
            r = reg.client.get("/v1/log/checkpoint", params={"tree_size": size})
            assert r.status_code == 404, r.text
            assert r.json()["type"].endswith("/not-found") and "no checkpoint was signed at tree size" in r.json()["detail"]


def _bundle_with_altered_certificate(tmp_path: Path, alter: Callable[[bytes, bytes], bytes]) -> Path:
    import base64
    import json

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    vectors = Path(__file__).resolve().parents[1] / "vectors" / "sigstore"
    doc = json.loads((vectors / "bundle.txt.sigstore").read_text())
    cert = doc["verificationMaterial"]["x509CertificateChain"]["certificates"][0]
    der = base64.b64decode(cert["rawBytes"])
    point = x509.load_der_x509_certificate(der).public_key().public_bytes(
        serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
    )
    cert["rawBytes"] = base64.b64encode(alter(der, point)).decode()
    path = tmp_path / "altered.sigstore"
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize(
    "alter",
    [
        # secp384r1's OID 1.3.132.0.34 made 0.3.132.0.34: cryptography raised UnsupportedAlgorithm
        lambda der, point: der.replace(b"\x2b\x81\x04\x00\x22", b"\x03\x81\x04\x00\x22", 1),
        # a point that is not on the curve: cryptography raised ValueError("Invalid key")
        lambda der, point: der.replace(point, point[:40] + bytes([point[40] ^ 1]) + point[41:], 1),
    ],
    ids=["unknown-curve", "point-off-curve"],
)
def test_sigstore_certificate_with_altered_key_raised_unsupported_algorithm_or_value_error(
    tmp_path: Path, alter: Callable[[bytes, bytes], bytes]
) -> None:
    from kvgraft.verifier._internal.bundles import CertificateIdentity, verify_bundle

    vectors = Path(__file__).resolve().parents[1] / "vectors" / "sigstore"
    bundle = _bundle_with_altered_certificate(tmp_path, alter)
    assert bundle.read_bytes() != (vectors / "bundle.txt.sigstore").read_bytes()
    with pytest.raises(MalformedInputError, match="the signing certificate's public key cannot be read"):
        verify_bundle(
            bundle, vectors / "bundle.txt", CertificateIdentity("a@tny.town", "https://github.com/login/oauth"),
            trusted_root=vectors / "trusted_root.sigstage.dev.json",
        )


def test_sigstore_certificate_with_unparsable_extensions_raised_value_error(tmp_path: Path) -> None:
    # Was: describing the identity of a certificate whose SAN does not parse raised ValueError
    # from cryptography while the IdentityMismatchError was being made.
    import base64
    import json

    from kvgraft.verifier import IdentityMismatchError
    from kvgraft.verifier._internal.bundles import CertificateIdentity, verify_bundle

    vectors = Path(__file__).resolve().parents[1] / "vectors" / "sigstore"
    doc = json.loads((vectors / "staging-rekor-v2.txt.sigstore.json").read_text())
    cert = doc["verificationMaterial"]["certificate"]
    der = base64.b64decode(cert["rawBytes"])
    i = der.index(bytes.fromhex("0603551d11")) + 5  # after the subjectAltName OID
    i += 3 if der[i] == 0x01 else 0  # a 'critical' BOOLEAN
    i += 2  # the OCTET STRING's tag and length: i is the SAN's SEQUENCE tag
    assert der[i] == 0x30
    cert["rawBytes"] = base64.b64encode(der[:i] + b"\x00" + der[i + 1 :]).decode()
    bundle = tmp_path / "altered.sigstore.json"
    bundle.write_text(json.dumps(doc))
    with pytest.raises(IdentityMismatchError, match="the signing certificate is for no identity"):
        verify_bundle(
            bundle, vectors / "staging-rekor-v2.txt", CertificateIdentity("jku@goto.fi", "https://github.com/login/oauth"),
            trusted_root=vectors / "trusted_root.sigstage.dev.json",
        )


def test_sigstore_certificate_with_unknown_version_raised_invalid_version(tmp_path: Path) -> None:
    # Was: cryptography's x509.InvalidVersion (not a ValueError) escaped the certificate reader.
    import base64
    import json

    from kvgraft.verifier._internal.bundles import CertificateIdentity, verify_bundle

    vectors = Path(__file__).resolve().parents[1] / "vectors" / "sigstore"
    doc = json.loads((vectors / "bundle.txt.sigstore").read_text())
    cert = doc["verificationMaterial"]["x509CertificateChain"]["certificates"][0]
    der = base64.b64decode(cert["rawBytes"])
    v3 = b"\xa0\x03\x02\x01\x02"  # [0] EXPLICIT INTEGER 2: X.509 v3
    assert v3 in der
    cert["rawBytes"] = base64.b64encode(der.replace(v3, b"\xa0\x03\x02\x01\x05", 1)).decode()
    bundle = tmp_path / "altered.sigstore"
    bundle.write_text(json.dumps(doc))
    with pytest.raises(MalformedInputError, match="bundle certificate 0 is not a DER X.509 certificate"):
        verify_bundle(
            bundle, vectors / "bundle.txt", CertificateIdentity("a@tny.town", "https://github.com/login/oauth"),
            trusted_root=vectors / "trusted_root.sigstage.dev.json",
        )


def test_a_zeroed_signature_claiming_a_registered_key_was_accepted_regression_claimed_keyid(
    tmp_path: Path, rkeys: dict[str, Key]
) -> None:
    """Was 201: an envelope with bob's valid signature and a zeroed one claiming alice's registered
    keyid was logged, as if alice had co-signed; docs/registry.md says a signature that claims a
    registered key and does not verify is refused (422). Nothing is logged."""
    import base64
    import json

    from kvgraft.verifier import keyid_of
    from tests.registry.conftest import artifact

    alice, bob = rkeys["alice"], rkeys["bob"]
    art = artifact("co-signed?")
    with harness(tmp_path / "data", rkeys) as h:
        assert h.put_blob(art.tensors, "bob").status_code in (200, 201)
        envelope = json.loads(bob.sign(art.statement))
        forged = {"keyid": str(keyid_of(alice.private.public_key())), "sig": base64.b64encode(bytes(64)).decode()}
        for signatures in ([*envelope["signatures"], forged], [forged, *envelope["signatures"]]):
            r = h.publish(json.dumps({**envelope, "signatures": signatures}).encode(), "bob")
            assert r.status_code == 422, r.text
            detail = r.json()["detail"]
            assert "claims key" in detail and "of publisher 'alice'" in detail and "does not verify" in detail, detail
        assert h.client.get("/v1/log/checkpoint").text.splitlines()[1] == "0"
        # bob's envelope as signed, and one co-signed for real by alice, are logged.
        cosigned = json.loads(alice.sign(art.statement))
        both = {**envelope, "signatures": envelope["signatures"] + cosigned["signatures"]}
        assert h.publish(json.dumps(both).encode(), "bob").status_code == 201
