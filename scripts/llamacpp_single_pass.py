"""Single-pass equality under ``llamacpp-cpu`` (issue 36, item 4): on the exactness experiment's
own prefix/continuation pairs (``draw_pairs``, same seed and lengths), how often prefix and
continuation computed in one llama.cpp call give the same logits as the prefix then the
continuation (``fresh``, what a graft equals), and by how much they differ.

    .venv/bin/python scripts/llamacpp_single_pass.py --model smollm2-135m --samples 50 [--out FILE]

Writes a JSON summary (per sample: prefix tokens, equal or not, max |difference| in a logit,
whether the argmax agrees at every position).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvgraft.engine import current_profile, draw_pairs, fresh, load_model_for, single_pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    profile = current_profile("llamacpp-cpu")
    model = load_model_for(args.model, profile)
    max_tokens = min(2 * model.sliding_window if model.sliding_window else 768, model.spec.window - 16)
    rows = []
    for pair in draw_pairs(model, args.samples, args.seed, min_tokens=16, max_tokens=max_tokens, continuation_tokens=8):
        two = fresh(model, profile, pair.prefix, pair.continuation)
        one = single_pass(model, profile, pair.prefix, pair.continuation)
        diff = float((two.logits - one.logits).abs().max())
        rows.append({"prefix_tokens": two.prefix_tokens, "equal": two.summary()["logits_sha256"] == one.summary()["logits_sha256"],
                     "max_abs_diff": diff, "argmax_agree": bool((two.logits.argmax(-1) == one.logits.argmax(-1)).all())})
        sys.stderr.write(f"{len(rows)}/{args.samples}: {rows[-1]}\n")
    summary = {"model": args.model, "profile": profile.name, "samples": len(rows), "equal": sum(r["equal"] for r in rows),
               "argmax_agree": sum(r["argmax_agree"] for r in rows), "max_abs_diff": max(r["max_abs_diff"] for r in rows),
               "rows": rows}
    text = json.dumps(summary, indent=1)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))


if __name__ == "__main__":
    main()
