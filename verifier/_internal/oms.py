"""OpenSSF model signing (``model_signing`` 1.0 and 1.1, PyPI ``model-signing``): ``model.sig`` for a directory.

A ``model.sig`` signs every file of a directory, as ``model_signing sign key`` writes it and
``model_signing verify key DIR --signature DIR/model.sig --public_key KEY.pub`` checks it:

- **the manifest**: every regular file under the directory, by its ``/``-separated relative
  path, with the sha256 of its bytes, sorted by path *components* (``a/b`` before ``a.txt``,
  as Python orders ``PurePosixPath``). Ignored, as model_signing ignores them by default: the
  signature file itself and, at the top level only, ``.git``, ``.gitattributes``, ``.github``
  and ``.gitignore`` (a folder ignored with everything under it); ``ignore_git_paths=False``
  (``--no-ignore-git-paths``, as model_signing's option) signs and checks those too. Hidden
  files count. A symbolic
  link or a special file anywhere refuses the directory (model_signing's ``allow_symlinks``
  off); empty folders are not in the manifest.
- **the statement**: an in-toto Statement v1 (payload type ``application/vnd.in-toto+json``),
  ``predicateType`` ``https://model_signing/signature/v1.0``; one subject, named after the
  directory (informative only: neither side compares it), whose ``sha256`` is the sha256 of the
  concatenated 32-byte resource digests in the order listed; ``predicate.serialization`` is
  ``{"method": "files", "hash_type": "sha256", "allow_symlinks": false, "ignore_paths": [...]}``
  and ``predicate.resources`` is ``[{"name", "algorithm": "sha256", "digest": <hex>}, ...]``.
  kvgraft writes the statement as RFC 8785 canonical JSON (model_signing writes protobuf's
  indented JSON; both sides parse it, neither re-serializes it).
- **the signature**: one DSSE signature over ``PAE(payloadType, payload)`` by an ECDSA key, DER
  encoded (P-256 with SHA-256, P-384 with SHA-384: ``keys``), with an empty ``keyid``.
- **the file**: a Sigstore bundle v0.3 (``application/vnd.dev.sigstore.bundle.v0.3+json``) whose
  ``verificationMaterial`` is ``{"publicKey": {"hint": <sha256 hex of the public key's PEM
  SubjectPublicKeyInfo>}, "tlogEntries": []}`` and whose ``dsseEnvelope`` is the envelope.
  model_signing 1.1 and later write that, and so does kvgraft. model_signing 1.0.x wrote the key
  itself instead, ``{"publicKey": {"rawBytes": <base64 of its PEM SubjectPublicKeyInfo>,
  "keyDetails": "PKIX_ECDSA_P256_SHA_256" | "PKIX_ECDSA_P384_SHA_384"}}``, a ``null`` DSSE
  ``keyid``, no ``tlogEntries`` and no ``ignore_paths``; model_signing 1.1 verifies those, and
  so does kvgraft: the key in ``rawBytes`` only picks the trusted key its hint would name (it
  is not signed, so it is never trusted itself). model_signing 1.0.x ignores the git paths only
  relative to the current folder: a directory it signed from outside has its git files signed,
  which ``--no-ignore-git-paths`` checks (model_signing 1.1 asks for the same option).

Verifying (``verify_model_signature``) is offline: the bundle is parsed strictly (bounded size,
no unknown fields, exactly one signature, no transparency-log entries, no certificate), the hint
picks the trusted ECDSA key, the signature is checked before the payload is parsed, the subject
digest is recomputed from the resources, and the directory is walked again: every file listed
must be there with its digest, and no other file may be (the first missing, extra or changed file
is named). The paths the signature lists in ``ignore_paths`` are honoured, as model_signing
honours them (they are signed); each must be a plain relative path, and what they leave out
beyond ``model.sig`` and the git paths is named in ``describe()``. Every folder and file is
opened beneath its folder's descriptor without following links, so a folder swapped for a link
mid-walk is refused; ``model.sig`` itself must be a regular file, read to a bound. Differences
from model_signing, each stricter or bounded: only the ``files`` method with sha256 (not
``shards``, blake2 or blake3), no pre-1.0 signatures (neither hint nor key; the v0.2 predicate;
the escaped-PAE signatures model_signing 1.1 still accepts), no P-521 keys, at least one
signed file, no resource named twice (model_signing keeps the last), at most ``MAX_ENTRIES``
files and folders and ``MAX_DEPTH`` levels. One difference is laxer: ignored folders are not
walked (model_signing walks ``.git`` too, and refuses a link inside it).

``check_model_signature_beside`` is the ``--artifact-dir`` rule: a ``model.sig`` by a key the
caller does not trust, or of a kind not checked here, is reported unchecked rather than failing
the statement's check (as DSSE passes over signatures by unknown keys); one by a trusted key must
hold.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvgraft.schemas import (
    IN_TOTO_PAYLOAD_TYPE,
    MODEL_SIG_FILE,
    STATEMENT_TYPE,
    Contract,
    DocumentError,
    Envelope,
    HexDigestField,
    Sha256Digest,
    Sha256Hex,
    Signature,
    SubjectDigest,
    canonical_model,
    hex_of,
    parse_json,
    prefixed,
    sha256_stream,
)

from .dsse import pae, verify_envelope
from .errors import (
    BadSignatureError,
    KeyFileError,
    ModelDirectoryError,
    ModelManifestMismatchError,
    ModelSignatureFormatError,
    ThresholdNotMetError,
    UnknownKeyError,
    UnsupportedKeyTypeError,
    UnsupportedPayloadTypeError,
)
from .keys import (
    KeyType,
    PublicKey,
    SigningKey,
    TrustedKey,
    TrustedKeys,
    key_type_label,
    key_type_of,
    parse_public_key,
    public_key_pem,
)

#: The predicate type of a model_signing v1.0 signature.
MODEL_SIGNING_PREDICATE: Final = "https://model_signing/signature/v1.0"
#: The media type of the Sigstore bundle model_signing writes for key-based signatures.
MODEL_SIGNING_BUNDLE_MEDIA_TYPE: Final = "application/vnd.dev.sigstore.bundle.v0.3+json"
#: What model_signing ignores at the top of a directory by default (``--ignore-git-paths``).
GIT_PATHS: Final = (".git", ".gitattributes", ".github", ".gitignore")
#: The key types model_signing's ``key`` method signs with that kvgraft makes (it also takes P-521).
MODEL_SIGNING_KEY_TYPES: Final[tuple[KeyType, ...]] = ("p256", "p384")

#: At most this many files and folders under a directory signed or checked (a kvgraft artifact
#: holds two files; an exactness record a few dozen).
MAX_ENTRIES: Final = 10_000
#: At most this many folder levels below the directory.
MAX_DEPTH: Final = 32
#: A ``model.sig`` larger than this is refused before it is read (10 000 resources are ~2 MB).
MAX_SIGNATURE_BYTES: Final = 16 * 1024 * 1024
#: At most this many ``ignore_paths`` in a signature.
MAX_IGNORE_PATHS: Final = 256
#: At most this many bytes of PEM in a model_signing 1.0.x ``publicKey.rawBytes`` (a P-384 key's is 215).
MAX_RAW_KEY_BYTES: Final = 4096
#: model_signing 1.0.x's ``publicKey.keyDetails`` for the key types checked here (it also signs with P-521).
KEY_DETAILS: Final[dict[str, KeyType]] = {"PKIX_ECDSA_P256_SHA_256": "p256", "PKIX_ECDSA_P384_SHA_384": "p384"}


# --- the documents --------------------------------------------------------------------------


def _plain_relative(name: str, what: str) -> str:
    # Resource names and ignored paths become paths under the directory: nothing that escapes it.
    if not name or name.startswith("/") or "\0" in name or any(p in ("", ".", "..") for p in name.split("/")):
        raise ValueError(f"{what} {name[:200]!r} is not a plain relative path (no leading '/', '.', '..' or empty parts)")
    return name


class ModelResource(Contract):
    """One file of the manifest: its relative path, the hash algorithm and the hex digest."""

    name: str = Field(min_length=1, description="the file's path relative to the directory, '/'-separated")
    algorithm: Literal["sha256"]
    digest: HexDigestField

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        return _plain_relative(name, "resource name")


class ModelSerialization(Contract):
    """How the manifest was made: model_signing's ``files`` method (one sha256 per file)."""

    method: Literal["files"]
    hash_type: Literal["sha256"]
    allow_symlinks: bool
    ignore_paths: list[str] = Field(default_factory=list, max_length=MAX_IGNORE_PATHS)

    @field_validator("ignore_paths")
    @classmethod
    def _ignore_paths(cls, paths: list[str]) -> list[str]:
        return [_plain_relative(p, "ignored path") for p in paths]

    @model_validator(mode="before")
    @classmethod
    def _method(cls, data: Any) -> Any:
        # A clear refusal for the methods model_signing has and kvgraft does not check.
        if isinstance(data, dict):
            if data.get("method", "files") != "files":
                raise ValueError(
                    f"serialization method {str(data['method'])[:40]!r} is not checked here, only 'files' "
                    "(sign without sharding)"
                )
            if data.get("hash_type", "sha256") != "sha256":
                raise ValueError(f"hash type {str(data['hash_type'])[:40]!r} is not checked here, only 'sha256'")
        return data


