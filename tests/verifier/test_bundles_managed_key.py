"""Sigstore bundle verification, offline: managed-key bundles built here with freshly generated keys
and a one-off transparency log we sign ourselves."""

from __future__ import annotations

import base64
import copy
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import Prehashed

from kvgraft.verifier._internal.bundles import (
    CertificateIdentity,
    ManagedKey,
    VerifiedBundle,
    shipped_trusted_root,
    verify_bundle,
)
from kvgraft.verifier._internal.errors import (
    BadSignatureError,
    DigestMismatchError,
    IdentityMismatchError,
    LogEntryError,
    MalformedInputError,
    UnsupportedPayloadTypeError,
    UntrustedRootError,
)

from .bundle_helpers import (
    ENTRY,
    GITHUB_OAUTH,
    MutateFn,
    b64,
    flip_b64,
    set_at,
    write,
)

# --------------------------------------------------------------------------------------------
# Managed-key bundles, built here: fresh keys, and a small transparency log we sign ourselves
# --------------------------------------------------------------------------------------------

PrivateKey = ec.EllipticCurvePrivateKey | ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey


def pem_of(key: PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def der_of(key: PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)


def sign(key: PrivateKey, data: bytes, *, prehashed: bool = False, hash_: hashes.HashAlgorithm | None = None) -> bytes:
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    algorithm: Any = hash_ or hashes.SHA256()
    if prehashed:
        algorithm = Prehashed(algorithm)
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PKCS1v15(), algorithm)
    return key.sign(data, ec.ECDSA(algorithm))


def pae(payload_type: str, payload: bytes) -> bytes:
    return b"DSSEv1 %d %s %d %s" % (len(payload_type), payload_type.encode(), len(payload), payload)


def statement(digest_hex: str, statement_type: str | None = "https://in-toto.io/Statement/v1") -> bytes:
    body: dict[str, Any] = {
        "subject": [{"name": "artifact.bin", "digest": {"sha256": digest_hex}}],
        "predicateType": "https://example.com/test",
        "predicate": {},
    }
    if statement_type is not None:
        body["_type"] = statement_type
    return rfc8785.dumps(body)


