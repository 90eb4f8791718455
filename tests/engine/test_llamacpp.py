"""The ``llamacpp-cpu`` profile: llama.cpp (llama-cpp-python's libllama, built by
scripts/setup_llama_cpp.sh) on the real GGUFs, its sequence state as kvgraft artifacts."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvgraft.engine import (
    ArtifactError,
    LlamaCppError,
    ProfileMismatchError,
    capture,
    current_profile,
    fresh,
    graft,
    load_artifact,
    load_model_for,
    read_kv_file,
    trust_signer,
)
from kvgraft.engine._internal import llamacpp
from kvgraft.engine._internal.kvstate import Segment
from kvgraft.engine._internal.ops import new_state, restored
from kvgraft.schemas import DeterminismProfile

pytest.importorskip("llama_cpp", reason="make install builds llama-cpp-python (scripts/setup_llama_cpp.sh)")

#: Texts in three languages (and scripts): a prefix and its continuation each.
TEXTS = [
    ("The harbour was quiet before dawn, and the fishermen checked their nets twice.", " Then the first boat"),
    ("El tren salió de Madrid a las ocho y llegó a Sevilla antes del mediodía.", " Los viajeros bajaron"),
    ("東京の朝はとても静かで、駅にはまだ人が少なかった。", "しかし、七時になると"),
]
MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]


@pytest.fixture(scope="module")
def lc() -> DeterminismProfile:
    return current_profile("llamacpp-cpu")


def test_the_profile_names_the_build_the_gguf_and_the_settings(lc: DeterminismProfile) -> None:
    assert lc.name == "llamacpp-cpu" and lc.device_kind == "llamacpp"
    assert "llama-cpp-python=0.3.36" in lc.device_fingerprint
    assert "libs-sha256=" in lc.device_fingerprint and "state=llama.cpp-seq-state" in lc.device_fingerprint
    assert lc.kernel_versions["llama.cpp.n_ubatch"] == "512" and lc.kernel_versions["llama.cpp.flash_attn"] == "true"
    assert lc.kernel_versions["llama.cpp.type_k"] == "f16"
    model = load_model_for("smollm2-135m", lc)
    assert model.ref.weights_digest == "sha256:" + str(model.spec.gguf_sha256)
    assert current_profile("llamacpp").name == "llamacpp-cpu"


@pytest.mark.parametrize("name", MODELS)
def test_graft_equals_fresh_bit_for_bit_in_three_languages(name: str, lc: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    model = load_model_for(name, lc)
    for i, (prefix, continuation) in enumerate(TEXTS):
        capture(model, lc, prefix, tmp_path / str(i), key=key)
        art = load_artifact(tmp_path / str(i), model, lc, trusted=trust_signer(key))
        g, f = graft(model, lc, art, continuation), fresh(model, lc, prefix, continuation)
        assert g.summary()["logits_sha256"] == f.summary()["logits_sha256"], (name, prefix)
        assert g.prefix_tokens == f.prefix_tokens and g.continuation_ids == f.continuation_ids


def test_gemma3_graft_equals_fresh_past_the_sliding_window(lc: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    model = load_model_for("gemma3-270m", lc)
    prefix = " ".join(f"Step {i}: the {['red', 'blue', 'green'][i % 3]} box moves left." for i in range(100))
    assert len(model.tokenizer.encode(prefix, first=True)) > 2 * 512  # past the window and the sliding cache's first size
    capture(model, lc, prefix, tmp_path / "a", key=key)
    tensors, _ = read_kv_file(tmp_path / "a" / "kv.safetensors")
    assert tensors["caches.1.positions"].shape[0] < tensors["caches.0.positions"].shape[0]  # the sliding cache holds its window
    art = load_artifact(tmp_path / "a", model, lc, trusted=trust_signer(key))
    assert graft(model, lc, art, " Step 100:").summary()["logits_sha256"] == fresh(model, lc, prefix, " Step 100:").summary()["logits_sha256"]


def test_the_artifact_holds_llama_cpps_cells_as_named_tensors(lc: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    model = load_model_for("qwen2.5-coder-0.5b", lc)
    captured = capture(model, lc, "def add(a, b):\n    return a + b\n", tmp_path / "a", key=key)
    tensors, _ = read_kv_file(tmp_path / "a" / "kv.safetensors")
    n = captured.statement.predicate.positions.end
    assert torch.equal(tensors["caches.0.positions"], torch.arange(n, dtype=torch.int32))
    shape = model.shapes[0]
    assert len([k for k in tensors if k.endswith(".keys")]) == shape.layers
    assert tensors["caches.0.layers.0.keys"].shape == (1, shape.kv_heads, n, shape.key_dim)
    assert tensors["caches.0.layers.0.keys"].dtype == torch.float16


def test_the_state_codec_writes_back_llama_cpps_own_bytes(lc: DeterminismProfile) -> None:
    for name in ("smollm2-135m", "gemma3-270m"):
        model = load_model_for(name, lc)
        state = new_state(model)
        state.extend(model.tokenizer.encode("A short state to read and write back.", first=True), keep_last=1)
        raw = state.raw_state()
        state.close()
        assert llamacpp.encode_state(llamacpp.decode_state(raw, model.n_caches), int.from_bytes(raw[4:8], "little")) == raw


def test_a_changed_byte_is_refused(lc: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    model = load_model_for("smollm2-135m", lc)
    capture(model, lc, TEXTS[0][0], tmp_path / "a", key=key)
    kv = tmp_path / "a" / "kv.safetensors"
    data = bytearray(kv.read_bytes())
    data[-3] ^= 0x01
    kv.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="has digest .* but the statement says"):
        load_artifact(tmp_path / "a", model, lc, trusted=trust_signer(key))


def test_an_artifact_of_another_profile_is_refused(lc: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    """Captured by the torch engine (the default profile) on the same GGUF: refused under llamacpp-cpu."""
    from kvgraft.engine import load_model

    default = current_profile()
    capture(load_model("smollm2-135m"), default, TEXTS[0][0], tmp_path / "a", key=key)
    with pytest.raises(ProfileMismatchError, match="profile.name: artifact 'cpu-fp32-sdpa', here 'llamacpp-cpu'"):
        load_artifact(tmp_path / "a", load_model_for("smollm2-135m", lc), lc, trusted=trust_signer(key))


def test_an_artifact_of_another_gguf_is_refused(lc: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    capture(load_model_for("qwen2.5-coder-0.5b", lc), lc, TEXTS[0][0], tmp_path / "a", key=key)
    with pytest.raises(ProfileMismatchError, match="model.weights_digest"):
        load_artifact(tmp_path / "a", load_model_for("smollm2-135m", lc), lc, trusted=trust_signer(key))


def test_a_restore_llama_cpp_refuses_leaves_the_sequence_empty(lc: DeterminismProfile) -> None:
    model = load_model_for("smollm2-135m", lc)
    state = new_state(model)
    state.extend(model.tokenizer.encode("Nothing of this may be left behind.", first=True), keep_last=1)
    raw = state.raw_state()
    state.close()
    seq = model.acquire()
    try:
        with pytest.raises(LlamaCppError, match="did not restore the state .* left empty"):
            model.set_seq_state(seq, raw[:-64], (0, 8))  # cut short: llama.cpp stops mid-layer
        lib = llamacpp.lib()
        assert lib.llama_memory_seq_pos_max(lib.llama_get_memory(model._ctx), seq) == -1
    finally:
        model.release(seq)


def test_a_tensor_of_the_wrong_shape_is_refused_before_llama_cpp_reads_it(lc: DeterminismProfile) -> None:
    model = load_model_for("smollm2-135m", lc)
    state = new_state(model)
    ids = model.tokenizer.encode("Shapes are checked first.", first=True)
    state.extend(ids, keep_last=1)
    tensors = state.export(0)
    state.close()
    tensors["caches.0.layers.3.values"] = tensors["caches.0.layers.3.values"][:, :, :-1]
    with pytest.raises(ArtifactError, match=r"caches.0.layers.3.values has shape .* needs \[1, 3, \d+, 64\]"):
        restored(model, [Segment(tensors, 0, len(ids), tuple(ids))])
    assert model.acquire() == 0  # every sequence was given back
    model.release(0)


def test_single_pass_is_not_schedule_invariant_under_llama_cpp(lc: DeterminismProfile) -> None:
    """Own-position exact only: prefix and continuation in one call run other ubatch shapes."""
    model = load_model_for("qwen2.5-coder-0.5b", lc)
    prefix = model.tokenizer.encode(" ".join(["the quick brown fox jumps over the lazy dog"] * 80), first=True)
    cont = model.tokenizer.encode(" and then it rested", first=False)
    two = new_state(model)
    two.extend(prefix, keep_last=1)
    separate = two.extend(cont)
    two.close()
    one = new_state(model)
    together = one.extend(prefix + cont)[-len(cont):]
    one.close()
    assert not torch.equal(separate, together)
    assert float((separate - together).abs().max()) < 5.0


def test_cli_graft_and_fresh_agree_and_refuse_another_profile(key: Path, tmp_path: Path) -> None:
    (tmp_path / "p.txt").write_text(TEXTS[1][0], encoding="utf-8")
    (tmp_path / "c.txt").write_text(TEXTS[1][1], encoding="utf-8")

    def kvgraft(*args: str) -> dict[str, object]:
        out = subprocess.run([sys.executable, "-m", "kvgraft", "--json", *args], capture_output=True, text=True, timeout=300)
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    cap = kvgraft("capture", "--model", "smollm2-135m", "--profile", "llamacpp-cpu", "--text-file", str(tmp_path / "p.txt"),
                  "--out", str(tmp_path / "a"), "--key", str(key))
    assert cap["ok"] is True
    g = kvgraft("graft", "--profile", "llamacpp-cpu", "--trusted-keys", str(_trusted(key, tmp_path)), "--artifact", str(tmp_path / "a"),
                "--text-file", str(tmp_path / "c.txt"))
    f = kvgraft("fresh", "--model", "smollm2-135m", "--profile", "llamacpp-cpu", "--prefix-file", str(tmp_path / "p.txt"),
                "--text-file", str(tmp_path / "c.txt"))
    assert g.get("logits_sha256") == f["logits_sha256"] and len(str(f["logits_sha256"])) == 64, (g, f)
    other = kvgraft("graft", "--trusted-keys", str(_trusted(key, tmp_path)), "--artifact", str(tmp_path / "a"),
                    "--text-file", str(tmp_path / "c.txt"))
    assert other["ok"] is False and other["error"] == "ProfileMismatchError"
    assert "pass --profile llamacpp-cpu" in str(other["message"])


def _trusted(key: Path, tmp_path: Path) -> Path:
    """A trusted-keys file holding ``key``'s public key (written by ``kvgraft keys trust``)."""
    path = tmp_path / "trusted.json"
    if not path.exists():
        subprocess.run([sys.executable, "-m", "kvgraft", "keys", "trust", "--file", str(path), "--name", "test",
                        "--public-key", str(key.with_name("k.pem.pub"))], check=True, capture_output=True, timeout=60)
    return path


