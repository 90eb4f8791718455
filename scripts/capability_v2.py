"""The capability experiment, redesigned (issue 39): base greedy, self-consistency@k and a
verifier-gated flywheel, paired on the same GSM8K test problems, pre-registered and resumable.

    KVGRAFT_HOME=.kvgraft-home nice -n 19 .venv/bin/python scripts/capability_v2.py \\
        [--model qwen2.5-coder-1.5b] [--profile llamacpp-cpu] [--size 600] [--seed 39] [--k 4] \\
        [--budget 512] [--temperature 0.7] [--top-p 0.95] [--batch 16] [--out results/capability] \\
        [--work .experiments/capability-v2] [--only design,library,base,vote,flywheel,publish,table]

Parts, in order (each skips what is done; a stopped part resumes from its journals):

``design``   draws the test problems (``--size`` with ``--seed``) and, for each, the most similar
             GSM8K train problem (TF-IDF over train questions: questions only, no test answer
             is read), writes the design as a signed pre-registration (``OUT/design``) and logs it
             in the experiment's registry (``WORK/registry``, a ``kvgraft serve`` started on
             127.0.0.1 for the run; its proof ``OUT/design/log.json``, ``OUT/checkpoint.txt``). Refused once any arm's output exists: the design comes first.
``library``  the flywheel's library, from the train split only: the model answers each chosen
             train problem greedily (a signed evaluation record, ``OUT/library-source``); each
             answer the grader confirms against the train key is deposited as a worked solution
             (``WORK/library``).
``base``     greedy, the instruction and the problem (``kvgraft eval``'s base mode).
``vote``     self-consistency@k: k samples per problem (temperature, top_p, seed + doc*k + j),
             plurality of the finished ones' answers.
``flywheel`` the same k samples; where they are not unanimous, one greedy answer with the most
             similar verified library entry grafted, then the vote (engine/_internal/capability.py).
``publish``  logs each arm's record (after the design) and writes every ``log.json`` at one
             checkpoint (``OUT/checkpoint.txt``).
``table``    re-checks every arm with ``kvgraft-verify eval --design`` and writes
             ``OUT/summary.json`` and ``OUT/README.md`` (partial arms are reported as missing).

Each arm's record is ``OUT/arms/NAME``; it names the design (envelope digest and arm).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from experiment_keys import KVGRAFT, VERIFY, record_predicate, trust_beside
from experiment_stats import paired, wilson

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "data" / "datasets"
TEST, TRAIN = DATA / "gsm8k_test.jsonl", DATA / "gsm8k_train.jsonl"
ALPHA = 0.01


def log(message: str) -> None:
    sys.stderr.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}\n")
    sys.stderr.flush()


#: ``--pause-while FILE``: between items, wait while FILE exists (another job's timing runs).
PAUSE_FILE: list[Path] = []


def pause_while() -> None:
    """Wait while the ``--pause-while`` file exists (checked between items: the decoding stops,
    its threads idle; the journals keep everything finished)."""
    if PAUSE_FILE and PAUSE_FILE[0].exists():
        log(f"paused while {PAUSE_FILE[0]} exists")
        while PAUSE_FILE[0].exists():
            time.sleep(30)
        log("resumed")


def arm_names(k: int) -> tuple[str, str, str]:
    """The three arms' names: base, self-consistency@k, flywheel."""
    return "base", f"self-consistency@{k}", "flywheel"


# --- the registry ---------------------------------------------------------------------------------


