"""mkdocs hooks of the docs site (mkdocs.yml ``hooks:``): generated pages and a complete nav.

- ``index.md``: the README, its links made relative to ``docs/`` (one text for the repository's
  front page and the site's home);
- ``reference/cli.md``: every command of ``kvgraft`` and ``kvgraft-verify`` with its ``--help``,
  generated from the argparse parsers themselves (``walk``), so the reference cannot go stale;
- ``reference/api.md``: every public name (``__all__``) of each package, with its signature and
  the first paragraph of its docstring;
- ``bench-plots/*.png``: the benchmark plots of ``bench/results/``, which the results page shows;
- a page under ``docs/`` that ``nav`` does not name is listed under "More" rather than left out,
  so a page another change adds is never unreachable.

``mkdocs build --strict`` (``make test``) fails on a broken link or anchor in any page.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files
from mkdocs.structure.nav import Navigation, Section
from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parent.parent
#: The packages whose public names the API reference lists, in the order of docs/architecture.md.
API_PACKAGES = ("kvgraft.schemas", "kvgraft.verifier", "kvgraft.engine", "kvgraft.registry", "kvgraft.registry.client",
                "kvgraft.web")
#: Help text is wrapped at this width, whatever terminal runs the build (a stable page).
HELP_COLUMNS = "100"


def cli_reference() -> str:
    """The CLI reference page: each command's ``--help``, as the tools print it."""
    os.environ["COLUMNS"] = HELP_COLUMNS
    from kvgraft.cli import build_parser
    from kvgraft.verifier.cli import build_parser as build_verify_parser
    from kvgraft.verifier.cli import walk

    out = ["# CLI reference", "",
           "Generated from the command lines' own parsers when the site is built: what `--help` prints, "
           "for every command of `kvgraft` and `kvgraft-verify`. Global options (`--json`) go anywhere on "
           "the command line; a mistyped command gets a suggestion.", ""]
    for tool, build in (("kvgraft", build_parser), ("kvgraft-verify", build_verify_parser)):
        out += [f"## {tool}", ""]
        for path, parser in walk(build(), (tool,)):
            if len(path) > 1:
                out += [f"### {' '.join(path)}", ""]
            out += ["```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(out)


def _first_paragraph(obj: Any) -> str:
    doc = inspect.getdoc(obj) or ""
    return " ".join(doc.split("\n\n", 1)[0].split())


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return ""


def api_reference() -> str:
    """The API reference page: each package's public names, signature and first docstring paragraph."""
    out = ["# API reference", "",
           "Generated when the site is built from each package's `__all__`: the public surface "
           "(everything else lives in a package's `_internal` and may change). Each entry gives the "
           "signature and the first paragraph of the docstring; the docstrings state formats and invariants.", ""]
    for name in API_PACKAGES:
        module = importlib.import_module(name)
        out += [f"## {name}", "", _first_paragraph(module), ""]
        for public in sorted(getattr(module, "__all__", ())):
            obj = getattr(module, public, None)
            if obj is None:
                continue
            if inspect.isclass(obj) or inspect.isfunction(obj):
                kind = "class" if inspect.isclass(obj) else "def"
                out += [f"`{kind} {public}{_signature(obj)}`", "", _first_paragraph(obj) or "(no docstring)", ""]
            else:
                out += [f"`{public}`: a constant, `{type(obj).__name__}`", ""]
    return "\n".join(out).replace("\n\n\n", "\n\n")


def home_page() -> str:
    """The site's home page: README.md with ``docs/X`` links made ``X`` (the README links from the
    repository's root, the site's pages from ``docs/``)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.sub(r"\]\(docs/([^)]*)\)", r"](\1)", readme)


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, "index.md", content=home_page()))
    files.append(File.generated(config, "reference/cli.md", content=cli_reference()))
    files.append(File.generated(config, "reference/api.md", content=api_reference()))
    for plot in sorted((ROOT / "bench" / "results").glob("*.png")):
        files.append(File.generated(config, f"bench-plots/{plot.name}", abs_src_path=str(plot)))
    return files


def _nav_pages(items: list[Any]) -> list[Page]:
    pages: list[Page] = []
    for item in items:
        if isinstance(item, Page):
            pages.append(item)
        elif isinstance(item, Section):
            pages += _nav_pages(item.children)
    return pages


def on_nav(nav: Navigation, config: MkDocsConfig, files: Files) -> Navigation:
    listed = {page.file.src_uri for page in _nav_pages(nav.items)}
    missing = [f.page for f in files.documentation_pages() if f.src_uri not in listed and isinstance(f.page, Page)]
    if missing:
        more = Section("More", missing)
        for page in missing:
            page.parent = more
        nav.items.append(more)
        nav.pages.extend(missing)
    return nav
