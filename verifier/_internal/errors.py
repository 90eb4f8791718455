"""The verifier's exceptions: one base class, one subclass per way verification can fail.

Every error carries a ``message`` (what happened) and a ``hint`` (what to do), in pip's style,
and renders as one line so that ``kvgraft-verify`` can print it without a traceback.
"""

from __future__ import annotations

from kvgraft.schemas import KvgraftError


class VerificationError(KvgraftError):
    """Base class of every failure the verifier reports.

    Verification never returns a bool: it returns what was verified or raises one of these.
    """

    #: What the user can do about it; subclasses give a default, callers may override.
    default_hint: str | None = "check the inputs named in the message"


class MalformedInputError(VerificationError):
    """An input could not be read or parsed: not JSON, wrong types, bad base64, truncated."""

    default_hint = "pass the file the producer wrote, unmodified"


class UnsupportedPayloadTypeError(VerificationError):
    """A DSSE envelope's payloadType is not one the caller accepts."""

    default_hint = "only application/vnd.in-toto+json statements are accepted"


class UnknownKeyError(VerificationError):
    """No signature was made by a key the verifier trusts."""

    default_hint = "add the signer's public key to the trusted-keys file, if you trust it"


class BadSignatureError(VerificationError):
    """A signature does not verify over the signed bytes."""

    default_hint = "the signed content or the signature was altered; fetch it again from its source"


class ThresholdNotMetError(VerificationError):
    """Fewer distinct trusted keys signed than the threshold requires."""

    default_hint = "collect signatures from more distinct trusted keys, or lower the threshold"


class DigestMismatchError(VerificationError):
    """Bytes on disk (or a claimed digest) do not match the digest they were signed under."""

    default_hint = "the file was altered or replaced; fetch it again from its source"


class SubjectMismatchError(DigestMismatchError):
    """The files on disk are not exactly a statement's subjects (missing, extra, or different)."""

    default_hint = "the directory must hold exactly the files the statement names, unmodified"


class TokenDigestMismatchError(DigestMismatchError):
    """A KV artifact's ``tokens.digest`` is not the sha256 of its token ids' canonical JSON."""

    default_hint = "the signer produced an inconsistent statement; do not graft it, ask them to re-capture it"


class ChainKeyMismatchError(DigestMismatchError):
    """A KV artifact's ``chain_key`` does not follow from its parent's (or, for a root, from nothing),
    or the parent given is not the one it names."""

    default_hint = "the artifact does not continue the parent it names; do not graft it onto that parent"


class UntrustedRootError(VerificationError):
    """A Sigstore bundle does not chain to the trusted root (or the root is unusable)."""

    default_hint = "pass the trusted root the signer used (--trusted-root FILE, or --staging)"


class IdentityMismatchError(VerificationError):
    """A Sigstore certificate names a different identity or issuer than required."""

    default_hint = "check --certificate-identity and --certificate-oidc-issuer"


class KeyFileError(MalformedInputError):
    """A key or trusted-keys file cannot be used: unreadable, wrong format, wrong passphrase."""

    default_hint = "pass an Ed25519 PEM key written by 'kvgraft keys generate' (and its passphrase)"


class LogEntryError(VerificationError):
    """A bundle's transparency log entry is malformed, unproven, or inconsistent with the bundle.

    Covers the inclusion proof, the signed checkpoint, the signed entry timestamp, and the entry
    body's agreement with the signature, artifact digest and signer (CVE-2022-36056-style swaps).
    """

    default_hint = (
        "the bundle's log entry was altered or belongs to another signature; fetch the bundle again from its source"
    )


class LogProofError(VerificationError):
    """A kvgraft registry's transparency-log evidence does not verify.

    Covers RFC 9162 inclusion and consistency proofs and the registry's C2SP signed checkpoints:
    a wrong root, a proof of the wrong length, an index outside the tree, a missing or bad
    checkpoint signature. (Sigstore bundle log entries use ``LogEntryError``.)
    """

    default_hint = (
        "the proof, checkpoint or entry was altered, or they come from different logs or tree sizes; "
        "fetch them again from the registry"
    )


class ClaimMismatchError(VerificationError):
    """A figure in a record differs from the one recomputed from its files."""

    default_hint = "the record's claims were altered, or the producer computed them wrongly; do not trust them"
