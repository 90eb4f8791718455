"""llama-server slots as signed statements (``kvgraft slot sign|verify``).

llama-server saves a slot's KV state with ``POST /slots/N?action=save`` into ``--slot-save-path``
and loads it back with ``action=restore``, checking nothing: not the bytes, not the weights, not
the build. A slot file is ``llama_state_seq_save_file``'s format, little-endian::

    u32 magic 'ggsq' (0x67677371), u32 version (3), u32 n_tokens, n_tokens x i32 (the server's
    token record), then the sequence's caches as llamacpp.py's module docstring lays them out
    (without the in-memory header)

``read_slot`` parses all of it (``SlotError`` on anything else, or a file over ``MAX_SLOT_BYTES``).
``sign_slot`` writes ``<slot>.dsse.json`` beside it: an in-toto statement (predicate type
``SLOT_PREDICATE``, ``SlotPredicate``) whose only subject is the slot file by sha256, binding the
server's GGUF (sha256 of the file the server reports in ``GET /props`` as ``model_path``, or of
``--gguf``), its build (``build_info``), the file's format version, its tokens and the shape of
every cache (cells, layers, row bytes, the positions' digest). ``verify_slot`` checks, in order:
the envelope against trusted keys, the subject's digest against the file, the file's structure
against the predicate, and the predicate against the server that is to restore it; each failure
is a ``SlotError`` naming what differs. Only then may ``restore_slot`` ask the server to restore.
"""

from __future__ import annotations

import datetime as dt
import json
import struct
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from kvgraft.schemas import (
    SLOT_PREDICATE,
    KvgraftError,
    Sha256Digest,
    SlotCache,
    SlotPredicate,
    SlotStatement,
    Subject,
    SubjectDigest,
    hex_of,
    sha256_bytes,
    sha256_file,
    token_digest,
    write_atomic,
)
from kvgraft.verifier import (
    TrustedKeys,
    envelope_json,
    open_signing_key,
    read_envelope,
    sign_statement,
    verify_statement_envelope,
)

from .errors import ArtifactError, EngineError
from .llamacpp import decode_state

#: ``LLAMA_FILE_MAGIC_GGSQ`` and the one version of the slot format this build writes.
SLOT_MAGIC = 0x67677371
SLOT_VERSION = 3
#: The largest slot file read (a 32K-token context of a 1.5B model is under 1 GiB).
MAX_SLOT_BYTES = 4 << 30
#: The longest wait for a server's answer, and the most bytes of it read.
SERVER_TIMEOUT_S = 30.0
MAX_SERVER_REPLY = 1 << 20


class SlotError(EngineError):
    """A slot file, its signature or its binding to a server does not check out."""

    default_hint = "save the slot again from the server that is to restore it, and sign it: kvgraft slot sign"


@dataclass(frozen=True)
class SlotFile:
    """A parsed slot file."""

    version: int
    tokens: list[int]
    caches: list[SlotCache]


