"""The front door (issue 38): README.md stays at most 8 KB; every command its tour and the how-tos
show parses with the real parsers; the docs site's strict build refuses a broken link or anchor;
the site's home page is the README itself."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvgraft.cli import build_parser
from kvgraft.verifier.cli import build_parser as build_verify_parser

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: mkdocs-material's end-of-life banner off: the output holds only the build's own lines.
ENV = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
#: The pages whose commands are meant to be copied and run as written (no [OPTIONAL] placeholders).
RUNNABLE_PAGES = [README, *sorted((ROOT / "docs" / "howto").glob("*.md"))]


def test_readme_is_at_most_8_kb() -> None:
    size = README.stat().st_size
    assert size <= 8192, f"README.md is {size} bytes; move detail to docs/ (the limit is 8192)"


def test_readme_keeps_the_setup_commands_first_and_the_tour() -> None:
    text = README.read_text(encoding="utf-8")
    first_block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    assert first_block.startswith("make demo") and "\nmake test" in first_block
    for step in ("**1. Deposit**", "**2. Ask**", "**3. Capture and graft**", "**4. Publish and pull**", "**5. Audit**"):
        assert step in text


def _commands(page: Path) -> list[str]:
    """Each ``kvgraft`` / ``kvgraft-verify`` command in the page's ``sh`` blocks (continuations joined;
    a command inside ``$(...)`` or before a pipe taken alone)."""
    found = []
    for block in re.findall(r"```sh\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            inner = re.search(r"\$\((kvgraft[^|)]*)", line)
            if inner:
                line = inner.group(1)
            line = line.split("|")[0].split("&&")[0].removesuffix("&").strip()
            if line.startswith(("kvgraft ", "kvgraft-verify ")):
                found.append(line)
    return found


@pytest.mark.parametrize("page", RUNNABLE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_command_shown_parses(page: Path, capsys: pytest.CaptureFixture[str]) -> None:
    commands = _commands(page)
    assert len(commands) >= 5, commands
    for line in commands:
        argv = shlex.split(line)
        parser = build_parser() if argv[0] == "kvgraft" else build_verify_parser()
        try:
            args = parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"{page.name}: {line!r} does not parse: {capsys.readouterr().err}")
        assert callable(args.run), line


def test_the_strict_build_refuses_a_broken_link_and_a_broken_anchor(tmp_path: Path) -> None:
    """mkdocs.yml's own validation settings, on a two-page site: each fault alone fails the build."""
    pytest.importorskip("mkdocs")
    import yaml  # mkdocs's own dependency

    ours = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    config = yaml.safe_load(re.sub(r"^hooks:\n(  - .*\n)+", "", ours, flags=re.M).split("\nnav:\n")[0])
    assert config["strict"] is True
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "b.md").write_text("# B\n\n## Known part\n")
    config.update(docs_dir=str(docs), site_dir=str(tmp_path / "site"))
    for fault, warning in (
        ("[gone](missing.md)", "contains a link 'missing.md', but the target is not found"),
        ("[no such part](b.md#unknown-part)", "does not contain an anchor '#unknown-part'"),
    ):
        (docs / "index.md").write_text(f"# A\n\n{fault}\n")
        (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
        done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "-f", str(tmp_path / "mkdocs.yml")],
                              capture_output=True, text=True, timeout=300, env=ENV)
        assert done.returncode == 1, (fault, done.stderr)
        assert warning in done.stderr, done.stderr
    (docs / "index.md").write_text("# A\n\n[fine](b.md#known-part)\n")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "-f", str(tmp_path / "mkdocs.yml")],
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr


def test_the_site_home_page_is_the_readme_with_site_links() -> None:
    pytest.importorskip("mkdocs")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import docs_hooks
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    home = docs_hooks.home_page()
    assert home.startswith("# kvgraft\n")
    assert "](docs/" not in home and "](architecture.md)" in home and "](howto/auditor.md)" in home
