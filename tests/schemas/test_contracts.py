"""Data contracts: digests, canonical JSON, typed statements and the JSON Schema files."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
import rfc8785

from kvgraft.schemas import (
    KV_ARTIFACT_PREDICATE,
    SCHEMA_FILES,
    CanonicalizationError,
    DocumentError,
    InvalidDigestError,
    KvArtifactStatement,
    Statement,
    canonical_json,
    canonical_model,
    json_schema_text,
    parse_sha256,
    parse_statement,
    sha256_bytes,
    sha256_file,
    sha256_stream,
)
from kvgraft.schemas._internal import canonical

from .fixtures import kv_artifact_statement

JSON_DIR = Path(__file__).resolve().parents[2] / "schemas" / "json"


def test_json_schema_files_are_current() -> None:
    stale = []
    for stem, model in SCHEMA_FILES.items():
        path = JSON_DIR / f"{stem}.schema.json"
        if not path.exists() or path.read_text(encoding="utf-8") != json_schema_text(model):
            stale.append(path.name)
    assert not stale, f"stale JSON Schema files {stale}: run `make schemas` and commit the result"


def test_no_unlisted_schema_files() -> None:
    listed = {f"{stem}.schema.json" for stem in SCHEMA_FILES}
    assert {p.name for p in JSON_DIR.glob("*.json")} == listed


@pytest.mark.parametrize(
    "bad",
    ["", "sha256:", "sha256:" + "A" * 64, "sha256:" + "a" * 63, "sha512:" + "a" * 64, "a" * 64, "sha256:" + "a" * 64 + "/.."],
)
def test_bad_digests_are_refused(bad: str) -> None:
    with pytest.raises(InvalidDigestError, match="is not a sha256 digest"):
        parse_sha256(bad)


def test_digest_of_bytes_stream_and_file_agree(tmp_path: Path) -> None:
    data = b"kvgraft" * 300_000  # several 1 MiB chunks
    (tmp_path / "f").write_bytes(data)
    d = sha256_bytes(data)
    assert d == sha256_stream(io.BytesIO(data)) == sha256_file(tmp_path / "f")
    assert parse_sha256(d) == d
    assert sha256_bytes(b"") == "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


def test_canonical_json_follows_rfc8785() -> None:
    # Keys sorted by UTF-16 code units, no whitespace, ECMAScript number form (RFC 8785 §3.2).
    value = {"b": [1e21, 1.5, -0.0, 10.0], "a": "\u20ac", "\u00e9": None, "A": True}
    assert canonical_json(value) == '{"A":true,"a":"€","b":[1e+21,1.5,0,10],"é":null}'.encode()


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 2**64, {1: "x"}, [2**53, 7], [-(2**53)]])
def test_canonical_json_refuses_what_it_cannot_represent(value: object) -> None:
    with pytest.raises(CanonicalizationError, match="cannot write canonical JSON"):
        canonical_json(value)


def test_kv_artifact_statement_round_trips_canonically() -> None:
    statement = kv_artifact_statement()
    payload = canonical_model(statement)
    parsed = parse_statement(payload)
    assert isinstance(parsed, KvArtifactStatement)
    assert parsed == statement
    assert canonical_model(parsed) == payload
    assert json.loads(payload)["_type"] == "https://in-toto.io/Statement/v1"
    assert json.loads(payload)["predicateType"] == KV_ARTIFACT_PREDICATE


def test_unknown_predicate_type_parses_as_plain_statement() -> None:
    doc = {"_type": "https://in-toto.io/Statement/v1", "subject": [{"name": "a", "digest": {"sha256": "0" * 64}}],
           "predicateType": "https://example.com/x/v1", "predicate": {"k": 1}}
    parsed = parse_statement(json.dumps(doc).encode())
    assert type(parsed) is Statement


def _artifact_doc() -> dict:
    return json.loads(canonical_model(kv_artifact_statement()))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["predicate"].pop("chain_key"), r"predicate\.chain_key: Field required"),
        (lambda d: d["predicate"]["tokens"].update(ids=[1, 2]), "cover 3 tokens but 2 token ids"),
        (lambda d: d["predicate"].update(parent="sha256:xyz"), "is not a sha256 digest"),
        (lambda d: d["predicate"].update(extra=1), r"predicate\.extra: Extra inputs are not permitted"),
        (lambda d: d["predicate"]["positions"].update(start=5, end=2), "ends before it starts"),
        (lambda d: d["subject"][0].update(name="../etc/passwd"), "must be a relative path"),
        (lambda d: d.update(subject=[]), "subject: List should have at least 1 item"),
        (lambda d: d.update(_type="https://in-toto.io/Statement/v0.1"), "_type: Input should be"),
        (lambda d: d["predicate"]["profile"].update(threads="two"), r"profile\.threads: Input should be a valid integer"),
    ],
)
def test_invalid_artifact_statements_name_the_field(mutate, message: str) -> None:  # type: ignore[no-untyped-def]
    doc = _artifact_doc()
    mutate(doc)
    with pytest.raises(DocumentError, match=message):
        parse_statement(json.dumps(doc).encode())


def test_duplicate_keys_are_refused() -> None:
    with pytest.raises(DocumentError, match="duplicate key '_type'"):
        parse_statement(b'{"_type": "a", "_type": "b"}')


@pytest.mark.parametrize("ids", [[], [0], [5, -3, 49151], [2**53 - 1, -(2**53 - 1)], [True, 1], [7, 1.5], list(range(4096))])
def test_canonical_json_of_a_list_of_integers_is_rfc8785s(ids: list[int]) -> None:
    # The token-id fast path (digits joined by commas) and the general serializer agree,
    # including where the fast path hands over (a bool, a float; past 2**53 - 1 both refuse).
    assert canonical_json(ids) == rfc8785.dumps(ids)


def _depth_by_every_character(text: str, limit: int) -> bool:
    """The plain statement of the depth rule: one character at a time."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > limit:
                return False
        elif ch in "]}":
            depth -= 1
    return True


def test_depth_check_visiting_only_special_characters_agrees_with_visiting_every_one() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice('[[{{]}"\\\\ax1,') for _ in range(rng.randint(0, 160)))
        assert canonical._depth_ok(text) == _depth_by_every_character(text, canonical.MAX_DEPTH), text
    # Brackets inside strings (escaped quotes and backslashes included) never count.
    assert canonical._depth_ok('["' + "[" * 100 + '\\"\\\\' + "{" * 100 + '"]')
    assert not canonical._depth_ok('["\\\\"' + "[" * 64 + "]")
