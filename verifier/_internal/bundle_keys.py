"""Keys and signatures in Sigstore bundles: the public keys a bundle or a trusted root holds,
the hashes they sign with, and one ``verifies`` for every scheme (Ed25519, ECDSA, RSA PKCS#1 v1.5
and PSS), which answers a bool so that callers can try candidates and raise their own error.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed

from .bundle_wire import Artifact, MessageSignature
from .errors import DigestMismatchError, MalformedInputError

PublicKey = ec.EllipticCurvePublicKey | ed25519.Ed25519PublicKey | rsa.RSAPublicKey


def load_public_key_pem(pem: bytes, what: str) -> PublicKey:
    """The PEM SubjectPublicKeyInfo ``pem`` (named ``what`` in errors) as an ECDSA, Ed25519 or RSA key."""
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


def spki(key: PublicKey) -> bytes:
    """The key's DER SubjectPublicKeyInfo: what logs and bundles compare keys by."""
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


# --- signatures ---------------------------------------------------------------------------------

DIGEST_NAMES = {"SHA2_256": "sha256", "SHA2_384": "sha384", "SHA2_512": "sha512"}
HASHES: dict[str, hashes.HashAlgorithm] = {
    "sha256": hashes.SHA256(),
    "sha384": hashes.SHA384(),
    "sha512": hashes.SHA512(),
}


def default_hash(key: PublicKey) -> hashes.HashAlgorithm:
    """The hash a key signs with unless told otherwise: SHA-384 for P-384, SHA-512 for P-521, else SHA-256."""
    if isinstance(key, ec.EllipticCurvePublicKey):
        return {384: hashes.SHA384(), 521: hashes.SHA512()}.get(key.curve.key_size, hashes.SHA256())
    return hashes.SHA256()


def verifies(
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
            digest_hash = hash_ or default_hash(key)
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


# --- who signed, and what --------------------------------------------------------------------------


@dataclass(frozen=True)
class Signer:
    """Who the bundle says signed: a Fulcio certificate, or a managed key."""

    key: PublicKey
    certificate: x509.Certificate | None

    @property
    def spki(self) -> bytes:
        return spki(self.key)


def check_message_digest(content: MessageSignature, artifact: Artifact) -> None:
    """The digest a message signature says it signed must be the artifact's (when it gives one)."""
    if content.digest is None:
        return
    name = DIGEST_NAMES.get(content.digest_algorithm or "")
    if name is None:
        raise MalformedInputError(f"the bundle's message digest uses unknown algorithm {content.digest_algorithm!r}")
    actual = artifact.digest(name)
    if actual != content.digest:
        raise DigestMismatchError(
            f"the artifact's {name} is {actual.hex()}, but the bundle signs {content.digest.hex()}"
        )


def candidate_hashes(key: PublicKey) -> list[hashes.HashAlgorithm | None]:
    """The hashes a signature by ``key`` may be over, in the order to try them (None: Ed25519)."""
    # The key's natural hash first (P-384 signs SHA-384), then SHA-256, which some signers use
    # with every curve.
    if isinstance(key, ed25519.Ed25519PublicKey):
        return [None]
    natural = default_hash(key)
    return [natural] if isinstance(natural, hashes.SHA256) else [natural, hashes.SHA256()]
