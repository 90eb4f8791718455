"""Schedule-invariant exactness, bit for bit (``torch.equal`` on float32 logits).

Under ``cpu-fp32-invariant`` the logits of a token at a position do not depend on the schedule:
a graft plus its continuation equals one single-pass prefill for a split at every tile and key
block boundary and one either side; chunked prefill (1, 7, 16, 64 tokens, whole) equals the
single pass; one and two threads give the same bits; a request alone equals the same request in
a batch of four different ones; greedy decoding token by token equals the prefill's logits. The
negative control shows that under ``cpu-fp32`` the same comparisons differ, so the tests can fail.

Broad on ``tiny-llama-test``; short texts on SmolLM2-135M and Gemma 3 270M (plus one Gemma
graft across its 512-token sliding window).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvgraft.engine import (
    KVState,
    LoadedModel,
    Segment,
    UnknownProfileError,
    applied,
    capture,
    current_profile,
    graft,
    load_artifact,
    load_model,
    logits_digest,
    trust_signer,
)
from kvgraft.engine._internal import invariant
from kvgraft.engine._internal.kernel_errors import ScheduleError
from kvgraft.engine._internal.schedules import prefill, single_pass
from kvgraft.schemas import DeterminismProfile

GSM8K = Path(__file__).resolve().parents[2] / "data" / "datasets" / "gsm8k_test.jsonl"
INVARIANT = "cpu-fp32-invariant"
SETTINGS = invariant.InvariantSettings()


def _text(offset: int) -> str:
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()[offset:offset + 4]]
    return "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows)


def _boundaries(n: int) -> list[int]:
    """Split points at every tile (16) and key block (64) boundary, and one either side."""
    edges = range(min(SETTINGS.tile, SETTINGS.key_block), n, min(SETTINGS.tile, SETTINGS.key_block))
    return sorted({e + d for e in edges for d in (-1, 0, 1) if 0 < e + d < n})


@dataclass
class Case:
    """A model, a request's token ids, three other requests, and the single-pass logits."""

    model: LoadedModel
    ids: list[int]
    others: list[list[int]]
    reference: torch.Tensor  # invariant single pass, [len(ids), vocab]
    #: How many leading tokens the (expensive) chunk-size-1 schedule covers.
    per_token: int
    decode_prompt: int
    decode_steps: int


#: Tokens per model: (text, chunk-size-1 prefix, decode prompt, decode steps). Broad on tiny,
#: short on the real models (the CPU is shared); 70 tokens cross the first 64-key block.
_SIZES = {"tiny-llama-test": (150, 150, 60, 24), "smollm2-135m": (70, 24, 40, 8), "gemma3-270m": (70, 20, 40, 6),
          "qwen2.5-coder-0.5b": (70, 12, 40, 4)}


@pytest.fixture(scope="module")
def inv() -> DeterminismProfile:
    """The schedule-invariant profile on this machine."""
    return current_profile(INVARIANT)


@pytest.fixture(scope="module", params=[
    "tiny-llama-test",
    pytest.param("smollm2-135m", marks=pytest.mark.slow),
    pytest.param("gemma3-270m", marks=pytest.mark.slow),
    pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow),
])
def case(request: pytest.FixtureRequest, inv: DeterminismProfile) -> Case:
    model = load_model(request.param)
    n, per_token, prompt, steps = _SIZES[request.param]
    ids = model.tokenizer.encode(_text(0), first=True)[:n]
    others = [model.tokenizer.encode(_text(k), first=True)[:m] for k, m in ((7, n - 9), (13, n + 5), (21, 12))]
    assert len(ids) == n and len(others[1]) == n + 5
    with applied(inv):
        reference = KVState(model).extend(ids)
    return Case(model, ids, others, reference, per_token, prompt, steps)


