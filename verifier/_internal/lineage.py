"""Check what binds a KV artifact to its tokens and to its parent, offline and without torch.

A KV artifact's predicate carries ``tokens.digest`` (the sha256 of its token ids' canonical JSON)
and ``chain_key`` (a hash over the parent's chain key, the model, the tokenizer, the profile and
the token ids: ``kvgraft.schemas.chain_key``). Both are recomputed here from the signed
statement. A root's chain key needs nothing else; a child's needs its parent's statement, which
must itself be signed by trusted keys and be about the tensors the child names as its parent,
ending where the child starts. The engine checks the same before it grafts (docs/artifacts.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgraft.schemas import KV_FILE, KvArtifactStatement, chain_key, prefixed, token_digest

from .errors import ChainKeyMismatchError, TokenDigestMismatchError


@dataclass(frozen=True)
class ArtifactLineage:
    """What ``verify_artifact_lineage`` proved.

    ``chain_key`` is ``"root"`` (recomputed with no parent), ``"parent"`` (recomputed from the
    given parent's chain key), or ``"not checked"`` (a child whose parent was not given).
    """

    token_digest: str
    chain_key: str
    parent: str | None

    def describe(self) -> str:
        """One clause for the command's summary line."""
        chain = {
            "root": "chain key matches (root)",
            "parent": f"chain key matches its parent {self.parent}",
            "not checked": f"chain key not checked (pass --parent-dir with the parent {self.parent})",
        }[self.chain_key]
        return f"token digest matches; {chain}"


def _tensors_digest(statement: KvArtifactStatement) -> str | None:
    return next((prefixed(s.digest.sha256) for s in statement.subject if s.name == KV_FILE), None)


def verify_artifact_lineage(statement: KvArtifactStatement, parent: KvArtifactStatement | None = None) -> ArtifactLineage:
    """Recompute ``statement``'s token digest and, for a root or with its ``parent``, its chain key.

    ``parent`` must be a statement already verified against trusted keys. Raises
    ``TokenDigestMismatchError`` or ``ChainKeyMismatchError`` naming what differs.
    """
    p = statement.predicate
    got = token_digest(p.tokens.ids)
    if got != p.tokens.digest:
        raise TokenDigestMismatchError(
            f"the statement's {len(p.tokens.ids)} token ids hash to {got}, but tokens.digest says {p.tokens.digest}"
        )
    if p.parent is None:
        if parent is not None:
            raise ChainKeyMismatchError("the statement is a root (no parent), but a parent artifact was given",
                                        hint="drop --parent-dir for a root artifact")
        if p.positions.start != 0:
            raise ChainKeyMismatchError(f"a root artifact must start at position 0, not {p.positions.start}")
        parent_key = None
    elif parent is None:
        return ArtifactLineage(got, "not checked", p.parent)
    else:
        pp = parent.predicate
        if _tensors_digest(parent) != p.parent:
            raise ChainKeyMismatchError(
                f"the statement names parent {p.parent}, but the parent given is about {KV_FILE} {_tensors_digest(parent)}",
                hint="pass the parent's own artifact directory as --parent-dir",
            )
        if pp.positions.end != p.positions.start:
            raise ChainKeyMismatchError(
                f"the artifact starts at position {p.positions.start}, but its parent ends at {pp.positions.end}"
            )
        parent_key = pp.chain_key
    want = chain_key(parent_key, p.model, p.tokenizer_digest, p.profile, p.tokens.ids)
    if want != p.chain_key:
        raise ChainKeyMismatchError(
            f"the chain key recomputed from {'its parent' if parent_key else 'the root'}, the model, tokenizer, "
            f"profile and token ids is {want}, but the statement says {p.chain_key}"
        )
    return ArtifactLineage(got, "parent" if parent_key else "root", p.parent)
