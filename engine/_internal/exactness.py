"""The exactness experiment: graft vs fresh computation on (prefix, continuation) pairs drawn
from real text, written as a signed exactness record with its logits files.

Each sample's prefix is captured to an artifact on disk, read back (digest checked) and grafted;
the same prefix is recomputed fresh from its text; the two continuations' logits are compared
byte for byte (SHA-256), by KL divergence and by argmax, with the verifier's own numpy code.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvgraft.schemas import (
    RECORD_FILE,
    DatasetRef,
    DeterminismProfile,
    ExactnessPredicate,
    ExactnessSample,
    ExactnessStatement,
    ExactnessSummary,
    LogitsFiles,
    Sha256Digest,
    StagedDirectory,
    Subject,
    SubjectDigest,
    hex_of,
    sha256_bytes,
    sha256_file,
    token_digest,
)
from kvgraft.verifier import (
    compare_logits,
    envelope_json,
    logits_file_name,
    open_signing_key,
    sign_statement,
)

from .artifacts import load_artifact, logits_digest
from .errors import ArtifactError, InputTextError
from .ops import AnyModel, capture, fresh, graft
from .trust import trust_signer

#: The texts samples are drawn from, shipped with the project (see data/datasets/*.SOURCE.md).
DATA_DIR = Path(__file__).resolve().parents[2] / "data" / "datasets"
SOURCES = ("gsm8k_test.jsonl", "aime2025.jsonl")


def _documents() -> tuple[list[str], list[DatasetRef]]:
    docs: list[str] = []
    refs = []
    for name in SOURCES:
        path = DATA_DIR / name
        if not path.is_file():
            raise InputTextError(f"the sample texts {path} are missing", hint="reinstall kvgraft from a complete checkout")
        refs.append(DatasetRef(name=name, digest=sha256_file(path)))
        # Lines end at "\n" only: str.splitlines would also split at U+2028 inside a JSON string.
        for line in filter(None, path.read_text(encoding="utf-8").split("\n")):
            row = json.loads(line)
            if "question" in row:
                docs.append(f"Question: {row['question']}\nAnswer: {row['answer']}\n\n")
            else:
                docs.append(f"Problem: {row['prompt']}\nAnswer: {row['answer']}\n\n")
    return docs, refs


@dataclass(frozen=True)
class Pair:
    """A prefix text and a continuation text."""

    prefix: str
    continuation: str


def draw_pairs(model: AnyModel, samples: int, seed: int, *, min_tokens: int, max_tokens: int, continuation_tokens: int) -> Iterator[Pair]:
    """``samples`` pairs with prefix lengths spread evenly over ``[min_tokens, max_tokens]``.

    Prefixes run across whole documents picked by a seeded RNG; continuations are the start of
    the next document. Lengths are targets in tokens; the texts are what gets tokenized.
    """
    docs, _ = _documents()
    rng = random.Random(seed)
    for i in range(samples):
        target = min_tokens if samples == 1 else min_tokens + (i * (max_tokens - min_tokens)) // (samples - 1)
        j = rng.randrange(len(docs))
        text, ids = "", list[int]()
        while len(ids) < target:
            text += docs[j % len(docs)]
            j += 1
            ids = model.tokenizer.encode(text, first=True)
        prefix = model.tokenizer.decode(ids[:target])
        nxt = model.tokenizer.encode(docs[j % len(docs)], first=False)[:continuation_tokens]
        yield Pair(prefix=prefix, continuation=model.tokenizer.decode(nxt))


def _write_logits(stage: StagedDirectory, arr: np.ndarray) -> Sha256Digest:
    data = np.ascontiguousarray(arr, dtype="<f4").tobytes()
    digest = sha256_bytes(data)
    if not (stage.path / logits_file_name(digest)).exists():  # equal logits share one file
        stage.write(logits_file_name(digest), data)
    return digest


def run_exactness(
    model: AnyModel,
    profile: DeterminismProfile,
    out: Path,
    *,
    samples: int,
    key: Path,
    shift: int = 0,
    seed: int = 0,
    min_tokens: int = 16,
    max_tokens: int | None = None,
    continuation_tokens: int = 8,
    keep_artifacts: bool = False,
    passphrase: bytes | None = None,
    progress: bool = True,
) -> ExactnessStatement:
    """Run the experiment and write ``out/record.dsse.json`` and ``out/logits/`` atomically."""
    if samples < 1:
        raise ArtifactError("--samples must be at least 1", hint="e.g. --samples 50")
    if out.exists():
        raise ArtifactError(f"{out} already exists", hint="choose a new --out directory")
    if max_tokens is None:
        # Past the sliding window where a model has one, so that window state is exercised.
        max_tokens = 2 * model.sliding_window if model.sliding_window else 768
    max_tokens = min(max_tokens, model.spec.window - continuation_tokens - abs(shift) - 8)
    _, refs = _documents()
    stage = StagedDirectory(out)
    work = stage.path / "artifacts"
    own = trust_signer(key, passphrase)
    results: list[ExactnessSample] = []
    with stage:
        pairs = draw_pairs(model, samples, seed, min_tokens=min_tokens, max_tokens=max_tokens, continuation_tokens=continuation_tokens)
        # A bar on a terminal only; a log (stderr not a terminal) gets one plain line per sample instead.
        lines = progress and not sys.stderr.isatty()
        bar = tqdm(pairs, total=samples, desc=f"exactness {model.spec.name}", unit="sample", disable=not progress or lines, file=sys.stderr)
        for index, pair in enumerate(bar):
            art_dir = work / f"sample-{index:03d}"
            captured = capture(model, profile, pair.prefix, art_dir, key=key, passphrase=passphrase)
            # Read back from disk: signature (by the key that just signed it), digest and tensors checked.
            loaded = load_artifact(art_dir, model, profile, trusted=own)
            g = graft(model, profile, loaded, pair.continuation, shift=shift)
            f = fresh(model, profile, pair.prefix, pair.continuation)
            if f.continuation_ids != g.continuation_ids or f.prefix_tokens != g.prefix_tokens:
                raise ArtifactError(f"sample {index}: fresh and graft tokenized differently", hint="a bug: report it")
            fl, gl = f.logits.numpy(), g.logits.numpy()
            cmp = compare_logits(fl, gl)
            fd, gd = _write_logits(stage, fl), _write_logits(stage, gl)
            if fd != logits_digest(f.logits) or gd != logits_digest(g.logits):
                raise ArtifactError("logits bytes changed between torch and numpy", hint="a bug: report it")
            results.append(ExactnessSample(
                index=index, prefix_artifact=captured.kv_digest, prefix_tokens=f.prefix_tokens,
                continuation_digest=token_digest(f.continuation_ids), continuation_tokens=len(f.continuation_ids),
                fresh_logits_sha256=fd, graft_logits_sha256=gd, bitwise_equal=fd == gd,
                kl_divergence=cmp.kl_divergence, argmax_agreement=cmp.argmax_agreement, shift=shift,
                logits_files=LogitsFiles(fresh=fd, graft=gd),
            ))
            bar.set_postfix(equal=sum(r.bitwise_equal for r in results), tokens=f.prefix_tokens)
            if lines:
                sys.stderr.write(f"kvgraft: exactness {model.spec.name} {index + 1}/{samples}: "
                                 f"{sum(r.bitwise_equal for r in results)} equal so far ({f.prefix_tokens} prefix tokens)\n")
            if not keep_artifacts:
                shutil.rmtree(art_dir)
        if keep_artifacts:
            os.replace(work, out.parent / f"{out.name}-artifacts")
        elif work.exists():
            work.rmdir()
        comparisons = [(r.kl_divergence, r.argmax_agreement) for r in results]
        statement = ExactnessStatement(
            subject=[
                Subject(name=logits_file_name(d), digest=SubjectDigest(sha256=hex_of(d)))
                for d in sorted({r.fresh_logits_sha256 for r in results} | {r.graft_logits_sha256 for r in results})
            ],
            predicate=ExactnessPredicate(
                model=model.ref, profile=profile, level="shifted" if shift else profile.exactness, shift=shift,
                vocab_size=int(fl.shape[1]), data_sources=refs, seed=seed,
                samples=results,
                summary=ExactnessSummary(
                    samples=len(results),
                    bitwise_equal=sum(r.bitwise_equal for r in results),
                    argmax_agree_all=sum(a == 1.0 for _, a in comparisons),
                    max_kl_divergence=max(k for k, _ in comparisons),
                    mean_argmax_agreement=sum(a for _, a in comparisons) / len(comparisons),
                ),
            ),
        )
        with open_signing_key(key, passphrase) as signer:
            stage.write(RECORD_FILE, envelope_json(sign_statement(statement, [signer])))
    return statement


def summary_table(statement: ExactnessStatement) -> str:
    """A plain-text table of the record, one row per sample and a total."""
    p = statement.predicate
    rows = [f"{'#':>3} {'prefix':>6} {'cont':>4} {'sha256 equal':<12} {'KL':>12} {'argmax':>6}"]
    for s in p.samples:
        rows.append(f"{s.index:>3} {s.prefix_tokens:>6} {s.continuation_tokens:>4} {'yes' if s.bitwise_equal else 'NO':<12} "
                    f"{s.kl_divergence:>12.3e} {s.argmax_agreement:>6.3f}")
    t = p.summary
    rows.append(f"{p.model.name} {p.level}{f' (shift {p.shift})' if p.shift else ''}: {t.bitwise_equal}/{t.samples} SHA-256 equal, "
                f"argmax all-agree {t.argmax_agree_all}/{t.samples}, mean argmax agreement {t.mean_argmax_agreement:.4f}, "
                f"max KL {t.max_kl_divergence!r}")
    return "\n".join(rows)