def test_decode_state_refuses_bytes_past_the_last_cache() -> None:
    cache = llamacpp._Cache(np.arange(2, dtype=np.int32), [np.zeros((2, 4), dtype=np.float16)], [np.ones((2, 4), dtype=np.float16)])
    data = llamacpp.encode_state([cache], 3)
    assert llamacpp.encode_state(llamacpp.decode_state(data, 1), 3) == data
    with pytest.raises(ArtifactError, match="2 bytes past its last cache"):
        llamacpp.decode_state(data + b"\0\0", 1)
    with pytest.raises(ArtifactError, match="ends early"):
        llamacpp.decode_state(data[:-1], 1)
    with pytest.raises(ArtifactError, match="not a llama.cpp sequence state"):
        llamacpp.decode_state(b"\0" * 8 + data[8:], 1)


def test_engine_serve_decodes_concurrent_base_answers_together(tmp_path: Path) -> None:
    """engine serve under llamacpp-cpu, no library: 6 clients at once all get a base answer (the
    worker decodes the waiting ones together; a batched row's numbers are not an exactness claim,
    so the texts are not compared with a lone run's)."""
    import concurrent.futures

    import httpx

    from tests.engine.test_engine_serve import EngineServer
    server = EngineServer(tmp_path / "serve.log", "--model", "smollm2-135m", "--profile", "llamacpp-cpu")
    try:
        server.wait_ready(timeout=300)
        questions = [f"Once upon a time, in a {place}, there lived a" for place in
                     ("small house by the sea", "castle on a hill", "small house by the sea", "forest", "busy city", "desert")]

        def ask(q: str) -> dict[str, object]:
            r = httpx.post(f"{server.url}/v1/completions", timeout=300,
                           json={"model": "smollm2-135m", "prompt": q, "max_tokens": 12, "temperature": 0})
            assert r.status_code == 200, r.text
            return dict(r.json())

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, questions))
        for a in answers:
            prov = dict(a["kvgraft"])  # type: ignore[arg-type]
            assert prov["kind"] == "unassisted" and prov["method"] == "none"
            assert int(dict(a["usage"])["completion_tokens"]) > 0  # type: ignore[arg-type]
        texts = [list(a["choices"])[0]["text"] for a in answers]  # type: ignore[call-overload]
        assert all(texts)
    finally:
        server.stop()


