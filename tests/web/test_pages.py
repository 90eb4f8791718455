"""The UI pages in-process: escaping, headers, signature status, filters, paging, errors."""

from __future__ import annotations

import base64
import json
import re

import pytest

from kvgraft.registry._internal.http import signatures
from kvgraft.registry._internal.http import ui as ui_module
from kvgraft.registry._internal.http.security import SECURITY_HEADERS
from kvgraft.verifier import keyid_of, parse_trusted_keys
from kvgraft.web import lineage_view
from tests.registry.conftest import Harness, Key, artifact

from .conftest import HOSTILE_MODEL, HOSTILE_TEXT, IMG, SCRIPT, World

PAGES = ["/", "/artifacts", "/artifacts?q=hostile", "/records", "/log", "/publishers"]


def keyid(key: Key) -> str:
    return str(keyid_of(key.private.public_key()))


def _pages(world: World) -> list[str]:
    return [
        *PAGES,
        f"/artifacts/{world.hostile.digest}",
        f"/artifacts/{world.middle.digest}",
        f"/records/{world.exactness_digest}",
        f"/records/{world.evaluation_digest}",
    ]


def test_hostile_strings_reach_the_html_escaped(ui: tuple[Harness, World]) -> None:
    h, world = ui
    for path in _pages(world):
        html = h.client.get(path).text
        assert SCRIPT not in html, path
        assert "<img" not in html, path
        assert "onerror=alert(1)>" not in html, path
    page = h.client.get(f"/artifacts/{world.hostile.digest}").text
    assert "hostile &lt;script&gt;alert(1)&lt;/script&gt; and &#34;&gt;&lt;img src=x onerror=alert(1)&gt; end" in page
    assert "evil&#34;&gt;&lt;img src=x onerror=alert(1)&gt;" in page
    # The hostile model name is also an <option> of the artifacts filter: escaped there too.
    listing = h.client.get("/artifacts").text
    assert "<option>evil&#34;&gt;&lt;img src=x onerror=alert(1)&gt;</option>" in listing


def test_pages_carry_no_inline_script_or_style(ui: tuple[Harness, World]) -> None:
    h, world = ui
    for path in _pages(world):
        html = h.client.get(path).text
        scripts = re.findall(r"<script\b[^>]*>", html)
        assert scripts == ['<script src="/static/app.js" defer>'], (path, scripts)
        assert "<style" not in html and " style=" not in html, path
        assert not re.search(r"<[a-z][^<>]*\son[a-z]+=", html), path  # no event-handler attribute on any tag
        assert "http://" not in re.sub(r'<pre class="cmd"[^>]*>.*?</pre>|xmlns="http://www.w3.org/2000/svg"', "", html, flags=re.S), path


@pytest.mark.parametrize("path", [*PAGES, "/static/style.css", "/static/app.js", "/artifacts/sha256:00", "/log?old=5&new=2",
                                  "/nowhere"])
def test_every_ui_response_has_the_security_headers(ui: tuple[Harness, World], path: str) -> None:
    h, _ = ui
    r = h.client.get(path)
    for name, value in SECURITY_HEADERS.items():
        assert r.headers.get(name) == value, (path, name)


def test_signature_status_reports_who_signed_and_why_not(ui: tuple[Harness, World], web_keys: dict[str, Key]) -> None:
    h, world = ui
    registry = h.client.app.state.registry
    good = web_keys["alice"].sign(world.root.statement)
    status = ui_signature(registry, good, "alice")
    assert status.verified and status.signers == [{"name": "alice", "keyid": keyid(web_keys["alice"])}]
    assert "verified by this server with alice's registered key" in status.message
    # Bob's keys do not verify alice's signature: the page says so and names the claimed key.
    wrong = ui_signature(registry, good, "bob")
    assert not wrong.verified and wrong.claimed_keyids == [keyid(web_keys["alice"])]
    assert re.search(r"signature|key", wrong.message)
    doc = json.loads(good)
    payload = json.loads(base64.b64decode(doc["payload"]))
    payload["predicate"]["source_text"]["text"] = "altered"
    doc["payload"] = base64.b64encode(json.dumps(payload).encode()).decode()
    altered = ui_signature(registry, json.dumps(doc).encode(), "alice")
    assert not altered.verified
    assert altered.message
    assert ui_signature(registry, good, "nobody").message == "publisher 'nobody' has no registered key to verify with"


