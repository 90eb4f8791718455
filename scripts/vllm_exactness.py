"""The connector's exactness inside vLLM: cold against connector-warm, as a signed exactness record.

Run with .venv-vllm's python (``make vllm``)::

    .venv-vllm/bin/python scripts/vllm_exactness.py --model DIR --samples 50 --key KEY.pem \\
        --out results/exactness/smollm2-135m-vllm-cpu-fp32
    .venv/bin/kvgraft-verify exactness results/exactness/smollm2-135m-vllm-cpu-fp32 \\
        --trusted-keys results/exactness/vllm-trusted-keys.json

``--mode connector`` (the default) writes the record. Each sample is a prompt drawn as kvgraft's own
experiment draws prefixes (whole GSM8K and AIME 2025 documents from data/datasets/, picked by a
seeded RNG, cut to a target length; targets spread evenly over ``[--min-tokens, --max-tokens]``).
vLLM runs it cold (vLLM's prefix cache off and the connector's store, a temporary directory of its
own, emptied after every sample: nothing is loaded, its blocks are saved), then again warm: the connector must load every usable block
(``num_cached_tokens`` says so, else the run stops). Each run decodes ``--continuation`` tokens
greedily and returns the full-vocabulary raw logits of every step (``logprobs_mode="raw_logits"``,
``logprobs=-1``); the record compares their SHA-256, KL divergence and argmax, with the verifier's
own code, and attaches the logits files (``logits/<sha256>.f32``, float32 ``[steps, vocab]``).
Samples run one at a time: vLLM's CPU build is not batch-invariant, and one at a time both runs
have the same batch shape.

The record's ``prefix_artifact`` is the tensors digest of the last block loaded (its chain key
covers the whole loaded prefix); ``model.weights_digest`` is the GGUF sha256 for a model kvgraft
converted (its ``COMPLETE`` file), else the binding's weights digest; ``model.config_digest`` is
the binding's (sha256 of the canonical ``config.json``); the profile names vLLM, the attention
backend and the binding digest.

``--mode prefix-cache`` measures vLLM's own prefix cache under the same settings, without the
connector: each prompt cold (after ``reset_prefix_cache``), then warm (vLLM's cache hit), and
writes the same comparisons as JSON to ``--out`` (no signature: it is vLLM's claim, not kvgraft's).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data" / "datasets"
SOURCES = ("gsm8k_test.jsonl", "aime2025.jsonl")
BLOCK = 32


def documents() -> tuple[list[str], list[dict[str, str]]]:
    """The sample texts and their dataset refs, as kvgraft's exactness experiment reads them."""
    from kvgraft.schemas import sha256_file

    docs: list[str] = []
    refs = []
    for name in SOURCES:
        path = DATA / name
        refs.append({"name": name, "digest": sha256_file(path)})
        for line in filter(None, path.read_text(encoding="utf-8").split("\n")):
            row = json.loads(line)
            docs.append(f"Question: {row['question']}\nAnswer: {row['answer']}\n\n" if "question" in row
                        else f"Problem: {row['prompt']}\nAnswer: {row['answer']}\n\n")
    return docs, refs


def draw_prompts(tokenizer: Any, samples: int, seed: int, min_tokens: int, max_tokens: int) -> list[list[int]]:
    """Token ids of ``samples`` prompts, lengths spread evenly over ``[min_tokens, max_tokens]``."""
    docs, _ = documents()
    rng = random.Random(seed)
    prompts = []
    for i in range(samples):
        target = min_tokens if samples == 1 else min_tokens + (i * (max_tokens - min_tokens)) // (samples - 1)
        j = rng.randrange(len(docs))
        text, ids = "", []
        while len(ids) < target:
            text += docs[j % len(docs)]
            j += 1
            ids = tokenizer.encode(text)
        prompts.append(list(ids[:target]))
    return prompts


def loadable(prompt_tokens: int) -> int:
    """Tokens the connector loads for a stored prompt (its _loadable_blocks: at least two are computed)."""
    blocks = (prompt_tokens - 1) // BLOCK
    return (blocks - 1 if blocks > 0 and prompt_tokens - blocks * BLOCK == 1 else blocks) * BLOCK


