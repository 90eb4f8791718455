"""Backend of ``kvgraft-verify log``: check a registry's log proofs offline.

    kvgraft-verify log --checkpoint FILE --registry-key PEM
                       (--inclusion PROOF ENTRY | --consistency PROOF OLD_CHECKPOINT) [--origin NAME]
                       [--witness-policy POLICY]

Files:

- CHECKPOINT, OLD_CHECKPOINT: the registry's signed checkpoint, byte for byte as served: a
  c2sp.org/tlog-checkpoint note (origin, tree size, base64 root hash) in a c2sp.org/signed-note
  envelope, signed with the registry's Ed25519 key under the origin as key name.
- PEM: the registry's Ed25519 public key (SubjectPublicKeyInfo PEM).
- inclusion PROOF: a JSON object with exactly these members::

      {"log_index": 12, "tree_size": 40, "hashes": ["<64 lowercase hex>", ...]}

  ``hashes`` is the RFC 9162 inclusion path, deepest sibling first; ``tree_size`` must be the
  checkpoint's size.
- consistency PROOF: a JSON object with exactly these members::

      {"old_size": 30, "new_size": 40, "hashes": ["<64 lowercase hex>", ...]}

  ``hashes`` is the RFC 9162 consistency proof; the sizes must be those of OLD_CHECKPOINT and
  CHECKPOINT.
- POLICY: a c2sp.org/tlog-policy witness policy (``witness``, ``group`` and ``quorum`` lines; see
  ``witness.py`` and docs/witness.md): CHECKPOINT must then also carry valid witness cosignatures
  meeting its quorum (``WitnessQuorumError`` otherwise).
- ENTRY: the log entry's bytes exactly as the registry stored them, i.e. the DSSE envelope JSON
  bytes that were posted. The log's leaf is ``SHA-256(0x00 || those bytes)``; any re-encoding of
  the JSON (whitespace, key order) changes the leaf and fails the proof.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from kvgraft.schemas import DocumentError, parse_json

from .errors import LogProofError, MalformedInputError, VerificationError
from .files import read_input
from .keys import load_public_key, require_ed25519
from .tlog import (
    HASH_SIZE,
    MAX_NOTE_BYTES,
    MAX_TREE_SIZE,
    Checkpoint,
    parse_checkpoint,
    parse_signed_note,
    verify_checkpoint,
    verify_consistency,
    verify_inclusion,
)
from .witness import load_witness_policy, verify_witnessed

#: Proof files are a few kilobytes: at most 2 * 64 hashes of 64 hex digits.
_MAX_PROOF_FILE = 64 * 1024
#: A consistency proof between uint64 sizes has at most 2 * 64 hashes; refuse longer lists early.
_MAX_PROOF_HASHES = 128
_HEX_HASH = re.compile(r"[0-9a-f]{64}", re.ASCII)
_CHUNK = 1 << 20

INCLUSION_KEYS = ("log_index", "tree_size", "hashes")
_CONSISTENCY_KEYS = ("old_size", "new_size", "hashes")


def inclusion_proof_document(log_index: int, tree_size: int, hashes: list[bytes]) -> dict[str, Any]:
    """The inclusion PROOF file's JSON object, as the registry should serve it."""
    return {"log_index": log_index, "tree_size": tree_size, "hashes": [h.hex() for h in hashes]}


def consistency_proof_document(old_size: int, new_size: int, hashes: list[bytes]) -> dict[str, Any]:
    """The consistency PROOF file's JSON object, as the registry should serve it."""
    return {"old_size": old_size, "new_size": new_size, "hashes": [h.hex() for h in hashes]}


def _entry_leaf_hash(path: Path) -> bytes:
    # Streamed: an entry can be large, and its leaf hash needs no more than one pass.
    h = hashlib.sha256(b"\x00")
    try:
        if path.is_dir():
            raise MalformedInputError(f"entry {path} is a directory, not a file", hint="pass the entry's envelope file")
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
            empty = f.tell() == 0
    except FileNotFoundError as e:
        raise MalformedInputError(f"entry {path} does not exist") from e
    except OSError as e:
        raise MalformedInputError(f"cannot read entry {path}: {e.strerror}") from e
    if empty:
        raise MalformedInputError(f"entry {path} is empty", hint="pass the entry's envelope bytes as the registry stored them")
    return h.digest()


