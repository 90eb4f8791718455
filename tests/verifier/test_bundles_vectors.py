"""Sigstore bundle verification, offline, on the Sigstore vectors: every EXPECTATIONS.md row, and
every mutation of every accepting row."""

from __future__ import annotations

import base64
import hashlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvgraft.verifier._internal.bundle_certs import SigstoreVerifier
from kvgraft.verifier._internal.bundles import (
    CertificateIdentity,
    ManagedKey,
    VerifiedBundle,
    shipped_trusted_root,
    verify_bundle,
)
from kvgraft.verifier._internal.errors import (
    BadSignatureError,
    DigestMismatchError,
    IdentityMismatchError,
    LogEntryError,
    MalformedInputError,
    UntrustedRootError,
)

from .bundle_helpers import (
    ACCEPT,
    GITHUB_OAUTH,
    GOOGLE,
    Vector,
    artifact_of,
    b64,
    flip_b64,
    load,
    root_of,
    sigstore_vectors,
    write,
)


@pytest.fixture(scope="module")
def vectors() -> Path:
    """tests/vectors/sigstore (the root conftest's ``vectors`` is the whole tests/vectors)."""
    return sigstore_vectors()


# --------------------------------------------------------------------------------------------
# The Sigstore vectors: every EXPECTATIONS.md row, and every mutation of every accepting row
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vector", ACCEPT, ids=lambda v: v.id)
def test_vector_accepts(vectors: Path, vector: Vector) -> None:
    result = verify_bundle(
        vectors / vector.bundle,
        artifact_of(vectors, vector),
        CertificateIdentity(vector.identity, vector.issuer),
        staging=vector.staging,
    )
    assert result.signer == vector.identity
    if vector.bundle.startswith("a.dsse"):
        payload = base64.b64decode(load(vectors / vector.bundle)["dsseEnvelope"]["payload"])
        assert result == VerifiedBundle("dsse", "application/vnd.in-toto+json", payload, vector.identity)
    else:
        assert result == VerifiedBundle("message_signature", None, None, vector.identity)


@pytest.mark.parametrize("vector", ACCEPT, ids=lambda v: v.id)
def test_vector_accepts_with_explicit_trusted_root(vectors: Path, vector: Vector) -> None:
    verify_bundle(
        vectors / vector.bundle,
        artifact_of(vectors, vector),
        CertificateIdentity(vector.identity, vector.issuer),
        trusted_root=root_of(vectors, vector.staging),
    )


@pytest.mark.parametrize("vector", ACCEPT, ids=lambda v: v.id)
def test_vector_rejects_changed_artifact(vectors: Path, vector: Vector, tmp_path: Path) -> None:
    if vector.artifact.startswith("sha256:"):
        changed: Path | str = vector.artifact[:-1] + ("0" if vector.artifact[-1] != "0" else "1")
    else:
        data = (vectors / vector.artifact).read_bytes()
        changed = tmp_path / "artifact"
        changed.write_bytes(data[:-1] + bytes([data[-1] ^ 0x20]))
    with pytest.raises(DigestMismatchError, match=r"artifact('s sha256| sha256:)"):
        verify_bundle(
            vectors / vector.bundle,
            changed,  # type: ignore[arg-type]
            CertificateIdentity(vector.identity, vector.issuer),
            staging=vector.staging,
        )


@pytest.mark.parametrize("vector", ACCEPT, ids=lambda v: v.id)
def test_vector_rejects_flipped_signature_bit(vectors: Path, vector: Vector, tmp_path: Path) -> None:
    document = load(vectors / vector.bundle)
    if "dsseEnvelope" in document:
        signature = document["dsseEnvelope"]["signatures"][0]
        signature["sig"] = flip_b64(signature["sig"])
    else:
        document["messageSignature"]["signature"] = flip_b64(document["messageSignature"]["signature"])
    with pytest.raises(BadSignatureError, match="signature does not verify"):
        verify_bundle(
            write(tmp_path / "bundle.json", document),
            artifact_of(vectors, vector),  # type: ignore[arg-type]
            CertificateIdentity(vector.identity, vector.issuer),
            staging=vector.staging,
        )


@pytest.mark.parametrize("vector", ACCEPT, ids=lambda v: v.id)
def test_vector_rejects_other_identity(vectors: Path, vector: Vector) -> None:
    with pytest.raises(IdentityMismatchError, match="signing certificate is for .* not someone@example.com"):
        verify_bundle(
            vectors / vector.bundle,
            artifact_of(vectors, vector),  # type: ignore[arg-type]
            CertificateIdentity("someone@example.com", vector.issuer),
            staging=vector.staging,
        )


