"""Offline verification of Sigstore bundles (``kvgraft-verify verify-bundle``).

Two kinds of bundle are verified, both against a pinned ``trusted_root.json`` and never with
the network (no TUF refresh, ever):

* Certificate bundles (a Fulcio certificate names the signer): sigstore-python's ``Verifier``
  is the authority for the certificate chain, the SCT, the signed times and the identity
  policy. Before it runs, this module repeats the cheap checks itself (identity, artifact
  digest, signature, log entry) so that each failure is reported as the right error class with
  a one-line message, and it adds the checks sigstore-python 4.5.1 skips.
* Managed-key bundles (``verificationMaterial.publicKey``): sigstore-python cannot verify
  these, so this module does all of it: the signature with the caller's key, and every
  transparency log entry (Merkle inclusion proof, signed checkpoint, signed entry timestamp,
  and the entry body's agreement with the signature, digest and key).

For DSSE bundles the in-toto statement must be a known Statement type and one of its subjects
must carry the artifact's sha256; the payload is returned byte for byte, never re-serialized.

Where sigstore-python 4.5.1 disagrees with the Sigstore client spec and the sigstore-conformance
suite (see docs/sigstore-conformance.md), ``_SigstoreVerifier`` overrides two of its private
methods; the sigstore pin (==4.5.1) in pyproject.toml keeps those overrides valid.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import rfc8785
from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed
from rfc3161_client import TimeStampResponse, VerifierBuilder
from rfc3161_client import VerificationError as Rfc3161VerificationError
from sigstore import dsse as sigstore_dsse
from sigstore._internal.timestamp import TimestampSource, TimestampVerificationResult
from sigstore.errors import CertValidationError
from sigstore.errors import Error as SigstoreError
from sigstore.errors import VerificationError as SigstoreVerificationError
from sigstore.hashes import Hashed
from sigstore.models import Bundle as SigstoreBundle
from sigstore.models import ClientTrustConfig, TrustedRoot
from sigstore.verify import Verifier
from sigstore.verify.policy import Identity
from sigstore_models.common.v1 import HashAlgorithm

from kvgraft.schemas import InvalidDigestError, Sha256Digest, parse_sha256

from .errors import (
    BadSignatureError,
    DigestMismatchError,
    IdentityMismatchError,
    LogEntryError,
    LogProofError,
    MalformedInputError,
    UnsupportedPayloadTypeError,
    UntrustedRootError,
    VerificationError,
)
from .files import read_input
from .tlog import hash_leaf, verify_inclusion

__all__ = [
    "CertificateIdentity",
    "ManagedKey",
    "VerifiedBundle",
    "shipped_trusted_root",
    "verify_bundle",
]

PublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey | rsa.RSAPublicKey

IN_TOTO_PAYLOAD_TYPE = "application/vnd.in-toto+json"
_STATEMENT_TYPES = frozenset({"https://in-toto.io/Statement/v1", "https://in-toto.io/Statement/v0.1"})
_BUNDLE_MEDIA_TYPES = frozenset(
    {
        "application/vnd.dev.sigstore.bundle+json;version=0.1",
        "application/vnd.dev.sigstore.bundle+json;version=0.2",
        "application/vnd.dev.sigstore.bundle+json;version=0.3",
        "application/vnd.dev.sigstore.bundle.v0.3+json",
    }
)
_BUNDLE_V01 = "application/vnd.dev.sigstore.bundle+json;version=0.1"
_TRUSTED_ROOT_MEDIA_TYPES = frozenset(
    {
        "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
        "application/vnd.dev.sigstore.trustedroot.v0.1+json",
        "application/vnd.dev.sigstore.trustedroot.v0.2+json",
    }
)
_TRUST_DIR = Path(__file__).resolve().parent.parent / "trust"
# Rekor's clock and ours may disagree a little; a log entry further in the future than this is
# not a clock difference but a forged or broken entry.
_CLOCK_SKEW = timedelta(minutes=10)
_CHUNK = 1 << 20


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
    parts = _parse_bundle(_parse_json(raw, f"bundle {bundle}"))
    target = _resolve_artifact(artifact)
    root_path = trusted_root if trusted_root is not None else shipped_trusted_root(staging=staging)
    root_document = _parse_json(read_input(root_path, "trusted root"), f"trusted root {root_path}")
    logs = _trusted_logs(root_document, root_path)

    if isinstance(policy, CertificateIdentity):
        signer = _verify_certificate_bundle(raw, parts, target, policy, root_path, logs)
    elif isinstance(policy, ManagedKey):
        signer = _verify_key_bundle(parts, target, policy, logs)
    else:
        raise TypeError(f"policy must be CertificateIdentity or ManagedKey, not {policy!r}")

    content = parts.content
    if isinstance(content, _Envelope):
        _check_statement(content, target)
        return VerifiedBundle("dsse", content.payload_type, content.payload, signer)
    return VerifiedBundle("message_signature", None, None, signer)


# --------------------------------------------------------------------------------------------
# Reading inputs
# --------------------------------------------------------------------------------------------


def _parse_json(raw: bytes, what: str) -> dict[str, object]:
    try:
        document = json.loads(raw)
    except UnicodeDecodeError as e:
        raise MalformedInputError(f"{what} is not UTF-8 text") from e
    except json.JSONDecodeError as e:
        raise MalformedInputError(f"{what} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from e
    except ValueError as e:
        # Integers longer than sys.get_int_max_str_digits() digits.
        raise MalformedInputError(f"{what} holds a number too long to read ({e})") from e
    except RecursionError as e:
        # Thousands of nested arrays exhaust json's recursion; no bundle nests that deep.
        raise MalformedInputError(f"{what} nests arrays or objects too deeply to be a bundle") from e
    if not isinstance(document, dict):
        raise MalformedInputError(f"{what} must be a JSON object, got {type(document).__name__}")
    return document


@dataclass(frozen=True)
class _Artifact:
    """The artifact under verification: always its sha256, and its file when we have one."""

    sha256: bytes
    path: Path | None

    def digest(self, algorithm: str) -> bytes:
        """The artifact's digest under ``algorithm`` (hashlib name)."""
        if algorithm == "sha256":
            return self.sha256
        if self.path is None:
            raise DigestMismatchError(
                f"the bundle records a {algorithm} digest, but only a sha256 digest was given",
                hint="pass the artifact file instead of its digest",
            )
        with self.path.open("rb") as f:
            return hashlib.file_digest(f, algorithm).digest()

    def read(self, why: str) -> bytes:
        """The artifact's bytes, which some signature schemes need whole."""
        if self.path is None:
            raise MalformedInputError(
                f"{why} needs the artifact itself, not its digest",
                hint="pass the artifact file instead of its digest",
            )
        return read_input(self.path, "artifact")


