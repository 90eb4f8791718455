"""The flywheel's value in one table (issue 39, item 4): a stream of deposited, paraphrased and
new questions through ``kvgraft engine serve`` with a library, against the same stream through
``engine serve`` without one (the base model).

On 127.0.0.1, for one model (default qwen2.5-coder-0.5b, under the profile ``engine serve``
picks: llamacpp-cpu where llama.cpp is built):

- a library of GSM8K train problems is deposited with the real ``kvgraft library deposit``
  (the dataset's worked solutions, each confirmed by the grader; signed by a fresh key);
- the stream (``--questions``, seeded shuffle) is ``--deposited-share`` deposited problems asked
  word for word, ``--paraphrased-share`` other deposited problems paraphrased by the
  calibration's rule (``scripts/calibrate_graft_threshold.py`` ``paraphrase``: synonyms, the
  question moved first, a frame; another seed than the calibration's), and the rest new
  problems (GSM8K test, never deposited);
- each server answers the whole stream, one server at a time on the same 2 cores, from
  ``--clients`` concurrent clients (greedy, budget ``--max-tokens``): the library server gets
  each question as a chat message; the base server (no library) the prompt the library's own
  unassisted answers run (``request``); every answer must be a 200 with its ``kvgraft``
  provenance.

Per group and overall, for each server: accuracy (``graded_answer``: the library server's
``kvgraft.answer``, the base server's text read by the verifier's GSM8K grader; either graded
against the train or test key; an unfinished decode has none and counts wrong), decode tokens (median and mean), latency (client side, p50 and p95) and every answer's
kind counted (``recalled`` / ``assisted`` / ``unassisted``). The figures are one pass of the
stream: its size is the repetition.

    .venv/bin/python bench/flywheel_stream.py [--model qwen2.5-coder-0.5b] [--questions 100] \\
        [--deposited-share 0.4] [--paraphrased-share 0.3] [--clients 4] [--max-tokens 512]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import (
    KVGRAFT,
    QUICK,
    ROOT,
    figure,
    free_port,
    median,
    percentile,
    post_json,
    say,
    server_process,
    write_result,
)

sys.path.insert(0, str(ROOT / "scripts"))
from calibrate_graft_threshold import paraphrase  # noqa: E402  (the calibration's rule, one place)

TRAIN = ROOT / "data" / "datasets" / "gsm8k_train.jsonl"
TEST = ROOT / "data" / "datasets" / "gsm8k_test.jsonl"
GROUPS = ("deposited", "paraphrased", "new")
KINDS = ("recalled", "assisted", "unassisted")


def _run(*args: str | Path) -> dict[str, Any]:
    """``kvgraft --json ARGS``: its JSON answer (SystemExit naming the failure otherwise)."""
    import subprocess

    done = subprocess.run([*KVGRAFT, "--json", *map(str, args)], capture_output=True, text=True, timeout=7200)
    if done.returncode != 0:
        raise SystemExit(f"kvgraft {' '.join(map(str, args[:3]))} failed: {done.stderr.strip()[-600:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def make_stream(args: argparse.Namespace) -> tuple[list[dict[str, Any]], int]:
    """The stream's questions in the order sent (each: group, text, dataset, doc id) and how many
    train problems the library holds (the first ones with a worked solution the grader confirms:
    ``library deposit --limit`` takes them in file order)."""
    from kvgraft.engine import worked_solution
    from kvgraft.verifier import load_dataset

    train, test = load_dataset(TRAIN), load_dataset(TEST)
    n_dep = round(args.questions * args.deposited_share)
    n_par = round(args.questions * args.paraphrased_share)
    n_new = args.questions - n_dep - n_par
    if min(n_dep, n_par, n_new) < 0:
        raise SystemExit("--deposited-share and --paraphrased-share add up to more than 1")
    with_solution = [i for i in range(len(train.docs)) if worked_solution(train, i) is not None][: n_dep + n_par]
    rng = random.Random(args.seed)
    order = with_solution[:]
    rng.shuffle(order)
    stream = [{"group": "deposited", "dataset": "train", "doc": d, "question": train.question(d)} for d in order[:n_dep]]
    stream += [{"group": "paraphrased", "dataset": "train", "doc": d, "question": paraphrase(train.question(d), rng)}
               for d in order[n_dep:]]
    stream += [{"group": "new", "dataset": "test", "doc": d, "question": test.question(d)}
               for d in rng.sample(range(len(test.docs)), n_new)]
    rng.shuffle(stream)
    # ``library deposit --limit N`` takes the first N docs that have a worked solution: these.
    return stream, with_solution[-1] + 1


def request(server: str, model: str, question: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """What each server is sent. The library server: the question as a chat message (it chooses
    recall, graft or nothing). The base server: the same prompt the library's unassisted answers
    run (the library's instruction, then ``Problem: ... Solution: Let's think step by step.``),
    as a completion stopped where the next problem would begin, so that the two differ only by
    the library."""
    from kvgraft.engine import INSTRUCTION, question_text

    if server == "library":
        return "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": question}],
                                        "max_tokens": max_tokens, "temperature": 0}
    return "/v1/completions", {"model": model, "prompt": INSTRUCTION + question_text(question), "max_tokens": max_tokens,
                               "temperature": 0, "stop": ["\nProblem:"]}


def graded_answer(server: str, answer: dict[str, Any], prov: dict[str, Any]) -> tuple[str | None, bool]:
    """The answer graded and whether the decode finished. The library server's is its own
    ``kvgraft.answer`` (a recall's verified one, else the model's from a finished decode). A server
    without a library extracts none (it knows no dataset kind): the verifier's GSM8K grader reads
    the completion's text, of a finished decode only (EOS or the stop string)."""
    from kvgraft.verifier import extract_answer

    if server == "library":
        return prov["answer"], bool(prov["finished"])
    finished = prov["stopped_by"] in ("eos", "stop")
    text = answer["choices"][0]["text"]
    return (extract_answer("gsm8k", text) if finished else None), finished