def ui_signature(registry: object, envelope: bytes, publisher: str) -> signatures.SignatureStatus:
    return signatures.signature_status(registry, envelope, publisher)  # type: ignore[arg-type]


def test_artifact_page_states_signer_lineage_proof_and_commands(ui: tuple[Harness, World], web_keys: dict[str, Key]) -> None:
    h, world = ui
    html = h.client.get(f"/artifacts/{world.middle.digest}").text
    assert keyid(web_keys["alice"]) in html
    assert f'href="/artifacts/{world.root.digest}"' in html and f'href="/artifacts/{world.leaf.digest}"' in html
    entry = h.client.get(f"/v1/artifacts/{world.middle.digest}").json()
    for proof_hash in entry["inclusion_proof"]["hashes"]:
        assert proof_hash in html
    index = entry["entry"]["log_index"]
    assert "--inclusion inclusion.json art/statement.dsse.json" in html
    assert f"/v1/log/proof/inclusion?index={index}&amp;tree_size={world.entries}" in html
    assert "kvgraft-verify envelope art/statement.dsse.json --trusted-keys trusted-keys.json --artifact-dir art" in html


def test_trusted_keys_file_of_a_publisher_parses(ui: tuple[Harness, World], web_keys: dict[str, Key]) -> None:
    h, _ = ui
    r = h.client.get("/publishers/alice/trusted-keys.json")
    assert r.status_code == 200
    trusted = parse_trusted_keys(r.content)
    assert [k.keyid for k in trusted.keys] == [keyid(web_keys["alice"])]
    missing = h.client.get("/publishers/nobody/trusted-keys.json")
    assert missing.status_code == 404
    assert "no publisher named &#39;nobody&#39; has a registered key here" in missing.text


def test_filters_and_search(ui: tuple[Harness, World]) -> None:
    h, world = ui
    by_text = h.client.get("/artifacts?q=CHLOROPHYLL+light").text
    assert "1 artifact matches" in by_text and world.middle.digest in by_text
    roots = h.client.get("/artifacts?parent=none").text
    assert "2 artifacts match" in roots
    children = h.client.get(f"/artifacts?parent={world.root.digest}").text
    assert "2 artifacts match" in children and world.sibling.digest in children and world.middle.digest in children
    assert "1 artifact matches" in h.client.get(f"/artifacts?model={HOSTILE_MODEL}").text
    assert "2 artifacts match" in h.client.get("/artifacts?publisher=bob").text
    assert "2 records" in h.client.get("/records?type=exactness").text
    assert "3 records" in h.client.get(f"/records?artifact={world.root.digest}").text


def test_pages_of_fifty_link_to_older_entries(ui: tuple[Harness, World], monkeypatch: pytest.MonkeyPatch) -> None:
    h, world = ui
    monkeypatch.setattr(ui_module, "PAGE_SIZE", 2)
    first = h.client.get("/artifacts").text
    older = re.search(r'href="(/artifacts\?before=\d+)" rel="next"', first)
    assert older, first
    second = h.client.get(older.group(1)).text
    third_link = re.search(r'href="(/artifacts\?before=\d+)" rel="next"', second)
    assert third_link
    third = h.client.get(third_link.group(1)).text
    assert 'rel="next"' not in third
    shown = [re.findall(r'<td class="num">(\d+)</td>', page) for page in (first, second, third)]
    assert [int(i) for page in shown for i in page] == [4, 3, 2, 1, 0]


def test_errors_are_html_pages_that_say_what_to_do(ui: tuple[Harness, World]) -> None:
    h, _ = ui
    r = h.client.get("/artifacts/sha256:" + "0" * 64)
    assert r.status_code == 404 and r.headers["content-type"].startswith("text/html")
    assert "no KV artifact with tensors sha256:" + "0" * 64 + " is in this registry" in r.text
    bad = h.client.get("/log?old=5&new=2")
    assert bad.status_code == 400
    assert "a consistency proof needs 0 &lt;= old &lt;= new &lt;= 8; got old=5, new=2" in bad.text
    assert h.client.get("/records?type=artifact").status_code == 400


