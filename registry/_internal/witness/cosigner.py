"""The witness: c2sp.org/tlog-witness ``add-checkpoint`` over HTTP, with one state file per log.

``kvgraft witness serve`` runs ``create_witness_app`` under uvicorn. The witness is configured
with its own name and Ed25519 key and the note verifier keys (vkeys) of the logs it watches; for
each log (by origin) it keeps only the last checkpoint it cosigned, and cosigns a new one only
when it is signed by the log and a consistency proof from that last one verifies. So a log can
never get this witness's cosignature on two trees that do not extend one another: a fork, or a
rollback, is refused.

HTTP interface (both prefixes are the server's root):

- ``POST /add-checkpoint``: the body is ``old <size>\\n``, zero to 63 consistency proof lines (one
  base64 SHA-256 hash each), an empty line, then the signed checkpoint note; every line ends in
  ``\\n``. Answers, checked in this order:

  - ``400`` malformed body (``malformed-add-checkpoint``), or an old size above the checkpoint's;
  - ``404`` the origin is not a configured log (``unknown-log``);
  - ``403`` no valid signature by a configured key of that log, or one by such a key that does
    not verify (``checkpoint-signature``);
  - ``409`` the old size is not the size this witness last cosigned for the log (0 when none):
    body ``<size>\\n``, ``Content-Type: text/x.tlog.size``;
  - ``422`` the proof does not verify from the stored checkpoint, a proof was sent with old size
    0, equal sizes with different roots, or a size-0 checkpoint without the empty-tree root
    (``inconsistent-checkpoint``);
  - ``200`` the cosignature line(s) (``— <name> <base64>\\n``, ``text/plain``), after the new
    state is on disk.

  Other failures are RFC 9457 problem documents, as the registry's.
- ``GET /<sha256(origin), lowercase hex>/checkpoint``: the last checkpoint cosigned for that log,
  with the log's verified signature lines and this witness's cosignature (``404`` when none).

State: ``STATE/<sha256(origin) hex>.json`` =
``{"format": "kvgraft-witness-state/v1", "origin", "tree_size", "root_hash" (hex), "checkpoint"}``
(the checkpoint note as the GET serves it), replaced atomically and fsynced (``write_atomic``)
*before* the 200 is sent. Checking the old size and writing the new state happen under one lock,
so two concurrent requests can never both advance from the same size (the race the spec
describes), and ``STATE/.lock`` (``flock``) keeps a second witness process off the directory. A
state file is re-checked on every read (origin, size, root, and this witness's own cosignature
over it): a damaged one fails closed (500, and that log gets no cosignature until it is restored).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from kvgraft.schemas import DocumentError, parse_json, write_atomic
from kvgraft.verifier import (
    EMPTY_ROOT,
    Checkpoint,
    LogProofError,
    MalformedInputError,
    SigningKey,
    WitnessKey,
    cosign,
    note_key_id,
    open_cosignatures,
    parse_checkpoint,
    parse_signed_note,
    parse_vkey,
    verify_checkpoint,
    verify_consistency,
)

from ..errors import (
    AddCheckpointRequestError,
    CheckpointSignatureError,
    ConfigError,
    InconsistentCheckpointError,
    OldSizeConflictError,
    RegistryError,
    UnknownLogError,
    WitnessStateError,
)

logger = logging.getLogger("kvgraft.witness")

STATE_FORMAT = "kvgraft-witness-state/v1"
LOCK_FILE = ".lock"
#: The ``Content-Type`` of a 409 answer's body (the witness's current size).
SIZE_MEDIA_TYPE = "text/x.tlog.size"
#: c2sp.org/tlog-witness: a client MUST NOT send more than 63 consistency proof lines.
MAX_PROOF_LINES = 63
#: An add-checkpoint body: a size line, 63 proof lines of 45 bytes and a checkpoint note with a
#: few signatures is under 8 KiB; this leaves room for many cosignatures already on the note.
DEFAULT_WITNESS_MAX_BODY_BYTES = 64 * 1024
#: A state file holds one note; anything much larger is not one.
_MAX_STATE_BYTES = 1 << 20

_OLD_LINE = re.compile(r"old (0|[1-9][0-9]{0,19})", re.ASCII)
_PROOF_LINE = re.compile(r"[A-Za-z0-9+/]{43}=", re.ASCII)
_ORIGIN_HASH = re.compile(r"[0-9a-f]{64}", re.ASCII)


# --- the request -------------------------------------------------------------------------------


@dataclass(frozen=True)
class AddCheckpoint:
    """A parsed add-checkpoint body: the old size, the consistency proof, the signed note."""

    old_size: int
    proof: tuple[bytes, ...]
    note: bytes


def parse_add_checkpoint(body: bytes) -> AddCheckpoint:
    """Split an add-checkpoint body; ``AddCheckpointRequestError`` (400) naming the first fault.

    Strict: ``old`` and a decimal without leading zeros, at most 63 proof lines of exactly one
    padded base64 SHA-256 hash, then an empty line, then a non-empty note. The note itself is
    parsed later (a malformed note is a 400 too).
    """
    first, sep, rest = body.partition(b"\n")
    try:
        old_line = first.decode("ascii")
    except UnicodeDecodeError as e:
        raise AddCheckpointRequestError("the first line is not ASCII; it must be 'old <size>'") from e
    if not sep or not _OLD_LINE.fullmatch(old_line):
        raise AddCheckpointRequestError(
            f"the first line {old_line[:40]!r} is not 'old <size>' (a decimal with no leading zeros, ending in a newline)"
        )
    # At most 20 digits; one past the checkpoint's size (itself at most 2^64-1) is refused later.
    old_size = int(old_line[4:])
    proof: list[bytes] = []
    while True:
        line, sep, rest = rest.partition(b"\n")
        if not sep:
            raise AddCheckpointRequestError(
                "the body has no empty line after the old size and the proof lines",
                hint="end the proof with an empty line, then send the checkpoint",
            )
        if not line:
            break
        if len(proof) == MAX_PROOF_LINES:
            raise AddCheckpointRequestError(f"the consistency proof has more than {MAX_PROOF_LINES} lines")
        text = line.decode("ascii", "replace")
        if not _PROOF_LINE.fullmatch(text):
            raise AddCheckpointRequestError(
                f"proof line {len(proof) + 1} {text[:60]!r} is not one base64 SHA-256 hash (44 characters)"
            )
        proof.append(base64.b64decode(text, validate=True))
    if not rest:
        raise AddCheckpointRequestError("the body has no checkpoint after its empty line")
    return AddCheckpoint(old_size, tuple(proof), rest)


# --- the state ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class WitnessedHead:
    """The last checkpoint this witness cosigned for one log, and the note it serves for it."""

    checkpoint: Checkpoint
    note: bytes


def origin_hash(origin: str) -> str:
    """The lowercase hex SHA-256 of the origin: the state file's stem and the monitoring path."""
    return hashlib.sha256(origin.encode("utf-8")).hexdigest()


