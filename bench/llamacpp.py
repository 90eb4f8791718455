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
``serve_ratio`` is engine serve's decode tokens/s over llama-server's (target: >= 0.9). Then, with
the base servers stopped, a third ``engine serve`` with a library of ``--deposit`` GSM8K train
problems deposited under ``llamacpp-cpu`` answers each deposited problem again, one client:
``recall_p50_s`` (target: <= 0.3 s).

**ttft** (first two models): time to first token after a stored prefix of each
``--ttft-lengths``: the engine's graft from its local store (``load_artifact``: signature,
``kv.safetensors`` sha256 and bindings checked, tensors decoded; then ``graft``: the cells set into
an empty sequence and the question run) against llama.cpp's own ``llama_state_seq_load_file`` of
the file llama.cpp wrote for the same tokens, then the question. ``graft_over_llama_restore``
(target: <= 1.1); the graft's phases say what verification costs.

    .venv/bin/python bench/llamacpp.py [--models smollm2-135m] [--sections decode ttft serve] [--runs 5]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import KVGRAFT, corpus_text, figure, free_port, machine, median, say, server_process, write_result
from engine_serve import TEST, TRAIN, Target, _measure, _questions, _run

from kvgraft.engine import (
    KV_FILE,
    LLAMACPP_SETTINGS,
    MODELS,
    DecodeJob,
    capture,
    current_profile,
    decode_batch,
    ensure_local_key,
    graft,
    is_installed,
    llama_cpp_bindings,
    load_artifact,
    load_model_for,
    locate_gguf,
    new_state,
    server_binary,
    spec_for,
    trust_signer,
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

    def save_seq(self, path: Path, ids: list[int]) -> int:
        """llama.cpp's own sequence state file for sequence 0 (which holds ``ids``); its bytes."""
        lib = llama_cpp_bindings()
        arr = (lib.llama_token * len(ids))(*ids)
        if lib.llama_state_seq_save_file(self.ctx, str(path).encode(), 0, arr, len(ids)) == 0:
            raise SystemExit(f"llama_state_seq_save_file failed for {path}")
        return path.stat().st_size

    def load_seq(self, path: Path, capacity: int) -> int:
        """Restore the file into sequence 0 (emptied first); the number of tokens it held."""
        lib = llama_cpp_bindings()
        arr = (lib.llama_token * capacity)()
        n = ctypes.c_size_t(0)
        if lib.llama_state_seq_load_file(self.ctx, str(path).encode(), 0, arr, capacity, ctypes.byref(n)) == 0:
            raise SystemExit(f"llama_state_seq_load_file failed for {path}")
        return n.value

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


QUESTION = "\n\nQuestion: How many apples are left if you eat three of seven apples?\nAnswer:"


def _ttft_runs(ours: Any, profile: Any, direct: Direct, trusted: Any, art_dir: Path, state_file: Path, prefix_tokens: int,
               q_ids: list[int], runs: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``runs`` timings of each (after one warm-up each), turning order: seconds, and the graft's phases."""
    times: dict[str, list[float]] = {"graft": [], "llama_restore": []}
    phases: dict[str, list[float]] = {"load": [], "restore": [], "pass": []}

    def ours_ttft() -> None:
        t0 = time.perf_counter()
        art = load_artifact(art_dir, ours, profile, trusted=trusted)
        t1 = time.perf_counter()
        cont = graft(ours, profile, art, QUESTION, keep_last=1)
        times["graft"].append(time.perf_counter() - t0)
        phases["load"].append(t1 - t0)
        phases["restore"].append(cont.state_seconds)
        phases["pass"].append(cont.pass_seconds)
        if cont.prefix_tokens != prefix_tokens or cont.continuation_ids != q_ids:
            raise SystemExit("the graft ran other tokens than llama.cpp's restore")

    def llama_ttft() -> None:
        direct.clear()
        t0 = time.perf_counter()
        n = direct.load_seq(state_file, LLAMACPP_SETTINGS.n_ctx)
        direct._run([(t, n + i, 0, i == len(q_ids) - 1) for i, t in enumerate(q_ids)])
        times["llama_restore"].append(time.perf_counter() - t0)
        if n != prefix_tokens:
            raise SystemExit(f"llama.cpp restored {n} tokens, not {prefix_tokens}")

    ours_ttft()  # warm, not timed
    llama_ttft()
    for series in (*times.values(), *phases.values()):
        series.clear()
    for run in range(runs):
        for fn in ((ours_ttft, llama_ttft) if run % 2 == 0 else (llama_ttft, ours_ttft)):
            fn()
    return times, phases


def ttft_model(name: str, lengths: list[int], runs: int, work: Path) -> dict[str, Any]:
    """Time to first token after a stored prefix: our graft against llama.cpp's own restore.

    For each prefix length L (GSM8K text, cut at L tokens): **graft** is the engine's normal path
    from the local store, ``load_artifact`` (statement read, signature checked against the key
    that made it, ``kv.safetensors`` sha256-checked, model/tokenizer/profile/build checked,
    tensors decoded) then ``graft`` (the state encoded to llama.cpp's cell layout and set into an
    empty sequence, then ``QUESTION`` run, the last position's logits out). **llama.cpp restore**
    is the same context settings driven directly: ``llama_state_seq_load_file`` of the sequence
    file llama.cpp itself wrote for the same L tokens into an empty sequence, then the question,
    last logits. The two turn order each run; medians of ``runs``. Where the graft's time goes is
    recorded too (load = verification and decoding, restore, the question's pass).
    """
    profile = current_profile("llamacpp-cpu")
    ours = load_model_for(name, profile)
    direct = Direct(name)
    key = ensure_local_key()[0]
    trusted = trust_signer(key)
    text_ids = ours.tokenizer.encode(corpus_text(8 * max(lengths) + 4096), first=True)
    q_ids = ours.tokenizer.encode(QUESTION, first=False)
    rows = []
    for length in lengths:
        if length + len(q_ids) > LLAMACPP_SETTINGS.n_ctx:
            continue
        prefix = ours.tokenizer.decode(text_ids[:length])
        art_dir = work / f"{name}-{length}"
        captured = capture(ours, profile, prefix, art_dir, key=key)
        ids = ours.tokenizer.encode(prefix, first=True)
        state_file = work / f"{name}-{length}.llama-seq"
        direct.clear()
        direct.prefill(ids)
        llama_bytes = direct.save_seq(state_file, ids)
        times, phases = _ttft_runs(ours, profile, direct, trusted, art_dir, state_file, len(ids), q_ids, runs)
        direct.clear()
        m = {k: median(v) for k, v in times.items()}
        rows.append({"prefix_tokens": len(ids), "question_tokens": len(q_ids),
                     "kv_bytes": (art_dir / KV_FILE).stat().st_size, "llama_state_bytes": llama_bytes,
                     "median_s": {k: round(v, 4) for k, v in m.items()},
                     "graft_phases_median_s": {k: round(median(v), 4) for k, v in phases.items()},
                     "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
                     "graft_over_llama_restore": round(m["graft"] / m["llama_restore"], 3),
                     "artifact": str(captured.kv_digest)})
        say(f"  ttft {name} L={len(ids)}: graft {m['graft']:.3f} s, llama.cpp restore {m['llama_restore']:.3f} s "
            f"({rows[-1]['graft_over_llama_restore']}x; load {rows[-1]['graft_phases_median_s']['load']:.3f} s)")
    return {"model": name, "rows": rows}


def serve_model(name: str, clients: int, requests: int, max_tokens: int, deposit: int, recalls: int, tmp: Path) -> dict[str, Any]:
    """engine serve (llamacpp-cpu) against llama-server: base answers with ``clients`` at once,
    and recalled answers (a library of ``deposit`` GSM8K train problems deposited under
    llamacpp-cpu, each asked again) one client at a time."""
    ports = {"base": free_port(), "llama": free_port(), "library": free_port()}
    questions = _questions(TEST, clients * requests)
    key, trust, library = tmp / f"{name}-key.pem", tmp / f"{name}-trusted-keys.json", tmp / f"{name}-library"
    _run("keys", "generate", "--out", key)
    _run("keys", "trust", "--file", trust, "--name", "bench", "--public-key", f"{key}.pub")
    _run("library", "deposit", "--model", name, "--profile", "llamacpp-cpu", "--dataset", TRAIN, "--library", library,
         "--limit", deposit, "--key", key)
    serve = [*KVGRAFT, "engine", "serve", "--model", name, "--profile", "llamacpp-cpu", "--log-level", "warning",
             "--host", "127.0.0.1", "--request-timeout", "1200", "--max-queue", str(4 * clients)]
    server = [str(server_binary()), "-m", str(locate_gguf(spec_for(name))), "--host", "127.0.0.1", "--port", str(ports["llama"]),
              "-np", str(clients), "-c", str(LLAMACPP_SETTINGS.n_ctx), "-t", str(LLAMACPP_SETTINGS.threads), "--alias", "llama"]
    with (server_process([*serve, "--port", str(ports["base"])], tmp / "serve.log", ports["base"], "/v1/models", seconds=600),
          server_process(server, tmp / "llama-server.log", ports["llama"], "/health", seconds=600)):
        rows = {}
        for kind in ("base", "llama"):
            target = Target(kind, ports[kind], name, questions, max_tokens)
            _measure(target, 1, 1)  # warm
            rows[kind] = _measure(target, clients, requests)
    # Alone on the machine: the library's server is not started until the base servers are gone.
    with server_process([*serve, "--library", str(library), "--trusted-keys", str(trust), "--port", str(ports["library"])],
                        tmp / "serve-library.log", ports["library"], "/v1/models", seconds=600):
        target = Target("recall", ports["library"], name, _questions(TRAIN, deposit), max_tokens)
        _measure(target, 1, 1)  # warm
        recall = _measure(target, 1, recalls)
    rate = {k: r["mean_decode_tokens"] * r["requests"] / r["wall_s"] for k, r in rows.items()}
    return {"model": name, "clients": clients, "requests_per_client": requests, "max_tokens": max_tokens,
            "tokens_per_s": {"engine_serve": round(rate["base"], 2), "llama_server": round(rate["llama"], 2)},
            "p50_s": {"engine_serve": rows["base"]["p50_s"], "llama_server": rows["llama"]["p50_s"]},
            "serve_ratio": round(rate["base"] / rate["llama"], 3),
            "recall": {"deposited": deposit, "requests": recall["requests"], "p50_s": recall["p50_s"], "p99_s": recall["p99_s"],
                       "mean_decode_tokens": recall["mean_decode_tokens"]}}


SECTIONS = ("decode", "ttft", "serve")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=[m for m in ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m", "qwen2.5-coder-1.5b")
                                                     if m in MODELS and is_installed(MODELS[m])])
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                    help="what to measure (default: all; the JSON holds only what this run measured)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--ttft-lengths", type=int, nargs="+", default=[512, 2048, 6144], help="prefix tokens for the TTFT rows")
    ap.add_argument("--serve-clients", type=int, default=8)
    ap.add_argument("--serve-requests", type=int, default=4, help="requests per client")
    ap.add_argument("--serve-max-tokens", type=int, default=48)
    ap.add_argument("--deposit", type=int, default=16, help="GSM8K train problems in the recall server's library")
    ap.add_argument("--recalls", type=int, default=16, help="recalled answers asked, one client")
    ap.add_argument("--quick", action="store_true", help="small sizes: checks the script runs")
    args = ap.parse_args()
    if args.quick:
        args.models, args.runs, args.tokens, args.prompt_tokens = args.models[:1], 2, 8, 64
        args.serve_requests, args.serve_max_tokens, args.ttft_lengths, args.deposit, args.recalls = 1, 8, [256], 2, 2
    result: dict[str, Any] = {"machine": machine(), "profile": current_profile("llamacpp-cpu").model_dump(mode="json"),
                              "runs": args.runs, "sections": args.sections,
                              "target": {"decode_ratio_min": 0.95, "serve_ratio_min": 0.9, "recall_p50_s_max": 0.3,
                                         "graft_over_llama_restore_max": 1.1}}
    if "decode" in args.sections:
        rows = []
        for name in args.models:
            say(f"llamacpp: {name}")
            rows.append(bench_model(name, args.runs, args.tokens, args.prompt_tokens))
            say(f"  {rows[-1]['tokens_per_s']} decode_ratio {rows[-1]['decode_ratio']} prefill_ratio {rows[-1]['prefill_ratio']}")
        result |= {"rows": rows, "decode_ratio": {r["model"]: r["decode_ratio"] for r in rows},
                   "prefill_ratio": {r["model"]: r["prefill_ratio"] for r in rows}}
        write_result("llamacpp", result)  # each section as it ends: a later failure keeps the earlier figures
    with tempfile.TemporaryDirectory() as tmp:
        if "ttft" in args.sections:
            ttft = []
            for name in args.models[:2]:
                say(f"llamacpp: ttft {name}")
                ttft.append(ttft_model(name, args.ttft_lengths, args.runs, Path(tmp)))
            result |= {"ttft": ttft, "graft_over_llama_restore": {
                t["model"]: {str(r["prefix_tokens"]): r["graft_over_llama_restore"] for r in t["rows"]} for t in ttft}}
            write_result("llamacpp", result)
        if "serve" in args.sections:
            serve = []
            for name in args.models[:2]:  # the two models engine_serve.py measures
                say(f"llamacpp: serve {name}, {args.serve_clients} clients")
                serve.append(serve_model(name, args.serve_clients, args.serve_requests, args.serve_max_tokens,
                                         args.deposit, args.recalls, Path(tmp)))
                say(f"  {serve[-1]['tokens_per_s']} serve_ratio {serve[-1]['serve_ratio']} recall p50 {serve[-1]['recall']['p50_s']} s")
            result |= {"serve": serve, "serve_ratio": {r["model"]: r["serve_ratio"] for r in serve},
                       "recall_p50_s": {r["model"]: r["recall"]["p50_s"] for r in serve}}
    write_result("llamacpp", result)
    plot(result)


