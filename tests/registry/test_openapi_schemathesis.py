"""The API's own contract, machine-checked: the OpenAPI document, and schemathesis against it.

schemathesis (the real CLI, from the dev extra) runs every check against a live ``kvgraft serve``
on 127.0.0.1, once without a token and once with a write token, bounded in examples and time;
any finding fails the test. It reads the repository's schemathesis.toml (run from the root).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tests.registry.conftest import REPO, Harness, Key, Server, artifact, running_server
from tests.reliability.servers import make_token, post_entry, put_blob

SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
DIGEST = "^sha256:[0-9a-f]{64}$"


def _document(reg: Harness) -> dict[str, Any]:
    r = reg.client.get("/schema/openapi.json")
    assert r.status_code == 200
    return dict(r.json())


def test_openapi_document_has_a_component_schema_for_every_request_and_response_body(reg: Harness) -> None:
    doc = _document(reg)
    schemas = doc["components"]["schemas"]
    for name in ("Problem", "BlobStored", "EntryDocument", "EntryPage", "ArtifactDocument", "ArtifactPage",
                 "InclusionProof", "ConsistencyProof", "LogKey", "PublisherList", "DsseEnvelope", "PostedEnvelope"):
        assert name in schemas, name
    assert schemas["EntryMeta"]["properties"]["digest"]["pattern"] == DIGEST
    paths = doc["paths"]
    assert set(paths) >= {"/v1/blobs/{digest}", "/v1/entries", "/v1/entries/{ref}", "/v1/log/checkpoint", "/v1/artifacts"}
    assert not any(p.startswith("/v1/admin") for p in paths)
    for path, item in paths.items():
        for method, op in item.items():
            responses = op["responses"]
            assert responses["default"]["content"] == {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
            for status, response in responses.items():
                if status.startswith(("4", "5")):
                    assert list(response["content"]) == ["application/problem+json"], (path, method, status)
    put = paths["/v1/blobs/{digest}"]["put"]
    assert put["requestBody"]["content"] == {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}
    post = paths["/v1/entries"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["allOf"] == [{"$ref": "#/components/schemas/PostedEnvelope"}]
    assert {"200", "201", "401", "409", "413", "422", "507"} <= set(post["responses"])
    assert paths["/v1/entries/{ref}"]["get"]["responses"]["200"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/EntryDocument"
    }


def test_openapi_document_requires_bearer_tokens_on_writes_and_on_reads_only_when_configured(
    reg: Harness, tmp_path: Path, keys: dict[str, Key]
) -> None:
    from tests.registry.conftest import harness

    doc = _document(reg)
    bearer = doc["components"]["securitySchemes"]["bearer"]
    assert (bearer["type"], bearer["scheme"]) == ("http", "bearer")
    assert doc["paths"]["/v1/blobs/{digest}"]["put"]["security"] == [{"bearer": []}]
    assert doc["paths"]["/v1/entries"]["post"]["security"] == [{"bearer": []}]
    assert "security" not in doc["paths"]["/v1/entries"]["get"]
    with harness(tmp_path / "private", keys, reads_require_token=True) as private:
        r = private.client.get("/schema/openapi.json")
        assert r.json()["paths"]["/v1/entries"]["get"]["security"] == [{"bearer": []}]


def test_openapi_document_bounds_digests_limits_and_tree_sizes(reg: Harness) -> None:
    paths = _document(reg)["paths"]

    def param(path: str, name: str) -> dict[str, Any]:
        return next(p["schema"] for p in paths[path]["get"]["parameters"] if p["name"] == name)

    assert param("/v1/blobs/{digest}", "digest")["pattern"] == DIGEST
    assert param("/v1/artifacts/{digest}", "digest")["pattern"] == DIGEST
    assert param("/v1/records", "artifact")["pattern"] == DIGEST
    for path in ("/v1/entries", "/v1/artifacts", "/v1/records"):
        assert param(path, "limit") == {"type": "integer", "minimum": 1, "maximum": 500}
    for path, name in (("/v1/log/checkpoint", "tree_size"), ("/v1/log/proof/inclusion", "index"),
                       ("/v1/log/proof/inclusion", "tree_size"), ("/v1/log/proof/consistency", "old"),
                       ("/v1/log/proof/consistency", "new")):
        assert param(path, name) == {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}, (path, name)
    # Exact integers: 2^63-1 is written as an integer, not the float 9.223372036854776e18.
    raw = reg.client.get("/schema/openapi.json").text
    assert '"maximum":9223372036854775807' in raw


def test_wire_models_keep_the_service_documents_byte_for_byte(reg: Harness, keys: dict[str, Key]) -> None:
    root = artifact("byte compatible root")
    child = artifact("byte compatible child", parent=root)
    reg.publish_artifact(root, keys["alice"])
    reg.publish_artifact(child, keys["alice"])
    registry = reg.client.app.state.registry
    pairs = [
        ("/v1/entries/0", registry.reader.entry("0")),
        (f"/v1/artifacts/{child.digest}", registry.reader.artifact(child.digest)),
        ("/v1/log/key", registry.log_key()),
        ("/v1/log/proof/inclusion?index=0", registry.inclusion_proof(0, None)),
        ("/v1/publishers", {"publishers": registry.reader.publishers()}),
    ]
    for path, document in pairs:
        r = reg.client.get(path)
        assert r.status_code == 200, r.text
        assert r.content == msgspec.json.encode(document), path
    page = registry.reader.list_artifacts(limit=1)
    r = reg.client.get("/v1/artifacts", params={"limit": 1})
    assert r.content == msgspec.json.encode({"items": page.items, "next_cursor": page.next_cursor})


def test_litestar_null_is_not_taken_for_an_absent_integer_parameter(reg: Harness) -> None:
    for path, params in (("/v1/entries", {"limit": "null"}), ("/v1/log/checkpoint", {"tree_size": "null"}),
                         ("/v1/log/proof/inclusion", {"index": "0", "tree_size": "\u00b3"})):
        r = reg.client.get(path, params=params)
        assert r.status_code == 400 and "is not a whole number" in r.json()["detail"], (path, r.text)


def test_empty_digest_filters_are_refused_not_ignored(reg: Harness) -> None:
    assert reg.client.get("/v1/artifacts", params={"parent": ""}).status_code == 400
    assert reg.client.get("/v1/records", params={"artifact": ""}).status_code == 400
    r = reg.client.get("/v1/records", params={"type": ""})
    assert r.status_code == 400 and "unknown record type" in r.json()["detail"]


# --- schemathesis against a live server --------------------------------------------------------


@pytest.fixture(scope="module")
def populated(tmp_path_factory: pytest.TempPathFactory, keys: dict[str, Key]) -> Iterator[tuple[Server, str]]:
    """A live server (rate limit off: the fuzzer is one client) with two artifacts, and a write token."""
    with running_server(tmp_path_factory.mktemp("schemathesis") / "data", "--rate-limit", "0") as server:
        token, _ = make_token(server, "alice", keys["alice"])
        root = artifact("schemathesis root")
        child = artifact("schemathesis child", parent=root)
        with httpx.Client(base_url=server.url, timeout=30) as c:
            for art in (root, child):
                assert put_blob(c, token, art.tensors).status_code == 201
                assert post_entry(c, token, keys["alice"].sign(art.statement)).status_code == 201
        yield server, token


def _schemathesis(server: Server, *extra: str, report: Path) -> subprocess.CompletedProcess[str]:
    if not SCHEMATHESIS.exists() and shutil.which("schemathesis") is None:
        pytest.fail("schemathesis is not installed: pip install -e '.[dev]' (it is pinned in the dev extra)")
    command = [
        str(SCHEMATHESIS if SCHEMATHESIS.exists() else shutil.which("schemathesis")), "run", f"{server.url}/schema/openapi.json",
        "--checks", "all", "--max-examples", "20", "--max-time", "60", "--seed", "14", "--workers", "1",
        "--request-timeout", "10", "--report", "junit", "--report-junit-path", str(report), *extra,
    ]
    # One worker: with two, hypothesis describes strategies (ast.parse of lambdas) in two threads
    # at once, which CPython 3.11 before 3.11.9 can fail with "SystemError: AST constructor
    # recursion depth mismatch" (python/cpython#106905), a runtime error of the fuzzer, not of us.
    # From the repository root, so schemathesis reads its schemathesis.toml.
    return subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=REPO)


def _assert_clean(done: subprocess.CompletedProcess[str]) -> None:
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "No issues found" in output or " passed" in output, output[-3000:]
    assert "Runtime Error" not in output and "❌" not in output, output[-6000:]


@pytest.mark.slow
def test_schemathesis_finds_nothing_without_a_token(populated: tuple[Server, str], tmp_path: Path) -> None:
    server, _ = populated
    _assert_clean(_schemathesis(server, report=tmp_path / "anonymous.xml"))
    assert "Traceback" not in server.log()


@pytest.mark.slow
def test_schemathesis_finds_nothing_with_a_write_token(populated: tuple[Server, str], tmp_path: Path) -> None:
    server, token = populated
    _assert_clean(_schemathesis(server, "-H", f"Authorization: Bearer {token}", report=tmp_path / "publisher.xml"))
    assert "Traceback" not in server.log()


def test_schemathesis_config_is_valid_toml_naming_real_operations() -> None:
    import tomllib

    config = tomllib.loads((REPO / "schemathesis.toml").read_text())
    assert {(o["include-path"], o["include-method"]) for o in config["operations"]} == {
        ("/v1/blobs/{digest}", "PUT"), ("/v1/entries", "POST"), ("/v1/artifacts", "GET")
    }
    assert json.dumps(config)  # plain data
