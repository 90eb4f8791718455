"""kvgraft: byte-exact, signed KV-cache artifacts for frozen small language models.

The distribution holds these packages (see docs/architecture.md):

- ``kvgraft.schemas``: data contracts, canonical JSON, digest types, JSON Schema files;
- ``kvgraft.verifier``: the offline verifier (signatures, digests, records), no torch;
- ``kvgraft.engine``: models, determinism, capture and graft (extra ``engine``);
- ``kvgraft.registry``: the registry service (extra ``registry``);
- ``kvgraft.web``: the provenance UI served by the registry.
- ``kvgraft.cli``: the ``kvgraft`` command, one module per command group (imports the others lazily).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgraft.schemas import KvgraftError

try:
    __version__ = version("kvgraft")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["KvgraftError", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so that ``import kvgraft`` (the version, the CLI's entry point) stays cheap.
    if name == "KvgraftError":
        from kvgraft.schemas import KvgraftError

        return KvgraftError
    raise AttributeError(f"module 'kvgraft' has no attribute {name!r}")
