"""Signing keys: Ed25519, ECDSA P-256 and ECDSA P-384; PEM files, key ids, the trusted-keys file.

Key types (``KeyType``) and how each signs (one table, ``_ECDSA``, and ``_sign``/``verify_signature``):

- ``ed25519``: Ed25519 (RFC 8032) over the message itself; a 64-byte signature.
- ``p256``: ECDSA over secp256r1 with SHA-256 (securesystemslib's ``ecdsa-sha2-nistp256``).
- ``p384``: ECDSA over secp384r1 with SHA-384 (``ecdsa-sha2-nistp384``).

ECDSA signatures are DER-encoded (X9.62 ``Ecdsa-Sig-Value``), as DSSE, securesystemslib,
Sigstore and ``model_signing`` produce and expect. Any other key (another curve, RSA, DSA,
Ed448) is refused with an ``UnsupportedKeyTypeError`` (a ``KeyFileError``) naming it and the
supported types.

The key id convention: ``keyid`` is the sha256 (hex) of the *raw* public key,

- Ed25519: the 32 raw public key bytes (so every existing artifact keeps its keyid);
- ECDSA: the X9.62 uncompressed point ``0x04 || X || Y`` (65 bytes for P-256, 97 for P-384),

so the same key has the same id everywhere, whatever PEM wrapping it travels in. A keyid is only
a hint when verifying: every trusted key is tried. (securesystemslib's default keyid, sha256 of
its canonical key JSON, is another number; docs/trusted-keys.md says how the two meet.)

Keys that sign C2SP signed notes (the registry's checkpoints) are Ed25519 only, as the note
format defines them: ``require_ed25519`` narrows a key for those uses, with a clear refusal.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NewType, get_args

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# write_atomic is the one single-file atomic writer (kvgraft.schemas); the verifier re-exports it.
from kvgraft.schemas import DocumentError, parse_json, write_atomic

from .errors import BadSignatureError, KeyFileError, UnsupportedKeyTypeError
from .files import read_input

KeyId = NewType("KeyId", str)

#: A public key kvgraft signs or verifies with: Ed25519, or ECDSA on P-256 or P-384 (checked on load).
PublicKey = Ed25519PublicKey | ec.EllipticCurvePublicKey
#: A private key kvgraft signs with (same types as ``PublicKey``).
PrivateKey = Ed25519PrivateKey | ec.EllipticCurvePrivateKey

#: The key types ``kvgraft keys generate --type`` makes and every loader accepts.
KeyType = Literal["ed25519", "p256", "p384"]
KEY_TYPES: tuple[KeyType, ...] = get_args(KeyType)

#: Refuse key files larger than this before reading them: a PEM key is a few hundred bytes.
_MAX_KEY_FILE = 64 * 1024
_MAX_TRUST_FILE = 16 * 1024 * 1024


@dataclass(frozen=True)
class _Ecdsa:
    key_type: KeyType
    label: str
    curve: type[ec.EllipticCurve]
    hash: type[hashes.HashAlgorithm]


#: The ECDSA curves kvgraft accepts, each with the hash it signs with (the securesystemslib schemes).
_ECDSA = (
    _Ecdsa("p256", "ECDSA P-256", ec.SECP256R1, hashes.SHA256),
    _Ecdsa("p384", "ECDSA P-384", ec.SECP384R1, hashes.SHA384),
)
_ECDSA_BY_TYPE = {e.key_type: e for e in _ECDSA}
_ECDSA_BY_CURVE = {e.curve().name: e for e in _ECDSA}
_SUPPORTED = "Ed25519, ECDSA P-256 (secp256r1) or ECDSA P-384 (secp384r1)"
_GENERATE_HINT = "make one with 'kvgraft keys generate --type {ed25519,p256,p384}'"


def _unsupported(source: str, key: object) -> UnsupportedKeyTypeError:
    if isinstance(key, (ec.EllipticCurvePublicKey, ec.EllipticCurvePrivateKey)):
        what = f"an ECDSA key on curve {key.curve.name}"
    else:
        # cryptography's class names: RSAPublicKey, DSAPrivateKey, Ed448PublicKey, X25519PrivateKey...
        name = type(key).__name__.removeprefix("_").removesuffix("PublicKey").removesuffix("PrivateKey") or "another"
        what = f"an {name} key" if name[0] in "AEFHILMNORSX" else f"a {name} key"
    return UnsupportedKeyTypeError(f"{source} holds {what}; supported keys are {_SUPPORTED}", hint=_GENERATE_HINT)


def _ecdsa_params(key: ec.EllipticCurvePublicKey | ec.EllipticCurvePrivateKey, source: str = "the key") -> _Ecdsa:
    """The table row of an ECDSA key's curve; a curve outside the table is refused."""
    params = _ECDSA_BY_CURVE.get(key.curve.name)
    if params is None:
        raise _unsupported(source, key)
    return params


