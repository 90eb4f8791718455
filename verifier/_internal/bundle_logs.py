"""Transparency log entries in Sigstore bundles, verified offline against the trusted root.

The trusted root's ``tlogs`` name each log: its key, its log id, its validity period. Each entry
of a bundle must come from one of them and verify completely: its RFC 9162 inclusion proof (up to
the root hash), the C2SP signed-note checkpoint that signs that root, the signed entry timestamp
(``inclusionPromise``, over the RFC 8785 JSON of body, integrated time, log id and index), an
integrated time inside the log's validity period and not in the future, and a body that describes
this bundle's signature, digest and signer (``bundle_entries``). Bundles v0.2+ must carry a
checkpoint; a v0.1 bundle may prove inclusion by the promise alone.
"""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import rfc8785
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from kvgraft.schemas import DocumentError, decode_base64

from .bundle_entries import check_entry_body
from .bundle_keys import PublicKey, Signer, default_hash, spki, verifies
from .bundle_wire import BUNDLE_V01, Artifact, BundleParts, EntryProof, LogEntry
from .errors import LogEntryError, LogProofError, UntrustedRootError
from .tlog import hash_leaf, verify_inclusion

_TRUSTED_ROOT_MEDIA_TYPES = frozenset(
    {
        "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
        "application/vnd.dev.sigstore.trustedroot.v0.1+json",
        "application/vnd.dev.sigstore.trustedroot.v0.2+json",
    }
)
# Rekor's clock and ours may disagree a little; a log entry further in the future than this is
# not a clock difference but a forged or broken entry.
_CLOCK_SKEW = timedelta(minutes=10)


# --------------------------------------------------------------------------------------------
# Trusted root: the transparency logs (sigstore-python reads the rest for certificate bundles)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrustedLog:
    """One transparency log instance from the trusted root."""

    log_ids: tuple[bytes, ...]  # the logId, and the checkpoint key id when the root names one
    key: PublicKey
    hash: hashes.HashAlgorithm | None  # None for Ed25519
    start: datetime
    end: datetime | None
    url: str

    @property
    def spki(self) -> bytes:
        """The log key's DER SubjectPublicKeyInfo."""
        return spki(self.key)


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


def trusted_logs(document: dict[str, object], path: Path) -> tuple[TrustedLog, ...]:
    """The transparency logs of the trusted root ``document`` (read from ``path``, named in errors)."""
    root = _trusted_root_of(document)
    media_type = root.get("mediaType")
    if media_type not in _TRUSTED_ROOT_MEDIA_TYPES:
        raise UntrustedRootError(f"{path} is not a Sigstore trusted root (mediaType {media_type!r})")
    tlogs = root.get("tlogs") or []
    if not isinstance(tlogs, list):
        raise UntrustedRootError(f"trusted root {path}: tlogs must be a list")
    return tuple(_parse_log_key(item, f"tlogs[{i}]", path) for i, item in enumerate(tlogs))


def _parse_log_key(item: object, where: str, path: Path) -> TrustedLog:
    def fail(why: str) -> UntrustedRootError:
        return UntrustedRootError(f"trusted root {path}: {where} {why}")

    if not isinstance(item, dict):
        raise fail("must be an object")
    public_key, log_id = item.get("publicKey"), item.get("logId")
    if not isinstance(public_key, dict) or not isinstance(log_id, dict):
        raise fail("needs publicKey and logId objects")
    try:
        der = decode_base64(str(public_key.get("rawBytes", "")), what="publicKey.rawBytes")
        ids = [decode_base64(str(log_id.get("keyId", "")), what="logId.keyId")]
        checkpoint_id = item.get("checkpointKeyId")
        if isinstance(checkpoint_id, dict) and checkpoint_id.get("keyId"):
            ids.append(decode_base64(str(checkpoint_id["keyId"]), what="checkpointKeyId.keyId"))
        key = serialization.load_der_public_key(der)
    except (ValueError, UnsupportedAlgorithm) as e:
        # ValueError: DocumentError (bad base64) included.
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
        hash_ = _KEY_HASHES.get(details) or default_hash(key)
    return TrustedLog(tuple(ids), key, hash_, start, end, str(item.get("baseUrl", "")))


def _find_log(logs: tuple[TrustedLog, ...], entry: LogEntry) -> TrustedLog:
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
# Log entries: inclusion proof, signed checkpoint, signed entry timestamp, body
# --------------------------------------------------------------------------------------------


def verify_log_entry(
    entry: LogEntry,
    logs: tuple[TrustedLog, ...],
    *,
    parts: BundleParts,
    artifact: Artifact,
    signer: Signer,
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
    if not proven and not (parts.media_type == BUNDLE_V01 and promised):
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
    check_entry_body(entry, parts, artifact, signer)


def _verify_inclusion(entry: LogEntry, proof: EntryProof) -> None:
    """RFC 9162 section 2.1.3.2: the audit path must hash the entry's leaf up to the root."""
    try:
        verify_inclusion(hash_leaf(entry.body), proof.log_index, proof.tree_size, proof.hashes, proof.root_hash)
    except LogProofError as e:
        raise LogEntryError(f"the bundle's inclusion proof fails: {e.message}") from e


_SIGNATURE_LINE = re.compile("\u2014 (\\S+) (\\S+)")


def _verify_checkpoint(envelope: str, proof: EntryProof, log: TrustedLog) -> None:
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
        root = decode_base64(root_line, what="the checkpoint's root hash")
    except DocumentError as e:
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
            raw = decode_base64(blob, what="a checkpoint signature")
        except DocumentError as e:
            raise LogEntryError("a checkpoint signature is not base64") from e
        if len(raw) < 5 or not _is_log_signature_line(name, raw[:4], origin, log):
            continue  # a witness cosignature, or another key: not ours to check
        if verifies(log.key, raw[4:], data=signed, hash_=log.hash):
            return
    raise LogEntryError(
        f"the checkpoint carries no valid signature from log {log.url or origin}",
        hint="the checkpoint was altered or signed by another log; fetch the bundle again",
    )


def _is_log_signature_line(name: str, hint: bytes, origin: str, log: TrustedLog) -> bool:
    if isinstance(log.key, ed25519.Ed25519PublicKey):
        # C2SP signed note: the key hash binds the signer's name to the key, and a log signs
        # its checkpoints under its origin.
        raw = log.key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        expected = hashlib.sha256(name.encode() + b"\n\x01" + raw).digest()[:4]
        return name == origin and hint == expected
    # Rekor v1 style: the hint is the log id's prefix, and the origin is "<name> - <tree id>".
    hints = {log_id[:4] for log_id in log.log_ids} | {hashlib.sha256(log.spki).digest()[:4]}
    return hint in hints and (origin == name or origin.startswith(name + " - "))


def _verify_promise(entry: LogEntry, log: TrustedLog) -> None:
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
    if not verifies(log.key, entry.signed_entry_timestamp, data=payload, hash_=log.hash):
        raise LogEntryError("the log entry's signed entry timestamp does not verify with the log's key")
