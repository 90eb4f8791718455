"""The real bundled models, with short texts: graft equals fresh bit for bit on SmolLM2-135M,
Gemma 3 270M (including a prefix past Gemma's 512-token sliding window) and Qwen2.5-Coder-0.5B
(QKV bias, untied head), captures are byte-identical across processes, and an artifact is
refused by another model.

The first run converts each GGUF once (20-150 s) into the test cache; later runs reuse it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvgraft.engine import (
    KVState,
    LoadedModel,
    ProfileMismatchError,
    applied,
    capture,
    fresh,
    graft,
    load_artifact,
    load_model,
    trust_signer,
)
from kvgraft.schemas import DeterminismProfile
from tests.engine.cpu_support import bf16_runs_here

pytestmark = pytest.mark.slow

GSM8K = Path(__file__).resolve().parents[2] / "data" / "datasets" / "gsm8k_test.jsonl"


@pytest.fixture(scope="module")
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m")


@pytest.fixture(scope="module")
def gemma3() -> LoadedModel:
    return load_model("gemma3-270m")


@pytest.fixture(scope="module")
def qwen25() -> LoadedModel:
    return load_model("qwen2.5-coder-0.5b")


def _text_of_tokens(model: LoadedModel, n: int) -> str:
    text = ""
    for line in GSM8K.read_text().splitlines():
        row = json.loads(line)
        text += f"Question: {row['question']}\nAnswer: {row['answer']}\n\n"
        ids = model.tokenizer.encode(text, first=True)
        if len(ids) >= n:
            return model.tokenizer.decode(ids[:n])
    raise AssertionError("not enough text")


def _exact(model: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path, prefix: str, continuation: str) -> int:
    capture(model, profile, prefix, tmp_path / "a", key=key)
    art = load_artifact(tmp_path / "a", model, profile, trusted=trust_signer(key))
    g = graft(model, profile, art, continuation)
    f = fresh(model, profile, prefix, continuation)
    assert torch.equal(g.logits, f.logits), "graft and fresh logits differ"
    assert g.summary()["logits_sha256"] == f.summary()["logits_sha256"]
    return art.statement.predicate.positions.end


def test_smollm2_graft_equals_fresh(smollm2: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    end = _exact(smollm2, profile, key, tmp_path, _text_of_tokens(smollm2, 48), " Natalia sold 48/2 = 24 clips in May.")
    assert end >= 40


def test_gemma3_graft_equals_fresh_short(gemma3: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    _exact(gemma3, profile, key, tmp_path, "The capital of France is", " Paris, and the capital of Italy is Rome.")


def test_gemma3_graft_equals_fresh_past_the_sliding_window(gemma3: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    assert gemma3.sliding_window == 512
    end = _exact(gemma3, profile, key, tmp_path, _text_of_tokens(gemma3, 560), "\n\nQuestion: How many apples")
    assert end > 512
    art = load_artifact(tmp_path / "a", gemma3, profile, trusted=trust_signer(key))
    # Sliding layers hold only their window, and say how many tokens they have seen.
    sliding = [i for i, t in enumerate(gemma3.module.config.layer_types) if t == "sliding_attention"]
    assert art.tensors[f"layers.{sliding[0]}.keys"].shape[-2] == 511
    assert int(art.tensors[f"layers.{sliding[0]}.seen"][0]) == end


def test_artifact_refused_by_the_other_model(smollm2: LoadedModel, gemma3: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    capture(smollm2, profile, "Hello there.", tmp_path / "a", key=key)
    with pytest.raises(ProfileMismatchError, match=r"model\.name: artifact smollm2-135m, here gemma3-270m;.*tokenizer_digest"):
        load_artifact(tmp_path / "a", gemma3, profile, trusted=trust_signer(key))


def test_smollm2_two_processes_capture_identical_bytes(smollm2: LoadedModel, tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("A worked solution: 3 + 4 = 7, so the answer is 7.")
    digests = []
    for name in ("one", "two"):
        proc = subprocess.run(
            [sys.executable, "-m", "kvgraft", "--json", "capture", "--model", "smollm2-135m", "--text-file", str(tmp_path / "t.txt"), "--out", str(tmp_path / name)],
            capture_output=True, text=True, env=os.environ.copy(), timeout=600,
        )
        assert proc.returncode == 0, proc.stderr
        digests.append(json.loads(proc.stdout)["kv_sha256"])
    assert digests[0] == digests[1]


def test_qwen25_coder_is_qwen2_as_its_gguf_says(qwen25: LoadedModel) -> None:
    config = qwen25.module.config
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == ("qwen2", 24, 14, 2)
    assert config.rope_parameters["rope_theta"] == 1_000_000.0  # the GGUF's qwen2.rope.freq_base
    # Its own lm head (the GGUF holds output.weight), not the embeddings.
    assert config.tie_word_embeddings is False
    assert qwen25.module.lm_head.weight.data_ptr() != qwen25.module.model.embed_tokens.weight.data_ptr()
    attention = qwen25.module.model.layers[0].self_attn
    assert all(getattr(attention, p).bias is not None for p in ("q_proj", "k_proj", "v_proj")) and attention.o_proj.bias is None
    assert qwen25.sliding_window is None


def test_qwen25_coder_graft_equals_fresh(qwen25: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    end = _exact(qwen25, profile, key, tmp_path, _text_of_tokens(qwen25, 48), " Natalia sold 48/2 = 24 clips in May.")
    assert end >= 40
    art = load_artifact(tmp_path / "a", qwen25, profile, trusted=trust_signer(key))
    # Every layer's own positions, two KV heads of 64.
    assert art.tensors["layers.23.keys"].shape == (1, 2, end, 64)


def test_qwen25_coder_chain_graft_equals_the_same_schedule_recomputed(qwen25: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    # A child captured on its parent: each link is its own forward pass, so the recomputation is too.
    parent_text, child_text, continuation = "def add(a, b):\n", "    return a + b\n", "\nprint(add(2, 3))"
    trusted = trust_signer(key)
    capture(qwen25, profile, parent_text, tmp_path / "parent", key=key)
    parent = load_artifact(tmp_path / "parent", qwen25, profile, trusted=trusted)
    capture(qwen25, profile, child_text, tmp_path / "child", key=key, parent=parent)
    child = load_artifact(tmp_path / "child", qwen25, profile, trusted=trusted)
    assert child.statement.predicate.positions.start == parent.statement.predicate.positions.end
    g = graft(qwen25, profile, child, continuation)
    with applied(profile):
        state = KVState(qwen25)
        state.extend(qwen25.tokenizer.encode(parent_text, first=True))
        state.extend(qwen25.tokenizer.encode(child_text, first=False))
        expected = state.extend(qwen25.tokenizer.encode(continuation, first=False))
    assert torch.equal(g.logits, expected)


def test_qwen25_coder_artifact_refused_by_smollm2(qwen25: LoadedModel, smollm2: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    capture(qwen25, profile, "def add(a, b):", tmp_path / "a", key=key)
    with pytest.raises(ProfileMismatchError, match=r"model\.name: artifact qwen2\.5-coder-0\.5b, here smollm2-135m;.*tokenizer_digest"):
        load_artifact(tmp_path / "a", smollm2, profile, trusted=trust_signer(key))


def test_gemma3_cannot_decode_in_a_batch(gemma3: LoadedModel) -> None:
    # Its sliding layers would count a row's left padding as positions seen.
    from kvgraft.engine import ArtifactError
    from kvgraft.engine._internal.kvstate import KVBatch

    with pytest.raises(ArtifactError, match="gemma3-270m has sliding-window layers, which cannot hold left-padded rows") as e:
        KVBatch(gemma3)
    assert e.value.hint == "decode it one problem at a time (batch 1)"


@pytest.mark.parametrize("name", ["kv16", "sdpa-kv16"])
def test_kv16_graft_equals_fresh_on_smollm2_and_past_gemma3s_sliding_window(
    smollm2: LoadedModel, gemma3: LoadedModel, key: Path, tmp_path: Path, name: str
) -> None:
    from kvgraft.engine import current_profile

    kv16 = current_profile(name)
    _exact(smollm2, kv16, key, tmp_path / "s", "The capital of France is", " Paris, and the capital of Italy is Rome.")
    # Gemma 3's sliding layers round as they enter too, and their held window is what is stored.
    assert _exact(gemma3, kv16, key, tmp_path / "g", _text_of_tokens(gemma3, 560), "\n\nQuestion: How many apples") == 560



def test_bf16_graft_equals_fresh_on_smollm2_and_past_gemma3s_sliding_window(key: Path, tmp_path: Path) -> None:
    from kvgraft.engine import current_profile

    if not bf16_runs_here("cpu-bf16-sdpa"):
        return  # an AVX2-only CPU: the profile was refused by name instead
    bf16 = current_profile("bf16")
    # Models of their own: the profile rounds the loaded weights to bfloat16 in place, which the
    # session's float32 models must not see.
    smollm2, gemma3 = load_model("smollm2-135m"), load_model("gemma3-270m")
    _exact(smollm2, bf16, key, tmp_path / "s", _text_of_tokens(smollm2, 300), "\n\nQuestion: How many apples")
    assert _exact(gemma3, bf16, key, tmp_path / "g", _text_of_tokens(gemma3, 560), "\n\nQuestion: How many apples") == 560
    assert next(smollm2.module.parameters()).dtype == torch.bfloat16
    # The artifact is half the float32 profile's: bfloat16 keys and values.
    art = load_artifact(tmp_path / "s" / "a", smollm2, bf16, trusted=trust_signer(key))
    assert {t.dtype for n, t in art.segments()[-1].tensors.items() if n.endswith(("keys", "values"))} == {torch.bfloat16}

def test_sdpa_graft_equals_fresh_on_smollm2_and_past_gemma3s_sliding_window(
    smollm2: LoadedModel, gemma3: LoadedModel, key: Path, tmp_path: Path
) -> None:
    from kvgraft.engine import current_profile

    sdpa = current_profile("sdpa")
    _exact(smollm2, sdpa, key, tmp_path / "s", _text_of_tokens(smollm2, 300), "\n\nQuestion: How many apples")
    assert _exact(gemma3, sdpa, key, tmp_path / "g", _text_of_tokens(gemma3, 560), "\n\nQuestion: How many apples") == 560
