"""Capture, graft and fresh on tiny-llama-test: own-position exactness, chains, byte-identical
captures across processes, and every kind of mismatched graft refused before the model runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvgraft.engine import (
    DEFAULT_PROFILE,
    ArtifactError,
    KVState,
    LoadedModel,
    ProfileMismatchError,
    UnknownProfileError,
    applied,
    capture,
    current_profile,
    fresh,
    graft,
    load_artifact,
    load_model,
    logits_digest,
    trust_signer,
)
from kvgraft.schemas import DeterminismProfile

PREFIXES = ["a", "Hello, world.", "The quick brown fox jumps over the lazy dog. " * 6, "ünïcödé ✓ " * 9]
CONTINUATIONS = [" x", " and then it rained for three days.", "!"]


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("continuation", CONTINUATIONS)
def test_graft_equals_fresh_bitwise(tiny: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path, prefix: str, continuation: str) -> None:
    capture(tiny, profile, prefix, tmp_path / "a", key=key)
    art = load_artifact(tmp_path / "a", tiny, profile, trusted=trust_signer(key))
    g = graft(tiny, profile, art, continuation)
    f = fresh(tiny, profile, prefix, continuation)
    assert torch.equal(g.logits, f.logits)
    assert g.summary()["logits_sha256"] == f.summary()["logits_sha256"]
    assert g.positions == f.positions == (len(art.statement.predicate.tokens.ids), len(art.statement.predicate.tokens.ids) + len(g.continuation_ids))


def test_graft_keep_last_gives_only_the_last_positions(tiny: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    capture(tiny, profile, "Hello, world.", tmp_path / "a", key=key)
    art = load_artifact(tmp_path / "a", tiny, profile, trusted=trust_signer(key))
    full = graft(tiny, profile, art, " and then it rained for three days.")
    last = graft(tiny, profile, art, " and then it rained for three days.", keep_last=1)
    assert last.logits.shape == (1, full.logits.shape[1])
    assert last.positions == full.positions
    # Only the lm head ran on fewer rows; its M=1 product may differ in the last bits, not the token.
    assert int(last.logits[0].argmax()) == int(full.logits[-1].argmax())
    assert torch.allclose(last.logits[0], full.logits[-1], atol=1e-4)
    with pytest.raises(ArtifactError, match="keep_last 99 is not within"):
        graft(tiny, profile, art, " x", keep_last=99)


def test_statement_fields(tiny: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    captured = capture(tiny, profile, "Hello", tmp_path / "a", key=key)
    p = captured.statement.predicate
    assert p.tokens.ids == [1, *(b + 3 for b in b"Hello")]
    assert (p.positions.start, p.positions.end) == (0, 6)
    assert p.parent is None and p.source_text.text == "Hello"
    assert p.profile == profile and p.model == tiny.ref
    assert sorted(x.name for x in (tmp_path / "a").iterdir()) == ["kv.safetensors", "statement.dsse.json"]


def test_chain_graft_equals_the_same_schedule_recomputed(tiny: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    capture(tiny, profile, "Instructions: answer briefly.\n", tmp_path / "root", key=key)
    root = load_artifact(tmp_path / "root", tiny, profile, trusted=trust_signer(key))
    capture(tiny, profile, "Q: 2+2?\nA:", tmp_path / "child", key=key, parent=root)
    child = load_artifact(tmp_path / "child", tiny, profile, trusted=trust_signer(key))
    assert child.statement.predicate.parent == root.kv_digest
    assert child.statement.predicate.positions.start == root.statement.predicate.positions.end
    g = graft(tiny, profile, child, " 4")
    with applied(profile):
        state = KVState(tiny)
        state.extend(tiny.tokenizer.encode("Instructions: answer briefly.\n", first=True))
        state.extend(tiny.tokenizer.encode("Q: 2+2?\nA:", first=False))
        expected = state.extend(tiny.tokenizer.encode(" 4", first=False))
    assert torch.equal(g.logits, expected)


def test_two_processes_capture_identical_bytes(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_text("Determinism is a feature. " * 5)
    digests = []
    for name in ("one", "two"):
        proc = subprocess.run(
            [sys.executable, "-m", "kvgraft", "--json", "capture", "--model", "tiny-llama-test", "--text-file", str(tmp_path / "t.txt"), "--out", str(tmp_path / name)],
            capture_output=True, text=True, env=os.environ.copy(), timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        digests.append(json.loads(proc.stdout)["kv_sha256"])
    assert digests[0] == digests[1]
    assert (tmp_path / "one" / "kv.safetensors").read_bytes() == (tmp_path / "two" / "kv.safetensors").read_bytes()


class _Counter:
    def __init__(self, model: LoadedModel) -> None:
        self.calls = 0
        self.handle = model.module.register_forward_pre_hook(self._hook)

    def _hook(self, *_: object) -> None:
        self.calls += 1


@pytest.fixture
def artifact(tiny: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path) -> Path:
    capture(tiny, profile, "A prefix worth keeping.", tmp_path / "a", key=key)
    return tmp_path / "a"


def _refused_without_running(tiny: LoadedModel, fn, error: type[Exception], match: str) -> None:  # type: ignore[no-untyped-def]
    counter = _Counter(tiny)
    try:
        with pytest.raises(error, match=match):
            fn()
    finally:
        counter.handle.remove()
    assert counter.calls == 0


def test_tampered_tensors_refused(tiny: LoadedModel, profile: DeterminismProfile, artifact: Path, key: Path) -> None:
    kv = artifact / "kv.safetensors"
    data = bytearray(kv.read_bytes())
    data[-3] ^= 0x01
    kv.write_bytes(bytes(data))
    _refused_without_running(tiny, lambda: graft(tiny, profile, load_artifact(artifact, tiny, profile, trusted=trust_signer(key)), " x"), ArtifactError, "has digest sha256:.* but the statement says")


def test_other_profile_refused_naming_fields(tiny: LoadedModel, profile: DeterminismProfile, artifact: Path, key: Path) -> None:
    other = profile.model_copy(update={"threads": profile.threads + 1, "attention_implementation": "sdpa"})
    _refused_without_running(tiny, lambda: load_artifact(artifact, tiny, other, trusted=trust_signer(key)), ProfileMismatchError,
                             r"profile\.threads: artifact 2, here 3; profile\.attention_implementation: artifact 'kvgraft_sdpa_gqa', here 'sdpa'")


def test_other_model_refused(tiny: LoadedModel, profile: DeterminismProfile, artifact: Path, key: Path) -> None:
    other = LoadedModel(tiny.spec, tiny.module, tiny.tokenizer, tiny.ref.model_copy(update={"weights_digest": "sha256:" + "0" * 64}), tiny.tokenizer_digest)
    _refused_without_running(tiny, lambda: load_artifact(artifact, other, profile, trusted=trust_signer(key)), ProfileMismatchError, r"model\.weights_digest: artifact sha256:")


def test_wrong_parent_refused(tiny: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    base = tmp_path / "chain"
    capture(tiny, profile, "parent one", base / "p1", key=key)
    capture(tiny, profile, " child", base / "c", key=key, parent=load_artifact(base / "p1", tiny, profile, trusted=trust_signer(key)))
    # Replace the parent with a different artifact under the same directory name.
    shutil.rmtree(base / "p1")
    capture(tiny, profile, "parent two", base / "p1", key=key)
    index = Path(os.environ["KVGRAFT_HOME"]) / "index"
    for entry in index.iterdir():
        if entry.read_text().strip() == str((base / "p1").resolve()):
            entry.unlink()
    _refused_without_running(tiny, lambda: load_artifact(base / "c", tiny, profile, trusted=trust_signer(key)), ArtifactError, "parent artifact sha256:.* was not found")


def test_shifted_graft_is_close_but_not_exact(tiny: LoadedModel, profile: DeterminismProfile, artifact: Path, key: Path) -> None:
    art = load_artifact(artifact, tiny, profile, trusted=trust_signer(key))
    exact = graft(tiny, profile, art, " and more")
    shifted = graft(tiny, profile, art, " and more", shift=3)
    assert logits_digest(exact.logits) != logits_digest(shifted.logits)
    assert (exact.logits.argmax(-1) == shifted.logits.argmax(-1)).float().mean() >= 0.5


def test_profile_context_restores_state() -> None:
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    p = current_profile().model_copy(update={"threads": 1})
    with applied(p):
        assert torch.get_num_threads() == 1 and torch.are_deterministic_algorithms_enabled()
    assert torch.get_num_threads() == threads and torch.are_deterministic_algorithms_enabled() == det


def test_tiny_model_is_the_same_every_time() -> None:
    assert load_model("tiny-llama-test").ref == load_model("tiny-llama-test").ref


# --- the half-size cache (cpu-fp32-kv16) ---------------------------------------------------------


@pytest.fixture(scope="module")
def kv16() -> DeterminismProfile:
    return current_profile("kv16")


@pytest.mark.parametrize("prefix", PREFIXES[1:3])
def test_kv16_graft_equals_fresh_bitwise_from_half_the_bytes(tiny: LoadedModel, profile: DeterminismProfile, kv16: DeterminismProfile,
                                                             key: Path, tmp_path: Path, prefix: str) -> None:
    assert kv16.name == "cpu-fp32-kv16" and kv16.dtype == "float32+kv-float16" and kv16.exactness == "own-position"
    capture(tiny, kv16, prefix, tmp_path / "h", key=key)
    capture(tiny, profile, prefix, tmp_path / "f", key=key)
    art = load_artifact(tmp_path / "h", tiny, kv16, trusted=trust_signer(key))
    assert {t.dtype for name, t in art.tensors.items()} == {torch.float16}
    f32 = load_artifact(tmp_path / "f", tiny, profile, trusted=trust_signer(key))
    assert 2 * sum(t.numel() * t.element_size() for t in art.tensors.values()) == sum(
        t.numel() * t.element_size() for t in f32.tensors.values())
    g = graft(tiny, kv16, art, " and then it rained for three days.")
    f = fresh(tiny, kv16, prefix, " and then it rained for three days.")
    assert torch.equal(g.logits, f.logits)
    # Rounding the cache moves the numbers (so it is a profile of its own), not the tokens here.
    exact = fresh(tiny, profile, prefix, " and then it rained for three days.")
    assert not torch.equal(f.logits, exact.logits) and torch.equal(f.logits.argmax(-1), exact.logits.argmax(-1))


def test_kv16_cache_holds_only_float16_values(tiny: LoadedModel, kv16: DeterminismProfile) -> None:
    with applied(kv16):
        state = KVState(tiny)
        state.extend(tiny.tokenizer.encode("Hello, world. The quick brown fox", first=True))
        state.extend(tiny.tokenizer.encode(" jumps", first=False))
    keys = state.cache.layers[0].keys
    assert keys is not None and keys.dtype == torch.float32 and torch.equal(keys, keys.half().float())
    assert state.export(0)["layers.0.keys"].dtype == torch.float16
    # Outside the profile a new state stores float32 again.
    assert KVState(tiny).kv_dtype == torch.float32


def test_kv16_artifact_refused_under_the_float32_profile(tiny: LoadedModel, profile: DeterminismProfile, kv16: DeterminismProfile,
                                                         key: Path, tmp_path: Path) -> None:
    capture(tiny, kv16, "Hello, world.", tmp_path / "h", key=key)
    with pytest.raises(ProfileMismatchError, match=rf"profile\.name: artifact 'cpu-fp32-kv16', here '{profile.name}'.*"
                       r"profile\.dtype: artifact 'float32\+kv-float16', here 'float32'") as e:
        load_artifact(tmp_path / "h", tiny, profile, trusted=trust_signer(key))
    # The hint names the profile to pass (the default changed in issue 16: an old artifact's likeliest refusal).
    assert e.value.hint == "pass --profile cpu-fp32-kv16, the profile the artifact was captured under"


def test_kv16_refuses_a_value_beyond_float16s_range(tiny: LoadedModel, kv16: DeterminismProfile,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # A key of 1e6 (float16 ends at 65504) would be stored as inf: refused, never written.
    layer = tiny.module.model.layers[0].self_attn.k_proj
    monkeypatch.setattr(layer.weight, "data", layer.weight.data * 1e7)
    with applied(kv16), pytest.raises(ArtifactError, match=r"a key or value of .* is beyond torch\.float16's range") as e:
        KVState(tiny).extend(tiny.tokenizer.encode("Hello", first=True))
    assert e.value.hint == "use a float32 profile (--profile cpu-fp32-sdpa) for this model"


def test_the_default_profile_is_the_fast_one_and_the_eager_one_is_kept() -> None:
    assert current_profile().name == current_profile("default").name == DEFAULT_PROFILE == "cpu-fp32-sdpa"
    assert current_profile("eager").attention_implementation == "eager"
    with pytest.raises(UnknownProfileError, match="no determinism profile named 'cpu-fp64'") as e:
        current_profile("cpu-fp64")
    assert e.value.hint == "use --profile cpu-fp32-sdpa (the default)"


# --- the fast profile (cpu-fp32-sdpa) ---------------------------------------------------------


def test_sdpa_graft_equals_fresh_bitwise_with_its_own_attention(tiny: LoadedModel, key: Path, tmp_path: Path) -> None:
    sdpa, profile = current_profile("sdpa"), current_profile("eager")
    assert sdpa.name == "cpu-fp32-sdpa" and sdpa.attention_implementation == "kvgraft_sdpa_gqa"
    assert profile.name == "cpu-fp32" and profile.attention_implementation == "eager"
    prefix, continuation = PREFIXES[2], " and then it rained for three days."
    capture(tiny, sdpa, prefix, tmp_path / "a", key=key)
    art = load_artifact(tmp_path / "a", tiny, sdpa, trusted=trust_signer(key))
    g = graft(tiny, sdpa, art, continuation)
    f = fresh(tiny, sdpa, prefix, continuation)
    assert torch.equal(g.logits, f.logits)
    # Another kernel than eager attention: other last bits, the same tokens; the model's config
    # names its own attention again after every pass.
    eager = fresh(tiny, profile, prefix, continuation)
    assert not torch.equal(f.logits, eager.logits) and torch.equal(f.logits.argmax(-1), eager.logits.argmax(-1))
    assert tiny.module.config._attn_implementation == "eager"
    with pytest.raises(ProfileMismatchError, match=r"profile\.attention_implementation: artifact 'kvgraft_sdpa_gqa', here 'eager'"):
        load_artifact(tmp_path / "a", tiny, profile, trusted=trust_signer(key))