def _grafted(model: LoadedModel, profile: DeterminismProfile, ids: list[int], splits: list[int], length: int | None = None) -> dict[int, torch.Tensor]:
    """For each split ``s``: the state after ``ids[:s]`` exported as artifact tensors, restored
    into a fresh state, and a continuation (``length`` tokens, or the rest) run on it in one
    pass; that continuation's logits."""
    out: dict[int, torch.Tensor] = {}
    with applied(profile):
        state, done = KVState(model), 0
        for s in splits:
            state.extend(ids[done:s], keep_last=1)
            done = s
            restored = KVState.restore(model, [Segment(state.export(0), 0, s, tuple(ids[:s]))])
            out[s] = restored.extend(ids[s:s + length] if length else ids[s:])
    return out


def _greedy(model: LoadedModel, profile: DeterminismProfile, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    """Greedy decoding one token per forward pass: the tokens and the logits that chose them."""
    with applied(profile):
        state = KVState(model)
        rows = [state.extend(prompt, keep_last=1)]
        tokens: list[int] = []
        for _ in range(steps):
            tokens.append(int(rows[-1][-1].argmax()))
            rows.append(state.extend([tokens[-1]]))
    return tokens, torch.cat(rows)  # [steps + 1, vocab]


# --- the matrix, on every model ------------------------------------------------------------------


def test_graft_at_every_block_boundary_equals_single_pass(case: Case, inv: DeterminismProfile) -> None:
    splits = _boundaries(len(case.ids))
    assert {15, 16, 17, 63, 64, 65} <= set(splits)
    # The rest of the text on tiny; a 12-token continuation on the real models.
    length = None if case.model.spec.name == "tiny-llama-test" else 12
    for s, logits in _grafted(case.model, inv, case.ids, splits, length).items():
        assert torch.equal(logits, case.reference[s:s + length] if length else case.reference[s:]), f"graft at {s} differs"


@pytest.mark.parametrize("chunk", [1, 7, 16, 64, None])
def test_chunked_prefill_equals_single_pass(case: Case, inv: DeterminismProfile, chunk: int | None) -> None:
    # Chunk size 1 is one forward pass per token: on the real models it covers the first tokens
    # (a causal prefix's logits are the same rows of the single pass).
    n = case.per_token if chunk == 1 else len(case.ids)
    with applied(inv):
        logits = KVState(case.model).extend(case.ids[:n], chunk=chunk)
    assert torch.equal(logits, case.reference[:n])


def test_one_and_two_threads_give_the_same_bits(case: Case, inv: DeterminismProfile) -> None:
    assert inv.threads == 2
    with applied(inv.model_copy(update={"threads": 1})):
        assert torch.get_num_threads() == 1
        logits = KVState(case.model).extend(case.ids)
    assert torch.equal(logits, case.reference)


def test_request_alone_equals_the_same_request_in_a_batch_of_four(case: Case, inv: DeterminismProfile) -> None:
    # Requests of different lengths (shorter and longer than this one), right-padded.
    n = case.decode_prompt
    others = [case.others[0][:n - 9], case.others[1][:n + 5], case.others[2]]
    with applied(inv):
        batch = prefill(case.model, [others[0], case.ids[:n], others[1], others[2]])
        (alone,) = prefill(case.model, [case.ids[:n]])
    assert torch.equal(batch[1], case.reference[:n])
    assert torch.equal(alone, case.reference[:n])
    # The batch's other rows are themselves their single passes (no row leaks into another).
    with applied(inv):
        assert torch.equal(batch[3], KVState(case.model).extend(others[2]))


def test_greedy_decode_token_by_token_equals_prefill(case: Case, inv: DeterminismProfile) -> None:
    prompt = case.ids[:case.decode_prompt]
    tokens, decoded = _greedy(case.model, inv, prompt, case.decode_steps)
    with applied(inv):
        prefilled = KVState(case.model).extend(prompt + tokens, keep_last=len(tokens) + 1)
    # Position prompt-1 .. prompt+steps-1: the prefill computes the decoded tokens' rows too.
    assert torch.equal(decoded, prefilled)


def test_negative_control_the_default_profile_differs(case: Case) -> None:
    default = current_profile("cpu-fp32")
    n = len(case.ids)
    with applied(default):
        reference = KVState(case.model).extend(case.ids)
    # The same comparisons as above, under kernels that pick their path by the row count.
    (late,) = _grafted(case.model, default, case.ids, [n - 1]).values()
    prompt = case.ids[:case.decode_prompt]
    tokens, decoded = _greedy(case.model, default, prompt, 4)
    with applied(default):
        prefilled = KVState(case.model).extend(prompt + tokens, keep_last=len(tokens) + 1)
    assert not torch.equal(late, reference[n - 1:]), "default-profile graft with a one-token continuation matched"
    assert not torch.equal(decoded, prefilled), "default-profile decode matched the prefill"
    # Both profiles compute the same model: close values, the same greedy choices.
    assert (reference - case.reference).abs().max() < 1e-3
    assert torch.equal(reference.argmax(-1), case.reference.argmax(-1))


# --- real files and commands' paths ---------------------------------------------------------------


def test_artifact_graft_equals_single_pass_bytes(tiny: LoadedModel, inv: DeterminismProfile, key: Path, tmp_path: Path) -> None:
    prefix, text = _text(2)[:181], " and then the answer is 42."
    capture(tiny, inv, prefix, tmp_path / "a", key=key)
    art = load_artifact(tmp_path / "a", tiny, inv, trusted=trust_signer(key))
    assert art.statement.predicate.profile.exactness == "schedule-invariant"
    g = graft(tiny, inv, art, text)
    s = single_pass(tiny, inv, prefix, text)
    assert torch.equal(g.logits, s.logits)
    assert g.summary()["logits_sha256"] == s.summary()["logits_sha256"] == logits_digest(s.logits).removeprefix("sha256:")
    assert g.positions == s.positions


@pytest.mark.slow
def test_gemma3_graft_across_the_sliding_window_equals_single_pass(inv: DeterminismProfile) -> None:
    gemma = load_model("gemma3-270m")
    assert gemma.sliding_window == 512
    ids = gemma.tokenizer.encode("".join(_text(k) for k in range(0, 40, 4)), first=True)[:526]
    assert len(ids) == 526
    with applied(inv):
        (whole,) = prefill(gemma, [ids], keep_from=510)
    # The prefix passes the window: its sliding layers hold only their last 511 positions.
    (logits,) = _grafted(gemma, inv, ids, [516]).values()
    assert torch.equal(logits, whole[516 - 510:])


# --- tiny: random schedules -----------------------------------------------------------------------


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_schedules_agree(tiny: LoadedModel, inv: DeterminismProfile, data: st.DataObject) -> None:
    text = data.draw(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=2, max_size=90))
    ids = tiny.tokenizer.encode(text, first=True)
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(ids) - 1), max_size=4))))
    threads = data.draw(st.sampled_from([1, 2]))
    with applied(inv):
        whole = KVState(tiny).extend(ids)
    with applied(inv.model_copy(update={"threads": threads})):
        state, parts, done = KVState(tiny), [], 0
        for c in [*cuts, len(ids)]:
            parts.append(state.extend(ids[done:c], chunk=data.draw(st.sampled_from([None, 1, 3, 16]))))
            state = KVState.restore(tiny, [Segment(state.export(0), 0, c, tuple(ids[:c]))])
            done = c
    assert torch.equal(torch.cat(parts), whole)