def read_slot(path: Path) -> SlotFile:
    """Parse the slot file at ``path`` whole (``SlotError`` naming what is wrong)."""
    try:
        size = path.stat().st_size
        if size > MAX_SLOT_BYTES:
            raise SlotError(f"slot file {path} is {size} bytes, over the {MAX_SLOT_BYTES}-byte limit")
        data = path.read_bytes()
    except FileNotFoundError as e:
        raise SlotError(f"slot file {path} does not exist", hint="pass the file llama-server wrote into --slot-save-path") from e
    except OSError as e:
        raise SlotError(f"cannot read slot file {path}: {e.strerror}") from e
    if len(data) < 12:
        raise SlotError(f"{path} is not a llama.cpp slot file ({len(data)} bytes)")
    magic, version, n = struct.unpack_from("<III", data, 0)
    if magic != SLOT_MAGIC:
        raise SlotError(f"{path} is not a llama.cpp slot file (magic {magic:#x}, not 'ggsq')")
    if version != SLOT_VERSION:
        raise SlotError(f"{path} is slot format version {version}; this llama.cpp build reads version {SLOT_VERSION}",
                        hint="save the slot again with the server that is to restore it")
    if 12 + 4 * n > len(data):
        raise SlotError(f"{path} names {n} tokens but ends before them")
    tokens = list(struct.unpack_from(f"<{n}i", data, 12))
    body = data[12 + 4 * n:]
    last: ArtifactError | None = None
    for n_caches in (1, 2):  # one cache, or a sliding-window model's full and sliding ones
        try:
            caches = decode_state(body, n_caches, header=False)
            break
        except ArtifactError as e:
            last = e
    else:
        raise SlotError(f"{path} holds no llama.cpp state this build reads: {last.message if last else ''}") from last
    return SlotFile(version, tokens, [
        SlotCache(cells=len(c.positions), layers=len(c.keys), key_row_bytes=int(c.keys[0].shape[1] * 2) if c.keys else 0,
                  value_row_bytes=int(c.values[0].shape[1] * 2) if c.values else 0,
                  positions_digest=sha256_bytes(c.positions.astype("<i4").tobytes()))
        for c in caches])


@dataclass(frozen=True)
class ServerIdentity:
    """What a llama-server runs: its GGUF (path and sha256) and its build."""

    gguf_file: Path
    gguf_sha256: Sha256Digest
    build_info: str


def server_identity(url: str, *, gguf: Path | None = None) -> ServerIdentity:
    """The identity of the llama-server at ``url`` (``GET /props``); its GGUF hashed from the
    ``model_path`` it reports, or from ``gguf`` (a copy of the same file, for a remote server)."""
    props = _server_json(url, "/props")
    build, model_path = props.get("build_info"), props.get("model_path")
    if not isinstance(build, str) or not build or not isinstance(model_path, str):
        raise SlotError(f"{url}/props names no build_info or model_path", hint="point --server at a llama-server")
    path = gguf if gguf is not None else Path(model_path)
    if not path.is_file():
        raise SlotError(f"the server's GGUF {model_path} is not a file here", hint="pass --gguf with a copy of the server's GGUF")
    return ServerIdentity(path, sha256_file(path), build)


def _server_json(url: str, path: str, body: dict[str, object] | None = None) -> dict[str, object]:
    request = urllib.request.Request(url.rstrip("/") + path, data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"}, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=SERVER_TIMEOUT_S) as reply:  # noqa: S310 (the user's server URL)
            data = reply.read(MAX_SERVER_REPLY + 1)
    except urllib.error.HTTPError as e:
        detail = e.read(4096).decode("utf-8", errors="replace")
        raise SlotError(f"{url}{path} answered {e.code}: {detail}") from e
    except (urllib.error.URLError, OSError) as e:
        raise SlotError(f"cannot reach llama-server at {url}: {e}", hint="start it, or pass the right --server URL") from e
    if len(data) > MAX_SERVER_REPLY:
        raise SlotError(f"{url}{path} answered more than {MAX_SERVER_REPLY} bytes")
    try:
        parsed = json.loads(data)
    except ValueError as e:
        raise SlotError(f"{url}{path} did not answer JSON") from e
    if not isinstance(parsed, dict):
        raise SlotError(f"{url}{path} did not answer a JSON object")
    return parsed


def envelope_path(slot: Path) -> Path:
    """Where a slot's signature lives: ``<slot>.dsse.json`` beside it."""
    return slot.with_name(slot.name + ".dsse.json")


def sign_slot(slot: Path, server: ServerIdentity, key: Path, passphrase: bytes | None = None) -> tuple[Path, str]:
    """Sign ``slot`` as saved by ``server``; write ``<slot>.dsse.json``; return it and the keyid."""
    parsed = read_slot(slot)
    predicate = SlotPredicate(
        gguf_sha256=server.gguf_sha256, gguf_file=server.gguf_file.name, build_info=server.build_info,
        format_version=parsed.version, tokens=parsed.tokens, tokens_digest=token_digest(parsed.tokens), caches=parsed.caches,
        created=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))
    statement = SlotStatement(subject=[Subject(name=slot.name, digest=SubjectDigest(sha256=hex_of(sha256_file(slot))))],
                              predicate=predicate)
    with open_signing_key(key, passphrase) as signer:
        envelope = sign_statement(statement, [signer])
        keyid = signer.keyid
    out = envelope_path(slot)
    write_atomic(out, envelope_json(envelope), 0o644)
    return out, keyid


