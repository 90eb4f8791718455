"""in-toto Statement v1 (https://github.com/in-toto/attestation/blob/main/spec/v1/statement.md)."""

from __future__ import annotations

from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .digests import HexDigestField

STATEMENT_TYPE: Final = "https://in-toto.io/Statement/v1"


class Contract(BaseModel):
    """Base of every kvgraft document model: frozen, strict about unknown fields."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, strict=True)


class SubjectDigest(Contract):
    """A subject's digest set; kvgraft always uses sha256 (bare hex, as in-toto does)."""

    sha256: HexDigestField


class Subject(Contract):
    """A resource the statement is about: a file name and its digest."""

    name: str = Field(min_length=1, description="file name, relative to the artifact directory")
    digest: SubjectDigest

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        # Subject names become paths wherever the statement is pulled, checked or reported: the
        # one rule (layout's, imported here because layout imports this module) is checked at
        # parse time, so that a registry refuses at publish what no client could write.
        from .layout import check_subject_name

        check_subject_name(name)
        return name


class Statement(Contract):
    """An in-toto Statement v1 with an untyped predicate.

    Typed statements (artifacts, records) subclass this and narrow ``predicate_type`` and
    ``predicate``.
    """

    type_: Literal["https://in-toto.io/Statement/v1"] = Field(default=STATEMENT_TYPE, alias="_type")
    subject: list[Subject] = Field(min_length=1)
    predicate_type: str = Field(alias="predicateType", min_length=1)
    predicate: dict[str, Any]

    @field_validator("subject")
    @classmethod
    def _unique_names(cls, subject: list[Subject]) -> list[Subject]:
        from .layout import check_subject_names

        check_subject_names([s.name for s in subject])
        return subject
