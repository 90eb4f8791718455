"""Entries: check a posted DSSE envelope for a token, and extract what the registry indexes.

The envelope bytes are the log's leaf data and are stored verbatim; everything here reads
them without re-serialising, and the payload is parsed only after a signature holds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NoReturn

from kvgraft.schemas import (
    EVALUATION_PREDICATE,
    EXACTNESS_PREDICATE,
    KV_ARTIFACT_PREDICATE,
    KV_FILE,
    PRE_REGISTRATION_PREDICATE,
    REPLAY_PREDICATE,
    SLOT_PREDICATE,
    STATEMENT_MODELS,
    Envelope,
    EvaluationStatement,
    ExactnessStatement,
    KvArtifactStatement,
    ReplayStatement,
    Statement,
    hex_of,
)
from kvgraft.verifier import (
    BadSignatureError,
    MalformedInputError,
    ThresholdNotMetError,
    TrustedKey,
    TrustedKeys,
    UnknownKeyError,
    UnsupportedPayloadTypeError,
    VerifiedEnvelope,
    b64decode_any,
    parse_envelope,
    verify_envelope,
    verify_statement_envelope,
)

from .errors import (
    BadRequestError,
    DocumentTooDeepError,
    InvalidLineageError,
    InvalidSignatureError,
    InvalidStatementError,
    KeyNotBoundError,
    MalformedEnvelopeError,
    TooManySignaturesError,
)
from .settings import DEFAULT_MAX_JSON_DEPTH, DEFAULT_MAX_SIGNATURES

#: predicateType -> the short kind the API filters and reports by.
KINDS: dict[str, str] = {
    KV_ARTIFACT_PREDICATE: "artifact",
    EXACTNESS_PREDICATE: "exactness",
    EVALUATION_PREDICATE: "evaluation",
    PRE_REGISTRATION_PREDICATE: "pre-registration",
    REPLAY_PREDICATE: "replay",
    SLOT_PREDICATE: "slot",
}
RECORD_KINDS = ("exactness", "evaluation", "pre-registration", "replay", "slot")


def kind_of_filter(value: str) -> str:
    """The kind named by a ``type`` filter: a kind or a predicate type URI."""
    if value in KINDS:
        return KINDS[value]
    if value in KINDS.values():
        return value
    raise BadRequestError(
        f"unknown record type {value!r}",
        hint=f"use one of {', '.join(RECORD_KINDS)} (or their predicate type URIs)",
    )


@dataclass(frozen=True)
class ArtifactFields:
    """The artifact columns of an entry."""

    digest: str
    model_name: str
    model_weights_digest: str
    model_config_digest: str
    profile_name: str
    parent: str | None
    chain_key: str
    position_start: int
    position_end: int
    source_text: str | None
    source_text_digest: str


@dataclass(frozen=True)
class IndexedStatement:
    """What the registry records about a verified statement, besides the envelope."""

    kind: str
    predicate_type: str
    subjects: list[tuple[str, str]]
    refs: list[tuple[str, str]] = field(default_factory=list)
    #: Blobs that must be stored before the entry is accepted (bare hex).
    required_blobs: list[str] = field(default_factory=list)
    artifact: ArtifactFields | None = None
    #: For a replay: the pre-registration it answers to (entry digest, log index).
    pre_registration: tuple[str, int] | None = None


# A JSON string token (with its escapes), and the brackets that open and close a level.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKETS = bytes.maketrans(b"[{]}", b"(())")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def json_depth_within(data: bytes, limit: int) -> bool:
    """True when the JSON text ``data`` nests at most ``limit`` levels of arrays and objects.

    Runs before any parser sees the text, in time linear in its size and at C speed: strings
    are dropped, the brackets kept, and innermost ``()`` pairs removed once per level. Text
    whose brackets do not balance also answers False after ``limit`` rounds (it is not JSON).
    """
    shape = _JSON_STRING.sub(b"", data).translate(_BRACKETS, _NOT_BRACKETS)
    for _ in range(limit):
        if not shape:
            return True
        shorter = shape.replace(b"()", b"")
        if len(shorter) == len(shape):
            return False
        shape = shorter
    return not shape


def decode_envelope(
    body: bytes, *, max_signatures: int = DEFAULT_MAX_SIGNATURES, max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
) -> Envelope:
    """Parse the posted bytes as a DSSE envelope and check that its base64 decodes.

    Refuses, before any signature is verified: an envelope or a payload nesting deeper than
    ``max_json_depth`` (``DocumentTooDeepError``, 400), more than ``max_signatures``
    signatures (``TooManySignaturesError``, 413), anything that is not a DSSE envelope (400).
    """
    if not body:
        raise MalformedEnvelopeError("the request body is empty; it must be a DSSE envelope (JSON)")
    if not json_depth_within(body, max_json_depth):
        raise DocumentTooDeepError(
            f"the posted envelope nests deeper than {max_json_depth} levels (or its brackets do not balance)",
            extra={"limit": max_json_depth},
        )
    try:
        envelope = parse_envelope(body, source="the posted envelope")
        if len(envelope.signatures) > max_signatures:
            raise TooManySignaturesError(
                f"the envelope carries {len(envelope.signatures)} signatures; this registry verifies at most "
                f"{max_signatures} per envelope",
                extra={"limit": max_signatures},
            )
        payload = b64decode_any(envelope.payload, what="the envelope's payload")
        for i, sig in enumerate(envelope.signatures):
            b64decode_any(sig.sig, what=f"the envelope's signature {i}")
    except MalformedInputError as e:
        raise MalformedEnvelopeError(e.message) from e
    if not json_depth_within(payload, max_json_depth):
        raise DocumentTooDeepError(
            f"the envelope's payload nests deeper than {max_json_depth} levels (or its brackets do not balance)",
            extra={"limit": max_json_depth},
        )
    return envelope


def verify_for_token(
    envelope: Envelope, bound: list[TrustedKey], registered: dict[str, tuple[TrustedKey, str]]
) -> tuple[VerifiedEnvelope, Statement]:
    """Verify ``envelope`` against the keys the token is ``bound`` to; return signers and statement.

    ``registered`` maps every registered key id to (key, publisher). A signature by a
    registered key the token is not bound to is a 403 when nothing else verifies. A signature
    that claims a registered or bound key (its keyid hint) but does not verify with it is an
    altered or forged envelope (422), even beside another key's valid signature: a reader who
    trusts the claimed key's publisher would otherwise see their name on an envelope they never
    signed.
    """
    if bound:
        try:
            verified = verify_statement_envelope(envelope, TrustedKeys(tuple(bound)))
        except UnsupportedPayloadTypeError as e:
            raise InvalidStatementError(e.message, hint="post in-toto statements (application/vnd.in-toto+json)") from e
        except MalformedInputError as e:
            # Signatures held; the signed payload is not a valid statement.
            raise InvalidStatementError(e.message) from e
        except (UnknownKeyError, BadSignatureError, ThresholdNotMetError):
            pass
        else:
            _check_claimed_signatures(envelope, bound, registered)
            return verified
    _explain_signature_failure(envelope, bound, registered)


def _check_claimed_signatures(
    envelope: Envelope, bound: list[TrustedKey], registered: dict[str, tuple[TrustedKey, str]]
) -> None:
    """Refuse (422) an envelope with a signature whose keyid hint names a registered or bound key
    it does not verify with. A lone signature is the one that just verified: nothing to check."""
    if len(envelope.signatures) < 2:
        return
    keys = {str(k.keyid): (k, "a key bound to this token") for k in bound} | {
        kid: (k, f"the key of publisher {publisher[:80]!r}") for kid, (k, publisher) in registered.items()
    }
    for index, signature in enumerate(envelope.signatures):
        claimed = keys.get(signature.keyid) if signature.keyid else None
        if claimed is None:
            continue
        key, owner = claimed
        alone = envelope.model_copy(update={"signatures": [signature]})
        try:
            verify_envelope(alone, TrustedKeys((key,)), threshold=1)
        except (UnknownKeyError, BadSignatureError, ThresholdNotMetError, MalformedInputError) as e:
            raise InvalidSignatureError(
                f"signature {index} of the envelope claims key {signature.keyid[:16]}... ({owner}), but "
                "does not verify over its payload with that key: it was altered after signing, or forged",
                hint="post the envelope as it was signed: drop every signature its key did not make",
            ) from e


def _explain_signature_failure(
    envelope: Envelope, bound: list[TrustedKey], registered: dict[str, tuple[TrustedKey, str]]
) -> NoReturn:
    bound_ids = {k.keyid for k in bound}
    others = [k for k, _ in registered.values() if k.keyid not in bound_ids]
    if others:
        try:
            verified = verify_envelope(envelope, TrustedKeys(tuple(others)), threshold=1)
        except (UnknownKeyError, BadSignatureError, ThresholdNotMetError, UnsupportedPayloadTypeError, MalformedInputError):
            verified = None
        if verified is not None:
            named = ", ".join(f"{k.keyid[:16]}... of publisher {registered[k.keyid][1]!r}" for k in verified.signers)
            raise KeyNotBoundError(f"the envelope is signed by {named}, and this token is not bound to that key")
    hints = {s.keyid for s in envelope.signatures if s.keyid}
    claimed = sorted(hints & (bound_ids | set(registered)))
    if claimed:
        owners = ", ".join(
            f"{kid[:16]}... of publisher {registered[kid][1][:80]!r}" if kid in registered else f"{kid[:16]}... (bound to this token)"
            for kid in claimed
        )
        raise InvalidSignatureError(
            f"the envelope's signature claiming key {owners} does not verify over its payload: it was altered after signing"
        )
    if hints:
        shown = ", ".join(sorted(h[:16] + "..." for h in hints))
        raise KeyNotBoundError(
            f"the envelope is signed by key(s) {shown} that are not registered with this registry",
            hint="register the public key ('kvgraft key add') and bind a token to it ('kvgraft token create --key')",
        )
    raise InvalidSignatureError(
        f"none of the envelope's {len(envelope.signatures)} signature(s) verifies with the "
        f"{len(bound)} key(s) this token is bound to ({', '.join(k.keyid[:16] + '...' for k in bound) or 'none'})",
        hint="sign with a key the token is bound to; if you did, the envelope was altered after signing",
    )


def index_statement(statement: Statement) -> IndexedStatement:
    """What to store and check for a verified statement; ``InvalidStatementError`` if unacceptable."""
    kind = KINDS.get(statement.predicate_type)
    if kind is None or not isinstance(statement, STATEMENT_MODELS[statement.predicate_type]):
        raise InvalidStatementError(f"predicate type {statement.predicate_type!r} is not one this registry accepts")
    subjects = [(s.name, "sha256:" + s.digest.sha256) for s in statement.subject]
    required = [s.digest.sha256 for s in statement.subject]
    refs: list[tuple[str, str]] = [(d, "subject") for _, d in subjects]
    artifact = None
    pre_registration = None
    if isinstance(statement, KvArtifactStatement):
        by_name = dict(subjects)
        if KV_FILE not in by_name:
            raise InvalidStatementError(
                f"a KV artifact statement must name a {KV_FILE} subject; this one names {', '.join(sorted(by_name))}",
                hint="post the statement 'kvgraft capture' wrote",
            )
        p = statement.predicate
        _check_span(p.positions.start, p.positions.end, len(p.tokens.ids), parent=p.parent, digest=by_name[KV_FILE])
        if p.parent is not None:
            # The parent's tensors: a child is useless without them.
            required.append(hex_of(p.parent))
            refs.append((p.parent, "parent"))
        artifact = ArtifactFields(
            digest=by_name[KV_FILE],
            model_name=p.model.name,
            model_weights_digest=p.model.weights_digest,
            model_config_digest=p.model.config_digest,
            profile_name=p.profile.name,
            parent=p.parent,
            chain_key=p.chain_key,
            position_start=p.positions.start,
            position_end=p.positions.end,
            source_text=p.source_text.text,
            source_text_digest=p.source_text.digest,
        )
    elif isinstance(statement, ExactnessStatement):
        refs += [(s.prefix_artifact, "prefix_artifact") for s in statement.predicate.samples]
    elif isinstance(statement, EvaluationStatement):
        refs += [(d, "library_artifact") for d in statement.predicate.library_artifacts]
        refs += [(i.library_entry, "library_artifact") for i in statement.predicate.items if i.library_entry]
    elif isinstance(statement, ReplayStatement):
        ref = statement.predicate.pre_registration
        refs.append((ref.envelope_digest, "pre_registration"))
        pre_registration = (ref.envelope_digest, ref.log_index)
    _check_storable(subjects, refs, artifact)
    return IndexedStatement(
        kind=kind,
        predicate_type=statement.predicate_type,
        subjects=subjects,
        refs=list(dict.fromkeys(refs)),
        required_blobs=list(dict.fromkeys(required)),
        artifact=artifact,
        pre_registration=pre_registration,
    )


def _check_storable(subjects: list[tuple[str, str]], refs: list[tuple[str, str]], artifact: ArtifactFields | None) -> None:
    """Refuse text the database cannot store: JSON may escape a lone UTF-16 surrogate (``"\\ud800"``),
    which no UTF-8 string holds. Checked before the publish is queued, so that it cannot fail
    the transaction of a whole batch of others' entries."""
    texts = [t for pair in subjects + refs for t in pair]
    if artifact is not None:
        texts += [artifact.model_name, artifact.profile_name, artifact.chain_key, artifact.source_text_digest,
                  artifact.model_weights_digest, artifact.model_config_digest, artifact.source_text or ""]
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidStatementError(
                f"the statement holds text with a lone UTF-16 surrogate ({text[max(e.start - 10, 0):e.start]!r} then "
                f"U+{ord(text[e.start]):04X}), which is not Unicode text",
                hint="sign a statement whose strings are valid Unicode ('kvgraft capture' writes one)",
            ) from e


def _check_span(start: int, end: int, tokens: int, *, parent: str | None, digest: str) -> None:
    """What an artifact's own statement must say about its span: the checks that need no other entry.

    A KV artifact covers ``[start, end)``, at least one position, one token id per position;
    a root starts at 0 (a child's start is checked against its parent's entry at publish).
    """
    if end <= start:
        raise InvalidLineageError(f"the artifact covers no positions: its range [{start}, {end}) is empty")
    if tokens != end - start:
        raise InvalidLineageError(
            f"the artifact's positions [{start}, {end}) cover {end - start} tokens, but it lists {tokens} token ids"
        )
    if parent is None and start != 0:
        raise InvalidLineageError(f"the artifact has no parent, so it must start at position 0; it starts at {start}")
    if parent == digest:
        raise InvalidLineageError(f"the artifact {digest} names itself as its parent: a lineage cycle")