@dataclass(frozen=True)
class VerifiedSlot:
    """A slot whose signature, bytes, structure and binding to a server all checked."""

    slot: Path
    predicate: SlotPredicate
    signers: str


def verify_slot(slot: Path, trusted: TrustedKeys, server: ServerIdentity) -> VerifiedSlot:
    """Check ``slot`` before ``server`` restores it (module docstring); ``SlotError`` on any failure."""
    envelope_file = envelope_path(slot)
    if not envelope_file.is_file():
        raise SlotError(f"{slot} has no signature ({envelope_file.name} is missing)", hint="sign it: kvgraft slot sign")
    try:
        verified, statement = verify_statement_envelope(read_envelope(envelope_file), trusted)
    except KvgraftError as e:  # the verifier's error, converted at the engine's edge
        raise SlotError(f"the signature of {slot} does not verify: {e.message}",
                        hint="get the signer's public key into your trusted-keys file, or sign the slot yourself") from e
    if statement.predicate_type != SLOT_PREDICATE:
        raise SlotError(f"{envelope_file.name} is a {statement.predicate_type} statement, not a signed slot")
    if [s.name for s in statement.subject] != [slot.name]:
        raise SlotError(f"{envelope_file.name} is about {[s.name for s in statement.subject]}, not {slot.name}")
    digest = sha256_file(slot)
    if hex_of(digest) != statement.subject[0].digest.sha256:
        raise SlotError(f"{slot} has digest {digest}, but its signature says sha256:{statement.subject[0].digest.sha256}",
                        hint="the slot file was altered after it was signed: save it again from the server")
    if not isinstance(statement, SlotStatement):
        raise SlotError(f"{envelope_file.name}'s statement is not a signed slot's")
    predicate = statement.predicate
    parsed = read_slot(slot)
    if parsed.caches != predicate.caches or parsed.tokens != predicate.tokens:
        raise SlotError(f"{slot}'s structure differs from what its signature says")
    diffs = []
    if predicate.gguf_sha256 != server.gguf_sha256:
        diffs.append(f"GGUF: slot {predicate.gguf_file} ({predicate.gguf_sha256}), server {server.gguf_file.name} ({server.gguf_sha256})")
    if predicate.build_info != server.build_info:
        diffs.append(f"llama.cpp build: slot {predicate.build_info}, server {server.build_info}")
    if diffs:
        raise SlotError(f"{slot} was saved by another server than this one: {'; '.join(diffs)}",
                        hint="restore it only into a server with the same GGUF and build; save the slot again here otherwise")
    signers = ", ".join(sorted({k.name for k in verified.signers}))
    return VerifiedSlot(slot, predicate, signers)


def restore_slot(url: str, checked: VerifiedSlot, slot_id: int) -> dict[str, object]:
    """Ask the server at ``url`` to restore a checked slot into slot ``slot_id`` (the file must
    lie in the server's ``--slot-save-path`` under its own name); its answer."""
    answer = _server_json(url, f"/slots/{slot_id}?action=restore", {"filename": checked.slot.name})
    cells = checked.predicate.caches[0].cells if checked.predicate.caches else 0
    if answer.get("n_restored") != cells:
        raise SlotError(f"the server restored {answer.get('n_restored')} cells of {cells}", hint="check the server's log")
    return answer
