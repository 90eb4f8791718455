"""The bodies of Rekor log entries: each must describe the bundle's own signature, digest and
signer, or the entry (and its proof) is someone else's (CVE-2022-36056).

Kinds read: ``hashedrekord`` 0.0.1 (Rekor v1: hex digest, base64 of a PEM certificate or key)
and 0.0.2 (Rekor v2: base64 digest, DER certificate or key), ``dsse`` 0.0.1 and 0.0.2, and
``intoto`` 0.0.2 (some fields base64 twice). A DSSE bundle logged as a hashedrekord signs the
digest of the envelope's PAE. Any other shape is a ``LogEntryError``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from kvgraft.schemas import DocumentError, decode_base64, parse_json

from .bundle_keys import DIGEST_NAMES, HASHES, Signer, spki
from .bundle_wire import Artifact, BundleEnvelope, BundleParts, LogEntry, MessageSignature
from .errors import LogEntryError


def _b64(value: object) -> bytes:
    # The one base64 rule (either alphabet, not both; padding optional); DocumentError is a ValueError.
    return decode_base64(value, what="a base64 field of the log entry body")


def check_entry_body(entry: LogEntry, parts: BundleParts, artifact: Artifact, signer: Signer) -> None:
    """The entry's body (``canonicalizedBody``) must be of the kind the bundle names and describe
    this bundle's signature, digest (or DSSE payload) and signer; else ``LogEntryError``."""
    try:
        body = parse_json(entry.body, what="the log entry body")
    except DocumentError as e:
        raise LogEntryError(f"the log entry body is not JSON: {e.message}") from e
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
        if isinstance(content, MessageSignature):
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
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, UnsupportedAlgorithm, x509.InvalidVersion) as e:
        # ValueError: DocumentError (bad base64) and binascii.Error included.
        raise LogEntryError(f"the {entry.kind}/{entry.version} log entry body is malformed ({e!r})") from e


def _body_mismatch(what: str) -> LogEntryError:
    return LogEntryError(f"the log entry records a different {what} than the bundle")


def _check_signer_pem(encoded: str, signer: Signer) -> None:
    """``encoded`` is base64 of a PEM certificate or public key, as Rekor v1 bodies store it."""
    pem = _b64(encoded)
    if b"-----BEGIN CERTIFICATE-----" in pem:
        logged_cert = x509.load_pem_x509_certificate(pem)
        if signer.certificate is not None:
            same = logged_cert.public_bytes(serialization.Encoding.DER) == signer.certificate.public_bytes(
                serialization.Encoding.DER
            )
        else:
            same = spki(logged_cert.public_key()) == signer.spki  # type: ignore[arg-type]
    elif signer.certificate is None:
        same = spki(serialization.load_pem_public_key(pem)) == signer.spki  # type: ignore[arg-type]
    else:
        same = False  # a certificate bundle must be logged with its certificate
    if not same:
        raise _body_mismatch("signing certificate or key")


def _check_signer_v2(verifier: dict[str, Any], signer: Signer) -> None:
    """Rekor v2 verifier: DER certificate or DER public key, not PEM."""
    if isinstance(verifier.get("x509Certificate"), dict):
        der = _b64(verifier["x509Certificate"]["rawBytes"])
        if signer.certificate is not None:
            same = der == signer.certificate.public_bytes(serialization.Encoding.DER)
        else:
            same = spki(x509.load_der_x509_certificate(der).public_key()) == signer.spki  # type: ignore[arg-type]
    elif isinstance(verifier.get("publicKey"), dict) and signer.certificate is None:
        same = _b64(verifier["publicKey"]["rawBytes"]) == signer.spki
    else:
        same = False
    if not same:
        raise _body_mismatch("signing certificate or key")


def _check_hashedrekord_v001(
    body: dict[str, Any], signature: bytes, digest_of: Callable[[str], bytes], signer: Signer
) -> None:
    spec = body["spec"]
    logged_hash = spec["data"]["hash"]
    algorithm = logged_hash["algorithm"]
    if algorithm not in HASHES:
        raise LogEntryError(f"the log entry uses an unsupported digest algorithm {algorithm!r}")
    if logged_hash["value"].lower() != digest_of(algorithm).hex():
        raise _body_mismatch("artifact digest")
    if _b64(spec["signature"]["content"]) != signature:
        raise _body_mismatch("signature")
    _check_signer_pem(spec["signature"]["publicKey"]["content"], signer)


def _check_hashedrekord_v002(
    body: dict[str, Any], signature: bytes, digest_of: Callable[[str], bytes], signer: Signer
) -> None:
    spec = body["spec"]["hashedRekordV002"]
    algorithm = DIGEST_NAMES.get(spec["data"]["algorithm"])
    if algorithm is None:
        raise LogEntryError(f"the log entry uses an unsupported digest algorithm {spec['data']['algorithm']!r}")
    if _b64(spec["data"]["digest"]) != digest_of(algorithm):
        raise _body_mismatch("artifact digest")
    if _b64(spec["signature"]["content"]) != signature:
        raise _body_mismatch("signature")
    _check_signer_v2(spec["signature"]["verifier"], signer)


def _check_dsse_v001(body: dict[str, Any], envelope: BundleEnvelope, signer: Signer) -> None:
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
    if len(signatures) != 1 or _b64(signatures[0]["signature"]) != envelope.signature:
        raise _body_mismatch("DSSE signature")
    _check_signer_pem(signatures[0]["verifier"], signer)


def _check_dsse_v002(body: dict[str, Any], envelope: BundleEnvelope, signer: Signer) -> None:
    spec = body["spec"]["dsseV002"]
    payload_hash = spec["payloadHash"]
    if (
        payload_hash["algorithm"] != "SHA2_256"
        or _b64(payload_hash["digest"]) != hashlib.sha256(envelope.payload).digest()
    ):
        raise _body_mismatch("DSSE payload")
    signatures = spec["signatures"]
    if len(signatures) != 1 or _b64(signatures[0]["content"]) != envelope.signature:
        raise _body_mismatch("DSSE signature")
    _check_signer_v2(signatures[0]["verifier"], signer)


def _decodes_to(encoded: str, expected: bytes) -> bool:
    # Rekor's intoto/0.0.2 double-base64-encodes some fields; accept either encoding.
    once = _b64(encoded)
    if once == expected:
        return True
    try:
        return _b64(once.decode()) == expected
    except (ValueError, UnicodeDecodeError):
        return False


def _check_intoto_v002(body: dict[str, Any], envelope: BundleEnvelope, signer: Signer) -> None:
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
    pem = _b64(public_key)
    # The key field is base64 of PEM; older entries encode it twice.
    _check_signer_pem(public_key if pem.startswith(b"-----") else pem.decode(), signer)