@contextlib.contextmanager
def registry(args: argparse.Namespace, key: Path) -> Iterator[tuple[str, str, Path]]:
    """The experiment's own registry, ``WORK/registry`` (its data directory holds the registry's
    private key and admin secret: never committed): ``kvgraft serve`` on 127.0.0.1 for the block;
    yields its URL, a publishing token bound to ``key`` and its public key file (copied to
    ``OUT/registry-key.pub.pem``, what an auditor checks checkpoints with)."""
    data = args.work / "registry"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server_log = args.work / "registry.log"
    with server_log.open("ab") as out:
        proc = subprocess.Popen([*KVGRAFT, "serve", "--data", str(data), "--init", "--port", str(port), "--log-level", "warning"],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/v1/log/checkpoint", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the registry did not start: see {server_log}")
            time.sleep(0.5)
        # The token may publish under every key the experiment trusts: records signed on an earlier
        # machine (whose private key stayed there) are logged beside this machine's.
        keys = args.work / "publisher-keys"
        keys.mkdir(exist_ok=True)
        pems = [f"{key}.pub"]
        for entry in json.loads((args.out / "trusted-keys.json").read_text())["keys"]:
            pem = keys / f"{entry['keyid']}.pub.pem"
            pem.write_text(entry["public_key_pem"])
            pems.append(str(pem))
        r = subprocess.run([*KVGRAFT, "--json", "token", "create", "--data", str(data), "--publisher", "kvgraft-capability",
                            *[a for pem in pems for a in ("--key", pem)]], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise SystemExit(f"token create failed: {r.stderr.strip()}")
        public = data / "registry-key.pub.pem"
        (args.out / "registry-key.pub.pem").write_bytes(public.read_bytes())
        yield url, json.loads(r.stdout)["token"], public
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def publish(url: str, token: str, registry_key: Path, directory: Path) -> int:
    """Log ``directory``'s record (idempotent: a logged one comes back with its index)."""
    r = subprocess.run([*KVGRAFT, "--json", "publish", "--registry", url, "--token", token, "--registry-key", str(registry_key),
                        str(directory)], capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"publish {directory} failed: {r.stderr.strip() or r.stdout.strip()}")
    index = json.loads(r.stdout.strip().splitlines()[-1])["log_index"]
    log(f"logged {directory} as entry {index}")
    return int(index)


def prove(url: str, registry_key: Path, directories: list[Path], checkpoint: Path) -> None:
    """``log.json`` in each directory, at one signed checkpoint written to ``checkpoint``."""
    from kvgraft.registry.client import RegistryClient
    from kvgraft.registry.client import registry_key as read_registry_key
    from kvgraft.registry.report import write_log_proofs

    with RegistryClient(url) as client:
        write_log_proofs(client, read_registry_key(client, registry_key), directories, checkpoint)


# --- the design -----------------------------------------------------------------------------------


def draw(args: argparse.Namespace) -> tuple[list[int], list[int]]:
    """The test doc ids (``select``) and, per test problem in order, its most similar train
    problem with a worked solution (distinct: a train problem chosen once)."""
    from kvgraft.engine import ProblemIndex, select, worked_solution
    from kvgraft.verifier import load_dataset

    test, train = load_dataset(TEST), load_dataset(TRAIN)
    test_ids = select(test, args.size, args.seed)
    train_ids = [i for i in range(len(train.docs)) if worked_solution(train, i) is not None]
    index = ProblemIndex([train.question(i) for i in train_ids])
    chosen: list[int] = []
    for t in test_ids:
        best = index.best(test.question(t))
        if best is not None and train_ids[best[0]] not in chosen:
            chosen.append(train_ids[best[0]])
    return test_ids, chosen


def design_of(args: argparse.Namespace) -> Any:
    from kvgraft.engine import FLYWHEEL_RULE, VOTE_RULE
    from kvgraft.schemas import DesignAnalysis, DesignArm, DesignComparison, DesignSplit, ExperimentDesign
    from kvgraft.verifier import load_dataset

    test_ids, train_ids = draw(args)
    test, train = load_dataset(TEST), load_dataset(TRAIN)
    base, vote, fly = arm_names(args.k)
    common: dict[str, str | int | float | bool | None] = {"max_new_tokens": args.budget, "limit": args.size, "seed": args.seed,
                                                          "batch": args.batch}
    sampled = {**common, "k": args.k, "temperature": args.temperature, "top_p": args.top_p, "sample_seed": args.seed}
    return ExperimentDesign(
        test=DesignSplit(name=test.name, digest=test.digest, doc_ids=test_ids,
                         rule=f"select(gsm8k_test, limit={args.size}, seed={args.seed}): random.Random(seed).sample, sorted"),
        train=DesignSplit(name=train.name, digest=train.digest, doc_ids=train_ids,
                          rule="for each test problem in order, the most similar train problem with a worked solution "
                          "(ProblemIndex: TF-IDF cosine over the questions' text), each once"),
        arms=[
            DesignArm(name=base, description=f"greedy, the instruction and the problem, budget {args.budget} tokens",
                      settings={**common, "mode": "base"}),
            DesignArm(name=vote, description=f"{args.k} samples per problem; {VOTE_RULE}", settings={**sampled, "mode": "vote"}),
            DesignArm(name=fly, description=(
                f"the library: the model answers each train problem of the design greedily (budget {args.budget}); "
                "every answer the grader confirms against the train key is deposited as a worked solution. "
                f"On a test problem: the same {args.k} samples as {vote}; {FLYWHEEL_RULE}"),
                settings={**sampled, "mode": "flywheel", "graft_threshold": args.graft_threshold}),
        ],
        k=args.k, budget=args.budget,
        decision_rule=(f"{base}: the greedy answer. {vote}: {VOTE_RULE}. {fly}: {FLYWHEEL_RULE}. Answers only from finished "
                       "decodes; graded by the verifier's GSM8K grader against the test key."),
        analysis=DesignAnalysis(
            test="mcnemar-exact-two-sided", alpha=ALPHA, interval="wilson-95",
            comparisons=[DesignComparison(first=vote, second=fly, primary=True), DesignComparison(first=base, second=fly),
                         DesignComparison(first=base, second=vote)],
        ),
    )


def samples_journal(args: argparse.Namespace) -> Path:
    """The samples shared by self-consistency@k and the flywheel: ``OUT/arms/samples.journal.jsonl``,
    beside the arms' own journals, so that it is committed with them. A journal resumes only
    under the profile that began it (its identity holds the device fingerprint): a later session
    on a machine with the same CPU and llama.cpp build goes on from it; on another ``set_aside_foreign``
    moves it aside and the arm starts afresh."""
    return args.out / "arms" / "samples.journal.jsonl"


def began_marker(args: argparse.Namespace) -> Path:
    """``WORK/test-output-began``: written when the first arm starts, so that a design made later
    with the same work directory (and its registry) is refused even under another ``--out``."""
    return args.work / "test-output-began"


def any_test_output(args: argparse.Namespace) -> list[Path]:
    arms = args.out / "arms"
    found = [p for p in arms.iterdir()] if arms.exists() else []
    marker = began_marker(args)
    return found + ([marker] if marker.exists() else []) + sorted(args.work.glob("samples*.journal.jsonl"))


def part_design(args: argparse.Namespace, model: Any, profile: Any, key: Path) -> None:
    from kvgraft.engine import write_design

    target = args.out / "design"
    if (target / "record.dsse.json").exists():
        log(f"design: {target} exists")
    else:
        outputs = any_test_output(args)
        if outputs:
            raise SystemExit(f"test output exists already ({outputs[0]}): a design is registered before any test output; "
                             "choose a new --out and --work")
        design = design_of(args)
        command = ["scripts/capability_v2.py", *sys.argv[1:]]
        write_design(target, design, model=model, profile=profile, dataset_path=TEST, command=command, key=key)
        log(f"design: {target} written ({len(design.test.doc_ids)} test, {len(design.train.doc_ids) if design.train else 0} train)")
    with registry(args, key) as (url, token, registry_key):
        publish(url, token, registry_key, target)
        prove(url, registry_key, [target], args.out / "checkpoint.txt")


def design_ref(args: argparse.Namespace, arm: str) -> Any:
    from kvgraft.schemas import DesignRef, sha256_bytes

    envelope = (args.out / "design" / "record.dsse.json").read_bytes()
    return DesignRef(envelope_digest=sha256_bytes(envelope), arm=arm)


def read_design(args: argparse.Namespace) -> Any:
    from kvgraft.schemas import PreRegistrationStatement, statement_unverified
    from kvgraft.verifier import read_envelope

    path = args.out / "design" / "record.dsse.json"
    if not path.exists():
        raise SystemExit(f"no design at {path}: run --only design first")
    statement = statement_unverified(read_envelope(path), what=str(path))
    if not isinstance(statement, PreRegistrationStatement) or statement.predicate.design is None:
        raise SystemExit(f"{path} is not a design")
    return statement.predicate.design


# --- the parts ------------------------------------------------------------------------------------


def set_aside_foreign(journal: Path, profile: Any) -> None:
    """Move ``journal`` aside when another profile began it (another CPU or llama.cpp build: its
    header's profile, device fingerprint included, is not this one), so the part starts afresh
    here instead of being refused. The journal is kept as ``NAME.<profile digest>.set-aside.jsonl``."""
    from kvgraft.schemas import canonical_json, hex_of, sha256_bytes

    if not journal.exists():
        return
    with journal.open("rb") as f:
        first = f.readline(1 << 20)
    try:
        began = json.loads(first)["run"]["profile"]
    except (ValueError, KeyError, TypeError):
        return  # not a journal header: the engine refuses it with its own message
    if began == profile.model_dump(mode="json"):
        return
    digest = hex_of(sha256_bytes(canonical_json(began)))[:12]
    target = journal.with_name(journal.name.removesuffix(".journal.jsonl") + f".{digest}.set-aside.jsonl")
    journal.rename(target)
    log(f"{journal} was begun under another profile ({began.get('device_fingerprint', '?')[:80]}...): set aside as {target}")


def part_library(args: argparse.Namespace, model: Any, profile: Any, key: Path) -> None:
    from kvgraft.engine import Library, journal_path, run_eval, trust_signer
    from kvgraft.schemas import LIBRARY_FILE
    from kvgraft.verifier import load_dataset

    design = read_design(args)
    source = args.out / "library-source"
    if not source.exists():
        set_aside_foreign(journal_path(source), profile)

        def item(n: int, total: int, it: Any) -> None:
            log(f"library-source {n + 1}/{total}: train doc {it.doc_id} {'right' if it.correct else 'wrong'} ({it.decode_tokens} tokens)")
            pause_while()

        run_eval(model, profile, TRAIN, source, key=key, max_new_tokens=args.budget, batch=args.batch,
                 doc_ids=design.train.doc_ids, on_item=item)
    done = args.work / "library.done"
    if done.exists():
        log(f"library: {args.work / 'library'} complete")
        return
    train = load_dataset(TRAIN)
    directory = args.work / "library"
    trusted = trust_signer(key, None, name="experiment key")
    library = (Library.open(directory, model, profile, trusted=trusted) if (directory / LIBRARY_FILE).exists()
               else Library.create(directory, model, profile, kind=train.kind, key=key))
    p = record_predicate(source)
    outputs = {json.loads(line)["doc_id"]: json.loads(line)["output"]
               for line in (source / "outputs.jsonl").read_text().splitlines()}
    right = [i["doc_id"] for i in p["items"] if i["correct"]]
    for n, doc in enumerate(right):
        entry = library.deposit(train, doc, outputs[doc], key=key)
        log(f"library deposit {n + 1}/{len(right)}: train doc {doc} {'ok' if entry is not None else 'refused'}")
        pause_while()
    done.write_text(json.dumps({"entries": len(library.entries), "confirmed": len(right), "tried": len(p["items"])}) + "\n")


def part_arm(args: argparse.Namespace, arm: str, model: Any, profile: Any, key: Path) -> None:
    from kvgraft.engine import Library, Sampling, journal_path, run_eval, run_voted_eval, trust_signer

    design = read_design(args)
    base, vote, fly = arm_names(design.k)
    out = args.out / "arms" / arm
    if (out / "record.dsse.json").exists():
        log(f"{arm}: {out} exists")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    if not began_marker(args).exists():
        began_marker(args).write_text(f"{arm} {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
    set_aside_foreign(journal_path(out), profile)
    if arm != base:
        set_aside_foreign(samples_journal(args), profile)
    spec = next(a for a in design.arms if a.name == arm).settings
    ref = design_ref(args, arm)

    def item(n: int, total: int, it: Any) -> None:
        log(f"{arm} {n + 1}/{total}: doc {it.doc_id} {'right' if it.correct else 'wrong'} ({it.decode_tokens} tokens)")
        pause_while()

    def sample(n: int, total: int) -> None:
        log(f"{arm} samples {n}/{total}")
        pause_while()

    if arm == base:
        run = run_eval(model, profile, TEST, out, key=key, max_new_tokens=int(spec["max_new_tokens"]), limit=int(spec["limit"]),
                       seed=int(spec["seed"]), batch=int(spec["batch"]), design=ref, on_item=item)
    else:
        sampling = Sampling(float(spec["temperature"]), float(spec["top_p"]), int(spec["sample_seed"]))
        library = None
        if arm == fly:
            if not (args.work / "library.done").exists():
                raise SystemExit("the flywheel needs its library: run --only library first")
            library = Library.open(args.work / "library", model, profile, trusted=trust_signer(key, None, name="experiment key"),
                                   graft_threshold=float(spec["graft_threshold"]))
        run = run_voted_eval(model, profile, TEST, out, key=key, mode="vote" if arm == vote else "flywheel", k=design.k,
                             sampling=sampling, samples_journal=samples_journal(args),
                             max_new_tokens=int(spec["max_new_tokens"]), limit=int(spec["limit"]), seed=int(spec["seed"]),
                             batch=int(spec["batch"]), library=library, design=ref, on_item=item, on_sample=sample)
    a = run.statement.predicate.aggregates
    log(f"{arm}: {a.correct}/{a.items}, {a.decode_tokens} decode tokens, {run.seconds:.0f} s")


def part_publish(args: argparse.Namespace, key: Path) -> None:
    arms = sorted((args.out / "arms").iterdir()) if (args.out / "arms").exists() else []
    arms = [a for a in arms if (a / "record.dsse.json").exists()]
    with registry(args, key) as (url, token, registry_key):
        publish(url, token, registry_key, args.out / "design")
        for arm in arms:
            publish(url, token, registry_key, arm)
        prove(url, registry_key, [args.out / "design", *arms], args.out / "checkpoint.txt")


def part_table(args: argparse.Namespace) -> None:
    design = read_design(args)
    arms_dir = args.out / "arms"
    summary: dict[str, Any] = {
        "preregistration": str((args.out / "design").relative_to(ROOT)) if (args.out / "design").is_relative_to(ROOT) else str(args.out / "design"),
        "design": {"k": design.k, "budget": design.budget, "test_problems": len(design.test.doc_ids),
                   "alpha": design.analysis.alpha, "test": design.analysis.test},
        "arms": {}, "pairs": {}, "missing": [],
    }
    correct: dict[str, list[bool]] = {}
    for arm in design.arms:
        record = arms_dir / arm.name
        if not (record / "record.dsse.json").exists():
            summary["missing"].append(arm.name)
            continue
        proc = subprocess.run([*VERIFY, "--json", "eval", str(record), "--dataset", str(TEST), "--trusted-keys",
                               str(args.out / "trusted-keys.json"), "--design", str(args.out / "design"), "--checkpoint",
                               str(args.out / "checkpoint.txt"), "--registry-key", str(args.out / "registry-key.pub.pem")],
                              capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"kvgraft-verify eval {record} failed: {proc.stdout}{proc.stderr}")
        p = record_predicate(record)
        correct[arm.name] = [i["correct"] for i in p["items"]]
        k, n = sum(correct[arm.name]), len(p["items"])
        summary["arms"][arm.name] = {
            "n": n, "correct": k, "decode_tokens": p["aggregates"]["decode_tokens"],
            "record": str(record.relative_to(ROOT)) if record.is_relative_to(ROOT) else str(record),
            "accuracy": k / n, "ci95": wilson(k, n), "decode_tokens_per_problem": p["aggregates"]["decode_tokens"] / n,
            "cut_off": p["settings"].get("cut_off"), "seconds": p["settings"].get("seconds"),
            **{f: p["settings"][f] for f in ("unanimous", "grafted") if f in p["settings"]},
            "verified": json.loads(proc.stdout)["summary"],
        }
    for c in design.analysis.comparisons:
        if c.first in correct and c.second in correct:
            pair = paired(correct[c.first], correct[c.second])
            pair["primary"] = c.primary
            pair["significant_at_alpha"] = pair["mcnemar_exact_p"] < design.analysis.alpha
            summary["pairs"][f"{c.second} - {c.first}"] = pair
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    write_readme(args, design, summary)
    log(f"table: {args.out / 'README.md'}")


def write_readme(args: argparse.Namespace, design: Any, summary: dict[str, Any]) -> None:
    n = len(design.test.doc_ids)
    verify = ("kvgraft-verify eval results/capability/arms/ARM --dataset data/datasets/gsm8k_test.jsonl --trusted-keys "
              "results/capability/trusted-keys.json --design results/capability/design --checkpoint "
              "results/capability/checkpoint.txt --registry-key results/capability/registry-key.pub.pem")
    lines = [
        f"# Capability experiment (issue 39): {args.model} under {args.profile}, GSM8K test, {n} paired problems",
        "",
        f"Pre-registered design: `{summary['preregistration']}` (signed, logged in the experiment's registry before any "
        f"test output). k = {design.k}, budget {design.budget} tokens per decode, analysis: paired McNemar exact test "
        f"(two-sided), alpha {design.analysis.alpha}. Re-check an arm: `{verify}`.",
        "",
    ]
    if (args.out / "first-log").exists():
        lines += [FIRST_LOG, ""]
    if summary["missing"]:
        lines += [f"**Partial:** arms not finished yet: {', '.join(summary['missing'])}. Nothing below is extrapolated.", ""]
    lines += ["| arm | correct | accuracy (95% Wilson) | decode tokens | per problem | record |", "|---|---|---|---|---|---|"]
    for name, row in summary["arms"].items():
        lo, hi = row["ci95"]
        lines.append(f"| {name} | {row['correct']}/{row['n']} | {row['accuracy']:.3f} [{lo:.3f}, {hi:.3f}] | "
                     f"{row['decode_tokens']:,} | {row['decode_tokens_per_problem']:.1f} | `{row['record']}` |")
    if summary["pairs"]:
        lines += ["", "| paired difference | difference (95% CI) | only the second right | only the first right | McNemar exact p | "
                  f"below alpha {design.analysis.alpha} |", "|---|---|---|---|---|---|"]
        for name, pair in summary["pairs"].items():
            lines.append(f"| {name}{' (primary)' if pair['primary'] else ''} | {pair['difference']:+.3f} "
                         f"[{pair['low']:+.3f}, {pair['high']:+.3f}] | {pair['only_second_correct']} | "
                         f"{pair['only_first_correct']} | {pair['mcnemar_exact_p']:.3g} | "
                         f"{'yes' if pair['significant_at_alpha'] else 'no'} |")
    (args.out / "README.md").write_text("\n".join(lines) + "\n")


#: Why ``OUT/first-log`` exists: the README says so whenever it does.
FIRST_LOG = (
    "The design was first logged on 2026-12-06, as entry 0 of a registry on the machine that wrote it "
    "(`first-log/`: its inclusion proof, checkpoint and registry key), before any test output. That registry's data "
    "and the first signing key stayed on that machine; on 2026-12-08 the same signed design (same envelope) was "
    "logged as entry 0 of a new registry, before any arm's record, and every arm is logged after it there "
    "(`checkpoint.txt`, `registry-key.pub.pem`). Records signed on later machines are signed by the keys that "
    "`trusted-keys.json` adds (`kvgraft-capability-5`, ...)."
)

PARTS = ("design", "library", "base", "vote", "flywheel", "publish", "table")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--profile", default="llamacpp-cpu")
    ap.add_argument("--size", type=int, default=600)
    ap.add_argument("--seed", type=int, default=39)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--graft-threshold", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "capability")
    ap.add_argument("--work", type=Path, default=ROOT / ".experiments" / "capability-v2")
    ap.add_argument("--key", type=Path, help="the signing key (default: $KVGRAFT_HOME/keys/capability.pem, made when missing)")
    ap.add_argument("--only", default=",".join(PARTS))
    ap.add_argument("--pause-while", type=Path, metavar="FILE", help="between items, wait while FILE exists")
    args = ap.parse_args()
    if args.pause_while is not None:
        PAUSE_FILE.append(args.pause_while)
    parts = args.only.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise SystemExit(f"unknown part(s) {sorted(unknown)}; known: {', '.join(PARTS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    from kvgraft.engine import current_profile, kvgraft_home, load_model_for

    key = args.key or kvgraft_home() / "keys" / "capability.pem"
    if not key.exists():
        subprocess.run([*KVGRAFT, "keys", "generate", "--out", str(key)], check=True)
    trust_beside(args.out / "trusted-keys.json", Path(f"{key}.pub"), "kvgraft-capability")
    model = profile = None
    arms = dict(zip(("base", "vote", "flywheel"), arm_names(args.k), strict=True))
    for part in PARTS:
        if part not in parts:
            continue
        if part == "publish":
            part_publish(args, key)
            continue
        if part == "table":
            part_table(args)
            continue
        if model is None:
            profile = current_profile(args.profile)
            model = load_model_for(args.model, profile)
        if part == "design":
            part_design(args, model, profile, key)
        elif part == "library":
            part_library(args, model, profile, key)
        else:
            part_arm(args, arms[part], model, profile, key)
    os.sync()


if __name__ == "__main__":
    main()
