"""Capture a KV state to a signed artifact directory, and load one back, checked, for a graft.

An artifact directory holds exactly ``kv.safetensors`` and ``statement.dsse.json``. It appears
under its final name only when complete (built in a temp dir, fsynced, renamed). Loading checks
the statement (and its signature when trusted keys are given), then the tensors file's sha256
against the statement, then model, tokenizer and profile, then the parent chain, all before
any tensor is used.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

import kvgraft
from kvgraft.schemas import (
    DeterminismProfile,
    DocumentError,
    KvArtifactPredicate,
    KvArtifactStatement,
    ModelRef,
    PositionRange,
    Sha256Digest,
    SourceText,
    Subject,
    SubjectDigest,
    TokenSpan,
    canonical_json,
    canonical_model,
    hex_of,
    parse_statement,
    sha256_bytes,
)
from kvgraft.verifier import (
    TrustedKeys,
    VerificationError,
    b64decode_any,
    envelope_json,
    generate_private_key,
    open_signing_key,
    read_envelope,
    save_private_key,
    save_public_key,
    sign_statement,
    verify_statement_envelope,
)

from .errors import ArtifactError, KvFileError
from .kvfile import deserialize, serialize
from .kvstate import KVState, Segment
from .models import LoadedModel, kvgraft_home
from .profiles import require_same

KV_FILE = "kv.safetensors"
STATEMENT_FILE = "statement.dsse.json"
_KV_METADATA = {"format": "kvgraft-kv-state/v1"}


def logits_digest(logits: torch.Tensor) -> Sha256Digest:
    """sha256 of float32 little-endian row-major bytes of ``logits``."""
    return sha256_bytes(logits.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes())


def token_digest(ids: list[int] | tuple[int, ...]) -> Sha256Digest:
    """sha256 of the canonical JSON list of token ids."""
    return sha256_bytes(canonical_json(list(ids)))


def chain_key(parent_key: Sha256Digest | None, model: ModelRef, tokenizer: Sha256Digest, profile: DeterminismProfile, ids: list[int]) -> Sha256Digest:
    """``sha256(parent_key || model || profile || token ids)``, every part fixed-length or canonical.

    The parent key is its 32 raw bytes (32 zero bytes for a root); model, tokenizer and profile
    enter as the sha256 of their canonical JSON; the ids as canonical JSON.
    """
    h = hashlib.sha256()
    h.update(bytes.fromhex(hex_of(parent_key)) if parent_key else b"\0" * 32)
    h.update(hashlib.sha256(canonical_model(model)).digest())
    h.update(bytes.fromhex(hex_of(tokenizer)))
    h.update(hashlib.sha256(canonical_model(profile)).digest())
    h.update(canonical_json(list(ids)))
    return Sha256Digest("sha256:" + h.hexdigest())


# --- keys --------------------------------------------------------------------------------------


def local_key_path() -> Path:
    """The local signing key made once under ``$KVGRAFT_HOME`` for users who pass no ``--key``."""
    return kvgraft_home() / "keys" / "local.pem"


def ensure_local_key() -> tuple[Path, bool]:
    """The local key's path, creating the key on first use; the flag says whether it was made now."""
    path = local_key_path()
    if path.exists():
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    key = generate_private_key()
    save_private_key(key, path)
    save_public_key(key.public_key(), path.with_name("local.pem.pub"))
    return path, True


