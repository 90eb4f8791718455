"""The seed paper's flywheel experiments at our scale (issue 7), with signed records.

    .venv/bin/python scripts/flywheel_experiments.py [--out results/flywheel] [--work DIR]
        [--aime-budget 256] [--gsm8k-size 50] [--gsm8k-seed 2025] [--gsm8k-budget 192]
        [--widening 1,5,10] [--only recurring,transfer,widening]

1. Recurring case, AIME 2025: base model with a stated decode budget per problem vs answers
   recalled from a library holding the verified answers (AIME ships no worked solutions, so the
   library stores the key's answer as the solution: this measures the cost of answering a
   repeat question from cached verified work, not problem solving).
2. Held-out transfer, GSM8K: a library from gsm8k_train (worked solutions, each answer checked
   by the grader); a fixed seeded slice of gsm8k_test answered by the base model and with the
   most similar train entry grafted in front. Accuracy with a 95% Wilson interval; the paired
   difference with a 95% interval (normal approximation on the per-item differences).
3. Context widening: the train library grown to 1x, 5x, 10x smollm2-135m's 8,192-token window;
   at each size a fresh process answers questions drawn across the whole store, and its peak
   resident memory is read from the kernel (getrusage of the child).

Every evaluation is a signed record under OUT (``kvgraft-verify eval`` re-checks it); the
libraries (gigabytes of KV) stay under WORK. ``OUT/summary.json`` holds the table's figures, each
with the record it comes from; ``OUT/README.md`` the table. Steps whose output exists are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from experiment_keys import KVGRAFT, VERIFY, record_predicate, trust_beside
from experiment_stats import paired, wilson

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "datasets"
MODEL = "smollm2-135m"
#: The libraries are deposited here with this machine's local key (no --key): reading them back
#: verifies every entry's signature against that key, which the experiments trust by saying so.
TRUST = ["--trust-local-key"]
WINDOW = 8192


def run(args: list[str], **kw: Any) -> dict[str, Any]:
    """Run a ``kvgraft --json`` command; return its JSON answer (exit non-zero on failure)."""
    proc = subprocess.run([*KVGRAFT, "--json", *args], capture_output=True, text=True, check=False, **kw)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise SystemExit(f"failed: kvgraft {' '.join(args)}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def recurring(out: Path, work: Path, budget: int) -> dict[str, Any]:
    dataset = DATA / "aime2025.jsonl"
    base, lib, library = out / "aime-base", out / "aime-library", work / "lib-aime"
    if not base.exists():
        run(["eval", "--model", MODEL, "--dataset", str(dataset), "--max-new-tokens", str(budget), "--out", str(base)])
    if not (library / "library.json").exists() or not lib.exists():
        run(["library", "deposit", "--model", MODEL, "--dataset", str(dataset), "--library", str(library), "--solutions-from-key",
             *TRUST])
    if not lib.exists():
        run(["eval", "--model", MODEL, "--dataset", str(dataset), "--library", str(library), "--out", str(lib), *TRUST])
    b, g = record_predicate(base), record_predicate(lib)
    return {
        "dataset": "aime2025.jsonl", "problems": b["aggregates"]["items"], "decode_budget_base": budget,
        "base": {**b["aggregates"], **{k: b["settings"][k] for k in ("seconds", "energy_joules", "energy_method")}, "record": base.name},
        "library": {**g["aggregates"], **{k: g["settings"][k] for k in ("seconds", "energy_joules", "energy_method")}, "record": lib.name},
        "decode_token_ratio": b["aggregates"]["decode_tokens"] / max(1, g["aggregates"]["decode_tokens"]),
    }


def transfer(out: Path, work: Path, size: int, seed: int, budget: int, train_limit: int) -> dict[str, Any]:
    test, train = DATA / "gsm8k_test.jsonl", DATA / "gsm8k_train.jsonl"
    base, lib, library = out / "gsm8k-base", out / "gsm8k-library", work / "lib-gsm8k"  # shared with widening
    common = ["--dataset", str(test), "--limit", str(size), "--seed", str(seed), "--max-new-tokens", str(budget)]
    if not (library / "library.json").exists():
        run(["library", "deposit", "--model", MODEL, "--dataset", str(train), "--library", str(library), "--limit", str(train_limit),
             *TRUST])
    if not base.exists():
        run(["eval", "--model", MODEL, *common, "--out", str(base)])
    if not lib.exists():
        # Threshold 0: the experiment grafts the most similar train entry at any score (as before issue 39).
        run(["eval", "--model", MODEL, *common, "--library", str(library), "--graft-threshold", "0", "--out", str(lib), *TRUST])
    b, g = record_predicate(base), record_predicate(lib)
    bc, gc = [i["correct"] for i in b["items"]], [i["correct"] for i in g["items"]]
    return {
        "dataset": "gsm8k_test.jsonl", "slice": {"size": size, "seed": seed}, "decode_budget": budget,
        # The library may have grown past --gsm8k-train (the widening part shares it): the record says.
        "library_entries_from_train": g["settings"]["library_entries"],
        "base": {**b["aggregates"], "ci95": wilson(sum(bc), len(bc)), "record": base.name},
        "library": {**g["aggregates"], "ci95": wilson(sum(gc), len(gc)), "record": lib.name},
        "paired": paired(bc, gc),
    }


def widening(out: Path, work: Path, multiples: list[int], questions: int, earlier: list[dict[str, Any]],
             profile: str = "cpu-fp32") -> dict[str, Any]:
    """Grow one library past the window; at each size, a fresh process answers across it.

    The library only grows, so a smaller multiple cannot be re-measured once passed: rows of
    ``earlier`` runs for multiples not asked for now are kept when they were made under the same
    profile (``cpu-fp32-kv16`` stores half the bytes: its library is another one).
    """
    import resource

    from kvgraft.engine import ensure_local_key, local_public_key_path, read_index
    from kvgraft.schemas import LIBRARY_INDEX_FILE

    # The records are signed with this machine's local key: trusted beside them, so that
    # kvgraft-verify eval re-checks them offline (a later machine's key under a name of its own).
    ensure_local_key()
    trusted = out / "trusted-keys.json"
    trust_beside(trusted, local_public_key_path(), "kvgraft-experiments")
    train = DATA / "gsm8k_train.jsonl"
    # The default profile's library is the transfer part's; another profile's is its own.
    library = work / ("lib-gsm8k" if profile == "cpu-fp32" else f"lib-gsm8k-{profile}")
    rows = []
    # The dataset's lines as they are (each a JSON object ending in "\n"): copied to the
    # questions file byte for byte, so the record is graded against the text that was deposited.
    docs = train.read_text().split("\n")
    for k in multiples:
        target = k * WINDOW
        while True:
            # No index yet: nothing deposited (read_index reads a library that exists, or fails).
            lines = list(read_index(library)) if (library / LIBRARY_INDEX_FILE).exists() else []
            stored = sum(line.tokens for line in lines)
            if stored >= target:
                break
            # Problems offered per deposit process (each loads the model once): about what the
            # target still needs at ~180 tokens each, at most 400, so a row lands near its multiple.
            step = min(400, max(8, (target - stored) // 180 + 1))
            limit = (lines[-1].doc_index + 1 if lines else 0) + step
            if lines and limit - step >= len(docs):
                raise SystemExit(f"gsm8k_train holds too few verified solutions for {k}x the window")
            run(["library", "deposit", "--model", MODEL, "--dataset", str(train), "--library", str(library), "--limit", str(limit),
                 "--profile", profile, *TRUST])
        entries = lines  # the index as the loop last read it, holding the target
        # Questions spread evenly over the whole store: its first, last and every entry between.
        picks = [entries[round(i * (len(entries) - 1) / (questions - 1))].doc_index for i in range(questions)]
        # Beside the record: the dataset file kvgraft-verify eval re-grades it against.
        qfile = out / f"widening-{k}x.jsonl"
        qfile.write_text("".join(docs[i] + "\n" for i in picks))
        record = out / f"widening-{k}x"
        if record.exists():
            shutil.rmtree(record)
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        t0 = time.perf_counter()
        proc = subprocess.Popen([*KVGRAFT, "--json", "eval", "--model", MODEL, "--dataset", str(qfile), "--library", str(library),
                                 "--max-new-tokens", "16", "--out", str(record), *TRUST], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        answer = json.loads(proc.stdout.read().strip().splitlines()[-1]) if proc.stdout else {}
        if status != 0:
            raise SystemExit(f"widening eval at {k}x failed")
        check = subprocess.run([*VERIFY, "eval", str(record), "--dataset", str(qfile), "--trusted-keys", str(trusted)],
                               capture_output=True, text=True, check=False)
        if check.returncode != 0:
            raise SystemExit(f"kvgraft-verify eval {record} failed: {check.stdout}{check.stderr}")
        rows.append({
            "multiple": k, "entries": len(entries), "stored_tokens": sum(e["tokens"] for e in entries),
            "window": WINDOW, "questions": questions, "correct": answer["correct"], "decode_tokens": answer["decode_tokens"],
            "peak_rss_mib": round(usage.ru_maxrss / 1024, 1), "seconds": round(time.perf_counter() - t0, 1),
            "record": record.name, "earlier_children_max_rss_kib": before, "profile": profile,
            "library_bytes": sum(f.stat().st_size for f in library.rglob("*") if f.is_file()), "verified": True,
        })
        sys.stderr.write(f"widening {k}x: {rows[-1]}\n")
    kept = [r for r in earlier if r["multiple"] not in multiples and r.get("profile", "cpu-fp32") == profile]
    return {"model": MODEL, "rows": sorted(kept + rows, key=lambda r: r["multiple"])}


def table(summary: dict[str, Any]) -> str:
    """The README's markdown tables, from ``summary.json``."""
    out = []
    if "recurring" in summary:
        r = summary["recurring"]
        out += ["### Recurring case: AIME 2025 (30 problems), smollm2-135m", "",
                "| run | solved | prompt tokens | decode tokens | seconds | energy (J) | record |", "|---|---|---|---|---|---|---|"]
        for label, key in ((f"base, {r['decode_budget_base']}-token budget", "base"), ("from the library (recall)", "library")):
            a = r[key]
            out.append(f"| {label} | {a['correct']}/{a['items']} | {a['prompt_tokens']:,} | {a['decode_tokens']:,} | {a['seconds']:.0f} | "
                       f"{a['energy_joules']} ({a['energy_method']}) | `results/flywheel/{a['record']}` |")
        out += ["", f"Decode tokens, base / library: {r['decode_token_ratio']:.1f}x.", ""]
    if "transfer" in summary:
        t = summary["transfer"]
        out += [f"### Held-out transfer: GSM8K test, {t['slice']['size']} problems drawn with seed {t['slice']['seed']}, "
                f"{t['decode_budget']}-token budget", "",
                "| run | correct | accuracy (95% Wilson) | decode tokens | record |", "|---|---|---|---|---|"]
        for label, key in (("base", "base"), ("graft of the most similar train solution", "library")):
            a = t[key]
            out.append(f"| {label} | {a['correct']}/{a['items']} | {a['accuracy']:.3f} [{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}] | "
                       f"{a['decode_tokens']} | `results/flywheel/{a['record']}` |")
        p = t["paired"]
        out += ["", f"Paired difference (graft - base): {p['difference']:+.3f}, 95% interval [{p['low']:+.3f}, {p['high']:+.3f}] "
                f"({p['only_second_correct']} problems only the graft solved, {p['only_first_correct']} only the base).", ""]
    if "widening" in summary:
        w = summary["widening"]
        out += ["### Context widening: one library grown past the 8,192-token window", "",
                "| store / window | entries | stored tokens | library on disk | questions answered correctly | decode tokens | "
                "peak RSS (MiB) | seconds | profile | record |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for row in w["rows"]:
            size = f"{row['library_bytes'] / 2**30:.1f} GiB" if "library_bytes" in row else ""
            out.append(f"| {row['stored_tokens'] / row['window']:.1f}x (target {row['multiple']}x) | {row['entries']} | {row['stored_tokens']:,} | "
                       f"{size} | {row['correct']}/{row['questions']} | {row['decode_tokens']} | {row['peak_rss_mib']} | "
                       f"{row['seconds']} | {row.get('profile', 'cpu-fp32')} | `results/flywheel/{row['record']}` |")
        out += ["", "Each row's record passes `kvgraft-verify eval results/flywheel/widening-Kx --dataset "
                "results/flywheel/widening-Kx.jsonl --trusted-keys results/flywheel/trusted-keys.json`; peak RSS is the "
                "answering process's, read from the kernel (wait4).", ""]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "flywheel")
    ap.add_argument("--work", type=Path, default=ROOT / ".experiments")
    ap.add_argument("--aime-budget", type=int, default=256)
    ap.add_argument("--gsm8k-size", type=int, default=50)
    ap.add_argument("--gsm8k-seed", type=int, default=2025)
    ap.add_argument("--gsm8k-budget", type=int, default=192)
    ap.add_argument("--gsm8k-train", type=int, default=500, help="train problems offered to the transfer library")
    ap.add_argument("--widening", default="1,5,10")
    ap.add_argument("--widening-questions", type=int, default=10)
    ap.add_argument("--widening-profile", default="cpu-fp32",
                    help="the library's profile (cpu-fp32-kv16: half-size artifacts, for 87x the window on this disk)")
    ap.add_argument("--only", default="recurring,widening,transfer")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    summary_path = args.out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    for part in args.only.split(","):
        t0 = time.perf_counter()
        if part == "recurring":
            summary[part] = recurring(args.out, args.work, args.aime_budget)
        elif part == "transfer":
            summary[part] = transfer(args.out, args.work, args.gsm8k_size, args.gsm8k_seed, args.gsm8k_budget, args.gsm8k_train)
        elif part == "table":
            (args.out / "README.md").write_text(table(summary))
            continue
        elif part == "widening":
            earlier = summary.get("widening", {}).get("rows", [])
            summary[part] = widening(args.out, args.work, [int(x) for x in args.widening.split(",")], args.widening_questions, earlier,
                                     args.widening_profile)
        else:
            raise SystemExit(f"unknown part {part!r}")
        summary[part]["wall_seconds"] = round(time.perf_counter() - t0, 1)
        # Re-read before writing: parts may run in separate processes side by side.
        on_disk = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        summary = {**on_disk, part: summary[part]}
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        sys.stderr.write(f"{part}: done in {summary[part]['wall_seconds']} s\n")


if __name__ == "__main__":
    main()
