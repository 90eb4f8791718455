"""Calibrate the library's graft threshold (issue 39): how similar a question must be to a deposited
problem before that problem's verified entry is grafted as context (answer kind ``assisted``).

    .venv/bin/python scripts/calibrate_graft_threshold.py [--deposited 1000] [--out results/graft-threshold/deposited-1000.json]

The similarity is the library's own: ``ProblemIndex`` is the TF-IDF cosine ``Library.lookup``
scores entries with, over an index of ``--deposited`` GSM8K train problems (what a library of
that many deposits holds). Every question is looked up and counts as grafted when its best score
is at or above the threshold:

- positives: paraphrases of deposited problems. A graft is right only when it is the entry of
  the problem paraphrased. Two kinds: rule-made paraphrases (framing added, common words swapped
  for synonyms, the question sentence moved first; seeded), and a small set written by hand
  (``HAND``) that rewords more freely;
- negatives: questions that are no deposited problem's paraphrase: GSM8K *test* problems (the
  same domain, different problems: the hardest negatives), the AIME 2025 problems, and everyday
  requests (``EVERYDAY``: what a chat client sends, "What is 2+2?", a haiku).

Precision: right grafts over all grafts (a negative grafted, or a paraphrase grafted with another
problem's entry, is a wrong graft). Recall: right grafts over positives. The threshold is chosen
on the calibration half (paraphrases of deposited problems 0, 2, 4, ...; half the negatives) as
the lowest grid value whose precision is at least ``--target``; the held-out half (the other
problems and negatives, paraphrased with another seed) measures it. The JSON written holds both
halves' figures per threshold and the held-out figures at the chosen one; docs/library.md quotes
them.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "datasets"

#: Everyday requests a chat client sends to an OpenAI-compatible server: none is a math problem.
EVERYDAY = [
    "What is 2+2?", "Write a haiku about the sea.", "Hello, who are you?", "Tell me a joke.",
    "What is the capital of France?", "Translate 'good morning' into Spanish.", "Summarize the plot of Hamlet.",
    "How do I reverse a list in Python?", "What's the weather like on Mars?", "Give me three names for a cat.",
    "Explain photosynthesis in one sentence.", "Who wrote Pride and Prejudice?", "What time is it in Tokyo?",
    "Write a short poem about autumn leaves.", "How many legs does a spider have?", "What is the speed of light?",
    "Recommend a good science fiction book.", "Can you help me write an email to my boss asking for a day off?",
    "What does HTTP stand for?", "Describe a sunset over the ocean.", "Why is the sky blue?",
    "List the planets of the solar system.", "How do you make a cup of tea?", "What is machine learning?",
    "Write a limerick about a dog who loves pizza.", "What is 15% of 80?", "How many days are in a leap year?",
    "Convert 100 degrees Fahrenheit to Celsius.", "What is the square root of 144?", "Is a tomato a fruit?",
    "Sarah has some apples. How many apples does she have?", "How much money do I need to buy a house?",
    "What is the best way to learn to play the guitar?", "How many hours are there in a week?",
    "If a train leaves at 3 pm, when does it arrive?", "Write a SQL query that counts rows in a table.",
    "What are the rules of chess?", "Plan a three-day trip to Rome.", "What is the meaning of life?",
    "Name a famous painting by Van Gogh.",
]

#: Paraphrases written by hand: (GSM8K train index, paraphrase). Reworded more freely than the rules do.
HAND = [
    (0, "In April Natalia sold clips to 48 friends. In May she sold only half that many. What is the total number of clips she sold over the two months?"),
    (1, "Babysitting pays Weng $12 per hour. She babysat for 50 minutes yesterday. What did she earn?"),
    (2, "A new wallet costs $100 and Betty has saved half of that. Her parents give her $15 and her grandparents give twice what her parents gave. How much is Betty still short?"),
    (3, "Julie has a book of 120 pages. She read 12 pages yesterday and double that today. Tomorrow she wants to read half of the pages that remain. How many pages is that?"),
    (4, "Twice a week, James writes a letter of 3 pages to each of 2 friends. How many pages does he write in a year?"),
    (6, "Albert buys 2 large and 2 small pizzas. Large pizzas have 16 slices, small ones 8. If he eats everything, how many slices does he eat in the day?"),
    (8, "Alexis had a $200 budget for interview clothes. She spent $30 on a shirt, $46 on pants, $38 on a coat, $11 on socks and $18 on a belt, then bought shoes but lost the receipt. $16 of her budget is left. What did the shoes cost?"),
    (9, "Tina earns $18.00 per hour. Any shift over 8 hours pays overtime at one and a half times her wage. She works 10-hour days for 5 days. How much does she earn?"),
    (11, "Tobias wants shoes costing $95. He saved for three months with a $5 monthly allowance, and he charges $15 per lawn mowed and $7 per driveway shoveled. He mowed 4 lawns and has $15 left after the purchase. How many driveways did he shovel?"),
    (12, "On his farm Randy grows 60 mango trees and 5 fewer than half as many coconut trees as mango trees. How many trees are there on the farm in total?"),
    (13, "For his dinner party Jasper buys 2 pounds of cheddar for $10, a pound of cream cheese at half the cheddar's price, and cold cuts at twice the cheddar's price. What does he spend in all?"),
    (14, "Joy reads 8 pages every 20 minutes. How long, in hours, does it take her to read 120 pages?"),
    (15, "James makes a movie for $2000. Each DVD costs $6 to produce and sells for 2.5 times that. He sells 500 a day, 5 days a week. What is his profit after 20 weeks?"),
]

#: Common words of GSM8K problems and a synonym each (whole words, lower case).
SYNONYMS = {
    "buys": "purchases", "bought": "purchased", "buy": "purchase", "how many": "what number of",
    "total": "overall", "each": "every", "costs": "is priced at", "cost": "price", "makes": "earns",
    "store": "shop", "friends": "pals", "spends": "uses", "spent": "used", "gives": "hands",
    "gave": "handed", "wants": "would like", "needs": "requires", "altogether": "in all", "twice": "two times",
    "money": "cash", "sells": "sold off", "day": "daily period", "week": "seven days", "hour": "60 minutes",
    "more": "additional", "left": "remaining", "has": "holds", "have": "hold", "after": "following",
    "then": "next", "much": "a lot", "if": "suppose", "works": "labors", "each day": "per day",
    "takes": "needs", "large": "big", "small": "little", "half": "one half", "number": "count",
}
FRAMES_BEFORE = ["", "Please solve: ", "Here is a problem. ", "Q: ", "Can you help me with this? ", "Math question: "]
FRAMES_AFTER = ["", " Show your work.", " Please answer quickly.", " Explain briefly.", " What's the answer?",
                " Give just the number."]
_SENTENCE = re.compile(r"(?<=[.?!])\s+")


def paraphrase(text: str, rng: random.Random) -> str:
    """A rule-made paraphrase: synonyms (each occurrence with probability 0.6), the question
    sentence moved first (probability 0.5), a frame before and after."""
    out = text
    for word, synonym in SYNONYMS.items():
        out = re.sub(rf"\b{re.escape(word)}\b", lambda m, s=synonym: s if rng.random() < 0.6 else m.group(), out,
                     flags=re.IGNORECASE)
    sentences = _SENTENCE.split(out.strip())
    if len(sentences) > 1 and rng.random() < 0.5:
        sentences = [sentences[-1], *sentences[:-1]]
    return rng.choice(FRAMES_BEFORE) + " ".join(sentences) + rng.choice(FRAMES_AFTER)


def _questions(path: Path, key: str) -> list[str]:
    return [json.loads(line)[key] for line in path.read_text().splitlines() if line.strip()]


def _measure(index: Any, positives: list[tuple[int, str]], negatives: list[str]) -> tuple[list[tuple[float, bool]], list[float]]:
    """Each positive's best score and whether its best entry is the one paraphrased; each negative's best score."""
    pos = []
    for target, question in positives:
        best = index.best(question)
        pos.append((0.0, False) if best is None else (best[1], best[0] == target))
    neg = []
    for question in negatives:
        best = index.best(question)
        neg.append(0.0 if best is None else best[1])
    return pos, neg


def _at(threshold: float, pos: list[tuple[float, bool]], neg: list[float]) -> dict[str, Any]:
    right = sum(score >= threshold and ok for score, ok in pos)
    wrong = sum(score >= threshold and not ok for score, ok in pos) + sum(score >= threshold for score in neg)
    grafted = right + wrong
    return {"threshold": threshold, "grafted": grafted, "right": right, "wrong": wrong,
            "negatives_grafted": sum(score >= threshold for score in neg), "negatives": len(neg), "positives": len(pos),
            "precision": round(right / grafted, 4) if grafted else 1.0, "recall": round(right / len(pos), 4) if pos else 0.0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--deposited", type=int, default=1000, help="GSM8K train problems in the index (default 1000)")
    parser.add_argument("--target", type=float, default=0.99, help="precision the threshold must reach on the calibration half")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "graft-threshold" / "deposited-1000.json")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT.parent))
    from kvgraft.engine import GRAFT_THRESHOLD, ProblemIndex

    train = _questions(DATA / "gsm8k_train.jsonl", "question")[: args.deposited]
    index = ProblemIndex(train)
    test = _questions(DATA / "gsm8k_test.jsonl", "question")
    aime = _questions(DATA / "aime2025.jsonl", "prompt")
    halves: dict[str, dict[str, Any]] = {}
    for half, (parity, seed) in {"calibration": (0, 1), "held_out": (1, 2)}.items():
        rng = random.Random(seed)
        rule = [(i, paraphrase(train[i], rng)) for i in range(parity, len(train), 2)]
        hand = [(i, text) for n, (i, text) in enumerate(HAND) if n % 2 == parity and i < len(train)]
        negatives = {"gsm8k_test": test[parity::2], "aime2025": aime[parity::2], "everyday": EVERYDAY[parity::2]}
        measured = {"rule_paraphrases": _measure(index, rule, [])[0], "hand_paraphrases": _measure(index, hand, [])[0]}
        scores = {name: _measure(index, [], qs)[1] for name, qs in negatives.items()}
        halves[half] = {"positives": measured, "negatives": scores}

    grid = [round(t / 100, 2) for t in range(5, 96)]

    def figures(half: str, t: float) -> dict[str, Any]:
        h = halves[half]
        pos = h["positives"]["rule_paraphrases"] + h["positives"]["hand_paraphrases"]
        neg = [s for scores in h["negatives"].values() for s in scores]
        out = _at(t, pos, neg)
        out["by_kind"] = {
            "rule_paraphrases_recall": _at(t, h["positives"]["rule_paraphrases"], [])["recall"],
            "hand_paraphrases_recall": _at(t, h["positives"]["hand_paraphrases"], [])["recall"],
            **{f"{name}_grafted": sum(s >= t for s in scores) for name, scores in h["negatives"].items()},
            **{f"{name}_max_score": round(max(scores, default=0.0), 4) for name, scores in h["negatives"].items()},
        }
        return out

    calibration = [figures("calibration", t) for t in grid]
    chosen = next((row["threshold"] for row in calibration if row["precision"] >= args.target), grid[-1])
    held_out = figures("held_out", chosen)
    result = {
        "similarity": "TF-IDF cosine over words (kvgraft.engine ProblemIndex, as Library.lookup scores entries)",
        "deposited": len(train), "target_precision": args.target, "chosen_threshold": chosen,
        "library_threshold": GRAFT_THRESHOLD, "held_out_at_chosen": held_out,
        "held_out_at_library_threshold": figures("held_out", GRAFT_THRESHOLD),
        "calibration_by_threshold": calibration,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    at = result["held_out_at_library_threshold"]
    sys.stdout.write(
        f"chosen threshold {chosen} (calibration precision >= {args.target}); library threshold {GRAFT_THRESHOLD}: "
        f"held-out precision {at['precision']}, recall {at['recall']} ({at['right']} right, {at['wrong']} wrong grafts; "
        f"{at['negatives_grafted']}/{at['negatives']} negatives grafted); {args.out}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
