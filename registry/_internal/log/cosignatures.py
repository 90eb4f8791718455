"""Witness cosignatures of the registry's checkpoints: collected in the background, stored, served.

``kvgraft serve --witness VKEY=URL`` (``RegistrySettings.witnesses``) names the witnesses. After
each new checkpoint is durable (the registry's ``on_new_head`` hook), one thread per witness
submits the newest checkpoint to it with c2sp.org/tlog-witness ``add-checkpoint``:
``old <size>``, the registry's consistency proof from that size, an empty line, the note. The
size is the last one the witness cosigned: from the last success, from the ``cosignatures``
table after a restart, or from the witness's ``409`` answer (its size, ``text/x.tlog.size``).
A witness that says it has seen a *larger* tree of this log than the registry has is reported
(the log was forked or rolled back behind it), and retried like any other failure.

Each request is bounded (``witness_timeout`` seconds per read and twice that in all, answers of
at most 64 KiB, read without decompressing); failures are retried with exponential backoff (1 s
doubling to 5 minutes); nothing here ever holds the database lock for more than one short
statement, so publishing never waits for a witness.

Every cosignature line a witness returns is verified (``kvgraft.verifier.open_cosignatures``
against the witness's vkey, over the checkpoint the registry signed) before it is stored in
``cosignatures`` (one row per tree size and witness key). ``/v1/log/checkpoint`` serves a
checkpoint's note with the stored lines appended; ``?witnessed=K`` finds the newest checkpoint
with at least K of them.
"""

from __future__ import annotations

import base64
import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvgraft.verifier import (
    MalformedInputError,
    VerificationError,
    WitnessKey,
    open_cosignatures,
    parse_signed_note,
    parse_witness_vkey,
)

from ..errors import ConfigError, WitnessSubmissionError
from ..storage.db import Database, now_utc
from ..storage.ddl import Migration, register
from .tree import LogHead

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger("kvgraft.registry")

#: The table of stored cosignatures; created by migration 3, registered below (ddl.py). ``line`` is the signature
#: line as the note carries it (``— <name> <base64>\n``), verified before it was stored.
COSIGNATURES_TABLE_DDL = (
    """CREATE TABLE cosignatures (
        tree_size BIGINT NOT NULL,
        witness VARCHAR NOT NULL,
        key_id VARCHAR NOT NULL,
        timestamp BIGINT NOT NULL,
        line VARCHAR NOT NULL,
        created_at VARCHAR NOT NULL,
        PRIMARY KEY (tree_size, witness, key_id))""",
)
# None exist before a witness is configured.
MIGRATION = register(
    Migration(3, "witness cosignatures of checkpoints", COSIGNATURES_TABLE_DDL, owner=__name__)
)

#: The most witnesses a registry submits to (each adds a line to every checkpoint note served).
MAX_WITNESSES = 32
#: The largest answer read from a witness: cosignature lines, or a 409's size.
MAX_ANSWER_BYTES = 64 * 1024
#: Backoff between failed rounds: first, and the most.
FIRST_BACKOFF_SECONDS = 1.0
MAX_BACKOFF_SECONDS = 300.0
#: How often a witness's thread looks at the head when nothing woke it (a safety net for a lost wake-up).
IDLE_POLL_SECONDS = 30.0
#: 409 answers followed in one round (the size moves only when another submitter advances it).
_MAX_CONFLICTS = 3
_SIZE_BODY = re.compile(rb"(0|[1-9][0-9]{0,19})\n", re.ASCII)
_URL = re.compile(r"https?://[^\s]+", re.ASCII)


@dataclass(frozen=True)
class WitnessTarget:
    """A witness the registry submits to: its verifier key and its submission prefix URL."""

    key: WitnessKey
    url: str


def parse_witness_option(value: str) -> tuple[str, str]:
    """``VKEY=URL`` (``kvgraft serve --witness``) as (vkey, url); ``ValueError`` naming the fault.

    The URL starts at the first ``=http://`` or ``=https://`` (a vkey's base64 never holds one).
    """
    for scheme in ("=https://", "=http://"):
        at = value.find(scheme)
        if at > 0:
            vkey, url = value[:at], value[at + 1 :].rstrip("/")
            if not _URL.fullmatch(url):
                raise ValueError(f"--witness {value[:80]!r}: {url[:80]!r} is not an http(s) URL")
            return vkey, url
    raise ValueError(f"--witness {value[:80]!r} is not VKEY=URL (e.g. witness.example/w1+1234abcd+BASE64=http://host:port)")


def witness_targets(witnesses: Sequence[tuple[str, str]]) -> list[WitnessTarget]:
    """The configured witnesses, each vkey parsed; ``ConfigError`` naming a bad or repeated one."""
    if len(witnesses) > MAX_WITNESSES:
        raise ConfigError(f"{len(witnesses)} witnesses are configured; a registry submits to at most {MAX_WITNESSES}")
    targets: list[WitnessTarget] = []
    for vkey, url in witnesses:
        try:
            key = parse_witness_vkey(vkey)
        except MalformedInputError as e:
            raise ConfigError(f"--witness {vkey[:60]!r}: {e.message}", hint="pass the vkey 'kvgraft witness key' prints") from e
        if any(t.key.same_key(key) for t in targets):
            raise ConfigError(f"--witness {key.name}: the same witness key is configured twice")
        targets.append(WitnessTarget(key, url))
    return targets