def key_type_of(key: PublicKey | PrivateKey) -> KeyType:
    """``"ed25519"``, ``"p256"`` or ``"p384"``; a key of any other type or curve is an ``UnsupportedKeyTypeError``."""
    if isinstance(key, (Ed25519PublicKey, Ed25519PrivateKey)):
        return "ed25519"
    if isinstance(key, (ec.EllipticCurvePublicKey, ec.EllipticCurvePrivateKey)):
        return _ecdsa_params(key).key_type
    raise _unsupported("the key", key)


def key_type_label(key_type: KeyType) -> str:
    """The human name of a key type: ``Ed25519``, ``ECDSA P-256``, ``ECDSA P-384``."""
    return "Ed25519" if key_type == "ed25519" else _ECDSA_BY_TYPE[key_type].label


def raw_public_key(public_key: PublicKey) -> bytes:
    """The bytes the key id hashes: Ed25519's 32 raw bytes, ECDSA's uncompressed point 0x04||X||Y."""
    if isinstance(public_key, Ed25519PublicKey):
        return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    _ecdsa_params(public_key)
    return public_key.public_bytes(serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint)


def keyid_of(public_key: PublicKey) -> KeyId:
    """The key id: sha256 hex of ``raw_public_key`` (see the module docstring)."""
    return KeyId(hashlib.sha256(raw_public_key(public_key)).hexdigest())


def public_key_pem(public_key: PublicKey) -> bytes:
    """The SubjectPublicKeyInfo PEM of a public key."""
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def generate_private_key(key_type: KeyType = "ed25519") -> PrivateKey:
    """A fresh private key of ``key_type`` (default Ed25519)."""
    if key_type == "ed25519":
        return Ed25519PrivateKey.generate()
    if key_type not in _ECDSA_BY_TYPE:
        raise UnsupportedKeyTypeError(f"unknown key type {key_type!r}", hint=f"use one of {', '.join(KEY_TYPES)}")
    return ec.generate_private_key(_ECDSA_BY_TYPE[key_type].curve())


def require_ed25519(public_key: PublicKey, what: str) -> Ed25519PublicKey:
    """``public_key`` if it is Ed25519, else an ``UnsupportedKeyTypeError`` (a ``KeyFileError``):
    for C2SP signed notes (checkpoints), whose format defines Ed25519 keys only."""
    if isinstance(public_key, Ed25519PublicKey):
        return public_key
    raise UnsupportedKeyTypeError(
        f"{what} is an {key_type_label(key_type_of(public_key))} key; C2SP signed notes (a registry's "
        "checkpoints) are signed with Ed25519 keys only",
        hint="use an Ed25519 key here ('kvgraft keys generate --type ed25519'); ECDSA keys sign artifacts and records",
    )


def _sign(key: PrivateKey, message: bytes) -> bytes:
    if isinstance(key, Ed25519PrivateKey):
        return key.sign(message)
    return key.sign(message, ec.ECDSA(_ecdsa_params(key).hash()))


def verify_signature(public_key: PublicKey, signature: bytes, message: bytes) -> None:
    """Verify ``signature`` over ``message``: Ed25519, or DER-encoded ECDSA with the curve's hash.

    Raises ``BadSignatureError`` when it does not verify (``UnsupportedKeyTypeError`` for an
    unsupported key). The one place a signature is checked by key type.
    """
    try:
        if isinstance(public_key, Ed25519PublicKey):
            public_key.verify(signature, message)
        else:
            public_key.verify(signature, message, ec.ECDSA(_ecdsa_params(public_key).hash()))
    except InvalidSignature as e:
        raise BadSignatureError(
            f"the {key_type_label(key_type_of(public_key))} signature does not verify with key "
            f"{keyid_of(public_key)[:16]}... over these bytes"
        ) from e


def read_limited(path: Path, limit: int, what: str) -> bytes:
    """Read a small key or trust file whole; failures are ``KeyFileError``."""
    return read_input(path, what, limit=limit, error=KeyFileError)


