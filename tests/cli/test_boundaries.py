"""The command line's edges: ``kvgraft --help`` and ``kvgraft keys`` start without torch, the
packages below never import the CLI, and no package's ``_internal`` is imported from outside it."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: Heavy dependencies a command that does not use them must not load.
HEAVY = ("torch", "transformers", "httpx", "litestar", "duckdb", "kvgraft.engine")


def _loaded_after(argv: list[str], tmp_path: Path) -> tuple[int, list[str], str]:
    """Run ``kvgraft.cli.main(argv)`` in a fresh interpreter; the exit status and the heavy modules it loaded."""
    code = (
        "import sys\n"
        "from kvgraft.cli import main\n"
        "try:\n"
        "    status = main(sys.argv[1:])\n"
        "except SystemExit as e:\n"
        "    status = e.code\n"
        f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "sys.stderr.write('HEAVY=' + ','.join(heavy) + '\\n')\n"
        "sys.exit(status)\n"
    )
    r = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    heavy = r.stderr.rsplit("HEAVY=", 1)[1].strip()
    return r.returncode, [m for m in heavy.split(",") if m], r.stdout + r.stderr


@pytest.mark.parametrize(
    "argv",
    [["--help"], ["keys", "generate", "--out", "k.pem"], ["--json", "keys", "generate", "--out", "k.pem"], ["ask", "--help"]],
    ids=["help", "keys-generate", "keys-generate-json", "ask-help"],
)
def test_commands_that_need_no_engine_do_not_import_torch(tmp_path: Path, argv: list[str]) -> None:
    code, heavy, output = _loaded_after(argv, tmp_path)
    assert code == 0, output
    assert heavy == [], f"kvgraft {' '.join(argv)} imported {heavy}"


def _package_sources() -> dict[str, Path]:
    """Installed package name -> its source folder (pyproject's package-dir), e.g. kvgraft.engine -> engine/."""
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: REPO / folder for name, folder in mapping.items()}


def _imports(path: Path, package: str) -> list[str]:
    """Every module ``path`` imports (module level or inside functions), relative imports resolved."""
    rel = path.relative_to(_package_sources()[package]).with_suffix("").parts
    # Relative imports start from the module's package (for __init__.py, the package itself).
    here = [*package.split("."), *rel][:-1]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names.append(module)
            names += [f"{module}.{a.name}" for a in node.names]
    return names


def _library_files() -> list[tuple[str, Path]]:
    """(package, file) for every source file of the distribution (not tests, scripts or bench)."""
    found = []
    sources = _package_sources()
    for package, folder in sources.items():
        nested = [f for name, f in sources.items() if name != package and f.is_relative_to(folder)]
        for path in sorted(folder.rglob("*.py")):
            if not any(path.is_relative_to(n) for n in nested):
                found.append((package, path))
    return found


def test_no_package_below_imports_the_cli() -> None:
    lower = ("kvgraft.schemas", "kvgraft.verifier", "kvgraft.engine", "kvgraft.registry", "kvgraft.web")
    bad = [
        f"{path.relative_to(REPO)} imports {name}"
        for package, path in _library_files() if package in lower
        for name in _imports(path, package) if name == "kvgraft.cli" or name.startswith("kvgraft.cli.")
    ]
    assert bad == []


def test_no_code_outside_a_package_imports_its_internal() -> None:
    packages = set(_package_sources())
    bad = []
    for package, path in _library_files():
        for name in _imports(path, package):
            if "._internal" not in name:
                continue
            owner = name.split("._internal")[0]
            if owner in packages and owner != package and not package.startswith(owner + "."):
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert bad == []