def _resolve_artifact(artifact: Path | Sha256Digest) -> _Artifact:
    if isinstance(artifact, Path):
        if artifact.is_dir():
            raise MalformedInputError(f"the artifact {artifact} is a directory, not a file")
        try:
            with artifact.open("rb") as f:
                digest = hashlib.file_digest(f, "sha256").digest()
        except OSError as e:
            raise MalformedInputError(
                f"cannot read the artifact {artifact}: {e.strerror or e}", hint="check the path"
            ) from e
        return _Artifact(digest, artifact)
    try:
        prefixed = parse_sha256(artifact)
    except InvalidDigestError as e:
        raise MalformedInputError(str(e), hint="pass a file path or sha256:<64 hex>") from e
    return _Artifact(bytes.fromhex(prefixed.removeprefix("sha256:")), None)


def _load_public_key_pem(pem: bytes, what: str) -> PublicKey:
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise MalformedInputError(
            f"{what} is not a PEM public key (SubjectPublicKeyInfo)",
            hint="pass the PEM public key the signer published",
        ) from e
    if not isinstance(key, (ec.EllipticCurvePublicKey, ed25519.Ed25519PublicKey, rsa.RSAPublicKey)):
        raise MalformedInputError(f"{what} is a {type(key).__name__}; only ECDSA, Ed25519 and RSA keys are supported")
    return key


