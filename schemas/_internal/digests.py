"""Digest types: a digest is never a bare string.

``Sha256Digest`` is the prefixed form used everywhere in documents and URLs
(``sha256:<64 lowercase hex>``); ``Sha256Hex`` is the bare hex form that in-toto subjects
use in their ``digest`` maps.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Annotated, BinaryIO, NewType

from pydantic import AfterValidator

from .errors import InvalidDigestError

Sha256Digest = NewType("Sha256Digest", str)
Sha256Hex = NewType("Sha256Hex", str)

_PREFIXED = re.compile(r"sha256:[0-9a-f]{64}")
_HEX = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 20


def parse_sha256(value: object) -> Sha256Digest:
    """Return ``value`` as a ``Sha256Digest`` or raise ``InvalidDigestError`` naming the fault."""
    if not isinstance(value, str):
        raise InvalidDigestError(f"a digest must be a string, got {type(value).__name__}")
    if not _PREFIXED.fullmatch(value):
        shown = value if len(value) <= 80 else value[:77] + "..."
        raise InvalidDigestError(
            f"{shown!r} is not a sha256 digest; expected 'sha256:' and 64 lowercase hex digits"
        )
    return Sha256Digest(value)


def parse_sha256_hex(value: object) -> Sha256Hex:
    """Return ``value`` as a bare ``Sha256Hex`` or raise ``InvalidDigestError``."""
    if not isinstance(value, str) or not _HEX.fullmatch(value):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise InvalidDigestError(f"{shown} is not 64 lowercase hex digits")
    return Sha256Hex(value)


def hex_of(digest: Sha256Digest) -> Sha256Hex:
    """The bare hex part of a prefixed digest."""
    return Sha256Hex(digest.removeprefix("sha256:"))


def prefixed(hex_digest: Sha256Hex) -> Sha256Digest:
    """The prefixed form of a bare hex digest."""
    return Sha256Digest("sha256:" + hex_digest)


def sha256_bytes(data: bytes) -> Sha256Digest:
    """The digest of ``data``."""
    return Sha256Digest("sha256:" + hashlib.sha256(data).hexdigest())


def sha256_stream(stream: BinaryIO) -> Sha256Digest:
    """The digest of everything left in ``stream``, read in 1 MiB chunks."""
    h = hashlib.sha256()
    while chunk := stream.read(_CHUNK):
        h.update(chunk)
    return Sha256Digest("sha256:" + h.hexdigest())


def sha256_file(path: Path) -> Sha256Digest:
    """The digest of the file at ``path`` (streamed, never read whole)."""
    with path.open("rb") as f:
        return Sha256Digest("sha256:" + hashlib.file_digest(f, "sha256").hexdigest())


def _validate_digest(value: str) -> Sha256Digest:
    try:
        return parse_sha256(value)
    except InvalidDigestError as e:
        raise ValueError(str(e)) from e


def _validate_hex(value: str) -> Sha256Hex:
    try:
        return parse_sha256_hex(value)
    except InvalidDigestError as e:
        raise ValueError(str(e)) from e


#: A pydantic field type for ``sha256:<hex>`` values.
DigestField = Annotated[Sha256Digest, AfterValidator(_validate_digest)]
#: A pydantic field type for bare hex sha256 values.
HexDigestField = Annotated[Sha256Hex, AfterValidator(_validate_hex)]
