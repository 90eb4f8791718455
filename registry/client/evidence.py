"""The client's evidence: the registry key, signed checkpoints, RFC 9162 proofs, and the
remembered checkpoint per log.

Every registry claim is checked here against bytes the client holds: an entry's digest and leaf
hash against its envelope, its inclusion proof against a checkpoint signed by the registry key,
and every checkpoint against the newest one this machine verified before for the same log
(``CheckpointMemory``, under ``$KVGRAFT_HOME``): one that does not provably extend it (RFC 9162
consistency proof) is refused, as Go's sumdb client refuses a forked checksum database.

With a witness policy (``--witness-policy FILE`` or ``$KVGRAFT_WITNESS_POLICY``: a
c2sp.org/tlog-policy file, docs/witness.md), a checkpoint counts only when it also carries valid
cosignatures from the witnesses the policy's quorum needs (``RegistryKey.verify``); the client asks
the registry for such a checkpoint (``/v1/log/checkpoint?witnessed=K``), proves entries against it,
and remembers only those. A past checkpoint is accepted when it is signed by the log and proved a
prefix of a witnessed one. A registry that forks its log then needs the witnesses to collude.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from kvgraft.schemas import EntryMeta, InclusionProof, kvgraft_home, write_atomic
from kvgraft.verifier import (
    Checkpoint,
    VerificationError,
    WitnessPolicy,
    WitnessQuorumError,
    hash_leaf,
    keyid_of,
    load_public_key,
    load_witness_policy,
    parse_public_key,
    public_key_pem,
    require_ed25519,
    verify_checkpoint,
    verify_consistency,
    verify_inclusion,
    verify_witnessed,
)

from .errors import (
    CheckpointMemoryError,
    EvidenceError,
    LocalFilesError,
    LogForkError,
    RegistryResponseError,
    UnwitnessedCheckpointError,
    malformed,
)

if TYPE_CHECKING:
    from .http import RegistryClient


# --- the registry key --------------------------------------------------------------------------


@dataclass(frozen=True)
class RegistryKey:
    """The key a registry's checkpoints must be signed with, and how it came to be trusted."""

    public_key: Ed25519PublicKey
    #: The log's origin when known (fetched from the registry); None for a pinned PEM, whose
    #: checkpoints are checked under their own origin line (the signature decides).
    origin: str | None
    #: True for a PEM the caller passed; False for a key fetched from the registry itself.
    pinned: bool
    #: The PEM file, or the URL the key was fetched from.
    source: str
    #: When set, a checkpoint must also meet this witness policy's quorum to be accepted.
    policy: WitnessPolicy | None = None

    @property
    def keyid(self) -> str:
        """The key's id (sha256 of its raw public key, hex)."""
        return str(keyid_of(self.public_key))

    @property
    def trust(self) -> str:
        """``pinned`` or ``trust-on-first-use``."""
        return "pinned" if self.pinned else "trust-on-first-use"

    def describe(self) -> str:
        """One phrase for the output."""
        witnessed = "" if self.policy is None else f", cosigned as {self.policy.source} requires ({self.policy.describe()})"
        if self.pinned:
            return f"registry key {self.keyid[:16]} (pinned: {self.source}){witnessed}"
        return (
            f"registry key {self.keyid[:16]} fetched from {self.source} (trust on first use: "
            f"save its public_key_pem and pass --registry-key to pin it){witnessed}"
        )

    def to_json(self) -> dict[str, Any]:
        """The key's identity for ``--json`` output."""
        return {
            "keyid": self.keyid,
            "origin": self.origin,
            "trust": self.trust,
            "source": self.source,
            "public_key_pem": public_key_pem(self.public_key).decode("ascii"),
            "witness_policy": None if self.policy is None else {
                "source": self.policy.source,
                "quorum": self.policy.describe(),
                "min_cosignatures": self.policy.min_cosignatures(),
            },
        }

    def _name(self, note: bytes) -> str:
        # Without a known origin the note's own first line names the key; a note signed by
        # anything but this key fails whatever it claims.
        return self.origin or note.split(b"\n", 1)[0].decode("utf-8", "replace")

    def verify(self, note: bytes, url: str) -> Checkpoint:
        """Verify a checkpoint note served by ``url``: signed by this key and, with a witness
        policy, cosigned as its quorum requires (``UnwitnessedCheckpointError`` otherwise)."""
        if self.policy is None:
            return self.verify_signed(note, url)
        try:
            witnessed = verify_witnessed(note, self._name(note), self.public_key, self.policy)
        except WitnessQuorumError as e:
            raise UnwitnessedCheckpointError(f"the checkpoint from {url} is not witnessed enough: {e.message}") from e
        except VerificationError as e:
            raise EvidenceError(
                f"the checkpoint from {url} does not verify with {self.describe()}: {e.message}",
                hint="pass the right --registry-key; if it is right, the registry's log or its cosignatures were tampered with",
            ) from e
        if self.origin is not None and witnessed.checkpoint.origin != self.origin:
            raise EvidenceError(f"the checkpoint from {url} is for log {witnessed.checkpoint.origin!r}, not {self.origin!r}")
        return witnessed.checkpoint

    def verify_signed(self, note: bytes, url: str) -> Checkpoint:
        """Verify that a checkpoint note served by ``url`` is signed by this key (cosignatures
        ignored: for a past checkpoint the caller proves a prefix of a witnessed one)."""
        try:
            return verify_checkpoint(note, self._name(note), self.public_key, origin=self.origin)
        except VerificationError as e:
            raise EvidenceError(
                f"the checkpoint from {url} does not verify with {self.describe()}: {e.message}",
                hint="pass the right --registry-key; if it is right, the registry's log was tampered with",
            ) from e


