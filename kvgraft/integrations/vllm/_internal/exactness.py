"""The connector's exactness inside vLLM: cold against connector-warm, as a signed exactness record.

Two halves, one module:

- ``run_in_vllm`` runs in the caller's interpreter (``kvgraft vllm exactness``, in kvgraft's own
  venv): it finds vLLM's interpreter (``vllm_python``: ``--vllm-python``, else
  ``$KVGRAFT_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in the working directory or in the
  checkout kvgraft runs from; ``make vllm`` builds it), starts ``python -m
  kvgraft.integrations.vllm MODE ... --result FILE`` there, and returns the result document it
  wrote (or raises the error it wrote). vLLM pins another transformers than the engine, so the
  measurement never runs in kvgraft's own venv.
- ``measure`` runs inside vLLM's venv (``main`` parses the same options).

``connector`` mode writes the record. Each sample is a prompt drawn as kvgraft's own experiment
draws prefixes (whole GSM8K and AIME 2025 documents from the shipped datasets, picked by a seeded
RNG, cut to a target length; targets spread evenly over ``[min_tokens, max_tokens]``). vLLM runs it
cold (vLLM's prefix cache off and the connector's store, a temporary directory of its own, emptied
after every sample: nothing is loaded, its blocks are saved), then again warm: the connector must
load every usable block (``num_cached_tokens`` says so, else the run stops with
``ExactnessRunError`` and nothing is written). Each run decodes ``continuation`` tokens greedily
and returns the full-vocabulary raw logits of every step (``logprobs_mode="raw_logits"``,
``logprobs=-1``); the record compares their SHA-256, KL divergence and argmax with the verifier's
own code, and attaches the logits files (``logits/<sha256>.f32``, float32 ``[steps, vocab]``).
Samples run one at a time: vLLM's CPU build is not batch-invariant, and one at a time both runs
have the same batch shape. The blocks are signed by a key made for the run (they live only in
its temporary store); the record is signed by ``key``.

The record's ``prefix_artifact`` is the tensors digest of the last block loaded (its chain key
covers the whole loaded prefix); ``model.weights_digest`` is the GGUF sha256 for a model kvgraft
converted (its ``COMPLETE`` file), else the binding's weights digest; ``model.config_digest`` is
the binding's (sha256 of the canonical ``config.json``); the profile names vLLM, the attention
backend and the binding digest.

``prefix-cache`` mode measures vLLM's own prefix cache under the same settings, without the
connector: each prompt cold (after ``reset_prefix_cache``), then warm (vLLM's cache hit), and
writes the same comparisons as JSON to ``out`` (no signature: it is vLLM's claim, not kvgraft's).

Nothing here imports vLLM, torch or numpy at import time: the measuring functions import them
when they run.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

from kvgraft.schemas import KvgraftError, parse_sha256

from .blocks import loadable_blocks
from .errors import ConnectorConfigError, ExactnessRunError

if TYPE_CHECKING:
    import numpy as np

    from kvgraft.schemas import ExactnessSample

#: The interpreter of vLLM's venv, when ``--vllm-python`` is not given.
VLLM_PYTHON_ENV: Final = "KVGRAFT_VLLM_PYTHON"
#: What builds that venv, named by every error about it.
MAKE_VLLM_HINT: Final = "run `make vllm` in the kvgraft checkout (it builds .venv-vllm), or pass --vllm-python PATH / set $" + VLLM_PYTHON_ENV
#: The block size the experiment runs vLLM with (vLLM's CPU build needs a multiple of 32).
BLOCK: Final = 32
#: The texts samples are drawn from, as kvgraft's own exactness experiment reads them.
SOURCES: Final = ("gsm8k_test.jsonl", "aime2025.jsonl")
#: The longest prompt: vLLM runs with ``max_model_len`` 1024, and decodes up to 64 tokens after it.
MAX_PROMPT_TOKENS: Final = 960

Mode = Literal["connector", "prefix-cache"]


@dataclass(frozen=True)
class ExactnessOptions:
    """What one measurement runs: the model directory, where the result goes, and the draw.

    ``out`` is the record directory (``connector``) or a JSON file (``prefix-cache``); it must
    not exist. ``key`` signs the record (``connector``); its passphrase, if any, is read from the
    environment variable ``passphrase_env``.
    """

    model: Path
    out: Path
    mode: Mode = "connector"
    key: Path | None = None
    passphrase_env: str | None = None
    samples: int = 50
    seed: int = 0
    min_tokens: int = 40
    max_tokens: int = 800
    continuation: int = 4
    model_name: str | None = None

    def check(self) -> None:
        """Refuse options that cannot run, before vLLM loads (``ConnectorConfigError`` names the fix)."""
        if not 1 <= self.samples <= 1000:
            raise ConnectorConfigError(f"--samples {self.samples} is out of range", hint="pass 1 to 1000 samples")
        if not 1 <= self.continuation <= 64:
            raise ConnectorConfigError(f"--continuation-tokens {self.continuation} is out of range", hint="pass 1 to 64")
        if not BLOCK + 1 <= self.min_tokens <= self.max_tokens <= MAX_PROMPT_TOKENS:
            raise ConnectorConfigError(f"prompt lengths {self.min_tokens}..{self.max_tokens} are out of range",
                                       hint=f"need {BLOCK + 1} <= --min-prefix-tokens <= --max-prefix-tokens <= {MAX_PROMPT_TOKENS}")
        if not (self.model / "config.json").is_file():
            raise ConnectorConfigError(f"{self.model} is not a model directory (no config.json)",
                                       hint="pass a model name kvgraft knows (smollm2-135m) or a Hugging Face model directory")
        if self.out.exists() or self.out.is_symlink():
            raise ConnectorConfigError(f"{self.out} already exists", hint="pick a new --out: a record is never overwritten")
        if self.mode == "connector":
            if self.key is None:
                raise ConnectorConfigError("the record needs a signing key", hint="pass --key KEY.pem")
            if not self.key.is_file():
                raise ConnectorConfigError(f"the signing key {self.key} is missing", hint="kvgraft keys generate --out KEY.pem")

    def argv(self) -> list[str]:
        """The options as ``main`` parses them (``measure``'s half, in vLLM's venv)."""
        args = [self.mode, "--model", str(self.model), "--out", str(self.out), "--samples", str(self.samples),
                "--seed", str(self.seed), "--min-tokens", str(self.min_tokens), "--max-tokens", str(self.max_tokens),
                "--continuation", str(self.continuation)]
        for flag, value in (("--key", self.key), ("--passphrase-env", self.passphrase_env), ("--model-name", self.model_name)):
            if value is not None:
                args += [flag, str(value)]
        return args


# --- the caller's half: find vLLM's interpreter and run the measurement there ------------------------


def vllm_python(given: Path | None = None) -> Path:
    """vLLM's interpreter: ``given``, else ``$KVGRAFT_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in
    the working directory, else in the checkout kvgraft is imported from. ``ConnectorConfigError``
    (naming ``make vllm``) when none is there."""
    named = given or (Path(os.environ[VLLM_PYTHON_ENV]) if os.environ.get(VLLM_PYTHON_ENV) else None)
    if named is not None:
        if not (named.is_file() and os.access(named, os.X_OK)):
            where = "--vllm-python" if given else f"${VLLM_PYTHON_ENV}"
            raise ConnectorConfigError(f"{where} names {named}, which is not an executable Python", hint=MAKE_VLLM_HINT)
        return named
    checkout = Path(__file__).resolve().parents[4]  # kvgraft/integrations/vllm/_internal/ -> the checkout
    candidates = [Path.cwd() / ".venv-vllm" / "bin" / "python", checkout / ".venv-vllm" / "bin" / "python"]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise ConnectorConfigError(f"vLLM's venv is missing (looked for {', '.join(str(c) for c in dict.fromkeys(candidates))})",
                               hint=MAKE_VLLM_HINT)


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        return None  # a captured stderr without a file: the child's output goes to ours unchanged


def run_in_vllm(options: ExactnessOptions, python: Path, *, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``options`` in vLLM's interpreter ``python``; return the result document it wrote.

    vLLM's log and the progress lines go to stderr (stdout stays the caller's). A failure the
    measurement reports comes back as ``ExactnessRunError`` with its message; a child that dies
    without a report (vLLM or kvgraft not installed there, killed) as one naming ``make vllm``.
    """
    options.check()
    with tempfile.TemporaryDirectory(prefix="kvgraft-vllm-") as tmp:
        result = Path(tmp) / "result.json"
        command = [str(python), "-m", "kvgraft.integrations.vllm", *options.argv(), "--result", str(result)]
        try:
            done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=_stderr_fd(), env=env, check=False)
        except OSError as e:
            raise ConnectorConfigError(f"cannot start {python}: {e.strerror}", hint=MAKE_VLLM_HINT) from e
        try:
            document: dict[str, Any] = json.loads(result.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise ExactnessRunError(f"the measurement in {python} exited with status {done.returncode} without a result",
                                    hint="the lines above say why; " + MAKE_VLLM_HINT) from None
    if not document.get("ok"):
        raise ExactnessRunError(f"{document.get('error', 'error')}: {document.get('message', '')}",
                                hint="the lines above say more")
    return document


# --- vLLM's half: the measurement -------------------------------------------------------------------


def _data_dir() -> Path:
    here = Path(__file__).resolve()
    # A checkout has data/datasets/ beside the packages; an installed kvgraft has kvgraft/data/datasets/.
    for candidate in (here.parents[4] / "data" / "datasets", here.parents[3] / "data" / "datasets"):
        if all((candidate / name).is_file() for name in SOURCES):
            return candidate
    raise ExactnessRunError(f"the sample texts ({', '.join(SOURCES)}) are missing", hint="reinstall kvgraft from a complete checkout")


def documents() -> tuple[list[str], list[tuple[str, Any]]]:
    """The sample texts and their (name, digest) refs, as kvgraft's exactness experiment reads them."""
    from kvgraft.schemas import sha256_file

    data = _data_dir()
    docs: list[str] = []
    refs = []
    for name in SOURCES:
        path = data / name
        refs.append((name, sha256_file(path)))
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
        text, ids = "", list[int]()
        while len(ids) < target:
            text += docs[j % len(docs)]
            j += 1
            ids = tokenizer.encode(text)
        prompts.append(list(ids[:target]))
    return prompts


def _generate(llm: Any, ids: list[int], steps: int) -> tuple[list[int], np.ndarray, int]:
    """Greedy ``steps`` tokens: their ids, the raw logits of every step ``[steps, vocab]``, cached tokens."""
    import numpy as np
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


def _make_llm(model: Path, connector: dict[str, str] | None, prefix_cache: bool) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    config = None if connector is None else KVTransferConfig(
        kv_connector="KvgraftConnector", kv_connector_module_path="kvgraft.integrations.vllm", kv_role="kv_both",
        kv_connector_extra_config=connector)
    return LLM(model=str(model), dtype="float32", max_model_len=1024, block_size=BLOCK, enforce_eager=True, seed=0,
               enable_prefix_caching=prefix_cache, max_logprobs=-1, logprobs_mode="raw_logits", max_num_seqs=1,
               kv_transfer_config=config)


def _last_block(store: Path, ids: list[int]) -> Any:
    """The statement of the last usable block of ``ids`` in ``store`` (read, not verified again: the
    connector verified it when it loaded it)."""
    from kvgraft.schemas import statement_unverified

    from .blocks import block_dir
    from .predicate import VllmBlockStatement, chain_keys

    def statement(directory: Path) -> Any:
        envelope = (directory / "statement.dsse.json").read_bytes()
        return VllmBlockStatement.model_validate(statement_unverified(envelope).model_dump(by_alias=True), strict=False)

    some = next(p for p in sorted(store.iterdir()) if p.is_dir() and not p.name.startswith("."))
    p = statement(some).predicate
    blocks = loadable_blocks(len(ids), p.binding.block_size)
    return statement(block_dir(store, chain_keys(p.binding_digest, ids, p.binding.block_size, blocks)[-1]))


def _compare(index: int, ids: list[int], cold: tuple[list[int], np.ndarray], warm: tuple[list[int], np.ndarray],
             stage: Path, artifact: str) -> ExactnessSample:
    import numpy as np

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
        index=index, prefix_artifact=parse_sha256(artifact), prefix_tokens=len(ids),
        continuation_digest=sha256_bytes(canonical_json(cold[0])), continuation_tokens=len(cold[0]),
        fresh_logits_sha256=digests[0], graft_logits_sha256=digests[1], bitwise_equal=digests[0] == digests[1],
        kl_divergence=c.kl_divergence, argmax_agreement=c.argmax_agreement,
        logits_files=LogitsFiles(fresh=digests[0], graft=digests[1]))