class WitnessState:
    """The state directory: one JSON file per log, and the lock that keeps it to one process.

    Use ``WitnessState.open(directory, key)`` as a context manager; reads re-check every file
    against the witness's own key (``load``).
    """

    def __init__(self, directory: Path, key: WitnessKey, lock_fd: int) -> None:
        self.directory = directory
        self.key = key
        self._lock_fd = lock_fd

    @classmethod
    @contextlib.contextmanager
    def open(cls, directory: Path, key: WitnessKey) -> Iterator[WitnessState]:
        """Create ``directory`` (0700) if needed and hold its lock until the block ends."""
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as e:
            raise WitnessStateError(f"cannot open the witness state directory {directory}: {e.strerror}") from e
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as e:
                raise WitnessStateError(
                    f"the witness state directory {directory} is in use by another witness process",
                    hint="stop the other witness, or give this one its own --state directory",
                ) from e
            yield cls(directory, key, fd)
        finally:
            os.close(fd)

    def path(self, origin: str) -> Path:
        """The state file of log ``origin``."""
        return self.directory / f"{origin_hash(origin)}.json"

    def load(self, origin: str) -> WitnessedHead | None:
        """The last checkpoint cosigned for ``origin``, re-checked; None when there is none.

        Raises ``WitnessStateError`` when the file is unreadable or does not hold a checkpoint of
        that origin carrying this witness's own valid cosignature.
        """
        path = self.path(origin)
        try:
            with path.open("rb") as f:
                raw = f.read(_MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise WitnessStateError(f"cannot read the witness state {path}: {e.strerror}") from e
        try:
            if len(raw) > _MAX_STATE_BYTES:
                raise ValueError("it is too large to be a state file")
            doc: Any = parse_json(raw, what=path.name)
            if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT:
                raise ValueError(f"it is not a {STATE_FORMAT} document")
            note = str(doc["checkpoint"]).encode("utf-8")
            # Our own cosignature proves we wrote it (and that nothing in it changed since).
            # Any time is fine here: it was cosigned in the past, whatever the clock says now.
            found = open_cosignatures(note, [self.key], now=float(1 << 62))
            if found.by(self.key) is None:
                raise ValueError(
                    f"it does not carry a cosignature by {self.key.name}+{self.key.key_id.hex()} (was it written "
                    "under another --key or --name? then start the witness with those)"
                )
            checkpoint = parse_checkpoint(parse_signed_note(note).text)
            if (checkpoint.origin, checkpoint.size, checkpoint.root_hash.hex()) != (
                origin, doc["tree_size"], doc["root_hash"]
            ):
                raise ValueError("its fields do not match its checkpoint")
        except (ValueError, KeyError, TypeError, DocumentError, LogProofError, MalformedInputError) as e:
            raise WitnessStateError(
                f"the witness state {path} of log {origin!r} is damaged: {e}",
                hint="restore it from a backup; until then this log gets no cosignature (never delete it: "
                "the witness would then cosign any tree for the log)",
            ) from e
        return WitnessedHead(checkpoint, note)

    def save(self, head: WitnessedHead) -> None:
        """Replace the state of ``head``'s log: temp file, fsync, rename, directory fsync."""
        c = head.checkpoint
        doc = {
            "format": STATE_FORMAT,
            "origin": c.origin,
            "tree_size": c.size,
            "root_hash": c.root_hash.hex(),
            "checkpoint": head.note.decode("utf-8"),
        }
        path = self.path(c.origin)
        try:
            write_atomic(path, (json.dumps(doc, indent=2) + "\n").encode("utf-8"), 0o600)
        except OSError as e:
            raise WitnessStateError(f"cannot write the witness state {path}: {e.strerror}") from e


# --- the witness -------------------------------------------------------------------------------


def parse_log_vkeys(vkeys: Sequence[str]) -> dict[str, list[Ed25519PublicKey]]:
    """The logs' note verifier keys by origin (the vkey's name is the log's origin).

    Raises ``ConfigError`` naming a malformed vkey, and when no log is given.
    """
    logs: dict[str, list[Ed25519PublicKey]] = {}
    for vkey in vkeys:
        try:
            origin, key = parse_vkey(vkey)
        except MalformedInputError as e:
            raise ConfigError(f"--log {vkey[:60]!r}: {e.message}", hint="pass the log's vkey, e.g. from GET /v1/log/key") from e
        logs.setdefault(origin, []).append(key)
    if not logs:
        raise ConfigError("the witness watches no log", hint="pass --log VKEY for each log it should cosign")
    return logs


class Witness:
    """The witness's rules over its state: verify, check consistency, cosign, persist; thread-safe."""

    def __init__(
        self, name: str, signing_key: SigningKey, logs: Mapping[str, Sequence[Ed25519PublicKey]], state: WitnessState
    ) -> None:
        self.name = name
        self._key = signing_key
        self.logs = {origin: tuple(keys) for origin, keys in logs.items()}
        self.state = state
        # One writer: the old-size check and the state write are one step (c2sp.org/tlog-witness).
        self._lock = threading.Lock()

    def _verify_log_signature(self, note: bytes, checkpoint: Checkpoint) -> bytes:
        """The note's signature lines by the log's configured keys, each verified (403 otherwise).

        Lines of other keys (other witnesses' cosignatures, keys the witness does not know) are
        ignored, as signed-note requires; one line of a known key that fails refuses the note.
        """
        origin = checkpoint.origin
        signatures = parse_signed_note(note).signatures
        kept: list[bytes] = []
        for key in self.logs[origin]:
            key_id = note_key_id(origin, key)
            mine = [s for s in signatures if (s.name, s.key_id) == (origin, key_id)]
            if not mine:
                continue
            try:
                verify_checkpoint(note, origin, key, origin=origin)
            except LogProofError as e:
                raise CheckpointSignatureError(f"the checkpoint of {origin}: {e.message}") from e
            kept += [s.line() for s in mine]
        if not kept:
            names = ", ".join(f"{s.name}+{s.key_id.hex()}" for s in signatures)
            raise CheckpointSignatureError(
                f"the checkpoint of {origin} carries no signature by a key this witness trusts for that log "
                f"(it is signed by {names})"
            )
        return b"".join(kept)

    def add_checkpoint(self, body: bytes) -> bytes:
        """Handle one add-checkpoint body; return the cosignature line(s) (see the module docstring)."""
        request = parse_add_checkpoint(body)
        try:
            parsed = parse_signed_note(request.note)
            checkpoint = parse_checkpoint(parsed.text)
        except MalformedInputError as e:
            raise AddCheckpointRequestError(f"the checkpoint note is malformed: {e.message}") from e
        if checkpoint.origin not in self.logs:
            raise UnknownLogError(f"this witness does not watch the log {checkpoint.origin!r}")
        log_lines = self._verify_log_signature(request.note, checkpoint)
        if request.old_size > checkpoint.size:
            raise AddCheckpointRequestError(
                f"the old size {request.old_size} is larger than the checkpoint's size {checkpoint.size}"
            )
        with self._lock:
            stored = self.state.load(checkpoint.origin)
            current = stored.checkpoint.size if stored is not None else 0
            if request.old_size != current:
                raise OldSizeConflictError(
                    f"the old size is {request.old_size}, but this witness last cosigned {checkpoint.origin} "
                    f"at size {current}",
                    size=current,
                )
            old_root = stored.checkpoint.root_hash if stored is not None else EMPTY_ROOT
            try:
                verify_consistency(current, checkpoint.size, old_root, checkpoint.root_hash, list(request.proof))
            except LogProofError as e:
                logger.warning("refused %s at size %d: %s", checkpoint.origin, checkpoint.size, e.message)
                raise InconsistentCheckpointError(
                    f"the checkpoint of {checkpoint.origin} at size {checkpoint.size} is not proved to extend the one "
                    f"this witness cosigned at size {current}: {e.message}"
                ) from e
            line = cosign(parsed.text, self.name, self._key)
            self.state.save(WitnessedHead(checkpoint, parsed.text + b"\n" + log_lines + line))
        logger.info("cosigned %s at size %d", checkpoint.origin, checkpoint.size)
        return line

    def latest(self, hashed_origin: str) -> bytes:
        """The note of the last checkpoint cosigned for the log whose origin hashes to ``hashed_origin``."""
        if not _ORIGIN_HASH.fullmatch(hashed_origin):
            raise UnknownLogError(f"{hashed_origin[:80]!r} is not the lowercase hex SHA-256 of a log's origin")
        for origin in self.logs:
            if origin_hash(origin) == hashed_origin:
                head = self.state.load(origin)
                if head is not None:
                    return head.note
                raise UnknownLogError(f"this witness has cosigned no checkpoint of {origin!r} yet")
        raise UnknownLogError(f"this witness watches no log whose origin hashes to {hashed_origin}")


# --- the app -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WitnessSettings:
    """How a witness serves: its key name, the logs' vkeys, its state directory and its limits."""

    name: str
    logs: tuple[str, ...]
    state: Path
    max_body_bytes: int = DEFAULT_WITNESS_MAX_BODY_BYTES

    def __post_init__(self) -> None:
        if isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
            raise ValueError(f"WitnessSettings.max_body_bytes must be a positive int, got {self.max_body_bytes!r}")


def create_witness_app(signing_key: SigningKey, settings: WitnessSettings) -> Any:
    """The witness's Litestar app. ``signing_key`` (Ed25519) must stay open while it serves.

    Its lifespan takes the state directory's lock and releases it on shutdown. Raises
    ``ConfigError`` for a bad name, log vkey or key type before anything is served.
    """
    import anyio
    import anyio.to_thread
    from litestar import Litestar, Request, Response, get, post
    from litestar.exceptions import HTTPException
    from litestar.params import FromPath

    from kvgraft.verifier import KeyFileError, require_ed25519

    from ..http.problems import HttpEdge, http_error, internal_error, read_limited, registry_error
    from ..http.security import add_security_headers
    from ..settings import RegistrySettings

    try:
        key = WitnessKey(settings.name, require_ed25519(signing_key.public_key, "the witness key"))
    except (KeyFileError, MalformedInputError) as e:
        raise ConfigError(f"the witness key or name cannot cosign: {e.message}", hint=e.hint) from e
    logs = parse_log_vkeys(settings.logs)

    def witness_error(request: Request[Any, Any, Any], exc: RegistryError) -> Response[Any]:
        if isinstance(exc, OldSizeConflictError):
            # The spec's answer: the size, a newline, and this media type (not a problem document).
            # Exactly this media type: Litestar would append "; charset=utf-8" to a text/ one it sets.
            return Response(
                content=f"{exc.size}\n".encode("ascii"), status_code=409, headers={"content-type": SIZE_MEDIA_TYPE}
            )
        return registry_error(request, exc)

    @post("/add-checkpoint", request_max_body_size=None, status_code=200, summary="Cosign a checkpoint")
    async def add_checkpoint(request: Request[Any, Any, Any]) -> Response[bytes]:
        witness: Witness = request.app.state.witness
        body = await read_limited(request, settings.max_body_bytes, "add-checkpoint body")
        line = await anyio.to_thread.run_sync(witness.add_checkpoint, body)
        return Response(content=line, media_type="text/plain")

    @get("/{hashed:str}/checkpoint", summary="The last checkpoint cosigned for a log")
    async def latest(request: Request[Any, Any, Any], hashed: FromPath[str]) -> Response[bytes]:
        witness: Witness = request.app.state.witness
        note = await anyio.to_thread.run_sync(witness.latest, hashed)
        return Response(content=note, media_type="text/plain", headers={"Cache-Control": "no-cache"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        stack = contextlib.ExitStack()
        state = await anyio.to_thread.run_sync(stack.enter_context, WitnessState.open(settings.state, key))
        try:
            app.state.witness = Witness(settings.name, signing_key, logs, state)
            app.state.scrub_roots = sorted({str(settings.state), str(settings.state.resolve())}, key=len, reverse=True)
            logger.info("witness %s: %d log(s), state in %s", key.vkey, len(logs), settings.state)
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(stack.close)

    app = Litestar(
        route_handlers=[add_checkpoint, latest],
        lifespan=[lifespan],
        before_send=[add_security_headers],
        exception_handlers={RegistryError: witness_error, HTTPException: http_error, Exception: internal_error},
        logging_config=None,
        openapi_config=None,
        # The handlers' annotations are strings (postponed), naming what this function imported.
        signature_namespace={"Any": Any, "FromPath": FromPath, "Request": Request, "Response": Response},
    )
    app.asgi_handler = HttpEdge(app, app.asgi_handler, RegistrySettings())
    return app


def serve_witness(signing_key: SigningKey, settings: WitnessSettings, *, host: str, port: int, log_level: str = "info") -> bool:
    """Serve the witness on ``host:port`` until interrupted; False if the server never started."""
    import sys

    import uvicorn

    from ..server import header_limited_protocol
    from ..settings import DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADER_COUNT

    if not 1 <= port <= 65535:
        raise ConfigError(f"port {port} is not between 1 and 65535", hint="pass --port 8001, or another free port")
    app = create_witness_app(signing_key, settings)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(log_level.upper())
    logger.propagate = False
    try:
        try:
            protocol: Any = header_limited_protocol(DEFAULT_MAX_HEADER_BYTES, DEFAULT_MAX_HEADER_COUNT)
        except ImportError:
            protocol = "h11"
        config = uvicorn.Config(
            app, host=host, port=port, log_level=log_level, lifespan="on", server_header=False, http=protocol,
            h11_max_incomplete_event_size=DEFAULT_MAX_HEADER_BYTES, timeout_graceful_shutdown=10,
        )
        server = uvicorn.Server(config)
        server.run()
        return bool(server.started)
    finally:
        logger.removeHandler(handler)
        logger.propagate = True