# --- the store ---------------------------------------------------------------------------------


class CosignatureStore:
    """The ``cosignatures`` table: verified cosignature lines by tree size and witness key."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def add(self, tree_size: int, key: WitnessKey, timestamp: int, line: bytes) -> None:
        """Store (or replace with a newer one) ``key``'s cosignature of the checkpoint at ``tree_size``."""
        with self.db.transaction() as conn:
            conn.execute(
                "INSERT INTO cosignatures VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tree_size, witness, key_id) DO UPDATE "
                "SET timestamp = excluded.timestamp, line = excluded.line, created_at = excluded.created_at",
                [tree_size, key.name, key.key_id.hex(), timestamp, line.decode("utf-8"), now_utc()],
            )

    def lines(self, tree_size: int) -> bytes:
        """The stored cosignature lines of the checkpoint at ``tree_size``, in witness name order."""
        rows = self.db.query(
            "SELECT line FROM cosignatures WHERE tree_size = ? ORDER BY witness, key_id", [tree_size]
        )
        return "".join(str(line) for (line,) in rows).encode("utf-8")

    def has(self, tree_size: int, key: WitnessKey) -> bool:
        """True when ``key``'s cosignature of the checkpoint at ``tree_size`` is stored."""
        row = self.db.query_one(
            "SELECT 1 FROM cosignatures WHERE tree_size = ? AND witness = ? AND key_id = ?",
            [tree_size, key.name, key.key_id.hex()],
        )
        return row is not None

    def newest_witnessed(self, count: int, max_size: int) -> int | None:
        """The largest tree size up to ``max_size`` with cosignatures by at least ``count`` witness keys."""
        row = self.db.query_one(
            "SELECT tree_size FROM cosignatures WHERE tree_size <= ? GROUP BY tree_size "
            "HAVING count(*) >= ? ORDER BY tree_size DESC LIMIT 1",
            [max_size, count],
        )
        return None if row is None else int(row[0])

    def last_size(self, key: WitnessKey) -> int | None:
        """The largest tree size ``key`` cosigned (None when it cosigned nothing here)."""
        row = self.db.query_one(
            "SELECT max(tree_size) FROM cosignatures WHERE witness = ? AND key_id = ?", [key.name, key.key_id.hex()]
        )
        return None if row is None or row[0] is None else int(row[0])


# --- the collector -----------------------------------------------------------------------------


class CheckpointSource(Protocol):
    """What the collector reads of the registry (``service.Registry``): its database, whether this
    process sequences, the announced head and consistency proofs. A protocol, so that this module
    does not import the service that builds it."""

    @property
    def db(self) -> Database: ...

    @property
    def sequences(self) -> bool: ...

    @property
    def head(self) -> LogHead: ...

    def consistency_proof(self, old: int, new: int | None) -> dict[str, Any]: ...


