"""Signatures as the provenance pages state them: re-verified by this server, remembered per envelope.

A page never repeats the registry's earlier judgement unchecked: the stored envelope is verified
again with ``kvgraft.verifier`` against the publisher's registered keys. The keys are read in
one short query (under ``registry.db.lock`` or not); the verification runs outside the lock, and
its outcome is remembered per envelope digest, publisher and set of registered key ids (entries
are immutable; a new key changes the cache key), in a bounded LRU of
``settings.verify_cache_entries`` per open registry. An envelope with more than
``settings.max_signatures`` signatures is reported unverified without being checked.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

from kvgraft.schemas import DocumentError, parse_json
from kvgraft.verifier import (
    TrustedKey,
    TrustedKeys,
    VerificationError,
    key_type_label,
    key_type_of,
    parse_envelope,
    parse_public_key,
    trusted_key,
    verify_envelope,
)
from kvgraft.web import short_digest

from .. import queries
from ..queries import PublisherKey
from ..service import Registry

logger = logging.getLogger("kvgraft.registry")



@dataclass(frozen=True)
class SignatureStatus:
    """The outcome of re-verifying a stored envelope against its publisher's registered keys."""

    publisher: str
    verified: bool
    signers: list[dict[str, str]]
    claimed_keyids: list[str]
    message: str
    hint: str = ""
    registered_keyids: list[str] = field(default_factory=list)


#: A publisher's registered keys as read under the lock, sorted by key id.
KeyRows = tuple[PublisherKey, ...]


def publisher_key_rows(registry: Registry, publisher: str) -> KeyRows:
    """The registered keys of ``publisher`` (one short query; take ``registry.db.lock`` around it or not)."""
    return queries.publisher_keys(registry.db, publisher)


class VerifyCache:
    """Signature outcomes by (envelope digest, publisher, registered key ids): a bounded, thread-safe LRU.

    Safe to keep because a stored envelope never changes (its digest names its bytes) and the
    outcome depends on nothing else but the publisher's key set, which is part of the key.
    """

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self._items: OrderedDict[tuple[str, str, tuple[str, ...]], SignatureStatus] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str, tuple[str, ...]]) -> SignatureStatus | None:
        with self._lock:
            found = self._items.get(key)
            if found is not None:
                self._items.move_to_end(key)
            return found

    def put(self, key: tuple[str, str, tuple[str, ...]], status: SignatureStatus) -> None:
        with self._lock:
            self._items[key] = status
            self._items.move_to_end(key)
            while len(self._items) > self.entries:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)


_CACHES: weakref.WeakKeyDictionary[Registry, VerifyCache] = weakref.WeakKeyDictionary()
_CACHES_LOCK = threading.Lock()


def verify_cache(registry: Registry) -> VerifyCache:
    """The signature cache of ``registry`` (one per open registry, sized by its settings)."""
    with _CACHES_LOCK:
        cache = _CACHES.get(registry)
        if cache is None:
            cache = _CACHES[registry] = VerifyCache(registry.settings.verify_cache_entries)
        return cache


def signature_status(registry: Registry, envelope_bytes: bytes, publisher: str) -> SignatureStatus:
    """Verify ``envelope_bytes`` with the keys registered for ``publisher``; say who signed or why not.

    Reads the keys in one short query, then verifies without holding the database lock.
    """
    with registry.db.lock:
        rows = publisher_key_rows(registry, publisher)
    return verified_status(registry, envelope_bytes, publisher, rows)


def verified_status(registry: Registry, envelope_bytes: bytes, publisher: str, key_rows: KeyRows) -> SignatureStatus:
    """The outcome for ``envelope_bytes`` and ``key_rows``, from the cache or computed now.

    Call it outside ``registry.db.lock``: a miss parses and verifies the envelope.
    """
    key = (hashlib.sha256(envelope_bytes).hexdigest(), publisher, tuple(k.keyid for k in key_rows))
    cache = verify_cache(registry)
    found = cache.get(key)
    if found is None:
        found = _verify_now(envelope_bytes, publisher, key_rows, registry.settings.max_signatures)
        cache.put(key, found)
    return found


def _count_signatures(envelope_bytes: bytes) -> int | None:
    # The number of entries in the envelope's "signatures" list, before any model is built.
    try:
        doc = parse_json(envelope_bytes, what="the stored envelope")
    except (DocumentError, RecursionError):
        return None
    signatures = doc.get("signatures") if isinstance(doc, dict) else None
    return len(signatures) if isinstance(signatures, list) else None


def _verify_now(envelope_bytes: bytes, publisher: str, key_rows: KeyRows, max_signatures: int) -> SignatureStatus:
    registered = [k.keyid for k in key_rows]
    count = _count_signatures(envelope_bytes)
    if count is not None and count > max_signatures:
        return SignatureStatus(
            publisher, False, [], [],
            f"not verified: too many signatures ({count}; this registry checks at most {max_signatures} per envelope)",
            "an envelope kvgraft signs carries one signature; treat this entry as unsigned", registered,
        )
    try:
        envelope = parse_envelope(envelope_bytes, source="the stored envelope")
    except VerificationError as e:
        return SignatureStatus(publisher, False, [], [], e.message, e.hint or "", registered)
    except RecursionError:
        message = "the stored envelope is nested too deeply to read"
        return SignatureStatus(publisher, False, [], [], message, "", registered)
    claimed = [sig.keyid for sig in envelope.signatures if sig.keyid]
    keys: list[TrustedKey] = []
    for keyid, pem in key_rows:
        try:
            public = parse_public_key(pem.encode("ascii"), source=f"key {keyid}")
            keys.append(trusted_key(f"{publisher}/{keyid[:16]}", public))
        except (VerificationError, UnicodeEncodeError):
            logger.warning("registered key %s of %r cannot be read; left out of verification", keyid, publisher)
    if not keys:
        return SignatureStatus(
            publisher, False, [], claimed, f"publisher {publisher!r} has no registered key to verify with",
            "the operator can list keys with 'kvgraft key list'", registered,
        )
    try:
        verified = verify_envelope(envelope, TrustedKeys(tuple(keys)), threshold=1)
    except VerificationError as e:
        return SignatureStatus(publisher, False, [], claimed, e.message, e.hint or "", registered)
    signers = [{"name": publisher, "keyid": k.keyid} for k in verified.signers]
    names = ", ".join(f"{short_digest(k.keyid, 16)} ({key_type_label(key_type_of(k.public_key))})" for k in verified.signers)
    message = f"signature over the DSSE payload verified by this server with {publisher}'s registered key {names}"
    return SignatureStatus(publisher, True, signers, claimed, message, "", registered)
