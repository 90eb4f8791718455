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


def test_packaging_regression_the_wheel_lacked_the_datasets(tmp_path: Path) -> None:
    # Was: data/datasets was not in the wheel, so 'kvgraft exactness' (which draws its texts from
    # gsm8k_test.jsonl and aime2025.jsonl) failed outside a checkout: "the sample texts ... are missing".
    import shutil
    import subprocess
    import sys
    import zipfile

    # Built from a copy of what the distribution is made of: setuptools builds in the source tree
    # (build/), which must not be left behind in the checkout, nor reused stale.
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", config["project"]["readme"]):
        shutil.copy(REPO / name, source / name)
    for folder in config["tool"]["setuptools"]["package-dir"].values():
        shutil.copytree(REPO / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True, capture_output=True, timeout=600, cwd=tmp_path,
    )
    (wheel,) = out.glob("kvgraft-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(p.name for p in (REPO / "data" / "datasets").iterdir() if p.is_file())
    assert {"gsm8k_test.jsonl", "aime2025.jsonl", "gsm8k.LICENSE"} <= set(shipped)
    missing = [n for n in shipped if f"kvgraft/data/datasets/{n}" not in names]
    assert not missing, f"the wheel lacks {missing}"
    # Installed, the engine finds them where a checkout has them: two levels above its module.
    module = "kvgraft/engine/_internal/exactness.py"
    assert module in names
    assert 'Path(__file__).resolve().parents[2] / "data" / "datasets"' in zipfile.ZipFile(wheel).read(module).decode()
    # The package says it is typed (PEP 561): a user's mypy reads its annotations.
    assert "kvgraft/py.typed" in names, "the wheel lacks kvgraft/py.typed"
