"""Capture a KV state to a signed artifact directory, and load one back, checked, for a graft.

An artifact directory holds exactly ``kv.safetensors`` and ``statement.dsse.json``. It appears
under its final name only when complete (built in a temp dir, fsynced, renamed). Loading checks,
for every artifact of the parent chain (walked iteratively, bounded, cycles refused): the
statement's signature against trusted keys (always, unless the caller explicitly opts out with
``insecure_skip_verify``), then model, tokenizer and profile; meanwhile each tensors file is
read into private memory and hashed (on ``HASH_WORKERS`` threads), and its sha256 must be the
statement's. Then each child must start at its parent's end under the chain key its parent leads
to, token ids must be in the vocabulary and every tensor finite: all before any tensor is used.
Capture refuses to sign a state that would fail those last checks.
"""

from __future__ import annotations

import datetime as dt
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import kvgraft
from kvgraft.schemas import (
    KV_FILE,
    STATEMENT_FILE,
    DeterminismProfile,
    DocumentError,
    KvArtifactPredicate,
    KvArtifactStatement,
    PositionRange,
    Sha256Digest,
    SourceText,
    Subject,
    SubjectDigest,
    TokenSpan,
    artifact_candidates,
    chain_key,
    hex_of,
    prefixed,
    remember_artifact,
    sha256_bytes,
    statement_unverified,
    token_digest,
    write_staged_directory,
)
from kvgraft.verifier import (
    MalformedInputError,
    TrustedKeys,
    VerificationError,
    envelope_json,
    generate_private_key,
    open_signing_key,
    read_envelope,
    save_private_key,
    save_public_key,
    sign_statement,
    verify_statement_envelope,
)

from .errors import (
    ArtifactError,
    ArtifactSignatureError,
    KvFileError,
    LineageError,
    NoTrustedKeysError,
    UnsafeTensorError,
)
from .kvfile import deserialize, read_hashed, serialize
from .kvstate import KVState, Segment
from .models import LoadedModel

if TYPE_CHECKING:
    from .llamacpp import LlamaCppModel, LlamaCppState
from .profiles import kv_dtype, require_same
from .trust import SKIPPED, local_key_path, local_public_key_path

_KV_METADATA = {"format": "kvgraft-kv-state/v1"}


