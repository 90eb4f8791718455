"""Every page of the provenance browser is usable on a phone (issue 38): in Debian's Chromium at
375 px wide, no page scrolls sideways and the navigation stays on screen.

At 375 px the overview was 998 px wide with the navigation off screen (no media query).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from tests.registry.conftest import Server

from .conftest import World
from .test_browser import CHROMIUM, CHROMIUM_ARGS

pytestmark = pytest.mark.skipif(os.environ.get("KVGRAFT_SKIP_BROWSER") == "1", reason="KVGRAFT_SKIP_BROWSER=1")

WIDTH = 375


def _pages(world: World) -> list[str]:
    """Every kind of page the browser serves, error pages included."""
    return [
        "/", "/artifacts", "/artifacts?q=chlorophyll", f"/artifacts/{world.root.digest}", f"/artifacts/{world.middle.digest}",
        f"/artifacts/{world.hostile.digest}", "/records", "/records?type=evaluation", f"/records/{world.exactness_digest}",
        f"/records/{world.shifted_digest}", f"/records/{world.evaluation_digest}", "/log", "/log?old=1&new=3",
        "/publishers", "/publishers/alice", "/artifacts/sha256:" + "0" * 64, "/publishers/nobody",
        "/no-such-page",
    ]


@pytest.fixture(scope="module")
def phone(live: tuple[Server, World]) -> Iterator[Any]:
    """A page in headless Chromium with a 375 px wide viewport."""
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():
        pytest.fail(f"the browser tests need Debian's Chromium at {CHROMIUM}: apt-get install -y chromium (make test does)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": WIDTH, "height": 800}, is_mobile=True)
            context.set_default_timeout(15_000)
            yield context.new_page()
        finally:
            browser.close()


def test_regression_narrow_screen_every_page_fits_375px(phone: Any, live: tuple[Server, World]) -> None:
    server, world = live
    too_wide = {}
    nav_off_screen = {}
    for path in _pages(world):
        response = phone.goto(server.url + path)
        assert response is not None and "text/html" in response.headers["content-type"], path
        width = phone.evaluate("document.documentElement.scrollWidth")
        if width > WIDTH:
            too_wide[path] = width
        # Every navigation link is on screen (not pushed past the right edge).
        right = phone.evaluate("Math.max(...[...document.querySelectorAll('header nav a')].map(a => a.getBoundingClientRect().right))")
        if right > WIDTH:
            nav_off_screen[path] = right
    assert too_wide == {}, f"pages wider than {WIDTH} px (document.scrollWidth): {too_wide}"
    assert nav_off_screen == {}, f"navigation links past the right edge: {nav_off_screen}"