def plot(result: dict[str, Any]) -> None:
    """Every ratio against its target: decode (1 and 16 sequences), prefill, serve, graft TTFT."""
    bars: list[tuple[str, float, float]] = []  # (label, ratio, target; above the line is good for the first kinds)
    for model, by in result.get("decode_ratio", {}).items():
        bars += [(f"{model}\ndecode x1", by["1"], 0.95), (f"{model}\ndecode x16", by["16"], 0.95)]
    for model, r in result.get("prefill_ratio", {}).items():
        bars.append((f"{model}\nprefill", r, 0.95))
    for model, r in result.get("serve_ratio", {}).items():
        bars.append((f"{model}\nserve x8", r, 0.9))
    restore = [(f"{m}\nTTFT {n}", r) for m, by in result.get("graft_over_llama_restore", {}).items() for n, r in by.items()]
    with figure("llamacpp") as fig:
        if fig is None:
            return
        ax = fig.add_subplot(1, 1, 1)
        labels = [b[0] for b in bars] + [r[0] for r in restore]
        values = [b[1] for b in bars] + [r[1] for r in restore]
        colors = ["tab:blue"] * len(bars) + ["tab:orange"] * len(restore)
        ax.bar(range(len(values)), values, color=colors)
        ax.axhline(0.95, color="tab:blue", linestyle="--", linewidth=0.8, label="speed target (ours / llama.cpp >= 0.95; serve >= 0.9)")
        ax.axhline(1.1, color="tab:orange", linestyle="--", linewidth=0.8, label="graft TTFT / llama.cpp restore <= 1.1")
        ax.set_xticks(range(len(values)), labels, rotation=90, fontsize=6)
        ax.set_ylabel("ratio")
        ax.set_title("llamacpp-cpu: the engine against llama.cpp on the same GGUF")
        ax.legend(fontsize=7)


if __name__ == "__main__":
    main()
