"""The engine under ``llamacpp-cpu`` against llama-cpp-python called directly (issue 36, item 5).

For each model (smollm2-135m, qwen2.5-coder-0.5b, gemma3-270m; qwen2.5-coder-1.5b when
installed), on the same GGUF, the same context settings (``LLAMACPP_SETTINGS``: n_ctx 8192,
n_batch and n_ubatch 512, 16 sequences in one unified f16 cache, flash attention, 2 threads),
side by side in one process, each contestant run ``--runs`` times in turning order:

- **prefill**: a ``--prompt-tokens`` prompt into an empty sequence, the last position's logits
  out. Ours: ``LlamaCppState.extend`` (what ``capture`` and ``fresh`` run). llama.cpp: one
  ``llama_decode`` per ``n_batch`` tokens through the bindings.
- **decode** at 1 and 16 concurrent sequences: each sequence a different short prompt, then
  ``--tokens`` greedy tokens (EOS ends a sequence early, the same for both, as both compute the
  same logits). Ours: ``ops.decode_batch`` (the engine's one decode loop for many sequences: one
  ``llama_decode`` per step, one row per sequence, ``DecodeRule`` per row). llama.cpp: the same
  loop written directly on the bindings, argmax with numpy.

tokens/s are medians over runs; ``decode_ratio`` and ``prefill_ratio`` are ours / llama.cpp's
(target: >= 0.95). Both compute with the same library on the same cells, so the ratio is what
the engine's own Python costs per step.

**serve** (``--serve-clients``, default 8): ``kvgraft engine serve --profile llamacpp-cpu``
(no library: base answers) against llama.cpp's own ``llama-server`` (``-np`` as many slots as
clients, the same threads), both on the same GGUF; each client sends ``--serve-requests`` GSM8K
test problems through ``/v1/completions`` (greedy, ``--serve-max-tokens``), after one warm-up.
``serve_ratio`` is engine serve's decode tokens/s over llama-server's (target: >= 0.9).

    .venv/bin/python bench/llamacpp.py [--models smollm2-135m] [--runs 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import KVGRAFT, RESULTS, free_port, machine, say, server_process, write_result
from engine_serve import TEST, Target, _measure, _questions

from kvgraft.engine import (
    LLAMACPP_SETTINGS,
    MODELS,
    DecodeJob,
    current_profile,
    decode_batch,
    is_installed,
    llama_cpp_bindings,
    load_model_for,
    locate_gguf,
    new_state,
    server_binary,
    spec_for,
)

PROMPTS = [f"Chapter {i}. Once upon a time, in a {c} house by the {t}, there lived a" for i, (c, t) in enumerate(
    [(c, t) for c in ("small", "red", "old", "tall") for t in ("sea", "river", "forest", "hills")])]


class Direct:
    """llama-cpp-python's bindings driven directly: a context with the profile's settings."""

    def __init__(self, name: str) -> None:
        lib = llama_cpp_bindings()
        s = LLAMACPP_SETTINGS
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = lib.llama_model_load_from_file(str(locate_gguf(spec_for(name))).encode(), mp)
        cp = lib.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = s.n_ctx, s.n_batch, s.n_ubatch, s.n_seq_max
        cp.n_threads = cp.n_threads_batch = s.threads
        cp.type_k = cp.type_v = 1
        cp.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.swa_full, cp.kv_unified, cp.no_perf = s.swa_full, s.kv_unified, True
        self.ctx = lib.llama_init_from_model(self.model, cp)
        self.mem = lib.llama_get_memory(self.ctx)
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)
        self.eos = lib.llama_vocab_eos(self.vocab)
        self.batch = lib.llama_batch_init(s.n_batch, 0, 1)

    def tokenize(self, text: str, first: bool) -> list[int]:
        lib = llama_cpp_bindings()
        data = text.encode()
        buf = (lib.llama_token * (len(data) + 8))()
        n = lib.llama_tokenize(self.vocab, data, len(data), buf, len(data) + 8, first, False)
        return list(buf[:n])

    def _run(self, rows: list[tuple[int, int, int, bool]]) -> list[np.ndarray]:
        lib = llama_cpp_bindings()
        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        if lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return [np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, i), shape=(self.n_vocab,))
                for i, r in enumerate(rows) if r[3]]

    def clear(self) -> None:
        llama_cpp_bindings().llama_memory_clear(self.mem, True)

    def prefill(self, ids: list[int]) -> None:
        step = LLAMACPP_SETTINGS.n_batch
        for at in range(0, len(ids), step):
            part = ids[at:at + step]
            self._run([(t, at + i, 0, at + i == len(ids) - 1) for i, t in enumerate(part)])

    def decode(self, prompts: list[list[int]], tokens: int) -> int:
        """Greedy decoding of every prompt as its own sequence, one batch per step; tokens made."""
        pos, nxt = [], []
        for seq, ids in enumerate(prompts):
            step = LLAMACPP_SETTINGS.n_batch
            for at in range(0, len(ids), step):
                out = self._run([(t, at + i, seq, at + i == len(ids) - 1) for i, t in enumerate(ids[at:at + step])])
            nxt.append(int(np.argmax(out[-1])))
            pos.append(len(ids))
        live = [s for s in range(len(prompts)) if nxt[s] != self.eos]
        made = [1 if s in live else 0 for s in range(len(prompts))]
        while live:
            live = [s for s in live if made[s] < tokens]
            if not live:
                break
            outs = self._run([(nxt[s], pos[s], s, True) for s in live])
            still = []
            for s, row in zip(live, outs, strict=True):
                pos[s] += 1
                nxt[s] = int(np.argmax(row))
                if nxt[s] != self.eos:
                    made[s] += 1
                    still.append(s)
            live = still
        return sum(made)


def _ours_decode(model: Any, profile: Any, prompts: list[list[int]], tokens: int) -> int:
    made = [0]

    def done(_: int, decoded: Any) -> None:
        made[0] += len(decoded.tokens)

    jobs = [DecodeJob(None, ids, max_new_tokens=tokens, keep_eos=False) for ids in prompts]
    decode_batch(model, profile, jobs, batch=len(prompts), on_done=done)
    return made[0]


def bench_model(name: str, runs: int, tokens: int, prompt_tokens: int) -> dict[str, Any]:
    profile = current_profile("llamacpp-cpu")
    ours = load_model_for(name, profile)
    direct = Direct(name)
    long = ours.tokenizer.encode(" ".join(PROMPTS * 40), first=True)[:prompt_tokens]
    times: dict[str, list[float]] = {}
    made: dict[str, int] = {}

    def timed(key: str, fn: Any) -> None:
        t0 = time.perf_counter()
        n = fn()
        times.setdefault(key, []).append(time.perf_counter() - t0)
        made[key] = n

    def ours_prefill() -> int:
        s = new_state(ours)
        s.extend(long, keep_last=1)
        s.close()
        return len(long)

    def direct_prefill() -> int:
        direct.clear()
        direct.prefill(long)
        direct.clear()
        return len(long)

    contests: list[tuple[str, Any]] = [("ours.prefill", ours_prefill), ("llama.prefill", direct_prefill)]
    for n in (1, 16):
        batch = [ours.tokenizer.encode(p, first=True) for p in PROMPTS[:n]]
        contests.append((f"ours.decode.{n}", lambda b=batch: _ours_decode(ours, profile, b, tokens)))
        contests.append((f"llama.decode.{n}", lambda b=batch: (direct.clear(), direct.decode(b, tokens), direct.clear())[1]))
    for _, fn in contests:  # warm-up, not timed: first-call costs (page faults, thread start) on both sides
        fn()
    for run in range(runs):
        order = contests[run % 2:] + contests[:run % 2]  # who goes first turns each run
        for key, fn in order:
            timed(key, fn)
    rate = {k: made[k] / statistics.median(v) for k, v in times.items()}
    out: dict[str, Any] = {"model": name, "prompt_tokens": len(long), "decode_tokens_max": tokens,
                           "tokens_per_s": {k: round(v, 2) for k, v in rate.items()}, "tokens": made,
                           "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
                           "prefill_ratio": round(rate["ours.prefill"] / rate["llama.prefill"], 3),
                           "decode_ratio": {str(n): round(rate[f"ours.decode.{n}"] / rate[f"llama.decode.{n}"], 3) for n in (1, 16)}}
    if made["ours.decode.16"] != made["llama.decode.16"] or made["ours.decode.1"] != made["llama.decode.1"]:
        out["note"] = "the two decoded different token counts (see tokens)"
    return out


def serve_model(name: str, clients: int, requests: int, max_tokens: int, tmp: Path) -> dict[str, Any]:
    """engine serve (llamacpp-cpu, base answers) against llama-server, ``clients`` at once."""
    ports = {"base": free_port(), "llama": free_port()}
    questions = _questions(TEST, clients * requests)
    serve = [*KVGRAFT, "engine", "serve", "--model", name, "--profile", "llamacpp-cpu", "--log-level", "warning",
             "--host", "127.0.0.1", "--request-timeout", "1200", "--max-queue", str(4 * clients), "--port", str(ports["base"])]
    server = [str(server_binary()), "-m", str(locate_gguf(spec_for(name))), "--host", "127.0.0.1", "--port", str(ports["llama"]),
              "-np", str(clients), "-c", str(LLAMACPP_SETTINGS.n_ctx), "-t", str(LLAMACPP_SETTINGS.threads), "--alias", "llama"]
    with (server_process(serve, tmp / "serve.log", ports["base"], "/v1/models", seconds=600),
          server_process(server, tmp / "llama-server.log", ports["llama"], "/health", seconds=600)):
        rows = {}
        for kind in ("base", "llama"):
            target = Target(kind, ports[kind], name, questions, max_tokens)
            _measure(target, 1, 1)  # warm
            rows[kind] = _measure(target, clients, requests)
    rate = {k: r["mean_decode_tokens"] * r["requests"] / r["wall_s"] for k, r in rows.items()}
    return {"model": name, "clients": clients, "requests_per_client": requests, "max_tokens": max_tokens,
            "tokens_per_s": {"engine_serve": round(rate["base"], 2), "llama_server": round(rate["llama"], 2)},
            "p50_s": {"engine_serve": rows["base"]["p50_s"], "llama_server": rows["llama"]["p50_s"]},
            "serve_ratio": round(rate["base"] / rate["llama"], 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=[m for m in ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m", "qwen2.5-coder-1.5b")
                                                     if m in MODELS and is_installed(MODELS[m])])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--serve-clients", type=int, default=8)
    ap.add_argument("--serve-requests", type=int, default=4, help="requests per client")
    ap.add_argument("--serve-max-tokens", type=int, default=48)
    ap.add_argument("--quick", action="store_true", help="small sizes: checks the script runs")
    args = ap.parse_args()
    if args.quick:
        args.models, args.runs, args.tokens, args.prompt_tokens = args.models[:1], 2, 8, 64
        args.serve_requests, args.serve_max_tokens = 1, 8
    rows = []
    for name in args.models:
        say(f"llamacpp: {name}")
        rows.append(bench_model(name, args.runs, args.tokens, args.prompt_tokens))
        say(f"  {rows[-1]['tokens_per_s']} decode_ratio {rows[-1]['decode_ratio']} prefill_ratio {rows[-1]['prefill_ratio']}")
    serve = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models[:2]:  # the two models engine_serve.py measures
            say(f"llamacpp: serve {name}, {args.serve_clients} clients")
            serve.append(serve_model(name, args.serve_clients, args.serve_requests, args.serve_max_tokens, Path(tmp)))
            say(f"  {serve[-1]['tokens_per_s']} serve_ratio {serve[-1]['serve_ratio']}")
    result = {"machine": machine(), "profile": current_profile("llamacpp-cpu").model_dump(mode="json"), "runs": args.runs,
              "target": {"decode_ratio_min": 0.95, "serve_ratio_min": 0.9},
              "rows": rows,
              "decode_ratio": {r["model"]: r["decode_ratio"] for r in rows},
              "prefill_ratio": {r["model"]: r["prefill_ratio"] for r in rows},
              "serve": serve, "serve_ratio": {r["model"]: r["serve_ratio"] for r in serve}}
    write_result("llamacpp", result)
    say(f"wrote {RESULTS / 'llamacpp.json'}")


if __name__ == "__main__":
    main()