# --- the kernels one by one -----------------------------------------------------------------------


def test_tiled_linear_rows_do_not_depend_on_their_neighbours() -> None:
    gen = torch.Generator().manual_seed(1)
    w, x = torch.randn(2600, 96, generator=gen), torch.randn(70, 96, generator=gen)
    full = invariant.tiled_linear(x, w, None, SETTINGS)
    for lo, hi in ((0, 1), (3, 4), (5, 38), (69, 70)):
        assert torch.equal(invariant.tiled_linear(x[lo:hi], w, None, SETTINGS), full[lo:hi])
    assert (full - F.linear(x, w)).abs().max() < 1e-4
    bias = torch.randn(2600, generator=gen)
    assert torch.equal(invariant.tiled_linear(x[:1], w, bias, SETTINGS), full[:1] + bias)


def test_tiled_activation_rows_do_not_depend_on_their_neighbours() -> None:
    x = torch.randn(41, 200, generator=torch.Generator().manual_seed(2)) * 4
    for fn in (F.silu, torch.sigmoid):
        full = invariant.tiled_elementwise(fn, x)
        assert (full - fn(x)).abs().max() < 1e-6
        for lo, hi in ((0, 1), (7, 8), (3, 40)):
            assert torch.equal(invariant.tiled_elementwise(fn, x[lo:hi]), full[lo:hi])
    gelu = invariant.tiled_elementwise(F.gelu, x, approximate="tanh")
    assert torch.equal(invariant.tiled_elementwise(F.gelu, x[9:10], approximate="tanh"), gelu[9:10])