def test_log_page_shows_a_consistency_proof_that_verifies(ui: tuple[Harness, World]) -> None:
    h, world = ui
    html = h.client.get("/log?old=3&new=8").text
    proof = h.client.get("/v1/log/proof/consistency?old=3&new=8").json()
    assert proof["hashes"] and all(x in html for x in proof["hashes"])
    assert "--consistency consistency.json checkpoint-old" in html
    assert html.count('<tr>\n      <td class="num">') == world.entries + 1


def test_entries_redirect_to_their_page(ui: tuple[Harness, World]) -> None:
    h, world = ui
    r = h.client.get("/entries/0", follow_redirects=False)
    assert r.status_code in (301, 302, 307) and r.headers["location"] == f"/artifacts/{world.root.digest}"
    r = h.client.get(f"/entries/{world.entries - 1}", follow_redirects=False)
    assert r.headers["location"] == f"/records/{world.evaluation_digest}"


def test_a_child_whose_parent_entry_is_missing_is_drawn_as_missing() -> None:
    from kvgraft.web import LineageNode, lineage_svg

    parent = artifact("p")
    svg = lineage_svg(
        [LineageNode(parent.digest[:19], "no entry in this log", None, "missing")],
        LineageNode("this", "pos 1-2", None, "current"),
        [LineageNode(HOSTILE_TEXT, IMG, "/artifacts/x?a=1&b=2", "child")],
    )
    assert "node-missing" in svg and "node-current" in svg
    assert "<img" not in svg and "&lt;img src=x" in svg
    assert 'href="/artifacts/x?a=1&amp;b=2"' in svg


def test_kl_plot_escapes_names_and_marks_all_zero_series() -> None:
    from kvgraft.web import PlotSeries, kl_plot_svg

    svg = kl_plot_svg([PlotSeries("exact", "s0", [(0, 0.0), (1, 0.0)]), PlotSeries(SCRIPT, "s1", [(0, 0.5), (1, 0.25)])])
    assert svg.count("<circle") == 4
    assert "exact (all 0)" in svg
    assert SCRIPT not in svg and "&lt;script&gt;" in svg


def test_ancestors_are_listed_nearest_first(ui: tuple[Harness, World]) -> None:
    h, world = ui
    html = h.client.get(f"/artifacts/{world.leaf.digest}").text
    parents = re.findall(r'<a class="lineage-parent" href="/artifacts/(sha256:[0-9a-f]{64})">', html)
    assert parents == [world.middle.digest, world.root.digest]


def test_a_long_chain_is_drawn_shortened_with_its_root() -> None:
    parents = [{"digest": f"sha256:{i:064x}", "log_index": i, "positions": (i, i + 1)} for i in range(9, -1, -1)]
    children = [{"digest": f"sha256:{100 + i:064x}", "log_index": 100 + i, "positions": (10, 11)} for i in range(8)]
    drawn = lineage_view({"digest": "sha256:" + "f" * 64, "positions": (10, 11)}, parents, children)
    svg = str(drawn["svg"])
    assert "\u2026 7 more" in svg  # 10 ancestors: the root, 7 behind the marker, the 2 nearest
    assert svg.count('class="node-link"') == 1 + 2 + 6 + 1  # root, 2 parents, 6 children, "+ 2 more" link
    assert "+ 2 more" in svg and f"/artifacts?parent=sha256:{'f' * 64}" in svg
    assert f"/artifacts/sha256:{0:064x}" in svg  # the root is always drawn


def test_evaluation_page_checks_doc_hashes_against_the_shipped_dataset(ui: tuple[Harness, World]) -> None:
    h, world = ui
    html = h.client.get(f"/records/{world.evaluation_digest}").text
    assert "every doc hash is its document's" in html
    assert html.count("\u2714 matches doc") == 3
