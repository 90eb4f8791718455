"""The one path-scrub rule (issue 38): the API's problems, the browser's pages and the witness keep
the host's paths out of every answer with ``security.scrub_paths``, written once."""

from __future__ import annotations

import re
from pathlib import Path

from kvgraft.registry._internal.http.security import scrub_paths

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("/srv/kvgraft/data",)


def test_the_data_directory_is_never_shown_and_other_paths_only_in_server_faults() -> None:
    text = "cannot open /srv/kvgraft/data/registry.duckdb (see /etc/kvgraft/x.toml)"
    assert scrub_paths(text, ROOTS, server_side=False) == "cannot open DATA/registry.duckdb (see /etc/kvgraft/x.toml)"
    assert scrub_paths(text, ROOTS, server_side=True) == "cannot open DATA/registry.duckdb (see <path>)"


def test_a_server_fault_loses_every_absolute_path_but_keeps_urls_and_relative_paths() -> None:
    cases = {
        "cannot write /var/lib/blobs/tmp/x: disk full (errno 28)": "cannot write <path>: disk full (errno 28)",
        # Names beyond word characters (the pages' old rule took them, the API's did not).
        "lost /home/ünïcode/data dir/x=1": "lost <path> dir/x=1",
        "'/opt/a/b' failed": "'<path>' failed",
        "see https://example.org/a/b and blobs/sha256/ab": "see https://example.org/a/b and blobs/sha256/ab",
        "a single /segment stays": "a single /segment stays",
    }
    for text, shown in cases.items():
        assert scrub_paths(text, server_side=True) == shown, text


def test_the_rule_is_written_once_regression_three_scrub_regexes() -> None:
    # app.py and ui.py each had their own regex (two different ones); the witness borrowed app.py's.
    sources = {p.relative_to(REPO).as_posix(): p.read_text() for p in (REPO / "registry").rglob("*.py")}
    defining = sorted(name for name, text in sources.items() if re.search(r"ABSOLUTE_PATH\w*\s*(:[^=]*)?=\s*re\.compile", text))
    assert defining == ["registry/_internal/http/security.py"]
    callers = sorted(name for name, text in sources.items() if "scrub_paths(" in text and not name.endswith("security.py"))
    assert callers == ["registry/_internal/http/problems.py", "registry/_internal/http/ui.py"]
