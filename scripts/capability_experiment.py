"""The capability experiment (issue 17): does a grafted worked example help a model that can reason?

    .venv/bin/python scripts/capability_experiment.py [--model qwen2.5-coder-1.5b] [--size 100]
        [--seed 2025] [--budget 1024] [--batch 24] [--out results/capability] [--work DIR]
        [--key KEY] [--only libraries,similar,base,fixed,table]

Held-out transfer on GSM8K test: ``--size`` problems drawn with ``--seed``, each answered three
ways, paired (the same problems, greedy, the same budget):

(a) ``base``: the instruction and the problem, from an empty state;
(b) ``fixed``: one fixed, unrelated verified worked example grafted before every problem (the
    control for format and length: a worked example, but not a related one);
(c) ``similar``: the most similar verified train solution grafted before each problem.

The libraries: for each test problem, the most similar GSM8K train problem by the library's own
rule (``ProblemIndex``: TF-IDF cosine over all 7,473 train problems, the question's text only) is
deposited with its worked solution (each answer confirmed by the grader against the key) into
``WORK/lib-similar``, which (c) asks as ``kvgraft eval --library`` does. (b)'s entry is the train
problem least similar to every test problem (lowest best cosine against the slice) among those
whose solution length is within 15% of the median of (c)'s entries, alone in ``WORK/lib-fixed``.

Each condition is a signed evaluation record (``kvgraft eval``'s, ``--batch`` problems decoded per
forward pass; stopped runs resume from their journals). ``table`` recomputes, from the records:
accuracy with 95% Wilson intervals, the budget's cut-off rate, and for each pair of conditions
the paired difference with its 95% interval and McNemar's exact test (two-sided binomial on the
discordant pairs); it re-checks every record with ``kvgraft-verify eval`` and writes
``OUT/v1-summary.json`` and ``OUT/v1-README.md`` (``OUT/summary.json`` and ``OUT/README.md`` are the
redesigned experiment's, scripts/capability_v2.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from experiment_keys import KVGRAFT, VERIFY, record_predicate, trust_beside
from experiment_stats import paired, wilson

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "datasets"
TEST, TRAIN = DATA / "gsm8k_test.jsonl", DATA / "gsm8k_train.jsonl"
CONDITIONS = ("base", "fixed", "similar")


def log(message: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


# --- the libraries --------------------------------------------------------------------------------


def build_libraries(args: argparse.Namespace, model: Any, profile: Any, key: Path) -> None:
    from kvgraft.engine import Library, ProblemIndex, select, worked_solution
    from kvgraft.schemas import LIBRARY_FILE
    from kvgraft.verifier import load_dataset

    test, train = load_dataset(TEST), load_dataset(TRAIN)
    slice_ = select(test, args.size, args.seed)
    train_ids = [i for i in range(len(train.docs)) if worked_solution(train, i) is not None]
    over_train = ProblemIndex([train.question(i) for i in train_ids])
    chosen: list[int] = []
    for t in slice_:
        best = over_train.best(test.question(t))
        if best is not None and train_ids[best[0]] not in chosen:
            chosen.append(train_ids[best[0]])
    log(f"similar: {len(chosen)} train problems for {len(slice_)} test problems")
    trusted = None

    def open_or_create(directory: Path) -> Any:
        if (directory / LIBRARY_FILE).exists():
            from kvgraft.engine import trust_signer

            return Library.open(directory, model, profile, trusted=trust_signer(key, None, name="experiment key"))
        return Library.create(directory, model, profile, kind=train.kind, key=key, trusted=trusted)

    # Only the similar condition asks the similar library: once its record exists (a later
    # session finishing the other conditions), the 100 deposits are not made again.
    if (args.out / "similar").exists():
        log(f"similar: {args.out / 'similar'} exists, its library is not rebuilt")
    else:
        similar = open_or_create(args.work / "lib-similar")
        for n, i in enumerate(chosen):
            solution = worked_solution(train, i)
            entry = similar.deposit(train, i, solution or "", key=key) if solution is not None else None
            log(f"deposit similar {n + 1}/{len(chosen)}: train doc {i} {'ok' if entry is not None else 'refused'}")
    # The fixed control: least similar to the whole slice, of typical length.
    lengths = sorted(len(worked_solution(train, i) or "") for i in chosen)
    median = statistics.median(lengths)
    over_slice = ProblemIndex([test.question(t) for t in slice_])
    candidates = [i for i in train_ids if i not in chosen and abs(len(worked_solution(train, i) or "") - median) <= 0.15 * median]

    def closeness(i: int) -> tuple[float, int]:
        best = over_slice.best(train.question(i))
        return (best[1] if best is not None else 0.0, i)

    fixed_doc = min(candidates, key=closeness)
    fixed = open_or_create(args.work / "lib-fixed")
    entry = fixed.deposit(train, fixed_doc, worked_solution(train, fixed_doc) or "", key=key)
    if entry is None:
        raise SystemExit(f"train doc {fixed_doc}'s solution was refused by the grader; cannot be the fixed example")
    (args.work / "fixed-entry.json").write_text(json.dumps(
        {"doc_id": fixed_doc, "artifact": entry.artifact, "best_cosine_to_slice": closeness(fixed_doc)[0],
         "solution_chars": len(worked_solution(train, fixed_doc) or ""), "median_similar_chars": median}, indent=2) + "\n")
    log(f"fixed: train doc {fixed_doc} ({entry.artifact}), best cosine to the slice {closeness(fixed_doc)[0]:.3f}")


# --- the evaluations ------------------------------------------------------------------------------


def evaluate(args: argparse.Namespace, condition: str, model: Any, profile: Any, key: Path) -> None:
    from kvgraft.engine import Library, run_eval, trust_signer

    out = args.out / condition
    if out.exists():
        log(f"{condition}: {out} exists, skipped")
        return
    library, fixed = None, None
    if condition != "base":
        directory = args.work / ("lib-fixed" if condition == "fixed" else "lib-similar")
        # Threshold 0: this experiment's condition is "the most similar train solution grafted", at any score.
        library = Library.open(directory, model, profile, trusted=trust_signer(key, None, name="experiment key"),
                               graft_threshold=0.0)
        if condition == "fixed":
            fixed = json.loads((args.work / "fixed-entry.json").read_text())["artifact"]

    def item(n: int, total: int, it: Any) -> None:
        log(f"{condition} {n + 1}/{total}: doc {it.doc_id} {'right' if it.correct else 'wrong'} ({it.decode_tokens} tokens)")

    run = run_eval(model, profile, TEST, out, key=key, library=library, fixed_entry=fixed, max_new_tokens=args.budget,
                   limit=args.size, seed=args.seed, batch=args.batch, on_item=item)
    a = run.statement.predicate.aggregates
    log(f"{condition}: {a.correct}/{a.items} in {run.seconds:.0f} s")


# --- the table ------------------------------------------------------------------------------------


def table(args: argparse.Namespace) -> None:
    records = {c: args.out / c for c in CONDITIONS if (args.out / c).exists()}
    summary: dict[str, Any] = {"model": args.model, "dataset": TEST.name, "size": args.size, "seed": args.seed,
                               "budget": args.budget, "batch": args.batch, "conditions": {}, "pairs": {}}
    correct: dict[str, list[bool]] = {}
    for c, record in records.items():
        proc = subprocess.run([*VERIFY, "eval", str(record), "--dataset", str(TEST),
                               "--trusted-keys", str(args.out / "trusted-keys.json")], capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"kvgraft-verify eval {record} failed: {proc.stdout}{proc.stderr}")
        p = record_predicate(record)
        items = sorted(p["items"], key=lambda i: i["doc_id"])
        correct[c] = [i["correct"] for i in items]
        k, n = sum(correct[c]), len(items)
        summary["conditions"][c] = {
            "record": str(record.relative_to(ROOT)) if record.is_relative_to(ROOT) else str(record),
            "correct": k, "items": n, "accuracy": k / n, "ci95": wilson(k, n), "cut_off": p["settings"]["cut_off"],
            "decode_tokens": p["aggregates"]["decode_tokens"], "prompt_tokens": p["aggregates"]["prompt_tokens"],
            "seconds": p["settings"]["seconds"], "profile": p["profile"]["name"],
            "device_fingerprint": p["profile"]["device_fingerprint"], "verified": True,
        }
    for first, second in (("base", "fixed"), ("base", "similar"), ("fixed", "similar")):
        if first in correct and second in correct:
            summary["pairs"][f"{second} - {first}"] = paired(correct[first], correct[second])
    fixed_entry = args.work / "fixed-entry.json"
    if fixed_entry.exists():
        summary["fixed_entry"] = json.loads(fixed_entry.read_text())
    (args.out / "v1-summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"# Capability experiment: {args.model}, GSM8K test, {args.size} problems (seed {args.seed})",
        "",
        f"Budget {args.budget} decode tokens per answer, greedy, {args.batch} problems per forward pass. Re-check any "
        f"record: `kvgraft-verify eval results/capability/CONDITION --dataset data/datasets/gsm8k_test.jsonl "
        f"--trusted-keys results/capability/trusted-keys.json`.",
        "",
        "| condition | correct | accuracy (95% Wilson) | cut off by the budget | decode tokens | profile (device) | record |",
        "|---|---|---|---|---|---|---|",
    ]
    for c, row in summary["conditions"].items():
        lo, hi = row["ci95"]
        lines.append(f"| {c} | {row['correct']}/{row['items']} | {row['accuracy']:.3f} [{lo:.3f}, {hi:.3f}] | "
                     f"{row['cut_off']}/{row['items']} | {row['decode_tokens']:,} | {row['profile']} "
                     f"({row['device_fingerprint']}) | `{row['record']}` |")
    devices = {row["device_fingerprint"] for row in summary["conditions"].values()}
    if len(devices) > 1:
        # Said, not hidden: the pairing is by problem and prompt, greedy at one budget; the
        # machines' kernels may round differently, which moves single answers, not the design.
        lines += ["", f"The conditions ran on {len(devices)} machines (the device column): the same profile, model, "
                  "problems, prompts and budget, greedy; kernels on different CPUs may round differently."]
    lines += ["", "| paired difference | difference (95% CI) | only the second right | only the first right | McNemar exact p |",
              "|---|---|---|---|---|"]
    for name, pair in summary["pairs"].items():
        lo, hi = pair["low"], pair["high"]
        lines.append(f"| {name} | {pair['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}] | {pair['only_second_correct']} | "
                     f"{pair['only_first_correct']} | {pair['mcnemar_exact_p']:.3g} |")
    (args.out / "v1-README.md").write_text("\n".join(lines) + "\n")
    log(f"table: {args.out / 'v1-README.md'}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--size", type=int, default=100)
    ap.add_argument("--seed", type=int, default=2025)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--profile", default=None, help="determinism profile (default: the engine's default)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "capability")
    ap.add_argument("--work", type=Path, default=ROOT / ".experiments" / "capability")
    ap.add_argument("--key", type=Path, help="the signing key (default: $KVGRAFT_HOME/keys/capability.pem, made when missing)")
    ap.add_argument("--only", default="libraries,similar,base,fixed,table")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    parts = args.only.split(",")
    unknown = set(parts) - {"libraries", "table", *CONDITIONS}
    if unknown:
        raise SystemExit(f"unknown part(s) {sorted(unknown)}; known: libraries, {', '.join(CONDITIONS)}, table")
    from kvgraft.engine import current_profile as profile_named
    from kvgraft.engine import kvgraft_home, load_model

    # The experiment's own key (never the machine's local key): its public half is what
    # OUT/trusted-keys.json trusts, and what an auditor checks the records against.
    key = args.key or kvgraft_home() / "keys" / "capability.pem"
    if not key.exists():
        subprocess.run([*KVGRAFT, "keys", "generate", "--out", str(key)], check=True)
    trust_beside(args.out / "trusted-keys.json", Path(f"{key}.pub"), "kvgraft-capability")
    model = profile = None
    for part in parts:
        if part == "table":
            table(args)
            continue
        if model is None:
            model, profile = load_model(args.model), profile_named(args.profile)
        if part == "libraries":
            build_libraries(args, model, profile, key)
        else:
            evaluate(args, part, model, profile, key)


if __name__ == "__main__":
    main()
