"""Digests of a model directory as vLLM serves it: weights, config and tokenizer.

The weights digest is ``sha256`` of the RFC 8785 JSON ``{file name: sha256 hex}`` over every
``*.safetensors``, ``*.bin`` and ``*.pt`` file at the top of the directory, so a converted
kvgraft model (``$KVGRAFT_HOME/models/<name>-<gguf sha256>/``) and a Hugging Face snapshot are
digested the same way. Hashing is the costly part (about 1 s a GB), so each process keeps the
digest per (path, size, mtime) of every file.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Final

from kvgraft.schemas import Sha256Digest, canonical_json, hex_of, sha256_bytes, sha256_file

from .errors import ConnectorConfigError

_WEIGHT_SUFFIXES: Final = (".safetensors", ".bin", ".pt")
_TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json", "merges.txt",
                           "special_tokens_map.json", "added_tokens.json", "chat_template.jinja")
_digests: dict[tuple[str, int, int], Sha256Digest] = {}


def _file_digest(path: Path) -> Sha256Digest:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _digests:
        _digests[key] = sha256_file(path)
    return _digests[key]


def _local_dir(value: str, what: str) -> Path:
    path = Path(value)
    if not path.is_dir():
        raise ConnectorConfigError(f"the {what} {value!r} is not a local directory; the connector binds blocks to the files it digests",
                                   hint="serve a local model directory, e.g. one converted by kvgraft under $KVGRAFT_HOME/models/")
    return path


def weights_digest(model_dir: str) -> Sha256Digest:
    """The weights digest of a model directory (module docstring)."""
    directory = _local_dir(model_dir, "model")
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES)
    if not files:
        raise ConnectorConfigError(f"model directory {directory} holds no weights file ({', '.join(_WEIGHT_SUFFIXES)})")
    return sha256_bytes(canonical_json({p.name: hex_of(_file_digest(p)) for p in files}))


def config_digest(model_dir: str) -> Sha256Digest:
    """sha256 of the canonical JSON of the directory's ``config.json``."""
    path = _local_dir(model_dir, "model") / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConnectorConfigError(f"cannot read {path}: {e}") from e
    return sha256_bytes(canonical_json(config))


def tokenizer_digest(tokenizer_dir: str) -> Sha256Digest:
    """sha256 of ``tokenizer.json`` when present, else of the canonical JSON of the tokenizer files' digests."""
    directory = _local_dir(tokenizer_dir, "tokenizer")
    if (directory / "tokenizer.json").is_file():
        return _file_digest(directory / "tokenizer.json")
    files = sorted(directory / n for n in _TOKENIZER_FILES if (directory / n).is_file())
    if not files:
        raise ConnectorConfigError(f"tokenizer directory {directory} holds no tokenizer file")
    return sha256_bytes(canonical_json({p.name: hex_of(_file_digest(p)) for p in files}))


def cpu_name() -> str:
    """The CPU's model name as the kernel reports it (``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass  # not Linux: fall back below
    return platform.processor() or platform.machine()


def env_setting(name: str) -> str:
    """An environment variable as a binding setting ('' when unset)."""
    return os.environ.get(name, "")
