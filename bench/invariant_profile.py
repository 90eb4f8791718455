"""Issue 4's benchmark: what the schedule-invariant profile costs against the default profile.

Prefill tokens/s (a ``prefill``-token prompt in one forward pass) and decode tokens/s (single-token
steps after that prompt) under the default profile (``DEFAULT_PROFILE``, ``cpu-fp32-sdpa`` since issue 16) and ``cpu-fp32-invariant``, for both real models, all
in ONE process. The two profiles alternate within each repetition (default, invariant, default,
...) so that a change in the shared machine's load hits both alike; one warm-up per profile and
model is excluded. Figures: every run's, the medians, and the ratio invariant / default of the
median times (target: at most 1.5x, the aim issue 16 sets for the new default).

    .venv/bin/python bench/invariant_profile.py [--runs 5] [--prefill 256] [--decode 16]
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

from common import QUICK, corpus_text, figure, median, say, write_result

from kvgraft.engine import DEFAULT_PROFILE, KVState, applied, current_profile, load_model

MODELS = ("smollm2-135m", "gemma3-270m")
#: The default profile (the fast one since issue 16) against the schedule-invariant one.
PROFILES = (DEFAULT_PROFILE, "cpu-fp32-invariant")
#: Issue 16: "<= 1.5x on prefill is the aim" for the new default (issue 4 had asked 1.3x of cpu-fp32).
TARGET_RATIO = 1.5
#: One load per model for all thread counts.
_load = functools.cache(load_model)


def _one_run(model: Any, profile: Any, ids: list[int], prefill: int, decode: int) -> dict[str, Any]:
    """One prefill of ``prefill`` tokens, then ``decode`` greedy single-token steps."""
    with applied(profile):
        state = KVState(model)
        t0 = time.perf_counter()
        logits = state.extend(ids[:prefill], keep_last=1)
        prefill_s = time.perf_counter() - t0
        steps: list[float] = []
        for _ in range(decode):
            nxt = int(logits[-1].argmax())
            t0 = time.perf_counter()
            logits = state.extend([nxt])
            steps.append(time.perf_counter() - t0)
    return {"prefill_s": prefill_s, "decode_step_s": steps}


def bench_model(name: str, runs: int, prefill: int, decode: int, threads: int | None) -> dict[str, Any]:
    """Alternate the two profiles ``runs`` times on model ``name``; every figure kept.

    ``threads`` overrides both profiles' pinned thread count (None: the profiles' own, 2).
    """
    model = _load(name)
    ids = model.tokenizer.encode(corpus_text(prefill * 8), first=True)
    if len(ids) < prefill:
        raise SystemExit(f"the corpus gives only {len(ids)} tokens for a {prefill}-token prefill")
    profiles = {p: current_profile(p) for p in PROFILES}
    if threads is not None:
        # Same kernels, another thread count: on a shared machine one thread is the steadier figure.
        profiles = {p: prof.model_copy(update={"threads": threads}) for p, prof in profiles.items()}
    for p in PROFILES:  # warm-up: first-call allocations and one-time dispatch setup
        _one_run(model, profiles[p], ids, prefill, 2)
    per: dict[str, list[dict[str, Any]]] = {p: [] for p in PROFILES}
    for r in range(runs):
        for p in PROFILES if r % 2 == 0 else PROFILES[::-1]:
            run = _one_run(model, profiles[p], ids, prefill, decode)
            per[p].append(run)
            say(f"{name} {p} threads {profiles[p].threads} run {r + 1}/{runs}: prefill {run['prefill_s']:.3f} s, "
                f"decode step median {median(run['decode_step_s']) * 1000:.1f} ms")
    out: dict[str, Any] = {"prefill_tokens": prefill, "decode_steps": decode, "profiles": {}}
    for p in PROFILES:
        prefill_s = median([x["prefill_s"] for x in per[p]])
        # Per run, the median step; then the median over runs.
        step_s = median([median(x["decode_step_s"]) for x in per[p]])
        out["profiles"][p] = {
            "runs": per[p],
            "prefill_s_median": prefill_s,
            "prefill_tokens_per_s": prefill / prefill_s,
            "decode_step_s_median": step_s,
            "decode_tokens_per_s": 1.0 / step_s,
            "threads": profiles[p].threads,
        }
    d, i = out["profiles"][PROFILES[0]], out["profiles"][PROFILES[1]]
    out["ratio_prefill"] = i["prefill_s_median"] / d["prefill_s_median"]
    out["ratio_decode"] = i["decode_step_s_median"] / d["decode_step_s_median"]
    say(f"{name} threads {profiles[PROFILES[0]].threads}: prefill ratio {out['ratio_prefill']:.2f}x, decode ratio {out['ratio_decode']:.2f}x")
    return out


def plot(results: dict[str, Any]) -> None:
    """Bars of the invariant / default ratio per model, prefill and decode, with the target."""
    with figure("invariant_profile") as fig:
        if fig is None:
            return
        ax = fig.add_subplot(1, 1, 1)
        names = list(results)
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [results[n]["ratio_prefill"] for n in names], width=0.4, label="prefill")
        ax.bar([x + 0.2 for x in xs], [results[n]["ratio_decode"] for n in names], width=0.4, label="decode")
        ax.axhline(TARGET_RATIO, color="red", linestyle="--", label=f"target {TARGET_RATIO}x")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_xticks(list(xs), [n.replace(" ", "\n") for n in names])
        ax.set_ylabel("time ratio invariant / default")
        ax.set_title("Cost of the schedule-invariant profile (CPU, fp32)")
        ax.legend()


def main() -> None:
    """Measure, write ``bench/results/invariant_profile.json`` and its plot."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2 if QUICK else 5)
    ap.add_argument("--prefill", type=int, default=64 if QUICK else 256)
    ap.add_argument("--decode", type=int, default=4 if QUICK else 16)
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--threads", type=int, nargs="+", default=[2], help="thread counts (2 is the profiles' own; 1 is steadier on a busy machine)")
    args = ap.parse_args()
    results = {
        f"{name} threads={t}": bench_model(name, args.runs, args.prefill, args.decode, None if t == 2 else t)
        for name in args.models for t in args.threads
    }
    write_result("invariant_profile", {
        "description": f"prefill and decode of the cpu-fp32-invariant profile vs the default {DEFAULT_PROFILE}, medians, one process",
        "target": {"ratio_max": TARGET_RATIO},
        "models": results,
        "met": {n: {"prefill": r["ratio_prefill"] <= TARGET_RATIO, "decode": r["ratio_decode"] <= TARGET_RATIO}
                for n, r in results.items()},
    })
    plot(results)


if __name__ == "__main__":
    main()
