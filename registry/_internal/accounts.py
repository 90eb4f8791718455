"""Publishers, their public keys, and the bearer tokens that publish under them.

A token is shown once, when it is made; the database keeps only its sha256. Each token belongs
to one publisher and is bound to some of that publisher's keys: it may publish envelopes
signed by those keys only.

The token and key lookups a request makes (``authenticate``, ``authenticate_id``,
``bound_keys``, ``registered_keys``) are remembered in memory: a publish then costs no
database statement before its batch (DuckDB pays about a millisecond per statement, and every
statement waits for the database lock the sequencer holds while a batch commits). The memory
is exact, not a time-limited cache: every change to publishers, keys and tokens goes through
this class (the running server owns the database file; admin commands reach it through its
admin API), and each change empties the memory under the database lock before the lock is
released, so a revocation still applies to the very next request. A lookup fills the memory
while it holds that lock, so a fill never outlives a change it did not see.

A PostgreSQL database is shared by several server processes, and a change made through one
(or by an admin command) must reach the others' memory too: each change there also counts up
``accounts_generation`` in ``meta`` and notifies the other processes, whose listener
(cluster.py) calls ``sync``, and the sequencer calls ``sync`` before every batch. So a
revocation committed anywhere refuses every publish sequenced after it, and every other
request within the milliseconds a notification takes.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvgraft.verifier import KeyFileError, KeyId, TrustedKey, keyid_of, parse_public_key, public_key_pem, trusted_key

from .errors import (
    AuthenticationError,
    BadRequestError,
    ConflictError,
    InvalidNameError,
    TokenNotFoundError,
    TokenRevokedError,
)
from .storage.db import ACCOUNTS_CHANNEL, Connection, Database, now_utc

#: Publisher tokens start with this, so that a leaked one is recognisable (secret scanners).
TOKEN_PREFIX = "kvgr_"
_PUBLISHER = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}", re.ASCII)
_TOKEN_ID = re.compile(r"tok_[0-9a-f]{12}", re.ASCII)
# Bounds what an Authorization header can make the server hash.
_MAX_TOKEN_LENGTH = 256

T = TypeVar("T")


#: A lookup not remembered yet (None is a remembered answer: a revoked token id).
_NOTHING = object()
#: The ``meta`` key counting changes to publishers, keys and tokens (shared databases only).
_GENERATION = "accounts_generation"


def token_hash(token: str) -> str:
    """The sha256 hex under which a token is stored."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def check_publisher(name: str) -> str:
    """Return ``name`` if it is a valid publisher name, else raise ``InvalidNameError``."""
    if not isinstance(name, str) or not _PUBLISHER.fullmatch(name):
        raise InvalidNameError(f"publisher name {name!r} is not acceptable")
    return name


@dataclass(frozen=True)
class TokenInfo:
    """An authenticated token: who it publishes as, and under which keys."""

    token_id: str
    publisher: str
    keyids: tuple[str, ...]