@pytest.mark.parametrize("vector", ACCEPT, ids=lambda v: v.id)
def test_vector_rejects_other_issuer(vectors: Path, vector: Vector) -> None:
    with pytest.raises(IdentityMismatchError, match="issuer https://issuer.example.com"):
        verify_bundle(
            vectors / vector.bundle,
            artifact_of(vectors, vector),  # type: ignore[arg-type]
            CertificateIdentity(vector.identity, "https://issuer.example.com"),
            staging=vector.staging,
        )


@pytest.mark.parametrize("vector", ACCEPT, ids=lambda v: v.id)
def test_vector_rejects_other_trusted_root(vectors: Path, vector: Vector) -> None:
    other = root_of(vectors, not vector.staging)
    with pytest.raises(UntrustedRootError, match="which the trusted root does not list"):
        verify_bundle(
            vectors / vector.bundle,
            artifact_of(vectors, vector),  # type: ignore[arg-type]
            CertificateIdentity(vector.identity, vector.issuer),
            trusted_root=other,
        )
    with pytest.raises(UntrustedRootError, match="which the trusted root does not list"):
        verify_bundle(
            vectors / vector.bundle,
            artifact_of(vectors, vector),  # type: ignore[arg-type]
            CertificateIdentity(vector.identity, vector.issuer),
            staging=not vector.staging,
        )


@pytest.mark.parametrize("vector", ACCEPT, ids=lambda v: v.id)
def test_vector_rejects_altered_inclusion_root(vectors: Path, vector: Vector, tmp_path: Path) -> None:
    document = load(vectors / vector.bundle)
    proof = document["verificationMaterial"]["tlogEntries"][0]["inclusionProof"]
    proof["rootHash"] = flip_b64(proof["rootHash"])
    with pytest.raises(LogEntryError, match="inclusion proof fails: .* leads to root .*, not the expected"):
        verify_bundle(
            write(tmp_path / "bundle.json", document),
            artifact_of(vectors, vector),  # type: ignore[arg-type]
            CertificateIdentity(vector.identity, vector.issuer),
            staging=vector.staging,
        )


def test_vector_rejects_altered_proof_hash_and_checkpoint(vectors: Path, tmp_path: Path) -> None:
    vector = ACCEPT[3]
    document = load(vectors / vector.bundle)
    proof = document["verificationMaterial"]["tlogEntries"][0]["inclusionProof"]
    proof["hashes"][3] = flip_b64(proof["hashes"][3])
    identity = CertificateIdentity(vector.identity, vector.issuer)
    with pytest.raises(LogEntryError, match="leads to root .*, not the expected"):
        verify_bundle(write(tmp_path / "a.json", document), vectors / vector.artifact, identity)

    document = load(vectors / vector.bundle)
    proof = document["verificationMaterial"]["tlogEntries"][0]["inclusionProof"]
    proof["checkpoint"]["envelope"] = proof["checkpoint"]["envelope"].replace("\n75441653\n", "\n75441654\n")
    with pytest.raises(LogEntryError, match="checkpoint signs a different tree"):
        verify_bundle(write(tmp_path / "b.json", document), vectors / vector.artifact, identity)


def test_vector_rejects_forged_signed_entry_timestamp(vectors: Path, tmp_path: Path) -> None:
    vector = ACCEPT[3]
    document = load(vectors / vector.bundle)
    entry = document["verificationMaterial"]["tlogEntries"][0]
    entry["integratedTime"] = str(int(entry["integratedTime"]) + 1)
    with pytest.raises(LogEntryError, match="signed entry timestamp does not verify"):
        verify_bundle(
            write(tmp_path / "b.json", document),
            vectors / vector.artifact,
            CertificateIdentity(vector.identity, vector.issuer),
        )


def test_vector_cve_2022_36056_is_rejected(vectors: Path) -> None:
    with pytest.raises(LogEntryError, match="log entry records a different signature than the bundle"):
        verify_bundle(
            vectors / "bundle_cve_2022_36056.txt.sigstore",
            vectors / "bundle_cve_2022_36056.txt",
            CertificateIdentity("william@yossarian.net", GITHUB_OAUTH),
            staging=True,
        )


@pytest.mark.parametrize(
    ("artifact", "bundle", "message"),
    [
        ("bundle_v3_no_signed_time.txt", "bundle_v3_no_signed_time.txt.sigstore.json", "inclusion promise or signed"),
        ("bundle_invalid_version.txt", "bundle_invalid_version.txt.sigstore", "unsupported bundle media type"),
        ("bundle_no_cert_v1.txt", "bundle_no_cert_v1.txt.sigstore", "x509CertificateChain is empty"),
        ("bundle_no_log_entry.txt", "bundle_no_log_entry.txt.sigstore", "exactly one log entry"),
        ("bundle_no_checkpoint.txt", "bundle_no_checkpoint.txt.sigstore", "inclusion proof, with checkpoint"),
    ],
)
def test_vector_rejected_at_load(vectors: Path, artifact: str, bundle: str, message: str) -> None:
    with pytest.raises(MalformedInputError, match=message):
        verify_bundle(
            vectors / bundle,
            vectors / artifact,
            CertificateIdentity("william@yossarian.net", GITHUB_OAUTH),
            staging=True,
        )


