"""Drives a real vLLM engine (run with .venv-vllm's python) through the connector's checks.

Called by test_vllm_connector.py; writes one JSON document of what it saw to --out, and vLLM's
and the connector's log to stderr. Two phases share one store:

- ``first`` (prefix caching on): each prompt cold (they share a prefix; prompt 0 is the first, so
  it loads nothing), saving their blocks; each again warm after the engine's own prefix cache is
  reset (they load them); again after one byte of a stored tensor file of prompt 0 is changed;
  again after a block of prompt 1 is replaced by a block signed by a trusted key for another
  model; again after a block of prompt 3 is deleted from the store; then a 97-token prompt cold
  and warm.
- ``second`` (a fresh engine, prefix caching off, chunked prefill in 64-token chunks): each prompt
  warm from the store; then all six at once; then prompt 2 with a ``cache_salt``.

Prompts run one at a time except in the batch: vLLM's CPU build is not batch-invariant (a prompt
decoded alone and beside five others differ in the last bits of their logprobs), and which
requests the engine groups depends on when they arrive.

Each generation records token ids, the top-k logprobs of every step, and num_cached_tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

SHARED = ("You are a careful assistant for a public library. Answer in one short sentence, cite the shelf, "
          "and never invent a book. The library opens at nine and closes at six; the reading room is upstairs. "
          "Children's books are on the ground floor, maps and atlases in the east wing, periodicals by the windows, "
          "and the rare books behind the desk, where a librarian must fetch them for you. ")
QUESTIONS = [
    "Where would I find books about the history of bridges, tunnels and the engineers who built the great railways of Europe?",
    "Which shelf holds the poetry written by sailors, whalers and lighthouse keepers during the nineteenth century?",
    "Do you keep any atlases of the ocean floor, the polar ice caps, and the long rivers of South America?",
    "I am looking for cookbooks about bread, fermentation, cheese making and the old village bakeries of Italy.",
    "Can you point me to the shelf with manuals on clock repair, watchmaking tools and mechanical calendars?",
    "Where are the books on birds of the northern forests, their songs, their nests and their long migrations?",
]
TOP_LOGPROBS = 5
MAX_TOKENS = 4


def prompts() -> list[str]:
    """The prompts: one shared prefix (its first blocks are shared), then a question of their own."""
    return [SHARED + q + " I have an hour before my train leaves, so " + q.lower() for q in QUESTIONS]


def _record(out: Any) -> dict[str, Any]:
    completion = out.outputs[0]
    steps = [sorted((int(t), float(lp.logprob)) for t, lp in step.items()) for step in (completion.logprobs or [])]
    return {"prompt_tokens": len(out.prompt_token_ids or []), "token_ids": list(completion.token_ids),
            "logprobs": steps, "num_cached_tokens": int(out.num_cached_tokens or 0)}


def _params() -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=TOP_LOGPROBS)


def run(llm: Any, texts: list[Any]) -> list[dict[str, Any]]:
    """Each prompt alone, one after another: the same batch shape every time, so bits compare."""
    return [_record(llm.generate([text], _params(), use_tqdm=False)[0]) for text in texts]


def run_batch(llm: Any, texts: list[Any]) -> list[dict[str, Any]]:
    """Every prompt at once. vLLM's CPU build is not batch-invariant and how the engine groups
    requests that arrive together depends on timing, so batched logprobs compare only closely."""
    return [_record(out) for out in llm.generate(texts, _params(), use_tqdm=False)]


def engine_binding(store: Path) -> tuple[Any, int]:
    """The engine's binding digest and block size, read from a block it stored. Read before any
    block is forged: a forged block holds another model's binding, and which directory the
    store lists first depends on the chain keys (the regression: on one machine the forged
    block came first, and the retired block was looked up under the forged binding)."""
    from kvgraft.integrations.vllm import VllmBlockStatement
    from kvgraft.schemas import statement_unverified

    some = next(p for p in store.iterdir() if p.is_dir() and not p.name.startswith("."))
    envelope = (some / "statement.dsse.json").read_bytes()
    statement = VllmBlockStatement.model_validate(statement_unverified(envelope).model_dump(by_alias=True), strict=False)
    return statement.predicate.binding_digest, statement.predicate.binding.block_size


def block_of(store: Path, binding: tuple[Any, int], llm: Any, text: str, index: int) -> Path:
    """The stored block directory of block ``index`` of ``text``, found by its chain key under the
    engine's ``binding`` (``engine_binding``)."""
    from kvgraft.integrations.vllm import block_dir, chain_keys

    ids = llm.get_tokenizer().encode(text)
    digest, block_size = binding
    keys = chain_keys(digest, ids, block_size, index + 1)
    return block_dir(store, keys[index])


