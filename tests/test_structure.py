"""The shape of the code (issue 38): no module over 900 lines, no import circle inside ``registry/``,
and no code outside a package importing that package's ``_internal``.

Every check reads the sources with ``ast``; nothing is imported, so a circle that Python happens to
resolve (one side importing inside a function) still counts: it still means neither module can be
read, tested or moved without the other. Imports under ``if TYPE_CHECKING:`` never run and are left
out of the circle check only (a module may name a type from a module that imports it); the
``_internal`` check counts them too.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: The most lines one module may have; past it a module does more than one job.
MAX_LINES = 900



def _package_sources() -> dict[str, Path]:
    """Installed package name -> its source folder (pyproject's ``package-dir``), e.g. kvgraft.engine -> engine/."""
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: REPO / folder for name, folder in mapping.items()}


def _modules() -> dict[str, tuple[str, Path]]:
    """Dotted module name (e.g. ``kvgraft.registry._internal.storage.db``) -> (its package, its file), for
    every ``.py`` file of the distribution, each file under the innermost package folder holding it."""
    sources = _package_sources()
    found: dict[str, tuple[str, Path]] = {}
    for package, folder in sources.items():
        nested = [f for name, f in sources.items() if name != package and f.is_relative_to(folder)]
        for path in sorted(folder.rglob("*.py")):
            if any(path.is_relative_to(n) for n in nested):
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = (package, path)
    return found


def _is_type_checking(node: ast.If) -> bool:
    return (
        (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
        or (isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING")
    )


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` that runs: all of it but the bodies of ``if TYPE_CHECKING:`` (their
    ``else`` runs)."""
    found: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        if isinstance(node, ast.If) and _is_type_checking(node):
            todo += node.orelse
        else:
            todo += ast.iter_child_nodes(node)
    return found


def _imports(name: str, path: Path, known: set[str], *, runtime_only: bool = False) -> list[str]:
    """Every module ``name`` (at ``path``) imports, at module level or inside functions, relative
    imports resolved. ``from a import b`` counts as importing ``a.b`` when that is a module of
    ``known``, else ``a``. With ``runtime_only``, imports under ``if TYPE_CHECKING:`` are left out."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    tree = ast.parse(path.read_text(), str(path))
    for node in _runtime_nodes(tree) if runtime_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            for alias in node.names:
                found.append(f"{module}.{alias.name}" if f"{module}.{alias.name}" in known else module)
    return found


def test_no_module_is_over_max_lines() -> None:
    over = []
    for _, path in _modules().values():
        lines = len(path.read_text().splitlines())
        rel = path.relative_to(REPO).as_posix()
        if lines > MAX_LINES:
            over.append(f"{rel}: {lines} lines")
    assert over == [], f"modules over {MAX_LINES} lines (split them by job): {sorted(over)}"


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (or a module importing itself),
    each as a sorted list: Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return found


def _graph(package: str, *, runtime_only: bool) -> dict[str, set[str]]:
    """The import graph of ``package`` and every module under it, edges inside it only."""
    modules = _modules()
    known = set(modules)
    inside = {name for name in known if name == package or name.startswith(package + ".")}
    return {
        name: {target for target in _imports(name, modules[name][1], known, runtime_only=runtime_only) if target in inside}
        for name in sorted(inside)
    }


def test_no_import_circle_inside_registry() -> None:
    cycles = _cycles(_graph("kvgraft.registry", runtime_only=True))
    assert cycles == [], f"import circles inside registry/ (make the imports one-way): {cycles}"


def test_no_import_circle_inside_the_registry_service_not_even_through_types() -> None:
    # The service's wings name each other's types through protocols (reader.LogView,
    # cluster.LogFollower, cosignatures.CheckpointSource), never by importing upwards.
    cycles = _cycles(_graph("kvgraft.registry._internal", runtime_only=False))
    assert cycles == [], f"import circles inside registry/_internal/, type-only imports included: {cycles}"


def test_the_registry_service_wings_import_one_way() -> None:
    # A wing is a subpackage of registry/_internal (storage, log, blobs, http, witness) or one of
    # its top-level modules; imports between wings form no circle either (docs/architecture.md).
    internal = "kvgraft.registry._internal"
    wings: dict[str, set[str]] = {}
    for name, targets in _graph(internal, runtime_only=False).items():
        if name == internal:
            continue
        wing = name[len(internal) + 1 :].split(".")[0]
        wings.setdefault(wing, set())
        wings[wing] |= {t[len(internal) + 1 :].split(".")[0] for t in targets if t != internal} - {wing}
    assert {"storage", "log", "blobs", "http", "witness"} <= set(wings)
    cycles = _cycles({w: {t for t in ts if t in wings} for w, ts in wings.items()})
    assert cycles == [], f"wings of registry/_internal/ that import each other: {cycles}"


def test_the_cycle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"], ["e"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_code_outside_a_package_imports_its_internal() -> None:
    modules = _modules()
    known = set(modules)
    packages = set(_package_sources())
    bad = []
    for name, (package, path) in modules.items():
        for target in _imports(name, path, known):
            if "._internal" not in target:
                continue
            owner = target.split("._internal")[0]
            if owner in packages and owner != package and not package.startswith(owner + "."):
                bad.append(f"{path.relative_to(REPO)} imports {target}")
    assert bad == [], f"code outside a package imports its _internal (export it from the package's __init__.py): {bad}"