def save_private_key(key: PrivateKey, path: Path, passphrase: bytes | None = None) -> None:
    """Write ``key`` as PKCS#8 PEM (encrypted when a passphrase is given), mode 0600.

    Refuses to overwrite an existing file: losing a signing key is not undoable.
    """
    key_type_of(key)
    if path.exists():
        raise KeyFileError(
            f"{path} already exists", hint="choose another path, or remove the old key yourself if you mean to"
        )
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
    )
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    write_atomic(path, pem, 0o600)


def save_public_key(public_key: PublicKey, path: Path) -> None:
    """Write the public key as SubjectPublicKeyInfo PEM, mode 0644."""
    key_type_of(public_key)
    write_atomic(path, public_key_pem(public_key), 0o644)


def load_private_key(path: Path, passphrase: bytes | None = None) -> PrivateKey:
    """Read an Ed25519, P-256 or P-384 private key from PEM; raise ``KeyFileError`` naming the fault."""
    data = read_limited(path, _MAX_KEY_FILE, "private key file")
    try:
        key = serialization.load_pem_private_key(data, password=passphrase)
    except TypeError as e:
        # cryptography raises TypeError for a missing or unexpected passphrase.
        needs = "is encrypted: give its passphrase" if passphrase is None else "is not encrypted: give no passphrase"
        raise KeyFileError(f"private key file {path} {needs}") from e
    except ValueError as e:
        raise KeyFileError(
            f"private key file {path} cannot be loaded: not a PEM private key, or the passphrase is wrong"
        ) from e
    except UnsupportedAlgorithm as e:
        raise UnsupportedKeyTypeError(
            f"private key file {path} uses an unsupported algorithm; supported keys are {_SUPPORTED}", hint=_GENERATE_HINT
        ) from e
    if isinstance(key, Ed25519PrivateKey):
        return key
    if isinstance(key, ec.EllipticCurvePrivateKey):
        _ecdsa_params(key, f"private key file {path}")
        return key
    raise _unsupported(f"private key file {path}", key)


def parse_public_key(pem: bytes, *, source: str = "public key") -> PublicKey:
    """Parse a SubjectPublicKeyInfo PEM holding an Ed25519, P-256 or P-384 key."""
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, UnsupportedAlgorithm) as e:
        raise KeyFileError(f"{source} is not a PEM public key") from e
    if isinstance(key, Ed25519PublicKey):
        return key
    if isinstance(key, ec.EllipticCurvePublicKey):
        _ecdsa_params(key, source)
        return key
    raise _unsupported(source, key)


def load_public_key(path: Path) -> PublicKey:
    """Read an Ed25519, P-256 or P-384 public key from a PEM file (a private key file is refused)."""
    return parse_public_key(read_limited(path, _MAX_KEY_FILE, "public key file"), source=f"public key file {path}")


class SigningKey:
    """A private key held for the span of a ``with`` block; it signs and then forgets the key.

    Use ``open_signing_key(path)`` rather than constructing it directly. ``sign`` returns an
    Ed25519 signature, or a DER-encoded ECDSA one (SHA-256 for P-256, SHA-384 for P-384).
    """

    def __init__(self, key: PrivateKey) -> None:
        self.key_type: KeyType = key_type_of(key)
        self._key: PrivateKey | None = key
        self.public_key: PublicKey = key.public_key()
        self.keyid: KeyId = keyid_of(self.public_key)

    def sign(self, message: bytes) -> bytes:
        """Sign ``message``; only valid inside the ``with`` block that opened the key."""
        if self._key is None:
            raise KeyFileError("the signing key was used after its 'with' block closed", hint="sign inside the block")
        return _sign(self._key, message)

    def close(self) -> None:
        """Drop the private key."""
        self._key = None


@contextlib.contextmanager
def open_signing_key(path: Path, passphrase: bytes | None = None) -> Iterator[SigningKey]:
    """Load a private key for signing; it is dropped when the block ends."""
    key = SigningKey(load_private_key(path, passphrase))
    try:
        yield key
    finally:
        key.close()


@contextlib.contextmanager
def ephemeral_signing_key(key: PrivateKey) -> Iterator[SigningKey]:
    """Hold an in-memory private key for signing (tests, freshly generated keys)."""
    signing = SigningKey(key)
    try:
        yield signing
    finally:
        signing.close()


# --- the trusted-keys file -----------------------------------------------------------------


class _TrustedKeyEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(min_length=1)
    public_key_pem: str
    keyid: str | None = None