def run_stream(server: str, port: int, model: str, stream: list[dict[str, Any]],
               args: argparse.Namespace) -> list[dict[str, Any]]:
    """Send the stream from ``args.clients`` clients (each takes the next question when free);
    one row per question: its latency, provenance and grade."""
    from kvgraft.verifier import load_dataset

    keys = {"train": load_dataset(TRAIN), "test": load_dataset(TEST)}
    rows: list[dict[str, Any] | None] = [None] * len(stream)
    lock = threading.Lock()
    cursor = [0]
    errors: list[BaseException] = []

    def client() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
        try:
            while True:
                with lock:
                    i = cursor[0]
                    cursor[0] += 1
                if i >= len(stream) or errors:
                    return
                q = stream[i]
                path, payload = request(server, model, q["question"], args.max_tokens)
                seconds, answer = post_json(conn, path, payload)
                prov = answer.get("kvgraft")
                if not isinstance(prov, dict) or prov.get("kind") not in KINDS:
                    raise SystemExit(f"question {i} came back without its kvgraft provenance: {json.dumps(answer)[:300]}")
                graded, finished = graded_answer(server, answer, prov)
                reference = keys[q["dataset"]].reference(q["doc"])
                rows[i] = {**q, "seconds": round(seconds, 4), "kind": prov["kind"], "method": prov["method"],
                           "score": prov["score"], "finished": finished, "stopped_by": prov["stopped_by"],
                           "decode_tokens": prov["decode_tokens"], "answer": graded, "reference": reference,
                           "correct": graded is not None and graded == reference}
        except BaseException as e:  # reported in the main thread
            errors.append(e)
        finally:
            conn.close()

    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"the stream failed: {errors[0]}")
    return [r for r in rows if r is not None]


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Accuracy, tokens, latency and kinds over ``rows``."""
    if not rows:
        return {"n": 0}
    tokens = [r["decode_tokens"] for r in rows]
    seconds = [r["seconds"] for r in rows]
    return {
        "n": len(rows), "correct": sum(r["correct"] for r in rows),
        "accuracy": round(sum(r["correct"] for r in rows) / len(rows), 4),
        "decode_tokens_total": sum(tokens), "decode_tokens_mean": round(statistics.fmean(tokens), 1),
        "decode_tokens_median": median([float(t) for t in tokens]),
        "latency_p50_s": round(median(seconds), 3), "latency_p95_s": round(percentile(seconds, 95), 3),
        "cut_off": sum(not r["finished"] for r in rows),
        "kinds": {k: sum(r["kind"] == k for r in rows) for k in KINDS},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--questions", type=int, default=20 if QUICK else 100)
    ap.add_argument("--deposited-share", type=float, default=0.4)
    ap.add_argument("--paraphrased-share", type=float, default=0.3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128 if QUICK else 512)
    ap.add_argument("--seed", type=int, default=4)
    args = ap.parse_args()
    stream, deposit = make_stream(args)
    with tempfile.TemporaryDirectory(prefix="kvgraft-bench-stream-") as tmp_name:
        tmp = Path(tmp_name)
        key, trust, library = tmp / "key.pem", tmp / "trusted-keys.json", tmp / "library"
        _run("keys", "generate", "--out", key)
        _run("keys", "trust", "--file", trust, "--name", "bench", "--public-key", f"{key}.pub")
        say(f"{args.model}: depositing the first {deposit} train problems")
        t0 = time.perf_counter()
        deposited = _run("library", "deposit", "--model", args.model, "--dataset", TRAIN, "--library", library,
                         "--limit", deposit, "--key", key)
        deposit_s = time.perf_counter() - t0
        # A problem whose worked solution the grader refused is not in the library: not asked as deposited.
        refused = set(deposited["refused"])
        stream = [q for q in stream if not (q["dataset"] == "train" and q["doc"] in refused)]
        serve = [*KVGRAFT, "engine", "serve", "--model", args.model, "--log-level", "warning", "--host", "127.0.0.1",
                 "--request-timeout", "3600"]
        results: dict[str, list[dict[str, Any]]] = {}
        for server, extra in (("library", ["--library", str(library), "--trusted-keys", str(trust)]), ("base", [])):
            port = free_port()
            with server_process([*serve, *extra, "--port", str(port)], tmp / f"serve-{server}.log", port, "/v1/models",
                                seconds=600):
                say(f"{server}: {len(stream)} questions from {args.clients} clients")
                t0 = time.perf_counter()
                results[server] = run_stream(server, port, args.model, stream, args)
                say(f"{server}: {time.perf_counter() - t0:.0f} s, {sum(r['correct'] for r in results[server])} right")
    table = {server: {"all": summarize(rows), **{g: summarize([r for r in rows if r["group"] == g]) for g in GROUPS}}
             for server, rows in results.items()}
    write_result("flywheel_stream", {
        "description": "a stream of deposited, paraphrased and new GSM8K questions through kvgraft engine serve with a "
        "library and without one (base), one server at a time, concurrent clients, greedy",
        "model": args.model, "questions": len(stream), "library_entries": deposited["entries"],
        "refused_deposits": sorted(refused), "deposit_seconds": round(deposit_s, 1),
        "shares": {"deposited": args.deposited_share, "paraphrased": args.paraphrased_share,
                   "new": round(1 - args.deposited_share - args.paraphrased_share, 4)},
        "clients": args.clients, "max_tokens": args.max_tokens, "seed": args.seed,
        "table": table, "answers": results,
    })
    for server, groups in table.items():
        for g, s in groups.items():
            say(f"{server:7s} {g:11s} {s['correct']}/{s['n']} right, {s['decode_tokens_mean']} tokens mean, "
                f"p50 {s['latency_p50_s']} s, kinds {s['kinds']}")
    plot(table)


def plot(table: dict[str, dict[str, Any]]) -> None:
    """Accuracy and mean decode tokens per group, library server beside the base model."""
    with figure("flywheel_stream") as fig:
        if fig is None:
            return
        groups = [*GROUPS, "all"]
        for n, (field, label) in enumerate((("accuracy", "accuracy"), ("decode_tokens_mean", "decode tokens per answer")), 1):
            ax = fig.add_subplot(1, 2, n)
            for j, server in enumerate(table):
                ax.bar([i + 0.4 * j for i in range(len(groups))], [table[server][g][field] for g in groups], width=0.4,
                       label=server)
            ax.set_xticks([i + 0.2 for i in range(len(groups))], groups)
            ax.set_ylabel(label)
            ax.legend(fontsize=7)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