def registry_key(client: RegistryClient, pem: Path | None) -> RegistryKey:
    """The registry key: the PEM file ``pem`` (pinned), else the registry's own (trust on first use)."""
    if pem is not None:
        try:
            key = require_ed25519(load_public_key(pem), f"the registry key {pem}")
            return RegistryKey(key, None, True, str(pem), client.witness_policy)
        except VerificationError as e:
            raise LocalFilesError(
                f"--registry-key: {e.message}", hint="pass the registry's registry-key.pub.pem"
            ) from e
    doc = client.log_key()
    url = client.url + "/v1/log/key"
    try:
        source = f"the public key from {url}"
        key = require_ed25519(parse_public_key(doc.public_key_pem.encode("ascii", "replace"), source=source), source)
    except VerificationError as e:
        raise malformed(url, e.message) from e
    return RegistryKey(key, doc.origin, False, url, client.witness_policy)


#: The environment variable naming the witness policy file when ``--witness-policy`` is not given.
WITNESS_POLICY_ENV = "KVGRAFT_WITNESS_POLICY"


def witness_policy_from(path: Path | None) -> WitnessPolicy | None:
    """The witness policy of ``path``, else of ``$KVGRAFT_WITNESS_POLICY`` when set, else None.

    Raises ``LocalFilesError`` (one line, naming the file and line) when the policy is unusable.
    """
    if path is None:
        named = os.environ.get(WITNESS_POLICY_ENV)
        if not named:
            return None
        path = Path(named)
    try:
        return load_witness_policy(path)
    except VerificationError as e:
        raise LocalFilesError(f"--witness-policy: {e.message}", hint=e.hint) from e


# --- proofs ------------------------------------------------------------------------------------


def _path(hashes: Sequence[str]) -> list[bytes]:
    # The wire model checked each hash is 64 lowercase hex digits.
    return [bytes.fromhex(h) for h in hashes]


def prove_consistency(client: RegistryClient, old_size: int, old_root: bytes, new: Checkpoint, what: str) -> None:
    """Fetch the consistency proof from ``old_size`` to ``new.size`` and verify it against
    ``old_root`` and ``new``'s root (raises ``EvidenceError`` naming ``what`` was not proved)."""
    if old_size == new.size or old_size == 0:
        hashes: list[str] = []
    else:
        proof = client.consistency_proof(old_size, new.size)
        if proof.old_size != old_size or proof.new_size != new.size:
            raise EvidenceError(
                f"{client.url}/v1/log/proof/consistency: the proof is not from size {old_size} to size {new.size}"
            )
        hashes = proof.hashes
    try:
        verify_consistency(old_size, new.size, old_root, new.root_hash, _path(hashes))
    except VerificationError as e:
        raise EvidenceError(f"{what}: {e.message}") from e


def prove_extends(client: RegistryClient, old: Checkpoint, new: Checkpoint) -> None:
    """Verify the registry's consistency proof that checkpoint ``new`` extends ``old``."""
    prove_consistency(
        client,
        old.size,
        old.root_hash,
        new,
        f"{client.url}'s log at size {new.size} is not proved to extend its log at size {old.size}",
    )


