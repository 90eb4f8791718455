"""The registry's wire format: one typed model per JSON body the HTTP API sends.

Shared by both ends: the service's handlers (``kvgraft.registry``'s ``app.py``) return these
models, so the OpenAPI document at ``/schema/openapi.json`` is generated from the very types the
service answers with; the client (``kvgraft.registry.client``) parses every answer with them
(strictly: nothing is coerced), so a document of the wrong shape is refused in one place.

Each model is validated from the service's plain document and serialised with ``exclude_unset``
(``dump_wire``), so a response holds exactly the keys the service put in it, in the same order:
the JSON bodies are the same bytes as before these models existed (the verifier parses them as is).

Models allow extra keys (``extra="allow"``): a field the service adds later is passed through
unchanged instead of turning every answer into a 500 (or every client into an error); the schema
documents the known ones.

Formats: a digest is ``sha256:`` and 64 lowercase hex digits; a hash in a proof is 64 lowercase
hex digits (no prefix); times are RFC 3339 UTC with seconds (``2026-11-29T12:00:00Z``).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

#: A content digest as the API spells it everywhere (path, query and body).
DIGEST_PATTERN = r"^sha256:[0-9a-f]{64}$"
#: The largest tree size or log index the API accepts: a signed 64-bit integer, as in RFC 9162.
MAX_TREE_SIZE = (1 << 63) - 1

Digest = Annotated[str, Field(pattern=DIGEST_PATTERN, examples=["sha256:" + "ab" * 32])]
Hash = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Index = Annotated[int, Field(ge=0, le=MAX_TREE_SIZE)]


class Wire(BaseModel):
    """Base of the response models: extra keys pass through, nothing is coerced."""

    model_config = ConfigDict(extra="allow", strict=False, frozen=True)


# --- problems ----------------------------------------------------------------------------------


class Problem(Wire):
    """An RFC 9457 problem document (``application/problem+json``), sent with every 4xx and 5xx."""

    type: str = Field(description="a URI naming the kind of failure (https://kvgraft.dev/problems/<slug>)")
    title: str
    status: int = Field(ge=400, le=599)
    detail: str = Field(description="what happened")
    instance: str | None = Field(default=None, description="the request path")
    hint: str | None = Field(default=None, description="what to do about it")


# --- blobs -------------------------------------------------------------------------------------


class BlobStored(Wire):
    """The answer to a blob upload."""

    digest: Digest
    size: int = Field(ge=0)
    created: bool = Field(description="false when the blob was already stored")


# --- the log -----------------------------------------------------------------------------------


class InclusionProof(Wire):
    """An RFC 9162 inclusion proof of entry ``log_index`` in the tree of ``tree_size`` leaves."""

    log_index: Index
    tree_size: Index
    hashes: list[Hash]


class ConsistencyProof(Wire):
    """An RFC 9162 consistency proof from the tree of ``old_size`` leaves to that of ``new_size``."""

    old_size: Index
    new_size: Index
    hashes: list[Hash]


class LogKey(Wire):
    """The registry's log signing key and the log's origin."""

    origin: str
    public_key_pem: str
    keyid: str
    vkey: str = Field(description="the C2SP note verifier key")
    tree_size: Index


# --- entries -----------------------------------------------------------------------------------


class SubjectRef(Wire):
    """One subject of a statement: its name and digest."""

    name: str
    digest: Digest


class ModelBlock(Wire):
    """The model an artifact was computed with."""

    name: str
    weights_digest: str
    config_digest: str


class ArtifactBlock(Wire):
    """The indexed facts of a KV artifact entry (null on records)."""

    digest: Digest = Field(description="the digest of the artifact's tensors file")
    model: ModelBlock
    profile: str
    parent: Digest | None
    chain_key: str
    positions: list[int] = Field(min_length=2, max_length=2, description="[start, end) token positions")
    tokens: int = Field(ge=0)
    text_digest: str
    text: str | None = Field(default=None, description="the full source text (single-artifact answers)")
    text_preview: str | None = Field(default=None, description="the first 200 characters of the source text (listings)")


class EntryMeta(Wire):
    """One log entry's metadata."""

    log_index: Index
    digest: Digest = Field(description="the digest of the envelope bytes (the log leaf's data)")
    leaf_hash: Hash
    payload_type: str
    predicate_type: str
    kind: str = Field(description="artifact, exactness, evaluation, pre-registration or replay")
    publisher: str
    keyids: list[str]
    integrated_at: str
    size: int = Field(ge=0, description="the envelope's size in bytes")
    subjects: list[SubjectRef]
    envelope_url: str
    artifact: ArtifactBlock | None


