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

    default_hint = "pass a PEM key written by 'kvgraft keys generate' (Ed25519, P-256 or P-384) and its passphrase"


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


class TileError(LogProofError):
    """A c2sp.org/tlog-tiles log does not verify: a tile or entry bundle is missing, of the wrong
    size, malformed, or does not hash to what the signed checkpoint commits to."""

    default_hint = (
        "the tile or bundle named was altered, truncated, or belongs to another log or tree size; "
        "fetch it again from the log, or export the tiles again ('kvgraft tiles export')"
    )


class ClaimMismatchError(VerificationError):
    """A figure in a record differs from the one recomputed from its files."""

    default_hint = "the record's claims were altered, or the producer computed them wrongly; do not trust them"


class CosignatureError(LogProofError):
    """A witness cosignature (c2sp.org/tlog-cosignature) by a key the verifier knows is malformed
    or does not verify over the checkpoint: the note was altered after it was cosigned."""

    default_hint = "the checkpoint or its cosignature line was altered; fetch the checkpoint again from the registry"


class WitnessQuorumError(LogProofError):
    """A checkpoint lacks the valid witness cosignatures a witness policy's quorum requires."""

    default_hint = (
        "wait for the witnesses to cosign a newer checkpoint and fetch it again; if they never do, the "
        "witnesses refused it (a fork or a rollback) or the policy names other witnesses than the log uses"
    )


class WitnessPolicyError(MalformedInputError):
    """A witness policy file (c2sp.org/tlog-policy) cannot be read or parsed."""

    default_hint = "write the policy as docs/witness.md describes: witness, group and quorum lines"


class ModelSignatureFormatError(MalformedInputError):
    """A ``model.sig`` is not a key-signed OpenSSF model signing v1.0 signature: not a Sigstore
    bundle v0.3 with a public-key hint (or 1.0.x's key) and one DSSE signature, or its signed statement is not a
    ``https://model_signing/signature/v1.0`` manifest of files hashed with sha256."""

    default_hint = (
        "pass the model.sig that 'kvgraft oms sign' or 'model_signing sign key' (1.x, file serialization, "
        "sha256) wrote, unmodified"
    )


class ModelDirectoryError(MalformedInputError):
    """A directory cannot be signed or checked file by file as model_signing does: it holds a
    symbolic link or a special file, a name that is not UTF-8, more entries or deeper folders
    than the limits, or a file that cannot be read."""

    default_hint = "sign or verify a directory of regular files (copy linked files in; remove sockets and pipes)"


class ModelManifestMismatchError(SubjectMismatchError):
    """The directory's files are not the ones its ``model.sig`` signs: one is missing, one is
    extra, or one's sha256 differs."""

    default_hint = "the directory was changed after it was signed; fetch it again from its source, or re-sign it"


class UnsupportedKeyTypeError(KeyFileError):
    """A key of a type this kind of signature cannot use: a curve or algorithm kvgraft does not sign
    with (keys.py), an ECDSA key where C2SP notes need Ed25519, an Ed25519 key for model_signing
    (ECDSA only)."""

    default_hint = "generate a P-256 key: kvgraft keys generate --type p256 --out KEY"
