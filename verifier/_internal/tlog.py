"""Transparency-log primitives: RFC 9162 Merkle trees, proofs, and C2SP signed checkpoints.

The Merkle tree is the one of RFC 9162 section 2.1 (identical to RFC 6962): a leaf hashes as
``SHA-256(0x00 || data)``, an interior node as ``SHA-256(0x01 || left || right)``, and the
empty tree's root is ``SHA-256("")``. Everything here works on *leaf hashes*: the registry
stores the leaf hash of each entry and never needs the entry bytes to build a proof.

Checkpoints follow c2sp.org/tlog-checkpoint inside a c2sp.org/signed-note envelope signed with
Ed25519 (signature type 0x01)::

    example.com/log
    42
    <base64 root hash>
    [extension lines]

    — example.com/log <base64(4-byte key ID || 64-byte signature)>

Pure Python: no torch, no registry, no web imports. Verification returns what it proved (or
None) and raises ``LogProofError`` (or ``MalformedInputError`` for unparseable input); it never
returns a bool.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .errors import LogProofError, MalformedInputError
from .keys import SigningKey, raw_public_key, require_ed25519

#: Size in bytes of every hash in the tree (SHA-256).
HASH_SIZE = 32
#: The root of the empty tree: SHA-256 of the empty string (RFC 9162 section 2.1.1).
EMPTY_ROOT = hashlib.sha256(b"").digest()
#: Tree sizes and indices are uint64 on the wire in every other implementation; refuse more.
MAX_TREE_SIZE = (1 << 64) - 1

#: The c2sp.org/signed-note signature type byte of Ed25519.
ED25519_SIGNATURE_TYPE = 0x01
#: A note larger than this is refused before parsing; checkpoints are a few hundred bytes, and
#: this still leaves room for many large (post-quantum) cosignatures.
MAX_NOTE_BYTES = 1 << 20
#: The signed-note spec requires accepting at least 16 signatures; Go's implementation caps at 100.
MAX_NOTE_SIGNATURES = 100

_EM_DASH = "\u2014"
_SIZE_LINE = re.compile(r"0|[1-9][0-9]*", re.ASCII)
_BASE64 = re.compile(r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?", re.ASCII)
_KEY_ID_HEX = re.compile(r"[0-9a-f]{8}", re.ASCII)


# --- hashing ---------------------------------------------------------------------------------


def hash_leaf(data: bytes) -> bytes:
    """The RFC 9162 leaf hash of ``data``: SHA-256(0x00 || data)."""
    return hashlib.sha256(b"\x00" + data).digest()


def hash_node(left: bytes, right: bytes) -> bytes:
    """The RFC 9162 interior node hash: SHA-256(0x01 || left || right)."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    # The largest power of two strictly less than n (n >= 2): where RFC 9162 splits D[n].
    return 1 << ((n - 1).bit_length() - 1)