def test_vector_digest_form_verifies_a_message_signature(vectors: Path) -> None:
    digest = "sha256:" + hashlib.sha256((vectors / "bundle_v3.txt").read_bytes()).hexdigest()
    result = verify_bundle(
        vectors / "bundle_v3.txt.sigstore",
        digest,  # type: ignore[arg-type]
        CertificateIdentity("william@yossarian.net", GITHUB_OAUTH),
        staging=True,
    )
    assert result.kind == "message_signature"


def test_v01_bundle_without_checkpoint_is_refused(vectors: Path) -> None:
    """A v0.1 bundle with only an inclusion promise (CPython 3.12.5's release bundle).

    The client spec lets v0.1 bundles omit the checkpoint, but sigstore-python 4.5.1 refuses to
    load a log entry without one, and it stays the authority for certificate bundles.
    """
    bundle = vectors / "integration" / "Python-3.12.5.tgz.sigstore"
    digest = base64.b64decode(load(bundle)["messageSignature"]["messageDigest"]["digest"]).hex()
    with pytest.raises(MalformedInputError, match="inclusion proof, with checkpoint"):
        verify_bundle(bundle, f"sha256:{digest}", CertificateIdentity("thomas@python.org", GOOGLE))  # type: ignore[arg-type]


def test_vector_dsse_subject_mismatch(vectors: Path) -> None:
    vector = ACCEPT[-1]
    with pytest.raises(DigestMismatchError, match="not among the statement's subjects \\(a.txt\\)"):
        verify_bundle(
            vectors / vector.bundle,
            vectors / "bundle.txt",
            CertificateIdentity(vector.identity, vector.issuer),
            staging=True,
        )


def test_trusted_root_wins_over_staging(vectors: Path) -> None:
    vector = ACCEPT[3]  # a production bundle
    verify_bundle(
        vectors / vector.bundle,
        vectors / vector.artifact,
        CertificateIdentity(vector.identity, vector.issuer),
        trusted_root=root_of(vectors, False),
        staging=True,
    )


def test_shipped_roots_are_the_vectors_roots(vectors: Path) -> None:
    assert shipped_trusted_root().read_bytes() == root_of(vectors, False).read_bytes()
    assert shipped_trusted_root(staging=True).read_bytes() == root_of(vectors, True).read_bytes()


def test_root_certificate_in_bundle_chain_is_rejected(vectors: Path, tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "sneaky root")])
    now = datetime.now(UTC)
    root = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    document = load(vectors / "bundle.txt.sigstore")
    chain = document["verificationMaterial"]["x509CertificateChain"]["certificates"]
    chain.append({"rawBytes": b64(root.public_bytes(serialization.Encoding.DER))})
    with pytest.raises(UntrustedRootError, match="carries its own root certificate"):
        verify_bundle(
            write(tmp_path / "b.json", document),
            vectors / "bundle.txt",
            CertificateIdentity("a@tny.town", GITHUB_OAUTH),
            staging=True,
        )


def test_key_policy_on_certificate_bundle(vectors: Path) -> None:
    pem = (
        ec.generate_private_key(ec.SECP256R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    with pytest.raises(IdentityMismatchError, match="signed by a Fulcio certificate for william@yossarian.net"):
        verify_bundle(vectors / "bundle_v3.txt.sigstore", vectors / "bundle_v3.txt", ManagedKey(pem), staging=True)


def test_tsa_validity_end_is_inclusive(vectors: Path, tmp_path: Path) -> None:
    """sigstore-python 4.5.1 drops a timestamp made at exactly its TSA's validFor.end; we keep it."""
    from rfc3161_client import decode_timestamp_response
    from sigstore.models import Bundle, TrustedRoot

    bundle = Bundle.from_json((vectors / "tsa" / "bundle.txt.sigstore").read_bytes())
    response = decode_timestamp_response(
        base64.b64decode(
            load(vectors / "tsa" / "bundle.txt.sigstore")["verificationMaterial"]["timestampVerificationData"][
                "rfc3161Timestamps"
            ][0]["signedTimestamp"]
        )
    )
    gen_time = response.tst_info.gen_time
    root = load(root_of(vectors, True))
    authority = load(vectors / "tsa" / "ca.json")

    def verified_with_end(end: datetime) -> bool:
        authority["validFor"]["end"] = end.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        root["timestampAuthorities"] = [authority]
        trusted = TrustedRoot.from_file(str(write(tmp_path / "root.json", root)))
        verifier = SigstoreVerifier(trusted_root=trusted)
        return verifier._verify_signed_timestamp(response, bundle.signature) is not None

    assert verified_with_end(gen_time)
    assert not verified_with_end(gen_time - timedelta(microseconds=1))


