"""The data contracts' exceptions: one base class, one subclass per failure."""

from __future__ import annotations


class SchemaError(ValueError):
    """Base class: a value does not satisfy a kvgraft data contract."""


class InvalidDigestError(SchemaError):
    """A digest string is not ``sha256:`` followed by 64 lowercase hex digits."""


class CanonicalizationError(SchemaError):
    """A value cannot be written as RFC 8785 canonical JSON (NaN, huge integers, bad keys)."""


class DocumentError(SchemaError):
    """A JSON document does not match the model it should be (wrong fields or types)."""