def logits_digest(logits: torch.Tensor) -> Sha256Digest:
    """sha256 of float32 little-endian row-major bytes of ``logits``."""
    return sha256_bytes(logits.detach().to(torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes())


# --- keys --------------------------------------------------------------------------------------


def ensure_local_key() -> tuple[Path, bool]:
    """The local key's path, creating the key on first use; the flag says whether it was made now."""
    path = local_key_path()
    if path.exists():
        return path, False
    path.parent.mkdir(parents=True, exist_ok=True)
    key = generate_private_key()
    save_private_key(key, path)
    save_public_key(key.public_key(), local_public_key_path())
    return path, True


# --- writing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Captured:
    """What a capture wrote."""

    directory: Path
    statement: KvArtifactStatement
    kv_digest: Sha256Digest
    keyid: str


def write_artifact(
    out: Path,
    *,
    model: LoadedModel | LlamaCppModel,
    profile: DeterminismProfile,
    state: KVState | LlamaCppState,
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
    ids = state.token_ids[start:]
    exported = state.export(start)
    # Never sign what could not be grafted back: ids outside the vocabulary, NaN or Inf state.
    check_token_ids(ids, start, model.vocab_size, f"capture into {out}")
    check_finite(exported, start, state.end, f"capture into {out}")
    data = serialize(exported, _KV_METADATA)
    kv_digest = sha256_bytes(data)
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
    write_staged_directory(out, {KV_FILE: data, STATEMENT_FILE: envelope_json(envelope)}, replace_empty=True)
    remember_artifact(out, kv_digest)
    return Captured(out, statement, kv_digest, keyid)


# --- the local index: where artifacts live, by their tensors' digest -------------------------------


@dataclass(frozen=True)
class Hashed:
    """A kv file's bytes as read into private memory (``read_hashed``'s buffer), their sha256,
    and what scanning them for non-finite values while they were hashed found."""

    data: memoryview
    digest: Sha256Digest
    scan: FiniteScan


def find_artifact(
    kv_digest: Sha256Digest, near: Path, digests: dict[Path, Sha256Digest | None] | None = None,
    *, finite_as: torch.dtype = torch.float32,
) -> tuple[Path, Hashed]:
    """Where the artifact whose tensors have ``kv_digest`` lives (the local index, or a sibling),
    and its kv file's bytes as they were hashed to find it (``read_hashed``'s private buffer,
    scanned for non-finite ``finite_as`` values on the way): the caller uses those bytes, so the
    file that was found is the file that is used, read and hashed once.

    ``digests`` remembers each candidate that did not match across the calls of one chain walk,
    so a deep chain hashes each sibling once, not once per link.
    """
    memo: dict[Path, Sha256Digest | None] = {} if digests is None else digests
    # The index only points; whatever it points at is hashed here.
    for c in artifact_candidates(kv_digest, near):
        if c in memo and memo[c] != kv_digest:
            continue
        kv = c / KV_FILE
        try:
            if not kv.is_file():
                memo[c] = None
                continue
            scan = FiniteScan(finite_as)
            data, digest = read_hashed(kv, each_chunk=scan)
        except (OSError, KvFileError):
            memo[c] = None
            continue
        memo[c] = digest
        if digest == kv_digest:
            return c, Hashed(data, digest, scan)
    raise ArtifactError(
        f"the parent artifact {kv_digest} of {near} was not found",
        hint="keep the parent's directory beside the child's, or capture the parent on this machine",
    )


# --- reading -----------------------------------------------------------------------------------

#: The longest parent chain ``load_artifact`` walks (a library's chain is 2 deep; the registry's
#: ``max_lineage_depth`` defaults to the same). A longer chain, or a cycle, is refused.
DEFAULT_MAX_CHAIN_DEPTH = 256


@dataclass(frozen=True)
class LoadedArtifact:
    """An artifact whose statement and tensors have been checked, with its parent chain."""

    directory: Path
    statement: KvArtifactStatement
    kv_digest: Sha256Digest
    tensors: dict[str, torch.Tensor]
    parent: LoadedArtifact | None
    #: ``verified: <signer names>``, or ``skipped (--insecure-skip-verify)``.
    signature: str

    @property
    def chain(self) -> list[LoadedArtifact]:
        """Root first (walked iteratively: a chain is bounded by ``DEFAULT_MAX_CHAIN_DEPTH``, never by the stack)."""
        out: list[LoadedArtifact] = []
        node: LoadedArtifact | None = self
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def segments(self) -> list[Segment]:
        """The chain as KV segments."""
        return [
            Segment(a.tensors, a.statement.predicate.positions.start, a.statement.predicate.positions.end, tuple(a.statement.predicate.tokens.ids))
            for a in self.chain
        ]


def _no_keys(directory: Path) -> NoTrustedKeysError:
    return NoTrustedKeysError(
        f"{directory}: no trusted keys to check its signature against",
        hint="pass trusted=TrustedKeys (on the command line --trusted-keys FILE or --trust-local-key), "
        "or insecure_skip_verify=True (--insecure-skip-verify) to skip the check",
    )


def read_statement(directory: Path, trusted: TrustedKeys | None, skip: bool = False) -> tuple[KvArtifactStatement, str]:
    """An artifact's statement, its signature verified against ``trusted`` before the payload is
    parsed (or, only with ``skip``, parsed unchecked), and how the signature was checked."""
    env_path = directory / STATEMENT_FILE
    try:
        envelope = read_envelope(env_path)
    except VerificationError as e:
        raise ArtifactError(f"artifact {directory}: {e.message}", hint=e.hint) from e
    try:
        if trusted is not None:
            verified, statement = verify_statement_envelope(envelope, trusted)
            signature = "verified: " + ", ".join(k.name for k in verified.signers)
        elif skip:
            statement = statement_unverified(envelope, what=str(env_path))
            signature = SKIPPED
        else:
            raise _no_keys(directory)
    except MalformedInputError as e:
        raise ArtifactError(f"artifact {directory}: {e.message}", hint=e.hint) from e
    except VerificationError as e:
        raise ArtifactSignatureError(f"artifact {directory}: its signature is refused: {e.message}") from e
    except DocumentError as e:
        raise ArtifactError(f"artifact {directory}: {e}") from e
    if not isinstance(statement, KvArtifactStatement):
        raise ArtifactError(f"{env_path} is a {statement.predicate_type} statement, not a KV artifact")
    return statement, signature


def check_token_ids(ids: list[int] | tuple[int, ...], start: int, vocab_size: int, where: str) -> None:
    """Refuse a token id outside ``[0, vocab_size)``, naming its position."""
    for i, t in enumerate(ids):
        if not 0 <= t < vocab_size:
            raise UnsafeTensorError(
                f"{where}: token id {t} at position {start + i} is outside the model's vocabulary of {vocab_size} ids"
            )


def check_finite(
    tensors: dict[str, torch.Tensor], start: int, end: int, where: str, *, scanned: FiniteScan | None = None
) -> None:
    """Refuse a NaN or infinite value in any float tensor, naming the tensor and the position.

    Keys and values are ``[1, heads, tokens, head_dim]``: a full layer's tokens are the
    artifact's own positions ``[start, end)``, a sliding layer's (one with ``.seen``) the last
    ``tokens`` positions before ``end``. A tensor ``scanned`` covers (every element of its bytes
    already seen finite while they were hashed) is not read again.
    """
    for name in sorted(tensors):
        t = tensors[name]
        if not t.is_floating_point() or t.numel() == 0:
            continue
        if scanned is not None and scanned.covers(t):
            continue
        # One pass in the tensor's own dtype: a NaN makes both extremes NaN (aminmax propagates
        # it) and an infinity is an extreme; only then look for where. (A float32 sum of a
        # half-precision tensor converted every element first: 3x slower on bfloat16.) The two
        # extremes are judged as Python floats: three more tensor ops per tensor cost as much as
        # the pass itself on a 4K-token artifact's 240 tensors.
        low, high = torch.aminmax(t)
        if math.isfinite(low.item()) and math.isfinite(high.item()):
            continue
        index = tuple(int(x) for x in (~torch.isfinite(t)).nonzero()[0])
        value = float(t[index])
        where_at = f"index {list(index)}"
        if t.dim() == 4:
            layer = name.rsplit(".", 1)[0]
            first = end - t.shape[2] if f"{layer}.seen" in tensors else start
            where_at = f"position {first + index[2]} (index {list(index)})"
        raise UnsafeTensorError(f"{where}: tensor {name} holds {value} at {where_at}; KV state must be finite")


class FiniteScan:
    """Where a buffer, read as ``dtype`` from its first byte on, holds only finite values,
    learnt chunk by chunk while the buffer is hashed (``read_hashed``'s ``each_chunk``), when its
    bytes are still in the CPU's cache: ``check_finite`` then need not read a covered tensor's
    bytes again (on a 4K-token bfloat16 chain that second pass, from memory, took 11-14 ms).

    Sound by construction, not by the file's layout: the scan sees every whole ``dtype`` element
    of the buffer on the grid that starts at its first byte, and where a chunk holds a value that
    is not finite it marks the ``BLOCK``-byte blocks that do (the safetensors header's bytes can
    read as an infinity in float16: ``}`` is ``0x7D``). A tensor is covered only when it is a
    contiguous ``dtype`` view of the scanned bytes, its first element on the grid, touching no
    marked block (``covers``). A tensor in another dtype, a copy (``deserialize`` copies a
    misaligned one) or anything off the grid or on a marked block is checked on its own, which
    refuses it naming the tensor and position if it is not finite; a chunk out of order, or more
    than ``MAX_MARKED`` marked blocks, turns the scan off and every tensor is checked. The result
    counts only once the buffer's digest has been compared: the scan itself acts on nothing.
    """

    #: Bytes per marked block (a multiple of every element size).
    BLOCK = 4096
    #: Marked blocks kept before the scan gives up and leaves every tensor to ``check_finite``.
    MAX_MARKED = 64

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._itemsize = torch.empty(0, dtype=dtype).element_size()
        #: The buffer's first byte's address, from the first chunk; 0 until then.
        self._base = 0
        #: Bytes of the buffer seen so far, and the end of the whole elements scanned in them.
        self._seen = 0
        self._covered = 0
        #: Offsets (from the buffer's first byte) of the blocks holding a value that is not finite.
        self._marked: list[int] = []
        self._on = dtype.is_floating_point

    def __call__(self, chunk: memoryview) -> None:
        """Scan the next chunk (``read_hashed`` calls this on its hashing thread)."""
        if not self._on or not len(chunk):
            return
        bytes_ = torch.frombuffer(chunk, dtype=torch.uint8)  # a view, no copy
        if self._seen == 0:
            self._base = bytes_.data_ptr()
        start = self._seen
        if start % self.BLOCK or bytes_.data_ptr() != self._base + start:
            self._on = False  # off the grid, or not the next chunk: cover nothing
            return
        self._seen += len(chunk)
        count = len(chunk) // self._itemsize
        values = bytes_[: count * self._itemsize].view(self.dtype)  # [count]
        # The same one-pass test as check_finite's: a NaN or an infinity is an extreme.
        low, high = torch.aminmax(values)
        if not (math.isfinite(low.item()) and math.isfinite(high.item())):
            self._mark(values, start)
        self._covered = start + count * self._itemsize

    def _mark(self, values: torch.Tensor, start: int) -> None:
        """Mark the blocks of a chunk (``values``, from byte ``start``) that hold a value that is
        not finite: each block's extremes in one more pass over the chunk, still in cache (a
        float16 file's first chunk comes here for its header's sake)."""
        per = self.BLOCK // self._itemsize
        full = values.numel() // per
        if full:
            low, high = torch.aminmax(values[: full * per].view(full, per), dim=1)  # [full] each
            bad = (~(torch.isfinite(low) & torch.isfinite(high))).nonzero().flatten()  # [marked]
            self._marked.extend(start + int(i) * self.BLOCK for i in bad)
        if values.numel() > full * per:  # the last, partial block
            low, high = torch.aminmax(values[full * per :])
            if not (math.isfinite(low.item()) and math.isfinite(high.item())):
                self._marked.append(start + full * self.BLOCK)
        if len(self._marked) > self.MAX_MARKED:
            self._on = False

    def covers(self, t: torch.Tensor) -> bool:
        """Whether every element of ``t`` was scanned and found finite."""
        if not self._on or t.dtype != self.dtype or not t.is_contiguous() or t.device.type != "cpu":
            return False
        offset = t.data_ptr() - self._base
        end = offset + t.numel() * self._itemsize
        if offset < 0 or offset % self._itemsize or end > self._covered:
            return False
        return not any(offset < m + self.BLOCK and m < end for m in self._marked)


#: Threads that read and hash a chain's kv files at once: ``readinto`` and hashlib's sha256
#: release the GIL, so a chain of several files verifies in about the time of its largest.
HASH_WORKERS = max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class _Read:
    directory: Path
    statement: KvArtifactStatement
    signature: str
    #: The kv file read into private memory, hashed and scanned (``_hash_kv``), being
    #: computed: ``deserialize``'s tensors view the bytes.
    kv: Future[Hashed]


def _hash_kv(directory: Path, dtype: torch.dtype) -> Hashed:
    """``directory``'s kv file read, hashed and scanned for non-finite ``dtype`` values, a
    failure as the ``ArtifactError`` it is."""
    scan = FiniteScan(dtype)
    try:
        data, digest = read_hashed(directory / KV_FILE, each_chunk=scan)
    except OSError as e:
        raise ArtifactError(f"cannot read {directory / KV_FILE}: {e.strerror}") from e
    except KvFileError as e:
        raise ArtifactError(e.message, hint=e.hint) from e
    return Hashed(data, digest, scan)


def _done(result: Hashed) -> Future[Hashed]:
    """A kv file already read and hashed (``find_artifact``'s), as the future the walk holds."""
    f: Future[Hashed] = Future()
    f.set_result(result)
    return f


def _read_statement_of(
    directory: Path, model: LoadedModel | LlamaCppModel, profile: DeterminismProfile, trusted: TrustedKeys | None, skip: bool
) -> tuple[KvArtifactStatement, str]:
    """One artifact's statement (signature first) and its model/tokenizer/profile fit."""
    if not directory.is_dir():
        raise ArtifactError(f"artifact directory {directory} does not exist or is not a directory")
    statement, signature = read_statement(directory, trusted, skip)
    subjects = [s.name for s in statement.subject]
    if subjects != [KV_FILE]:
        raise ArtifactError(f"{directory}: the statement's subjects are {sorted(subjects)}, expected only {KV_FILE}")
    p = statement.predicate
    require_same(
        artifact_model=p.model, model=model.ref, artifact_tokenizer=p.tokenizer_digest, tokenizer=model.tokenizer_digest,
        artifact_profile=p.profile, profile=profile,
    )
    return statement, signature


def _checked_bytes(r: _Read) -> Hashed:
    """``r``'s kv bytes once their sha256 is the one its (verified) statement names."""
    hashed = r.kv.result()
    named = r.statement.subject[0].digest.sha256
    if hex_of(hashed.digest) != named:
        raise ArtifactError(
            f"{r.directory / KV_FILE} has digest {hashed.digest}, but the statement says sha256:{named}",
            hint="the tensors were altered or replaced; fetch the artifact again",
        )
    return hashed


def load_artifact(
    directory: Path,
    model: LoadedModel | LlamaCppModel,
    profile: DeterminismProfile,
    *,
    trusted: TrustedKeys | None = None,
    insecure_skip_verify: bool = False,
    parent: LoadedArtifact | None = None,
    max_depth: int = DEFAULT_MAX_CHAIN_DEPTH,
) -> LoadedArtifact:
    """Load and check an artifact and its parent chain for grafting into ``model``/``profile``.

    Every artifact of the chain must be signed by ``trusted`` (checked before its statement is
    parsed); with no keys the load is refused (``NoTrustedKeysError``) unless the caller opts
    out with ``insecure_skip_verify=True``. The chain is walked iteratively, child to root, with
    a visited set (a cycle is refused) and at most ``max_depth`` artifacts. Each link must join
    up (the child starts at its parent's end, with the chain key its parent leads to); token ids
    must be in the model's vocabulary and every tensor finite, all before any tensor is used.

    ``parent``: an already loaded (and so already checked) artifact to use as the parent when the
    statement names its digest, instead of finding and re-reading it (a library's shared prefix).
    """
    if trusted is None and not insecure_skip_verify:
        raise _no_keys(directory)
    reads: list[_Read] = []  # child first
    seen: set[Sha256Digest] = set()
    digests: dict[Path, Sha256Digest | None] = {}
    # The dtype the profile stores K/V in: what the kv files are scanned for while hashed.
    stored = kv_dtype(profile)
    base: LoadedArtifact | None = None
    current = directory
    # Statements are read and checked on this thread, link by link; each kv file is read and
    # hashed on the pool meanwhile (a parent found by its bytes already was). Nothing of a
    # file is used before its digest is compared with its statement's, below.
    with ThreadPoolExecutor(max_workers=HASH_WORKERS, thread_name_prefix="kvgraft-hash") as pool:
        kv: Future[Hashed] | None = None
        while True:
            if len(reads) >= max_depth:
                raise LineageError(f"{directory}: its parent chain is longer than {max_depth} artifacts",
                                   hint="a chain this deep is not a real one (a library's is 2); capture a shorter chain")
            statement, signature = _read_statement_of(current, model, profile, trusted, insecure_skip_verify)
            named = prefixed(statement.subject[0].digest.sha256)
            reads.append(_Read(current, statement, signature, kv if kv is not None else pool.submit(_hash_kv, current, stored)))
            seen.add(named)
            p = statement.predicate
            if p.parent is None:
                break
            if p.parent in seen:
                raise LineageError(f"{directory}: its parent chain is a cycle: {current} names {p.parent} as its parent, "
                                   "which is already in the chain")
            if parent is not None and parent.kv_digest == p.parent:
                base = parent  # checked when it was loaded; the chain key below still ties it to the child
                break
            current, found = find_artifact(p.parent, current, digests, finite_as=stored)
            kv = _done(found)
        checked = [_checked_bytes(r) for r in reads]
    loaded = base
    vocab = model.vocab_size
    for r, hashed in zip(reversed(reads), reversed(checked), strict=True):
        p = r.statement.predicate
        if loaded is not None:
            lp = loaded.statement.predicate
            if lp.positions.end != p.positions.start:
                raise LineageError(
                    f"{r.directory}: it starts at position {p.positions.start}, but its parent {p.parent} "
                    f"ends at {lp.positions.end}",
                    hint="a child continues exactly where its parent ends; capture it with --parent",
                )
            if chain_key(lp.chain_key, p.model, p.tokenizer_digest, p.profile, p.tokens.ids) != p.chain_key:
                raise LineageError(f"{r.directory}: its parent {p.parent} does not lead to it (the chain key differs)",
                                   hint="wrong parent")
        elif p.positions.start != 0 or p.chain_key != chain_key(None, p.model, p.tokenizer_digest, p.profile,
                                                                 p.tokens.ids):
            raise LineageError(f"{r.directory}: a root artifact must start at 0 and carry its own chain key")
        if token_digest(p.tokens.ids) != p.tokens.digest:
            raise ArtifactError(f"{r.directory}: the token ids do not match their digest")
        check_token_ids(p.tokens.ids, p.positions.start, vocab, str(r.directory))
        try:
            tensors, _ = deserialize(hashed.data, source=str(r.directory / KV_FILE))
        except KvFileError as e:
            raise ArtifactError(str(e.message)) from e
        check_finite(tensors, p.positions.start, p.positions.end, str(r.directory / KV_FILE), scanned=hashed.scan)
        loaded = LoadedArtifact(r.directory, r.statement, hashed.digest, tensors, loaded, r.signature)
    if loaded is None:
        raise ArtifactError(f"{directory}: no artifact was read", hint="a bug: report it")
    return loaded