def _model_name(directory_name: str) -> str:
    """``smollm2-135m-<64 hex>`` (kvgraft's converted-model cache) -> ``smollm2-135m``."""
    head, _, tail = directory_name.rpartition("-")
    return head if head and len(tail) == 64 and all(c in "0123456789abcdef" for c in tail) else directory_name


def _passphrase(env_var: str | None) -> bytes | None:
    if env_var is None:
        return None
    value = os.environ.get(env_var)
    if not value:
        raise ConnectorConfigError(f"environment variable {env_var} is empty or unset", hint=f"export {env_var}=... first")
    return value.encode("utf-8")


def _progress(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def measure_connector(options: ExactnessOptions) -> dict[str, Any]:
    """Cold against connector-warm on the drawn prompts; writes the signed record at ``options.out``."""
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
        TrustedKeys,
        envelope_json,
        generate_private_key,
        logits_file_name,
        open_signing_key,
        save_private_key,
        sign_statement,
        trusted_key,
    )

    if options.key is None:
        raise ConnectorConfigError("the record needs a signing key", hint="pass --key KEY.pem")
    started = time.monotonic()
    with open_signing_key(options.key, _passphrase(options.passphrase_env)) as signer, \
            tempfile.TemporaryDirectory(prefix="kvgraft-vllm-exactness-") as tmp:
        work = Path(tmp)
        # The blocks live only in this run's store: a key of the run's own signs them.
        block_key = generate_private_key()
        save_private_key(block_key, work / "blocks.pem")
        trusted = work / "trusted-keys.json"
        trusted.write_text(json.dumps(TrustedKeys(keys=(trusted_key("vllm-exactness-blocks", block_key.public_key()),)).to_json()))
        store = work / "store"  # emptied after every sample
        llm = _make_llm(options.model, {"store": str(store), "key": str(work / "blocks.pem"), "trusted_keys": str(trusted)},
                        prefix_cache=False)
        prompts = draw_prompts(llm.get_tokenizer(), options.samples, options.seed, options.min_tokens, options.max_tokens)
        with StagedDirectory(options.out, tag="vllm-exactness") as stage:
            samples = []
            binding_predicate: Any = None
            vocab = 0
            for index, ids in enumerate(prompts):
                cold_ids, cold_logits, cold_cached = _generate(llm, ids, options.continuation)
                warm_ids, warm_logits, warm_cached = _generate(llm, ids, options.continuation)
                vocab = int(cold_logits.shape[1])
                usable = loadable_blocks(len(ids), BLOCK) * BLOCK
                if cold_cached != 0 or warm_cached != usable:
                    # Raised inside the staged directory: it is discarded, nothing appears at out.
                    raise ExactnessRunError(
                        f"sample {index}: {len(ids)} prompt tokens, cold loaded {cold_cached}, warm loaded {warm_cached} "
                        f"(want 0 and {usable}): not a cold/warm pair", hint="the connector's log lines above say why")
                last = _last_block(store, ids)
                binding_predicate = last.predicate
                artifact = "sha256:" + last.subject[0].digest.sha256
                samples.append(_compare(index, ids, (cold_ids, cold_logits), (warm_ids, warm_logits), stage.path, artifact))
                # Prompts drawn from the same documents share prefixes: empty the store, so that the next
                # sample's cold run is cold (vLLM's prefix cache is off, so nothing else is cached).
                for block in store.iterdir():
                    shutil.rmtree(block)
                s = samples[-1]
                _progress(f"sample {index + 1}/{len(prompts)}: {len(ids)} prompt tokens, {warm_cached} loaded, "
                          f"sha256 {'equal' if s.bitwise_equal else 'DIFFERENT'}, KL {s.kl_divergence:.3g}")
            p = binding_predicate
            binding = p.binding
            complete = options.model / "COMPLETE"
            gguf = complete.read_text(encoding="utf-8").strip() if complete.is_file() else ""
            weights = f"sha256:{gguf}" if gguf else binding.weights_digest
            profile = DeterminismProfile(
                name=f"vllm-cpu-{binding.vllm_version}-{binding.model_dtype}", exactness="own-position", device_kind="cpu",
                device_fingerprint=binding.device, dtype=binding.model_dtype, torch_version=torch.__version__,
                transformers_version=transformers.__version__,
                kernel_versions={"vllm": binding.vllm_version, "attention_backend": binding.attention_backend,
                                 "binding": p.binding_digest},
                threads=os.cpu_count() or 1, attention_implementation=f"vllm:{binding.attention_backend}",
                matmul_tiling="default", prefill_chunk=None, deterministic_algorithms=False)
            _, refs = documents()
            comparisons = [(s.kl_divergence, s.argmax_agreement) for s in samples]
            names = sorted({s.fresh_logits_sha256 for s in samples} | {s.graft_logits_sha256 for s in samples})
            statement = ExactnessStatement(
                subject=[Subject(name=logits_file_name(d), digest=SubjectDigest(sha256=hex_of(d))) for d in names],
                predicate=ExactnessPredicate(
                    model=ModelRef(name=options.model_name or _model_name(binding.model_name), weights_digest=parse_sha256(weights),
                                   config_digest=binding.config_digest),
                    profile=profile, level="own-position", shift=0, vocab_size=vocab,
                    data_sources=[DatasetRef(name=name, digest=digest) for name, digest in refs], seed=options.seed,
                    samples=samples,
                    summary=ExactnessSummary(
                        samples=len(samples), bitwise_equal=sum(s.bitwise_equal for s in samples),
                        argmax_agree_all=sum(a == 1.0 for _, a in comparisons), max_kl_divergence=max(k for k, _ in comparisons),
                        mean_argmax_agreement=sum(a for _, a in comparisons) / len(comparisons))))
            stage.write(RECORD_FILE, envelope_json(sign_statement(statement, [signer])))
    t = statement.predicate.summary
    seconds = round(time.monotonic() - started, 1)
    return {"record": str(options.out), "model": statement.predicate.model.name, "profile": profile.name,
            "samples": t.samples, "bitwise_equal": t.bitwise_equal, "argmax_agree_all": t.argmax_agree_all,
            "max_kl_divergence": t.max_kl_divergence, "mean_argmax_agreement": t.mean_argmax_agreement,
            "seconds": seconds, "key": str(options.key),
            "summary": f"{options.out}: {t.bitwise_equal}/{t.samples} SHA-256 equal cold vs connector-warm in vLLM, "
                       f"argmax all-agree {t.argmax_agree_all}/{t.samples}, max KL {t.max_kl_divergence} ({seconds:.0f} s); "
                       f"signed with {options.key}"}


