"""What a publish is on its way into the log, and the checks of it that need no registry state.

``PreparedPublish`` is a publish checked as far as it can be without the log's order (what
``Publisher.prepare_publish`` hands the sequencer); ``NewEntry`` is one accepted and numbered, with
the rows a batch inserts (``ENTRY_TYPES``, ``SUBJECT_TYPES``, ``REF_TYPES``: the columns of
migration 1 with their types); ``Published`` is the answer. The lineage and pre-registration
checks here are pure functions of rows, shared by the prepare step and the sequencer's batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from kvgraft.verifier import KeyId

from .accounts import TokenInfo
from .entries import ArtifactFields, IndexedStatement
from .errors import InvalidLineageError, InvalidStatementError, MissingReferenceError, RegistryError
from .log.tree import hash_leaf
from .queries import Ancestry, EntryRow


@dataclass(frozen=True)
class Published:
    """The outcome of a publish: the entry document and whether it is new."""

    document: dict[str, Any]
    created: bool


@dataclass(frozen=True)
class PreparedPublish:
    """A publish checked as far as it can be without the log's order, waiting for the sequencer.

    ``lineage`` is the lineage walk of a child whose parent was logged when it was prepared
    (None: a root, or a parent not logged yet); ``pre_registered`` whether a replay's
    pre-registration was found and checked then. ``sequence_batch`` checks the rest.
    """

    body: bytes
    digest: str
    payload_type: str
    indexed: IndexedStatement
    token: TokenInfo
    signers: tuple[KeyId, ...]
    lineage: Ancestry | None
    pre_registered: bool

    @property
    def size(self) -> int:
        """The envelope's bytes (the sequencer's queue and batches are bounded by them)."""
        return len(self.body)


class NewEntry:
    """An accepted publish numbered for appending: its entry row as ``queries`` would read it back."""

    def __init__(self, prepared: PreparedPublish, token: TokenInfo, log_index: int, integrated_at: str) -> None:
        self.prepared = prepared
        self.token = token
        indexed = prepared.indexed
        self.row = EntryRow(
            log_index=log_index, digest=prepared.digest, leaf_hash=hash_leaf(prepared.body),
            payload_type=prepared.payload_type, predicate_type=indexed.predicate_type, kind=indexed.kind,
            publisher=token.publisher, keyids=prepared.signers, integrated_at=integrated_at, size=len(prepared.body),
            artifact=indexed.artifact,
        )

    def entries_row(self) -> tuple[Any, ...]:
        """The ``entries`` columns, in ``ENTRY_TYPES`` order."""
        r, a = self.row, self.row.artifact
        return (
            r.log_index, r.digest, r.leaf_hash, self.prepared.body, r.payload_type, r.predicate_type, r.kind,
            r.publisher, list(r.keyids), self.token.token_id, r.integrated_at,
            a.digest if a else None, a.model_name if a else None, a.model_weights_digest if a else None,
            a.model_config_digest if a else None, a.profile_name if a else None, a.parent if a else None,
            a.chain_key if a else None, a.position_start if a else None, a.position_end if a else None,
            a.source_text if a else None, a.source_text_digest if a else None,
        )


#: The columns of ``entries`` (migration 1) with their types, as a batch inserts them.
ENTRY_TYPES = (
    ("log_index", "BIGINT"), ("digest", "VARCHAR"), ("leaf_hash", "BLOB"), ("envelope", "BLOB"),
    ("payload_type", "VARCHAR"), ("predicate_type", "VARCHAR"), ("kind", "VARCHAR"), ("publisher", "VARCHAR"),
    ("keyids", "VARCHAR[]"), ("token_id", "VARCHAR"), ("integrated_at", "VARCHAR"), ("artifact_digest", "VARCHAR"),
    ("model_name", "VARCHAR"), ("model_weights_digest", "VARCHAR"), ("model_config_digest", "VARCHAR"),
    ("profile_name", "VARCHAR"), ("parent", "VARCHAR"), ("chain_key", "VARCHAR"), ("position_start", "BIGINT"),
    ("position_end", "BIGINT"), ("source_text", "VARCHAR"), ("source_text_digest", "VARCHAR"),
)
SUBJECT_TYPES = (("log_index", "BIGINT"), ("name", "VARCHAR"), ("digest", "VARCHAR"))
REF_TYPES = (("log_index", "BIGINT"), ("ref", "VARCHAR"), ("role", "VARCHAR"))


def digest_of(data: bytes) -> str:
    """``sha256:<hex>`` of an envelope's bytes, its entry digest."""
    return "sha256:" + hashlib.sha256(data).hexdigest()




def check_join(artifact: ArtifactFields, parent: EntryRow) -> None:
    """A child starts where its parent's first entry ends (``InvalidLineageError`` otherwise)."""
    parent_end = parent.artifact.position_end if parent.artifact is not None else None
    if artifact.position_start != parent_end:
        raise InvalidLineageError(
            f"the artifact starts at position {artifact.position_start}, but its parent {artifact.parent} "
            f"ends at position {parent_end}: a child must start where its parent ends"
        )


def check_walk(walk: Ancestry, limit: int) -> None:
    """Refuse a lineage walk that cycles or runs past ``limit`` (``InvalidLineageError``)."""
    if walk.cut == "cycle":
        raise InvalidLineageError(
            f"the artifact's parent chain reaches {walk.cut_at} twice: publishing it would make a lineage cycle"
        )
    if walk.cut == "depth":
        raise InvalidLineageError(
            f"the artifact's parent chain is more than {limit} artifacts deep",
            hint=f"start a new root artifact; lineages here are at most {limit} deep (max_lineage_depth)",
            extra={"limit": limit},
        )


def stops_unlogged(walk: Ancestry) -> bool:
    """True when a walk ended at an ancestor without an entry (one may be logged later)."""
    return walk.cut is None and bool(walk.ancestors) and walk.ancestors[-1].entry is None


def check_pre_registration(ref: tuple[str, int], found: EntryRow | None) -> None:
    """A replay's pre-registration ``ref`` (entry digest, log index) is ``found``, at that index."""
    digest, log_index = ref
    if found is None:
        raise MissingReferenceError(f"the replay answers to pre-registration {digest}, which is not in this log")
    if found.log_index != log_index or found.kind != "pre-registration":
        raise InvalidStatementError(
            f"the replay says its pre-registration {digest} is entry {log_index}, but that digest is "
            f"entry {found.log_index} ({found.kind})",
            hint="point the replay at the pre-registration's real log index",
        )


def copy_error(e: RegistryError) -> RegistryError:
    """A fresh exception like ``e`` for each publish it fails (one instance raised in many threads
    would gather their tracebacks)."""
    copy = RegistryError.__new__(type(e))
    copy.__dict__.update(e.__dict__)
    copy.args = e.args
    copy.__cause__ = e.__cause__
    return copy