def tamper(directory: Path) -> None:
    """Change one byte in the middle of the block's tensors file."""
    path = directory / "kv.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def forge_other_model(directory: Path, key: Path) -> None:
    """Replace the block's statement by one a trusted key signed for another model's binding."""
    from kvgraft.integrations.vllm import VllmBlockStatement, binding_digest, block_chain_key
    from kvgraft.schemas import sha256_bytes, statement_unverified
    from kvgraft.verifier import SigningKey, envelope_json, load_private_key, sign_statement

    envelope = (directory / "statement.dsse.json").read_bytes()
    statement = VllmBlockStatement.model_validate(statement_unverified(envelope).model_dump(by_alias=True), strict=False)
    p = statement.predicate
    other = p.binding.model_copy(update={"model_name": "gemma3-270m", "weights_digest": sha256_bytes(b"another model's weights")})
    digest = binding_digest(other)
    forged = statement.model_copy(update={"predicate": p.model_copy(update={
        "binding": other, "binding_digest": digest, "chain_key": block_chain_key(p.parent, digest, p.tokens.ids)})})
    signer = SigningKey(load_private_key(key))
    (directory / "statement.dsse.json").write_bytes(envelope_json(sign_statement(forged, [signer])))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--store", required=True, type=Path)
    parser.add_argument("--key", required=True, type=Path)
    parser.add_argument("--trusted-keys", required=True)
    parser.add_argument("--phase", choices=["first", "second"], required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()

    from vllm import LLM
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(kv_connector="KvgraftConnector", kv_connector_module_path="kvgraft.integrations.vllm",
                              kv_role="kv_both", kv_connector_extra_config={
                                  "store": str(args.store), "key": str(args.key), "trusted_keys": args.trusted_keys})
    # first: the engine's prefix cache on, whole prompts in one step. second: the prefix cache off,
    # chunked prefill in chunks of 64 tokens (each prompt takes several steps).
    first = args.phase == "first"
    llm = LLM(model=args.model, dtype="float32", max_model_len=512, block_size=32, enforce_eager=True,
              enable_prefix_caching=first, enable_chunked_prefill=True, max_num_batched_tokens=2048 if first else 64,
              max_num_seqs=8, kv_transfer_config=config, seed=0)
    texts = prompts()
    result: dict[str, Any] = {}
    if args.phase == "first":
        result["cold"] = run(llm, texts)
        result["stored_blocks"] = sum(1 for p in args.store.iterdir() if p.is_dir() and not p.name.startswith("."))
        binding = engine_binding(args.store)
        llm.reset_prefix_cache()
        result["warm"] = run(llm, texts)
        tampered = block_of(args.store, binding, llm, texts[0], 2)
        tamper(tampered)
        result["tampered_block"] = tampered.name
        llm.reset_prefix_cache()
        result["after_tamper"] = run(llm, texts)
        forged = block_of(args.store, binding, llm, texts[1], 2)
        forge_other_model(forged, args.key)
        result["forged_block"] = forged.name
        llm.reset_prefix_cache()
        result["after_forge"] = run(llm, texts)
        # A block retired from the store (deleted) while the engine runs is saved again by the
        # next request that computes it.
        retired = block_of(args.store, binding, llm, texts[3], 3)
        shutil.rmtree(retired)
        llm.reset_prefix_cache()
        result["after_retire"] = run(llm, texts)
        result["retired_block"] = retired.name
        result["retired_block_back"] = retired.is_dir()
        # A prompt one token past a block boundary (97 = 3 * 32 + 1 tokens, its own first block),
        # alone, cold and then warm: the connector loads 2 blocks, not 3, so that the warm step
        # computes 33 tokens as a prefill and not 1 token with the decode kernels.
        from vllm import TokensPrompt

        ids = llm.get_tokenizer().encode("Unrelated question first. " + texts[5])[:97]
        llm.reset_prefix_cache()
        result["boundary_cold"] = run(llm, [TokensPrompt(prompt_token_ids=ids)])
        llm.reset_prefix_cache()
        result["boundary_warm"] = run(llm, [TokensPrompt(prompt_token_ids=ids)])
    else:
        result["warm"] = run(llm, texts)
        result["batch"] = run_batch(llm, texts)
        # A request with its own cache salt asked not to share KV: the connector loads nothing for it.
        result["salted"] = run(llm, [{"prompt": texts[2], "cache_salt": "tenant-a"}])
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":  # vLLM starts its engine core in a child process, which imports this file
    sys.exit(main())
