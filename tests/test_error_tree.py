"""One error tree: every exception class kvgraft defines is a ``kvgraft.KvgraftError``."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil

from kvgraft import KvgraftError
from kvgraft.cli import main

#: The installed packages live in separate source folders (pyproject's package-dir), so each is walked.
PACKAGES = ("kvgraft", "kvgraft.schemas", "kvgraft.verifier", "kvgraft.engine", "kvgraft.registry", "kvgraft.web")
#: Modules that import a package only their own venv has, by that package: the vLLM connector runs in
#: .venv-vllm (make vllm) and defines no exception class (kvgraft.integrations.vllm's errors module does).
OPTIONAL = {"kvgraft.integrations.vllm._internal.connector": "vllm"}


def _module_names() -> list[str]:
    names = []
    for package in PACKAGES:
        names.append(package)
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, prefix=package + "."):
            if info.name in OPTIONAL and importlib.util.find_spec(OPTIONAL[info.name]) is None:
                continue
            if not info.name.endswith("__main__") and not info.name.startswith(tuple(p + "." for p in PACKAGES[1:]) if package == "kvgraft" else ()):
                names.append(info.name)
    return names


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _module_names():
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__.startswith("kvgraft."):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return found


def test_every_exception_class_is_a_kvgraft_error() -> None:
    classes = _exception_classes()
    # The tree has a branch per package; if the walk found only a few, it did not look.
    assert len(classes) > 40, sorted(classes)
    outside = sorted(name for name, cls in classes.items() if not issubclass(cls, KvgraftError))
    assert outside == [], f"not under kvgraft.KvgraftError: {outside}"


def test_no_default_hint_says_see_the_message() -> None:
    lazy = [name for name, cls in _exception_classes().items() if "see the message" in str(getattr(cls, "default_hint", ""))]
    assert lazy == []


def test_str_is_one_line_with_the_hint() -> None:
    e = KvgraftError("the thing\nbroke", hint="do  this")
    assert str(e) == "the thing broke (hint: do this)"
    assert str(KvgraftError("no hint here")) == "no hint here"


def test_cli_reports_the_real_class_name_under_json(capsys) -> None:  # type: ignore[no-untyped-def]
    code = main(["--json", "keys", "trust", "--file", "/nonexistent/t.json", "--name", "x", "--public-key", "/nonexistent/key.pub"])
    out, err = capsys.readouterr()
    assert code == 1
    assert '"ok": false' in out and '"error": "' in out
    assert err.startswith("kvgraft: ") and err.count("\n") == 1
