"""``kv_connector_extra_config``: what the connector reads from vLLM's ``--kv-transfer-config``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, ValidationError

from kvgraft.schemas import Contract

from .errors import ConnectorConfigError

#: Where the trusted keys come from when the config names none (as for the engine).
TRUSTED_KEYS_ENV = "KVGRAFT_TRUSTED_KEYS"


class ConnectorSettings(Contract):
    """The connector's settings; unknown keys are refused, so a misspelt one is never ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, strict=False)

    store: str | None = Field(default=None, description="directory of block artifacts (made when missing)")
    key: str | None = Field(default=None, description="PEM private key that signs saved blocks; without it nothing is saved")
    trusted_keys: str | None = Field(default=None, description=f"trusted-keys file (default ${TRUSTED_KEYS_ENV})")
    model_name: str | None = Field(default=None, description="the name bound into blocks (default: the model directory's name)")
    # Named so that a configuration written for a registry store is refused with a reason, not as unknown.
    registry: str | None = Field(default=None, description="not supported yet: a kvgraft registry as the store")
    registry_key: str | None = Field(default=None, description="not supported yet: the registry's log key (PEM)")
    token: str | None = Field(default=None, description="not supported yet: bearer token for the registry")
    max_blocks_per_request: int = Field(default=4096, ge=1, description="the most blocks looked up for one request")

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        """Parse ``kv_connector_extra_config``; a ``ConnectorConfigError`` names the bad key."""
        try:
            settings = cls.model_validate(dict(extra or {}))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "kv_connector_extra_config"
            raise ConnectorConfigError(f"kv_connector_extra_config: {where}: {first['msg']}",
                                       hint="known keys: " + ", ".join(sorted(cls.model_fields))) from e
        if settings.store is None:
            raise ConnectorConfigError("kv_connector_extra_config has no 'store'",
                                       hint='add "store": "DIR" (a directory of block artifacts, made when missing)')
        if settings.registry is not None or settings.registry_key is not None or settings.token is not None:
            # The registry accepts the statement types it indexes (KV artifacts and records); a vLLM
            # block is not one of them yet, so publishing would fail at the first block.
            raise ConnectorConfigError("a kvgraft registry as the connector's store is not supported yet: the registry "
                                       "does not index vLLM block statements",
                                       hint="point every server at one shared store directory (docs/vllm.md); "
                                            "remove 'registry', 'registry_key' and 'token'")
        return settings

    def trusted_keys_path(self) -> Path:
        """The trusted-keys file: the setting, else ``$KVGRAFT_TRUSTED_KEYS``."""
        value = self.trusted_keys or os.environ.get(TRUSTED_KEYS_ENV)
        if not value:
            raise ConnectorConfigError("no trusted keys: the connector loads only blocks signed by keys you trust",
                                       hint=f'add "trusted_keys": "FILE" to kv_connector_extra_config, or set ${TRUSTED_KEYS_ENV}')
        return Path(value)
