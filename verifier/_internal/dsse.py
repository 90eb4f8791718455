"""DSSE: pre-authentication encoding, signing, and verification with thresholds.

Follows https://github.com/secure-systems-lab/dsse/blob/master/protocol.md: the signature is
over ``PAE(type, body)`` (Ed25519, or DER-encoded ECDSA P-256/SHA-256 or P-384/SHA-384: see
``keys``); ``keyid`` is only a hint; thresholds count distinct trusted keys.
The payload is verified as the bytes received and parsed only after the signatures hold.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from kvgraft.schemas import (
    IN_TOTO_PAYLOAD_TYPE,
    DocumentError,
    Envelope,
    Signature,
    Statement,
    canonical_model,
    decode_base64,
    parse_json,
    parse_statement,
)

from .errors import (
    BadSignatureError,
    MalformedInputError,
    ThresholdNotMetError,
    UnknownKeyError,
    UnsupportedPayloadTypeError,
)
from .keys import KeyId, SigningKey, TrustedKey, TrustedKeys, verify_signature

_MAX_ENVELOPE = 64 * 1024 * 1024


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE v1 pre-authentication encoding; lengths are byte lengths (UTF-8 for the type)."""
    type_bytes = payload_type.encode("utf-8")
    return b"DSSEv1 %d %b %d %b" % (len(type_bytes), type_bytes, len(payload), payload)


def b64decode_any(text: str, *, what: str) -> bytes:
    """Decode standard or URL-safe base64, padded or not; refuse anything else.

    The rule is ``kvgraft.schemas.decode_base64``; here a fault is a ``MalformedInputError``.
    """
    try:
        return decode_base64(text, what=what)
    except DocumentError as e:
        raise MalformedInputError(e.message) from e


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def sign_envelope(payload: bytes, signers: list[SigningKey], payload_type: str = IN_TOTO_PAYLOAD_TYPE) -> Envelope:
    """Sign ``payload`` with each signer; the keyid hint is the signer's key id."""
    if not signers:
        raise ValueError("sign_envelope needs at least one signer")
    message = pae(payload_type, payload)
    sigs = [Signature(sig=_b64(s.sign(message)), keyid=s.keyid) for s in signers]
    return Envelope(payload=_b64(payload), payload_type=payload_type, signatures=sigs)


def sign_statement(statement: Statement, signers: list[SigningKey]) -> Envelope:
    """Sign the RFC 8785 canonical JSON of ``statement`` as an in-toto DSSE envelope."""
    return sign_envelope(canonical_model(statement), signers)


def envelope_json(envelope: Envelope) -> bytes:
    """The envelope as the JSON text written to ``*.dsse.json`` files."""
    return envelope.model_dump_json(by_alias=True, indent=2).encode("utf-8") + b"\n"


def parse_envelope(data: bytes, *, source: str = "envelope") -> Envelope:
    """Parse DSSE envelope JSON; raise ``MalformedInputError`` naming the fault."""
    try:
        raw = parse_json(data, what=source)
    except DocumentError as e:
        raise MalformedInputError(str(e)) from e
    if not isinstance(raw, dict):
        raise MalformedInputError(f"{source} must be a JSON object, got {type(raw).__name__}")
    try:
        # Unknown top-level fields are not signed and not used: ignore them, as DSSE allows.
        known = {k: raw[k] for k in ("payload", "payloadType", "signatures") if k in raw}
        return Envelope.model_validate(known)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise MalformedInputError(f"{source}: {where}: {err['msg']}") from e


def read_envelope(path: Path) -> Envelope:
    """Read and parse a DSSE envelope file."""
    try:
        if path.is_dir():
            raise MalformedInputError(f"envelope {path} is a directory, not a file", hint="pass the .dsse.json file")
        if path.stat().st_size > _MAX_ENVELOPE:
            raise MalformedInputError(f"envelope {path} is larger than {_MAX_ENVELOPE} bytes")
        data = path.read_bytes()
    except FileNotFoundError as e:
        raise MalformedInputError(f"envelope {path} does not exist") from e
    except OSError as e:
        raise MalformedInputError(f"cannot read envelope {path}: {e.strerror}") from e
    return parse_envelope(data, source=f"envelope {path}")


@dataclass(frozen=True)
class VerifiedEnvelope:
    """What a verified envelope proves: these payload bytes, signed by these distinct keys."""

    payload_type: str
    payload: bytes
    signers: tuple[TrustedKey, ...]

    @property
    def keyids(self) -> tuple[KeyId, ...]:
        """The key ids of the distinct trusted keys that signed."""
        return tuple(k.keyid for k in self.signers)