class ModelSigningPredicate(BaseModel):
    """The v1.0 predicate: ``serialization`` and ``resources``. Other fields are ignored, as the
    v1.0 format tells verifiers to."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)

    serialization: ModelSerialization
    resources: list[ModelResource] = Field(max_length=MAX_ENTRIES)

    @field_validator("resources")
    @classmethod
    def _some(cls, resources: list[ModelResource]) -> list[ModelResource]:
        # A manifest of no file would verify for any directory its ignore_paths empty out.
        if not resources:
            raise ValueError("signs no file: a model.sig must sign at least one file of the directory")
        return resources


class ModelSubject(Contract):
    """The one subject: the directory's name (informative) and the digest over every resource digest."""

    name: str
    digest: SubjectDigest


class ModelSigningStatement(Contract):
    """The in-toto Statement v1 of a model_signing v1.0 signature."""

    type_: Literal["https://in-toto.io/Statement/v1"] = Field(default=STATEMENT_TYPE, alias="_type")
    subject: list[ModelSubject] = Field(min_length=1, max_length=1)
    predicate_type: Literal["https://model_signing/signature/v1.0"] = Field(
        default=MODEL_SIGNING_PREDICATE, alias="predicateType"
    )
    predicate: ModelSigningPredicate


class PublicKeyHint(Contract):
    """Which key signed. model_signing 1.1 and later (and kvgraft): ``hint``, the sha256 (hex) of
    its SubjectPublicKeyInfo PEM text. model_signing 1.0.x: ``rawBytes``, base64 of that PEM text,
    and ``keyDetails``, its algorithm. Exactly one of ``hint`` and ``rawBytes``; either only names
    the key (``key_hint``): the bundle's verification material is not signed."""

    hint: HexDigestField | None = None
    raw_bytes: str | None = Field(default=None, alias="rawBytes", max_length=(MAX_RAW_KEY_BYTES + 2) // 3 * 4)
    key_details: str | None = Field(default=None, alias="keyDetails", max_length=64)

    @model_validator(mode="after")
    def _one_way(self) -> PublicKeyHint:
        if self.hint is not None and (self.raw_bytes is not None or self.key_details is not None):
            raise ValueError("holds both a hint (model_signing 1.1) and rawBytes or keyDetails (1.0.x); a model.sig holds one")
        if self.hint is None:
            if self.raw_bytes is None:
                raise ValueError("has neither a hint (model_signing 1.1 and later) nor rawBytes (1.0.x): a pre-1.0 "
                                 "model_signing signature; re-sign it with model_signing 1.0 or later")
            self._raw_key()
        return self

    def _raw_key(self) -> PublicKey:
        # 1.0.x's key: its keyDetails must name a key type checked here, and the key must be one of it.
        if self.key_details not in KEY_DETAILS:
            raise ValueError(f"keyDetails {str(self.key_details)[:64]!r} is not a key type checked here, only "
                             f"{' or '.join(KEY_DETAILS)} (ECDSA P-256, P-384)")
        try:
            key = parse_public_key(base64.b64decode(self.raw_bytes or "", validate=True), source="it")
        except binascii.Error as e:
            raise ValueError(f"rawBytes is not base64 of a PEM public key ({e})") from e
        except KeyFileError as e:  # not a PEM key, or of a type kvgraft does not check
            raise ValueError(f"rawBytes is not base64 of a PEM public key of a type checked here ({e.message})") from e
        if key_type_of(key) != KEY_DETAILS[self.key_details]:
            raise ValueError(f"rawBytes holds an {key_type_label(key_type_of(key))} key, but keyDetails says {self.key_details}")
        return key

    def names(self) -> Sha256Hex:
        """The ``hint`` of the key that signed: given (1.1), or computed from ``rawBytes`` (1.0.x)."""
        return self.hint if self.hint is not None else key_hint(self._raw_key())


class ModelVerificationMaterial(Contract):
    """A key-based bundle's verification material: the key hint, and no log entries."""

    public_key: PublicKeyHint = Field(alias="publicKey")
    tlog_entries: list[dict[str, Any]] = Field(default_factory=list, alias="tlogEntries")

    @model_validator(mode="before")
    @classmethod
    def _key_based(cls, data: Any) -> Any:
        if isinstance(data, dict) and "publicKey" not in data and "public_key" not in data:
            kinds = ", ".join(sorted(str(k) for k in data if k != "tlogEntries")) or "nothing"
            raise ValueError(
                f"holds {kinds[:80]} but no publicKey: only key-signed model.sig files (model_signing sign key) "
                "are checked here, not certificate or Sigstore ones"
            )
        return data

    @field_validator("tlog_entries")
    @classmethod
    def _no_log(cls, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if entries:
            raise ValueError("must be empty: a key-signed model.sig carries no transparency-log entries")
        return entries


class ModelSigningBundle(Contract):
    """``model.sig``: a Sigstore bundle v0.3 holding a key hint and a DSSE envelope."""

    media_type: Literal["application/vnd.dev.sigstore.bundle.v0.3+json"] = Field(
        default=MODEL_SIGNING_BUNDLE_MEDIA_TYPE, alias="mediaType"
    )
    verification_material: ModelVerificationMaterial = Field(alias="verificationMaterial")
    dsse_envelope: Envelope = Field(alias="dsseEnvelope")

    @model_validator(mode="before")
    @classmethod
    def _null_keyid(cls, data: Any) -> Any:
        # model_signing 1.0.x writes the DSSE keyid as null, 1.1 as "": both mean none.
        envelope = data.get("dsseEnvelope") if isinstance(data, dict) else None
        if not isinstance(envelope, dict):
            return data
        signatures = envelope.get("signatures")
        if isinstance(signatures, list) and any(isinstance(sig, dict) and sig.get("keyid", "") is None for sig in signatures):
            fixed = [{k: v for k, v in sig.items() if not (k == "keyid" and v is None)} if isinstance(sig, dict) else sig
                     for sig in signatures]
            data = {**data, "dsseEnvelope": {**envelope, "signatures": fixed}}
        return data

    @field_validator("dsse_envelope")
    @classmethod
    def _one_signature(cls, envelope: Envelope) -> Envelope:
        if len(envelope.signatures) != 1:
            raise ValueError(f"has {len(envelope.signatures)} signatures; a model.sig holds exactly one")
        return envelope


def key_hint(public_key: PublicKey) -> Sha256Hex:
    """The bundle's ``publicKey.hint`` for a key: sha256 (hex) of its SubjectPublicKeyInfo PEM."""
    return Sha256Hex(hashlib.sha256(public_key_pem(public_key)).hexdigest())


def _validation_message(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{where}: {msg}"


# --- walking and hashing a directory -----------------------------------------------------------

# Every folder and file is opened beneath the descriptor of the folder above it, never by a path,
# and never through a link (O_NOFOLLOW at each step): a folder or file swapped for a link, a pipe
# or a device between the walk and the read is refused, not followed, however deep it lies.
# O_NONBLOCK so that opening a pipe swapped in does not wait for a writer.
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


def _check_directory(directory: Path) -> None:
    if directory.is_symlink():
        raise ModelDirectoryError(f"{directory} is a symbolic link", hint="pass the directory it points to")
    if not directory.exists():
        raise ModelDirectoryError(f"directory {directory} does not exist", hint="pass the directory to sign or verify")
    if not directory.is_dir():
        raise ModelDirectoryError(f"{directory} is not a directory", hint="pass the artifact's, record's or entry's directory")


def _changed(directory: Path, rel: str, e: OSError) -> ModelDirectoryError:
    if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT, errno.ENXIO):
        return ModelDirectoryError(
            f"{rel or '.'} in {directory} changed while it was read (now missing, a link or another kind of file)",
            hint="do not change the directory while it is signed or checked",
        )
    return ModelDirectoryError(f"cannot read {rel or '.'} in {directory}: {e.strerror or e}")


@contextlib.contextmanager
def _open_folder(directory: Path, parts: tuple[str, ...]) -> Iterator[int]:
    """A descriptor of ``directory/parts``, each folder opened beneath the one above without following a link."""
    try:
        fd = os.open(directory, _DIR_FLAGS)
    except OSError as e:
        raise _changed(directory, "", e) from e
    try:
        for i, part in enumerate(parts):
            try:
                below = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                raise _changed(directory, "/".join(parts[: i + 1]), e) from e
            os.close(fd)
            fd = below
        yield fd
    finally:
        os.close(fd)


def _ignored(parts: tuple[str, ...], ignore: frozenset[tuple[str, ...]]) -> bool:
    # A path is ignored when it, or a folder above it, is listed (model_signing's is_relative_to).
    return any(parts[:i] in ignore for i in range(1, len(parts) + 1))


def _ignore_set(paths: list[str] | tuple[str, ...]) -> frozenset[tuple[str, ...]]:
    return frozenset(tuple(p.split("/")) for p in paths)


def _sort_key(name: str) -> tuple[str, ...]:
    # PurePosixPath order, which model_signing sorts by: component by component.
    return tuple(name.split("/"))


def _walk(directory: Path, ignore: frozenset[tuple[str, ...]], max_entries: int) -> dict[str, tuple[str, ...]]:
    """Every regular file under ``directory`` not ignored: relative name -> path components.

    Refuses links, special files, names that are not UTF-8, more than ``max_entries`` entries
    (counted as they are listed: a huge folder is not read whole first) or ``MAX_DEPTH`` levels.
    """
    files: dict[str, tuple[str, ...]] = {}
    entries = 0
    pending: list[tuple[str, ...]] = [()]
    while pending:
        prefix = pending.pop()
        with _open_folder(directory, prefix) as fd:
            try:
                with os.scandir(fd) as it:
                    for entry in it:
                        parts = (*prefix, entry.name)
                        rel = "/".join(parts)
                        try:
                            rel.encode("utf-8")
                        except UnicodeEncodeError as e:
                            raise ModelDirectoryError(
                                f"{directory / '/'.join(prefix)} holds a name that is not UTF-8 "
                                f"({entry.name.encode('utf-8', 'surrogateescape')[:80]!r})",
                                hint="rename it: a signed manifest names files in UTF-8",
                            ) from e
                        if _ignored(parts, ignore):
                            continue
                        entries += 1
                        if entries > max_entries:
                            raise ModelDirectoryError(
                                f"{directory} holds more than {max_entries} files and folders",
                                hint="sign a smaller directory, or split it",
                            )
                        if entry.is_symlink():
                            raise ModelDirectoryError(
                                f"{rel} in {directory} is a symbolic link; model signing covers regular files only",
                                hint="copy the file it points to into the directory",
                            )
                        if entry.is_dir(follow_symlinks=False):
                            if len(parts) >= MAX_DEPTH:
                                raise ModelDirectoryError(
                                    f"{rel} in {directory} is more than {MAX_DEPTH} folders deep", hint="flatten the directory"
                                )
                            pending.append(parts)
                        elif entry.is_file(follow_symlinks=False):
                            files[rel] = parts
                        else:
                            raise ModelDirectoryError(
                                f"{rel} in {directory} is neither a regular file nor a folder (a socket, pipe or device)",
                                hint="remove it from the directory",
                            )
            except OSError as e:
                raise _changed(directory, "/".join(prefix), e) from e
    return files


def _hash_file(directory: Path, parts: tuple[str, ...]) -> Sha256Hex:
    """The sha256 hex of ``directory/parts``, opened beneath its folder's descriptor (``_open_folder``)."""
    rel = "/".join(parts)
    with _open_folder(directory, parts[:-1]) as folder:
        try:
            fd = os.open(parts[-1], _FILE_FLAGS, dir_fd=folder)
        except OSError as e:
            raise _changed(directory, rel, e) from e
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ModelDirectoryError(
                f"{rel} in {directory} is no longer a regular file", hint="do not change the directory while it is signed or checked"
            )
        try:
            return hex_of(sha256_stream(f))
        except OSError as e:
            raise _changed(directory, rel, e) from e


def _signature_inside(directory: Path, path: Path) -> str | None:
    """The signature's name relative to ``directory`` when it lies inside it (its own last
    component not followed), else ``None``."""
    try:
        return (path.parent.resolve() / path.name).relative_to(directory.resolve()).as_posix()
    except ValueError:
        return None


def _read_signature(path: Path, *, inside: bool) -> bytes:
    """``model.sig``'s bytes: a regular file, read to at most ``MAX_SIGNATURE_BYTES``; inside the
    directory not a link either (model_signing refuses a link anywhere in the directory, its
    signature included).

    Read through one descriptor, so a pipe or a device (``/dev/zero``) cannot make it wait or
    read without end.
    """
    if inside and path.is_symlink():
        raise ModelDirectoryError(
            f"model signature {path} is a symbolic link; a model.sig is a regular file",
            hint="copy the signature file itself there",
        )
    try:
        fd = os.open(path, _FILE_FLAGS if inside else _FILE_FLAGS & ~os.O_NOFOLLOW)
    except FileNotFoundError as e:
        raise ModelSignatureFormatError(f"model signature {path} does not exist") from e
    except OSError as e:
        raise ModelSignatureFormatError(f"cannot read model signature {path}: {e.strerror or e}") from e
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if stat.S_ISDIR(mode):
            raise ModelSignatureFormatError(f"model signature {path} is a directory, not a file")
        if not stat.S_ISREG(mode):
            raise ModelDirectoryError(
                f"model signature {path} is not a regular file (a pipe, socket or device)", hint="remove it"
            )
        data = f.read(MAX_SIGNATURE_BYTES + 1)
    if len(data) > MAX_SIGNATURE_BYTES:
        raise ModelSignatureFormatError(
            f"model signature {path} is more than the {MAX_SIGNATURE_BYTES} bytes a model.sig can be"
        )
    return data


def _model_name(directory: Path) -> str:
    # model_signing names the model after the path's last component (resolved for '.' and '..').
    name = directory.name
    return name if name and name != ".." else directory.resolve().name


def _root_digest(resources: list[ModelResource]) -> Sha256Hex:
    h = hashlib.sha256()
    for r in resources:
        h.update(bytes.fromhex(r.digest))
    return Sha256Hex(h.hexdigest())


# --- signing ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SignedModel:
    """A ``model.sig`` made for a directory: its bytes, and what it signs."""

    bundle: bytes
    statement: ModelSigningStatement
    key_type: KeyType

    @property
    def files(self) -> tuple[str, ...]:
        """The signed files, in manifest order."""
        return tuple(r.name for r in self.statement.predicate.resources)

    @property
    def root_digest(self) -> Sha256Digest:
        """The subject's digest: sha256 over the resource digests."""
        return prefixed(self.statement.subject[0].digest.sha256)


def _require_model_signing_key(key_type: KeyType) -> None:
    if key_type not in MODEL_SIGNING_KEY_TYPES:
        raise UnsupportedKeyTypeError(
            f"an {key_type_label(key_type)} key cannot sign a model.sig: model_signing verifies ECDSA keys only "
            "(P-256 or P-384)",
            hint="generate a P-256 key with 'kvgraft keys generate --type p256 --out KEY' and sign with it",
        )


def sign_model_directory(
    directory: Path, signer: SigningKey, *, ignore_git_paths: bool = True, max_entries: int = MAX_ENTRIES
) -> SignedModel:
    """Hash every file of ``directory`` (but ``model.sig`` and, unless ``ignore_git_paths`` is
    false, the git paths) and sign the model_signing v1.0 statement with ``signer`` (P-256 or
    P-384) into ``model.sig`` bytes.

    Writes nothing: the caller writes ``SignedModel.bundle`` to ``directory / MODEL_SIG_FILE``.
    Raises ``UnsupportedKeyTypeError`` for an Ed25519 key and ``ModelDirectoryError`` for a
    directory it cannot sign (empty, a link or special file inside, over the limits).
    """
    _require_model_signing_key(signer.key_type)
    _check_directory(directory)
    ignore_paths = [MODEL_SIG_FILE, *(GIT_PATHS if ignore_git_paths else ())]
    files = _walk(directory, _ignore_set(ignore_paths), max_entries)
    if not files:
        raise ModelDirectoryError(f"{directory} holds no files to sign", hint="sign a directory that holds the files")
    resources = [
        ModelResource(name=name, algorithm="sha256", digest=_hash_file(directory, files[name]))
        for name in sorted(files, key=_sort_key)
    ]
    statement = ModelSigningStatement(
        subject=[ModelSubject(name=_model_name(directory), digest=SubjectDigest(sha256=_root_digest(resources)))],
        predicate=ModelSigningPredicate(
            serialization=ModelSerialization(method="files", hash_type="sha256", allow_symlinks=False, ignore_paths=ignore_paths),
            resources=resources,
        ),
    )
    payload = canonical_model(statement)
    sig = signer.sign(pae(IN_TOTO_PAYLOAD_TYPE, payload))
    bundle = ModelSigningBundle(
        verification_material=ModelVerificationMaterial(public_key=PublicKeyHint(hint=key_hint(signer.public_key))),
        dsse_envelope=Envelope(
            payload=base64.b64encode(payload).decode("ascii"),
            payload_type=IN_TOTO_PAYLOAD_TYPE,
            # model_signing leaves the DSSE keyid empty: the bundle's hint names the key.
            signatures=[Signature(sig=base64.b64encode(sig).decode("ascii"), keyid="")],
        ),
    )
    # exclude_none: the unused 1.0.x key fields (rawBytes, keyDetails) are left out, not null.
    return SignedModel(bundle.model_dump_json(by_alias=True, exclude_none=True).encode("utf-8"), statement, signer.key_type)


# --- verifying ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class VerifiedModelSignature:
    """What a verified ``model.sig`` proves: these files of the directory, with these digests,
    signed by this trusted key."""

    directory: Path
    signature: Path
    signer: TrustedKey
    statement: ModelSigningStatement

    @property
    def files(self) -> tuple[str, ...]:
        """The signed files, in manifest order."""
        return tuple(r.name for r in self.statement.predicate.resources)

    @property
    def ignore_paths(self) -> tuple[str, ...]:
        """The paths the signature says it leaves out (``model.sig`` and the git paths among them)."""
        return tuple(self.statement.predicate.serialization.ignore_paths)

    @property
    def unsigned_paths(self) -> tuple[str, ...]:
        """The signed ``ignore_paths`` beyond the signature file and the git paths: what the
        signer chose to leave unchecked (``model_signing sign --ignore-paths``)."""
        usual = {MODEL_SIG_FILE, *GIT_PATHS, _signature_inside(self.directory, self.signature)}
        return tuple(p for p in self.ignore_paths if p not in usual)

    @property
    def model_name(self) -> str:
        """The subject's name: the directory's name when signed (informative only)."""
        return self.statement.subject[0].name

    @property
    def root_digest(self) -> Sha256Digest:
        """The subject's digest: sha256 over the resource digests."""
        return prefixed(self.statement.subject[0].digest.sha256)

    def describe(self) -> str:
        """One line for a command's summary (naming what the signature leaves unchecked, if anything)."""
        left_out = f", leaving out {_first(list(self.unsigned_paths), 'path(s)')} as signed" if self.unsigned_paths else ""
        return (
            f"model.sig over {len(self.files)} file(s) signed by {self.signer.name} "
            f"({key_type_label(key_type_of(self.signer.public_key))}, key {self.signer.keyid[:16]}){left_out}"
        )


@dataclass(frozen=True)
class UncheckedModelSignature:
    """A ``model.sig`` beside a statement's subjects that ``check_model_signature_beside`` could not
    check, and why: not by a trusted ECDSA key, or of a kind kvgraft does not check."""

    signature: Path
    reason: str


def parse_model_signature(data: bytes, *, source: str = "model.sig") -> ModelSigningBundle:
    """Parse ``model.sig`` bytes strictly; raise ``ModelSignatureFormatError`` naming the field."""
    try:
        raw = parse_json(data, what=source)
    except DocumentError as e:
        raise ModelSignatureFormatError(str(e)) from e
    try:
        return ModelSigningBundle.model_validate(raw)
    except ValidationError as e:
        raise ModelSignatureFormatError(f"{source}: {_validation_message(e)}") from e


def _signing_key(bundle: ModelSigningBundle, trusted: TrustedKeys, source: str) -> TrustedKey:
    """The trusted ECDSA key the bundle's hint names, once the trust policy allows a model.sig at all."""
    envelope = bundle.dsse_envelope
    if envelope.payload_type != IN_TOTO_PAYLOAD_TYPE or IN_TOTO_PAYLOAD_TYPE not in trusted.payload_types:
        raise UnsupportedPayloadTypeError(
            f"{source} carries payload type {envelope.payload_type!r}; a model.sig carries an in-toto statement "
            f"({IN_TOTO_PAYLOAD_TYPE}), which the trusted keys must accept"
        )
    need = trusted.threshold_for(MODEL_SIGNING_PREDICATE)
    if need > 1:
        raise ThresholdNotMetError(
            f"a model.sig holds one signature, but the trusted keys require {need} for {MODEL_SIGNING_PREDICATE}",
            hint=f'set "thresholds": {{"{MODEL_SIGNING_PREDICATE}": 1}} in the trusted-keys file, or pass --public-key',
        )
    hint = bundle.verification_material.public_key.names()
    ecdsa = [k for k in trusted.keys if key_type_of(k.public_key) in MODEL_SIGNING_KEY_TYPES]
    for key in ecdsa:
        if key_hint(key.public_key) == hint:
            return key
    raise UnknownKeyError(
        f"{source} was signed by the key whose PEM has sha256 {hint[:16]}..., which is none of the "
        f"{len(ecdsa)} trusted ECDSA key(s) ({len(trusted.keys)} trusted in all)",
        hint="pass the signer's public key (--public-key KEY.pub) or add it to the trusted-keys file, if you trust it",
    )


def _signed_statement(bundle: ModelSigningBundle, key: TrustedKey, source: str) -> ModelSigningStatement:
    """The statement, parsed only after its DSSE signature verifies with ``key`` (``verify_envelope``:
    the one DSSE check, PAE and key types included)."""
    try:
        verified = verify_envelope(bundle.dsse_envelope, TrustedKeys((key,)), threshold=1)
    except (BadSignatureError, UnknownKeyError) as e:
        raise BadSignatureError(f"{source}: the signature by trusted key {key.name!r} does not verify over its statement") from e
    try:
        statement = ModelSigningStatement.model_validate(parse_json(verified.payload, what=f"statement in {source}"))
    except DocumentError as e:
        raise ModelSignatureFormatError(str(e)) from e
    except ValidationError as e:
        raise ModelSignatureFormatError(f"statement in {source}: {_validation_message(e)}") from e
    resources = statement.predicate.resources
    names = [r.name for r in resources]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ModelSignatureFormatError(f"statement in {source} lists {dup!r} twice")
    claimed = statement.subject[0].digest.sha256
    if _root_digest(resources) != claimed:
        raise ModelSignatureFormatError(
            f"statement in {source} is inconsistent: its subject digest is {claimed}, but its resources hash to "
            f"{_root_digest(resources)}",
            hint="the signer wrote an invalid manifest; ask them to sign the directory again",
        )
    return statement


def _first(names: list[str], more: str) -> str:
    shown = ", ".join(names[:3])
    return shown + (f" and {len(names) - 3} more {more}" if len(names) > 3 else "")


def _read_bundle(directory: Path, sig_path: Path) -> ModelSigningBundle:
    inside = _signature_inside(directory, sig_path) is not None
    return parse_model_signature(_read_signature(sig_path, inside=inside), source=str(sig_path))


def _check_files(
    directory: Path, sig_path: Path, key: TrustedKey, statement: ModelSigningStatement, max_entries: int,
    ignore_git_paths: bool = True,
) -> VerifiedModelSignature:
    source = str(sig_path)
    ignore = [*(GIT_PATHS if ignore_git_paths else ()), *statement.predicate.serialization.ignore_paths]
    inside = _signature_inside(directory, sig_path)
    if inside is not None:
        ignore.append(inside)  # the signature file is never part of what it signs (model_signing ignores it too)
    on_disk = _walk(directory, _ignore_set(ignore), max_entries)
    signed = {r.name: r.digest for r in statement.predicate.resources}
    missing = sorted(set(signed) - set(on_disk), key=_sort_key)
    if missing:
        git = _ignore_set(GIT_PATHS)
        hint = ("the signer signed the git paths too (model_signing --no-ignore-git-paths, or model_signing 1.0.x run from "
                "outside the directory): check them with --no-ignore-git-paths"
                if ignore_git_paths and any(_ignored(tuple(m.split("/")), git) for m in missing) else None)
        raise ModelManifestMismatchError(f"{directory} lacks {_first(missing, 'signed file(s)')}, signed by {source}", hint=hint)
    extra = sorted(set(on_disk) - set(signed), key=_sort_key)
    if extra:
        raise ModelManifestMismatchError(
            f"{directory} holds {_first(extra, 'file(s)')}, not signed by {source}",
            hint="remove the files that are not part of the signed directory, or re-sign it",
        )
    for r in statement.predicate.resources:
        got = _hash_file(directory, on_disk[r.name])
        if got != r.digest:
            raise ModelManifestMismatchError(f"{r.name} in {directory} has sha256 {got}, but {source} signs {r.digest}")
    return VerifiedModelSignature(directory, sig_path, key, statement)


def verify_model_signature(
    directory: Path, trusted: TrustedKeys, *, signature: Path | None = None, ignore_git_paths: bool = True,
    max_entries: int = MAX_ENTRIES,
) -> VerifiedModelSignature:
    """Verify ``signature`` (default ``directory / model.sig``) against ``trusted`` and check
    that ``directory`` holds exactly the files it signs, with their digests: all but the paths
    the signature ignores and, unless ``ignore_git_paths`` is false, the git paths.

    Raises ``ModelSignatureFormatError`` (not a key-signed v1.0 model.sig), ``UnknownKeyError``
    (its hint, or 1.0.x's key, names no trusted ECDSA key), ``BadSignatureError``, ``ModelDirectoryError`` (a
    link, a special file, over the limits) or ``ModelManifestMismatchError`` naming the first
    missing, extra or changed file.
    """
    _check_directory(directory)
    sig_path = directory / MODEL_SIG_FILE if signature is None else signature
    bundle = _read_bundle(directory, sig_path)
    key = _signing_key(bundle, trusted, str(sig_path))
    return _check_files(directory, sig_path, key, _signed_statement(bundle, key, str(sig_path)), max_entries,
                        ignore_git_paths)


def check_model_signature_beside(
    directory: Path, trusted: TrustedKeys, *, max_entries: int = MAX_ENTRIES
) -> VerifiedModelSignature | UncheckedModelSignature | None:
    """The ``model.sig`` beside a statement's subjects (``kvgraft-verify envelope --artifact-dir``),
    checked when a trusted key signed it; ``None`` when there is none.

    As DSSE passes over a signature by a key it does not trust, a ``model.sig`` that is not by
    one of ``trusted``'s ECDSA keys, that the trust policy does not accept (a threshold above
    one), or that is of a kind kvgraft does not check (certificate or keyless Sigstore, shards,
    pre-1.0, not JSON) is returned as ``UncheckedModelSignature``: it says nothing against the
    statement, whose subjects were checked on their own. A ``model.sig`` whose hint names a
    trusted key must hold in full: a signature that does not verify, a directory that differs
    from its manifest, a link (the signature itself included) raise as ``verify_model_signature``
    does. ``kvgraft-verify oms`` is the check that requires a model.sig.
    """
    sig_path = directory / MODEL_SIG_FILE
    if not (sig_path.is_symlink() or sig_path.exists()):
        return None
    _check_directory(directory)
    try:
        bundle = _read_bundle(directory, sig_path)
        key = _signing_key(bundle, trusted, str(sig_path))
    except (ModelSignatureFormatError, UnknownKeyError, ThresholdNotMetError, UnsupportedPayloadTypeError) as e:
        return UncheckedModelSignature(sig_path, e.message)
    return _check_files(directory, sig_path, key, _signed_statement(bundle, key, str(sig_path)), max_entries)