def test_engine_serve_on_llamacpp_regression_a_request_waited_for_the_whole_batch(tmp_path: Path) -> None:
    """Was: a request that arrived while others decoded waited until the whole batch ended. Now
    it joins the running llama.cpp batch at the next step (continuous batching) and is answered
    when its own decode ends: a short request sent while a long one streams finishes first, and
    the long one, streamed to the end, is whole."""
    import threading

    import httpx

    from tests.engine.test_engine_serve import EngineServer
    server = EngineServer(tmp_path / "serve.log", "--model", "smollm2-135m", "--profile", "llamacpp-cpu")
    try:
        server.wait_ready(timeout=300)
        finished: dict[str, float] = {}
        long_text: list[str] = []
        streaming = threading.Event()

        def long() -> None:
            body = {"model": "smollm2-135m", "prompt": "Once upon a time, in a small house by the sea, there lived", "max_tokens": 400,
                    "temperature": 0, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        streaming.set()
                        long_text.append(line)
            finished["long"] = time.monotonic()

        t = threading.Thread(target=long)
        t.start()
        assert streaming.wait(120), "the long request never streamed"
        short = httpx.post(f"{server.url}/v1/completions", timeout=300,
                           json={"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
        finished["short"] = time.monotonic()
        t.join(300)
        assert short.status_code == 200 and int(short.json()["usage"]["completion_tokens"]) >= 1
        assert "long" in finished and finished["short"] < finished["long"], finished
        assert len(long_text) > 20  # the long answer went on decoding after the short one joined and left
    finally:
        server.stop()
