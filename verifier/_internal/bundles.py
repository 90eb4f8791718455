"""Offline verification of Sigstore bundles (``kvgraft-verify verify-bundle``).

Two kinds of bundle are verified, both against a pinned ``trusted_root.json`` and never with
the network (no TUF refresh, ever):

* Certificate bundles (a Fulcio certificate names the signer): sigstore-python's ``Verifier``
  is the authority for the certificate chain, the SCT, the signed times and the identity
  policy. Before it runs, the verifier repeats the cheap checks itself (identity, artifact
  digest, signature, log entry) so that each failure is reported as the right error class with
  a one-line message, and it adds the checks sigstore-python 4.5.1 skips.
* Managed-key bundles (``verificationMaterial.publicKey``): sigstore-python cannot verify
  these, so the verifier does all of it: the signature with the caller's key, and every
  transparency log entry (Merkle inclusion proof, signed checkpoint, signed entry timestamp,
  and the entry body's agreement with the signature, digest and key).

For DSSE bundles the in-toto statement must be a known Statement type and one of its subjects
must carry the artifact's sha256; the payload is returned byte for byte, never re-serialized.

This module is the entry point and the managed-key path; the rest lives beside it, each module
importing only those before it:

* ``bundle_wire``: the bundle's wire format, parsed and decoded (strict JSON and base64);
* ``bundle_keys``: public keys, hashes and signature checks;
* ``bundle_entries``: the Rekor entry bodies, matched against the bundle;
* ``bundle_logs``: the trusted root's logs, and each log entry's proofs and timestamps;
* ``bundle_certs``: certificate bundles, through sigstore-python (``SigstoreVerifier``, two
  overrides that the sigstore pin (==4.5.1) in pyproject.toml keeps valid).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from cryptography.hazmat.primitives.asymmetric import ed25519

from kvgraft.schemas import IN_TOTO_PAYLOAD_TYPE, DocumentError, Sha256Digest, parse_json

from .bundle_certs import describe_identity, verify_certificate_bundle
from .bundle_keys import (
    DIGEST_NAMES,
    HASHES,
    PublicKey,
    Signer,
    candidate_hashes,
    check_message_digest,
    load_public_key_pem,
    spki,
    verifies,
)
from .bundle_logs import TrustedLog, trusted_logs, verify_log_entry
from .bundle_wire import (
    Artifact,
    BundleEnvelope,
    BundleParts,
    MessageSignature,
    parse_bundle,
    read_json,
    resolve_artifact,
)
from .errors import (
    BadSignatureError,
    DigestMismatchError,
    IdentityMismatchError,
    MalformedInputError,
    UnsupportedPayloadTypeError,
)
from .files import read_input

__all__ = [
    "CertificateIdentity",
    "ManagedKey",
    "VerifiedBundle",
    "shipped_trusted_root",
    "verify_bundle",
]

_STATEMENT_TYPES = frozenset({"https://in-toto.io/Statement/v1", "https://in-toto.io/Statement/v0.1"})
_TRUST_DIR = Path(__file__).resolve().parent.parent / "trust"


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CertificateIdentity:
    """Policy for certificate bundles: the exact certificate SAN and the OIDC issuer."""

    identity: str
    issuer: str


@dataclass(frozen=True)
class ManagedKey:
    """Policy for bundles signed by a long-lived key (PEM SubjectPublicKeyInfo), no certificate."""

    public_key_pem: bytes


@dataclass(frozen=True)
class VerifiedBundle:
    """What a verified bundle proved.

    ``payload_type`` and ``payload`` are set for DSSE bundles only; ``payload`` is the exact
    signed bytes. ``signer`` is the certificate identity, or ``sha256:<hex>`` of the managed
    key's DER SubjectPublicKeyInfo; it is for display.
    """

    kind: Literal["message_signature", "dsse"]
    payload_type: str | None
    payload: bytes | None
    signer: str


def shipped_trusted_root(*, staging: bool = False) -> Path:
    """The path of the pinned Sigstore trusted root shipped with the verifier."""
    name = "staging_trusted_root.json" if staging else "production_trusted_root.json"
    return _TRUST_DIR / name


def verify_bundle(
    bundle: Path,
    artifact: Path | Sha256Digest,
    policy: CertificateIdentity | ManagedKey,
    *,
    trusted_root: Path | None = None,
    staging: bool = False,
) -> VerifiedBundle:
    """Verify the Sigstore bundle at ``bundle`` over ``artifact``, offline.

    ``artifact`` is the signed file, or its digest as ``sha256:<64 hex>``. ``policy`` says who
    must have signed: a certificate identity and issuer, or a managed public key. The trusted
    root is ``trusted_root`` when given (it wins over ``staging``), else the shipped production
    root, or the shipped staging root when ``staging`` is true.

    Returns what was verified; raises a ``VerificationError`` subclass naming the first check
    that failed. Never touches the network.
    """
    raw = read_input(bundle, "bundle")
    parts = parse_bundle(read_json(raw, f"bundle {bundle}"))
    target = resolve_artifact(artifact)
    root_path = trusted_root if trusted_root is not None else shipped_trusted_root(staging=staging)
    root_document = read_json(read_input(root_path, "trusted root"), f"trusted root {root_path}")
    logs = trusted_logs(root_document, root_path)

    if isinstance(policy, CertificateIdentity):
        signer = verify_certificate_bundle(
            raw, parts, target, policy.identity, policy.issuer, (root_path, root_document), logs
        )
    elif isinstance(policy, ManagedKey):
        signer = _verify_key_bundle(parts, target, policy, logs)
    else:
        raise TypeError(f"policy must be CertificateIdentity or ManagedKey, not {policy!r}")

    content = parts.content
    if isinstance(content, BundleEnvelope):
        _check_statement(content, target)
        return VerifiedBundle("dsse", content.payload_type, content.payload, signer)
    return VerifiedBundle("message_signature", None, None, signer)


# --------------------------------------------------------------------------------------------
# Managed-key bundles: all checks are ours
# --------------------------------------------------------------------------------------------


def _verify_key_bundle(parts: BundleParts, artifact: Artifact, policy: ManagedKey, logs: tuple[TrustedLog, ...]) -> str:
    key = load_public_key_pem(policy.public_key_pem, "the managed key")
    if parts.certificates:
        raise IdentityMismatchError(
            f"the bundle is signed by a Fulcio certificate for {describe_identity(parts.certificates[0])}, "
            "not by a managed key",
            hint="verify it with --certificate-identity and --certificate-oidc-issuer",
        )
    content = parts.content
    if isinstance(content, MessageSignature):
        check_message_digest(content, artifact)
        if not _key_signed_message(key, content, artifact):
            raise BadSignatureError(
                "the bundle's signature does not verify over the artifact with the given key",
                hint="the bundle was signed by another key, or altered; check --key",
            )
    elif not any(verifies(key, content.signature, data=content.pae(), hash_=h) for h in candidate_hashes(key)):
        raise BadSignatureError(
            "the DSSE envelope's signature does not verify with the given key",
            hint="the bundle was signed by another key, or altered; check --key",
        )
    # Timestamps from a TSA are not needed here: a managed key has no validity period to check
    # a signing time against. Log entries, when present, must verify completely.
    signer = Signer(key, None)
    for entry in parts.entries:
        verify_log_entry(entry, logs, parts=parts, artifact=artifact, signer=signer)
    return "sha256:" + hashlib.sha256(spki(key)).hexdigest()


def _key_signed_message(key: PublicKey, content: MessageSignature, artifact: Artifact) -> bool:
    if isinstance(key, ed25519.Ed25519PublicKey):
        # Ed25519 signs the message itself, so the digest cannot stand in for the artifact.
        return verifies(key, content.signature, data=artifact.read("an Ed25519 signature"))
    if content.digest is not None:
        name = DIGEST_NAMES[content.digest_algorithm or ""]
        return verifies(key, content.signature, prehashed=(HASHES[name], artifact.digest(name)))
    return any(
        verifies(key, content.signature, prehashed=(h, artifact.digest(h.name)))
        for h in candidate_hashes(key)
        if h is not None
    )


# --------------------------------------------------------------------------------------------
# in-toto statement (DSSE bundles)
# --------------------------------------------------------------------------------------------


def _check_statement(envelope: BundleEnvelope, artifact: Artifact) -> None:
    """The signed statement must be an in-toto Statement naming the artifact as a subject."""
    if envelope.payload_type != IN_TOTO_PAYLOAD_TYPE:
        raise UnsupportedPayloadTypeError(
            f"the DSSE payload type is {envelope.payload_type!r}, not {IN_TOTO_PAYLOAD_TYPE}"
        )
    try:
        statement = parse_json(envelope.payload, what="the DSSE payload")
    except DocumentError as e:
        raise MalformedInputError(e.message) from e
    if not isinstance(statement, dict):
        raise MalformedInputError("the DSSE payload is not a JSON object")
    statement_type = statement.get("_type")
    if statement_type is None:
        raise MalformedInputError("the in-toto statement has no _type")
    if statement_type not in _STATEMENT_TYPES:
        # Unknown statement semantics must not be read as if they were v1's.
        raise UnsupportedPayloadTypeError(
            f"the statement's _type {statement_type!r} is not an in-toto Statement v1 or v0.1",
            hint="only in-toto Statement v1 (or v0.1) payloads are accepted",
        )
    subjects = statement.get("subject")
    if not isinstance(subjects, list) or not subjects:
        raise MalformedInputError("the in-toto statement has no subjects")
    wanted = artifact.sha256.hex()
    names = []
    for subject in subjects:
        if not isinstance(subject, dict) or not isinstance(subject.get("digest"), dict):
            raise MalformedInputError("an in-toto subject lacks a digest map")
        names.append(str(subject.get("name", "?")))
        logged = subject["digest"].get("sha256")
        if isinstance(logged, str) and logged.lower() == wanted:
            return
    raise DigestMismatchError(
        f"the artifact sha256:{wanted} is not among the statement's subjects "
        f"({', '.join(names[:5])}{', ...' if len(names) > 5 else ''})"
    )