def leaf_hash(data: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def mth(leaves: list[bytes]) -> bytes:
    """RFC 6962 Merkle tree hash over leaf hashes."""
    if len(leaves) == 1:
        return leaves[0]
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    return node_hash(mth(leaves[:k]), mth(leaves[k:]))


def audit_path(m: int, leaves: list[bytes]) -> list[bytes]:
    """RFC 6962 PATH(m, D[n]), bottom first."""
    if len(leaves) == 1:
        return []
    k = 1 << ((len(leaves) - 1).bit_length() - 1)
    if m < k:
        return audit_path(m, leaves[:k]) + [mth(leaves[k:])]
    return audit_path(m - k, leaves[k:]) + [mth(leaves[:k])]


@dataclass
class OwnLog:
    """A transparency log of our own: one key, a few filler leaves, our entry among them."""

    key: PrivateKey
    name: str = "rekor.test"
    tree_id: str = "42"
    size: int = 7
    index: int = 5
    valid_for: dict[str, str] = field(default_factory=lambda: {"start": "2020-01-01T00:00:00Z"})

    @property
    def ed25519(self) -> bool:
        return isinstance(self.key, ed25519.Ed25519PrivateKey)

    @property
    def origin(self) -> str:
        return self.name if self.ed25519 else f"{self.name} - {self.tree_id}"

    @property
    def log_id(self) -> bytes:
        if self.ed25519:
            raw = self.key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            return hashlib.sha256(self.name.encode() + b"\n\x01" + raw).digest()
        return hashlib.sha256(der_of(self.key)).digest()

    def trusted_root(self) -> dict[str, Any]:
        details = "PKIX_ED25519" if self.ed25519 else "PKIX_ECDSA_P256_SHA_256"
        return {
            "mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1",
            "tlogs": [
                {
                    "baseUrl": f"https://{self.name}",
                    "hashAlgorithm": "SHA2_256",
                    "publicKey": {"rawBytes": b64(der_of(self.key)), "keyDetails": details, "validFor": self.valid_for},
                    "logId": {"keyId": b64(self.log_id)},
                }
            ],
            "certificateAuthorities": [],
            "ctlogs": [],
            "timestampAuthorities": [],
        }

    def checkpoint(self, root: bytes, *, signer_name: str | None = None, extra_lines: str = "") -> str:
        text = f"{self.origin}\n{self.size}\n{b64(root)}\n"
        name = signer_name or (self.origin if self.ed25519 else self.name)
        if self.ed25519:
            raw = self.key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            hint = hashlib.sha256(name.encode() + b"\n\x01" + raw).digest()[:4]
        else:
            hint = self.log_id[:4]
        signature = sign(self.key, text.encode())
        return f"{text}\n{extra_lines}\u2014 {name} {b64(hint + signature)}\n"

    def entry(self, kind: str, version: str, body: bytes, *, promise: bool, integrated_time: int) -> dict[str, Any]:
        leaves = [leaf_hash(b"filler %d" % i) for i in range(self.size)]
        leaves[self.index] = leaf_hash(body)
        root = mth(leaves)
        entry: dict[str, Any] = {
            "logIndex": str(1000 + self.index),
            "logId": {"keyId": b64(self.log_id)},
            "kindVersion": {"kind": kind, "version": version},
            "inclusionProof": {
                "logIndex": str(self.index),
                "rootHash": b64(root),
                "treeSize": str(self.size),
                "hashes": [b64(h) for h in audit_path(self.index, leaves)],
                "checkpoint": {"envelope": self.checkpoint(root)},
            },
            "canonicalizedBody": b64(body),
        }
        if promise:
            entry["integratedTime"] = str(integrated_time)
            payload = rfc8785.dumps(
                {
                    "body": b64(body),
                    "integratedTime": integrated_time,
                    "logID": self.log_id.hex(),
                    "logIndex": 1000 + self.index,
                }
            )
            entry["inclusionPromise"] = {"signedEntryTimestamp": b64(sign(self.key, payload))}
        return entry


INTEGRATED = 1_700_000_000


def entry_body(kind: str, version: str, signer: PrivateKey, signature: bytes, digest: bytes, payload: bytes) -> bytes:
    """The canonicalized body Rekor would log for ``kind``/``version``."""
    pem64 = b64(pem_of(signer))
    verifier = {"publicKey": {"rawBytes": b64(der_of(signer))}, "keyDetails": "PKIX_ECDSA_P256_SHA_256"}
    payload_hash = hashlib.sha256(payload).digest()
    spec: dict[str, Any]
    if (kind, version) == ("hashedrekord", "0.0.1"):
        spec = {
            "data": {"hash": {"algorithm": "sha256", "value": digest.hex()}},
            "signature": {"content": b64(signature), "publicKey": {"content": pem64}},
        }
    elif (kind, version) == ("hashedrekord", "0.0.2"):
        spec = {
            "hashedRekordV002": {
                "data": {"algorithm": "SHA2_256", "digest": b64(digest)},
                "signature": {"content": b64(signature), "verifier": verifier},
            }
        }
    elif (kind, version) == ("dsse", "0.0.1"):
        spec = {
            "envelopeHash": {"algorithm": "sha256", "value": "00" * 32},
            "payloadHash": {"algorithm": "sha256", "value": payload_hash.hex()},
            "signatures": [{"signature": b64(signature), "verifier": pem64}],
        }
    elif (kind, version) == ("dsse", "0.0.2"):
        spec = {
            "dsseV002": {
                "payloadHash": {"algorithm": "SHA2_256", "digest": b64(payload_hash)},
                "signatures": [{"content": b64(signature), "verifier": verifier}],
            }
        }
    elif (kind, version) == ("intoto", "0.0.2"):
        # Rekor's intoto/0.0.2 double-encodes the signature and stores the PEM key in base64.
        spec = {
            "content": {
                "envelope": {
                    "payloadType": "application/vnd.in-toto+json",
                    "signatures": [{"publicKey": pem64, "sig": b64(b64(signature).encode())}],
                },
                "hash": {"algorithm": "sha256", "value": "00" * 32},
                "payloadHash": {"algorithm": "sha256", "value": payload_hash.hex()},
            }
        }
    else:
        raise AssertionError(f"no body for {kind}/{version}")
    return rfc8785.dumps({"apiVersion": version, "kind": kind, "spec": spec})


@dataclass
class KeyCase:
    """One managed-key bundle written to disk, with everything needed to verify it."""

    bundle: Path
    artifact: Path
    key: PrivateKey
    root: Path | None
    document: dict[str, Any]

    def verify(self, **overrides: Any) -> VerifiedBundle:
        args: dict[str, Any] = {
            "bundle": self.bundle,
            "artifact": self.artifact,
            "policy": ManagedKey(pem_of(self.key)),
            "trusted_root": self.root,
        }
        args.update(overrides)
        return verify_bundle(args["bundle"], args["artifact"], args["policy"], trusted_root=args["trusted_root"])

    def rewrite(self, mutate: MutateFn) -> Path:
        document = copy.deepcopy(self.document)
        mutate(document)
        return write(self.bundle.with_name("mutated.json"), document)


def make_key_bundle(
    tmp_path: Path,
    *,
    dsse: bool = False,
    key: PrivateKey | None = None,
    entry: tuple[str, str] | None = None,
    log: OwnLog | None = None,
    promise: bool | None = None,
    statement_type: str | None = "https://in-toto.io/Statement/v1",
    payload_type: str = "application/vnd.in-toto+json",
    hash_: hashes.HashAlgorithm | None = None,
    message_digest: bool = True,
) -> KeyCase:
    key = key or ec.generate_private_key(ec.SECP256R1())
    artifact = tmp_path / "artifact.bin"
    artifact.write_bytes(b"a KV cache, or anything else worth signing\n")
    data = artifact.read_bytes()
    document: dict[str, Any] = {
        "mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json",
        "verificationMaterial": {"publicKey": {"hint": "test-key"}},
    }
    payload = b""
    if dsse:
        payload = statement(hashlib.sha256(data).hexdigest(), statement_type)
        signature = sign(key, pae(payload_type, payload), hash_=hash_)
        digest = hashlib.sha256(pae(payload_type, payload)).digest()
        document["dsseEnvelope"] = {
            "payload": b64(payload),
            "payloadType": payload_type,
            "signatures": [{"sig": b64(signature), "keyid": ""}],
        }
    else:
        algorithm = hash_ or hashes.SHA256()
        digest = hashlib.new(algorithm.name, data).digest()
        if isinstance(key, ed25519.Ed25519PrivateKey):
            signature = sign(key, data)
        else:
            signature = sign(key, digest, prehashed=True, hash_=algorithm)
        names = {"sha256": "SHA2_256", "sha384": "SHA2_384", "sha512": "SHA2_512"}
        document["messageSignature"] = {"signature": b64(signature)}
        if message_digest:
            document["messageSignature"]["messageDigest"] = {"algorithm": names[algorithm.name], "digest": b64(digest)}
    root_path = None
    if entry is not None:
        log = log or OwnLog(ec.generate_private_key(ec.SECP256R1()))
        body = entry_body(*entry, key, signature, digest, payload)
        with_promise = promise if promise is not None else entry[1] == "0.0.1"
        document["verificationMaterial"]["tlogEntries"] = [
            log.entry(*entry, body, promise=with_promise, integrated_time=INTEGRATED)
        ]
        root_path = write(tmp_path / "trusted_root.json", log.trusted_root())
    bundle = write(tmp_path / "bundle.sigstore.json", document)
    return KeyCase(bundle, artifact, key, root_path, document)


def test_key_message_bundle_without_log_entry(tmp_path: Path) -> None:
    case = make_key_bundle(tmp_path)
    result = case.verify()
    assert result == VerifiedBundle(
        "message_signature", None, None, "sha256:" + hashlib.sha256(der_of(case.key)).hexdigest()
    )
    digest = "sha256:" + hashlib.sha256(case.artifact.read_bytes()).hexdigest()
    case.verify(artifact=digest)
    # No log entries: the trusted root has nothing to vouch for, even an empty one works.
    empty = write(
        tmp_path / "empty_root.json", {"mediaType": "application/vnd.dev.sigstore.trustedroot+json;version=0.1"}
    )
    case.verify(trusted_root=empty)


def test_key_dsse_bundle_without_log_entry(tmp_path: Path) -> None:
    case = make_key_bundle(tmp_path, dsse=True)
    result = case.verify()
    assert result.kind == "dsse"
    assert result.payload_type == "application/vnd.in-toto+json"
    assert result.payload == base64.b64decode(case.document["dsseEnvelope"]["payload"])


@pytest.mark.parametrize(
    ("key_factory", "hash_"),
    [
        (lambda: ec.generate_private_key(ec.SECP384R1()), hashes.SHA384()),
        (lambda: ec.generate_private_key(ec.SECP384R1()), hashes.SHA256()),
        (lambda: ec.generate_private_key(ec.SECP521R1()), hashes.SHA512()),
        (lambda: rsa.generate_private_key(public_exponent=65537, key_size=2048), hashes.SHA256()),
        (ed25519.Ed25519PrivateKey.generate, None),
    ],
    ids=["p384-sha384", "p384-sha256", "p521", "rsa", "ed25519"],
)
@pytest.mark.parametrize("dsse", [False, True], ids=["message", "dsse"])
def test_key_algorithms(tmp_path: Path, key_factory: Callable[[], PrivateKey], hash_: Any, dsse: bool) -> None:
    case = make_key_bundle(tmp_path, key=key_factory(), hash_=hash_, dsse=dsse)
    case.verify()
    with pytest.raises(BadSignatureError, match="does not verify"):
        case.verify(policy=ManagedKey(pem_of(ec.generate_private_key(ec.SECP256R1()))))


def test_key_bundle_base64_regression_mixed_alphabets_were_accepted(tmp_path: Path) -> None:
    """Was: the bundle reader had its own base64 decoder, which read a field mixing the standard
    and URL-safe alphabets as if it were one, so a managed-key bundle (which sigstore-python never
    parses) verified with such a field, while ``kvgraft.schemas.decode_base64``, the rule for every
    other base64 field kvgraft reads, refuses it. Now the bundle reader uses that one rule."""
    for _ in range(100):
        # ECDSA signatures are random: find one with two of the characters the alphabets differ in.
        case = make_key_bundle(tmp_path)
        signature = case.document["messageSignature"]["signature"]
        specials = [i for i, c in enumerate(signature) if c in "+/"]
        if len(specials) >= 2:
            break
    else:
        pytest.fail("no signature with two '+' or '/' characters in 100 tries")
    i = specials[0]
    mixed = signature[:i] + {"+": "-", "/": "_"}[signature[i]] + signature[i + 1 :]
    # Either alphabet alone is read: the whole field in the URL-safe alphabet still verifies.
    url_safe = signature.replace("+", "-").replace("/", "_")
    case.verify(bundle=case.rewrite(set_at(["messageSignature", "signature"], url_safe)))
    with pytest.raises(
        MalformedInputError,
        match=r"^bundle field messageSignature\.signature mixes the standard and URL-safe base64 alphabets",
    ):
        case.verify(bundle=case.rewrite(set_at(["messageSignature", "signature"], mixed)))


def test_key_message_without_digest_field(tmp_path: Path) -> None:
    case = make_key_bundle(
        tmp_path, key=ec.generate_private_key(ec.SECP384R1()), hash_=hashes.SHA384(), message_digest=False
    )
    case.verify()


def test_ed25519_message_needs_the_artifact(tmp_path: Path) -> None:
    case = make_key_bundle(tmp_path, key=ed25519.Ed25519PrivateKey.generate())
    digest = "sha256:" + hashlib.sha256(case.artifact.read_bytes()).hexdigest()
    with pytest.raises(MalformedInputError, match="Ed25519 signature needs the artifact itself"):
        case.verify(artifact=digest)


ENTRY_KINDS_MESSAGE = [("hashedrekord", "0.0.1"), ("hashedrekord", "0.0.2")]
ENTRY_KINDS_DSSE = [
    ("hashedrekord", "0.0.1"),
    ("hashedrekord", "0.0.2"),
    ("dsse", "0.0.1"),
    ("dsse", "0.0.2"),
    ("intoto", "0.0.2"),
]
ALL_ENTRY_CASES = [(False, k) for k in ENTRY_KINDS_MESSAGE] + [(True, k) for k in ENTRY_KINDS_DSSE]


def _case_id(value: Any) -> str:
    if isinstance(value, tuple):
        return "/".join(value)
    return "dsse" if value else "message"


@pytest.mark.parametrize(("dsse", "entry"), ALL_ENTRY_CASES, ids=_case_id)
@pytest.mark.parametrize("log_key", ["ecdsa", "ed25519"])
def test_key_bundle_with_log_entry_accepts(tmp_path: Path, dsse: bool, entry: tuple[str, str], log_key: str) -> None:
    log_private: PrivateKey = (
        ec.generate_private_key(ec.SECP256R1()) if log_key == "ecdsa" else ed25519.Ed25519PrivateKey.generate()
    )
    name = "rekor.test" if log_key == "ecdsa" else "log2099.rekor.test"
    case = make_key_bundle(tmp_path, dsse=dsse, entry=entry, log=OwnLog(log_private, name=name))
    assert case.verify().kind == ("dsse" if dsse else "message_signature")


@pytest.mark.parametrize(("dsse", "entry"), ALL_ENTRY_CASES, ids=_case_id)
def test_key_bundle_mutations_reject(tmp_path: Path, dsse: bool, entry: tuple[str, str]) -> None:
    case = make_key_bundle(tmp_path, dsse=dsse, entry=entry)

    changed = tmp_path / "changed.bin"
    data = case.artifact.read_bytes()
    changed.write_bytes(data[:-1] + b"?")
    with pytest.raises(DigestMismatchError, match="artifact"):
        case.verify(artifact=changed)

    def flip_signature(document: dict[str, Any]) -> None:
        if dsse:
            sig = document["dsseEnvelope"]["signatures"][0]
            sig["sig"] = flip_b64(sig["sig"])
        else:
            document["messageSignature"]["signature"] = flip_b64(document["messageSignature"]["signature"])

    with pytest.raises(BadSignatureError, match="does not verify with the given key|over the artifact"):
        case.verify(bundle=case.rewrite(flip_signature))

    with pytest.raises(BadSignatureError, match="does not verify"):
        case.verify(policy=ManagedKey(pem_of(ec.generate_private_key(ec.SECP256R1()))))

    with pytest.raises(UntrustedRootError, match="which the trusted root does not list"):
        case.verify(trusted_root=None)  # the shipped production root
    with pytest.raises(UntrustedRootError, match="which the trusted root does not list"):
        case.verify(trusted_root=shipped_trusted_root(staging=True))

    def alter_root(document: dict[str, Any]) -> None:
        proof = document["verificationMaterial"]["tlogEntries"][0]["inclusionProof"]
        proof["rootHash"] = flip_b64(proof["rootHash"])

    with pytest.raises(LogEntryError, match="inclusion proof fails: .* leads to root .*, not the expected"):
        case.verify(bundle=case.rewrite(alter_root))

    def drop_checkpoint(document: dict[str, Any]) -> None:
        del document["verificationMaterial"]["tlogEntries"][0]["inclusionProof"]["checkpoint"]

    with pytest.raises(LogEntryError, match="no inclusion proof with a signed checkpoint"):
        case.verify(bundle=case.rewrite(drop_checkpoint))


def _swap_entry_for(case: KeyCase, tmp_path: Path, other: KeyCase) -> Path:
    """CVE-2022-36056: a genuine, provable log entry, but for another signature."""

    def swap(document: dict[str, Any]) -> None:
        document["verificationMaterial"]["tlogEntries"] = other.document["verificationMaterial"]["tlogEntries"]

    return case.rewrite(swap)


@pytest.mark.parametrize(("dsse", "entry"), ALL_ENTRY_CASES, ids=_case_id)
def test_key_bundle_with_swapped_entry_rejects(tmp_path: Path, dsse: bool, entry: tuple[str, str]) -> None:
    log = OwnLog(ec.generate_private_key(ec.SECP256R1()))
    key = ec.generate_private_key(ec.SECP256R1())
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    case = make_key_bundle(tmp_path / "a", dsse=dsse, entry=entry, log=log, key=key)
    # The same signer signs again (ECDSA is randomized): a different signature, same key.
    other = make_key_bundle(tmp_path / "b", dsse=dsse, entry=entry, log=log, key=key)
    with pytest.raises(LogEntryError, match="log entry records a different"):
        case.verify(bundle=_swap_entry_for(case, tmp_path, other))


def test_key_bundle_entry_for_other_key_rejects(tmp_path: Path) -> None:
    log = OwnLog(ec.generate_private_key(ec.SECP256R1()))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    case = make_key_bundle(tmp_path / "a", entry=("hashedrekord", "0.0.1"), log=log)
    other = make_key_bundle(tmp_path / "b", entry=("hashedrekord", "0.0.1"), log=log)
    with pytest.raises(LogEntryError, match="different signature"):
        case.verify(bundle=_swap_entry_for(case, tmp_path, other))


def test_message_bundle_must_be_logged_as_hashedrekord(tmp_path: Path) -> None:
    case = make_key_bundle(tmp_path, entry=("hashedrekord", "0.0.1"))

    def relabel(document: dict[str, Any]) -> None:
        document["verificationMaterial"]["tlogEntries"][0]["kindVersion"] = {"kind": "dsse", "version": "0.0.1"}

    with pytest.raises(LogEntryError, match="body is a hashedrekord/0.0.1, but the bundle says dsse/0.0.1"):
        case.verify(bundle=case.rewrite(relabel))


def test_checkpoint_rules(tmp_path: Path) -> None:
    log = OwnLog(ed25519.Ed25519PrivateKey.generate(), name="log2099.rekor.test")
    case = make_key_bundle(tmp_path, dsse=True, entry=("hashedrekord", "0.0.2"), log=log)
    proof = case.document["verificationMaterial"]["tlogEntries"][0]["inclusionProof"]
    root = base64.b64decode(proof["rootHash"])
    witness = ed25519.Ed25519PrivateKey.generate()
    text = proof["checkpoint"]["envelope"].split("\n\n")[0] + "\n"
    witness_signature = b64(bytes([0, 1, 2, 3]) + witness.sign(text.encode()))
    cosignature = f"\u2014 witness.example {witness_signature}\n"

    def set_checkpoint(envelope: str) -> Path:
        return case.rewrite(set_at([*ENTRY, "inclusionProof", "checkpoint", "envelope"], envelope))

    # Witness cosignatures, before or after the log's own signature, are ignored.
    signed = log.checkpoint(root)
    case.verify(bundle=set_checkpoint(signed.replace("\n\n", "\n\n" + cosignature)))
    case.verify(bundle=set_checkpoint(signed + cosignature))

    # A signature under another name no longer matches the log's key hash.
    with pytest.raises(LogEntryError, match="no valid signature from log"):
        case.verify(bundle=set_checkpoint(log.checkpoint(root, signer_name="other.rekor.test")))
    # Only witnesses signed: the log's signature is missing.
    with pytest.raises(LogEntryError, match="no valid signature from log"):
        case.verify(bundle=set_checkpoint(text + "\n" + cosignature))
    # Signed by another key under the log's name.
    impostor = OwnLog(ed25519.Ed25519PrivateKey.generate(), name=log.name)
    with pytest.raises(LogEntryError, match="no valid signature from log"):
        case.verify(bundle=set_checkpoint(impostor.checkpoint(root)))
    # Missing origin, size or root hash lines.
    lines = text.split("\n")
    for drop in range(3):
        broken = "\n".join(line for i, line in enumerate(lines) if i != drop)
        with pytest.raises(LogEntryError, match="checkpoint"):
            case.verify(bundle=set_checkpoint(broken + "\n" + signed.split("\n\n")[1]))


def test_ecdsa_checkpoint_signer_must_be_the_logs_name(tmp_path: Path) -> None:
    log = OwnLog(ec.generate_private_key(ec.SECP256R1()))
    case = make_key_bundle(tmp_path, entry=("hashedrekord", "0.0.1"), log=log)
    root = base64.b64decode(case.document["verificationMaterial"]["tlogEntries"][0]["inclusionProof"]["rootHash"])
    envelope = log.checkpoint(root, signer_name="elsewhere.test")
    with pytest.raises(LogEntryError, match="no valid signature from log"):
        case.verify(bundle=case.rewrite(set_at([*ENTRY, "inclusionProof", "checkpoint", "envelope"], envelope)))


def test_signed_entry_timestamp_must_verify(tmp_path: Path) -> None:
    case = make_key_bundle(tmp_path, entry=("hashedrekord", "0.0.1"))
    promise = case.document["verificationMaterial"]["tlogEntries"][0]["inclusionPromise"]
    forged = flip_b64(promise["signedEntryTimestamp"])
    with pytest.raises(LogEntryError, match="signed entry timestamp does not verify"):
        case.verify(bundle=case.rewrite(set_at([*ENTRY, "inclusionPromise", "signedEntryTimestamp"], forged)))
    with pytest.raises(LogEntryError, match="signed entry timestamp does not verify"):
        case.verify(bundle=case.rewrite(set_at([*ENTRY, "integratedTime"], str(INTEGRATED + 1))))


def test_log_key_validity_is_a_closed_interval(tmp_path: Path) -> None:
    at_end = datetime.fromtimestamp(INTEGRATED, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    log = OwnLog(ec.generate_private_key(ec.SECP256R1()), valid_for={"start": "2020-01-01T00:00:00Z", "end": at_end})
    (tmp_path / "a").mkdir()
    make_key_bundle(tmp_path / "a", entry=("hashedrekord", "0.0.1"), log=log).verify()

    before = datetime.fromtimestamp(INTEGRATED - 1, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    log.valid_for = {"start": "2020-01-01T00:00:00Z", "end": before}
    (tmp_path / "b").mkdir()
    case = make_key_bundle(tmp_path / "b", entry=("hashedrekord", "0.0.1"), log=log)
    with pytest.raises(UntrustedRootError, match="outside the validity period"):
        case.verify()


def test_inclusion_proof_index_outside_tree(tmp_path: Path) -> None:
    case = make_key_bundle(tmp_path, entry=("hashedrekord", "0.0.2"))
    with pytest.raises(LogEntryError, match="leaf index 7 is outside a tree of size"):
        case.verify(bundle=case.rewrite(set_at([*ENTRY, "inclusionProof", "logIndex"], "7")))


def test_inclusion_proof_with_extra_hash(tmp_path: Path) -> None:
    case = make_key_bundle(tmp_path, entry=("hashedrekord", "0.0.2"))
    hashes_ = case.document["verificationMaterial"]["tlogEntries"][0]["inclusionProof"]["hashes"]
    with pytest.raises(LogEntryError, match="inclusion proof fails: .*too long"):
        case.verify(bundle=case.rewrite(set_at([*ENTRY, "inclusionProof", "hashes"], [*hashes_, hashes_[0]])))


@pytest.mark.parametrize(
    ("statement_type", "payload_type", "error", "message"),
    [
        (
            "https://in-toto.io/Statement/v2",
            "application/vnd.in-toto+json",
            UnsupportedPayloadTypeError,
            "not an in-toto Statement v1",
        ),
        (None, "application/vnd.in-toto+json", MalformedInputError, "has no _type"),
        ("https://in-toto.io/Statement/v1", "text/plain", UnsupportedPayloadTypeError, "payload type is 'text/plain'"),
    ],
)
def test_key_dsse_statement_rules(
    tmp_path: Path, statement_type: str | None, payload_type: str, error: type[Exception], message: str
) -> None:
    case = make_key_bundle(
        tmp_path, dsse=True, entry=("hashedrekord", "0.0.2"), statement_type=statement_type, payload_type=payload_type
    )
    with pytest.raises(error, match=message):
        case.verify()


def test_key_statement_v01_is_accepted(tmp_path: Path) -> None:
    make_key_bundle(tmp_path, dsse=True, statement_type="https://in-toto.io/Statement/v0.1").verify()


def test_identity_policy_on_key_bundle(tmp_path: Path) -> None:
    case = make_key_bundle(tmp_path)
    with pytest.raises(IdentityMismatchError, match="signed with a managed key, not a Fulcio certificate"):
        case.verify(policy=CertificateIdentity("a@example.com", GITHUB_OAUTH))


def test_malformed_managed_key(tmp_path: Path) -> None:
    case = make_key_bundle(tmp_path)
    with pytest.raises(MalformedInputError, match="not a PEM public key"):
        case.verify(policy=ManagedKey(b"-----BEGIN PUBLIC KEY-----\nnope\n-----END PUBLIC KEY-----\n"))


def test_dsse_envelope_with_two_signatures_is_malformed(tmp_path: Path) -> None:
    case = make_key_bundle(tmp_path, dsse=True)
    signatures = case.document["dsseEnvelope"]["signatures"]
    with pytest.raises(MalformedInputError, match="exactly one signature, found 2"):
        case.verify(bundle=case.rewrite(set_at(["dsseEnvelope", "signatures"], signatures * 2)))


def test_future_integrated_time_rejects(tmp_path: Path) -> None:
    log = OwnLog(ec.generate_private_key(ec.SECP256R1()))
    case = make_key_bundle(tmp_path, entry=("hashedrekord", "0.0.1"), log=log)
    entry = case.document["verificationMaterial"]["tlogEntries"][0]
    future = int((datetime.now(UTC) + timedelta(days=2)).timestamp())
    body = base64.b64decode(entry["canonicalizedBody"])
    redone = log.entry("hashedrekord", "0.0.1", body, promise=True, integrated_time=future)
    with pytest.raises(LogEntryError, match="integrated in the future"):
        case.verify(bundle=case.rewrite(set_at(["verificationMaterial", "tlogEntries"], [redone])))