def _check_leaf_hash_arg(value: object, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != HASH_SIZE:
        raise ValueError(f"{what} must be {HASH_SIZE} bytes, got {_describe(value)}")
    return value


def _describe(value: object) -> str:
    return f"{len(value)} bytes" if isinstance(value, bytes) else type(value).__name__


class MerkleTree:
    """An append-only RFC 9162 Merkle tree over leaf hashes, with proofs for any earlier size.

    It keeps the root of every complete power-of-two subtree (about 2n hashes for n leaves), so
    appending is amortised O(1) and a root, inclusion proof or consistency proof for any size up
    to the current one costs O(log^2 n) hash operations, whatever n is.
    """

    def __init__(self, leaf_hashes: Iterable[bytes] = ()) -> None:
        # _levels[h][i] is the root of the perfect subtree over leaves [i * 2**h, (i + 1) * 2**h).
        self._levels: list[list[bytes]] = [[]]
        for leaf in leaf_hashes:
            self.append(leaf)

    @property
    def size(self) -> int:
        """The number of leaves."""
        return len(self._levels[0])

    def append(self, leaf_hash: bytes) -> int:
        """Append a leaf hash (see ``hash_leaf``); return its index."""
        node = _check_leaf_hash_arg(leaf_hash, "a leaf hash")
        index = self.size
        level = 0
        while True:
            row = self._levels[level]
            row.append(node)
            if len(row) % 2:
                break
            # A right child completes a perfect subtree one level up.
            node = hash_node(row[-2], row[-1])
            level += 1
            if level == len(self._levels):
                self._levels.append([])
        return index

    def truncate(self, size: int) -> None:
        """Forget every leaf from ``size`` on (leaves appended but never committed); never fails.

        Level ``h`` keeps the ``size >> h`` perfect subtrees that lie wholly in the first ``size``
        leaves, and the tree keeps as many levels as appending ``size`` leaves would have made:
        the result equals ``MerkleTree(first size leaf hashes)`` without rehashing or reading them.
        """
        self._check_sizes(size, self.size, "tree size")
        self._levels = [row[: size >> h] for h, row in enumerate(self._levels[: max(1, size.bit_length())])]

    def leaf_hash(self, index: int) -> bytes:
        """The leaf hash at ``index``."""
        self._check_sizes(index, self.size - 1, "leaf index")
        return self._levels[0][index]

    def subtree_hashes(self, height: int, start: int, end: int) -> list[bytes]:
        """The roots of the perfect subtrees of ``2**height`` leaves numbered ``start`` to ``end - 1``.

        Subtree ``i`` covers leaves ``[i * 2**height, (i + 1) * 2**height)``; every one asked for
        must be complete in the current tree. Height 0 gives leaf hashes. No hashing: they are
        kept (a c2sp.org/tlog-tiles tile at level L is ``subtree_hashes(8 * L, ...)``).
        """
        self._check_sizes(height, max(len(self._levels) - 1, 0), "subtree height")
        row = self._levels[height]
        self._check_sizes(end, len(row), f"end of the subtrees of height {height}")
        self._check_sizes(start, end, f"start of the subtrees of height {height}")
        return row[start:end]

    def root(self, tree_size: int | None = None) -> bytes:
        """The Merkle Tree Hash of the first ``tree_size`` leaves (default: all of them)."""
        size = self.size if tree_size is None else tree_size
        self._check_sizes(size, self.size, "tree size")
        return self._subtree_root(0, size)

    def inclusion_proof(self, leaf_index: int, tree_size: int | None = None) -> list[bytes]:
        """RFC 9162 section 2.1.3.1 PATH(leaf_index, D[tree_size]), deepest sibling first."""
        size = self.size if tree_size is None else tree_size
        self._check_sizes(size, self.size, "tree size")
        self._check_sizes(leaf_index, size - 1, "leaf index")
        proof: list[bytes] = []
        start, end, m = 0, size, leaf_index
        # Walk down from the root; RFC order is bottom-up, hence the reverse at the end.
        while end - start > 1:
            k = _split(end - start)
            if m < k:
                proof.append(self._subtree_root(start + k, end))
                end = start + k
            else:
                proof.append(self._subtree_root(start, start + k))
                start += k
                m -= k
        proof.reverse()
        return proof

    def consistency_proof(self, old_size: int, new_size: int | None = None) -> list[bytes]:
        """RFC 9162 section 2.1.4.1 PROOF(old_size, D[new_size]); empty when old_size is 0 or equal."""
        size = self.size if new_size is None else new_size
        self._check_sizes(size, self.size, "new tree size")
        self._check_sizes(old_size, size, "old tree size")
        if old_size == 0 or old_size == size:
            return []
        proof: list[bytes] = []
        start, end, m, complete = 0, size, old_size, True
        while end - start != m:
            k = _split(end - start)
            if m <= k:
                proof.append(self._subtree_root(start + k, end))
                end = start + k
            else:
                proof.append(self._subtree_root(start, start + k))
                start += k
                m -= k
                complete = False
        if not complete:
            # SUBPROOF(m, D[m], false): the old tree's own subtree root is part of the proof.
            proof.append(self._subtree_root(start, end))
        proof.reverse()
        return proof

    def _subtree_root(self, start: int, end: int) -> bytes:
        n = end - start
        if n == 0:
            return EMPTY_ROOT
        if n & (n - 1) == 0 and start % n == 0:
            level = n.bit_length() - 1
            return self._levels[level][start >> level]
        k = _split(n)
        return hash_node(self._subtree_root(start, start + k), self._subtree_root(start + k, end))

    @staticmethod
    def _check_sizes(value: int, maximum: int, what: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{what} must be an int, got {type(value).__name__}")
        if maximum < 0:
            raise ValueError(f"{what} {value} is out of range: the tree is empty")
        if not 0 <= value <= maximum:
            raise ValueError(f"{what} {value} is out of range: it must be between 0 and {maximum}")


def merkle_root(leaf_hashes: Sequence[bytes]) -> bytes:
    """The RFC 9162 Merkle Tree Hash of a list of leaf hashes (EMPTY_ROOT for an empty list)."""
    return MerkleTree(leaf_hashes).root()


def inclusion_proof(leaf_index: int, tree_size: int, leaves: Sequence[bytes]) -> list[bytes]:
    """The inclusion proof of leaf ``leaf_index`` in the tree of the first ``tree_size`` leaf hashes.

    O(tree_size); to serve many proofs, keep a ``MerkleTree`` instead. Raises ``ValueError`` when
    the index or size is out of range (a caller's error, not a verification failure).
    """
    MerkleTree._check_sizes(tree_size, len(leaves), "tree size")
    return MerkleTree(leaves[:tree_size]).inclusion_proof(leaf_index)


def consistency_proof(old_size: int, new_size: int, leaves: Sequence[bytes]) -> list[bytes]:
    """The consistency proof from the first ``old_size`` to the first ``new_size`` leaf hashes.

    O(new_size); to serve many proofs, keep a ``MerkleTree`` instead. Raises ``ValueError`` when
    a size is out of range.
    """
    MerkleTree._check_sizes(new_size, len(leaves), "new tree size")
    return MerkleTree(leaves[:new_size]).consistency_proof(old_size)


# --- verification (RFC 9162 sections 2.1.3.2 and 2.1.4.2) -----------------------------------


def _require_size(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise LogProofError(f"{what} must be an integer, got {type(value).__name__}")
    if not 0 <= value <= MAX_TREE_SIZE:
        raise LogProofError(f"{what} {value} is out of range: it must be between 0 and 2^64-1")
    return value


def _require_hash(value: object, what: str) -> bytes:
    if not isinstance(value, bytes) or len(value) != HASH_SIZE:
        raise LogProofError(f"{what} must be a {HASH_SIZE}-byte SHA-256 hash, got {_describe(value)}")
    return value


def _require_proof(proof: object) -> list[bytes]:
    if isinstance(proof, (bytes, str)) or not isinstance(proof, Sequence):
        raise LogProofError(f"a proof must be a list of hashes, got {type(proof).__name__}")
    return [_require_hash(p, f"proof hash {i}") for i, p in enumerate(proof)]


def _path_length(index: int, size: int) -> int:
    # Hashes on the path from leaf `index` to the root of a tree of `size` leaves: one per level
    # below the point where the paths to `index` and to the last leaf part, plus one per left
    # sibling above it on the right border.
    inner = (index ^ (size - 1)).bit_length()
    return inner + (index >> inner).bit_count()


def inclusion_proof_length(leaf_index: int, tree_size: int) -> int:
    """How many hashes the inclusion proof of ``leaf_index`` in a tree of ``tree_size`` has."""
    return _path_length(leaf_index, tree_size)


def consistency_proof_length(old_size: int, new_size: int) -> int:
    """How many hashes the consistency proof from ``old_size`` to ``new_size`` has."""
    if old_size == 0 or old_size == new_size:
        return 0
    # Below the old tree's lowest complete subtree the two trees agree; count from there.
    level = (old_size & -old_size).bit_length() - 1
    length = _path_length((old_size - 1) >> level, ((new_size - 1) >> level) + 1)
    # When old_size is a power of two its root is that subtree, which the verifier already has.
    return length if old_size == 1 << level else length + 1


def _length_error(kind: str, got: int, want: int, about: str) -> LogProofError:
    verdict = "too long" if got > want else "too short"
    return LogProofError(f"the {kind} proof has {got} hash(es), {verdict}: {about} has exactly {want}")


def verify_inclusion(leaf_hash: bytes, index: int, tree_size: int, proof: Sequence[bytes], root: bytes) -> None:
    """Check that ``leaf_hash`` is leaf ``index`` of the tree of ``tree_size`` leaves with ``root``.

    RFC 9162 section 2.1.3.2. Returns None when the proof holds; raises ``LogProofError`` naming
    what failed (index out of range, proof too long or too short, wrong root).
    """
    index = _require_size(index, "the leaf index")
    tree_size = _require_size(tree_size, "the tree size")
    leaf_hash = _require_hash(leaf_hash, "the leaf hash")
    root = _require_hash(root, "the root hash")
    path = _require_proof(proof)
    if index >= tree_size:
        raise LogProofError(f"leaf index {index} is outside a tree of size {tree_size}")
    want = _path_length(index, tree_size)
    if len(path) != want:
        raise _length_error("inclusion", len(path), want, f"the proof for leaf {index} in a tree of size {tree_size}")

    fn, sn, r = index, tree_size - 1, leaf_hash
    for p in path:
        if sn == 0:
            raise LogProofError("the inclusion proof is too long for its tree size")
        if fn & 1 or fn == sn:
            r = hash_node(p, r)
            if not fn & 1:
                # On the right border: skip the levels where this node has no right sibling.
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            r = hash_node(r, p)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise LogProofError("the inclusion proof is too short for its tree size")
    if r != root:
        raise LogProofError(
            f"the inclusion proof for leaf {index} in a tree of size {tree_size} leads to root "
            f"{r.hex()}, not the expected {root.hex()}: the entry is not at that index of that tree"
        )


def verify_consistency(old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]) -> None:
    """Check that the tree of ``new_size`` leaves with ``new_root`` extends the one of ``old_size``.

    RFC 9162 section 2.1.4.2, plus the trivial cases: equal sizes need equal roots and an empty
    proof; an old size of 0 needs the empty-tree root and an empty proof. Returns None when the
    proof holds; raises ``LogProofError`` naming what failed.
    """
    old_size = _require_size(old_size, "the old tree size")
    new_size = _require_size(new_size, "the new tree size")
    old_root = _require_hash(old_root, "the old root hash")
    new_root = _require_hash(new_root, "the new root hash")
    path = _require_proof(proof)
    if old_size > new_size:
        raise LogProofError(
            f"the old tree size {old_size} is larger than the new tree size {new_size}",
            hint="pass the older checkpoint as the old one; a log never shrinks",
        )
    want = consistency_proof_length(old_size, new_size)
    if len(path) != want:
        raise _length_error("consistency", len(path), want, f"the proof from size {old_size} to size {new_size}")
    if old_size == new_size:
        if old_root != new_root:
            raise LogProofError(
                f"two checkpoints of the same size {old_size} have different roots "
                f"({old_root.hex()} and {new_root.hex()}): the log forked"
            )
        return
    if old_size == 0:
        if old_root != EMPTY_ROOT:
            raise LogProofError(f"the old tree has size 0 but its root {old_root.hex()} is not the empty-tree root")
        return

    if old_size & (old_size - 1) == 0:
        # The old tree is a complete subtree of the new one: its root is the proof's seed.
        path.insert(0, old_root)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn >>= 1
        sn >>= 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise LogProofError("the consistency proof is too long for its tree sizes")
        if fn & 1 or fn == sn:
            fr = hash_node(c, fr)
            sr = hash_node(c, sr)
            if not fn & 1:
                while fn and not fn & 1:
                    fn >>= 1
                    sn >>= 1
        else:
            sr = hash_node(sr, c)
        fn >>= 1
        sn >>= 1
    if sn != 0:
        raise LogProofError("the consistency proof is too short for its tree sizes")
    if fr != old_root:
        raise LogProofError(
            f"the consistency proof gives old root {fr.hex()}, not the old checkpoint's {old_root.hex()}: "
            f"the tree of size {old_size} is not a prefix of the tree of size {new_size}"
        )
    if sr != new_root:
        raise LogProofError(
            f"the consistency proof gives new root {sr.hex()}, not the new checkpoint's {new_root.hex()}: "
            f"the tree of size {new_size} does not extend the tree of size {old_size}"
        )


# --- signed notes (c2sp.org/signed-note) ----------------------------------------------------


def check_key_name(name: object, what: str = "key name") -> str:
    """``name`` when it is a valid signed-note key name (non-empty, no space, ``+`` or control
    character), else a ``MalformedInputError`` naming it as ``what``."""
    if not isinstance(name, str) or not name:
        raise MalformedInputError(f"a note {what} must be a non-empty string, got {name!r}")
    bad = next((ch for ch in name if ch.isspace() or ch == "+" or ord(ch) < 0x20), None)
    if bad is not None:
        raise MalformedInputError(
            f"note {what} {name!r} contains {bad!r}; key names have no spaces, '+' or control characters",
            hint="key names are usually schema-less URLs such as example.com/log",
        )
    return name


def note_key_id(name: str, public_key: Ed25519PublicKey) -> bytes:
    """The 4-byte key ID: SHA-256(name || "\\n" || 0x01 || 32-byte Ed25519 public key)[:4]."""
    check_key_name(name)
    material = bytes([ED25519_SIGNATURE_TYPE]) + raw_public_key(public_key)
    return hashlib.sha256(name.encode("utf-8") + b"\n" + material).digest()[:4]


def format_vkey(name: str, public_key: Ed25519PublicKey) -> str:
    """The verifier key string ``<name>+<hex key ID>+<base64(0x01 || public key)>``."""
    material = bytes([ED25519_SIGNATURE_TYPE]) + raw_public_key(public_key)
    return f"{name}+{note_key_id(name, public_key).hex()}+{base64.b64encode(material).decode('ascii')}"


def parse_vkey(vkey: str) -> tuple[str, Ed25519PublicKey]:
    """Parse an Ed25519 verifier key string into its name and public key.

    Raises ``MalformedInputError`` when it is malformed, of another signature type, or its key
    ID does not match its name and key.
    """
    if not isinstance(vkey, str):
        raise MalformedInputError(f"a verifier key must be a string, got {type(vkey).__name__}")
    # The base64 part may itself contain '+', so split at most twice.
    parts = vkey.strip("\n").split("+", 2)
    if len(parts) != 3:
        raise MalformedInputError("a verifier key has the form <name>+<8 hex digits>+<base64 key>")
    name, key_id, encoded = parts
    check_key_name(name)
    if not _KEY_ID_HEX.fullmatch(key_id):
        raise MalformedInputError(f"verifier key {name!r}: key ID {key_id!r} is not 8 lowercase hex digits")
    material = strict_b64decode(encoded, f"verifier key {name!r}")
    if len(material) != 33 or material[0] != ED25519_SIGNATURE_TYPE:
        raise MalformedInputError(
            f"verifier key {name!r} is not an Ed25519 key (type 0x01 and 32 bytes)",
            hint="only Ed25519 note keys are supported",
        )
    public_key = Ed25519PublicKey.from_public_bytes(material[1:])
    if note_key_id(name, public_key).hex() != key_id:
        raise MalformedInputError(f"verifier key {name!r}: key ID {key_id} does not match its name and key")
    return name, public_key


def strict_b64decode(text: str, what: str) -> bytes:
    """Standard padded base64 only, as signed notes and verifier keys are written (c2sp.org/signed-note)."""
    if not _BASE64.fullmatch(text):
        raise MalformedInputError(f"{what} is not standard padded base64")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MalformedInputError(f"{what} is not valid base64: {e}") from e


@dataclass(frozen=True)
class NoteSignature:
    """One signature line of a signed note (not yet verified)."""

    name: str
    key_id: bytes
    signature: bytes

    def line(self) -> bytes:
        """The line as a note carries it: ``— <name> <base64(key ID || signature)>\\n``."""
        return f"{_EM_DASH} {self.name} {base64.b64encode(self.key_id + self.signature).decode('ascii')}\n".encode()


@dataclass(frozen=True)
class SignedNote:
    """A signed note split into its text (with its final newline) and its signature lines."""

    text: bytes
    signatures: tuple[NoteSignature, ...]


def _decode_note_text(data: bytes, what: str) -> str:
    if not isinstance(data, bytes):
        raise MalformedInputError(f"{what} must be bytes, got {type(data).__name__}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MalformedInputError(f"{what} is not UTF-8: {e.reason} at byte {e.start}") from e
    for lineno, line in enumerate(text.split("\n"), start=1):
        bad = next((ch for ch in line if ord(ch) < 0x20), None)
        if bad is not None:
            raise MalformedInputError(
                f"{what} line {lineno} contains the control character U+{ord(bad):04X}; only newlines are allowed",
                hint="notes use bare \\n line endings; do not convert the file to CRLF",
            )
    if not text.endswith("\n"):
        raise MalformedInputError(f"{what} does not end with a newline: it was truncated or edited")
    return text


def parse_signed_note(note: bytes) -> SignedNote:
    """Split a signed note into text and signature lines without verifying anything.

    Raises ``MalformedInputError`` when the envelope is malformed (not UTF-8, control
    characters, no blank line before the signatures, a bad signature line, too many signatures).
    """
    if isinstance(note, bytes) and len(note) > MAX_NOTE_BYTES:
        raise MalformedInputError(f"the note is {len(note)} bytes, more than the {MAX_NOTE_BYTES} allowed")
    text = _decode_note_text(note, "the note")
    # The text ends at the last blank line; it may itself contain blank lines.
    split = text.rfind("\n\n")
    if split < 0:
        raise MalformedInputError("the note has no blank line before its signatures: it is not a signed note")
    body, block = text[: split + 1], text[split + 2 :]
    if not block:
        raise MalformedInputError("the note has no signature lines after its blank line")
    lines = block[:-1].split("\n")
    if len(lines) > MAX_NOTE_SIGNATURES:
        raise MalformedInputError(f"the note has {len(lines)} signatures, more than the {MAX_NOTE_SIGNATURES} allowed")
    signatures = []
    for n, line in enumerate(lines, start=1):
        prefix = _EM_DASH + " "
        fields = line[len(prefix) :].split(" ") if line.startswith(prefix) else []
        if len(fields) != 2:
            raise MalformedInputError(
                f"signature line {n} of the note is not '{_EM_DASH} <key name> <base64 signature>': {line[:80]!r}"
            )
        name = check_key_name(fields[0], what="signature name")
        blob = strict_b64decode(fields[1], f"the signature by {name!r}")
        if len(blob) < 5:
            raise MalformedInputError(f"the signature by {name!r} is {len(blob)} bytes; it needs a 4-byte key ID and more")
        signatures.append(NoteSignature(name=name, key_id=blob[:4], signature=blob[4:]))
    return SignedNote(text=body.encode("utf-8"), signatures=tuple(signatures))


def sign_note(text: bytes, name: str, signing_key: SigningKey) -> bytes:
    """Sign ``text`` (UTF-8, ending in a newline) as a signed note by key ``name``."""
    if not _decode_note_text(text, "the note text").strip("\n"):
        raise ValueError("the note text is empty")
    key_id = note_key_id(name, require_ed25519(signing_key.public_key, "the note's signing key"))
    blob = base64.b64encode(key_id + signing_key.sign(text)).decode("ascii")
    return text + f"\n{_EM_DASH} {name} {blob}\n".encode()


def open_note(note: bytes, name: str, public_key: Ed25519PublicKey) -> bytes:
    """Verify that ``note`` is signed by the Ed25519 key ``public_key`` under ``name``; return its text.

    Signatures by other keys (other names or key IDs, e.g. witness cosignatures) are ignored,
    as the spec requires; every signature by this name and key ID must verify.
    """
    parsed = parse_signed_note(note)
    key_id = note_key_id(check_key_name(name), public_key)
    mine = [s for s in parsed.signatures if s.name == name and s.key_id == key_id]
    if not mine:
        present = ", ".join(f"{s.name}+{s.key_id.hex()}" for s in parsed.signatures)
        raise LogProofError(
            f"the note has no signature by {name}+{key_id.hex()} (it is signed by {present})",
            hint="check that --registry-key is this log's key and that the key name (the origin) is right",
        )
    for sig in mine:
        try:
            if len(sig.signature) != 64:
                raise InvalidSignature
            public_key.verify(sig.signature, parsed.text)
        except InvalidSignature as e:
            raise LogProofError(
                f"the signature by {name}+{key_id.hex()} does not verify over the note text: "
                f"the note was altered after signing"
            ) from e
    return parsed.text


# --- checkpoints (c2sp.org/tlog-checkpoint) -------------------------------------------------


@dataclass(frozen=True)
class Checkpoint:
    """A log's tree head: the origin (the log's name), the tree size and the root hash."""

    origin: str
    size: int
    root_hash: bytes
    extensions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # A Checkpoint always renders to a text that parse_checkpoint accepts.
        for what, line in [("origin", self.origin), *(("extension line", e) for e in self.extensions)]:
            if not isinstance(line, str) or not line or line != line.strip() or any(ord(ch) < 0x20 for ch in line):
                raise ValueError(f"checkpoint {what} {line!r} must be non-empty, one line, no surrounding spaces")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or not 0 <= self.size <= MAX_TREE_SIZE:
            raise ValueError(f"checkpoint size {self.size!r} must be an int between 0 and 2^64-1")
        _check_leaf_hash_arg(self.root_hash, "a checkpoint root hash")

    def note_text(self) -> bytes:
        """The checkpoint's note text: origin, size, base64 root, extension lines, each ending in \\n."""
        lines = [self.origin, str(self.size), base64.b64encode(self.root_hash).decode("ascii"), *self.extensions]
        return "".join(line + "\n" for line in lines).encode("utf-8")


def parse_checkpoint(text: bytes) -> Checkpoint:
    """Parse a checkpoint's note text (not the signed note: see ``verify_checkpoint``).

    Strict: UTF-8, every line ends in a newline, no empty lines, no leading or trailing spaces,
    a decimal size without leading zeros, a base64 root of exactly 32 bytes. Raises
    ``MalformedInputError`` naming the first fault.
    """
    decoded = _decode_note_text(text, "the checkpoint")
    lines = decoded[:-1].split("\n")
    if len(lines) < 3:
        raise MalformedInputError(f"the checkpoint has {len(lines)} line(s); it needs origin, size and root hash")
    names = ["origin", "tree size", "root hash"]
    for n, line in enumerate(lines):
        what = names[n] if n < 3 else f"extension line {n - 2}"
        if not line:
            raise MalformedInputError(
                f"the checkpoint's {what} (line {n + 1}) is empty",
                hint="pass the checkpoint as the registry served it: the signed note, unmodified",
            )
        if line != line.strip():
            raise MalformedInputError(f"the checkpoint's {what} (line {n + 1}) has leading or trailing spaces")
    origin, size_line, root_line = lines[:3]
    if not _SIZE_LINE.fullmatch(size_line):
        raise MalformedInputError(
            f"the checkpoint's tree size {size_line[:40]!r} is not a decimal number without leading zeros"
        )
    size = int(size_line)
    if size > MAX_TREE_SIZE:
        raise MalformedInputError(f"the checkpoint's tree size {size} is larger than 2^64-1")
    root = strict_b64decode(root_line, "the checkpoint's root hash")
    if len(root) != HASH_SIZE:
        raise MalformedInputError(f"the checkpoint's root hash is {len(root)} bytes, not {HASH_SIZE}")
    if base64.b64encode(root).decode("ascii") != root_line:
        raise MalformedInputError("the checkpoint's root hash is not canonical base64")
    return Checkpoint(origin=origin, size=size, root_hash=root, extensions=tuple(lines[3:]))


def sign_checkpoint(checkpoint: Checkpoint, name: str, signing_key: SigningKey) -> bytes:
    """The signed note of ``checkpoint``, signed by ``signing_key`` under key name ``name``.

    The registry signs with its origin as the key name, as tlog-checkpoint recommends.
    """
    return sign_note(checkpoint.note_text(), name, signing_key)


def verify_checkpoint(
    note: bytes, name: str, public_key: Ed25519PublicKey, *, origin: str | None = None
) -> Checkpoint:
    """Verify a signed checkpoint by ``public_key`` under key name ``name``; return the checkpoint.

    Other signatures (witnesses, other keys) are ignored. With ``origin``, the checkpoint must
    also be for that log. Raises ``LogProofError`` when the signature is missing or bad or the
    origin differs, ``MalformedInputError`` when the note or checkpoint is malformed.
    """
    # The text means nothing until its signature is checked, so check that first.
    checkpoint = parse_checkpoint(open_note(note, name, public_key))
    if origin is not None and checkpoint.origin != origin:
        raise LogProofError(
            f"the checkpoint is for log {checkpoint.origin!r}, not {origin!r}",
            hint="pass the checkpoint of the log you meant, or the right --origin",
        )
    return checkpoint