def measure_prefix_cache(options: ExactnessOptions) -> dict[str, Any]:
    """vLLM's own prefix cache, cold against warm, no connector; writes the comparisons as JSON at ``options.out``."""
    import numpy as np

    from kvgraft.schemas import write_atomic
    from kvgraft.verifier import compare_logits

    llm = _make_llm(options.model, None, prefix_cache=True)
    prompts = draw_prompts(llm.get_tokenizer(), options.samples, options.seed, options.min_tokens, options.max_tokens)
    rows = []
    for index, ids in enumerate(prompts):
        llm.reset_prefix_cache()
        cold = _generate(llm, ids, options.continuation)
        warm = _generate(llm, ids, options.continuation)
        c = compare_logits(cold[1], warm[1])
        rows.append({"index": index, "prompt_tokens": len(ids), "cold_cached": cold[2], "warm_cached": warm[2],
                     "bitwise_equal": bool(np.array_equal(cold[1], warm[1])), "same_tokens": cold[0] == warm[0],
                     "kl_divergence": c.kl_divergence, "argmax_agreement": c.argmax_agreement})
        _progress(f"sample {index + 1}/{len(prompts)}: {len(ids)} tokens, warm cached {warm[2]}, "
                  f"{'equal' if rows[-1]['bitwise_equal'] else 'DIFFERENT'}")
    summary = {"what": "vLLM's own prefix cache, cold (after reset_prefix_cache) against warm (its cache hit), no connector",
               "model": str(options.model), "samples": len(rows), "seed": options.seed,
               "continuation_tokens": options.continuation, "bitwise_equal": sum(r["bitwise_equal"] for r in rows),
               "same_tokens": sum(r["same_tokens"] for r in rows),
               "max_kl_divergence": max(r["kl_divergence"] for r in rows), "rows": rows}
    write_atomic(options.out, (json.dumps(summary, indent=1) + "\n").encode(), 0o644)
    return {"out": str(options.out), "samples": len(rows), "bitwise_equal": summary["bitwise_equal"],
            "max_kl_divergence": summary["max_kl_divergence"],
            "summary": f"{options.out}: vLLM's own prefix cache {summary['bitwise_equal']}/{len(rows)} SHA-256 equal, "
                       f"max KL {summary['max_kl_divergence']}"}


