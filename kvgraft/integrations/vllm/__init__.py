"""kvgraft's vLLM KV connector: prefix blocks as signed artifacts, loaded only when they verify.

Used by stock vLLM (docs/vllm.md)::

    vllm serve DIR --kv-transfer-config '{"kv_connector": "KvgraftConnector",
      "kv_connector_module_path": "kvgraft.integrations.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"store": "DIR", "key": "PEM", "trusted_keys": "FILE"}}'

``KvgraftConnector`` needs vLLM installed (``make vllm`` builds ``.venv-vllm``) and is imported
on first use, so the rest of this package (the block format, its verification, the settings)
imports without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._internal.binding import config_digest, tokenizer_digest, weights_digest
from ._internal.blocks import (
    BlockClaim,
    PrefixDigests,
    block_dir,
    decode_block,
    encode_block,
    loadable_blocks,
    read_verified_block,
    sign_block,
    write_block,
)
from ._internal.errors import (
    BindingMismatchError,
    BlockFileError,
    BlockRefusedError,
    ChainMismatchError,
    ConnectorConfigError,
    ConnectorError,
    ExactnessRunError,
)
from ._internal.exactness import MAKE_VLLM_HINT, VLLM_PYTHON_ENV, ExactnessOptions, run_in_vllm, vllm_python
from ._internal.handoff import Handoff, open_handed
from ._internal.predicate import (
    KV_LAYOUT,
    VLLM_BLOCK_PREDICATE,
    VllmBinding,
    VllmBlockPredicate,
    VllmBlockStatement,
    binding_digest,
    block_chain_key,
    chain_keys,
)
from ._internal.settings import TRUSTED_KEYS_ENV, ConnectorSettings

if TYPE_CHECKING:
    from ._internal.connector import KvgraftConnector

__all__ = [
    "KV_LAYOUT", "MAKE_VLLM_HINT", "TRUSTED_KEYS_ENV", "VLLM_BLOCK_PREDICATE", "VLLM_PYTHON_ENV", "BindingMismatchError",
    "BlockClaim", "BlockFileError", "BlockRefusedError", "ChainMismatchError", "ConnectorConfigError", "ConnectorError",
    "ConnectorSettings", "ExactnessOptions", "ExactnessRunError", "Handoff", "KvgraftConnector", "PrefixDigests", "VllmBinding", "VllmBlockPredicate",
    "VllmBlockStatement", "binding_digest", "block_chain_key", "block_dir", "chain_keys", "config_digest", "decode_block",
    "encode_block", "loadable_blocks", "open_handed", "read_verified_block", "run_in_vllm", "sign_block", "tokenizer_digest",
    "vllm_python", "weights_digest", "write_block",
]


def __getattr__(name: str) -> Any:
    # vLLM finds the class with getattr(module, "KvgraftConnector"); importing vLLM only then keeps
    # this package importable where vLLM is not installed (the main .venv, the error-tree walk).
    if name == "KvgraftConnector":
        from ._internal.connector import KvgraftConnector

        return KvgraftConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