def _spki(key: PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


# --------------------------------------------------------------------------------------------
# JSON field readers: every malformed field becomes one MalformedInputError naming the field
# --------------------------------------------------------------------------------------------

_B64 = re.compile(r"[A-Za-z0-9+/_-]*={0,2}")


def _b64decode(value: str) -> bytes:
    """Strict base64: the standard or URL-safe alphabet, padding optional (protobuf JSON rules).

    ``base64.b64decode`` silently drops foreign characters, which would let a mangled field
    decode to something; this rejects them instead.
    """
    if not _B64.fullmatch(value):
        raise ValueError("not base64")
    body = value.rstrip("=").replace("-", "+").replace("_", "/")
    if len(body) % 4 == 1:
        raise ValueError("truncated base64")
    return base64.b64decode(body + "=" * (-len(body) % 4), validate=True)


def _field(obj: dict[str, object], key: str, where: str, *, required: bool = True) -> object:
    if key not in obj or obj[key] is None:
        if required:
            raise MalformedInputError(f"bundle field {where}.{key} is missing")
        return None
    return obj[key]


def _as_obj(value: object, where: str) -> dict[str, object]:
    if not isinstance(value, dict):
        raise MalformedInputError(f"bundle field {where} must be an object")
    return value


def _as_list(value: object, where: str) -> list[object]:
    if not isinstance(value, list):
        raise MalformedInputError(f"bundle field {where} must be a list")
    return value


def _as_str(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise MalformedInputError(f"bundle field {where} must be a string")
    return value


def _as_bytes(value: object, where: str) -> bytes:
    try:
        return _b64decode(_as_str(value, where))
    except (ValueError, binascii.Error) as e:
        raise MalformedInputError(f"bundle field {where} is not valid base64") from e


def _as_uint(value: object, where: str) -> int:
    # Protobuf JSON writes 64-bit integers as strings, but readers must accept numbers too.
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise MalformedInputError(f"bundle field {where} must be an integer")
    if isinstance(value, str):
        if not re.fullmatch(r"-?[0-9]+", value):
            raise MalformedInputError(f"bundle field {where} must be an integer, got {value!r}")
        value = int(value)
    if value < 0 or value >= 1 << 63:
        raise MalformedInputError(f"bundle field {where} is out of range ({value})")
    return value


# --------------------------------------------------------------------------------------------
# Bundle parts, read by our own parser (sigstore-python's refuses managed-key bundles)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _MessageSignature:
    digest_algorithm: str | None  # protobuf HashAlgorithm name, e.g. SHA2_256
    digest: bytes | None
    signature: bytes


@dataclass(frozen=True)
class _Envelope:
    payload_type: str
    payload: bytes
    signature: bytes  # a Sigstore bundle's envelope carries exactly one

    def pae(self) -> bytes:
        """DSSE pre-authentication encoding: the bytes the signature covers."""
        kind = self.payload_type.encode()
        return b"DSSEv1 %d %s %d %s" % (len(kind), kind, len(self.payload), self.payload)


@dataclass(frozen=True)
class _InclusionProof:
    log_index: int
    root_hash: bytes
    tree_size: int
    hashes: tuple[bytes, ...]
    checkpoint: str | None


@dataclass(frozen=True)
class _LogEntry:
    log_index: int
    log_id: bytes
    kind: str
    version: str
    integrated_time: int | None
    signed_entry_timestamp: bytes | None
    proof: _InclusionProof | None
    body: bytes


@dataclass(frozen=True)
class _BundleParts:
    media_type: str
    certificates: tuple[x509.Certificate, ...]  # leaf first; empty for managed-key bundles
    content: _MessageSignature | _Envelope
    entries: tuple[_LogEntry, ...]


def _parse_bundle(document: dict[str, object]) -> _BundleParts:
    media_type = _as_str(_field(document, "mediaType", "bundle"), "mediaType")
    if media_type not in _BUNDLE_MEDIA_TYPES:
        raise MalformedInputError(
            f"unsupported bundle media type {media_type!r}",
            hint="pass a Sigstore bundle of version 0.1 to 0.3",
        )
    material = _as_obj(_field(document, "verificationMaterial", "bundle"), "verificationMaterial")
    certificates = _parse_signer_material(material)

    entries = tuple(
        _parse_log_entry(_as_obj(item, f"tlogEntries[{i}]"), f"tlogEntries[{i}]")
        for i, item in enumerate(_as_list(material.get("tlogEntries", []), "verificationMaterial.tlogEntries"))
    )

    has_message = document.get("messageSignature") is not None
    has_envelope = document.get("dsseEnvelope") is not None
    if has_message == has_envelope:
        raise MalformedInputError("a bundle must hold exactly one of messageSignature or dsseEnvelope")
    content: _MessageSignature | _Envelope
    if has_message:
        content = _parse_message_signature(_as_obj(document["messageSignature"], "messageSignature"))
    else:
        content = _parse_envelope(_as_obj(document["dsseEnvelope"], "dsseEnvelope"))
    return _BundleParts(media_type, certificates, content, entries)


def _parse_signer_material(material: dict[str, object]) -> tuple[x509.Certificate, ...]:
    present = [k for k in ("certificate", "x509CertificateChain", "publicKey") if material.get(k) is not None]
    if len(present) != 1:
        raise MalformedInputError(
            "verificationMaterial must hold exactly one of certificate, x509CertificateChain "
            f"or publicKey (found {', '.join(present) or 'none'})"
        )
    if present[0] == "publicKey":
        key = _as_obj(material["publicKey"], "verificationMaterial.publicKey")
        if key.get("hint") is not None:
            _as_str(key["hint"], "verificationMaterial.publicKey.hint")
        return ()
    if present[0] == "certificate":
        cert = _as_obj(material["certificate"], "verificationMaterial.certificate")
        raws = [_field(cert, "rawBytes", "verificationMaterial.certificate")]
    else:
        chain = _as_obj(material["x509CertificateChain"], "verificationMaterial.x509CertificateChain")
        raws = [
            _field(_as_obj(c, "x509CertificateChain.certificates[]"), "rawBytes", "certificates[]")
            for c in _as_list(chain.get("certificates") or [], "x509CertificateChain.certificates")
        ]
        if not raws:
            raise MalformedInputError("the bundle's x509CertificateChain is empty")
    certificates = []
    for i, raw in enumerate(raws):
        der = _as_bytes(raw, f"certificate[{i}].rawBytes")
        try:
            certificates.append(x509.load_der_x509_certificate(der))
        except (ValueError, x509.InvalidVersion) as e:
            # InvalidVersion is no ValueError: a version field other than v1 or v3.
            raise MalformedInputError(f"bundle certificate {i} is not a DER X.509 certificate") from e
    return tuple(certificates)


def _parse_message_signature(obj: dict[str, object]) -> _MessageSignature:
    signature = _as_bytes(_field(obj, "signature", "messageSignature"), "messageSignature.signature")
    algorithm = digest = None
    if obj.get("messageDigest") is not None:
        md = _as_obj(obj["messageDigest"], "messageSignature.messageDigest")
        algorithm = _as_str(_field(md, "algorithm", "messageDigest"), "messageDigest.algorithm")
        digest = _as_bytes(_field(md, "digest", "messageDigest"), "messageDigest.digest")
    if not signature:
        raise MalformedInputError("the bundle's messageSignature.signature is empty")
    return _MessageSignature(algorithm, digest, signature)


def _parse_envelope(obj: dict[str, object]) -> _Envelope:
    payload = _as_bytes(_field(obj, "payload", "dsseEnvelope"), "dsseEnvelope.payload")
    payload_type = _as_str(_field(obj, "payloadType", "dsseEnvelope"), "dsseEnvelope.payloadType")
    signatures = _as_list(_field(obj, "signatures", "dsseEnvelope"), "dsseEnvelope.signatures")
    if len(signatures) != 1:
        # The client spec allows one signature per bundle envelope; more would let a second,
        # unchecked signer ride along.
        raise MalformedInputError(f"a bundle's DSSE envelope must carry exactly one signature, found {len(signatures)}")
    sig_obj = _as_obj(signatures[0], "dsseEnvelope.signatures[0]")
    signature = _as_bytes(_field(sig_obj, "sig", "dsseEnvelope.signatures[0]"), "signatures[0].sig")
    if not signature:
        raise MalformedInputError("the bundle's DSSE signature is empty")
    return _Envelope(payload_type, payload, signature)


def _parse_log_entry(obj: dict[str, object], where: str) -> _LogEntry:
    kind_version = _as_obj(_field(obj, "kindVersion", where), f"{where}.kindVersion")
    proof = None
    if obj.get("inclusionProof") is not None:
        p = _as_obj(obj["inclusionProof"], f"{where}.inclusionProof")
        pw = f"{where}.inclusionProof"
        checkpoint = None
        if p.get("checkpoint") is not None:
            cp = _as_obj(p["checkpoint"], f"{pw}.checkpoint")
            checkpoint = _as_str(_field(cp, "envelope", f"{pw}.checkpoint"), f"{pw}.checkpoint")
        proof = _InclusionProof(
            log_index=_as_uint(_field(p, "logIndex", pw), f"{pw}.logIndex"),
            root_hash=_as_bytes(_field(p, "rootHash", pw), f"{pw}.rootHash"),
            tree_size=_as_uint(_field(p, "treeSize", pw), f"{pw}.treeSize"),
            hashes=tuple(_as_bytes(h, f"{pw}.hashes[]") for h in _as_list(p.get("hashes") or [], f"{pw}.hashes")),
            checkpoint=checkpoint,
        )
    set_ = None
    if obj.get("inclusionPromise") is not None:
        promise = _as_obj(obj["inclusionPromise"], f"{where}.inclusionPromise")
        set_ = _as_bytes(
            _field(promise, "signedEntryTimestamp", f"{where}.inclusionPromise"),
            f"{where}.inclusionPromise.signedEntryTimestamp",
        )
    integrated = obj.get("integratedTime")
    log_id = _as_obj(_field(obj, "logId", where), f"{where}.logId")
    return _LogEntry(
        log_index=_as_uint(_field(obj, "logIndex", where), f"{where}.logIndex"),
        log_id=_as_bytes(_field(log_id, "keyId", f"{where}.logId"), f"{where}.logId.keyId"),
        kind=_as_str(_field(kind_version, "kind", f"{where}.kindVersion"), "kind"),
        version=_as_str(_field(kind_version, "version", f"{where}.kindVersion"), "version"),
        integrated_time=None if integrated is None else _as_uint(integrated, f"{where}.integratedTime"),
        signed_entry_timestamp=set_,
        proof=proof,
        body=_as_bytes(_field(obj, "canonicalizedBody", where), f"{where}.canonicalizedBody"),
    )


# --------------------------------------------------------------------------------------------
# Trusted root: the transparency logs (sigstore-python reads the rest for certificate bundles)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LogKey:
    """One transparency log instance from the trusted root."""

    log_ids: tuple[bytes, ...]  # the logId, and the checkpoint key id when the root names one
    key: PublicKey
    hash: hashes.HashAlgorithm | None  # None for Ed25519
    start: datetime
    end: datetime | None
    url: str

    @property
    def spki(self) -> bytes:
        return _spki(self.key)


_TIME = re.compile(r"(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(?:\.(\d+))?(Z|[+-]\d{2}:\d{2})")


def _parse_time(value: object, where: str) -> datetime:
    if not isinstance(value, str) or not (m := _TIME.fullmatch(value)):
        raise UntrustedRootError(f"trusted root field {where} is not an RFC 3339 time: {value!r}")
    # Python keeps microseconds; protobuf times may carry nanoseconds, which cannot matter here.
    fraction = (m.group(2) or "0")[:6].ljust(6, "0")
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    return datetime.fromisoformat(f"{m.group(1)}.{fraction}{zone}")


_KEY_HASHES: dict[str, hashes.HashAlgorithm] = {
    "PKIX_ECDSA_P256_SHA_256": hashes.SHA256(),
    "PKIX_ECDSA_P384_SHA_384": hashes.SHA384(),
    "PKIX_ECDSA_P521_SHA_512": hashes.SHA512(),
    "PKCS1_RSA_PKCS1V5": hashes.SHA256(),
    "PKIX_RSA_PKCS1V5": hashes.SHA256(),
    "PKIX_RSA_PKCS1V15_2048_SHA256": hashes.SHA256(),
    "PKIX_RSA_PKCS1V15_3072_SHA256": hashes.SHA256(),
    "PKIX_RSA_PKCS1V15_4096_SHA256": hashes.SHA256(),
}


def _trusted_root_of(document: dict[str, object]) -> dict[str, object]:
    # A client trust config wraps the trusted root; accept it as well as a bare root.
    inner = document.get("trustedRoot")
    return inner if isinstance(inner, dict) else document


def _trusted_logs(document: dict[str, object], path: Path) -> tuple[_LogKey, ...]:
    root = _trusted_root_of(document)
    media_type = root.get("mediaType")
    if media_type not in _TRUSTED_ROOT_MEDIA_TYPES:
        raise UntrustedRootError(f"{path} is not a Sigstore trusted root (mediaType {media_type!r})")
    tlogs = root.get("tlogs") or []
    if not isinstance(tlogs, list):
        raise UntrustedRootError(f"trusted root {path}: tlogs must be a list")
    return tuple(_parse_log_key(item, f"tlogs[{i}]", path) for i, item in enumerate(tlogs))


def _parse_log_key(item: object, where: str, path: Path) -> _LogKey:
    def fail(why: str) -> UntrustedRootError:
        return UntrustedRootError(f"trusted root {path}: {where} {why}")

    if not isinstance(item, dict):
        raise fail("must be an object")
    public_key, log_id = item.get("publicKey"), item.get("logId")
    if not isinstance(public_key, dict) or not isinstance(log_id, dict):
        raise fail("needs publicKey and logId objects")
    try:
        der = _b64decode(str(public_key.get("rawBytes", "")))
        ids = [_b64decode(str(log_id.get("keyId", "")))]
        checkpoint_id = item.get("checkpointKeyId")
        if isinstance(checkpoint_id, dict) and checkpoint_id.get("keyId"):
            ids.append(_b64decode(str(checkpoint_id["keyId"])))
        key = serialization.load_der_public_key(der)
    except (ValueError, binascii.Error, UnsupportedAlgorithm) as e:
        raise fail("has an unreadable public key or log id") from e
    if not isinstance(key, (ec.EllipticCurvePublicKey, ed25519.Ed25519PublicKey, rsa.RSAPublicKey)):
        raise fail(f"has an unsupported {type(key).__name__}")
    validity = public_key.get("validFor")
    start, end = datetime.min.replace(tzinfo=UTC), None
    if validity is not None:
        if not isinstance(validity, dict) or "start" not in validity:
            # The spec makes start mandatory; a root without it is malformed, not "always valid".
            raise fail("has a validFor without a start")
        start = _parse_time(validity["start"], f"{where}.publicKey.validFor.start")
        if validity.get("end") is not None:
            end = _parse_time(validity["end"], f"{where}.publicKey.validFor.end")
    details = str(public_key.get("keyDetails", ""))
    hash_: hashes.HashAlgorithm | None = None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        hash_ = _KEY_HASHES.get(details) or _default_hash(key)
    return _LogKey(tuple(ids), key, hash_, start, end, str(item.get("baseUrl", "")))


def _find_log(logs: tuple[_LogKey, ...], entry: _LogEntry) -> _LogKey:
    for log in logs:
        if entry.log_id in log.log_ids:
            return log
    # Some roots give a log id that is not the key's RFC 6962 id; the key still identifies it.
    for log in logs:
        if hashlib.sha256(log.spki).digest() == entry.log_id:
            return log
    raise UntrustedRootError(
        f"the bundle's log entry comes from log {base64.b64encode(entry.log_id).decode()}, "
        "which the trusted root does not list"
    )


# --------------------------------------------------------------------------------------------
# Signatures
# --------------------------------------------------------------------------------------------

_DIGEST_NAMES = {"SHA2_256": "sha256", "SHA2_384": "sha384", "SHA2_512": "sha512"}
_HASHES: dict[str, hashes.HashAlgorithm] = {
    "sha256": hashes.SHA256(),
    "sha384": hashes.SHA384(),
    "sha512": hashes.SHA512(),
}


def _default_hash(key: PublicKey) -> hashes.HashAlgorithm:
    if isinstance(key, ec.EllipticCurvePublicKey):
        return {384: hashes.SHA384(), 521: hashes.SHA512()}.get(key.curve.key_size, hashes.SHA256())
    return hashes.SHA256()


def _verifies(
    key: PublicKey,
    signature: bytes,
    *,
    data: bytes | None = None,
    prehashed: tuple[hashes.HashAlgorithm, bytes] | None = None,
    hash_: hashes.HashAlgorithm | None = None,
) -> bool:
    """Whether ``signature`` verifies under ``key`` over ``data`` or a precomputed digest.

    Ed25519 needs ``data``; ECDSA and RSA take either (``hash_`` picks the hash for ``data``).
    RSA signatures are tried as PKCS#1 v1.5, then PSS.
    """
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            if data is None:
                return False
            key.verify(signature, data)
            return True
        if prehashed is not None:
            digest_hash, message = prehashed
            algorithm: hashes.HashAlgorithm | Prehashed = Prehashed(digest_hash)
        elif data is not None:
            digest_hash = hash_ or _default_hash(key)
            algorithm, message = digest_hash, data
        else:
            return False
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, message, ec.ECDSA(algorithm))
            return True
        try:
            key.verify(signature, message, padding.PKCS1v15(), algorithm)
            return True
        except InvalidSignature:
            pss = padding.PSS(mgf=padding.MGF1(digest_hash), salt_length=padding.PSS.AUTO)
            key.verify(signature, message, pss, algorithm)
            return True
    except (InvalidSignature, ValueError, TypeError, UnsupportedAlgorithm):
        return False


# --------------------------------------------------------------------------------------------
# Transparency log entries
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Signer:
    """Who the bundle says signed: a Fulcio certificate, or a managed key."""

    key: PublicKey
    certificate: x509.Certificate | None

    @property
    def spki(self) -> bytes:
        return _spki(self.key)


def _verify_log_entry(
    entry: _LogEntry,
    logs: tuple[_LogKey, ...],
    *,
    parts: _BundleParts,
    artifact: _Artifact,
    signer: _Signer,
) -> None:
    """Verify one log entry as far as can be done offline, raising on the first failure."""
    log = _find_log(logs, entry)
    proof = entry.proof
    if proof is not None:
        _verify_inclusion(entry, proof)
        if proof.checkpoint is not None:
            _verify_checkpoint(proof.checkpoint, proof, log)
    promised = False
    if entry.signed_entry_timestamp is not None:
        _verify_promise(entry, log)
        promised = True

    # What makes an entry count as logged (client spec): bundles v0.2+ carry an inclusion
    # proof with a signed checkpoint; v0.1 bundles may carry only the signed promise.
    proven = proof is not None and proof.checkpoint is not None
    if not proven and not (parts.media_type == _BUNDLE_V01 and promised):
        raise LogEntryError(
            "the bundle's log entry has no inclusion proof with a signed checkpoint",
            hint="pass a bundle written by a current Sigstore client",
        )
    if promised and entry.integrated_time is not None:
        logged_at = datetime.fromtimestamp(entry.integrated_time, tz=UTC)
        if logged_at > datetime.now(UTC) + _CLOCK_SKEW:
            raise LogEntryError(f"the log entry claims to be integrated in the future ({logged_at:%Y-%m-%dT%H:%M:%SZ})")
        # Validity periods are closed intervals: the end instant itself is still valid.
        if logged_at < log.start or (log.end is not None and logged_at > log.end):
            raise UntrustedRootError(
                f"the log entry was integrated at {logged_at:%Y-%m-%dT%H:%M:%SZ}, outside the "
                f"validity period the trusted root gives log {log.url or '(unnamed)'}"
            )
    _check_entry_body(entry, parts, artifact, signer)


def _verify_inclusion(entry: _LogEntry, proof: _InclusionProof) -> None:
    """RFC 9162 section 2.1.3.2: the audit path must hash the entry's leaf up to the root."""
    try:
        verify_inclusion(hash_leaf(entry.body), proof.log_index, proof.tree_size, proof.hashes, proof.root_hash)
    except LogProofError as e:
        raise LogEntryError(f"the bundle's inclusion proof fails: {e.message}") from e


_SIGNATURE_LINE = re.compile("\u2014 (\\S+) (\\S+)")


def _verify_checkpoint(envelope: str, proof: _InclusionProof, log: _LogKey) -> None:
    """Verify a C2SP signed-note checkpoint: the log signed this tree size and root hash."""
    split = envelope.rfind("\n\n")
    if split < 0 or not envelope.endswith("\n"):
        raise LogEntryError("the checkpoint is not a signed note (no signature block)")
    text, signature_block = envelope[: split + 1], envelope[split + 2 :]
    lines = text.split("\n")[:-1]
    if len(lines) < 3 or not lines[0]:
        raise LogEntryError("the checkpoint lacks its origin, tree size or root hash line")
    origin, size_line, root_line = lines[0], lines[1], lines[2]
    if not re.fullmatch(r"[0-9]+", size_line):
        raise LogEntryError(f"the checkpoint's tree size line is not a number: {size_line!r}")
    try:
        root = _b64decode(root_line)
    except (ValueError, binascii.Error) as e:
        raise LogEntryError("the checkpoint's root hash line is not base64") from e
    if int(size_line) != proof.tree_size or root != proof.root_hash:
        raise LogEntryError("the checkpoint signs a different tree (size or root hash) than the inclusion proof")

    signed = text.encode()
    for line in signature_block.split("\n")[:-1]:
        match = _SIGNATURE_LINE.fullmatch(line)
        if not match:
            raise LogEntryError(f"the checkpoint has a malformed signature line: {line[:60]!r}")
        name, blob = match.groups()
        try:
            raw = _b64decode(blob)
        except (ValueError, binascii.Error) as e:
            raise LogEntryError("a checkpoint signature is not base64") from e
        if len(raw) < 5 or not _is_log_signature_line(name, raw[:4], origin, log):
            continue  # a witness cosignature, or another key: not ours to check
        if _verifies(log.key, raw[4:], data=signed, hash_=log.hash):
            return
    raise LogEntryError(
        f"the checkpoint carries no valid signature from log {log.url or origin}",
        hint="the checkpoint was altered or signed by another log; fetch the bundle again",
    )


def _is_log_signature_line(name: str, hint: bytes, origin: str, log: _LogKey) -> bool:
    if isinstance(log.key, ed25519.Ed25519PublicKey):
        # C2SP signed note: the key hash binds the signer's name to the key, and a log signs
        # its checkpoints under its origin.
        raw = log.key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        expected = hashlib.sha256(name.encode() + b"\n\x01" + raw).digest()[:4]
        return name == origin and hint == expected
    # Rekor v1 style: the hint is the log id's prefix, and the origin is "<name> - <tree id>".
    hints = {log_id[:4] for log_id in log.log_ids} | {hashlib.sha256(log.spki).digest()[:4]}
    return hint in hints and (origin == name or origin.startswith(name + " - "))


def _verify_promise(entry: _LogEntry, log: _LogKey) -> None:
    """Verify the signed entry timestamp: the log promised to include this entry at that time."""
    if entry.integrated_time is None or entry.signed_entry_timestamp is None:
        raise LogEntryError("the log entry has an inclusion promise but no integrated time")
    payload = rfc8785.dumps(
        {
            "body": base64.b64encode(entry.body).decode(),
            "integratedTime": entry.integrated_time,
            "logID": entry.log_id.hex(),
            "logIndex": entry.log_index,
        }
    )
    if not _verifies(log.key, entry.signed_entry_timestamp, data=payload, hash_=log.hash):
        raise LogEntryError("the log entry's signed entry timestamp does not verify with the log's key")


# The entry body must describe this bundle's signature, digest and signer; otherwise the proof
# is for someone else's entry (CVE-2022-36056).


def _check_entry_body(entry: _LogEntry, parts: _BundleParts, artifact: _Artifact, signer: _Signer) -> None:
    try:
        body = json.loads(entry.body)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise LogEntryError("the log entry body is not JSON") from e
    if not isinstance(body, dict):
        raise LogEntryError("the log entry body is not a JSON object")
    if (body.get("kind"), body.get("apiVersion")) != (entry.kind, entry.version):
        raise LogEntryError(
            f"the log entry body is a {body.get('kind')}/{body.get('apiVersion')}, but the bundle "
            f"says {entry.kind}/{entry.version}"
        )
    content = parts.content
    kind = (entry.kind, entry.version)
    try:
        if isinstance(content, _MessageSignature):
            if kind == ("hashedrekord", "0.0.1"):
                _check_hashedrekord_v001(body, content.signature, artifact.digest, signer)
            elif kind == ("hashedrekord", "0.0.2"):
                _check_hashedrekord_v002(body, content.signature, artifact.digest, signer)
            else:
                raise LogEntryError(
                    f"a message signature must be logged as a hashedrekord, not {entry.kind}/{entry.version}"
                )
            return

        def pae_digest(name: str) -> bytes:
            return hashlib.new(name, content.pae()).digest()

        if kind == ("hashedrekord", "0.0.1"):
            _check_hashedrekord_v001(body, content.signature, pae_digest, signer)
        elif kind == ("hashedrekord", "0.0.2"):
            _check_hashedrekord_v002(body, content.signature, pae_digest, signer)
        elif kind == ("dsse", "0.0.1"):
            _check_dsse_v001(body, content, signer)
        elif kind == ("dsse", "0.0.2"):
            _check_dsse_v002(body, content, signer)
        elif kind == ("intoto", "0.0.2"):
            _check_intoto_v002(body, content, signer)
        else:
            raise LogEntryError(f"unsupported log entry kind {entry.kind}/{entry.version} for a DSSE bundle")
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, binascii.Error, UnsupportedAlgorithm, x509.InvalidVersion) as e:
        raise LogEntryError(f"the {entry.kind}/{entry.version} log entry body is malformed ({e!r})") from e


