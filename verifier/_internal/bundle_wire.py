"""The Sigstore bundle's wire format, read by our own parser (sigstore-python's refuses
managed-key bundles): every field checked for shape and decoded, nothing verified.

A bundle is protobuf JSON (``dev.sigstore.bundle.v1.Bundle``, media types 0.1 to 0.3): bytes are
base64 (the standard or URL-safe alphabet, padding optional; one alphabet per field, by the one
rule in ``kvgraft.schemas.decode_base64``), 64-bit integers may be strings or numbers, and a
field set to ``null`` counts as missing. Every malformed field becomes one
``MalformedInputError`` naming the field.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509

from kvgraft.schemas import DocumentError, InvalidDigestError, Sha256Digest, parse_json, parse_sha256

from .dsse import b64decode_any, pae
from .errors import DigestMismatchError, MalformedInputError
from .files import read_input

BUNDLE_MEDIA_TYPES = frozenset(
    {
        "application/vnd.dev.sigstore.bundle+json;version=0.1",
        "application/vnd.dev.sigstore.bundle+json;version=0.2",
        "application/vnd.dev.sigstore.bundle+json;version=0.3",
        "application/vnd.dev.sigstore.bundle.v0.3+json",
    }
)
#: The one version whose log entries may prove inclusion by a signed promise alone.
BUNDLE_V01 = "application/vnd.dev.sigstore.bundle+json;version=0.1"


# --------------------------------------------------------------------------------------------
# Reading inputs
# --------------------------------------------------------------------------------------------


def read_json(raw: bytes, what: str) -> dict[str, object]:
    """``raw`` (a bundle or a trusted root) as a JSON object, parsed by the one strict parser,
    ``kvgraft.schemas.parse_json``: UTF-8, no duplicate keys, no NaN, at most 64 levels deep.

    A duplicate key would let two readers of one bundle (this one and sigstore-python's) see two
    different documents; it is refused, as everywhere else in kvgraft. Every fault is one
    ``MalformedInputError`` naming ``what``.
    """
    try:
        document = parse_json(raw, what=what)
    except DocumentError as e:
        raise MalformedInputError(e.message) from e
    if not isinstance(document, dict):
        raise MalformedInputError(f"{what} must be a JSON object, got {type(document).__name__}")
    return document


@dataclass(frozen=True)
class Artifact:
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


def resolve_artifact(artifact: Path | Sha256Digest) -> Artifact:
    """The artifact as a file (hashed here) or as ``sha256:<64 hex>``."""
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
        return Artifact(digest, artifact)
    try:
        prefixed = parse_sha256(artifact)
    except InvalidDigestError as e:
        raise MalformedInputError(str(e), hint="pass a file path or sha256:<64 hex>") from e
    return Artifact(bytes.fromhex(prefixed.removeprefix("sha256:")), None)


# --------------------------------------------------------------------------------------------
# JSON field readers: every malformed field becomes one MalformedInputError naming the field
# --------------------------------------------------------------------------------------------

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
    return b64decode_any(_as_str(value, where), what=f"bundle field {where}")


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
# Bundle parts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MessageSignature:
    """A bundle's ``messageSignature``: a signature over the artifact, and optionally the digest
    the signer says it signed (checked against the artifact by ``check_message_digest``)."""

    digest_algorithm: str | None  # protobuf HashAlgorithm name, e.g. SHA2_256
    digest: bytes | None
    signature: bytes


@dataclass(frozen=True)
class BundleEnvelope:
    """A bundle's ``dsseEnvelope``: the payload bytes exactly as signed, never re-serialized."""

    payload_type: str
    payload: bytes
    signature: bytes  # a Sigstore bundle's envelope carries exactly one

    def pae(self) -> bytes:
        """DSSE pre-authentication encoding: the bytes the signature covers."""
        return pae(self.payload_type, self.payload)


@dataclass(frozen=True)
class EntryProof:
    """A log entry's ``inclusionProof``: an RFC 9162 audit path up to ``root_hash`` at
    ``tree_size``, and the C2SP signed-note checkpoint that signs that tree (None in v0.1)."""

    log_index: int
    root_hash: bytes
    tree_size: int
    hashes: tuple[bytes, ...]
    checkpoint: str | None


@dataclass(frozen=True)
class LogEntry:
    """One of ``verificationMaterial.tlogEntries``: where the log put the signature
    (``log_id``, ``log_index``), the entry body as logged (``canonicalizedBody``, of Rekor kind
    ``kind``/``version``), its proof, and the signed entry timestamp (``inclusionPromise``)."""

    log_index: int
    log_id: bytes
    kind: str
    version: str
    integrated_time: int | None
    signed_entry_timestamp: bytes | None
    proof: EntryProof | None
    body: bytes


@dataclass(frozen=True)
class BundleParts:
    """Everything a bundle holds, each field checked for shape and decoded, nothing verified."""

    media_type: str
    certificates: tuple[x509.Certificate, ...]  # leaf first; empty for managed-key bundles
    content: MessageSignature | BundleEnvelope
    entries: tuple[LogEntry, ...]


def parse_bundle(document: dict[str, object]) -> BundleParts:
    """The parts of a bundle (``read_json``'s object); a malformed field is one
    ``MalformedInputError`` naming it."""
    media_type = _as_str(_field(document, "mediaType", "bundle"), "mediaType")
    if media_type not in BUNDLE_MEDIA_TYPES:
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
    content: MessageSignature | BundleEnvelope
    if has_message:
        content = _parse_message_signature(_as_obj(document["messageSignature"], "messageSignature"))
    else:
        content = _parse_envelope(_as_obj(document["dsseEnvelope"], "dsseEnvelope"))
    return BundleParts(media_type, certificates, content, entries)


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


def _parse_message_signature(obj: dict[str, object]) -> MessageSignature:
    signature = _as_bytes(_field(obj, "signature", "messageSignature"), "messageSignature.signature")
    algorithm = digest = None
    if obj.get("messageDigest") is not None:
        md = _as_obj(obj["messageDigest"], "messageSignature.messageDigest")
        algorithm = _as_str(_field(md, "algorithm", "messageDigest"), "messageDigest.algorithm")
        digest = _as_bytes(_field(md, "digest", "messageDigest"), "messageDigest.digest")
    if not signature:
        raise MalformedInputError("the bundle's messageSignature.signature is empty")
    return MessageSignature(algorithm, digest, signature)


def _parse_envelope(obj: dict[str, object]) -> BundleEnvelope:
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
    return BundleEnvelope(payload_type, payload, signature)


def _parse_log_entry(obj: dict[str, object], where: str) -> LogEntry:
    kind_version = _as_obj(_field(obj, "kindVersion", where), f"{where}.kindVersion")
    proof = None
    if obj.get("inclusionProof") is not None:
        p = _as_obj(obj["inclusionProof"], f"{where}.inclusionProof")
        pw = f"{where}.inclusionProof"
        checkpoint = None
        if p.get("checkpoint") is not None:
            cp = _as_obj(p["checkpoint"], f"{pw}.checkpoint")
            checkpoint = _as_str(_field(cp, "envelope", f"{pw}.checkpoint"), f"{pw}.checkpoint")
        proof = EntryProof(
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
    return LogEntry(
        log_index=_as_uint(_field(obj, "logIndex", where), f"{where}.logIndex"),
        log_id=_as_bytes(_field(log_id, "keyId", f"{where}.logId"), f"{where}.logId.keyId"),
        kind=_as_str(_field(kind_version, "kind", f"{where}.kindVersion"), "kind"),
        version=_as_str(_field(kind_version, "version", f"{where}.kindVersion"), "version"),
        integrated_time=None if integrated is None else _as_uint(integrated, f"{where}.integratedTime"),
        signed_entry_timestamp=set_,
        proof=proof,
        body=_as_bytes(_field(obj, "canonicalizedBody", where), f"{where}.canonicalizedBody"),
    )

