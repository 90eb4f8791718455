"""``kvgraft vllm``: kvgraft inside stock vLLM (docs/vllm.md).

- ``vllm exactness``: the connector's exactness inside vLLM, cold against connector-warm, as a
  signed exactness record that ``kvgraft-verify exactness`` checks offline;
- ``vllm prefix-cache``: vLLM's own prefix cache under the same settings, cold against warm (JSON).

vLLM pins another transformers than kvgraft's engine, so it lives in its own venv (``make vllm``
builds ``.venv-vllm``): these commands run the measurement there, as ``python -m
kvgraft.integrations.vllm``, and report what it wrote. Which interpreter: ``--vllm-python``, else
``$KVGRAFT_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in the working directory or the checkout.
Importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._common import ENGINE, add_command, needs
from .engine import add_key_options, signing_key

if TYPE_CHECKING:
    from kvgraft.integrations.vllm import ExactnessOptions


def _model_dir(model: str) -> Path:
    """A model directory as given, else kvgraft's converted copy of the model it names (made once)."""
    path = Path(model)
    if path.is_dir():
        return path
    with needs(ENGINE):
        from kvgraft.engine import ensure_cached, spec_for

        return ensure_cached(spec_for(model))


def _run(args: argparse.Namespace, options: ExactnessOptions) -> dict[str, Any]:
    from kvgraft.integrations.vllm import run_in_vllm, vllm_python

    python = vllm_python(args.vllm_python)
    return {**run_in_vllm(options, python), "vllm_python": str(python)}


def _cmd_exactness(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.integrations.vllm import ExactnessOptions

    key, _, note = signing_key(args)
    options = ExactnessOptions(
        model=_model_dir(args.model), out=args.out, mode="connector", key=key, passphrase_env=args.passphrase_env,
        samples=args.samples, seed=args.seed, min_tokens=args.min_prefix_tokens, max_tokens=args.max_prefix_tokens,
        continuation=args.continuation_tokens, model_name=args.model_name)
    result = _run(args, options)
    return {**result, "summary": result["summary"] + note}


def _cmd_prefix_cache(args: argparse.Namespace) -> dict[str, Any]:
    from kvgraft.integrations.vllm import ExactnessOptions

    options = ExactnessOptions(
        model=_model_dir(args.model), out=args.out, mode="prefix-cache", samples=args.samples, seed=args.seed,
        min_tokens=args.min_prefix_tokens, max_tokens=args.max_prefix_tokens, continuation=args.continuation_tokens)
    return _run(args, options)


def _add_shared(p: argparse.ArgumentParser, samples: int) -> None:
    p.add_argument("--model", required=True, metavar="NAME|DIR",
                   help="a model kvgraft knows (smollm2-135m: its converted directory under $KVGRAFT_HOME/models/) "
                        "or a Hugging Face model directory vLLM can load")
    p.add_argument("--samples", type=int, default=samples, metavar="N",
                   help=f"prompts drawn from the shipped GSM8K and AIME texts, one at a time (1 to 1000, default {samples})")
    p.add_argument("--seed", type=int, default=0, help="the seed the prompts are drawn with (default 0)")
    p.add_argument("--min-prefix-tokens", type=int, default=40, metavar="N", help="the shortest prompt (default 40)")
    p.add_argument("--max-prefix-tokens", type=int, default=800, metavar="N", help="the longest prompt (default 800, at most 960)")
    p.add_argument("--continuation-tokens", type=int, default=4, metavar="N",
                   help="greedy tokens decoded after each prompt, whose full-vocabulary logits are compared (default 4)")
    p.add_argument("--vllm-python", type=Path, metavar="PATH",
                   help="vLLM's interpreter (default: $KVGRAFT_VLLM_PYTHON, else .venv-vllm/bin/python, which `make vllm` builds)")


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``vllm exactness`` and ``vllm prefix-cache`` to ``kvgraft``'s subcommands."""
    vllm = sub.add_parser("vllm", help="kvgraft's KV connector inside stock vLLM: its exactness record (docs/vllm.md)")
    vsub = vllm.add_subparsers(dest="vllm_command", required=True, metavar="ACTION")
    ex = add_command(
        vsub, "exactness", _cmd_exactness,
        help="cold against connector-warm inside vLLM on N prompts; writes a signed exactness record",
        examples=(
            ("kvgraft vllm exactness --model smollm2-135m --samples 50 --out results/exactness/smollm2-135m-vllm-cpu-fp32 --key KEY.pem",
             "the 50-sample record, run in .venv-vllm; then: kvgraft-verify exactness DIR --trusted-keys keys.json"),
        ))
    _add_shared(ex, 50)
    ex.add_argument("--out", type=Path, required=True, metavar="DIR", help="the record directory to create (must not exist)")
    ex.add_argument("--model-name", help="the record's model name (default: the model directory's, without kvgraft's cache suffix)")
    add_key_options(ex)
    pc = add_command(
        vsub, "prefix-cache", _cmd_prefix_cache,
        help="vLLM's own prefix cache, cold against warm, under the same settings (JSON, unsigned)",
        examples=(("kvgraft vllm prefix-cache --model smollm2-135m --samples 10 --out prefix-cache.json",
                   "10 prompts, each after reset_prefix_cache and then as vLLM's own cache hit"),))
    _add_shared(pc, 10)
    pc.add_argument("--out", type=Path, required=True, metavar="FILE", help="the JSON file to write (must not exist)")