def _body_mismatch(what: str) -> LogEntryError:
    return LogEntryError(f"the log entry records a different {what} than the bundle")


def _check_signer_pem(encoded: str, signer: _Signer) -> None:
    """``encoded`` is base64 of a PEM certificate or public key, as Rekor v1 bodies store it."""
    pem = _b64decode(encoded)
    if b"-----BEGIN CERTIFICATE-----" in pem:
        logged_cert = x509.load_pem_x509_certificate(pem)
        if signer.certificate is not None:
            same = logged_cert.public_bytes(serialization.Encoding.DER) == signer.certificate.public_bytes(
                serialization.Encoding.DER
            )
        else:
            same = _spki(logged_cert.public_key()) == signer.spki  # type: ignore[arg-type]
    elif signer.certificate is None:
        same = _spki(serialization.load_pem_public_key(pem)) == signer.spki  # type: ignore[arg-type]
    else:
        same = False  # a certificate bundle must be logged with its certificate
    if not same:
        raise _body_mismatch("signing certificate or key")


def _check_signer_v2(verifier: dict[str, Any], signer: _Signer) -> None:
    """Rekor v2 verifier: DER certificate or DER public key, not PEM."""
    if isinstance(verifier.get("x509Certificate"), dict):
        der = _b64decode(verifier["x509Certificate"]["rawBytes"])
        if signer.certificate is not None:
            same = der == signer.certificate.public_bytes(serialization.Encoding.DER)
        else:
            same = _spki(x509.load_der_x509_certificate(der).public_key()) == signer.spki  # type: ignore[arg-type]
    elif isinstance(verifier.get("publicKey"), dict) and signer.certificate is None:
        same = _b64decode(verifier["publicKey"]["rawBytes"]) == signer.spki
    else:
        same = False
    if not same:
        raise _body_mismatch("signing certificate or key")


