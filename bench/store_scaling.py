"""Store scaling (issue 8, item 5): lookup latency and the engine's peak memory as the knowledge
library grows.

A library (``Library`` in ``kvgraft.engine``'s library module, what ``kvgraft library deposit/ask``
use) is filled with GSM8K train problems and their worked solutions (checked by the grader on
deposit, as the CLI does), to at least 1M stored tokens with ``tiny-llama-test`` and at least 10x
the window (8,192) with ``smollm2-135m``. At checkpoints along the way a fresh process opens the
library and measures:

- ``open``: ``Library.open`` (reads the index, builds the in-memory lookup structures);
- ``lookup exact``: a deposited problem, found by its normalized hash;
- ``lookup similar``: an unseen GSM8K test problem, found by TF-IDF similarity;
- ``lookup + load``: the similar hit's artifact chain loaded and digest-checked (the graft's read);
- ``ask``: one full ask (lookup, graft, decode of at most 8 tokens);
- the process's peak resident memory (``VmHWM``) after all of that.

Target: lookup latency sublinear in store size, memory flat.

    .venv/bin/python bench/store_scaling.py [--tiny-tokens 1000000] [--smollm-tokens 81920]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import QUICK, ROOT, figure, median, percentile, say, write_result

TRAIN = ROOT / "data" / "datasets" / "gsm8k_train.jsonl"
TEST = ROOT / "data" / "datasets" / "gsm8k_test.jsonl"


def _library_class() -> Any:
    from kvgraft.engine import Library

    return Library


def peak_rss_mib() -> float:
    """This process's peak resident set size (VmHWM), MiB."""
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _profile(threads: int) -> Any:
    from kvgraft.engine import current_profile

    profile = current_profile("cpu-fp32")
    # The same kernels on fewer threads: tiny-llama-test's passes are too small to share, and on a
    # busy machine two threads wait on each other; the library records the profile it was made with.
    return profile if threads == profile.threads else profile.model_copy(update={"threads": threads})


def measure(library_dir: Path, model_name: str, lookups: int, threads: int) -> dict[str, Any]:
    """Open the library in this (fresh) process and time lookups; print one JSON line."""
    from kvgraft.engine import load_model
    from kvgraft.verifier import load_dataset

    library_cls = _library_class()
    model = load_model(model_name)
    profile = _profile(threads)
    base_rss = peak_rss_mib()
    t0 = time.perf_counter()
    from kvgraft.engine import ensure_local_key, trust_signer

    trusted = trust_signer(ensure_local_key()[0])  # the key build() deposits with
    lib = library_cls.open(library_dir, model, profile, trusted=trusted)
    open_s = time.perf_counter() - t0
    rng = random.Random(0)
    known = [e.problem for e in rng.sample(lib.entries, min(lookups, len(lib.entries)))]
    test = load_dataset(TEST)
    unseen = [test.question(i) for i in rng.sample(range(len(test.docs)), lookups)]
    lib.lookup(unseen[0])  # builds the TF-IDF postings once (done lazily on the first query)
    exact, similar, load = [], [], []
    for q in known:
        t0 = time.perf_counter()
        hit = lib.lookup(q)
        exact.append(time.perf_counter() - t0)
        if hit is None or hit.method != "exact":
            raise SystemExit("a deposited problem was not found by its hash")
    for q in unseen:
        t0 = time.perf_counter()
        hit = lib.lookup(q)
        similar.append(time.perf_counter() - t0)
        if hit is None:
            continue
        t0 = time.perf_counter()
        lib.load_entry(hit.entry)
        load.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    lib.ask(unseen[0], max_new_tokens=8)
    ask_s = time.perf_counter() - t0
    return {
        "entries": len(lib.entries),
        "stored_tokens": lib.stored_tokens,
        "open_s": open_s,
        "lookup_exact_ms": {"p50": percentile(exact, 50) * 1e3, "p99": percentile(exact, 99) * 1e3},
        "lookup_similar_ms": {"p50": percentile(similar, 50) * 1e3, "p99": percentile(similar, 99) * 1e3},
        "lookup_load_ms": {"p50": percentile(load, 50) * 1e3, "p99": percentile(load, 99) * 1e3} if load else None,
        "ask_s": ask_s,
        "model_loaded_peak_rss_mib": base_rss,
        "peak_rss_mib": peak_rss_mib(),
    }


