#!/usr/bin/env bash
# Type-check kvgraft with mypy: strict on kvgraft.schemas and kvgraft.verifier, the default
# checks elsewhere (pyproject.toml, [tool.mypy]).
#
# Why a link tree: the repository keeps its packages at the top level (schemas/, verifier/, ...)
# and pyproject's package-dir maps them to kvgraft.schemas, kvgraft.verifier, ...; setuptools'
# editable install resolves that with an import hook, which a type checker cannot follow. So
# this script lays out build/typecheck/kvgraft/ as the installed package looks, with symbolic
# links to the source folders (new files are seen at once, nothing is copied), and points mypy
# there. The mapping is read from pyproject.toml, so it exists once.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-.venv/bin/python}"
tree=build/typecheck
rm -rf "$tree"
mkdir -p "$tree/kvgraft"
"$PYTHON" - "$tree" <<'PY'
import os
import sys
import tomllib
from pathlib import Path

tree = Path(sys.argv[1])
package_dir = tomllib.loads(Path("pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
root = Path(package_dir.pop("kvgraft")).resolve()
for entry in root.iterdir():
    if entry.name != "__pycache__":
        os.symlink(entry, tree / "kvgraft" / entry.name)
for name, source in package_dir.items():
    # A package below one that is not mapped (kvgraft.data.datasets) needs its parent folder.
    (tree / Path(*name.split("."))).parent.mkdir(parents=True, exist_ok=True)
    os.symlink(Path(source).resolve(), tree / Path(*name.split(".")))
PY
MYPYPATH="$tree" exec "$PYTHON" -m mypy -p kvgraft