def _check_hashedrekord_v001(
    body: dict[str, Any], signature: bytes, digest_of: Callable[[str], bytes], signer: _Signer
) -> None:
    spec = body["spec"]
    logged_hash = spec["data"]["hash"]
    algorithm = logged_hash["algorithm"]
    if algorithm not in _HASHES:
        raise LogEntryError(f"the log entry uses an unsupported digest algorithm {algorithm!r}")
    if logged_hash["value"].lower() != digest_of(algorithm).hex():
        raise _body_mismatch("artifact digest")
    if _b64decode(spec["signature"]["content"]) != signature:
        raise _body_mismatch("signature")
    _check_signer_pem(spec["signature"]["publicKey"]["content"], signer)


def _check_hashedrekord_v002(
    body: dict[str, Any], signature: bytes, digest_of: Callable[[str], bytes], signer: _Signer
) -> None:
    spec = body["spec"]["hashedRekordV002"]
    algorithm = _DIGEST_NAMES.get(spec["data"]["algorithm"])
    if algorithm is None:
        raise LogEntryError(f"the log entry uses an unsupported digest algorithm {spec['data']['algorithm']!r}")
    if _b64decode(spec["data"]["digest"]) != digest_of(algorithm):
        raise _body_mismatch("artifact digest")
    if _b64decode(spec["signature"]["content"]) != signature:
        raise _body_mismatch("signature")
    _check_signer_v2(spec["signature"]["verifier"], signer)


