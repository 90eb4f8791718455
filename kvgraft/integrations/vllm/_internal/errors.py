"""The connector's branch of the error tree (each a ``kvgraft.KvgraftError``)::

    ConnectorError
    ├── ConnectorConfigError     kv_connector_extra_config or the engine's set-up cannot be served
    ├── ExactnessRunError        the exactness measurement inside vLLM did not run to its record
    └── BlockRefusedError        a stored block that does not verify (it is recomputed, never loaded)
        ├── BindingMismatchError the block was computed under another binding (model, vLLM, layout...)
        ├── ChainMismatchError   its chain key, parent or token ids are not the ones asked for
        └── BlockFileError       its tensors file is missing, too large, or not the layout bound

Signature and subject failures keep the verifier's own classes (``kvgraft.verifier.VerificationError``);
the connector treats those as refusals too.
"""

from __future__ import annotations

from kvgraft.schemas import KvgraftError


class ConnectorError(KvgraftError):
    """Base class of every failure of the vLLM connector."""

    default_hint: str | None = "check kv_connector_extra_config (docs/vllm.md)"


class ConnectorConfigError(ConnectorError):
    """The connector's configuration, or the engine it runs in, cannot be served."""


class ExactnessRunError(ConnectorError):
    """The exactness measurement inside vLLM stopped before its record (nothing is written)."""

    default_hint: str | None = "the lines above (vLLM's and the connector's log) say why"


class BlockRefusedError(ConnectorError):
    """A stored block that does not verify: it is a miss, recomputed by vLLM, never loaded."""

    default_hint: str | None = "nothing to do for serving: vLLM recomputes the block; delete it from the store if it keeps being refused"


class BindingMismatchError(BlockRefusedError):
    """The block's signed binding differs from the running engine's (another model, vLLM, layout...)."""


class ChainMismatchError(BlockRefusedError):
    """The block's chain key, parent or token ids are not the ones the request needs."""


class BlockFileError(BlockRefusedError):
    """The block's tensors file is unreadable, too large, or not the layout its binding names."""
