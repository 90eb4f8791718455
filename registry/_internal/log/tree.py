"""The transparency log: an RFC 9162 Merkle tree over entry leaf hashes, with signed checkpoints.

The tree lives in memory (about two hashes per leaf) and is rebuilt from the database's leaf
hashes at start; the database is the record, and each append commits the entry, its leaf and
the new signed checkpoint in one transaction. Proof documents are exactly those that
``kvgraft-verify log`` reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from kvgraft.verifier import (
    Checkpoint,
    MerkleTree,
    SigningKey,
    Tile,
    consistency_proof_document,
    format_vkey,
    hash_leaf,
    inclusion_proof_document,
    require_ed25519,
    sign_checkpoint,
    tile_data,
    verify_checkpoint,
)

from ..errors import NotFoundError

__all__ = ["LogHead", "TransparencyLog", "format_vkey", "hash_leaf", "verify_checkpoint"]


@dataclass(frozen=True)
class LogHead:
    """A tree size, its root, and the signed checkpoint note for them."""

    size: int
    root_hash: bytes
    note: bytes


class TransparencyLog:
    """The Merkle tree and checkpoint signer. Not thread-safe: the registry holds its lock."""

    def __init__(self, origin: str, signing_key: SigningKey, leaf_hashes: list[bytes]) -> None:
        self.origin = origin
        self._key = signing_key
        # Checkpoints are C2SP signed notes, whose keys are Ed25519 only: refuse another key at start.
        self._public = require_ed25519(signing_key.public_key, "the registry key")
        self._tree = MerkleTree(leaf_hashes)

    @property
    def public_key(self) -> Ed25519PublicKey:
        """The key checkpoints are signed with."""
        return self._public

    @property
    def size(self) -> int:
        """The number of leaves."""
        return self._tree.size

    def root(self, size: int | None = None) -> bytes:
        """The root hash of the first ``size`` leaves (default all)."""
        return self._tree.root(size)

    def tile(self, tile: Tile) -> bytes:
        """The bytes of a c2sp.org/tlog-tiles hash tile (``tile.min_tree_size <= size``), from the tree as kept."""
        return tile_data(self._tree, tile)

    def sign(self, size: int | None = None) -> LogHead:
        """Sign the checkpoint of the first ``size`` leaves (default all)."""
        n = self.size if size is None else size
        root = self._tree.root(n)
        note = sign_checkpoint(Checkpoint(origin=self.origin, size=n, root_hash=root), self.origin, self._key)
        return LogHead(size=n, root_hash=root, note=note)

    def append(self, leaf_hash: bytes) -> int:
        """Append a leaf hash; return its index."""
        return self._tree.append(leaf_hash)

    def reset(self, leaf_hashes: list[bytes]) -> None:
        """Rebuild the tree from the stored leaves."""
        self._tree = MerkleTree(leaf_hashes)

    def truncate(self, size: int) -> None:
        """Forget the leaves from ``size`` on (a batch whose commit failed or was refused); never fails."""
        self._tree.truncate(size)

    def inclusion(self, index: int, tree_size: int | None = None) -> dict[str, Any]:
        """The inclusion proof document of leaf ``index`` in the tree of ``tree_size`` leaves.

        A tree the log does not have, or a leaf not in it, is a 404: what was asked for does not
        exist, though the numbers are well formed (parsing them is the caller's job).
        """
        size = self.size if tree_size is None else tree_size
        if not 0 <= size <= self.size:
            raise NotFoundError(
                f"tree size {size} is outside the log, which has {self.size} entries",
                hint="ask for a tree size no larger than the latest checkpoint's",
            )
        if not 0 <= index < size:
            raise NotFoundError(
                f"entry {index} is not in a tree of size {size}",
                hint="the index must be less than the tree size",
            )
        return inclusion_proof_document(index, size, self._tree.inclusion_proof(index, size))

    def consistency(self, old_size: int, new_size: int | None = None) -> dict[str, Any]:
        """The consistency proof document from ``old_size`` to ``new_size`` (default: all); 404 as above."""
        new = self.size if new_size is None else new_size
        if not 0 <= new <= self.size:
            raise NotFoundError(
                f"tree size {new} is outside the log, which has {self.size} entries",
                hint="ask for a tree size no larger than the latest checkpoint's",
            )
        if not 0 <= old_size <= new:
            raise NotFoundError(
                f"old tree size {old_size} must be between 0 and the new tree size {new}",
                hint="pass the older checkpoint's size as old and the newer one's as new",
            )
        return consistency_proof_document(old_size, new, self._tree.consistency_proof(old_size, new))