class Accounts:
    """Publisher, key and token operations on the registry database."""

    def __init__(self, db: Database) -> None:
        self._db = db
        # Lookups remembered until the next change (see the module docstring). Keys are
        # (kind, ...) tuples of token hashes, token ids and key ids this registry issued or
        # holds: only successful lookups are kept, so a stranger's guesses never grow it.
        self._memory: dict[tuple[Any, ...], Any] = {}
        #: ``accounts_generation`` when the memory was last checked against it (shared databases).
        self._generation: str | None = None

    def _remembered(self, key: tuple[Any, ...], load: Callable[[], T]) -> T:
        """``load()``'s value, remembered under ``key`` until the next change."""
        found = self._memory.get(key, _NOTHING)
        if found is not _NOTHING:
            return found
        with self._db.lock:
            # Loaded and stored under the lock every change holds too: no change can land between.
            value = load()
            self._memory[key] = value
        return value

    @contextlib.contextmanager
    def _change(self) -> Iterator[Connection]:
        """A transaction that changes publishers, keys or tokens; the memory is emptied before the lock is released."""
        with self._db.lock:
            try:
                with self._db.transaction() as conn:
                    yield conn
                    if self._db.dialect.shared:
                        conn.execute(
                            "INSERT INTO meta VALUES (?, '1') ON CONFLICT (key) DO UPDATE "
                            "SET value = CAST(CAST(meta.value AS BIGINT) + 1 AS VARCHAR)",
                            [_GENERATION],
                        )
                        self._db.dialect.notify(conn, ACCOUNTS_CHANNEL)
            finally:
                self._memory = {}

    def sync(self) -> None:
        """Forget every remembered lookup if another process changed accounts since the last ``sync``.

        One statement, on a shared (PostgreSQL) database only; a no-op on DuckDB, where every
        change goes through this object.
        """
        if not self._db.dialect.shared:
            return
        with self._db.lock:
            generation = self._db.get_meta(_GENERATION)
            if generation != self._generation:
                self._memory = {}
                self._generation = generation

    # --- keys ------------------------------------------------------------------------------

    def add_key(self, publisher: str, public_key: str | bytes) -> dict[str, Any]:
        """Register ``public_key`` (PEM) for ``publisher`` (created if new).

        Registering the same key for the same publisher again changes nothing; a key already
        registered for another publisher is a ``ConflictError``.
        """
        check_publisher(publisher)
        pem = public_key.encode("utf-8") if isinstance(public_key, str) else public_key
        try:
            key = parse_public_key(pem, source="the public key")
        except KeyFileError as e:
            raise BadRequestError(e.message, hint="pass an Ed25519, P-256 or P-384 public key PEM ('kvgraft keys generate' writes one as .pub)") from e
        keyid = keyid_of(key)
        with self._change() as conn:
            row = conn.execute("SELECT publisher FROM publisher_keys WHERE keyid = ?", [keyid]).fetchone()
            if row is not None:
                if row[0] != publisher:
                    raise ConflictError(
                        f"key {keyid} is already registered for publisher {row[0]!r}",
                        hint="a key belongs to one publisher; generate another key for this one",
                    )
                return {"publisher": publisher, "keyid": keyid, "created": False}
            now = now_utc()
            conn.execute("INSERT INTO publishers VALUES (?, ?) ON CONFLICT DO NOTHING", [publisher, now])
            conn.execute(
                "INSERT INTO publisher_keys VALUES (?, ?, ?, ?)",
                [keyid, publisher, public_key_pem(key).decode("ascii"), now],
            )
        return {"publisher": publisher, "keyid": keyid, "created": True}

    def list_keys(self) -> list[dict[str, Any]]:
        """Every registered key: publisher, key id, PEM, when."""
        rows = self._db.query(
            "SELECT publisher, keyid, public_key_pem, created_at FROM publisher_keys ORDER BY publisher, created_at, keyid"
        )
        return [{"publisher": p, "keyid": k, "public_key_pem": pem, "created_at": c} for p, k, pem, c in rows]

    def publishers(self) -> list[dict[str, Any]]:
        """Every publisher with its keys."""
        names = self._db.query("SELECT name, created_at FROM publishers ORDER BY name")
        keys: dict[str, list[dict[str, Any]]] = {}
        for k in self.list_keys():
            keys.setdefault(k["publisher"], []).append(
                {"keyid": k["keyid"], "public_key_pem": k["public_key_pem"], "created_at": k["created_at"]}
            )
        return [{"name": n, "created_at": c, "keys": keys.get(n, [])} for n, c in names]

    def registered_keys(self) -> dict[str, tuple[TrustedKey, str]]:
        """key id -> (key, publisher), for every registered key (the caller must not change it)."""

        def load() -> dict[str, tuple[TrustedKey, str]]:
            rows = self._db.query("SELECT keyid, publisher, public_key_pem FROM publisher_keys")
            return {
                kid: (trusted_key(f"{pub}/{kid[:16]}", parse_public_key(pem.encode("ascii"), source=f"registered key {kid}")), pub)
                for kid, pub, pem in rows
            }

        return self._remembered(("registered",), load)

    # --- tokens ----------------------------------------------------------------------------

    def create_token(self, publisher: str, public_keys: Sequence[str | bytes]) -> dict[str, Any]:
        """Make a token for ``publisher`` bound to ``public_keys``; return it (shown only now).

        Keys not yet registered are registered for ``publisher``; a key of another publisher
        is a ``ConflictError`` and nothing is created.
        """
        check_publisher(publisher)
        if not public_keys:
            raise BadRequestError("a token must be bound to at least one public key", hint="pass --key PUBKEY.pem")
        keyids: list[KeyId] = []
        registered: list[KeyId] = []
        # Check every key before registering any, so a conflict leaves nothing behind.
        parsed = []
        for i, pem in enumerate(public_keys):
            raw = pem.encode("utf-8") if isinstance(pem, str) else pem
            try:
                parsed.append(parse_public_key(raw, source=f"public key {i + 1}"))
            except KeyFileError as e:
                raise BadRequestError(e.message, hint="pass Ed25519, P-256 or P-384 public key PEM files ('kvgraft keys generate' writes .pub)") from e
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        token_id = "tok_" + secrets.token_hex(6)
        with self._change() as conn:
            for key in parsed:
                keyid = keyid_of(key)
                row = conn.execute("SELECT publisher FROM publisher_keys WHERE keyid = ?", [keyid]).fetchone()
                if row is not None and row[0] != publisher:
                    raise ConflictError(
                        f"key {keyid} is registered for publisher {row[0]!r}, not {publisher!r}",
                        hint="bind a token only to its own publisher's keys",
                    )
                if row is None:
                    now = now_utc()
                    conn.execute("INSERT INTO publishers VALUES (?, ?) ON CONFLICT DO NOTHING", [publisher, now])
                    conn.execute(
                        "INSERT INTO publisher_keys VALUES (?, ?, ?, ?)",
                        [keyid, publisher, public_key_pem(key).decode("ascii"), now],
                    )
                    registered.append(keyid)
                if keyid not in keyids:
                    keyids.append(keyid)
            conn.execute(
                "INSERT INTO tokens VALUES (?, ?, ?, ?, NULL)", [token_id, token_hash(token), publisher, now_utc()]
            )
            for keyid in keyids:
                conn.execute("INSERT INTO token_keys VALUES (?, ?)", [token_id, keyid])
        return {"token_id": token_id, "token": token, "publisher": publisher, "keyids": keyids, "registered_keys": registered}

    def list_tokens(self) -> list[dict[str, Any]]:
        """Every token (never the token itself): id, publisher, keys, created, revoked."""
        rows = self._db.query(
            "SELECT t.token_id, t.publisher, t.created_at, t.revoked_at, "
            "array_agg(k.keyid ORDER BY k.keyid) FILTER (WHERE k.keyid IS NOT NULL) "
            "FROM tokens t LEFT JOIN token_keys k ON k.token_id = t.token_id "
            "GROUP BY t.token_id, t.publisher, t.created_at, t.revoked_at ORDER BY t.created_at, t.token_id"
        )
        return [
            {"token_id": t, "publisher": p, "created_at": c, "revoked_at": r, "revoked": r is not None, "keyids": list(k or [])}
            for t, p, c, r, k in rows
        ]

    def revoke_token(self, token_id: str) -> dict[str, Any]:
        """Revoke a token; revoking a revoked token changes nothing."""
        if not isinstance(token_id, str) or not _TOKEN_ID.fullmatch(token_id):
            raise TokenNotFoundError(f"{token_id!r} is not a token id (tok_ and 12 hex digits)")
        with self._change() as conn:
            row = conn.execute("SELECT publisher, revoked_at FROM tokens WHERE token_id = ?", [token_id]).fetchone()
            if row is None:
                raise TokenNotFoundError(f"no token has id {token_id}")
            publisher, revoked_at = row
            if revoked_at is None:
                revoked_at = now_utc()
                conn.execute("UPDATE tokens SET revoked_at = ? WHERE token_id = ?", [revoked_at, token_id])
                changed = True
            else:
                changed = False
        return {"token_id": token_id, "publisher": publisher, "revoked_at": revoked_at, "changed": changed}

    def authenticate(self, authorization: str | None) -> TokenInfo:
        """The token of an ``Authorization: Bearer`` header; 401 when absent or unknown, 403 when revoked."""
        if authorization is None or not authorization.strip():
            raise AuthenticationError("this request needs a bearer token and none was sent")
        scheme, _, token = authorization.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise AuthenticationError("the Authorization header is not 'Bearer <token>'")
        if len(token) > _MAX_TOKEN_LENGTH:
            raise AuthenticationError("the bearer token is not one this registry issued")
        hashed = token_hash(token)
        found = self._memory.get(("token", hashed))
        if isinstance(found, TokenInfo):
            return found
        with self._db.lock:
            row = self._db.query_one("SELECT token_id, publisher, revoked_at FROM tokens WHERE token_hash = ?", [hashed])
            if row is None:
                raise AuthenticationError("the bearer token is not one this registry issued")
            token_id, publisher, revoked_at = row
            if revoked_at is not None:
                raise TokenRevokedError(f"token {token_id} was revoked at {revoked_at}")
            keys = self._db.query("SELECT keyid FROM token_keys WHERE token_id = ? ORDER BY keyid", [token_id])
            info = TokenInfo(token_id=token_id, publisher=publisher, keyids=tuple(k for (k,) in keys))
            # Only a valid token is remembered (under the lock, as in _remembered).
            self._memory[("token", hashed)] = info
        return info

    def authenticate_id(self, token_id: str) -> TokenInfo | None:
        """The token ``token_id`` as it stands now, or None when it is revoked or gone."""

        def load() -> TokenInfo | None:
            row = self._db.query_one("SELECT publisher, revoked_at FROM tokens WHERE token_id = ?", [token_id])
            if row is None or row[1] is not None:
                return None
            keys = self._db.query("SELECT keyid FROM token_keys WHERE token_id = ? ORDER BY keyid", [token_id])
            return TokenInfo(token_id=token_id, publisher=row[0], keyids=tuple(k for (k,) in keys))

        return self._remembered(("id", token_id), load)

    def bound_keys(self, info: TokenInfo) -> list[TrustedKey]:
        """The keys a token may publish under (those still registered for its publisher)."""
        if not info.keyids:
            return []

        def load() -> list[TrustedKey]:
            placeholders = ", ".join("?" for _ in info.keyids)
            rows = self._db.query(
                f"SELECT keyid, public_key_pem FROM publisher_keys WHERE publisher = ? AND keyid IN ({placeholders})",  # only placeholders are interpolated
                [info.publisher, *info.keyids],
            )
            return [
                trusted_key(f"{info.publisher}/{kid[:16]}", parse_public_key(pem.encode("ascii"), source=f"registered key {kid}"))
                for kid, pem in rows
            ]

        return list(self._remembered(("bound", info.publisher, info.keyids), load))