class _TrustedKeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    version: int = Field(ge=1, le=1)
    keys: list[_TrustedKeyEntry] = Field(min_length=1)
    threshold: int = Field(default=1, ge=1)
    thresholds: dict[str, int] = Field(default_factory=dict)
    payload_types: list[str] = Field(default_factory=lambda: ["application/vnd.in-toto+json"], min_length=1)


@dataclass(frozen=True)
class TrustedKey:
    """A public key the verifier trusts, with a human name."""

    name: str
    keyid: KeyId
    public_key: PublicKey


@dataclass(frozen=True)
class TrustedKeys:
    """The keys an envelope may be signed by, how many distinct ones must sign, and which
    payload types are accepted.

    ``thresholds`` overrides ``threshold`` per predicateType (e.g. two signers for evaluations).
    """

    keys: tuple[TrustedKey, ...]
    threshold: int = 1
    thresholds: dict[str, int] = field(default_factory=dict)
    payload_types: tuple[str, ...] = ("application/vnd.in-toto+json",)

    def threshold_for(self, predicate_type: str | None) -> int:
        """The threshold that applies to a statement of ``predicate_type``."""
        if predicate_type is not None and predicate_type in self.thresholds:
            return self.thresholds[predicate_type]
        return self.threshold

    def to_json(self) -> dict[str, object]:
        """The trusted-keys file document for these keys."""
        return {
            "version": 1,
            "keys": [
                {"name": k.name, "keyid": k.keyid, "public_key_pem": public_key_pem(k.public_key).decode("ascii")}
                for k in self.keys
            ],
            "threshold": self.threshold,
            "thresholds": dict(self.thresholds),
            "payload_types": list(self.payload_types),
        }


def trusted_key(name: str, public_key: PublicKey) -> TrustedKey:
    """A ``TrustedKey`` with its key id computed."""
    return TrustedKey(name=name, keyid=keyid_of(public_key), public_key=public_key)


def parse_trusted_keys(data: bytes, *, source: str = "trusted-keys file") -> TrustedKeys:
    """Parse a trusted-keys document (JSON, version 1); see docs/trusted-keys.md."""
    try:
        doc = _TrustedKeysFile.model_validate(parse_json(data, what=source))
    except DocumentError as e:
        raise KeyFileError(str(e), hint="a trusted-keys file is JSON: see docs/trusted-keys.md") from e
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        raise KeyFileError(f"{source}: {where}: {err['msg']}", hint="see docs/trusted-keys.md for the format") from e
    keys: list[TrustedKey] = []
    for entry in doc.keys:
        key = trusted_key(entry.name, parse_public_key(entry.public_key_pem.encode("utf-8"), source=f"{source}: key {entry.name!r}"))
        if entry.keyid is not None and entry.keyid != key.keyid:
            raise KeyFileError(
                f"{source}: key {entry.name!r} says keyid {entry.keyid} but its public key has keyid {key.keyid}",
                hint="the keyid is sha256 of the raw public key (see docs/trusted-keys.md); fix or drop the keyid field",
            )
        keys.append(key)
    if len({k.keyid for k in keys}) != len(keys):
        raise KeyFileError(f"{source} lists the same public key twice", hint="list each key once")
    for where, value in [("threshold", doc.threshold), *doc.thresholds.items()]:
        if value < 1 or value > len(keys):
            raise KeyFileError(
                f"{source}: threshold {value} for {where} cannot be met by {len(keys)} key(s)",
                hint="a threshold is between 1 and the number of keys",
            )
    return TrustedKeys(tuple(keys), doc.threshold, dict(doc.thresholds), tuple(doc.payload_types))


#: How to get a trusted-keys file: it lists public keys, and needs no private key or passphrase.
TRUSTED_KEYS_HINT = (
    "a trusted-keys file lists the public keys you trust: get it from the publishers, or write one from "
    "their public keys with 'kvgraft keys trust --file FILE --name NAME --public-key KEY.pub' (docs/trusted-keys.md)"
)


def load_trusted_keys(path: Path) -> TrustedKeys:
    """Read a trusted-keys file; ``KeyFileError`` (hinting how to get one) when it cannot be read."""
    try:
        data = read_limited(path, _MAX_TRUST_FILE, "trusted-keys file")
    except KeyFileError as e:
        # KeyFileError's own hint is about private keys and passphrases: not what is missing here.
        raise KeyFileError(e.message, hint=TRUSTED_KEYS_HINT) from e
    return parse_trusted_keys(data, source=f"trusted-keys file {path}")
