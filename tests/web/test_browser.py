"""The provenance browser in a real Chromium (Debian's, headless) driven by Playwright.

Walks the path an auditor takes (overview, search, an artifact, its lineage, a record), saves a
screenshot of each page under test-artifacts/web/, and checks on every page that the CSP
header came with it, that the browser reported no CSP violation, and that hostile entry text
is shown as text, never run.
"""

from __future__ import annotations

import html as htmllib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgraft.registry._internal.http.security import CONTENT_SECURITY_POLICY
from tests.registry.conftest import Server

from .conftest import HOSTILE_MODEL, HOSTILE_TEXT, IMG, SCREENSHOTS, SCRIPT, World

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]

# Missing Chromium fails these tests (`make test` installs it); a silent skip would pass a UI nobody opened.
# KVGRAFT_SKIP_BROWSER=1 skips them deliberately on a machine without it.
pytestmark = pytest.mark.skipif(os.environ.get("KVGRAFT_SKIP_BROWSER") == "1", reason="KVGRAFT_SKIP_BROWSER=1")


class Browser:
    """One page in headless Chromium that records what the checks need about every navigation."""

    def __init__(self, page: Any, base: str) -> None:
        self.page = page
        self.base = base
        self.documents: list[tuple[str, dict[str, str]]] = []
        self.dialogs: list[str] = []
        self.console: list[str] = []
        self.external: list[str] = []
        page.on("response", self._response)
        page.on("dialog", self._dialog)
        page.on("console", lambda m: self.console.append(m.text))
        page.on("request", lambda r: None if r.url.startswith(base) or r.url.startswith("data:") else self.external.append(r.url))

    def _response(self, response: Any) -> None:
        if response.request.resource_type in ("document", "stylesheet", "script"):
            self.documents.append((response.url, response.all_headers()))

    def _dialog(self, dialog: Any) -> None:
        self.dialogs.append(dialog.message)
        dialog.dismiss()

    def shot(self, name: str) -> Path:
        path = SCREENSHOTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


@pytest.fixture(scope="module")
def chromium(live: tuple[Server, World]) -> Iterator[Any]:
    """Headless Debian Chromium for this module."""
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():
        pytest.fail(f"the browser tests need Debian's Chromium at {CHROMIUM}: apt-get install -y chromium (make test does)")
    if SCREENSHOTS.exists():
        shutil.rmtree(SCREENSHOTS)
    SCREENSHOTS.mkdir(parents=True)
    with sync_playwright() as p:
        instance = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield instance
        finally:
            instance.close()


@pytest.fixture(scope="module")
def browser(chromium: Any, live: tuple[Server, World]) -> Iterator[Browser]:
    server, _ = live
    context = chromium.new_context(viewport={"width": 1280, "height": 900})
    context.set_default_timeout(15_000)
    try:
        yield Browser(context.new_page(), server.url)
    finally:
        context.close()


def test_an_auditor_walks_from_the_overview_to_a_record(browser: Browser, live: tuple[Server, World]) -> None:
    server, world = live
    page = browser.page

    page.goto(server.url + "/")
    assert page.locator(".stat").first.inner_text().split()[0] == "5"  # artifacts
    assert "Latest checkpoint" in page.inner_text("main")
    browser.shot("01-overview")

    page.fill("header form.search input[name=q]", "chlorophyll")
    page.click("header form.search button")
    page.wait_for_url(re.compile(r"/artifacts\?q=chlorophyll"))
    assert page.inner_text("#result-count").startswith("1 artifact matches")
    browser.shot("02-search")

    page.click(f"#artifacts a[href='/artifacts/{world.middle.digest}']")
    page.wait_for_url(f"**/artifacts/{world.middle.digest}")
    assert "signature verified" in page.inner_text(".verdicts")
    assert world.middle.statement.predicate.source_text.text in page.inner_text("#text")
    assert "kvgraft-verify envelope art/statement.dsse.json" in page.inner_text("#verify")
    assert page.locator("svg.lineage a").count() == 2  # the root and the leaf are links
    assert page.locator("button.copy").count() == 2  # /static/app.js ran under the CSP
    browser.shot("03-artifact")

    page.click(f"svg.lineage a[href='/artifacts/{world.root.digest}']")
    page.wait_for_url(f"**/artifacts/{world.root.digest}")
    children = page.locator("a.lineage-child")
    assert sorted(children.all_inner_texts()) == sorted(
        [a.digest[:19] + "\u2026" for a in (world.middle, world.sibling)]
    )
    browser.shot("04-lineage-root")

    page.click(f"a.record-link[href='/records/{world.exactness_digest}']")
    page.wait_for_url(f"**/records/{world.exactness_digest}")
    assert "summary matches the samples" in page.inner_text(".verdicts")
    assert page.locator("svg.plot circle").count() == 4  # two samples, exact and shifted
    assert "shifted (shift 3)" in page.inner_text("#samples")
    browser.shot("05-exactness-record")

    page.goto(f"{server.url}/records/{world.evaluation_digest}")
    assert "aggregates match the items" in page.inner_text(".verdicts")
    items = page.inner_text("#items")
    assert "Janet\u2019s ducks lay 16 eggs per day" in items  # GSM8K test doc 0, shown from the shipped file
    assert items.count("\u2714 matches doc") == 3
    browser.shot("06-evaluation-record")

    page.goto(server.url + "/log")
    assert page.locator("#checkpoints tbody tr").count() == world.entries + 1
    browser.shot("07-log")

    page.goto(server.url + "/publishers")
    assert page.locator("section.card h2").all_inner_texts() == ["alice", "bob"]
    browser.shot("08-publishers")

    assert not browser.dialogs
    assert not browser.external, f"pages fetched from outside the registry: {browser.external}"
    assert not [m for m in browser.console if "Content Security Policy" in m], browser.console


