"""Transparency log: RFC 9162 Merkle proofs, C2SP signed checkpoints, and ``kvgraft-verify log``.

Known answers come from other implementations (sources named at each vector); properties check
every proof against a direct transcription of the RFC's recursive definitions.
"""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgraft.verifier import (
    KeyFileError,
    MalformedInputError,
    ephemeral_signing_key,
    generate_private_key,
    save_public_key,
)
from kvgraft.verifier._internal.errors import LogProofError, VerificationError
from kvgraft.verifier._internal.tlog import (
    EMPTY_ROOT,
    Checkpoint,
    MerkleTree,
    consistency_proof,
    consistency_proof_length,
    format_vkey,
    hash_leaf,
    hash_node,
    inclusion_proof,
    inclusion_proof_length,
    merkle_root,
    note_key_id,
    open_note,
    parse_checkpoint,
    parse_signed_note,
    parse_vkey,
    sign_checkpoint,
    sign_note,
    verify_checkpoint,
    verify_consistency,
    verify_inclusion,
)
from kvgraft.verifier._internal.tlog_cli import (
    add_log_parser,
    consistency_proof_document,
    inclusion_proof_document,
    verify_log_command,
)


def h(hex_digest: str) -> bytes:
    return bytes.fromhex(hex_digest)


# --- RFC 6962 / RFC 9162 known answers ------------------------------------------------------
# From transparency-dev/merkle (github.com/transparency-dev/merkle), rfc6962/rfc6962_test.go
# (hasher) and proof/verify_test.go (the classic eight-leaf tree that goes back to
# google/certificate-transparency's merkle tree tests). That file numbers inclusion-proof leaves
# from 1; the indices below are 0-based.

KAT_LEAVES = [
    b"",
    b"\x00",
    b"\x10",
    b"\x20\x21",
    b"\x30\x31",
    b"\x40\x41\x42\x43",
    b"\x50\x51\x52\x53\x54\x55\x56\x57",
    b"\x60\x61\x62\x63\x64\x65\x66\x67\x68\x69\x6a\x6b\x6c\x6d\x6e\x6f",
]
# KAT_ROOTS[n - 1] is the root of the tree of the first n leaves.
KAT_ROOTS = [
    h("6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"),
    h("fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125"),
    h("aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77"),
    h("d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"),
    h("4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4"),
    h("76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef"),
    h("ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c"),
    h("5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328"),
]
# (leaf index, tree size, path)
KAT_INCLUSION = [
    (0, 1, []),
    (0, 8, [
        h("96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7"),
        h("5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e"),
        h("6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"),
    ]),
    (5, 8, [
        h("bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"),
        h("ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0"),
        h("d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"),
    ]),
    (2, 3, [h("fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125")]),
    (1, 5, [
        h("6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"),
        h("5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e"),
        h("bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"),
    ]),
]
# (old size, new size, proof)
KAT_CONSISTENCY = [
    (1, 1, []),
    (1, 8, [
        h("96a296d224f285c67bee93c30f8a309157f0daa35dc5b87e410b78630a09cfc7"),
        h("5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e"),
        h("6b47aaf29ee3c2af9af889bc1fb9254dabd31177f16232dd6aab035ca39bf6e4"),
    ]),
    (6, 8, [
        h("0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a"),
        h("ca854ea128ed050b41b35ffc1b87b8eb2bde461e9e3b5596ece6b9d5975a0ae0"),
        h("d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"),
    ]),
    (2, 5, [
        h("5f083f0a1a33ca076a95279832580db3e0ef4584bdff1f54c8a360f50de3031e"),
        h("bc1a0643b12e4d2d7c77918f44e0f4f79a838b6cf9ec5b5c283e1f4d88599e6b"),
    ]),
    (6, 7, [
        h("0ebc5d3437fbe2db158b9f126a1d118e308181031d0a949f8dededebc558ef6a"),
        h("b08693ec2e721597130641e8211e7eedccb4c26413963eee6c1e2ed16ffb1a5f"),
        h("d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7"),
    ]),
]
KAT_TREE = MerkleTree([hash_leaf(d) for d in KAT_LEAVES])
SOME_HASH = h("abacaba000000000000000000000000000000000000000000060061e00123456")


