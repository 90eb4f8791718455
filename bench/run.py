"""Run the whole benchmark suite, one script after another, each in its own process.

Each script writes ``bench/results/<name>.json`` and ``<name>.png``; this runner then prints the
table of ratios (the one the README shows) from those files. ``--quick`` runs every script with
small sizes and few repetitions, to check that the suite works end to end; its figures are not
the ones to quote. ``--only NAME ...`` runs some of them.

    .venv/bin/python bench/run.py [--quick] [--threads 1] [--only ttft registry_throughput]

``--threads N`` runs every method of the model benchmarks on N threads (default: the profiles'
own 2). On a machine other jobs load, 1 is steadier: a 2-thread op waits for its second thread.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

from common import RESULTS, ROOT, say

#: The scripts that take ``--threads`` (the model benchmarks).
THREADED = ("restore_floor", "invariant_profile", "ttft")
#: In the order they run: the quick ones first, the store last (it grows the library longest).
SUITE = ("verifier_throughput", "restore_floor", "registry_throughput", "registry_reads", "registry_publish", "invariant_profile", "ttft",
         "store_scaling", "engine_serve", "llamacpp", "flywheel_stream")


def _load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def table() -> list[str]:
    """Markdown rows: ratio, measured, target, command; from the result files present."""
    rows = ["| benchmark | ratio | measured | target | command |", "|---|---|---|---|---|"]

    def add(name: str, what: str, value: str, target: str) -> None:
        rows.append(f"| {name} | {what} | {value} | {target} | `.venv/bin/python bench/{name}.py` |")

    r = _load("ttft")
    if r:
        # Every profile's graft, side by side in the same run (bench/ttft.py --profiles); the first
        # is the default profile's.
        for key, name in r["profiles"].items():
            for row in r["rows"]:
                add("ttft", f"recompute / graft TTFT, {name}, {row['prefix_tokens']} tokens",
                    f"{row['speedup_vs_recompute_by_graft'][key]:.1f}x", f">= {r['target']['graft_speedup_at_4k_min']:g}x at 4K, growing")
        for key, name in r["profiles"].items():
            for row in r["rows"]:
                if "over_llama_restore_by_graft" in row:
                    add("ttft", f"graft / llama.cpp restore TTFT, {name}, {row['prefix_tokens']} tokens",
                        f"{row['over_llama_restore_by_graft'][key]:.2f}x", "<= 1x")
        for key, name in r["profiles"].items():
            rows_with = [row for row in r["rows"] if "kv_bytes_over_llama_state_by_graft" in row]
            if rows_with:
                last = rows_with[-1]
                add("ttft", f"artifact bytes / llama.cpp f16 state, {name}, {last['prefix_tokens']} tokens",
                    f"{last['kv_bytes_over_llama_state_by_graft'][key]:.2f}x", "<= 1x")
    r = _load("restore_floor")
    if r:
        for row in r["rows"]:
            for c in ("warm", "cold"):
                add("restore_floor", f"restore / sha256sum, {row['kv_bytes'] / 1e6:.0f} MB, {c}",
                    f"{row[c]['restore_over_sha256sum']:.2f}x", "<= 2x")
                if "restore_over_openssl" in row[c]:
                    add("restore_floor", f"restore / openssl sha256, {row['kv_bytes'] / 1e6:.0f} MB, {c}",
                        f"{row[c]['restore_over_openssl']:.2f}x", "(stricter floor)")
    r = _load("registry_throughput")
    if r:
        for row in r["transfers"]:
            add("registry_throughput", f"download kvgraft / nginx, {row['bytes'] / 2**20:.0f} MiB",
                f"{row['download_ratio_kvgraft_over_nginx']:.2f}x", ">= 0.5x")
        for row in r["transfers"]:
            add("registry_throughput", f"upload kvgraft / hashlib sha256, {row['bytes'] / 2**20:.0f} MiB",
                f"{row['upload_over_hashlib']:.2f}x", "limited by hashing")
    r = _load("registry_reads")
    if r:
        m = r["median"]
        add("registry_reads", "4 KiB read p50 / p99, 1 client (nginx)",
            f"{m['kvgraft_4k_p50_ms']:.2f} / {m['kvgraft_4k_p99_ms']:.2f} ms ({m['nginx_4k_p50_ms']:.2f} / {m['nginx_4k_p99_ms']:.2f})",
            f"p50 <= {r['target']['p50_ms_max']:g} ms")
        add("registry_reads", "download kvgraft / nginx, 1 MiB", f"{r['download_ratio_kvgraft_over_nginx_1m']:.2f}x",
            f">= {r['target']['download_ratio_min']:g}x")
    r = _load("registry_publish")
    if r:
        for backend, rates in r["publishes_per_second"].items():
            counts = sorted(rates, key=int)
            target = r["target"]
            add("registry_publish", f"publishes per second, {backend}, {' / '.join(counts)} clients",
                " / ".join(f"{rates[c]:.0f}" for c in counts),
                f">= {target['publishes_per_second_min']:.0f}/s at {target['clients']} clients"
                if backend == target["backend"] else "(measured)")
    r = _load("engine_serve")
    if r:
        t = r["target"]
        for m in r["models"]:
            s = m["one_client"]
            target = (f"<= {t['recall_p50_s_max']:g} s; >= {t['base_over_recall_min']:g}x" if m["model"] == t["model"] else "(measured)")
            add("engine_serve", f"recall p50, 1 client, {m['model']}; base / recall p50",
                f"{s['recall_p50_s']:.3f} s; {s['base_over_recall_p50']:.1f}x (llama.cpp base / recall {s['llama_over_recall_p50']:.1f}x)", target)
    r = _load("llamacpp")
    if r:
        for row in r.get("rows", []):
            for n, ratio in row["decode_ratio"].items():
                add("llamacpp", f"engine (llamacpp-cpu) / llama.cpp decode tokens/s, {n} seq, {row['model']}", f"{ratio:.2f}x",
                    f">= {r['target']['decode_ratio_min']:g}x")
            add("llamacpp", f"engine (llamacpp-cpu) / llama.cpp prefill tokens/s, {row['model']}", f"{row['prefill_ratio']:.2f}x",
                f">= {r['target']['decode_ratio_min']:g}x")
        for row in r.get("serve", []):
            add("llamacpp", f"engine serve / llama-server tokens/s, {row['clients']} clients, {row['model']}", f"{row['serve_ratio']:.2f}x",
                f">= {r['target']['serve_ratio_min']:g}x")
            if "recall" in row:
                add("llamacpp", f"recalled answer p50, 1 client, {row['model']}", f"{row['recall']['p50_s']:.3f} s",
                    f"<= {r['target'].get('recall_p50_s_max', 0.3):g} s")
        for t in r.get("ttft", []):
            for row in t["rows"]:
                add("llamacpp", f"graft TTFT / llama.cpp state restore, {row['prefix_tokens']} tokens, {t['model']}",
                    f"{row['graft_over_llama_restore']:.2f}x (verification {row['graft_phases_median_s']['load']:.3f} s)",
                    f"<= {r['target'].get('graft_over_llama_restore_max', 1.1):g}x")
    r = _load("flywheel_stream")
    if r:
        lib, base = r["table"]["library"]["all"], r["table"]["base"]["all"]
        add("flywheel_stream", f"stream of {r['questions']} (deposited/paraphrased/new), {r['model']}: accuracy, decode "
            "tokens per answer, p50 latency, library / base",
            f"{lib['accuracy']:.2f} / {base['accuracy']:.2f}; {lib['decode_tokens_mean']:.0f} / {base['decode_tokens_mean']:.0f}; "
            f"{lib['latency_p50_s']:.2f} / {base['latency_p50_s']:.2f} s; kinds {lib['kinds']}", "(measured)")
    r = _load("verifier_throughput")
    if r:
        add("verifier_throughput", "verifier hashing / sha256sum", f"{r['hashing']['ratio_verifier_over_sha256sum']:.2f}x", ">= 0.8x")
        if "ratio_verifier_over_openssl" in r["hashing"]:
            add("verifier_throughput", "verifier hashing / openssl sha256", f"{r['hashing']['ratio_verifier_over_openssl']:.2f}x",
                "(stricter reference)")
    r = _load("invariant_profile")
    if r:
        for name, m in r["models"].items():
            add("invariant_profile", f"invariant / default prefill time, {name}", f"{m['ratio_prefill']:.2f}x", "<= 1.5x (aim)")
            add("invariant_profile", f"invariant / default decode time, {name}", f"{m['ratio_decode']:.2f}x", "<= 1.3x")
    r = _load("store_scaling")
    if r:
        for name, g in r["growth_first_to_last_checkpoint"].items():
            add("store_scaling", f"similar-lookup p50 growth for {g['store_growth']:.0f}x the store, {name}",
                f"{g['similar_lookup_growth']:.2f}x", "sublinear")
            add("store_scaling", f"peak RSS growth for {g['store_growth']:.0f}x the store, {name}", f"{g['peak_rss_growth']:.2f}x", "flat")
    return rows


def main() -> None:
    """Run the suite; exit non-zero when any script failed (the others still run)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, few repetitions: a smoke run")
    ap.add_argument("--only", nargs="+", choices=SUITE, help="run only these")
    ap.add_argument("--table", action="store_true", help="only print the table from the existing results")
    ap.add_argument("--threads", type=int, help="threads for the model benchmarks' every method (default: the profiles' 2)")
    args = ap.parse_args()
    if not args.table:
        env = dict(os.environ)
        if args.quick:
            env["KVGRAFT_BENCH_QUICK"] = "1"
        failed = []
        timings = {}
        for name in args.only or SUITE:
            say(f"=== {name}")
            t0 = time.perf_counter()
            extra = ["--threads", str(args.threads)] if args.threads and name in THREADED else []
            done = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), *extra], env=env, check=False)
            timings[name] = round(time.perf_counter() - t0, 1)
            say(f"=== {name}: {'ok' if done.returncode == 0 else f'FAILED (exit {done.returncode})'} in {timings[name]:.0f} s")
            if done.returncode != 0:
                failed.append(name)
        # Merged into the last run's record, so that a partial run (--only) keeps the others' times.
        previous = _load("run") or {}
        record = {"seconds": {**previous.get("seconds", {}), **timings},
                  "failed": sorted({*previous.get("failed", []), *failed} - {n for n in timings if n not in failed}),
                  "quick": args.quick}
        (RESULTS / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    sys.stdout.write("\n".join(table()) + "\n")
    if not args.table and failed:
        raise SystemExit(f"benchmark(s) failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