def _check_dsse_v001(body: dict[str, Any], envelope: _Envelope, signer: _Signer) -> None:
    spec = body["spec"]
    # The envelope hash covers uncanonicalized JSON and cannot be recomputed; the payload hash
    # and the signatures are what bind the entry to this envelope.
    payload_hash = spec["payloadHash"]
    if (
        payload_hash["algorithm"] != "sha256"
        or payload_hash["value"].lower() != hashlib.sha256(envelope.payload).hexdigest()
    ):
        raise _body_mismatch("DSSE payload")
    signatures = spec["signatures"]
    if len(signatures) != 1 or _b64decode(signatures[0]["signature"]) != envelope.signature:
        raise _body_mismatch("DSSE signature")
    _check_signer_pem(signatures[0]["verifier"], signer)


def _check_dsse_v002(body: dict[str, Any], envelope: _Envelope, signer: _Signer) -> None:
    spec = body["spec"]["dsseV002"]
    payload_hash = spec["payloadHash"]
    if (
        payload_hash["algorithm"] != "SHA2_256"
        or _b64decode(payload_hash["digest"]) != hashlib.sha256(envelope.payload).digest()
    ):
        raise _body_mismatch("DSSE payload")
    signatures = spec["signatures"]
    if len(signatures) != 1 or _b64decode(signatures[0]["content"]) != envelope.signature:
        raise _body_mismatch("DSSE signature")
    _check_signer_v2(signatures[0]["verifier"], signer)


def _decodes_to(encoded: str, expected: bytes) -> bool:
    # Rekor's intoto/0.0.2 double-base64-encodes some fields; accept either encoding.
    once = _b64decode(encoded)
    if once == expected:
        return True
    try:
        return _b64decode(once.decode()) == expected
    except (ValueError, UnicodeDecodeError, binascii.Error):
        return False


def _check_intoto_v002(body: dict[str, Any], envelope: _Envelope, signer: _Signer) -> None:
    content = body["spec"]["content"]
    payload_hash = content["payloadHash"]
    if (
        payload_hash["algorithm"] != "sha256"
        or payload_hash["value"].lower() != hashlib.sha256(envelope.payload).hexdigest()
    ):
        raise _body_mismatch("DSSE payload")
    logged = content["envelope"]
    if logged.get("payloadType", envelope.payload_type) != envelope.payload_type:
        raise _body_mismatch("DSSE payload type")
    if logged.get("payload") is not None and not _decodes_to(logged["payload"], envelope.payload):
        raise _body_mismatch("DSSE payload")
    signatures = logged["signatures"]
    if len(signatures) != 1 or not _decodes_to(signatures[0]["sig"], envelope.signature):
        raise _body_mismatch("DSSE signature")
    public_key = signatures[0]["publicKey"]
    pem = _b64decode(public_key)
    # The key field is base64 of PEM; older entries encode it twice.
    _check_signer_pem(public_key if pem.startswith(b"-----") else pem.decode(), signer)


# --------------------------------------------------------------------------------------------
# Certificate bundles: our checks first (for precise errors), then sigstore-python
# --------------------------------------------------------------------------------------------