# --- writing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Captured:
    """What a capture wrote."""

    directory: Path
    statement: KvArtifactStatement
    kv_digest: Sha256Digest
    keyid: str


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_artifact(
    out: Path,
    *,
    model: LoadedModel,
    profile: DeterminismProfile,
    state: KVState,
    start: int,
    last_logits: torch.Tensor,
    text: str,
    parent: LoadedArtifact | None,
    key: Path,
    passphrase: bytes | None = None,
) -> Captured:
    """Write ``state``'s positions ``[start, end)`` as a signed artifact at ``out`` (atomically)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ArtifactError(f"{out} already exists and is not an empty directory", hint="choose a new --out directory")
    data = serialize(state.export(start), _KV_METADATA)
    kv_digest = sha256_bytes(data)
    ids = state.token_ids[start:]
    statement = KvArtifactStatement(
        subject=[Subject(name=KV_FILE, digest=SubjectDigest(sha256=hex_of(kv_digest)))],
        predicate=KvArtifactPredicate(
            model=model.ref,
            tokenizer_digest=model.tokenizer_digest,
            profile=profile,
            parent=parent.kv_digest if parent else None,
            chain_key=chain_key(parent.statement.predicate.chain_key if parent else None, model.ref, model.tokenizer_digest, profile, ids),
            tokens=TokenSpan(ids=ids, digest=token_digest(ids)),
            positions=PositionRange(start=start, end=state.end),
            source_text=SourceText(digest=sha256_bytes(text.encode("utf-8")), text=text),
            next_token_logits_digest=logits_digest(last_logits),
            engine_versions={"kvgraft": kvgraft.__version__, "torch": torch.__version__, "transformers": profile.transformers_version},
            created=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        ),
    )
    with open_signing_key(key, passphrase) as signer:
        envelope = sign_statement(statement, [signer])
        keyid = signer.keyid
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        for name, content in ((KV_FILE, data), (STATEMENT_FILE, envelope_json(envelope))):
            with (tmp / name).open("wb") as f:
                f.write(content)
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
        _fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _remember(out, kv_digest)
    return Captured(out, statement, kv_digest, keyid)


# --- the local index: where artifacts live, by their tensors' digest -------------------------------


def _index_path(kv_digest: Sha256Digest) -> Path:
    return kvgraft_home() / "index" / hex_of(kv_digest)


def _remember(directory: Path, kv_digest: Sha256Digest) -> None:
    # The index only points; whatever it points at is re-verified when used.
    path = _index_path(kv_digest)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(str(directory.resolve()))
    os.replace(tmp, path)


def find_artifact(kv_digest: Sha256Digest, near: Path) -> Path:
    """Where the artifact whose tensors have ``kv_digest`` lives: the local index, or a sibling."""
    candidates = []
    with contextlib.suppress(OSError):
        candidates.append(Path(_index_path(kv_digest).read_text().strip()))
    candidates += [p for p in near.parent.iterdir() if p.is_dir()] if near.parent.is_dir() else []
    for c in candidates:
        kv = c / KV_FILE
        if kv.is_file() and sha256_bytes(kv.read_bytes()) == kv_digest:
            return c
    raise ArtifactError(
        f"the parent artifact {kv_digest} of {near} was not found",
        hint="keep the parent's directory beside the child's, or capture the parent on this machine",
    )


# --- reading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadedArtifact:
    """An artifact whose statement and tensors have been checked, with its parent chain."""

    directory: Path
    statement: KvArtifactStatement
    kv_digest: Sha256Digest
    tensors: dict[str, torch.Tensor]
    parent: LoadedArtifact | None
    signature: str

    @property
    def chain(self) -> list[LoadedArtifact]:
        """Root first."""
        return [*(self.parent.chain if self.parent else []), self]

    def segments(self) -> list[Segment]:
        """The chain as KV segments."""
        return [
            Segment(a.tensors, a.statement.predicate.positions.start, a.statement.predicate.positions.end, tuple(a.statement.predicate.tokens.ids))
            for a in self.chain
        ]


def _read_statement(directory: Path, trusted: TrustedKeys | None) -> tuple[KvArtifactStatement, str]:
    env_path = directory / STATEMENT_FILE
    try:
        envelope = read_envelope(env_path)
        if trusted is not None:
            verified, statement = verify_statement_envelope(envelope, trusted)
            signature = "verified: " + ", ".join(k.name for k in verified.signers)
        else:
            statement = parse_statement(b64decode_any(envelope.payload, what="envelope payload"), what=f"statement in {env_path}")
            signature = "not checked (no trusted keys given)"
    except (VerificationError, DocumentError) as e:
        raise ArtifactError(f"artifact {directory}: {e}") from e
    if not isinstance(statement, KvArtifactStatement):
        raise ArtifactError(f"{env_path} is a {statement.predicate_type} statement, not a KV artifact")
    return statement, signature


def load_artifact(
    directory: Path,
    model: LoadedModel,
    profile: DeterminismProfile,
    *,
    trusted: TrustedKeys | None = None,
    parent: LoadedArtifact | None = None,
    _depth: int = 0,
) -> LoadedArtifact:
    """Load and check an artifact and its parent chain for grafting into ``model``/``profile``.

    ``parent``: an already loaded (and so already checked) artifact to use as the parent when the
    statement names its digest, instead of finding and re-reading it (a library's shared prefix).
    """
    if not directory.is_dir():
        raise ArtifactError(f"artifact directory {directory} does not exist or is not a directory")
    if _depth > 10_000:
        raise ArtifactError("the parent chain is longer than 10000 artifacts (a cycle?)")
    statement, signature = _read_statement(directory, trusted)
    subjects = {s.name: s for s in statement.subject}
    if set(subjects) != {KV_FILE}:
        raise ArtifactError(f"{directory}: the statement's subjects are {sorted(subjects)}, expected only {KV_FILE}")
    try:
        data = (directory / KV_FILE).read_bytes()
    except OSError as e:
        raise ArtifactError(f"cannot read {directory / KV_FILE}: {e.strerror}") from e
    kv_digest = sha256_bytes(data)
    if hex_of(kv_digest) != subjects[KV_FILE].digest.sha256:
        raise ArtifactError(
            f"{directory / KV_FILE} has digest {kv_digest}, but the statement says sha256:{subjects[KV_FILE].digest.sha256}",
            hint="the tensors were altered or replaced; fetch the artifact again",
        )
    p = statement.predicate
    require_same(
        artifact_model=p.model, model=model.ref, artifact_tokenizer=p.tokenizer_digest, tokenizer=model.tokenizer_digest,
        artifact_profile=p.profile, profile=profile,
    )
    if p.parent is None:
        parent = None
    elif parent is not None and parent.kv_digest == p.parent:
        pass  # checked when it was loaded; the chain key below still ties it to this artifact
    else:
        parent = load_artifact(find_artifact(p.parent, directory), model, profile, trusted=trusted, _depth=_depth + 1)
    if parent is not None:
        expected_key = chain_key(parent.statement.predicate.chain_key, p.model, p.tokenizer_digest, p.profile, p.tokens.ids)
        if parent.statement.predicate.positions.end != p.positions.start or expected_key != p.chain_key:
            raise ArtifactError(f"{directory}: its parent {p.parent} does not lead to it (positions or chain key differ)", hint="wrong parent")
    elif p.positions.start != 0 or p.chain_key != chain_key(None, p.model, p.tokenizer_digest, p.profile, p.tokens.ids):
        raise ArtifactError(f"{directory}: a root artifact must start at 0 and carry its own chain key")
    if token_digest(p.tokens.ids) != p.tokens.digest:
        raise ArtifactError(f"{directory}: the token ids do not match their digest")
    try:
        tensors, _ = deserialize(data, source=str(directory / KV_FILE))
    except KvFileError as e:
        raise ArtifactError(str(e.message)) from e
    return LoadedArtifact(directory, statement, kv_digest, tensors, parent, signature)