def verify_envelope(envelope: Envelope, trusted: TrustedKeys, *, threshold: int | None = None) -> VerifiedEnvelope:
    """Verify ``envelope`` against ``trusted``; return the payload or raise.

    ``threshold`` defaults to ``trusted.threshold``. Each trusted key counts once however many
    signatures it made; keyid hints are used only to order the search, never to decide.
    """
    need = trusted.threshold if threshold is None else threshold
    if envelope.payload_type not in trusted.payload_types:
        raise UnsupportedPayloadTypeError(
            f"payload type {envelope.payload_type!r} is not accepted (accepted: {', '.join(trusted.payload_types)})"
        )
    payload = b64decode_any(envelope.payload, what="envelope payload")
    message = pae(envelope.payload_type, payload)

    recognized: dict[KeyId, TrustedKey] = {}
    hinted_but_bad: list[str] = []
    for index, signature in enumerate(envelope.signatures):
        sig = b64decode_any(signature.sig, what=f"signature {index}")
        candidates = sorted(
            (k for k in trusted.keys if k.keyid not in recognized),
            key=lambda k: k.keyid != signature.keyid,
        )
        for key in candidates:
            try:
                verify_signature(key.public_key, sig, message)
            except BadSignatureError:
                continue  # not this key's signature: try the next trusted key
            recognized[key.keyid] = key
            break
        else:
            if any(k.keyid == signature.keyid for k in trusted.keys):
                hinted_but_bad.append(signature.keyid)

    if len(recognized) >= need:
        return VerifiedEnvelope(envelope.payload_type, payload, tuple(recognized.values()))
    if hinted_but_bad and not recognized:
        named = next(k for k in trusted.keys if k.keyid == hinted_but_bad[0])
        raise BadSignatureError(
            f"the signature by trusted key {_named([named])} does not verify over this payload"
        )
    if not recognized:
        raise UnknownKeyError(
            f"none of the envelope's {len(envelope.signatures)} signature(s) verifies with any of the "
            f"{len(trusted.keys)} trusted key(s) ({_named(trusted.keys)}); {_claimed(envelope)}"
        )
    raise ThresholdNotMetError(
        f"{len(recognized)} distinct trusted key(s) signed ({', '.join(k.name for k in recognized.values())}); "
        f"{need} are required"
    )


def _named(keys: Iterable[TrustedKey], most: int = 4) -> str:
    # Keys as a reader knows them: the trusted-keys file's name, and the keyid to tell them apart.
    keys = list(keys)
    shown = ", ".join(f"{k.name} keyid {k.keyid[:16]}..." for k in keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")


def _claimed(envelope: Envelope, most: int = 4) -> str:
    """Which keys the envelope's signatures say they are by (their keyid hints; unverified)."""
    hints = list(dict.fromkeys(s.keyid for s in envelope.signatures if s.keyid))
    if not hints:
        return "its signatures name no keyid"
    shown = ", ".join(f"{h[:16]}..." for h in hints[:most]) + (f" and {len(hints) - most} more" if len(hints) > most else "")
    return f"its signatures claim keyid(s) {shown}"


def verify_statement_envelope(envelope: Envelope, trusted: TrustedKeys) -> tuple[VerifiedEnvelope, Statement]:
    """Verify an in-toto envelope, then parse its statement and apply the per-type threshold.

    The signature check runs first with the smallest threshold so that an unsigned payload is
    never parsed; the predicate's own threshold is then enforced on the same signers.
    """
    if envelope.payload_type != IN_TOTO_PAYLOAD_TYPE:
        raise UnsupportedPayloadTypeError(
            f"payload type {envelope.payload_type!r} is not an in-toto statement ({IN_TOTO_PAYLOAD_TYPE})"
        )
    verified = verify_envelope(envelope, trusted, threshold=min([trusted.threshold, *trusted.thresholds.values()]))
    try:
        statement = parse_statement(verified.payload, what="signed statement")
    except DocumentError as e:
        raise MalformedInputError(str(e), hint="the signer produced an invalid statement; ask them to re-issue it") from e
    need = trusted.threshold_for(statement.predicate_type)
    if len(verified.signers) < need:
        raise ThresholdNotMetError(
            f"{len(verified.signers)} distinct trusted key(s) signed this {statement.predicate_type} "
            f"statement; {need} are required"
        )
    return verified, statement
