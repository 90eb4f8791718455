"""Ed25519 keys: generate, save and load PEM, key ids, and the trusted-keys file.

``keyid`` is the sha256 (hex) of the raw 32-byte public key, so the same key has the same id
everywhere, whatever PEM wrapping it travels in.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NewType

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

# write_atomic is the one single-file atomic writer (kvgraft.schemas); the verifier re-exports it.
from kvgraft.schemas import DocumentError, parse_json, write_atomic

from .errors import KeyFileError
from .files import read_input

KeyId = NewType("KeyId", str)

#: Refuse key files larger than this before reading them: a PEM key is a few hundred bytes.
_MAX_KEY_FILE = 64 * 1024
_MAX_TRUST_FILE = 16 * 1024 * 1024


def keyid_of(public_key: Ed25519PublicKey) -> KeyId:
    """The key id: sha256 hex of the raw public key bytes."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return KeyId(hashlib.sha256(raw).hexdigest())


def public_key_pem(public_key: Ed25519PublicKey) -> bytes:
    """The SubjectPublicKeyInfo PEM of a public key."""
    return public_key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def generate_private_key() -> Ed25519PrivateKey:
    """A fresh Ed25519 private key."""
    return Ed25519PrivateKey.generate()


def read_limited(path: Path, limit: int, what: str) -> bytes:
    """Read a small key or trust file whole; failures are ``KeyFileError``."""
    return read_input(path, what, limit=limit, error=KeyFileError)


def save_private_key(key: Ed25519PrivateKey, path: Path, passphrase: bytes | None = None) -> None:
    """Write ``key`` as PKCS#8 PEM (encrypted when a passphrase is given), mode 0600.

    Refuses to overwrite an existing file: losing a signing key is not undoable.
    """
    if path.exists():
        raise KeyFileError(
            f"{path} already exists", hint="choose another path, or remove the old key yourself if you mean to"
        )
    encryption: serialization.KeySerializationEncryption = (
        serialization.BestAvailableEncryption(passphrase) if passphrase else serialization.NoEncryption()
    )
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)
    write_atomic(path, pem, 0o600)


def save_public_key(public_key: Ed25519PublicKey, path: Path) -> None:
    """Write the public key as SubjectPublicKeyInfo PEM, mode 0644."""
    write_atomic(path, public_key_pem(public_key), 0o644)


def load_private_key(path: Path, passphrase: bytes | None = None) -> Ed25519PrivateKey:
    """Read an Ed25519 private key from PEM; raise ``KeyFileError`` naming the fault."""
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
        raise KeyFileError(f"private key file {path} uses an unsupported algorithm") from e
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"private key file {path} holds a {type(key).__name__}, not an Ed25519 key")
    return key


def parse_public_key(pem: bytes, *, source: str = "public key") -> Ed25519PublicKey:
    """Parse a SubjectPublicKeyInfo PEM holding an Ed25519 key."""
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, UnsupportedAlgorithm) as e:
        raise KeyFileError(f"{source} is not a PEM public key") from e
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{source} holds a {type(key).__name__}, not an Ed25519 key")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    """Read an Ed25519 public key from a PEM file (a private key file is refused)."""
    return parse_public_key(read_limited(path, _MAX_KEY_FILE, "public key file"), source=f"public key file {path}")


class SigningKey:
    """A private key held for the span of a ``with`` block; it signs and then forgets the key.

    Use ``open_signing_key(path)`` rather than constructing it directly.
    """

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key: Ed25519PrivateKey | None = key
        self.keyid: KeyId = keyid_of(key.public_key())
        self.public_key: Ed25519PublicKey = key.public_key()

    def sign(self, message: bytes) -> bytes:
        """Sign ``message``; only valid inside the ``with`` block that opened the key."""
        if self._key is None:
            raise KeyFileError("the signing key was used after its 'with' block closed", hint="sign inside the block")
        return self._key.sign(message)

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
def ephemeral_signing_key(key: Ed25519PrivateKey) -> Iterator[SigningKey]:
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
    public_key: Ed25519PublicKey


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


def trusted_key(name: str, public_key: Ed25519PublicKey) -> TrustedKey:
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
                hint="the keyid is sha256 of the raw public key; fix or drop the keyid field",
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


def load_trusted_keys(path: Path) -> TrustedKeys:
    """Read a trusted-keys file."""
    return parse_trusted_keys(read_limited(path, _MAX_TRUST_FILE, "trusted-keys file"), source=f"trusted-keys file {path}")
