"""Parsing documents into models, and the JSON Schema files that describe them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from .canonical import parse_json
from .dsse import Envelope
from .errors import DocumentError
from .predicates import KV_ARTIFACT_PREDICATE, KvArtifactStatement
from .records import (
    EVALUATION_PREDICATE,
    EXACTNESS_PREDICATE,
    PRE_REGISTRATION_PREDICATE,
    REPLAY_PREDICATE,
    EvaluationStatement,
    ExactnessStatement,
    PreRegistrationStatement,
    ReplayStatement,
)
from .slot import SLOT_PREDICATE, SlotStatement
from .statement import Statement

M = TypeVar("M", bound=BaseModel)

#: predicateType -> the typed statement model for it.
STATEMENT_MODELS: dict[str, type[Statement]] = {
    KV_ARTIFACT_PREDICATE: KvArtifactStatement,
    EXACTNESS_PREDICATE: ExactnessStatement,
    EVALUATION_PREDICATE: EvaluationStatement,
    PRE_REGISTRATION_PREDICATE: PreRegistrationStatement,
    REPLAY_PREDICATE: ReplayStatement,
    SLOT_PREDICATE: SlotStatement,
}

#: file stem under schemas/json/ -> model. The files are generated; a test fails when stale.
SCHEMA_FILES: dict[str, type[BaseModel]] = {
    "statement": Statement,
    "dsse-envelope": Envelope,
    "kv-artifact": KvArtifactStatement,
    "exactness": ExactnessStatement,
    "evaluation": EvaluationStatement,
    "pre-registration": PreRegistrationStatement,
    "replay": ReplayStatement,
    "llama-slot": SlotStatement,
}

JSON_DIR = Path(__file__).resolve().parent.parent / "json"


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
    return f"{where}: {err['msg']}{more}"


def validate_document(model: type[M], data: object, *, what: str) -> M:
    """Validate already-parsed JSON against ``model``; raise ``DocumentError`` naming the field."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise DocumentError(f"{what} does not match {model.__name__}: {_first_error(e)}") from e


def parse_document(model: type[M], data: bytes | str, *, what: str) -> M:
    """Parse JSON text strictly and validate it against ``model``."""
    return validate_document(model, parse_json(data, what=what), what=what)


def parse_statement(payload: bytes, *, what: str = "statement") -> Statement:
    """Parse an in-toto statement, typed by its predicateType when kvgraft knows it.

    Unknown predicate types parse as a plain ``Statement``; a known type must match its model.
    """
    data = parse_json(payload, what=what)
    generic = validate_document(Statement, data, what=what)
    typed = STATEMENT_MODELS.get(generic.predicate_type)
    return generic if typed is None else validate_document(typed, data, what=what)


def json_schema_text(model: type[BaseModel]) -> str:
    """The JSON Schema of ``model`` (by alias), as the exact text written to schemas/json/."""
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return json.dumps(schema, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write_json_schemas(directory: Path = JSON_DIR) -> list[Path]:
    """Write one ``<name>.schema.json`` per contract into ``directory``; return the paths."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for stem, model in SCHEMA_FILES.items():
        path = directory / f"{stem}.schema.json"
        path.write_text(json_schema_text(model), encoding="utf-8")
        written.append(path)
    return written
