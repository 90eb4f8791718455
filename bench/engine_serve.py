"""Engine server latency (issue 17, item 2): warm answers from ``kvgraft engine serve`` against llama.cpp's server.

For each model (smollm2-135m, and qwen2.5-coder-0.5b when installed), on 127.0.0.1:

- a library of ``--deposit`` GSM8K train problems is made with the real ``kvgraft library
  deposit`` (signed by a fresh key, trusted through a trusted-keys file), and two real
  ``kvgraft engine serve`` processes are started: one with the library (recall and grafted
  examples), one without (the base model);
- llama.cpp's own server (``python -m llama_cpp.server``, the bench venv's llama-cpp-python) is
  started on the same GGUF file, with the profile's threads;
- after a warm-up request of each kind, each of 1 and 8 concurrent clients (threads, one
  keep-alive ``http.client`` connection each) sends its share of requests of one kind at a time:
  **recall** (a deposited problem, chat completions: the server grafts its entry and decodes the
  answer box), **similar** (a deposited problem paraphrased, "Please solve: ...": its entry
  grafted as a worked example, above the graft threshold, then a full solution), **base** (the same test problem through ``/v1/completions`` on the library-less
  server) and **llama** (the same base prompt and budget through llama.cpp's ``/v1/completions``).
  Every answer's status must be 200; kvgraft's must carry its provenance (``kvgraft.method``
  exact/similar/none as asked, an entry digest for recall).

The figures are the medians and p99 of the per-request wall times (client side: request sent to
the whole answer read), and the ratio base p50 / recall p50 for the same question's kind. Both
servers decode greedily with the same budget (``--max-tokens``); each server is one process on
the same 2 cores, answering one request at a time (kvgraft's one model worker; llama.cpp's server
with its default of one slot), so 8 clients measure queueing as much as decoding.

Target: a recalled answer, warm, p50 <= 0.3 s with smollm2-135m, and >= 20x faster than the same
question answered by the base model.

    .venv/bin/python bench/engine_serve.py [--models smollm2-135m] [--clients 1 8] [--requests 16]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import (
    KVGRAFT,
    QUICK,
    ROOT,
    figure,
    free_port,
    median,
    percentile,
    post_json,
    say,
    server_process,
    write_result,
)

TARGET_RECALL_P50_S = 0.3
TARGET_RECALL_SPEEDUP = 20.0
TRAIN = ROOT / "data" / "datasets" / "gsm8k_train.jsonl"
TEST = ROOT / "data" / "datasets" / "gsm8k_test.jsonl"
KINDS = ("recall", "similar", "base", "llama")


def _questions(path: Path, count: int) -> list[str]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line)["question"] for line in list(f)[:count]]


def _run(*args: str | Path) -> dict[str, Any]:
    """``kvgraft --json ARGS``: its JSON answer (SystemExit naming the failure otherwise)."""
    done = subprocess.run([*KVGRAFT, "--json", *map(str, args)], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"kvgraft {' '.join(map(str, args[:3]))} failed: {done.stderr.strip()[-600:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


class Target:
    """How one kind of request is sent, and what its answer must show."""

    def __init__(self, kind: str, port: int, model: str, questions: list[str], max_tokens: int) -> None:
        self.kind, self.port, self.model, self.questions, self.max_tokens = kind, port, model, questions, max_tokens

    def body(self, i: int) -> tuple[str, dict[str, Any]]:
        q = self.questions[i % len(self.questions)]
        if self.kind in ("recall", "similar"):
            return "/v1/chat/completions", {"model": self.model, "messages": [{"role": "user", "content": q}],
                                             "max_tokens": self.max_tokens, "temperature": 0}
        # The base prompt both servers complete: the question as a library asks a new problem
        # (engine/_internal/library.py ``question_text``).
        prompt = f"Problem: {q.strip()}\nSolution: Let's think step by step."
        model = self.model if self.kind == "base" else "llama"
        return "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0}

    def check(self, answer: dict[str, Any]) -> int:
        """The answer's decode tokens; SystemExit when kvgraft's provenance is not what was asked."""
        usage = answer.get("usage") or {}
        if self.kind == "llama":
            return int(usage.get("completion_tokens", 0))
        prov = answer.get("kvgraft") or {}
        want = {"recall": "exact", "similar": "similar", "base": "none"}[self.kind]
        if prov.get("method") != want or (self.kind == "recall" and not prov.get("entry")):
            raise SystemExit(f"a {self.kind} request was answered by method {prov.get('method')!r}: {json.dumps(prov)[:300]}")
        return int(prov.get("decode_tokens", usage.get("completion_tokens", 0)))


def _measure(target: Target, clients: int, per_client: int) -> dict[str, Any]:
    """``clients`` threads, each sending ``per_client`` requests of ``target`` one after another."""
    times: list[float] = []
    tokens: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    barrier = threading.Barrier(clients)

    def client(c: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", target.port, timeout=600)
        try:
            barrier.wait()
            for k in range(per_client):
                path, body = target.body(c * per_client + k)
                seconds, answer = post_json(conn, path, body)
                n = target.check(answer)
                with lock:
                    times.append(seconds)
                    tokens.append(n)
        except BaseException as e:  # reported in the main thread
            errors.append(e)
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{target.kind}, {clients} clients: {errors[0]}")
    return {
        "kind": target.kind, "clients": clients, "requests": len(times),
        "p50_s": round(median(times), 4), "p99_s": round(percentile(times, 99), 4),
        "mean_decode_tokens": round(statistics.fmean(tokens), 2), "wall_s": round(wall, 3),
        "requests_per_s": round(len(times) / wall, 3), "seconds": [round(t, 4) for t in times],
    }


def bench_model(name: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Every kind at every client count for model ``name``."""
    from kvgraft.engine import locate_gguf, spec_for

    spec = spec_for(name)
    key = tmp / "key.pem"
    _run("keys", "generate", "--out", key)
    trust = tmp / "trusted-keys.json"
    _run("keys", "trust", "--file", trust, "--name", "bench", "--public-key", f"{key}.pub")
    library = tmp / "library"
    say(f"{name}: depositing {args.deposit} problems")
    _run("library", "deposit", "--model", name, "--dataset", TRAIN, "--library", library, "--limit", args.deposit, "--key", key)
    deposited = _questions(TRAIN, args.deposit)
    held_out = _questions(TEST, max(4, args.requests))
    gguf = locate_gguf(spec)
    ports = {"library": free_port(), "base": free_port(), "llama": free_port()}
    # The request timeout counts the queue wait: 8 clients of a model whose answers take 20-30 s
    # (qwen2.5-coder-0.5b's base and grafted-example answers) wait past the default 120 s.
    serve = [*KVGRAFT, "engine", "serve", "--model", name, "--log-level", "warning", "--host", "127.0.0.1",
             "--request-timeout", "1200"]
    llama = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "llama", "--host", "127.0.0.1",
             "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx", "4096"]
    rows = []
    with (
        server_process([*serve, "--library", str(library), "--trusted-keys", str(trust), "--port", str(ports["library"])],
                 tmp / "serve-library.log", ports["library"], "/v1/models", seconds=600),
        server_process([*serve, "--port", str(ports["base"])], tmp / "serve-base.log", ports["base"], "/v1/models", seconds=600),
        server_process([*llama, "--port", str(ports["llama"])], tmp / "llama.log", ports["llama"], "/v1/models", seconds=600),
    ):
        targets = {
            "recall": Target("recall", ports["library"], name, deposited, args.max_tokens),
            # Paraphrases of deposited problems: a GSM8K test problem is rarely above the graft
            # threshold (docs/library.md), and below it nothing is grafted (method none).
            "similar": Target("similar", ports["library"], name, [f"Please solve: {q}" for q in deposited], args.max_tokens),
            "base": Target("base", ports["base"], name, held_out, args.max_tokens),
            "llama": Target("llama", ports["llama"], name, held_out, args.max_tokens),
        }
        for target in targets.values():  # warm: the first request of each kind is not measured
            _measure(target, 1, 1)
        for clients in args.clients:
            for kind in KINDS:
                per_client = max(1, (args.requests if kind == "recall" else args.slow_requests) // clients)
                row = _measure(targets[kind], clients, per_client)
                say(f"{name}, {clients} clients, {kind}: p50 {row['p50_s']:.3f} s, p99 {row['p99_s']:.3f} s, "
                    f"{row['mean_decode_tokens']:.1f} decode tokens")
                rows.append(row)
    by = {(r["kind"], r["clients"]): r for r in rows}
    one = {k: by[(k, 1)] for k in KINDS if (k, 1) in by}
    summary = {
        "recall_p50_s": one["recall"]["p50_s"],
        "base_over_recall_p50": round(one["base"]["p50_s"] / one["recall"]["p50_s"], 2),
        "llama_over_recall_p50": round(one["llama"]["p50_s"] / one["recall"]["p50_s"], 2),
        "base_over_llama_p50": round(one["base"]["p50_s"] / one["llama"]["p50_s"], 2),
    }
    return {"model": name, "gguf": gguf.name, "deposited": args.deposit, "rows": rows, "one_client": summary}


def main() -> None:
    """Measure, write ``bench/results/engine_serve.json`` and its plot."""
    from kvgraft.engine import MODELS, is_installed

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_models = [m for m in ("smollm2-135m", "qwen2.5-coder-0.5b") if m in MODELS and is_installed(MODELS[m])]
    ap.add_argument("--models", nargs="+", default=default_models)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=8 if QUICK else 32, help="recall requests per client count")
    ap.add_argument("--slow-requests", type=int, default=4 if QUICK else 8,
                    help="similar, base and llama requests per client count (each decodes up to --max-tokens)")
    ap.add_argument("--deposit", type=int, default=4 if QUICK else 16, help="GSM8K train problems in the library")
    ap.add_argument("--max-tokens", type=int, default=64 if QUICK else 256, help="the budget of every request")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (the kvgraft profile's own are 2)")
    args = ap.parse_args()
    results = []
    for name in args.models:
        with tempfile.TemporaryDirectory(prefix="kvgraft-bench-engine-") as tmp:
            results.append(bench_model(name, args, Path(tmp)))
    first = next((r for r in results if r["model"] == "smollm2-135m"), None)
    met = None
    if first is not None:
        s = first["one_client"]
        met = s["recall_p50_s"] <= TARGET_RECALL_P50_S and s["base_over_recall_p50"] >= TARGET_RECALL_SPEEDUP
    write_result("engine_serve", {
        "description": "kvgraft engine serve (recall, grafted example, base) vs llama.cpp's server (same GGUF, same base "
        "prompt and budget) on 127.0.0.1, warm, 1 and 8 concurrent clients, per-request wall time",
        "client": "Python threads, one keep-alive http.client connection each; JSON bodies, no streaming",
        "max_tokens": args.max_tokens,
        "models": results,
        "target": {"model": "smollm2-135m", "recall_p50_s_max": TARGET_RECALL_P50_S, "base_over_recall_min": TARGET_RECALL_SPEEDUP},
        "met": met,
    })
    plot(results)


def plot(results: list[dict[str, Any]]) -> None:
    """p50 per kind and client count, one panel per model (log scale: recall is milliseconds, base seconds)."""
    with figure("engine_serve") as fig:
        if fig is None:
            return
        for n, res in enumerate(results, start=1):
            ax = fig.add_subplot(1, len(results), n)
            for clients in sorted({r["clients"] for r in res["rows"]}):
                rows = [r for r in res["rows"] if r["clients"] == clients]
                ax.bar([f"{r['kind']}\n{clients}c" for r in rows], [r["p50_s"] for r in rows], label=f"{clients} clients")
            ax.axhline(TARGET_RECALL_P50_S, linestyle="--", color="grey", label="recall target")
            ax.set_yscale("log")
            ax.set_ylabel("p50 seconds per answer")
            ax.set_title(res["model"])
            ax.tick_params(axis="x", labelsize=6)
            ax.legend(fontsize=7)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