def test_hostile_entry_text_is_shown_as_text(browser: Browser, live: tuple[Server, World]) -> None:
    server, world = live
    page = browser.page
    for url in (f"/artifacts/{world.hostile.digest}", "/artifacts?q=hostile", "/"):
        page.goto(server.url + url)
        assert page.locator("img[src=x]").count() == 0, url
        assert page.locator("script:not([src])").count() == 0, url
        body = page.inner_text("body")
        assert SCRIPT in body and IMG in body, url
    page.goto(f"{server.url}/artifacts/{world.hostile.digest}")
    assert page.inner_text("#text pre") == HOSTILE_TEXT
    assert HOSTILE_MODEL in page.inner_text("#statement")
    browser.shot("09-hostile-entry")
    assert not browser.dialogs, f"a hostile string ran: {browser.dialogs}"


def test_every_page_came_with_the_content_security_policy(browser: Browser, live: tuple[Server, World]) -> None:
    server, world = live
    for path in ("/", "/artifacts?q=light", f"/artifacts/{world.leaf.digest}", "/records",
                 f"/records/{world.shifted_digest}", "/log", "/publishers", "/artifacts/sha256:" + "0" * 64):
        browser.page.goto(server.url + path)
    # Every document, stylesheet and script the browser loaded in this module's tests.
    kinds = {url.rsplit("/", 1)[-1] for url, _ in browser.documents}
    assert {"style.css", "app.js"} <= kinds
    assert len(browser.documents) >= 8
    for url, headers in browser.documents:
        assert headers.get("content-security-policy") == CONTENT_SECURITY_POLICY, url
        assert headers.get("x-content-type-options") == "nosniff", url
        assert headers.get("x-frame-options") == "DENY", url
    assert not [m for m in browser.console if "Content Security Policy" in m], browser.console


def test_pages_work_without_javascript(chromium: Any, live: tuple[Server, World]) -> None:
    server, world = live
    context = chromium.new_context(java_script_enabled=False, viewport={"width": 1280, "height": 900})
    try:
        page = context.new_page()
        page.goto(server.url + "/")
        page.fill("header form.search input[name=q]", "calvin")
        page.click("header form.search button")
        page.wait_for_url(re.compile(r"/artifacts\?q=calvin"))
        page.click(f"#artifacts a[href='/artifacts/{world.leaf.digest}']")
        page.click(f"a.lineage-parent[href='/artifacts/{world.middle.digest}']")
        page.wait_for_url(f"**/artifacts/{world.middle.digest}")
        page.goto(server.url + "/records")
        page.select_option("form.filters select[name=type]", "evaluation")
        page.click("form.filters button")
        page.wait_for_url(re.compile(r"type=evaluation"))
        assert page.locator("#records tbody tr").count() == 1
        assert page.locator("button.copy").count() == 0  # the only scripted feature is absent, nothing else is
        page.goto(f"{server.url}/artifacts/{world.middle.digest}")
        browser_shot = SCREENSHOTS / "10-artifact-without-javascript.png"
        page.screenshot(path=str(browser_shot), full_page=True)
        assert "signature verified" in page.inner_text(".verdicts")
    finally:
        context.close()


def _command_block(html: str, block: str) -> str:
    found = re.search(rf'<pre class="cmd" id="cmd-{block}"><code>(.*?)</code></pre>', html, re.S)
    assert found, f"no command block {block!r} on the page"
    return htmllib.unescape(found.group(1))


def _bash(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # kvgraft-verify from this environment, curl from the system: what an auditor runs.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", "-euo", "pipefail", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_commands_on_the_pages_re_check_offline(live: tuple[Server, World], tmp_path: Path) -> None:
    server, world = live
    page = httpx.get(f"{server.url}/artifacts/{world.middle.digest}", timeout=30).text
    command = _command_block(page, "verify")
    done = _bash(command, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "art" / "kv.safetensors").read_bytes() == world.middle.tensors
    # The same checks refuse a downloaded file changed by one byte.
    tensors = tmp_path / "art" / "kv.safetensors"
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 1
    tensors.write_bytes(bytes(data))
    verify_line = next(line for line in command.splitlines() if line.startswith("kvgraft-verify envelope"))
    refused = _bash(verify_line, tmp_path)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "kv.safetensors" in refused.stdout + refused.stderr

    log_page = httpx.get(f"{server.url}/log?old=3&new={world.entries}", timeout=30).text
    consistency = _bash(_command_block(log_page, "consistency"), tmp_path)
    assert consistency.returncode == 0, consistency.stdout + consistency.stderr
