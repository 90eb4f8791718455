"""kvgraft: byte-exact, signed KV-cache artifacts for frozen small language models.

The distribution holds these packages (see docs/architecture.md):

- ``kvgraft.schemas``: data contracts, canonical JSON, digest types, JSON Schema files;
- ``kvgraft.verifier``: the offline verifier (signatures, digests, records), no torch;
- ``kvgraft.engine``: models, determinism, capture and graft (extra ``engine``);
- ``kvgraft.registry``: the registry service (extra ``registry``);
- ``kvgraft.web``: the provenance UI served by the registry.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvgraft")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