def verify_entry_evidence(
    client: RegistryClient,
    url: str,
    envelope: bytes,
    entry: EntryMeta,
    proof: InclusionProof,
    note: str,
    key: RegistryKey,
) -> tuple[int, Checkpoint]:
    """Check that ``envelope`` is ``entry``, and is its leaf in the signed checkpoint ``note``.

    Returns (log index, checkpoint). Every registry claim is checked against the bytes, and the
    checkpoint against the one remembered for this log (``RegistryClient.remember``). With a
    witness policy on ``key`` the entry is proved instead against the newest witnessed checkpoint
    that holds it (``RegistryClient.witnessed_head``, waiting a bounded time for the witnesses),
    with an inclusion proof fetched at that checkpoint's size.
    """
    digest, index = entry.digest, entry.log_index
    got = "sha256:" + hashlib.sha256(envelope).hexdigest()
    if got != digest:
        raise EvidenceError(f"{url} says entry {index} has digest {digest}, but its envelope bytes hash to {got}")
    leaf = hash_leaf(envelope)
    if entry.leaf_hash != leaf.hex():
        raise EvidenceError(
            f"{url} says entry {index}'s leaf hash is {entry.leaf_hash}, but SHA-256(0x00 || envelope) is {leaf.hex()}"
        )
    if key.policy is not None:
        # The checkpoint beside the entry may not be cosigned yet (it is a publish's own, say).
        head, _ = client.witnessed_head(key, min_size=index + 1)
        proof = client.inclusion_proof(index, head.size)
    else:
        note_bytes = note.encode("utf-8")
        head = key.verify(note_bytes, url)
        # Served beside an entry, it may be a moment old: a smaller size must be proved a prefix.
        client.remember(key, head, note_bytes, latest=False)
    if proof.log_index != index or proof.tree_size != head.size:
        raise EvidenceError(
            f"{url}: the inclusion proof is for entry {proof.log_index} at tree size {proof.tree_size}, "
            f"but the entry is {index} and the checkpoint is at size {head.size}"
        )
    try:
        verify_inclusion(leaf, index, head.size, _path(proof.hashes), head.root_hash)
    except VerificationError as e:
        raise EvidenceError(f"{url}: entry {index} is not proved to be in the signed log: {e.message}") from e
    return index, head


# --- remembered checkpoints --------------------------------------------------------------------


class NoMemory:
    """Pass ``memory=NO_MEMORY`` to ``RegistryClient`` to remember nothing (tests of the log itself)."""


#: ``RegistryClient(memory=NO_MEMORY)``: no checkpoint is remembered or compared.
NO_MEMORY = NoMemory
#: Remembered logs of one key read at most when looking for another origin (a key signs one log).
_MAX_OTHER_ORIGINS = 16


@dataclass(frozen=True)
class RememberedHead:
    """The newest checkpoint verified for one log, as stored in its memory file."""

    head: Checkpoint
    note: bytes
    registry: str
    verified_at: str
    path: Path

    def describe(self) -> str:
        """One phrase: size, root and when and where it was verified."""
        return (
            f"tree size {self.head.size} with root {self.head.root_hash.hex()[:16]}, verified from {self.registry} "
            f"at {self.verified_at} (remembered in {self.path})"
        )