class _SigstoreVerifier(Verifier):
    """sigstore-python 4.5.1's ``Verifier`` with two deviations the spec and conformance need.

    * A TSA's ``validFor`` is a closed interval: a timestamp at exactly ``end`` is valid
      (4.5.1 treats the end as excluded; conformance case trust-root-tsa-validity-end-inclusive).
    * An ``intoto/0.0.2`` Rekor v1 entry's integrated time counts as a signed time when its
      inclusion promise is present (4.5.1 refuses the entry kind outright; conformance case
      intoto-with-custom-trust-root). The promise itself is still verified by
      ``TransparencyLogEntry._verify``.
    """

    def _verify_signed_timestamp(
        self, timestamp_response: TimeStampResponse, message: bytes
    ) -> TimestampVerificationResult | None:
        for authority in self._trusted_root.get_timestamp_authorities():
            certificates = authority.certificates(allow_expired=True)
            if len(certificates) < 2:
                continue  # a TSA chain needs at least a signing certificate and a root
            builder = VerifierBuilder().tsa_certificate(certificates[0]).add_root_certificate(certificates[-1])
            for certificate in certificates[1:-1]:
                builder = builder.add_intermediate_certificate(certificate)
            try:
                builder.build().verify_message(timestamp_response, message)
            except Rfc3161VerificationError:
                continue
            # Bind the time to the authority that signed it, never to another one's validity.
            time = timestamp_response.tst_info.gen_time
            end = authority.validity_period_end
            if authority.validity_period_start <= time and (end is None or time <= end):
                return TimestampVerificationResult(source=TimestampSource.TIMESTAMP_AUTHORITY, time=time)
        return None

    def _establish_time(self, bundle: SigstoreBundle) -> list[TimestampVerificationResult]:
        verified: list[TimestampVerificationResult] = []
        if bundle.verification_material.timestamp_verification_data:
            if not self._trusted_root.get_timestamp_authorities():
                raise SigstoreVerificationError(
                    "the bundle has signed timestamps but the trusted root lists no timestamp authority"
                )
            verified.extend(self._verify_timestamp_authority(bundle))
        entry = bundle.log_entry._inner
        if entry.integrated_time and entry.inclusion_promise:
            kind = (entry.kind_version.kind, entry.kind_version.version)
            if kind not in {("dsse", "0.0.1"), ("hashedrekord", "0.0.1"), ("intoto", "0.0.2")}:
                raise SigstoreVerificationError(
                    f"an integrated time is not a signed time for {kind[0]}/{kind[1]} entries"
                )
            verified.append(
                TimestampVerificationResult(
                    source=TimestampSource.TRANSPARENCY_SERVICE,
                    time=datetime.fromtimestamp(entry.integrated_time, tz=UTC),
                )
            )
        return verified


def _verify_certificate_bundle(
    raw: bytes,
    parts: _BundleParts,
    artifact: _Artifact,
    policy: CertificateIdentity,
    root_path: Path,
    logs: tuple[_LogKey, ...],
) -> str:
    if not parts.certificates:
        raise IdentityMismatchError(
            "the bundle is signed with a managed key, not a Fulcio certificate",
            hint="verify it with --key and the signer's public key",
        )
    try:
        bundle = SigstoreBundle.from_json(raw)
    except (SigstoreError, ValueError) as e:
        raise MalformedInputError(f"the bundle is not a valid Sigstore bundle: {_one_line(e)}") from e
    leaf = parts.certificates[0]
    for extra in parts.certificates[1:]:
        if _is_root_ca(extra):
            # A bundle-supplied root could be mistaken for a trust anchor; the conformance suite
            # requires rejecting it (the client spec asks for at least a warning).
            raise UntrustedRootError(
                "the bundle carries its own root certificate",
                hint="trust anchors come only from the trusted root; fetch the bundle again",
            )

    identity = Identity(identity=policy.identity, issuer=policy.issuer)
    try:
        identity.verify(leaf)
    except (SigstoreError, ValueError, x509.ExtensionNotFound) as e:
        raise IdentityMismatchError(
            f"the signing certificate is for {_describe_identity(leaf)}, not {policy.identity} (issuer {policy.issuer})"
        ) from e

    try:
        signing_key = leaf.public_key()
    except (ValueError, UnsupportedAlgorithm) as e:
        # An altered certificate can carry a key on an unknown curve, or bytes that are no key.
        raise MalformedInputError(
            f"the signing certificate's public key cannot be read: {_one_line(e)}",
            hint="the bundle was altered; fetch it again from its source",
        ) from e
    if not isinstance(signing_key, (ec.EllipticCurvePublicKey, ed25519.Ed25519PublicKey, rsa.RSAPublicKey)):
        raise UntrustedRootError(f"the signing certificate has an unsupported {type(signing_key).__name__}")
    signer = _Signer(signing_key, leaf)
    content = parts.content
    if isinstance(content, _MessageSignature):
        _check_message_digest(content, artifact)
        # sigstore-python signs and verifies the sha256 digest, whatever the key size.
        if not _verifies(signing_key, content.signature, prehashed=(hashes.SHA256(), artifact.sha256)):
            raise BadSignatureError(
                "the bundle's signature does not verify over the artifact with the signing certificate's key"
            )
    elif not _verifies(signing_key, content.signature, data=content.pae(), hash_=hashes.SHA256()):
        raise BadSignatureError("the DSSE envelope's signature does not verify with the signing certificate's key")

    for entry in parts.entries:
        _verify_log_entry(entry, logs, parts=parts, artifact=artifact, signer=signer)

    trusted = _sigstore_trusted_root(root_path)
    try:
        verifier = _SigstoreVerifier(trusted_root=trusted)
        if isinstance(content, _MessageSignature):
            hashed = Hashed(algorithm=HashAlgorithm.SHA2_256, digest=artifact.sha256)
            verifier.verify_artifact(hashed, bundle, identity)
        else:
            kind = bundle.log_entry._inner.kind_version
            if (kind.kind, kind.version) in {("dsse", "0.0.1"), ("hashedrekord", "0.0.2")}:
                verifier.verify_dsse(bundle, identity)
            else:
                # sigstore-python 4.5.1 has no body check for these kinds (hashedrekord/0.0.1
                # over the PAE, intoto/0.0.2); _check_entry_body above did it. The certificate,
                # times, SCT, policy and log proofs are still sigstore-python's.
                verifier._verify_common_signing_cert(bundle, identity)
                envelope = bundle._dsse_envelope
                if envelope is None:
                    raise MalformedInputError("the bundle's DSSE envelope is missing")
                sigstore_dsse._verify(signing_key, envelope)  # type: ignore[arg-type]
    except VerificationError:
        raise
    except (
        SigstoreError,
        ValueError,
        TypeError,
        KeyError,
        InvalidSignature,
        UnsupportedAlgorithm,
        x509.ExtensionNotFound,
    ) as e:
        raise _from_sigstore(e) from e
    return policy.identity


def _sigstore_trusted_root(path: Path) -> TrustedRoot:
    try:
        text = path.read_text(encoding="utf-8")
        if "trustedRoot" in json.loads(text):
            return ClientTrustConfig.from_json(text).trusted_root
        return TrustedRoot.from_file(str(path))
    except (SigstoreError, ValueError, TypeError, OSError) as e:
        raise UntrustedRootError(f"the trusted root is not usable: {_one_line(e)}") from e