class EntryDocument(Wire):
    """An entry with its inclusion proof at the latest checkpoint, and that checkpoint's note."""

    entry: EntryMeta
    inclusion_proof: InclusionProof
    checkpoint: str = Field(description="the C2SP signed note of the latest checkpoint")


class ListedItem(Wire):
    """What every listed item has, whatever the listing (entries, records, artifacts): its log index."""

    log_index: Index


class Listing(Wire):
    """What every page shares (``EntryPage``, ``ArtifactPage``): a client walks any listing with it."""

    items: list[ListedItem]
    next_cursor: str | None


class EntryPage(Wire):
    """One page of entries (or records) in log order; ``next_cursor`` is null on the last page."""

    items: list[EntryMeta]
    next_cursor: str | None


# --- artifacts ---------------------------------------------------------------------------------


class ArtifactSummary(ArtifactBlock):
    """A KV artifact as listed: its indexed facts and where it sits in the log."""

    log_index: Index
    entry_digest: Digest
    publisher: str
    keyids: list[str]
    integrated_at: str


class MissingParent(Wire):
    """A parent whose tensors are stored but that no entry of this log describes."""

    digest: Digest
    log_index: None


class Lineage(Wire):
    """An artifact's ancestors (nearest first) and its direct children."""

    parents: list[ArtifactSummary | MissingParent]
    children: list[ArtifactSummary]


class OtherEntry(Wire):
    """Another entry that logs the same tensors: a claim by its own signers (no entry owns a digest)."""

    log_index: Index
    digest: Digest
    publisher: str
    keyids: list[str] = Field(default_factory=list, description="the key ids that signed it")


class DsseSignature(Wire):
    """One DSSE signature."""

    sig: str
    keyid: str | None = None


class DsseEnvelope(Wire):
    """A DSSE envelope, as posted (https://github.com/secure-systems-lab/dsse)."""

    payload: str = Field(description="base64 of the payload bytes")
    payloadType: str  # noqa: N815 (the DSSE field name)
    signatures: list[DsseSignature]


class PostedSignature(BaseModel):
    """One signature of a posted envelope."""

    model_config = ConfigDict(extra="forbid")

    sig: str = Field(description="base64 of the signature bytes")
    keyid: str = Field(default="", description="hint only: the sha256 of the raw public key, in hex")


class PostedEnvelope(BaseModel):
    """The request body of ``POST /v1/entries``: a DSSE envelope, stored byte for byte."""

    model_config = ConfigDict(extra="forbid")

    payload: str = Field(description="base64 of the in-toto statement's bytes")
    payloadType: str  # noqa: N815 (the DSSE field name)
    signatures: list[PostedSignature] = Field(min_length=1)


class ArtifactDocument(Wire):
    """One artifact: its summary, entry, statement, envelope, lineage, inclusion proof and checkpoint."""

    artifact: ArtifactSummary
    entry: EntryMeta
    other_entries: list[OtherEntry]
    statement: dict[str, Any] = Field(description="the in-toto statement the envelope signs")
    envelope: DsseEnvelope
    lineage: Lineage
    inclusion_proof: InclusionProof
    checkpoint: str


class ArtifactPage(Wire):
    """One page of artifacts in log order; ``next_cursor`` is null on the last page."""

    items: list[ArtifactSummary]
    next_cursor: str | None


# --- publishers --------------------------------------------------------------------------------


class PublisherKey(Wire):
    """A registered publisher public key (Ed25519, ECDSA P-256 or P-384; SubjectPublicKeyInfo PEM)."""

    keyid: str
    public_key_pem: str
    created_at: str


class Publisher(Wire):
    """A publisher and its keys."""

    name: str
    created_at: str
    keys: list[PublisherKey]


class PublisherList(Wire):
    """Every publisher."""

    publishers: list[Publisher]


class DigestMatch(Wire):
    """A digest a short digest names: an artifact's tensors (``kind`` artifact, its first entry) or a record's envelope."""

    digest: str
    kind: str
    log_index: int
    publisher: str


class DigestMatches(Wire):
    """``GET /v1/digests/{prefix}``: the digests that start with ``prefix`` (``sha256:<hex>``),
    artifacts first, each ordered by digest; ``more`` when there are more than listed. One match
    is what a unique short digest names (as git resolves an abbreviated object name)."""

    prefix: str
    matches: list[DigestMatch]
    more: bool


def dump_wire(model: BaseModel) -> dict[str, Any]:
    """``model`` as the JSON object the API sends: only the keys that were set, in order."""
    return model.model_dump(mode="json", exclude_unset=True)
