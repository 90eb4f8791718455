"""The distribution lists every package directory, so a wheel install is complete."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_package_directory_is_listed() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = config["package-dir"]
    found = set()
    for name, directory in mapping.items():
        root = REPO / directory
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root).parts
            found.add(".".join((name, *rel)))
    missing = sorted(found - set(config["packages"]))
    assert not missing, f"add {missing} to [tool.setuptools] packages in pyproject.toml"