class _Attn(torch.nn.Module):
    def __init__(self, groups: int, head_dim: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.head_dim = groups, head_dim


@pytest.mark.parametrize(("hq", "hkv", "d", "window"), [(9, 3, 64, None), (4, 1, 256, 20), (4, 2, 16, None), (4, 1, 16, 7)])
def test_invariant_attention_matches_eager_attention(hq: int, hkv: int, d: int, window: int | None) -> None:
    from transformers.models.gemma3.modeling_gemma3 import eager_attention_forward

    gen = torch.Generator().manual_seed(3)
    b, start, q = 2, 37, 30
    s = start + q
    query, key, value = (torch.randn(b, h, n, d, generator=gen) for h, n in ((hq, q), (hkv, s), (hkv, s)))
    module = _Attn(hq // hkv, d)
    qpos, kpos = torch.arange(start, s)[:, None], torch.arange(s)[None, :]
    allowed = (kpos <= qpos) if window is None else (kpos <= qpos) & (kpos > qpos - window)
    mask = torch.zeros(q, s).masked_fill(~allowed, float("-inf"))[None, None]  # [1, 1, q, s]
    expected, _ = eager_attention_forward(module, query, key, value, mask, scaling=d**-0.5)
    got, _ = invariant.invariant_attention(module, query, key, value, None, scaling=d**-0.5, sliding_window=window,
                                           kvgraft_query_start=start)
    assert got.shape == expected.shape == (b, q, hq, d)
    assert (got - expected).abs().max() < 1e-5
    # Keys a sliding layer no longer holds are masked anyway: dropping them changes no bit.
    if window is not None:
        held = window - 1
        first = start - held
        part, _ = invariant.invariant_attention(module, query[:, :, :1], key[:, :, first:start + 1], value[:, :, first:start + 1], None,
                                                scaling=d**-0.5, sliding_window=window, kvgraft_query_start=start)
        assert torch.equal(part, got[:, :1])


def test_invariant_attention_key_padding_mask() -> None:
    gen = torch.Generator().manual_seed(4)
    query, key, value = torch.randn(1, 4, 3, 16, generator=gen), torch.randn(1, 2, 10, 16, generator=gen), torch.randn(1, 2, 10, 16, generator=gen)
    mask = torch.ones(1, 10, dtype=torch.long)
    mask[0, 2] = 0
    module = _Attn(2, 16)
    masked, _ = invariant.invariant_attention(module, query, key, value, mask, kvgraft_query_start=7)
    changed = value.clone()
    changed[:, :, 2] = 1e3
    again, _ = invariant.invariant_attention(module, query, key, changed, mask, kvgraft_query_start=7)
    assert torch.equal(masked, again)
    with pytest.raises(ScheduleError, match="2-D key padding mask or none"):
        invariant.invariant_attention(module, query, key, value, torch.zeros(1, 1, 3, 10), kvgraft_query_start=7)
    with pytest.raises(ScheduleError, match="dropout in attention is not deterministic"):
        invariant.invariant_attention(module, query, key, value, None, dropout=0.1, kvgraft_query_start=7)


# --- the profile and its context -------------------------------------------------------------------


def test_invariant_profile_fields() -> None:
    p = current_profile("invariant")
    assert p.name == INVARIANT and p.exactness == "schedule-invariant"
    assert p.matmul_tiling == "fixed-m-16" and p.attention_implementation == "kvgraft_invariant"
    assert p.kernel_versions["kvgraft_invariant"] == "v1; m-tile=16; n-block=2048; query-tile=16; key-block=64"
    assert current_profile("default") == current_profile("cpu-fp32-sdpa")
    with pytest.raises(UnknownProfileError, match="no determinism profile named 'fast'"):
        current_profile("fast")
    with pytest.raises(ScheduleError, match="matmul tiling 'fixed-m-x' is not 'fixed-m-<rows>'"):
        invariant.settings_from_tiling("fixed-m-x")


def test_applied_leaves_no_global_state(tiny: LoadedModel, inv: DeterminismProfile) -> None:
    linear_forward, attn = torch.nn.Linear.forward, tiny.module.config._attn_implementation
    threads, stack = torch.get_num_threads(), torch._C._len_torch_function_stack()
    assert not invariant.is_registered() and invariant.active() is None
    with applied(inv):
        assert invariant.is_registered() and invariant.active() == SETTINGS
        assert torch._C._len_torch_function_stack() == stack + 1
        with invariant.scoped_call(tiny.module, 0, 100) as kwargs:
            assert kwargs == {"kvgraft_query_start": 0}
            assert tiny.module.config._attn_implementation == "kvgraft_invariant"
        assert tiny.module.config._attn_implementation == attn
    assert not invariant.is_registered() and invariant.active() is None
    assert "kvgraft_invariant" not in ALL_ATTENTION_FUNCTIONS
    assert torch.nn.Linear.forward is linear_forward and torch._C._len_torch_function_stack() == stack
    assert torch.get_num_threads() == threads and tiny.module.config._attn_implementation == attn
    # Also after an error inside the block.
    with pytest.raises(ScheduleError, match="chunk"), applied(inv):
        raise ScheduleError("chunk")
    assert not invariant.is_registered() and torch._C._len_torch_function_stack() == stack
    # Outside the profile, a forward pass is the default one.
    with invariant.scoped_call(tiny.module, 0, 1) as kwargs:
        assert kwargs == {} and tiny.module.config._attn_implementation == attn


def test_installation_is_per_thread(tiny: LoadedModel, inv: DeterminismProfile) -> None:
    seen: list[object] = []
    with applied(inv):
        worker = threading.Thread(target=lambda: seen.append(invariant.active()))
        worker.start()
        worker.join()
    assert seen == [None]


def test_schedule_arguments_refused(tiny: LoadedModel, inv: DeterminismProfile) -> None:
    with applied(inv):
        with pytest.raises(ScheduleError, match="every sequence in a batch needs at least one token"):
            prefill(tiny, [[1, 2], []])
        with pytest.raises(ScheduleError, match="keep_from 5 is outside the shortest sequence"):
            prefill(tiny, [[1, 2, 3]], keep_from=5)
        from kvgraft.engine import ArtifactError

        with pytest.raises(ArtifactError, match="chunk size 0 is not a positive number of tokens"):
            KVState(tiny).extend([1, 2], chunk=0)
        with pytest.raises(ArtifactError, match="keep_last 3 is not within the 2 tokens run"):
            KVState(tiny).extend([1, 2], keep_last=3)