def measure(options: ExactnessOptions) -> dict[str, Any]:
    """Run ``options`` here (vLLM installed); the result document (``summary`` holds the line to print)."""
    options.check()
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise ConnectorConfigError(f"vLLM is not installed in {sys.executable} ({e.name} is missing)", hint=MAKE_VLLM_HINT) from e
    return measure_connector(options) if options.mode == "connector" else measure_prefix_cache(options)


def parser() -> argparse.ArgumentParser:
    """``python -m kvgraft.integrations.vllm MODE ...``: the measurement's own command line (vLLM's half)."""
    p = argparse.ArgumentParser(prog="python -m kvgraft.integrations.vllm",
                                description="Run kvgraft's exactness measurement inside vLLM (use 'kvgraft vllm exactness').")
    p.add_argument("mode", choices=["connector", "prefix-cache"], help="the connector's record, or vLLM's own prefix cache")
    p.add_argument("--model", required=True, type=Path, help="the model directory")
    p.add_argument("--out", required=True, type=Path, help="the record directory (connector) or JSON file (prefix-cache)")
    p.add_argument("--key", type=Path, help="PEM private key that signs the record (connector)")
    p.add_argument("--passphrase-env", help="the key's passphrase is in this environment variable")
    p.add_argument("--samples", type=int, default=50, help="prompts (default 50)")
    p.add_argument("--seed", type=int, default=0, help="the draw's seed (default 0)")
    p.add_argument("--min-tokens", type=int, default=40, help="shortest prompt (default 40)")
    p.add_argument("--max-tokens", type=int, default=800, help="longest prompt (default 800)")
    p.add_argument("--continuation", type=int, default=4, help="greedy tokens decoded per run (default 4)")
    p.add_argument("--model-name", help="the record's model name (default: the directory's, without kvgraft's cache suffix)")
    p.add_argument("--result", type=Path, help="write the result document (or the failure) here as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Parse, measure, write ``--result``; 0 when the measurement ran, 1 when it failed (one line on stderr)."""
    args = parser().parse_args(argv)
    options = ExactnessOptions(model=args.model, out=args.out, mode=args.mode, key=args.key, passphrase_env=args.passphrase_env,
                               samples=args.samples, seed=args.seed, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                               continuation=args.continuation, model_name=args.model_name)
    try:
        document = {"ok": True, **measure(options)}
        status = 0
    except KvgraftError as e:
        document = {"ok": False, "error": type(e).__name__, "message": " ".join(str(e).split())}
        sys.stderr.write(f"kvgraft: {document['error']}: {document['message']}\n")
        status = 1
    if args.result is not None:
        args.result.write_text(json.dumps(document, sort_keys=True) + "\n", encoding="utf-8")
    else:
        sys.stdout.write(str(document.get("summary", "")) + "\n")
    return status


__all__ = ["MAKE_VLLM_HINT", "VLLM_PYTHON_ENV", "ExactnessOptions", "main", "measure", "run_in_vllm", "vllm_python"]