def proof_object(path: Path, kind: str, keys: tuple[str, ...]) -> dict[str, Any]:
    """The JSON proof file at ``path``: an object with exactly ``keys`` (``INCLUSION_KEYS`` or the
    consistency proof's), or a one-line ``MalformedInputError``."""
    what = f"{kind} proof"
    try:
        doc = parse_json(read_input(path, what, limit=_MAX_PROOF_FILE), what=f"{what} {path}")
    except DocumentError as e:
        raise MalformedInputError(str(e)) from e
    if not isinstance(doc, dict):
        raise MalformedInputError(f"{what} {path} must be a JSON object, got {type(doc).__name__}")
    other = _CONSISTENCY_KEYS if keys == INCLUSION_KEYS else INCLUSION_KEYS
    if set(doc) == set(other):
        other_kind = "consistency" if kind == "inclusion" else "inclusion"
        raise MalformedInputError(
            f"{what} {path} is {'an' if other_kind == 'inclusion' else 'a'} {other_kind} proof",
            hint=f"pass it with --{other_kind}, or pass the {kind} proof",
        )
    missing = [k for k in keys if k not in doc]
    extra = sorted(k for k in doc if k not in keys)
    if missing or extra:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(extra)}"] if extra else [])
        raise MalformedInputError(
            f"{what} {path}: {'; '.join(parts)}", hint=f"a {what} is a JSON object with exactly {', '.join(keys)}"
        )
    for key in keys[:2]:
        value = doc[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TREE_SIZE:
            raise MalformedInputError(f"{what} {path}: {key} must be an integer from 0 to 2^64-1, got {value!r}")
    hashes = doc["hashes"]
    if not isinstance(hashes, list):
        raise MalformedInputError(f"{what} {path}: hashes must be a list of hex strings, got {type(hashes).__name__}")
    if len(hashes) > _MAX_PROOF_HASHES:
        raise MalformedInputError(f"{what} {path} has {len(hashes)} hashes; no log proof has more than {_MAX_PROOF_HASHES}")
    decoded = []
    for i, item in enumerate(hashes):
        if not isinstance(item, str) or not _HEX_HASH.fullmatch(item):
            shown = repr(item) if len(repr(item)) <= 80 else repr(item)[:77] + "..."
            raise MalformedInputError(f"{what} {path}: hashes[{i}] = {shown} is not {2 * HASH_SIZE} lowercase hex digits")
        decoded.append(bytes.fromhex(item))
    return {**doc, "hashes": decoded}


def read_checkpoint(path: Path, what: str) -> bytes:
    """A checkpoint note file's bytes, at most ``MAX_NOTE_BYTES``."""
    return read_input(path, what, limit=MAX_NOTE_BYTES)


@contextlib.contextmanager
def about_file(what: str, path: Path) -> Iterator[None]:
    """Re-raise a ``VerificationError`` in the block with the file it is about named."""
    # Name the file in the one-line error: with two checkpoints, "the note" alone is ambiguous.
    try:
        yield
    except VerificationError as e:
        raise type(e)(f"{what} {path}: {e.message}", hint=e.hint) from e


def unverified_origin(note: bytes) -> str:
    """The origin line of a checkpoint note, read before any signature is checked."""
    # Only picks the key name to look for; the signature by the pinned key decides whether the
    # checkpoint (origin line included) is genuine.
    return parse_checkpoint(parse_signed_note(note).text).origin


def verify_log_command(
    checkpoint: Path,
    registry_key: Path,
    inclusion: tuple[Path, Path] | None,
    consistency: tuple[Path, Path] | None,
    origin: str | None,
    witness_policy: Path | None = None,
) -> dict[str, Any]:
    """Verify a signed checkpoint, then an inclusion proof (PROOF, ENTRY) and/or a consistency
    proof (PROOF, OLD_CHECKPOINT) against it; return the result with a one-line ``summary``.

    With ``witness_policy`` the checkpoint must also meet that policy's quorum of witness
    cosignatures (``verify_witnessed``); the result then names the witnesses that cosigned.

    The checkpoint must be signed by ``registry_key`` under the key name ``origin`` (default: the
    checkpoint's own origin line, which is how the registry signs), and with ``origin`` it must
    be that log's checkpoint. Raises ``LogProofError`` when anything fails to verify and
    ``MalformedInputError`` when a file is unreadable or malformed.
    """
    key = require_ed25519(load_public_key(registry_key), f"the registry key {registry_key}")
    note = read_checkpoint(checkpoint, "checkpoint")
    with about_file("checkpoint", checkpoint):
        name = origin if origin is not None else unverified_origin(note)
        head = verify_checkpoint(note, name, key, origin=origin)
    result: dict[str, Any] = {
        "verified": "log",
        "origin": head.origin,
        "tree_size": head.size,
        "root_hash": head.root_hash.hex(),
        "checks": ["checkpoint"],
    }
    done = [f"checkpoint of {head.origin} at size {head.size} (root {head.root_hash.hex()[:16]}) is signed"]
    if witness_policy is not None:
        policy = load_witness_policy(witness_policy)
        with about_file("checkpoint", checkpoint):
            witnessed = verify_witnessed(note, name, key, policy)
        result["checks"].append("witnesses")
        result["witnesses"] = {
            "quorum": policy.describe(),
            "cosigners": {n: {"key_name": c.witness.name, "timestamp": c.timestamp} for n, c in witnessed.cosigners.items()},
        }
        done.append(f"{witnessed.describe()}, as {policy.source} requires ({policy.describe()})")

    if inclusion is not None:
        proof_path, entry_path = inclusion
        proof = proof_object(proof_path, "inclusion", INCLUSION_KEYS)
        leaf = _entry_leaf_hash(entry_path)
        if proof["tree_size"] != head.size:
            raise LogProofError(
                f"the inclusion proof is for a tree of size {proof['tree_size']}, "
                f"but the checkpoint is at size {head.size}",
                hint="fetch the inclusion proof for this checkpoint's tree size",
            )
        verify_inclusion(leaf, proof["log_index"], head.size, proof["hashes"], head.root_hash)
        result["checks"].append("inclusion")
        result["inclusion"] = {"log_index": proof["log_index"], "leaf_hash": leaf.hex()}
        done.append(f"entry {entry_path.name} is leaf {proof['log_index']}")

    if consistency is not None:
        proof_path, old_path = consistency
        proof = proof_object(proof_path, "consistency", _CONSISTENCY_KEYS)
        old = _verify_old_checkpoint(old_path, name, key, head)
        if (proof["old_size"], proof["new_size"]) != (old.size, head.size):
            raise LogProofError(
                f"the consistency proof is from size {proof['old_size']} to {proof['new_size']}, "
                f"but the checkpoints are at sizes {old.size} and {head.size}",
                hint="fetch the consistency proof between these two checkpoints' sizes",
            )
        verify_consistency(old.size, head.size, old.root_hash, head.root_hash, proof["hashes"])
        result["checks"].append("consistency")
        result["consistency"] = {"old_size": old.size, "old_root_hash": old.root_hash.hex()}
        done.append(f"it extends the checkpoint at size {old.size}")

    result["summary"] = "OK: " + "; ".join(done)
    return result


def _verify_old_checkpoint(path: Path, name: str, key: Ed25519PublicKey, head: Checkpoint) -> Checkpoint:
    note = read_checkpoint(path, "old checkpoint")
    with about_file("old checkpoint", path):
        old = verify_checkpoint(note, name, key, origin=head.origin)
    if old.size > head.size:
        raise LogProofError(
            f"the old checkpoint (size {old.size}) is larger than the new one (size {head.size})",
            hint="pass the newer checkpoint as --checkpoint and the older one after the consistency proof",
        )
    return old


def _run(args: argparse.Namespace) -> dict[str, Any]:
    return verify_log_command(
        args.checkpoint,
        args.registry_key,
        tuple(args.inclusion) if args.inclusion is not None else None,
        tuple(args.consistency) if args.consistency is not None else None,
        args.origin,
        args.witness_policy,
    )


def add_log_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register the ``log`` subcommand; its ``run(args)`` returns the result dict."""
    log = subparsers.add_parser(
        "log",
        help="verify a registry's signed checkpoint and an inclusion or consistency proof",
        description="Verify a kvgraft registry's transparency-log evidence offline: the checkpoint's "
        "signature, then that ENTRY is in the log (--inclusion) or that the log extends an older "
        "checkpoint (--consistency). PROOF files are the JSON the registry serves.",
    )
    log.add_argument("--checkpoint", type=Path, required=True, help="the registry's signed checkpoint (note)")
    log.add_argument("--registry-key", type=Path, required=True, help="the registry's Ed25519 public key (PEM)")
    log.add_argument(
        "--origin",
        help="the log's origin, which is also its key name (default: the checkpoint's origin line)",
    )
    log.add_argument(
        "--witness-policy",
        type=Path,
        metavar="POLICY",
        help="also require witness cosignatures on the checkpoint, as this c2sp.org/tlog-policy file's quorum says",
    )
    which = log.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--inclusion",
        nargs=2,
        type=Path,
        metavar=("PROOF", "ENTRY"),
        help="inclusion proof JSON and the entry's stored bytes (the DSSE envelope JSON)",
    )
    which.add_argument(
        "--consistency",
        nargs=2,
        type=Path,
        metavar=("PROOF", "OLD_CHECKPOINT"),
        help="consistency proof JSON and the older signed checkpoint",
    )
    log.set_defaults(run=_run)
    return log