def grow(model_name: str, target_tokens: int, checkpoints: list[int], lookups: int, work: Path, threads: int) -> dict[str, Any]:
    """Deposit until ``target_tokens`` are stored, measuring in a fresh process at each checkpoint."""
    from kvgraft.engine import clean_solution, ensure_local_key, load_model
    from kvgraft.verifier import load_dataset

    library_cls = _library_class()
    model = load_model(model_name)
    profile = _profile(threads)
    key, _ = ensure_local_key()
    train = load_dataset(TRAIN)
    directory = work / f"lib-{model_name}"
    lib = library_cls.create(directory, model, profile, kind=train.kind, key=key)
    points: list[dict[str, Any]] = []
    pending = sorted(c for c in checkpoints if c < target_tokens) + [target_tokens]
    deposit_s: list[float] = []
    t_start = time.perf_counter()
    for i in range(len(train.docs)):
        solution = train.solution(i)
        if solution is None:
            continue
        t0 = time.perf_counter()
        entry = lib.deposit(train, i, clean_solution(solution) + f"\nThe answer is {train.reference(i)}.", key=key)
        if entry is not None:
            deposit_s.append(time.perf_counter() - t0)
        if pending and lib.stored_tokens >= pending[0]:
            pending.pop(0)
            say(f"{model_name}: {len(lib.entries)} entries, {lib.stored_tokens} tokens stored "
                f"({time.perf_counter() - t_start:.0f} s depositing); measuring")
            out = subprocess.run([sys.executable, __file__, "--measure", str(directory), "--model", model_name,
                                  "--lookups", str(lookups), "--threads", str(threads)], capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"the measuring process failed: {out.stderr[-2000:]}")
            point = json.loads(out.stdout.strip().splitlines()[-1])
            say(f"  exact p50 {point['lookup_exact_ms']['p50']:.3f} ms, similar p50 {point['lookup_similar_ms']['p50']:.2f} ms, "
                f"peak RSS {point['peak_rss_mib']:.0f} MiB")
            points.append(point)
            if not pending:
                break
    else:
        say(f"{model_name}: the training set ran out at {lib.stored_tokens} tokens")
    disk = sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
    return {"model": model_name, "window": model.spec.window, "threads": threads, "target_tokens": target_tokens, "points": points,
            "deposit_s_median": median(deposit_s) if deposit_s else None, "library_bytes_on_disk": disk}


def main() -> None:
    """Grow both libraries, write ``bench/results/store_scaling.json`` and its plot."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--lookups", type=int, default=20 if QUICK else 100)
    ap.add_argument("--tiny-tokens", type=int, default=30_000 if QUICK else 1_000_000)
    ap.add_argument("--smollm-tokens", type=int, default=3_000 if QUICK else 10 * 8192)
    args = ap.parse_args()
    if args.measure is not None:
        sys.stdout.write(json.dumps(measure(args.measure, args.model, args.lookups, args.threads)) + "\n")
        return
    with tempfile.TemporaryDirectory(prefix="kvgraft-bench-store-") as tmp:
        work = Path(tmp)
        tiny = grow("tiny-llama-test", args.tiny_tokens, [10_000, 100_000, 300_000], args.lookups, work, threads=1)
        smol = grow("smollm2-135m", args.smollm_tokens, [8_192, 30_000], args.lookups, work, threads=1)
    results = {"tiny-llama-test": tiny, "smollm2-135m": smol}
    met = {}
    for name, r in results.items():
        pts = r["points"]
        if len(pts) >= 2:
            a, b = pts[0], pts[-1]
            growth = b["stored_tokens"] / a["stored_tokens"]
            met[name] = {
                "store_growth": growth,
                "similar_lookup_growth": b["lookup_similar_ms"]["p50"] / a["lookup_similar_ms"]["p50"],
                "exact_lookup_growth": b["lookup_exact_ms"]["p50"] / a["lookup_exact_ms"]["p50"],
                "peak_rss_growth": b["peak_rss_mib"] / a["peak_rss_mib"],
            }
    write_result("store_scaling", {
        "description": "knowledge library: lookup latency and peak memory as the store grows",
        "api": "Library (engine/_internal/library.py), as kvgraft library deposit/ask use it",
        "models": results,
        "growth_first_to_last_checkpoint": met,
    })
    plot(results)


def plot(results: dict[str, Any]) -> None:
    """Lookup latency and peak RSS against stored tokens, both models."""
    with figure("store_scaling") as fig:
        if fig is None:
            return
        ax = fig.add_subplot(1, 2, 1)
        ax2 = fig.add_subplot(1, 2, 2)
        for name, r in results.items():
            xs = [p["stored_tokens"] for p in r["points"]]
            ax.plot(xs, [p["lookup_exact_ms"]["p50"] for p in r["points"]], marker="o", label=f"{name} exact")
            ax.plot(xs, [p["lookup_similar_ms"]["p50"] for p in r["points"]], marker="x", label=f"{name} similar")
            ax2.plot(xs, [p["peak_rss_mib"] for p in r["points"]], marker="o", label=name)
        for a in (ax, ax2):
            a.set_xscale("log")
            a.set_xlabel("tokens stored")
            a.legend(fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("lookup p50 (ms)")
        ax.set_title("Lookup latency")
        ax2.set_ylabel("peak RSS of the engine (MiB)")
        ax2.set_title("Memory")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
