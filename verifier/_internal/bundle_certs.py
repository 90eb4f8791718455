"""Certificate bundles: a Fulcio certificate names the signer, and sigstore-python's ``Verifier``
is the authority for the certificate chain, the SCT, the signed times and the identity policy.

Before it runs, ``verify_certificate_bundle`` repeats the cheap checks itself (identity, artifact
digest, signature, log entries) so that each failure is reported as the right error class with a
one-line message, and it adds the checks sigstore-python 4.5.1 skips (a bundle that carries its
own root certificate; the bodies of log entry kinds it cannot read). What sigstore-python still
rejects is mapped from its prose to our classes (``_from_sigstore``).

Where sigstore-python 4.5.1 disagrees with the Sigstore client spec and the sigstore-conformance
suite (see docs/sigstore-conformance.md), ``SigstoreVerifier`` overrides two of its private
methods; the sigstore pin (==4.5.1) in pyproject.toml keeps those overrides valid.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
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

from .bundle_keys import Signer, check_message_digest, verifies
from .bundle_logs import TrustedLog, verify_log_entry
from .bundle_wire import Artifact, BundleParts, MessageSignature
from .errors import (
    BadSignatureError,
    DigestMismatchError,
    IdentityMismatchError,
    LogEntryError,
    MalformedInputError,
    UntrustedRootError,
    VerificationError,
)


class SigstoreVerifier(Verifier):
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


def verify_certificate_bundle(
    raw: bytes,
    parts: BundleParts,
    artifact: Artifact,
    identity: str,
    issuer: str,
    root: tuple[Path, dict[str, object]],
    logs: tuple[TrustedLog, ...],
) -> str:
    """Verify a certificate bundle (``raw``, parsed as ``parts``) over ``artifact``: signed by
    ``identity`` as certified by ``issuer``, against the trusted root (its path and parsed
    document) and its ``logs``. Returns the identity; raises the first check that failed.
    """
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

    policy = Identity(identity=identity, issuer=issuer)
    try:
        policy.verify(leaf)
    except (SigstoreError, ValueError, x509.ExtensionNotFound) as e:
        raise IdentityMismatchError(
            f"the signing certificate is for {describe_identity(leaf)}, not {identity} (issuer {issuer})"
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
    signer = Signer(signing_key, leaf)
    content = parts.content
    if isinstance(content, MessageSignature):
        check_message_digest(content, artifact)
        # sigstore-python signs and verifies the sha256 digest, whatever the key size.
        if not verifies(signing_key, content.signature, prehashed=(hashes.SHA256(), artifact.sha256)):
            raise BadSignatureError(
                "the bundle's signature does not verify over the artifact with the signing certificate's key"
            )
    elif not verifies(signing_key, content.signature, data=content.pae(), hash_=hashes.SHA256()):
        raise BadSignatureError("the DSSE envelope's signature does not verify with the signing certificate's key")

    for entry in parts.entries:
        verify_log_entry(entry, logs, parts=parts, artifact=artifact, signer=signer)

    trusted = _sigstore_trusted_root(*root)
    try:
        verifier = SigstoreVerifier(trusted_root=trusted)
        if isinstance(content, MessageSignature):
            hashed = Hashed(algorithm=HashAlgorithm.SHA2_256, digest=artifact.sha256)
            verifier.verify_artifact(hashed, bundle, policy)
        else:
            kind = bundle.log_entry._inner.kind_version
            if (kind.kind, kind.version) in {("dsse", "0.0.1"), ("hashedrekord", "0.0.2")}:
                verifier.verify_dsse(bundle, policy)
            else:
                # sigstore-python 4.5.1 has no body check for these kinds (hashedrekord/0.0.1
                # over the PAE, intoto/0.0.2); verify_log_entry's body check above did it. The certificate,
                # times, SCT, policy and log proofs are still sigstore-python's.
                verifier._verify_common_signing_cert(bundle, policy)
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
    return identity


def _sigstore_trusted_root(path: Path, document: dict[str, object]) -> TrustedRoot:
    # ``document`` is the file as read_json parsed it: a client trust config wraps the root.
    try:
        text = path.read_text(encoding="utf-8")
        if "trustedRoot" in document:
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


def describe_identity(certificate: x509.Certificate) -> str:
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