def generate(llm: Any, ids: list[int], steps: int) -> tuple[list[int], np.ndarray, int]:
    """Greedy ``steps`` tokens: their ids, the raw logits of every step ``[steps, vocab]``, cached tokens."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=steps, min_tokens=steps, temperature=0.0, logprobs=-1, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
    completion = out.outputs[0]
    vocab = len(completion.logprobs[0])
    logits = np.empty((len(completion.logprobs), vocab), dtype="<f4")
    for row, step in enumerate(completion.logprobs):
        for token, entry in step.items():
            logits[row, token] = entry.logprob  # raw logits under logprobs_mode="raw_logits"
    return list(completion.token_ids), logits, int(out.num_cached_tokens or 0)


def make_llm(model: str, connector: dict[str, str] | None, prefix_cache: bool) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    config = None if connector is None else KVTransferConfig(
        kv_connector="KvgraftConnector", kv_connector_module_path="kvgraft.integrations.vllm", kv_role="kv_both",
        kv_connector_extra_config=connector)
    return LLM(model=model, dtype="float32", max_model_len=1024, block_size=BLOCK, enforce_eager=True, seed=0,
               enable_prefix_caching=prefix_cache, max_logprobs=-1, logprobs_mode="raw_logits", max_num_seqs=1,
               kv_transfer_config=config)


def last_block(store: Path, ids: list[int]) -> Any:
    """The statement of the last usable block of ``ids`` in ``store`` (read, not verified: the
    connector verified it when it loaded it)."""
    from kvgraft.integrations.vllm import VllmBlockStatement, block_dir, chain_keys
    from kvgraft.schemas import statement_unverified

    def statement(directory: Path) -> Any:
        envelope = (directory / "statement.dsse.json").read_bytes()
        return VllmBlockStatement.model_validate(statement_unverified(envelope).model_dump(by_alias=True), strict=False)

    some = next(p for p in sorted(store.iterdir()) if p.is_dir() and not p.name.startswith("."))
    p = statement(some).predicate
    blocks = loadable(len(ids)) // p.binding.block_size
    return statement(block_dir(store, chain_keys(p.binding_digest, ids, p.binding.block_size, blocks)[-1]))


def compare(index: int, ids: list[int], cold: tuple[list[int], np.ndarray], warm: tuple[list[int], np.ndarray],
            stage: Path, artifact: str | None) -> Any:
    from kvgraft.schemas import ExactnessSample, LogitsFiles, canonical_json, sha256_bytes
    from kvgraft.verifier import compare_logits, logits_file_name

    digests = []
    for arr in (cold[1], warm[1]):
        data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
        digest = sha256_bytes(data)
        path = stage / logits_file_name(digest)
        if not path.exists():  # equal logits share one file
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        digests.append(digest)
    c = compare_logits(cold[1], warm[1])
    return ExactnessSample(
        index=index, prefix_artifact=artifact or sha256_bytes(b""), prefix_tokens=len(ids),
        continuation_digest=sha256_bytes(canonical_json(cold[0])), continuation_tokens=len(cold[0]),
        fresh_logits_sha256=digests[0], graft_logits_sha256=digests[1], bitwise_equal=digests[0] == digests[1],
        kl_divergence=c.kl_divergence, argmax_agreement=c.argmax_agreement,
        logits_files=LogitsFiles(fresh=digests[0], graft=digests[1]))


def run_connector(args: argparse.Namespace) -> int:
    import torch
    import transformers

    from kvgraft.schemas import (
        RECORD_FILE,
        DatasetRef,
        DeterminismProfile,
        ExactnessPredicate,
        ExactnessStatement,
        ExactnessSummary,
        ModelRef,
        StagedDirectory,
        Subject,
        SubjectDigest,
        hex_of,
    )
    from kvgraft.verifier import (
        SigningKey,
        TrustedKeys,
        envelope_json,
        load_private_key,
        logits_file_name,
        sign_statement,
        trusted_key,
    )

    signer = SigningKey(load_private_key(args.key))
    work = Path(tempfile.mkdtemp(prefix="vllm-exactness-"))
    trusted = work / "trusted-keys.json"
    trusted.write_text(json.dumps(TrustedKeys(keys=(trusted_key("exactness", signer.public_key),)).to_json()))
    store = work / "store"  # its own: it is emptied after every sample
    binding_predicate = None
    llm = make_llm(args.model, {"store": str(store), "key": str(args.key), "trusted_keys": str(trusted)}, prefix_cache=False)
    prompts = draw_prompts(llm.get_tokenizer(), args.samples, args.seed, args.min_tokens, args.max_tokens)
    started = time.monotonic()
    with StagedDirectory(args.out, tag="vllm-exactness") as stage:
        samples = []
        for index, ids in enumerate(prompts):
            cold_ids, cold_logits, cold_cached = generate(llm, ids, args.continuation)
            warm_ids, warm_logits, warm_cached = generate(llm, ids, args.continuation)
            vocab = int(cold_logits.shape[1])
            usable = loadable(len(ids))
            if cold_cached != 0 or warm_cached != usable:
                sys.stderr.write(f"sample {index}: {len(ids)} prompt tokens, cold loaded {cold_cached}, warm loaded {warm_cached} "
                                 f"(want 0 and {usable}): not a cold/warm pair\n")
                raise SystemExit(1)  # an exception: the staged record directory is discarded, nothing appears at --out
            last = last_block(store, ids)
            if index == len(prompts) - 1:
                binding_predicate = last.predicate
            artifact = "sha256:" + last.subject[0].digest.sha256
            samples.append(compare(index, ids, (cold_ids, cold_logits), (warm_ids, warm_logits), stage.path, artifact))
            # Prompts drawn from the same documents share prefixes: empty the store, so that the next
            # sample's cold run is cold (vLLM's prefix cache is off, so nothing else is cached).
            for block in store.iterdir():
                shutil.rmtree(block)
            s = samples[-1]
            sys.stderr.write(f"sample {index + 1}/{len(prompts)}: {len(ids)} prompt tokens, {warm_cached} loaded, "
                             f"sha256 {'equal' if s.bitwise_equal else 'DIFFERENT'}, KL {s.kl_divergence:.3g}\n")
        p = binding_predicate
        binding = p.binding
        complete = Path(args.model) / "COMPLETE"
        weights = ("sha256:" + complete.read_text().strip()) if complete.is_file() and complete.read_text().strip() else binding.weights_digest
        profile = DeterminismProfile(
            name=f"vllm-cpu-{binding.vllm_version}-{binding.model_dtype}", exactness="own-position", device_kind="cpu",
            device_fingerprint=binding.device, dtype=binding.model_dtype, torch_version=torch.__version__,
            transformers_version=transformers.__version__,
            kernel_versions={"vllm": binding.vllm_version, "attention_backend": binding.attention_backend, "binding": p.binding_digest},
            threads=os.cpu_count() or 1, attention_implementation=f"vllm:{binding.attention_backend}", matmul_tiling="default",
            prefill_chunk=None, deterministic_algorithms=False)
        _, refs = documents()
        comparisons = [(s.kl_divergence, s.argmax_agreement) for s in samples]
        names = sorted({s.fresh_logits_sha256 for s in samples} | {s.graft_logits_sha256 for s in samples})
        statement = ExactnessStatement(
            subject=[Subject(name=logits_file_name(d), digest=SubjectDigest(sha256=hex_of(d))) for d in names],
            predicate=ExactnessPredicate(
                model=ModelRef(name=args.model_name or _model_name(binding.model_name), weights_digest=weights,
                               config_digest=binding.config_digest),
                profile=profile, level="own-position", shift=0, vocab_size=vocab,
                data_sources=[DatasetRef(name=r["name"], digest=r["digest"]) for r in refs], seed=args.seed, samples=samples,
                summary=ExactnessSummary(
                    samples=len(samples), bitwise_equal=sum(s.bitwise_equal for s in samples),
                    argmax_agree_all=sum(a == 1.0 for _, a in comparisons), max_kl_divergence=max(k for k, _ in comparisons),
                    mean_argmax_agreement=sum(a for _, a in comparisons) / len(comparisons))))
        stage.write(RECORD_FILE, envelope_json(sign_statement(statement, [signer])))
    signer.close()
    t = statement.predicate.summary
    print(f"{args.out}: {t.bitwise_equal}/{t.samples} SHA-256 equal, argmax all-agree {t.argmax_agree_all}/{t.samples}, "
          f"max KL {t.max_kl_divergence}, {time.monotonic() - started:.0f} s")
    return 0


def _model_name(directory_name: str) -> str:
    """``smollm2-135m-<64 hex>`` (kvgraft's converted-model cache) -> ``smollm2-135m``."""
    head, _, tail = directory_name.rpartition("-")
    return head if head and len(tail) == 64 and all(c in "0123456789abcdef" for c in tail) else directory_name


def run_prefix_cache(args: argparse.Namespace) -> int:
    from kvgraft.verifier import compare_logits

    llm = make_llm(args.model, None, prefix_cache=True)
    prompts = draw_prompts(llm.get_tokenizer(), args.samples, args.seed, args.min_tokens, args.max_tokens)
    rows = []
    for index, ids in enumerate(prompts):
        llm.reset_prefix_cache()
        cold = generate(llm, ids, args.continuation)
        warm = generate(llm, ids, args.continuation)
        c = compare_logits(cold[1], warm[1])
        rows.append({"index": index, "prompt_tokens": len(ids), "cold_cached": cold[2], "warm_cached": warm[2],
                     "bitwise_equal": bool(np.array_equal(cold[1], warm[1])), "same_tokens": cold[0] == warm[0],
                     "kl_divergence": c.kl_divergence, "argmax_agreement": c.argmax_agreement})
        sys.stderr.write(f"sample {index + 1}/{len(prompts)}: {len(ids)} tokens, warm cached {warm[2]}, "
                         f"{'equal' if rows[-1]['bitwise_equal'] else 'DIFFERENT'}\n")
    summary = {"what": "vLLM's own prefix cache, cold (after reset_prefix_cache) against warm (its cache hit), no connector",
               "model": args.model, "samples": len(rows), "seed": args.seed, "continuation_tokens": args.continuation,
               "bitwise_equal": sum(r["bitwise_equal"] for r in rows), "same_tokens": sum(r["same_tokens"] for r in rows),
               "max_kl_divergence": max(r["kl_divergence"] for r in rows), "rows": rows}
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"{args.out}: vLLM prefix cache {summary['bitwise_equal']}/{len(rows)} SHA-256 equal, max KL {summary['max_kl_divergence']}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="local model directory, e.g. $KVGRAFT_HOME/models/smollm2-135m-<sha256>")
    parser.add_argument("--out", required=True, type=Path, help="the new record directory (connector) or JSON file (prefix-cache)")
    parser.add_argument("--mode", choices=["connector", "prefix-cache"], default="connector")
    parser.add_argument("--key", type=Path, help="PEM private key that signs the record and the blocks (connector mode)")
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=800)
    parser.add_argument("--continuation", type=int, default=4, help="greedy tokens decoded per run")
    parser.add_argument("--model-name", help="the record's model name (default: the directory's name, without a kvgraft cache suffix)")
    args = parser.parse_args()
    if not 1 <= args.samples <= 1000 or not 1 <= args.continuation <= 64 or not BLOCK + 1 <= args.min_tokens <= args.max_tokens <= 1000:
        parser.error("need 1 <= --samples <= 1000, 1 <= --continuation <= 64, 33 <= --min-tokens <= --max-tokens <= 1000")
    if args.out.exists():
        parser.error(f"{args.out} already exists: pick a new --out")
    if args.mode == "connector":
        if args.key is None:
            parser.error("--key is required in connector mode (it signs the record)")
        return run_connector(args)
    return run_prefix_cache(args)


if __name__ == "__main__":  # vLLM starts its engine core in a child process, which imports this file
    sys.exit(main())
