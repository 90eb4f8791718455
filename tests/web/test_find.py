"""Finding things (issue 38): a short digest resolves as git resolves an abbreviation (one match: its
page; several: the candidates listed; none: a clear 404), in the UI, the API and ``kvgraft pull``;
the search box finds digests, publishers and models; every browser path answers errors as HTML
(``/publishers/NAME`` was raw problem JSON); a publisher has its own page."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgraft.cli import main
from tests.registry.conftest import Artifact, Harness, Key, Server, artifact, harness, running_server

from .conftest import World, publish_world


def _twins() -> tuple[Artifact, Artifact]:
    """Two artifacts whose tensor digests share their first 4 hex digits (found by trying salts)."""
    seen: dict[str, Artifact] = {}
    for n in range(5000):
        a = artifact("twin", salt=str(n).encode())
        head = a.digest.removeprefix("sha256:")[:4]
        if head in seen:
            return seen[head], a
        seen[head] = a
    raise AssertionError("no two of 5000 digests share 4 hex digits")


@pytest.fixture(scope="module")
def found(tmp_path_factory: pytest.TempPathFactory, web_keys: dict[str, Key]) -> tuple[Path, World, Artifact, Artifact]:
    data = tmp_path_factory.mktemp("find") / "data"
    first, second = _twins()
    with harness(data, web_keys) as h:
        world = publish_world(h, web_keys["alice"], web_keys["bob"])
        h.publish_artifact(first, web_keys["alice"])
        h.publish_artifact(second, web_keys["alice"])
    return data, world, first, second


@pytest.fixture
def site(found: tuple[Path, World, Artifact, Artifact], web_keys: dict[str, Key]) -> Iterator[Harness]:
    # Per test: the live server of the last test opens the same database, which one process holds at a time.
    with harness(found[0], web_keys) as h:
        yield h


def _short(digest: str, hex_digits: int = 10) -> str:
    return digest[: len("sha256:") + hex_digits]


def test_a_unique_short_digest_opens_its_page(site: Harness, found: tuple[Path, World, Artifact, Artifact]) -> None:
    _, world, _, _ = found
    for path, target in (
        (f"/artifacts/{_short(world.middle.digest)}", f"/artifacts/{world.middle.digest}"),
        (f"/artifacts/{_short(world.middle.digest).removeprefix('sha256:')}", f"/artifacts/{world.middle.digest}"),
        (f"/records/{_short(world.evaluation_digest)}", f"/records/{world.evaluation_digest}"),
    ):
        r = site.client.get(path, follow_redirects=False)
        assert r.status_code in (301, 302, 303, 307), (path, r.status_code)
        assert r.headers["location"] == target
    page = site.client.get(f"/artifacts/{_short(world.middle.digest)}")
    assert page.status_code == 200 and "Chlorophyll absorbs mostly blue and red light." in page.text


def test_an_ambiguous_short_digest_lists_the_candidates(site: Harness, found: tuple[Path, World, Artifact, Artifact]) -> None:
    _, _, first, second = found
    shared = _short(first.digest, 4)
    r = site.client.get(f"/artifacts/{shared}", follow_redirects=False)
    assert r.status_code == 409 and r.headers["content-type"].startswith("text/html")
    assert "Ambiguous short digest" in r.text and f"{shared} is the start of" in r.text
    assert f'href="/artifacts/{first.digest}"' in r.text and f'href="/artifacts/{second.digest}"' in r.text


def test_a_short_digest_matching_nothing_is_an_html_404(site: Harness) -> None:
    r = site.client.get("/artifacts/sha256:ffff0000ffff", follow_redirects=False)
    # The fixture's few digests starting with these 48 bits is a chance of about 1e-13: not skipped.
    assert r.status_code == 404
    assert r.headers["content-type"].startswith("text/html")
    assert "no artifact or record digest starts with sha256:ffff0000ffff" in r.text


def test_the_search_box_finds_a_digest_a_publisher_and_a_model(
    site: Harness, found: tuple[Path, World, Artifact, Artifact]
) -> None:
    _, world, first, second = found
    r = site.client.get("/artifacts", params={"q": _short(world.leaf.digest, 12)}, follow_redirects=False)
    assert r.status_code in (302, 303) and r.headers["location"] == f"/artifacts/{world.leaf.digest}"
    r = site.client.get("/artifacts", params={"q": _short(first.digest, 4)})
    assert r.status_code == 200 and 'id="candidates"' in r.text
    assert first.digest in r.text and second.digest in r.text
    by_bob = site.client.get("/artifacts", params={"q": "bob"}).text
    assert "Showing the artifacts of publisher bob" in by_bob and "2 artifacts match" in by_bob
    by_model = site.client.get("/artifacts", params={"q": "tiny-llama-test"}).text
    assert "Showing the artifacts of model tiny-llama-test" in by_model and "6 artifacts match" in by_model
    words = site.client.get("/artifacts", params={"q": "chlorophyll"}).text
    assert "1 artifact matches" in words and "Showing the artifacts of" not in words


def test_the_api_resolves_short_digests(site: Harness, found: tuple[Path, World, Artifact, Artifact]) -> None:
    _, world, first, second = found
    doc = site.client.get(f"/v1/digests/{_short(first.digest, 4)}").json()
    assert doc["prefix"] == _short(first.digest, 4) and doc["more"] is False
    assert [m["digest"] for m in doc["matches"]] == sorted([first.digest, second.digest])
    assert all(m["kind"] == "artifact" and m["publisher"] == "alice" for m in doc["matches"])
    one = site.client.get(f"/v1/digests/{_short(world.evaluation_digest)}").json()
    assert [(m["digest"], m["kind"]) for m in one["matches"]] == [(world.evaluation_digest, "evaluation")]
    only_artifacts = site.client.get(f"/v1/digests/{_short(world.evaluation_digest)}", params={"kind": "artifact"}).json()
    assert only_artifacts["matches"] == []
    bad = site.client.get("/v1/digests/zz%25")
    assert bad.status_code == 400 and bad.headers["content-type"].startswith("application/problem+json")
    assert "is not a short digest" in bad.json()["detail"]


def test_regression_publisher_page_was_problem_json(site: Harness, found: tuple[Path, World, Artifact, Artifact]) -> None:
    _, world, _, _ = found
    r = site.client.get("/publishers/alice")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "<h1>Publisher alice</h1>" in r.text and 'href="/publishers/alice/trusted-keys.json"' in r.text
    assert f"/artifacts/{world.root.digest}" in r.text
    for path, message in (
        ("/publishers/nobody", "no publisher named &#39;nobody&#39; is registered here"),
        ("/publishers/alice/no-such-thing", "is not part of this registry"),
        ("/no-such-page", "is not part of this registry"),
    ):
        r = site.client.get(path)
        assert r.status_code == 404, path
        assert r.headers["content-type"].startswith("text/html"), (path, r.headers["content-type"])
        assert message in r.text, (path, r.text[:2000])
    # The machine interfaces keep answering problem JSON.
    for path in ("/v1/no-such-thing", "/v1", "/tlog/no-such-thing"):
        r = site.client.get(path)
        assert r.status_code == 404 and r.headers["content-type"].startswith("application/problem+json"), path


@pytest.fixture(scope="module")
def live_found(found: tuple[Path, World, Artifact, Artifact]) -> Iterator[Server]:
    with running_server(found[0]) as server:
        yield server


def test_kvgraft_pull_takes_a_unique_short_digest(
    live_found: Server, found: tuple[Path, World, Artifact, Artifact], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    _, world, first, _ = found
    monkeypatch.setenv("KVGRAFT_HOME", str(tmp_path / "home"))
    out = tmp_path / "pulled"
    assert main(["pull", "--registry", live_found.url, "--out", str(out), _short(world.middle.digest), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and (out / "kv.safetensors").read_bytes() == world.middle.tensors

    assert main(["pull", "--registry", live_found.url, "--out", str(tmp_path / "x"), _short(first.digest, 4), "--json"]) == 1
    stdout, stderr = capsys.readouterr()
    doc = json.loads(stdout)
    assert doc["error"] == "AmbiguousDigestError", doc
    assert f"{_short(first.digest, 4)} is the start of several artifact digests" in doc["message"]
    assert first.digest in doc["message"] and "pass more of the digest" in doc["message"]
    assert not (tmp_path / "x").exists()

    assert main(["pull", "--registry", live_found.url, "--out", str(tmp_path / "y"), _short(world.evaluation_digest)]) == 1
    _, stderr = capsys.readouterr()
    assert stderr.startswith("kvgraft: RegistryNotFoundError: no artifact digest in ")