class WitnessCollector:
    """One daemon thread per witness submitting the registry's newest checkpoint; ``stop`` joins them."""

    def __init__(self, registry: CheckpointSource, targets: Sequence[WitnessTarget], timeout: float) -> None:
        self.registry = registry
        self.store = CosignatureStore(registry.db)
        self.timeout = timeout
        self._stop = threading.Event()
        self._wake = [threading.Event() for _ in targets]
        self._threads = [
            threading.Thread(target=self._run, args=(t, w), name=f"kvgraft-witness-{t.key.name}", daemon=True)
            for t, w in zip(targets, self._wake, strict=True)
        ]

    def start(self) -> None:
        """Start the threads; each submits the current head at once."""
        for thread in self._threads:
            thread.start()

    def notify(self) -> None:
        """A new checkpoint is durable: wake every witness's thread (never blocks)."""
        for event in self._wake:
            event.set()

    def stop(self) -> None:
        """Stop and join the threads (each finishes at most its request in flight: ``2 * timeout``)."""
        self._stop.set()
        self.notify()
        for thread in self._threads:
            thread.join(timeout=2 * self.timeout + 5)

    def _run(self, target: WitnessTarget, wake: threading.Event) -> None:
        import httpx

        # The size this witness last cosigned, as far as the registry knows (None: read the table;
        # 0: ask the witness, by its 409).
        known: list[int | None] = [None]
        backoff = 0.0
        with httpx.Client(timeout=httpx.Timeout(self.timeout), follow_redirects=False) as http:
            while not self._stop.is_set():
                wake.clear()
                try:
                    if not self.registry.sequences:
                        # Several processes on one database: the sequencer submits its heads, the others wait.
                        known[0] = None
                        wake.wait(IDLE_POLL_SECONDS)
                        continue
                    if known[0] is None:
                        known[0] = self.store.last_size(target.key) or 0
                    # Idle only once *this* witness's line for the head is stored: a 409 may have
                    # set the size to the head's without a cosignature coming back.
                    head_size = self.registry.head.size
                    if known[0] == head_size and self.store.has(head_size, target.key):
                        wake.wait(IDLE_POLL_SECONDS)
                        continue
                    self._submit(http, target, known)
                    backoff = 0.0
                except WitnessSubmissionError as e:
                    backoff = min(max(FIRST_BACKOFF_SECONDS, backoff * 2), MAX_BACKOFF_SECONDS)
                    logger.warning(
                        "witness %s (%s): %s; retrying in %.0f s", target.key.name, target.url, e.message, backoff
                    )
                    self._stop.wait(backoff)
                except Exception:  # a bug: logged with its traceback, and the thread keeps going
                    backoff = min(max(FIRST_BACKOFF_SECONDS, backoff * 2), MAX_BACKOFF_SECONDS)
                    logger.exception("witness %s (%s): submitting failed", target.key.name, target.url)
                    self._stop.wait(backoff)

    def _submit(self, http: httpx.Client, target: WitnessTarget, known: list[int | None]) -> None:
        """Submit the current head from the witness's size ``known[0]`` (updated from a 409 and on
        success) and store the cosignature it returns; ``WitnessSubmissionError`` when it does not cosign."""
        head = self.registry.head
        text = parse_signed_note(head.note).text
        for _ in range(_MAX_CONFLICTS):
            old = known[0] or 0
            if old > head.size:
                raise WitnessSubmissionError(
                    f"it cosigned tree size {old} of this log, larger than this registry's {head.size}: the log was "
                    "rolled back or forked behind it (restore the data directory; see LogRollbackError)"
                )
            hashes = [] if old == 0 else self.registry.consistency_proof(old, head.size)["hashes"]
            proof = "".join(base64.b64encode(bytes.fromhex(h)).decode("ascii") + "\n" for h in hashes)
            body = f"old {old}\n{proof}\n".encode("ascii") + head.note
            status, media, answer = self._post(http, target, body)
            if status == 409:
                size = _SIZE_BODY.fullmatch(answer)
                if not media.startswith("text/x.tlog.size") or size is None:
                    raise WitnessSubmissionError(f"it answered 409 without its size ({media or 'no content type'})")
                known[0] = int(size.group(1))
                continue
            if status != 200:
                raise WitnessSubmissionError(f"add-checkpoint of size {head.size} from {old} answered {status}: {answer[:300]!r}")
            # Only signature lines: a blank line in the answer would make the lines after it sign
            # a text of the witness's choosing, not this checkpoint (served, such a line would
            # make every client that trusts the witness refuse the whole note).
            if not answer.endswith(b"\n") or answer.startswith(b"\n") or b"\n\n" in answer:
                raise WitnessSubmissionError(f"its answer {answer[:120]!r} is not cosignature lines, each ending in a newline")
            try:
                found = open_cosignatures(text + b"\n" + answer, [target.key])
            except VerificationError as e:
                raise WitnessSubmissionError(f"its answer is not a valid cosignature of size {head.size}: {e.message}") from e
            mine = found.by(target.key)
            if mine is None:
                why = "; ".join(reason for _, reason in found.skipped) or "no line by its key"
                raise WitnessSubmissionError(f"its answer carries no usable cosignature of size {head.size} ({why})")
            self.store.add(head.size, target.key, mine.timestamp, mine.line)
            known[0] = head.size
            logger.info("witness %s cosigned tree size %d", target.key.name, head.size)
            return
        raise WitnessSubmissionError(f"its size kept changing ({_MAX_CONFLICTS} answers 409 in a row)")

    def _post(self, http: httpx.Client, target: WitnessTarget, body: bytes) -> tuple[int, str, bytes]:
        """POST ``body`` to the witness's add-checkpoint: (status, content type, answer).

        The whole exchange has one deadline (twice ``timeout``: httpx's bounds each read, not the
        sum), the answer is read raw (no decompression: a witness has no reason to compress a few
        lines) and at most ``MAX_ANSWER_BYTES``. ``WitnessSubmissionError`` otherwise.
        """
        import httpx

        deadline = time.monotonic() + 2 * self.timeout
        headers = {"Content-Type": "text/plain", "Accept-Encoding": "identity"}
        try:
            with http.stream("POST", target.url + "/add-checkpoint", content=body, headers=headers) as response:
                if response.headers.get("content-encoding", "identity") != "identity":
                    raise WitnessSubmissionError(f"it answered with Content-Encoding {response.headers['content-encoding']!r}")
                answer = b""
                for chunk in response.iter_raw():
                    answer += chunk
                    if len(answer) > MAX_ANSWER_BYTES:
                        raise WitnessSubmissionError(f"it answered more than {MAX_ANSWER_BYTES} bytes")
                    if time.monotonic() > deadline:
                        raise WitnessSubmissionError(f"its answer took more than {2 * self.timeout:g} s")
                return response.status_code, response.headers.get("content-type", ""), answer
        except httpx.HTTPError as e:
            raise WitnessSubmissionError(f"add-checkpoint failed: {e or type(e).__name__}") from e
