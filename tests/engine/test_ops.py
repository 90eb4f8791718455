"""The graft path on tiny-llama-test: the one greedy decode loop (each of its stopping rules, EOS
kept or dropped), ``continue_from`` as the one restore-extend-decode, ``decode_batch`` and its
``KVBatch`` (many rows per forward pass, each at its own position), and the shifted restore
re-rotating every layer's keys with the graft kernels' RoPE reference (and the Triton kernel,
under ``TRITON_INTERPRET=1``, giving the same bits)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgraft.engine import (
    KVState,
    LoadedArtifact,
    LoadedModel,
    applied,
    capture,
    fresh,
    generate,
    graft,
    load_artifact,
    trust_signer,
)
from kvgraft.engine._internal.kvstate import KVBatch, _rotation
from kvgraft.engine._internal.ops import Decoded, DecodeJob, continue_from, decode_batch, greedy_decode
from kvgraft.engine.kernels import rerotate, rerotate_reference, triton_available
from kvgraft.schemas import DeterminismProfile

PROMPT = "Hello, world. The quick brown fox"


def _prompt(model: LoadedModel, profile: DeterminismProfile) -> tuple[KVState, torch.Tensor]:
    state = KVState(model)
    with applied(profile):
        logits = state.extend(model.tokenizer.encode(PROMPT, first=True), keep_last=1)
    return state, logits


def _decode(model: LoadedModel, profile: DeterminismProfile, **kwargs: Any) -> tuple[Decoded, int]:
    """Decode after PROMPT; also how many decoded tokens were run on the state."""
    state, logits = _prompt(model, profile)
    start = state.end
    with applied(profile):
        decoded = greedy_decode(state, logits, **kwargs)
    return decoded, state.end - start


@pytest.fixture()
def artifact(tiny: LoadedModel, profile: DeterminismProfile, key: Path, tmp_path: Path) -> LoadedArtifact:
    capture(tiny, profile, PROMPT, tmp_path / "a", key=key)
    return load_artifact(tmp_path / "a", tiny, profile, trusted=trust_signer(key))


def test_budget_ends_decoding_with_the_last_token_never_run(tiny: LoadedModel, profile: DeterminismProfile) -> None:
    # The budget's last token is kept but not run: nothing would read its logits.
    decoded, ran = _decode(tiny, profile, max_new_tokens=6, keep_eos=False)
    assert decoded.stopped_by == "max_new_tokens" and len(decoded.tokens) == 6 and ran == 5
    assert decoded.text == tiny.tokenizer.decode(decoded.tokens)
    none, ran = _decode(tiny, profile, max_new_tokens=0, keep_eos=False)
    assert (none.tokens, none.text, none.stopped_by, ran) == ([], "", "max_new_tokens", 0)


def test_eos_ends_decoding_kept_or_dropped(
    tiny: LoadedModel, profile: DeterminismProfile, monkeypatch: pytest.MonkeyPatch
) -> None:
    free, _ = _decode(tiny, profile, max_new_tokens=8, keep_eos=False)
    # The seeded model never says its EOS in 8 tokens: name its third token the EOS instead.
    monkeypatch.setattr(tiny.tokenizer, "eos_token_id", free.tokens[2])
    kept, ran_kept = _decode(tiny, profile, max_new_tokens=8, keep_eos=True)
    dropped, ran_dropped = _decode(tiny, profile, max_new_tokens=8, keep_eos=False)
    assert kept.stopped_by == dropped.stopped_by == "eos"
    assert kept.tokens == free.tokens[:3] and dropped.tokens == free.tokens[:2]
    assert ran_kept == ran_dropped == 2  # the EOS itself never runs
    assert dropped.text == tiny.tokenizer.decode(free.tokens[:2])


def test_stop_ends_decoding_on_the_text_so_far(tiny: LoadedModel, profile: DeterminismProfile) -> None:
    seen: list[str] = []

    def stop(text: str) -> bool:
        seen.append(text)
        return len(seen) == 3

    decoded, ran = _decode(tiny, profile, max_new_tokens=8, keep_eos=False, stop=stop)
    assert decoded.stopped_by == "stop" and len(decoded.tokens) == 3 and ran == 2
    assert seen[-1] == decoded.text


def test_window_ends_decoding_with_a_token_never_run(tiny: LoadedModel, profile: DeterminismProfile) -> None:
    # The same weights behind a 40-position window.
    small = dataclasses.replace(tiny, spec=dataclasses.replace(tiny.spec, window=40))
    state, logits = _prompt(small, profile)
    start = state.end
    with applied(profile):
        decoded = greedy_decode(state, logits, max_new_tokens=20, keep_eos=False)
    assert decoded.stopped_by == "window" and state.end == 40
    assert len(decoded.tokens) == 40 - start + 1


def test_continue_from_is_generate_and_the_library_decode(
    tiny: LoadedModel, profile: DeterminismProfile, artifact: LoadedArtifact
) -> None:
    ids = tiny.tokenizer.encode(" jumps", first=False)
    result = generate(tiny, profile, artifact, " jumps", 12)
    every_row = continue_from(tiny, profile, artifact, ids, max_new_tokens=12, keep_eos=True, keep_last=None)
    assert result["tokens"] == every_row.tokens and result["text"] == every_row.text
    # By hand: restore, extend, decode; and from an empty state, the prompt run whole.
    with applied(profile):
        state = KVState.restore(tiny, artifact.segments())
        by_hand = greedy_decode(state, state.extend(ids, keep_last=1), max_new_tokens=12, keep_eos=False)
        empty = KVState(tiny)
        whole = tiny.tokenizer.encode(PROMPT + " jumps", first=True)
        from_empty = greedy_decode(empty, empty.extend(whole, keep_last=1), max_new_tokens=12, keep_eos=False)
    assert continue_from(tiny, profile, artifact, ids, max_new_tokens=12, keep_eos=False) == by_hand
    assert continue_from(tiny, profile, None, whole, max_new_tokens=12, keep_eos=False) == from_empty


@pytest.mark.parametrize("shift", [3, -2, 517])
def test_shifted_restore_rerotates_keys_with_the_kernels_reference(
    tiny: LoadedModel,
    profile: DeterminismProfile,
    artifact: LoadedArtifact,
    shift: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    own = KVState.restore(tiny, artifact.segments())
    moved = KVState.restore(tiny, artifact.segments(), shift=shift)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for i, (a, b) in enumerate(zip(own.cache.layers, moved.cache.layers, strict=True)):
        cos, sin = _rotation(tiny, i, shift, a.keys)  # [1, 1, 1, d]
        assert torch.equal(b.keys, rerotate_reference(a.keys, cos, sin)) and torch.equal(b.values, a.values)
        # The formula with the model's [1, 1, 1, d] angles broadcast, as the engine wrote it before.
        half = a.keys.shape[-1] // 2
        assert torch.equal(b.keys, a.keys * cos + torch.cat([-a.keys[..., half:], a.keys[..., :half]], dim=-1) * sin)
        if triton_available():
            assert torch.equal(b.keys, rerotate(a.keys, cos, sin, backend="triton"))
    assert moved.shift == shift and moved.token_ids == own.token_ids


# --- many sequences per forward pass ---------------------------------------------------------------

_SUFFIXES = [" jumps over", " and then, after a long pause, the lazy dog", " sat", " ran to the river and back again twice"]


def _jobs(tiny: LoadedModel, artifact: LoadedArtifact, budget: int) -> list[DecodeJob]:
    # Rows of different lengths: grafted or from an empty state, short and long suffixes.
    return [DecodeJob(artifact if n % 2 == 0 else None, tiny.tokenizer.encode(text, first=n % 2 == 1), budget, keep_eos=False)
            for n, text in enumerate(_SUFFIXES)]


@pytest.mark.parametrize("batch", [1, 2, 3, 8])
def test_decode_batch_answers_as_continue_from_answers_each_row(
    tiny: LoadedModel, profile: DeterminismProfile, artifact: LoadedArtifact, batch: int
) -> None:
    jobs = _jobs(tiny, artifact, 10)
    alone = [continue_from(tiny, profile, j.artifact, j.suffix_ids, max_new_tokens=j.max_new_tokens, keep_eos=False) for j in jobs]
    got: dict[int, Decoded] = {}
    decode_batch(tiny, profile, jobs, batch=batch, on_done=lambda i, d: got.__setitem__(i, d))
    assert [got[i] for i in range(len(jobs))] == alone


def test_decode_batch_follows_each_rows_stop_rule(tiny: LoadedModel, profile: DeterminismProfile, artifact: LoadedArtifact) -> None:
    jobs = _jobs(tiny, artifact, 10)
    jobs[1] = dataclasses.replace(jobs[1], stop=lambda text: len(text) >= 3)
    jobs[2] = dataclasses.replace(jobs[2], max_new_tokens=1)
    order: list[int] = []
    got: dict[int, Decoded] = {}

    def done(i: int, d: Decoded) -> None:
        order.append(i)
        got[i] = d

    decode_batch(tiny, profile, jobs, batch=4, on_done=done)
    assert got[1].stopped_by == "stop" and len(got[1].text) >= 3
    assert got[2].stopped_by == "max_new_tokens" and len(got[2].tokens) == 1
    assert order[0] == 2  # its one-token budget ends it as it joins, before any batched step
    assert {got[0].stopped_by, got[3].stopped_by} == {"max_new_tokens"}


def test_kv_batch_runs_each_row_at_its_own_position(tiny: LoadedModel, profile: DeterminismProfile) -> None:
    texts = ["Hello", "Hello, world. The quick brown fox jumps", "A much longer text than the others, by far, it is"]
    with applied(profile):
        states = [KVState(tiny) for _ in texts]
        for s, t in zip(states, texts, strict=True):
            s.extend(tiny.tokenizer.encode(t, first=True))
        batch = KVBatch(tiny)
        for s in states:
            batch.add(s)
        assert batch.mask.shape == (3, max(s.end for s in states)) and batch.ends == [s.end for s in states]
        # Each row was written once, right-aligned after zeros, into a buffer with room: the
        # step appends in place.
        layer = batch.cache.layers[0]
        first = layer.keys.data_ptr()
        assert not layer.keys[0, :, : batch.mask.shape[1] - states[0].end].any()
        assert torch.equal(layer.keys[1, :, batch.mask.shape[1] - states[1].end:], states[1].cache.layers[0].keys[0])
        tokens = [5, 6, 7]
        together = batch.step(tokens)  # [3, vocab]
        assert layer.keys.data_ptr() == first, "the first step after the rows joined copied the batch's cache"
        alone = torch.cat([s.extend([t]) for s, t in zip(states, tokens, strict=True)])  # [3, vocab]
        torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
        # The longest row leaves: the columns only it held are dropped, the others run on.
        before = layer.keys[:2, :, batch.mask.shape[1] - states[1].end:].clone()
        batch.remove([2])
        assert batch.mask.shape == (2, states[1].end) and bool(batch.mask.all(dim=0).any())
        assert torch.equal(layer.keys, before)
        # The kept rows were written once into a buffer with room: the next step appends in place.
        kept = layer.keys.data_ptr()
        together = batch.step([8, 9])
        assert layer.keys.data_ptr() == kept, "the first step after rows left copied the batch's cache"
        alone = torch.cat([s.extend([t]) for s, t in zip(states[:2], [8, 9], strict=True)])
        torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)
        batch.remove([0, 1])
        assert len(batch) == 0 and batch.mask.shape == (0, 0)


def test_kv_batch_refuses_what_it_cannot_run(tiny: LoadedModel, profile: DeterminismProfile) -> None:
    from kvgraft.engine import ArtifactError, InputTextError, current_profile

    batch = KVBatch(tiny)
    with pytest.raises(ArtifactError, match="an empty state cannot join a batch"):
        batch.add(KVState(tiny))
    with applied(profile):
        state = KVState(tiny)
        state.extend(tiny.tokenizer.encode("Hello", first=True))
        batch.add(state)
        with pytest.raises(ArtifactError, match=r"2 tokens for a batch of 1 rows") as e:
            batch.step([1, 2])
        assert e.value.hint == "pass one token per row"
    with applied(current_profile("kv16")):
        half = KVState(tiny)
        half.extend(tiny.tokenizer.encode("Hello", first=True))
    with pytest.raises(ArtifactError, match=r"a state on cpu computing torch\.float32 and storing torch\.float16 cannot join "
                                            r"a batch on cpu computing torch\.float32 and storing torch\.float32") as e:
        batch.add(half)
    assert e.value.hint == "make the batch and its rows under the same profile"
    with pytest.raises(InputTextError, match="batched decoding needs an own-position profile"):
        decode_batch(tiny, current_profile("invariant"), [], batch=2, on_done=lambda i, d: None)
    with pytest.raises(InputTextError, match="batch 0 is not a positive number of rows"):
        decode_batch(tiny, profile, [], batch=0, on_done=lambda i, d: None)


def test_decode_batch_under_the_sdpa_profile_answers_as_each_row_alone(tiny: LoadedModel, artifact: LoadedArtifact) -> None:
    # The batch's padding mask goes through transformers' SDPA mask builder to the fast attention.
    from kvgraft.engine import current_profile

    sdpa = current_profile("sdpa")
    ids = [tiny.tokenizer.encode(text, first=True) for text in _SUFFIXES]
    jobs = [DecodeJob(None, i, 10, keep_eos=False) for i in ids]
    alone = [continue_from(tiny, sdpa, None, j.suffix_ids, max_new_tokens=10, keep_eos=False) for j in jobs]
    got: dict[int, Decoded] = {}
    decode_batch(tiny, sdpa, jobs, batch=4, on_done=lambda i, d: got.__setitem__(i, d))
    assert [got[i] for i in range(len(jobs))] == alone


def test_a_continuation_says_how_long_its_prefix_state_and_its_pass_took(
    tiny: LoadedModel, profile: DeterminismProfile, artifact: LoadedArtifact
) -> None:
    # bench/ttft.py reads where a graft's time went from here, not from a copy of its steps.
    grafted = graft(tiny, profile, artifact, " jumps over")
    recomputed = fresh(tiny, profile, PROMPT, " jumps over")
    for c in (grafted, recomputed):
        assert 0 < c.state_seconds < c.seconds
        assert c.pass_seconds == c.seconds - c.state_seconds > 0
    assert torch.equal(grafted.logits, recomputed.logits)