def _is_root_ca(certificate: x509.Certificate) -> bool:
    if certificate.issuer != certificate.subject:
        return False
    try:
        return bool(certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except x509.ExtensionNotFound:
        return False
    except ValueError as e:
        raise MalformedInputError(
            f"a certificate in the bundle's chain has extensions that do not parse: {_one_line(e)}",
            hint="the bundle was altered; fetch it again from its source",
        ) from e


def _describe_identity(certificate: x509.Certificate) -> str:
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [str(v) for v in san.get_values_for_type(x509.RFC822Name)]
        names += [str(v) for v in san.get_values_for_type(x509.UniformResourceIdentifier)]
        names += [o.value.decode(errors="replace") for o in san.get_values_for_type(x509.OtherName)]
    except (x509.ExtensionNotFound, ValueError):
        # ValueError: extensions that do not parse (an altered certificate); it is described, then refused.
        names = []
    issuer = None
    for oid, der_encoded in (("1.3.6.1.4.1.57264.1.8", True), ("1.3.6.1.4.1.57264.1.1", False)):
        try:
            value = certificate.extensions.get_extension_for_oid(x509.ObjectIdentifier(oid)).value
        except (x509.ExtensionNotFound, ValueError):
            continue
        raw = getattr(value, "value", b"")
        # The v2 issuer extension is a DER UTF8String (tag, length, text); v1 is raw text.
        issuer = (raw[2:] if der_encoded and len(raw) > 2 and raw[1] < 0x80 else raw).decode(errors="replace")
        break
    who = ", ".join(names) or "no identity"
    return f"{who} (issuer {issuer or 'unknown'})"


def _check_message_digest(content: _MessageSignature, artifact: _Artifact) -> None:
    if content.digest is None:
        return
    name = _DIGEST_NAMES.get(content.digest_algorithm or "")
    if name is None:
        raise MalformedInputError(f"the bundle's message digest uses unknown algorithm {content.digest_algorithm!r}")
    actual = artifact.digest(name)
    if actual != content.digest:
        raise DigestMismatchError(
            f"the artifact's {name} is {actual.hex()}, but the bundle signs {content.digest.hex()}"
        )


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 300 else text[:297] + "..."


# sigstore-python reports every failure as a VerificationError with prose; map the prose to our
# classes. Our own checks above normally fail first, so these are the residual cases.
_SIGSTORE_ERRORS: tuple[tuple[str, type[VerificationError]], ...] = (
    ("SANs do not match", IdentityMismatchError),
    ("OIDC issuer", IdentityMismatchError),
    ("message digest mismatch", DigestMismatchError),
    ("Signature is invalid", BadSignatureError),
    ("DSSE: invalid signature", BadSignatureError),
    ("log entry", LogEntryError),
    ("inclusion", LogEntryError),
    ("checkpoint", LogEntryError),
    ("SET", LogEntryError),
)


def _from_sigstore(error: BaseException) -> VerificationError:
    text = _one_line(error)
    if isinstance(error, (CertValidationError, UnsupportedAlgorithm)):
        return UntrustedRootError(f"the signing certificate does not chain to the trusted root: {text}")
    for needle, cls in _SIGSTORE_ERRORS:
        if needle in text:
            return cls(f"sigstore-python rejected the bundle: {text}")
    # Chain, SCT and signed-time failures: all mean the trusted root does not vouch for it.
    return UntrustedRootError(f"sigstore-python rejected the bundle: {text}")


# --------------------------------------------------------------------------------------------
# Managed-key bundles: all checks are ours
# --------------------------------------------------------------------------------------------


def _verify_key_bundle(parts: _BundleParts, artifact: _Artifact, policy: ManagedKey, logs: tuple[_LogKey, ...]) -> str:
    key = _load_public_key_pem(policy.public_key_pem, "the managed key")
    if parts.certificates:
        raise IdentityMismatchError(
            f"the bundle is signed by a Fulcio certificate for {_describe_identity(parts.certificates[0])}, "
            "not by a managed key",
            hint="verify it with --certificate-identity and --certificate-oidc-issuer",
        )
    content = parts.content
    if isinstance(content, _MessageSignature):
        _check_message_digest(content, artifact)
        if not _key_signed_message(key, content, artifact):
            raise BadSignatureError(
                "the bundle's signature does not verify over the artifact with the given key",
                hint="the bundle was signed by another key, or altered; check --key",
            )
    elif not any(_verifies(key, content.signature, data=content.pae(), hash_=h) for h in _candidate_hashes(key)):
        raise BadSignatureError(
            "the DSSE envelope's signature does not verify with the given key",
            hint="the bundle was signed by another key, or altered; check --key",
        )
    # Timestamps from a TSA are not needed here: a managed key has no validity period to check
    # a signing time against. Log entries, when present, must verify completely.
    signer = _Signer(key, None)
    for entry in parts.entries:
        _verify_log_entry(entry, logs, parts=parts, artifact=artifact, signer=signer)
    return "sha256:" + hashlib.sha256(_spki(key)).hexdigest()


def _candidate_hashes(key: PublicKey) -> list[hashes.HashAlgorithm | None]:
    # The key's natural hash first (P-384 signs SHA-384), then SHA-256, which some signers use
    # with every curve.
    if isinstance(key, ed25519.Ed25519PublicKey):
        return [None]
    natural = _default_hash(key)
    return [natural] if isinstance(natural, hashes.SHA256) else [natural, hashes.SHA256()]


def _key_signed_message(key: PublicKey, content: _MessageSignature, artifact: _Artifact) -> bool:
    if isinstance(key, ed25519.Ed25519PublicKey):
        # Ed25519 signs the message itself, so the digest cannot stand in for the artifact.
        return _verifies(key, content.signature, data=artifact.read("an Ed25519 signature"))
    if content.digest is not None:
        name = _DIGEST_NAMES[content.digest_algorithm or ""]
        return _verifies(key, content.signature, prehashed=(_HASHES[name], artifact.digest(name)))
    return any(
        _verifies(key, content.signature, prehashed=(h, artifact.digest(h.name)))
        for h in _candidate_hashes(key)
        if h is not None
    )


# --------------------------------------------------------------------------------------------
# in-toto statement (DSSE bundles)
# --------------------------------------------------------------------------------------------


def _check_statement(envelope: _Envelope, artifact: _Artifact) -> None:
    """The signed statement must be an in-toto Statement naming the artifact as a subject."""
    if envelope.payload_type != IN_TOTO_PAYLOAD_TYPE:
        raise UnsupportedPayloadTypeError(
            f"the DSSE payload type is {envelope.payload_type!r}, not {IN_TOTO_PAYLOAD_TYPE}"
        )
    try:
        statement = json.loads(envelope.payload)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise MalformedInputError("the DSSE payload is not JSON") from e
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