class CheckpointMemory:
    """The newest checkpoint this machine verified per log, one file per (key id, origin).

    A registry key signs one log: a key this machine verified under one origin that now signs a
    checkpoint under another (the log started over under a new ``--origin``, with the key and the
    URL kept) is refused as a ``LogForkError``, pinned and trust-on-first-use keys alike, unless
    ``accept_new_origin`` (``--accept-new-origin``: the operator renamed the log on purpose). The
    accepted origin is then remembered beside the old one, each checked on its own from then on.

    ``DIR/<keyid>.<sha256(origin)[:16]>.json`` holds ``{"format", "keyid", "origin",
    "tree_size", "root_hash", "checkpoint" (the signed note), "registry", "verified_at"}``,
    written atomically (temp file, fsync, rename) under an exclusive lock file beside it. The
    note is re-verified with the registry key on every read, so a damaged file is an error,
    never a silent reset. Invariant: the remembered tree size only grows, and only by a
    verified RFC 9162 consistency proof.
    """

    FORMAT = "kvgraft-checkpoint-memory/v1"

    def __init__(self, directory: Path, *, accept_new_origin: bool = False) -> None:
        self.directory = directory
        self.accept_new_origin = accept_new_origin

    @classmethod
    def default(cls, *, accept_new_origin: bool = False) -> CheckpointMemory:
        """``$KVGRAFT_HOME/checkpoints``."""
        return cls(kvgraft_home() / "checkpoints", accept_new_origin=accept_new_origin)

    def path(self, keyid: str, origin: str) -> Path:
        """The memory file of the log ``origin`` signed by key ``keyid``."""
        return self.directory / f"{keyid}.{hashlib.sha256(origin.encode()).hexdigest()[:16]}.json"

    @contextlib.contextmanager
    def _locked(self, path: Path) -> Iterator[None]:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise CheckpointMemoryError(f"cannot open the checkpoint memory {path}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def load(self, key: RegistryKey, origin: str) -> RememberedHead | None:
        """The remembered head of ``origin`` under ``key``, re-verified; None when there is none."""
        path = self.path(key.keyid, origin)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise CheckpointMemoryError(f"cannot read the remembered checkpoint {path}: {e.strerror}") from e
        try:
            doc = json.loads(raw)
            note = doc["checkpoint"].encode("utf-8")
            head = verify_checkpoint(note, origin, key.public_key, origin=origin)
            return RememberedHead(head, note, str(doc["registry"]), str(doc["verified_at"]), path)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError, VerificationError) as e:
            raise CheckpointMemoryError(
                f"the remembered checkpoint {path} is damaged or not signed by {key.describe()}: {e}",
            ) from e

    def other_origins(self, key: RegistryKey, origin: str) -> list[tuple[str, RememberedHead]]:
        """The logs other than ``origin`` remembered under ``key`` (origin, re-verified head), by origin.

        At most ``_MAX_OTHER_ORIGINS`` files are read (a key signs one log; more is a damaged
        memory directory, and a refusal needs only one).
        """
        found: list[tuple[str, RememberedHead]] = []
        mine = self.path(key.keyid, origin)
        try:
            paths = sorted(p for p in self.directory.glob(f"{key.keyid}.*.json") if p != mine)
        except OSError as e:
            raise CheckpointMemoryError(f"cannot list the checkpoint memory {self.directory}: {e.strerror}") from e
        for path in paths[:_MAX_OTHER_ORIGINS]:
            try:
                doc = json.loads(path.read_bytes())
                other = doc["origin"]
            except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
                raise CheckpointMemoryError(f"the remembered checkpoint {path} is damaged: {e}") from e
            if not isinstance(other, str) or self.path(key.keyid, other) != path:
                raise CheckpointMemoryError(f"the remembered checkpoint {path} is damaged: it names another log than its file")
            remembered = self.load(key, other)
            if remembered is not None:
                found.append((other, remembered))
        return found

    def _save(self, key: RegistryKey, head: Checkpoint, note: bytes, registry: str) -> None:
        path = self.path(key.keyid, head.origin)
        doc = {
            "format": self.FORMAT,
            "keyid": key.keyid,
            "origin": head.origin,
            "tree_size": head.size,
            "root_hash": head.root_hash.hex(),
            "checkpoint": note.decode("utf-8"),
            "registry": registry,
            "verified_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        try:
            write_atomic(path, json.dumps(doc, indent=2).encode() + b"\n", 0o644)
        except OSError as e:
            raise CheckpointMemoryError(f"cannot write the remembered checkpoint {path}: {e.strerror}") from e

    def check(self, client: RegistryClient, key: RegistryKey, head: Checkpoint, note: bytes, *, latest: bool) -> None:
        """Refuse ``head`` (verified with ``key``) unless it provably extends the remembered head,
        or, when it is not ``latest``, is provably a prefix of it; remember it when newer.

        A latest head smaller than the remembered one is a rollback; one of the same size with
        another root is a split view; a larger one needs the registry's consistency proof from
        the remembered size (``LogForkError`` otherwise).
        """
        path = self.path(key.keyid, head.origin)
        with self._locked(path):
            known = self.load(key, head.origin)
            if known is None:
                others = self.other_origins(key, head.origin)
                if others and not self.accept_new_origin:
                    origin, other = others[0]
                    raise LogForkError(
                        f"possible log restart: {client.url} signs log {head.origin!r} at tree size {head.size} with "
                        f"registry key {key.keyid[:16]}, but this machine verified that key's log as {origin!r}: "
                        f"{other.describe()}; a registry key signs one log, and a log started over under a new "
                        "origin can drop entries",
                        hint="do not use this registry's answers; only if its operator confirms the log was renamed "
                        "on purpose, run the command again with --accept-new-origin (the new origin is then "
                        "remembered beside the old one)",
                    )
                self._save(key, head, note, client.url)
                return
            old = known.head
            if head.size == old.size:
                if head.root_hash != old.root_hash:
                    raise LogForkError(
                        f"possible split view: {client.url} signed log {head.origin!r} at tree size {head.size} with root "
                        f"{head.root_hash.hex()[:16]}, but this machine verified another root at that size: {known.describe()}"
                    )
                return
            if head.size < old.size:
                if latest:
                    raise LogForkError(
                        f"possible rollback: {client.url} says log {head.origin!r} is at tree size {head.size}, "
                        f"but this machine verified {known.describe()}; the log lost entries or runs from an old copy"
                    )
                try:
                    client.verify_extends(head, old)
                except (EvidenceError, RegistryResponseError) as e:
                    raise LogForkError(
                        f"possible rollback or split view: {client.url} cannot prove that its tree at size {head.size} is a "
                        f"prefix of the one this machine verified, {known.describe()}: {e.message}"
                    ) from e
                return
            try:
                client.verify_extends(old, head)
            except (EvidenceError, RegistryResponseError) as e:
                raise LogForkError(
                    f"possible split view: {client.url}'s log {head.origin!r} at tree size {head.size} is not proved to "
                    f"extend the one this machine verified, {known.describe()}: {e.message}"
                ) from e
            self._save(key, head, note, client.url)