def test_hasher_known_answers() -> None:
    assert EMPTY_ROOT == h("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
    assert hash_leaf(b"") == h("6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d")
    assert hash_leaf(b"L123456") == h("395aa064aa4c29f7010acfe3f25db9485bbd4b91897b6ad7ad547639252b4d56")
    assert hash_node(b"N123", b"N456") == h("aa217fe888e47007fa15edab33c2b492a722cb106c64667fc2b044444de66bbb")
    # Domain separation: a node is not the leaf of its children's concatenation.
    a, b = hash_leaf(b"Hello"), hash_leaf(b"World")
    assert hash_node(a, b) != hash_leaf(a + b)
    assert hash_node(a, b) != hash_node(b, a)


@pytest.mark.parametrize("size", range(1, 9))
def test_roots_known_answers(size: int) -> None:
    assert KAT_TREE.root(size) == KAT_ROOTS[size - 1]
    assert merkle_root([hash_leaf(d) for d in KAT_LEAVES[:size]]) == KAT_ROOTS[size - 1]


def test_empty_tree_root() -> None:
    assert merkle_root([]) == EMPTY_ROOT
    assert MerkleTree().root() == EMPTY_ROOT
    assert KAT_TREE.root(0) == EMPTY_ROOT


@pytest.mark.parametrize(("index", "size", "path"), KAT_INCLUSION)
def test_inclusion_known_answers(index: int, size: int, path: list[bytes]) -> None:
    leaves = [hash_leaf(d) for d in KAT_LEAVES]
    assert KAT_TREE.inclusion_proof(index, size) == path
    assert inclusion_proof(index, size, leaves) == path
    verify_inclusion(leaves[index], index, size, path, KAT_ROOTS[size - 1])


@pytest.mark.parametrize(("old", "new", "proof"), KAT_CONSISTENCY)
def test_consistency_known_answers(old: int, new: int, proof: list[bytes]) -> None:
    leaves = [hash_leaf(d) for d in KAT_LEAVES]
    assert KAT_TREE.consistency_proof(old, new) == proof
    assert consistency_proof(old, new, leaves) == proof
    verify_consistency(old, new, KAT_ROOTS[old - 1], KAT_ROOTS[new - 1], proof)


def _flip(proof: list[bytes], i: int, bit: int) -> list[bytes]:
    out = list(proof)
    out[i] = bytes([out[i][0] ^ bit]) + out[i][1:]
    return out


@pytest.mark.parametrize(("index", "size", "path"), [v for v in KAT_INCLUSION if v[2]])
def test_inclusion_known_answers_corrupted(index: int, size: int, path: list[bytes]) -> None:
    # The corruptions of transparency-dev/merkle's corruptInclusionProof, each must fail.
    leaf, root = hash_leaf(KAT_LEAVES[index]), KAT_ROOTS[size - 1]
    probes = [
        (leaf, index - 1, size, path, root),
        (leaf, index + 1, size, path, root),
        (leaf, index ^ 2, size, path, root),
        (leaf, index, size * 2, path, root),
        (leaf, index, size // 2, path, root),
        (b"WrongLeaf", index, size, path, root),
        (SOME_HASH, index, size, path, root),
        (leaf, index, size, path, EMPTY_ROOT),
        (leaf, index, size, path, SOME_HASH),
        (leaf, index, size, [*path, b""], root),
        (leaf, index, size, [*path, root], root),
        (leaf, index, size, [b"", *path], root),
        (leaf, index, size, [root, *path], root),
        (leaf, index, size, path[:-1], root),
        *((leaf, index, size, _flip(path, i, 8), root) for i in range(len(path))),
    ]
    if len(path) > 1:
        probes.append((leaf, index, size, [path[0], SOME_HASH, *path[1:]], root))
    for probe in probes:
        with pytest.raises(LogProofError):
            verify_inclusion(*probe)


@pytest.mark.parametrize(("old", "new", "proof"), [v for v in KAT_CONSISTENCY if v[2]])
def test_consistency_known_answers_corrupted(old: int, new: int, proof: list[bytes]) -> None:
    # The corruptions of transparency-dev/merkle's corruptConsistencyProof, each must fail.
    r1, r2 = KAT_ROOTS[old - 1], KAT_ROOTS[new - 1]
    probes = [
        (old - 1, new, r1, r2, proof),
        (old + 1, new, r1, r2, proof),
        (old ^ 2, new, r1, r2, proof),
        (old, new * 2, r1, r2, proof),
        (old, new // 2, r1, r2, proof),
        (old, new, b"WrongRoot", r2, proof),
        (old, new, r1, b"WrongRoot", proof),
        (old, new, SOME_HASH, r2, proof),
        (old, new, r1, SOME_HASH, proof),
        (old, new, r2, r1, proof),
        (old, new, r1, r2, []),
        (old, new, r1, r2, [*proof, b""]),
        (old, new, r1, r2, [*proof, r1]),
        (old, new, r1, r2, [*proof, r2]),
        (old, new, r1, r2, [b"", *proof]),
        (old, new, r1, r2, [r1, *proof]),
        (old, new, r1, r2, [r2, *proof]),
        (old, new, r1, r2, [proof[0], *proof]),
        (old, new, r1, r2, proof[:-1]),
        *((old, new, r1, r2, _flip(proof, i, 16)) for i in range(len(proof))),
    ]
    for probe in probes:
        with pytest.raises(LogProofError):
            verify_consistency(*probe)


def test_inclusion_edge_cases() -> None:
    leaf = hash_leaf(b"data")
    # A one-leaf tree's root is its leaf hash and its proof is empty.
    verify_inclusion(leaf, 0, 1, [], leaf)
    with pytest.raises(LogProofError, match="root hash must be a 32-byte"):
        verify_inclusion(leaf, 0, 1, [], b"")
    with pytest.raises(LogProofError, match="leaf hash must be a 32-byte"):
        verify_inclusion(b"", 0, 1, [], leaf)
    for index, size in [(0, 0), (1, 0), (1, 1), (2, 1)]:
        with pytest.raises(LogProofError, match=f"leaf index {index} is outside a tree of size {size}"):
            verify_inclusion(SOME_HASH, index, size, [], EMPTY_ROOT)
    with pytest.raises(LogProofError, match="does not lead to|leads to root"):
        verify_inclusion(SOME_HASH, 0, 1, [], EMPTY_ROOT)
    with pytest.raises(LogProofError, match="too long"):
        verify_inclusion(leaf, 0, 1, [leaf], leaf)
    with pytest.raises(LogProofError, match="too short"):
        verify_inclusion(leaf, 0, 2, [], leaf)
    with pytest.raises(LogProofError, match="out of range"):
        verify_inclusion(leaf, -1, 2, [leaf], leaf)
    with pytest.raises(LogProofError, match="must be an integer"):
        verify_inclusion(leaf, True, 2, [leaf], leaf)  # type: ignore[arg-type]
    with pytest.raises(LogProofError, match="list of hashes"):
        verify_inclusion(leaf, 0, 2, leaf, leaf)  # type: ignore[arg-type]


def test_consistency_edge_cases() -> None:
    r1, r2 = hash_leaf(b"one"), hash_leaf(b"two")
    verify_consistency(0, 0, EMPTY_ROOT, EMPTY_ROOT, [])
    verify_consistency(0, 5, EMPTY_ROOT, r2, [])
    verify_consistency(1, 1, r2, r2, [])
    with pytest.raises(LogProofError, match="forked"):
        verify_consistency(1, 1, r1, r2, [])
    # Stricter than transparency-dev/merkle, which accepts any old root at size 0: a size-0
    # checkpoint with another root is a log misbehaving.
    with pytest.raises(LogProofError, match="not the empty-tree root"):
        verify_consistency(0, 1, r1, r2, [])
    with pytest.raises(LogProofError, match="larger than the new tree size"):
        verify_consistency(2, 1, r1, r2, [])
    with pytest.raises(LogProofError, match="larger than the new tree size"):
        verify_consistency(1, 0, r1, r2, [])
    with pytest.raises(LogProofError, match="too short"):
        verify_consistency(1, 2, r1, r2, [])
    for old, new in [(0, 0), (0, 1), (1, 1)]:
        with pytest.raises(LogProofError, match="too long"):
            verify_consistency(old, new, EMPTY_ROOT, EMPTY_ROOT, [EMPTY_ROOT])
    leaves = [hash_leaf(d) for d in KAT_LEAVES]
    with pytest.raises(LogProofError, match="old root"):
        verify_consistency(6, 8, KAT_ROOTS[4], KAT_ROOTS[7], consistency_proof(6, 8, leaves))
    with pytest.raises(LogProofError, match="new root"):
        verify_consistency(6, 8, KAT_ROOTS[5], KAT_ROOTS[6], consistency_proof(6, 8, leaves))


def test_generation_rejects_out_of_range_arguments() -> None:
    leaves = [hash_leaf(d) for d in KAT_LEAVES]
    with pytest.raises(ValueError, match="leaf index 8 is out of range"):
        inclusion_proof(8, 8, leaves)
    with pytest.raises(ValueError, match="tree size 9 is out of range"):
        inclusion_proof(0, 9, leaves)
    with pytest.raises(ValueError, match="old tree size 6 is out of range"):
        consistency_proof(6, 5, leaves)
    with pytest.raises(ValueError, match="32 bytes"):
        MerkleTree([b"short"])


# --- properties against the RFC's recursive definitions -------------------------------------


def ref_mth(leaves: list[bytes]) -> bytes:
    """RFC 9162 2.1.1 MTH over leaf hashes, transcribed literally."""
    n = len(leaves)
    if n == 0:
        return EMPTY_ROOT
    if n == 1:
        return leaves[0]
    k = 1 << ((n - 1).bit_length() - 1)
    return hash_node(ref_mth(leaves[:k]), ref_mth(leaves[k:]))


def ref_path(m: int, leaves: list[bytes]) -> list[bytes]:
    """RFC 9162 2.1.3.1 PATH(m, D[n])."""
    n = len(leaves)
    if n == 1:
        return []
    k = 1 << ((n - 1).bit_length() - 1)
    if m < k:
        return ref_path(m, leaves[:k]) + [ref_mth(leaves[k:])]
    return ref_path(m - k, leaves[k:]) + [ref_mth(leaves[:k])]


def ref_subproof(m: int, leaves: list[bytes], b: bool) -> list[bytes]:
    """RFC 9162 2.1.4.1 SUBPROOF(m, D[n], b)."""
    n = len(leaves)
    if m == n:
        return [] if b else [ref_mth(leaves)]
    k = 1 << ((n - 1).bit_length() - 1)
    if m <= k:
        return ref_subproof(m, leaves[:k], b) + [ref_mth(leaves[k:])]
    return ref_subproof(m - k, leaves[k:], False) + [ref_mth(leaves[:k])]


def distinct_leaves(n: int, salt: bytes = b"") -> list[bytes]:
    # Distinct leaves: with repeated leaves, a proof for one copy is also a proof for another.
    return [hash_leaf(salt + i.to_bytes(4, "big")) for i in range(n)]


def test_every_proof_of_small_trees_matches_the_rfc_and_verifies() -> None:
    leaves = distinct_leaves(48)
    tree = MerkleTree(leaves)
    for n in range(0, 49):
        assert tree.root(n) == ref_mth(leaves[:n])
        for i in range(n):
            proof = tree.inclusion_proof(i, n)
            assert proof == ref_path(i, leaves[:n])
            assert len(proof) == inclusion_proof_length(i, n)
            verify_inclusion(leaves[i], i, n, proof, tree.root(n))
        for m in range(0, n + 1):
            proof = tree.consistency_proof(m, n)
            assert proof == (ref_subproof(m, leaves[:n], True) if 0 < m < n else [])
            assert len(proof) == consistency_proof_length(m, n)
            verify_consistency(m, n, tree.root(m), tree.root(n), proof)


@st.composite
def inclusion_cases(draw: st.DrawFn) -> tuple[list[bytes], int, int]:
    size = draw(st.integers(1, 200))
    index = draw(st.integers(0, size - 1))
    return distinct_leaves(size, draw(st.binary(max_size=8))), index, size


@st.composite
def consistency_cases(draw: st.DrawFn) -> tuple[list[bytes], int, int]:
    new = draw(st.integers(2, 200))
    old = draw(st.integers(1, new - 1))
    return distinct_leaves(new, draw(st.binary(max_size=8))), old, new


@settings(max_examples=150, deadline=None)
@given(case=inclusion_cases(), data=st.data())
def test_inclusion_proofs_verify_and_tampering_is_rejected(
    case: tuple[list[bytes], int, int], data: st.DataObject
) -> None:
    leaves, index, size = case
    tree = MerkleTree(leaves)
    root, leaf = tree.root(), leaves[index]
    proof = inclusion_proof(index, size, leaves)
    assert proof == tree.inclusion_proof(index) == ref_path(index, leaves)
    verify_inclusion(leaf, index, size, proof, root)

    if proof:
        i = data.draw(st.integers(0, len(proof) - 1), label="hash")
        byte = data.draw(st.integers(0, 31), label="byte")
        bad = list(proof)
        bad[i] = bad[i][:byte] + bytes([bad[i][byte] ^ data.draw(st.integers(1, 255), label="xor")]) + bad[i][byte + 1 :]
        with pytest.raises(LogProofError):
            verify_inclusion(leaf, index, size, bad, root)
    other_index = data.draw(st.integers(0, size - 1).filter(lambda j: j != index), label="index") if size > 1 else None
    if other_index is not None:
        with pytest.raises(LogProofError):
            verify_inclusion(leaf, other_index, size, proof, root)
    # A different size, with that size's root (as a genuine checkpoint would pair them). The same
    # proof can verify for another size with the *same* root (RFC 9162 proofs do not bind the size
    # on the left of the tree), which is why the verifier takes size and root from one signed
    # checkpoint.
    other_size = data.draw(st.integers(index + 1, 200).filter(lambda s: s != size), label="size")
    other_root = MerkleTree(distinct_leaves(other_size, b"x")).root() if other_size > size else tree.root(other_size)
    with pytest.raises(LogProofError):
        verify_inclusion(leaf, index, other_size, proof, other_root)
    with pytest.raises(LogProofError):
        verify_inclusion(leaf, index, size, proof, hash_leaf(b"another root"))
    with pytest.raises(LogProofError):
        verify_inclusion(hash_leaf(b"another entry"), index, size, proof, root)


@settings(max_examples=150, deadline=None)
@given(case=consistency_cases(), data=st.data())
def test_consistency_proofs_verify_and_tampering_is_rejected(
    case: tuple[list[bytes], int, int], data: st.DataObject
) -> None:
    leaves, old, new = case
    tree = MerkleTree(leaves)
    old_root, new_root = tree.root(old), tree.root(new)
    proof = consistency_proof(old, new, leaves)
    assert proof == tree.consistency_proof(old) == ref_subproof(old, leaves, True)
    verify_consistency(old, new, old_root, new_root, proof)

    i = data.draw(st.integers(0, len(proof) - 1), label="hash")
    byte = data.draw(st.integers(0, 31), label="byte")
    bad = list(proof)
    bad[i] = bad[i][:byte] + bytes([bad[i][byte] ^ data.draw(st.integers(1, 255), label="xor")]) + bad[i][byte + 1 :]
    with pytest.raises(LogProofError):
        verify_consistency(old, new, old_root, new_root, bad)
    other_old = data.draw(st.integers(0, new).filter(lambda s: s != old), label="old size")
    with pytest.raises(LogProofError):
        verify_consistency(other_old, new, tree.root(other_old), new_root, proof)
    other_new = data.draw(st.integers(old, new + 50).filter(lambda s: s != new), label="new size")
    grown = MerkleTree(leaves + distinct_leaves(50, b"more"))
    with pytest.raises(LogProofError):
        verify_consistency(old, other_new, old_root, grown.root(other_new), proof)
    with pytest.raises(LogProofError):
        verify_consistency(old, new, hash_leaf(b"another root"), new_root, proof)
    with pytest.raises(LogProofError):
        verify_consistency(old, new, old_root, hash_leaf(b"another root"), proof)
    # A forked log: same old prefix length, different history.
    forked = MerkleTree(distinct_leaves(new, b"fork"))
    with pytest.raises(LogProofError):
        verify_consistency(old, new, old_root, new_root, forked.consistency_proof(old))


def test_truncate_equals_the_tree_of_the_first_leaves() -> None:
    leaves = [hash_leaf(bytes([i])) for i in range(70)]
    for full in (0, 1, 2, 5, 16, 17, 64, 70):
        for size in range(full + 1):
            tree = MerkleTree(leaves[:full])
            tree.truncate(size)
            fresh = MerkleTree(leaves[:size])
            assert tree.size == size and tree.root() == fresh.root()
            assert tree._levels == fresh._levels  # the same kept subtrees: later appends and tiles agree
            tree.append(leaves[69])
            fresh.append(leaves[69])
            assert tree.root() == fresh.root()
    with pytest.raises(ValueError, match="tree size"):
        MerkleTree(leaves[:3]).truncate(4)


def test_a_large_tree_serves_proofs_cheaply() -> None:
    leaves = distinct_leaves(100_000)
    tree = MerkleTree(leaves)
    for index in (0, 31_337, 99_999):
        verify_inclusion(leaves[index], index, tree.size, tree.inclusion_proof(index), tree.root())
    verify_consistency(65_537, 99_999, tree.root(65_537), tree.root(99_999), tree.consistency_proof(65_537, 99_999))
    assert tree.leaf_hash(31_337) == leaves[31_337]


# --- signed notes: known answers -------------------------------------------------------------
# golang.org/x/mod, sumdb/note/note_test.go (TestSign, TestOpen) and the package doc: the
# PeterNeumann and EnochRoot keys, text and signatures. Ed25519 is deterministic (RFC 8032), so
# signing the same text with the same key must reproduce the published note byte for byte.

GO_SKEY = "PRIVATE+KEY+PeterNeumann+c74f20a3+AYEKFALVFGyNhPJEMzD1QIDr+Y7hfZx09iUvxdXHKDFz"
GO_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
GO_ENOCH_VKEY = "EnochRoot+af0cfe78+ATtqJ7zOtqQtYqOo0CpvDXNlMhV3HeJDpjrASKGLWdop"
GO_TEXT = b"If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n"
GO_PETER_SIG = "— PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n".encode()
GO_ENOCH_SIG = "— EnochRoot rwz+eBzmZa0SO3NbfRGzPCpDckykFXSdeX+MNtCOXm2/5n2tiOHp+vAF1aGrQ5ovTG01oOTGwnWLox33WWd1RvMc+QQ=\n".encode()

# c2sp.org/signed-note (editor's copy, Example section): key example.com/foo.
C2SP_VKEY = "example.com/foo+530d903a+AekyeRrm56hApGFkyQR4ZCbV54Id2LKaANYcrnKv3U2k"
C2SP_NOTE = (
    "This is an example message.\n\n"
    "— example.com/foo Uw2QOkn8srV1yJGh2VYRlL1Tnagv1YEq6TfXppzi2ONncAlTgK7Ztg1ERYNZXsYjOBH3mFXmRKuwHjG1Yu72IneyaQM=\n"
).encode()

# A real checkpoint of the Go checksum database (sum.golang.org, tree size 15368405), as quoted
# in a public write-up on the checkpoint format; the verifier key is the one built into the go
# command (cmd/go/internal/modfetch/key.go). Its key name (sum.golang.org) differs from its
# origin line (go.sum database tree).
SUMDB_VKEY = "sum.golang.org+033de0ae+Ac4zctda0e5eza+HJyk9SxEdh+s3Ux18htTTAD8OuAn8"
SUMDB_CHECKPOINT = (
    "go.sum database tree\n15368405\n/g9am3I6YWNKaZX/jkne1fqd9zEyjss+JXyPXG0WfkY=\n\n"
    "— sum.golang.org Az3grqJGUaSGukG9p8nI2vKgiFn7qGHxn0W+mrwyI6Gz3F0t1J3LzmWk/p96Ybf295EjwdSwlzgijq5WA9d1Ded7owM=\n"
).encode()


def go_signing_key() -> Ed25519PrivateKey:
    material = base64.b64decode(GO_SKEY.split("+", 4)[4])
    assert material[0] == 1
    return Ed25519PrivateKey.from_private_bytes(material[1:])


def test_sign_note_reproduces_the_go_reference_note() -> None:
    key = go_signing_key()
    with ephemeral_signing_key(key) as signer:
        note = sign_note(GO_TEXT, "PeterNeumann", signer)
    assert note == GO_TEXT + b"\n" + GO_PETER_SIG
    assert format_vkey("PeterNeumann", key.public_key()) == GO_VKEY
    assert note_key_id("PeterNeumann", key.public_key()) == h("c74f20a3")


def test_open_note_go_reference_vectors() -> None:
    peter_name, peter = parse_vkey(GO_VKEY)
    enoch_name, enoch = parse_vkey(GO_ENOCH_VKEY)
    assert (peter_name, enoch_name) == ("PeterNeumann", "EnochRoot")
    note = GO_TEXT + b"\n" + GO_PETER_SIG + GO_ENOCH_SIG
    # Each key finds its own signature and ignores the other.
    assert open_note(note, "PeterNeumann", peter) == GO_TEXT
    assert open_note(note, "EnochRoot", enoch) == GO_TEXT
    assert [s.name for s in parse_signed_note(note).signatures] == ["PeterNeumann", "EnochRoot"]
    with pytest.raises(LogProofError, match="does not verify"):
        open_note(note.replace(b"cryptography", b"cryptographY"), "PeterNeumann", peter)
    # Go's TestOpen "invalid signature": four characters spliced into the signature.
    spliced = GO_TEXT + b"\n" + GO_PETER_SIG[:60] + b"ABCD" + GO_PETER_SIG[60:]
    with pytest.raises(LogProofError, match="does not verify"):
        open_note(spliced, "PeterNeumann", peter)
    with pytest.raises(LogProofError, match="no signature by PeterNeumann"):
        open_note(GO_TEXT + b"\n" + GO_ENOCH_SIG, "PeterNeumann", peter)
    # Go's TestOpen malformed notes.
    for bad in [
        GO_TEXT,
        GO_TEXT + b"\n",
        GO_TEXT + b"\n" + GO_PETER_SIG[:-1],
        b"\x01" + GO_TEXT + b"\n" + GO_PETER_SIG,
        b"\xff" + GO_TEXT + b"\n" + GO_PETER_SIG,
        GO_TEXT + b"\n" + "— Bad Name x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=".encode(),
        GO_TEXT + b"\n" + GO_PETER_SIG + b"Unexpected line.\n",
        GO_TEXT + b"\n" + GO_PETER_SIG * 101,
    ]:
        with pytest.raises(MalformedInputError):
            open_note(bad, "PeterNeumann", peter)


def test_open_note_c2sp_example() -> None:
    name, key = parse_vkey(C2SP_VKEY)
    assert open_note(C2SP_NOTE, name, key) == b"This is an example message.\n"
    assert format_vkey(name, key) == C2SP_VKEY


def test_verify_checkpoint_of_the_go_checksum_database() -> None:
    name, key = parse_vkey(SUMDB_VKEY)
    checkpoint = verify_checkpoint(SUMDB_CHECKPOINT, name, key)
    assert checkpoint == Checkpoint(
        origin="go.sum database tree",
        size=15368405,
        root_hash=base64.b64decode("/g9am3I6YWNKaZX/jkne1fqd9zEyjss+JXyPXG0WfkY="),
        extensions=(),
    )
    assert checkpoint.note_text() + b"\n" == SUMDB_CHECKPOINT.split("—".encode())[0]
    with pytest.raises(LogProofError, match="does not verify"):
        verify_checkpoint(SUMDB_CHECKPOINT.replace(b"15368405", b"15368406"), name, key)


@pytest.mark.parametrize(
    "vkey",
    [
        GO_VKEY[:-1],
        GO_VKEY.replace("c74f20a3", "c74f20a4"),
        GO_VKEY.replace("PeterNeumann", "PeterNeuman"),
        GO_VKEY.replace("c74f20a3", "C74F20A3"),
        "PeterNeumann+cc469956+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TWBADKEY==",  # wrong length
        "PeterNeumann+173116ae+ZRpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",  # unknown type
        "PeterNeumann",
        "Peter Neumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW",
    ],
)
def test_parse_vkey_rejects_manglings(vkey: str) -> None:
    # From golang.org/x/mod sumdb/note TestNewVerifier.
    with pytest.raises(MalformedInputError):
        parse_vkey(vkey)


# --- checkpoints: round trip and tampering ---------------------------------------------------

ORIGIN = "registry.example/log"


@pytest.fixture(scope="module")
def log_key() -> Ed25519PrivateKey:
    return generate_private_key()


def signed(checkpoint: Checkpoint, key: Ed25519PrivateKey, name: str = ORIGIN) -> bytes:
    with ephemeral_signing_key(key) as signer:
        return sign_checkpoint(checkpoint, name, signer)


def test_checkpoint_round_trip(log_key: Ed25519PrivateKey) -> None:
    for checkpoint in [
        Checkpoint(ORIGIN, 0, EMPTY_ROOT),
        Checkpoint(ORIGIN, 8, KAT_ROOTS[7]),
        Checkpoint(ORIGIN, 2**64 - 1, SOME_HASH, ("ext one", "ext-two")),
    ]:
        note = signed(checkpoint, log_key)
        assert parse_checkpoint(parse_signed_note(note).text) == checkpoint
        assert verify_checkpoint(note, ORIGIN, log_key.public_key()) == checkpoint
        assert verify_checkpoint(note, ORIGIN, log_key.public_key(), origin=ORIGIN) == checkpoint
    note = signed(Checkpoint(ORIGIN, 8, KAT_ROOTS[7]), log_key)
    root_b64 = base64.b64encode(KAT_ROOTS[7]).decode()
    assert note.startswith(f"{ORIGIN}\n8\n{root_b64}\n\n— {ORIGIN} ".encode())
    assert note.endswith(b"\n")


def test_checkpoint_cosignatures_and_unknown_keys_are_ignored(log_key: Ed25519PrivateKey) -> None:
    checkpoint = Checkpoint(ORIGIN, 8, KAT_ROOTS[7])
    note = signed(checkpoint, log_key)
    witness = generate_private_key()
    with ephemeral_signing_key(witness) as w:
        cosigned = sign_note(checkpoint.note_text(), "witness.example", w)
    both = note + cosigned.split(b"\n\n", 1)[1]
    assert verify_checkpoint(both, ORIGIN, log_key.public_key()) == checkpoint
    # A signature under the log's name by another key has another key ID: ignored, as the spec says.
    impostor = signed(checkpoint, generate_private_key())
    both = impostor + note.split(b"\n\n", 1)[1]
    assert verify_checkpoint(both, ORIGIN, log_key.public_key()) == checkpoint


def test_tampered_checkpoints_are_rejected(log_key: Ed25519PrivateKey) -> None:
    checkpoint = Checkpoint(ORIGIN, 8, KAT_ROOTS[7])
    note = signed(checkpoint, log_key)
    root_b64 = base64.b64encode(KAT_ROOTS[7])
    with pytest.raises(LogProofError, match="does not verify over the note text"):
        verify_checkpoint(note.replace(b"\n8\n", b"\n9\n"), ORIGIN, log_key.public_key())
    with pytest.raises(LogProofError, match="does not verify over the note text"):
        verify_checkpoint(note.replace(root_b64, base64.b64encode(KAT_ROOTS[6])), ORIGIN, log_key.public_key())
    with pytest.raises(LogProofError, match="does not verify over the note text"):
        verify_checkpoint(note.replace(root_b64 + b"\n", root_b64 + b"\nextension\n"), ORIGIN, log_key.public_key())
    with pytest.raises(LogProofError, match="no signature by registry.example/log"):
        verify_checkpoint(note, ORIGIN, generate_private_key().public_key())
    with pytest.raises(LogProofError, match="no signature by other.example/log"):
        verify_checkpoint(note, "other.example/log", log_key.public_key())
    other_origin = signed(Checkpoint("other.example/log", 8, KAT_ROOTS[7]), log_key, name=ORIGIN)
    with pytest.raises(LogProofError, match="is for log 'other.example/log', not 'registry.example/log'"):
        verify_checkpoint(other_origin, ORIGIN, log_key.public_key(), origin=ORIGIN)
    with pytest.raises(MalformedInputError, match="no blank line"):
        verify_checkpoint(checkpoint.note_text(), ORIGIN, log_key.public_key())
    with pytest.raises(MalformedInputError, match="no signature lines"):
        verify_checkpoint(checkpoint.note_text() + b"\n", ORIGIN, log_key.public_key())
    with pytest.raises(MalformedInputError, match="contains"):
        verify_checkpoint(note, "bad name", log_key.public_key())


def _cp(*lines: str, end: str = "\n") -> bytes:
    return ("\n".join(lines) + end).encode()


ROOT_B64 = base64.b64encode(KAT_ROOTS[7]).decode()


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (_cp(ORIGIN, "8"), "needs origin, size and root"),
        (_cp(ORIGIN, "8", ROOT_B64, end=""), "does not end with a newline"),
        (_cp("", "8", ROOT_B64), "origin .line 1. is empty"),
        (_cp(ORIGIN, "08", ROOT_B64), "without leading zeros"),
        (_cp(ORIGIN, "-1", ROOT_B64), "without leading zeros"),
        (_cp(ORIGIN, "+8", ROOT_B64), "without leading zeros"),
        (_cp(ORIGIN, "8.0", ROOT_B64), "without leading zeros"),
        (_cp(ORIGIN, "\u0668", ROOT_B64), "without leading zeros"),  # an Arabic-Indic eight
        (_cp(ORIGIN, str(2**64), ROOT_B64), "larger than 2\\^64-1"),
        (_cp(ORIGIN + " ", "8", ROOT_B64), "origin .line 1. has leading or trailing spaces"),
        (_cp(ORIGIN, "8 ", ROOT_B64), "tree size .line 2. has leading or trailing spaces"),
        (_cp(ORIGIN, "8", ROOT_B64, "ext "), "extension line 1 .line 4. has leading or trailing"),
        (_cp(ORIGIN, "8", ROOT_B64, ""), "extension line 1 .line 4. is empty"),
        (_cp(ORIGIN, "8", ROOT_B64.rstrip("=")), "not standard padded base64"),
        (_cp(ORIGIN, "8", base64.b64encode(KAT_ROOTS[7][:31]).decode()), "31 bytes, not 32"),
        (_cp(ORIGIN, "8", base64.b64encode(KAT_ROOTS[7] + b"\x00").decode()), "33 bytes, not 32"),
        (_cp(ORIGIN, "8", ROOT_B64[:42] + "z="), "not canonical base64"),
        (_cp(ORIGIN, "8", base64.urlsafe_b64encode(b"\xfb" * 32).decode()), "not standard padded base64"),
        (_cp(ORIGIN, "8", ROOT_B64).replace(b"\n", b"\r\n"), "control character U\\+000D"),
        (_cp(ORIGIN + "\t", "8", ROOT_B64), "control character U\\+0009"),
        (b"\xffregistry\n8\n" + ROOT_B64.encode() + b"\n", "not UTF-8"),
    ],
)
def test_malformed_checkpoint_text_is_rejected(text: bytes, match: str) -> None:
    with pytest.raises(MalformedInputError, match=match):
        parse_checkpoint(text)


def test_malformed_checkpoint_is_rejected_even_when_signed(log_key: Ed25519PrivateKey) -> None:
    with ephemeral_signing_key(log_key) as signer:
        note = sign_note(_cp(ORIGIN, "08", ROOT_B64), ORIGIN, signer)
    with pytest.raises(MalformedInputError, match="without leading zeros"):
        verify_checkpoint(note, ORIGIN, log_key.public_key())


def test_checkpoint_refuses_values_it_cannot_render() -> None:
    with pytest.raises(ValueError, match="origin"):
        Checkpoint("two\nlines", 1, SOME_HASH)
    with pytest.raises(ValueError, match="size"):
        Checkpoint(ORIGIN, -1, SOME_HASH)
    with pytest.raises(ValueError, match="32 bytes"):
        Checkpoint(ORIGIN, 1, b"short")


# --- kvgraft-verify log ----------------------------------------------------------------------


class LogFiles:
    """A small log on disk: entries, the registry key, and checkpoints at two sizes."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.key = generate_private_key()
        self.key_pem = root / "registry.pub.pem"
        save_public_key(self.key.public_key(), self.key_pem)
        # Entries stand in for stored DSSE envelopes: the leaf is over their exact bytes.
        self.entries = [
            json.dumps({"payload": base64.b64encode(b"entry %d" % i).decode(), "payloadType": "x", "signatures": []},
                       indent=2).encode() + b"\n"
            for i in range(9)
        ]
        self.tree = MerkleTree(hash_leaf(e) for e in self.entries)
        self.old = self.write("old.checkpoint", self.checkpoint(5))
        self.new = self.write("new.checkpoint", self.checkpoint(9))

    def checkpoint(self, size: int, key: Ed25519PrivateKey | None = None, origin: str = ORIGIN) -> bytes:
        return signed(Checkpoint(origin, size, self.tree.root(size)), key or self.key, name=origin)

    def write(self, name: str, data: bytes | dict[str, object]) -> Path:
        path = self.root / name
        path.write_bytes(data if isinstance(data, bytes) else json.dumps(data).encode())
        return path

    def entry(self, index: int) -> Path:
        return self.write(f"entry-{index}.dsse.json", self.entries[index])

    def inclusion(self, index: int, size: int = 9) -> Path:
        doc = inclusion_proof_document(index, size, self.tree.inclusion_proof(index, size))
        return self.write(f"inclusion-{index}-{size}.json", doc)

    def consistency(self, old: int = 5, new: int = 9) -> Path:
        return self.write(f"consistency-{old}-{new}.json", consistency_proof_document(old, new, self.tree.consistency_proof(old, new)))


@pytest.fixture
def log(tmp_path: Path) -> LogFiles:
    return LogFiles(tmp_path)


def test_log_command_verifies_inclusion(log: LogFiles) -> None:
    for index in (0, 4, 8):
        result = verify_log_command(log.new, log.key_pem, (log.inclusion(index), log.entry(index)), None, None)
        assert result["checks"] == ["checkpoint", "inclusion"]
        assert result["inclusion"] == {"log_index": index, "leaf_hash": hash_leaf(log.entries[index]).hex()}
        assert (result["origin"], result["tree_size"], result["root_hash"]) == (ORIGIN, 9, log.tree.root().hex())
        assert result["summary"].startswith("OK: checkpoint of registry.example/log at size 9")
        assert "\n" not in result["summary"]
    result = verify_log_command(log.new, log.key_pem, (log.inclusion(3), log.entry(3)), None, ORIGIN)
    assert result["origin"] == ORIGIN


def test_log_command_verifies_consistency(log: LogFiles) -> None:
    result = verify_log_command(log.new, log.key_pem, None, (log.consistency(), log.old), None)
    assert result["checks"] == ["checkpoint", "consistency"]
    assert result["consistency"] == {"old_size": 5, "old_root_hash": log.tree.root(5).hex()}
    assert "extends the checkpoint at size 5" in result["summary"]
    same = log.write("same.json", consistency_proof_document(9, 9, []))
    verify_log_command(log.new, log.key_pem, None, (same, log.new), None)


def test_log_command_rejects_what_does_not_verify(log: LogFiles) -> None:
    entry3, proof3 = log.entry(3), log.inclusion(3)
    with pytest.raises(LogProofError, match="not the expected"):
        verify_log_command(log.new, log.key_pem, (proof3, log.entry(4)), None, None)
    # The entry re-encoded (same JSON, other whitespace) is another leaf.
    compact = log.write("compact.json", json.dumps(json.loads(log.entries[3])).encode())
    with pytest.raises(LogProofError, match="not the expected"):
        verify_log_command(log.new, log.key_pem, (proof3, compact), None, None)
    doc = json.loads(proof3.read_text())
    doc["hashes"][1] = ("0" if doc["hashes"][1][0] != "0" else "1") + doc["hashes"][1][1:]
    with pytest.raises(LogProofError, match="not the expected"):
        verify_log_command(log.new, log.key_pem, (log.write("bad.json", doc), entry3), None, None)
    with pytest.raises(LogProofError, match="inclusion proof is for a tree of size 5"):
        verify_log_command(log.new, log.key_pem, (log.inclusion(3, size=5), entry3), None, None)
    other_key = log.root / "other.pub.pem"
    save_public_key(generate_private_key().public_key(), other_key)
    with pytest.raises(LogProofError, match="no signature by registry.example/log"):
        verify_log_command(log.new, other_key, (proof3, entry3), None, None)
    with pytest.raises(LogProofError, match="no signature by mirror.example/log"):
        verify_log_command(log.new, log.key_pem, (proof3, entry3), None, "mirror.example/log")
    tampered = log.write("tampered.checkpoint", log.new.read_bytes().replace(b"\n9\n", b"\n8\n"))
    with pytest.raises(LogProofError, match="does not verify over the note text"):
        verify_log_command(tampered, log.key_pem, (log.inclusion(3, size=8), entry3), None, None)
    # The checkpoint of another log signed with the same key, under its own origin as key name.
    other = log.write("other.checkpoint", log.checkpoint(9, origin="other.example/log"))
    with pytest.raises(LogProofError, match="no signature by registry.example/log"):
        verify_log_command(other, log.key_pem, (proof3, entry3), None, ORIGIN)


def test_log_command_rejects_inconsistent_checkpoints(log: LogFiles) -> None:
    with pytest.raises(LogProofError, match="larger than the new one"):
        verify_log_command(log.old, log.key_pem, None, (log.consistency(), log.new), None)
    with pytest.raises(LogProofError, match="from size 4 to 9, but the checkpoints are at sizes 5 and 9"):
        verify_log_command(log.new, log.key_pem, None, (log.consistency(4, 9), log.old), None)
    # A forked log: a size-5 checkpoint over other entries, signed by the same key.
    forked_tree = MerkleTree(distinct_leaves(5, b"fork"))
    forked = log.write("forked.checkpoint", signed(Checkpoint(ORIGIN, 5, forked_tree.root()), log.key))
    with pytest.raises(LogProofError, match="not a prefix"):
        verify_log_command(log.new, log.key_pem, None, (log.consistency(), forked), None)
    foreign = log.write("foreign.checkpoint", log.checkpoint(5, origin="other.example/log"))
    with pytest.raises(LogProofError, match="old checkpoint .*foreign.checkpoint: the note has no signature by registry"):
        verify_log_command(log.new, log.key_pem, None, (log.consistency(), foreign), None)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (b"", "not valid JSON"),
        (b"not json", "not valid JSON"),
        (b'{"log_index": 3, "tree_size": 9, "hashes": ["ab', "not valid JSON"),  # truncated
        (b"[]", "must be a JSON object, got list"),
        (b'{"log_index": 3, "tree_size": 9}', "missing hashes"),
        (b'{"log_index": 3, "tree_size": 9, "hashes": [], "extra": 1}', "unknown extra"),
        (b'{"log_index": "3", "tree_size": 9, "hashes": []}', "log_index must be an integer"),
        (b'{"log_index": 3.0, "tree_size": 9, "hashes": []}', "log_index must be an integer"),
        (b'{"log_index": true, "tree_size": 9, "hashes": []}', "log_index must be an integer"),
        (b'{"log_index": -1, "tree_size": 9, "hashes": []}', "log_index must be an integer"),
        (b'{"log_index": 3, "tree_size": 9, "hashes": "ab"}', "hashes must be a list"),
        (b'{"log_index": 3, "tree_size": 9, "hashes": ["xyz"]}', "hashes\\[0\\] = 'xyz' is not 64 lowercase hex"),
        (b'{"log_index": 3, "tree_size": 9, "hashes": ["' + b"AB" * 32 + b'"]}', "not 64 lowercase hex"),
        (b'{"log_index": 3, "tree_size": 9, "hashes": [1]}', "not 64 lowercase hex"),
        (b'{"old_size": 3, "new_size": 9, "hashes": []}', "is a consistency proof"),
        (b'{"log_index": 3, "log_index": 3, "tree_size": 9, "hashes": []}', "duplicate"),
    ],
)
def test_log_command_rejects_malformed_proof_files(log: LogFiles, content: bytes, match: str) -> None:
    proof = log.write("proof.json", content)
    with pytest.raises(MalformedInputError, match=match) as info:
        verify_log_command(log.new, log.key_pem, (proof, log.entry(3)), None, None)
    assert "\n" not in str(info.value)


def test_log_command_rejects_unreadable_files(log: LogFiles) -> None:
    proof, entry = log.inclusion(3), log.entry(3)
    missing = log.root / "missing"
    with pytest.raises(MalformedInputError, match="is a directory"):
        verify_log_command(log.new, log.key_pem, (log.root, entry), None, None)
    with pytest.raises(MalformedInputError, match="entry .* is a directory"):
        verify_log_command(log.new, log.key_pem, (proof, log.root), None, None)
    with pytest.raises(MalformedInputError, match="entry .* does not exist"):
        verify_log_command(log.new, log.key_pem, (proof, missing), None, None)
    with pytest.raises(MalformedInputError, match="entry .* is empty"):
        verify_log_command(log.new, log.key_pem, (proof, log.write("empty", b"")), None, None)
    with pytest.raises(MalformedInputError, match="checkpoint .* is a directory"):
        verify_log_command(log.root, log.key_pem, (proof, entry), None, None)
    with pytest.raises(MalformedInputError, match="checkpoint .* does not exist"):
        verify_log_command(missing, log.key_pem, (proof, entry), None, None)
    truncated = log.write("truncated.checkpoint", log.new.read_bytes()[:40])
    with pytest.raises(MalformedInputError, match="checkpoint .*truncated.checkpoint: the note does not end with a newline"):
        verify_log_command(truncated, log.key_pem, (proof, entry), None, None)
    with pytest.raises(MalformedInputError, match="no blank line"):
        verify_log_command(log.write("unsigned.checkpoint", log.new.read_bytes().split(b"\n\n")[0] + b"\n"),
                           log.key_pem, (proof, entry), None, None)
    with pytest.raises(MalformedInputError, match="old checkpoint .* does not exist"):
        verify_log_command(log.new, log.key_pem, None, (log.consistency(), missing), None)
    with pytest.raises(MalformedInputError, match="is an inclusion proof"):
        verify_log_command(log.new, log.key_pem, None, (proof, log.old), None)
    with pytest.raises(KeyFileError):
        verify_log_command(log.new, log.new, (proof, entry), None, None)
    with pytest.raises(MalformedInputError, match="contains ' '"):
        verify_log_command(log.new, log.key_pem, (proof, entry), None, "registry example")


def test_log_subcommand_parses_and_runs(log: LogFiles, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvgraft-verify")
    sub = parser.add_subparsers(dest="command", required=True)
    add_log_parser(sub)
    base = ["log", "--checkpoint", str(log.new), "--registry-key", str(log.key_pem)]
    args = parser.parse_args([*base, "--inclusion", str(log.inclusion(2)), str(log.entry(2))])
    assert args.run(args)["inclusion"]["log_index"] == 2
    args = parser.parse_args([*base, "--origin", ORIGIN, "--consistency", str(log.consistency()), str(log.old)])
    assert args.run(args)["checks"] == ["checkpoint", "consistency"]
    for argv in (
        base,
        [*base, "--inclusion", str(log.inclusion(2))],
        [*base, "--inclusion", "p", "e", "--consistency", "p", "o"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    capsys.readouterr()


def test_errors_render_as_one_line(log: LogFiles) -> None:
    with pytest.raises(VerificationError) as info:
        verify_log_command(log.new, log.key_pem, (log.inclusion(3), log.entry(4)), None, None)
    text = str(info.value)
    assert "\n" not in text and "(hint: " in text
