"""The record pages' own views (``/records/DIGEST``): an exactness record's samples beside its
companions' and its KL plot; an evaluation's setup (its arm first: the base model alone, or
answers from a library), its items with the expected answer of each wrong one, and its
aggregates recomputed; and, for every record, the records it is linked with, both ways.

Split from ``ui.py``, which mounts the handlers. Figures come from the signed statements; the
expected answers from the datasets shipped with kvgraft, when the record names one by digest.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from typing import Any, TypedDict

from kvgraft.schemas import (
    DocumentError,
    EvaluationStatement,
    ExactnessSample,
    ExactnessStatement,
    Sha256Digest,
    Statement,
    statement_unverified,
)
from kvgraft.verifier import Dataset, VerificationError, harness_hashes, load_dataset
from kvgraft.web import PlotSeries, kl_plot_svg, mean_figure, same_figure

from .. import queries
from ..errors import RegistryError
from ..service import Registry

logger = logging.getLogger("kvgraft.registry")

#: The datasets shipped with kvgraft: an evaluation over one of them shows its questions and expected answers.
DATASETS_DIR = Path(__file__).resolve().parents[3] / "data" / "datasets"


def stored_statement(envelope_bytes: bytes) -> Statement:
    """A stored envelope's statement, typed (no signature checked: pages verify it apart);
    ``RegistryError`` when it cannot be decoded."""
    try:
        return statement_unverified(envelope_bytes, what="stored envelope")
    except (DocumentError, VerificationError, KeyError, TypeError) as e:
        raise RegistryError(f"a stored envelope cannot be decoded: {e}") from e


@functools.cache
def shipped_datasets() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted(DATASETS_DIR.glob("*.jsonl")) if DATASETS_DIR.is_dir() else []:
        out["sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()] = path
    return out


@functools.lru_cache(maxsize=4)
def shipped_dataset(digest: str) -> Dataset | None:
    path = shipped_datasets().get(digest)
    if path is None:
        return None
    try:
        return load_dataset(path)
    except VerificationError as e:
        logger.warning("shipped dataset %s cannot be read: %s", path, e)
        return None


class _Companion(TypedDict):
    """Another exactness record over the same prefix artifacts, shown beside this one."""

    log_index: int
    level: str
    shift: int
    by_prefix: dict[Sha256Digest, ExactnessSample]
    label: str


def exactness_context(registry: Registry, entry: dict[str, Any], statement: ExactnessStatement) -> dict[str, Any]:
    p = statement.predicate
    samples = list(p.samples)
    # Other exactness records over the same prefix artifacts at another level (a shifted run
    # beside an own-position one, or the reverse): their figures go beside these.
    companions: list[_Companion] = []
    for found in queries.exactness_companions(registry.db, int(entry["log_index"])):
        index = found.log_index
        try:
            other = stored_statement(found.envelope)
        except RegistryError:
            continue
        if not isinstance(other, ExactnessStatement):
            continue
        op = other.predicate
        if (op.level, op.shift) == (p.level, p.shift):
            continue
        by_prefix = {s.prefix_artifact: s for s in op.samples}
        companions.append({"log_index": int(index), "level": op.level, "shift": op.shift, "by_prefix": by_prefix,
                           "label": f"{op.level}" + (f" (shift {op.shift})" if op.shift else "") + f", entry {index}"})
    companions = companions[:2]
    level = p.level + (f" (shift {p.shift})" if p.shift else "")
    label = level + ", this record"
    series = [PlotSeries(label, "s0", [(s.index, s.kl_divergence) for s in samples])]
    for n, c in enumerate(companions, start=1):
        pts = [(s.index, c["by_prefix"][s.prefix_artifact].kl_divergence) for s in samples if s.prefix_artifact in c["by_prefix"]]
        series.append(PlotSeries(c["label"], f"s{n}", pts))
    recomputed = {
        "samples": len(samples),
        "bitwise_equal": sum(s.bitwise_equal for s in samples),
        "argmax_agree_all": sum(s.argmax_agreement == 1.0 for s in samples),
        "max_kl_divergence": max((s.kl_divergence for s in samples), default=0.0),
        "mean_argmax_agreement": mean_figure([s.argmax_agreement for s in samples]),
    }
    claimed = p.summary.model_dump()
    return {
        "p": p,
        "samples": samples,
        "companions": companions,
        "plot": kl_plot_svg(series),
        "summary_rows": [(k, claimed[k], recomputed[k], same_figure(claimed[k], recomputed[k])) for k in recomputed],
        "summary_ok": all(same_figure(claimed[k], recomputed[k]) for k in recomputed),
        "label": label,
        "level": level,
    }


def evaluation_context(statement: EvaluationStatement) -> dict[str, Any]:
    """An evaluation page's figures: the setup (``evaluation_setup``), each item with its question
    and ``expected`` answer (the dataset's reference, when the dataset is one shipped here), and
    the aggregates claimed beside those recomputed from the items."""
    p = statement.predicate
    dataset = shipped_dataset(p.dataset.digest)
    items = []
    for item in p.items:
        question = expected = None
        doc_matches = None
        if dataset is not None and 0 <= item.doc_id < len(dataset):
            question = dataset.question(item.doc_id)
            expected = dataset.reference(item.doc_id)
            # The harness's doc hash: says whether the signed item is about this very document.
            doc_matches = harness_hashes(dataset.docs[item.doc_id], "", "").doc_hash == item.doc_hash
        items.append({"item": item, "question": question, "expected": expected, "doc_matches": doc_matches})
    n = len(p.items)
    correct = sum(i.correct for i in p.items)
    recomputed = {
        "items": n,
        "correct": correct,
        "accuracy": correct / n if n else 0.0,
        "prompt_tokens": sum(i.prompt_tokens for i in p.items),
        "decode_tokens": sum(i.decode_tokens for i in p.items),
    }
    claimed = p.aggregates.model_dump()
    return {
        "p": p,
        "setup": evaluation_setup(statement),
        "items": items,
        "wrong": sum(1 for i in p.items if not i.correct),
        "dataset_known": dataset is not None,
        "doc_mismatches": sum(1 for row in items if row["doc_matches"] is False),
        "dataset_file": shipped_datasets().get(p.dataset.digest),
        "aggregate_rows": [(k, claimed[k], recomputed[k], same_figure(claimed[k], recomputed[k])) for k in recomputed],
        "all_match": all(same_figure(claimed[k], recomputed[k]) for k in recomputed),
    }


def evaluation_setup(statement: EvaluationStatement) -> dict[str, Any]:
    """What an evaluation ran, arm first: ``arm`` is ``library`` when answers came from library
    artifacts (``library_artifacts``, or an entry grafted per item), else ``base``; ``settings``
    leaves out the unset (None) ones, which said nothing."""
    p = statement.predicate
    libraries = list(dict.fromkeys([*p.library_artifacts, *(i.library_entry for i in p.items if i.library_entry)]))
    return {
        "arm": "library" if libraries else "base",
        "libraries": libraries,
        "settings": {k: v for k, v in p.settings.items() if v is not None},
    }


#: How a linked record relates to the one shown, by (shown kind, linked kind).
_RELATIONS = {
    ("evaluation", "pre-registration"): "pre-registers a replay of this evaluation (the same outputs file)",
    ("evaluation", "replay"): "replays this evaluation (the same outputs file)",
    ("pre-registration", "evaluation"): "the evaluation this pre-registers (the same outputs file)",
    ("pre-registration", "replay"): "a replay answering this pre-registration",
    ("replay", "pre-registration"): "the pre-registration this replay answers",
    ("replay", "evaluation"): "the evaluation this replay reproduced (the same outputs file)",
}


def related_records(registry: Registry, entry: dict[str, Any]) -> list[dict[str, Any]]:
    """The records linked with ``entry`` both ways (``queries.linked_entries``), each with how (under the lock)."""
    rows = queries.linked_entries(registry.db, int(entry["log_index"]), entry["digest"])
    return [
        {"log_index": r.log_index, "digest": r.digest, "kind": r.kind, "publisher": r.publisher,
         "relation": _RELATIONS.get((entry["kind"], r.kind), "shares a file or a reference with this record")}
        for r in rows
    ]
