"""Issue 6's benchmark: how long each provenance-browser page takes with 10,000 entries.

Fills a fresh registry data directory with the registry's own checks (real Ed25519 signatures,
real blob store, one log leaf and signed checkpoint per entry, rows written in batches): chains of KV artifacts (depth up
to ``--depth``) from three publishers, exactness records over them, and evaluation records over
the shipped GSM8K test set. Then starts ``kvgraft serve`` on 127.0.0.1 and times a GET of every
page kind over HTTP (server render + transfer), one warm-up excluded, ``--runs`` runs each;
reports every run, the median and the max. Target: median under 200 ms per page.

    .venv/bin/python bench/web_pages.py [--entries 10000] [--runs 7] [--keep DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from common import QUICK, ROOT, figure, median, say, write_result

from kvgraft.registry import RegistrySettings
from kvgraft.registry._internal.entries import decode_envelope, index_statement, verify_for_token
from kvgraft.registry._internal.log.tree import hash_leaf
from kvgraft.registry._internal.service import Registry
from kvgraft.registry._internal.storage.db import now_utc
from kvgraft.schemas import (
    KV_FILE,
    OUTPUTS_FILE,
    DatasetRef,
    DeterminismProfile,
    EvaluationAggregates,
    EvaluationItem,
    EvaluationPredicate,
    EvaluationStatement,
    ExactnessPredicate,
    ExactnessSample,
    ExactnessStatement,
    ExactnessSummary,
    KvArtifactPredicate,
    KvArtifactStatement,
    ModelRef,
    PositionRange,
    SourceText,
    Statement,
    Subject,
    SubjectDigest,
    TokenSpan,
    canonical_json,
    hex_of,
    sha256_bytes,
)
from kvgraft.verifier import envelope_json, ephemeral_signing_key, generate_private_key, public_key_pem, sign_statement

TARGET_MS = 200.0
PUBLISHERS = ("alice", "bob", "carol")
GSM8K = ROOT / "data" / "datasets" / "gsm8k_test.jsonl"


def _profile() -> DeterminismProfile:
    return DeterminismProfile(
        name="cpu-fp32", exactness="own-position", device_kind="cpu", device_fingerprint="bench-cpu", dtype="float32",
        torch_version="2.13.0", transformers_version="5.24.0", threads=1, attention_implementation="eager",
        matmul_tiling="default", deterministic_algorithms=True,
    )


def _model(name: str) -> ModelRef:
    return ModelRef(name=name, weights_digest=sha256_bytes(name.encode()), config_digest=sha256_bytes(b"config " + name.encode()))


def _subject(name: str, data: bytes) -> Subject:
    return Subject(name=name, digest=SubjectDigest(sha256=hex_of(sha256_bytes(data))))


class Filler:
    """Signs statements and appends them to an open registry in batches.

    Each envelope is checked as ``Registry.publish`` checks it (signature against the token's
    keys, statement indexed by the registry's own ``index_statement``, blobs present) and gets its
    own log leaf and signed checkpoint; the rows of a batch are written in one transaction,
    because one DuckDB commit per entry would make a 10,000-entry fill take half an hour on a
    shared CPU. The service reopens and re-checks the whole log (``Registry.open``) before
    anything is timed.
    """

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.keys = {p: generate_private_key() for p in PUBLISHERS}
        self.tokens = {}
        for name, key in self.keys.items():
            token = registry.accounts.create_token(name, [public_key_pem(key.public_key())])["token"]
            self.tokens[name] = registry.authenticate(f"Bearer {token}")
        self.bound = {name: registry.accounts.bound_keys(t) for name, t in self.tokens.items()}
        self.registered = registry.accounts.registered_keys()
        self.count = 0
        self._blobs: list[bytes] = []
        self._rows: dict[str, list[list[Any]]] = {"entries": [], "entry_subjects": [], "entry_refs": [], "checkpoints": []}
        self._head: Any = None

    def blobs(self, items: list[bytes]) -> None:
        self._blobs += items

    def publish(self, statement: Statement, publisher: str) -> dict[str, Any]:
        with ephemeral_signing_key(self.keys[publisher]) as signer:
            body = envelope_json(sign_statement(statement, [signer]))
        token = self.tokens[publisher]
        verified, checked = verify_for_token(decode_envelope(body), self.bound[publisher], self.registered)
        indexed = index_statement(checked)
        log = self.registry.log
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        leaf = hash_leaf(body)
        index = log.append(leaf)
        head = log.sign()
        a = indexed.artifact
        now = now_utc()
        self._rows["entries"].append([
            index, digest, leaf, body, "application/vnd.in-toto+json", indexed.predicate_type, indexed.kind, token.publisher,
            [k.keyid for k in verified.signers], token.token_id, now,
            a.digest if a else None, a.model_name if a else None, a.model_weights_digest if a else None,
            a.model_config_digest if a else None, a.profile_name if a else None, a.parent if a else None,
            a.chain_key if a else None, a.position_start if a else None, a.position_end if a else None,
            a.source_text if a else None, a.source_text_digest if a else None,
        ])
        self._rows["entry_subjects"] += [[index, name, d] for name, d in indexed.subjects]
        self._rows["entry_refs"] += [[index, ref, role] for ref, role in indexed.refs]
        self._rows["checkpoints"].append([head.size, head.root_hash, head.note, now])
        self._head = head
        self.count += 1
        if len(self._rows["entries"]) >= 500:
            self.flush()
        return {"entry": {"log_index": index, "digest": digest}}

    def flush(self) -> None:
        """Store the pending blobs, then write the pending rows in one transaction."""
        for data in dict.fromkeys(self._blobs):
            # Straight to the store's final path: these bytes were hashed here, so the streamed,
            # digest-checked upload path adds nothing to what the pages read.
            path = self.registry.blobs.path(hashlib.sha256(data).hexdigest())
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
        self._blobs = []
        with self.registry.db.transaction() as conn:
            for table, rows in self._rows.items():
                # Multi-row VALUES: DuckDB's executemany runs one statement per row, far slower.
                for start in range(0, len(rows), 100):
                    chunk = rows[start:start + 100]
                    row = "(" + ", ".join("?" for _ in chunk[0]) + ")"
                    conn.execute(f"INSERT INTO {table} VALUES " + ", ".join(row for _ in chunk), [v for r in chunk for v in r])
                rows.clear()


def _artifact(i: int, parent: tuple[bytes, KvArtifactStatement] | None, model: str, words: list[str]) -> tuple[bytes, KvArtifactStatement]:
    text = " ".join(words[(i * 7 + k) % len(words)] for k in range(24))
    tensors = b"KV" + hashlib.sha256(f"{i}".encode()).digest() * 8
    start = parent[1].predicate.positions.end if parent else 0
    ids = [len(w) for w in text.split()]
    statement = KvArtifactStatement(
        subject=[_subject(KV_FILE, tensors)],
        predicate=KvArtifactPredicate(
            model=_model(model), tokenizer_digest=sha256_bytes(b"tok"), profile=_profile(),
            parent=sha256_bytes(parent[0]) if parent else None, chain_key=sha256_bytes(tensors + b"chain"),
            tokens=TokenSpan(ids=ids, digest=sha256_bytes(canonical_json(ids))),
            positions=PositionRange(start=start, end=start + len(ids)),
            source_text=SourceText(digest=sha256_bytes(text.encode()), text=text),
            next_token_logits_digest=sha256_bytes(b"logits"), engine_versions={"kvgraft": "0.1.0"},
            created="2026-11-29T12:00:00Z",
        ),
    )
    return tensors, statement


def _exactness(n: int, prefixes: list[tuple[bytes, KvArtifactStatement]], shift: int) -> tuple[ExactnessStatement, list[bytes]]:
    samples, files = [], []
    for i, (tensors, st) in enumerate(prefixes):
        fresh = f"fresh {n} {i}".encode()
        graft = fresh if shift == 0 else f"graft {n} {i} {shift}".encode()
        files += [fresh, graft]
        kl = 0.0 if shift == 0 else 0.001 * (i + 1)
        samples.append(ExactnessSample(
            index=i, prefix_artifact=sha256_bytes(tensors), prefix_tokens=st.predicate.positions.end,
            continuation_digest=sha256_bytes(f"c{i}".encode()), continuation_tokens=8,
            fresh_logits_sha256=sha256_bytes(fresh), graft_logits_sha256=sha256_bytes(graft), bitwise_equal=shift == 0,
            kl_divergence=kl, argmax_agreement=1.0, shift=shift,
        ))
    files = list(dict.fromkeys(files))
    statement = ExactnessStatement(
        subject=[_subject(f"logits/{hex_of(sha256_bytes(f))}.f32", f) for f in files],
        predicate=ExactnessPredicate(
            model=_model("smollm2-135m"), profile=_profile(), level="shifted" if shift else "own-position", shift=shift,
            vocab_size=49152, seed=n, samples=samples,
            summary=ExactnessSummary(
                samples=len(samples), bitwise_equal=sum(s.bitwise_equal for s in samples), argmax_agree_all=len(samples),
                max_kl_divergence=max(s.kl_divergence for s in samples), mean_argmax_agreement=1.0,
            ),
        ),
    )
    return statement, files


def _evaluation(n: int, items: int, dataset_digest: str, library: str) -> tuple[EvaluationStatement, bytes]:
    outputs = f"outputs of evaluation {n}\n".encode()
    rows = [
        EvaluationItem(
            doc_id=(n * items + i) % 1000, doc_hash=hex_of(sha256_bytes(f"d{i}".encode())), prompt_hash=hex_of(sha256_bytes(b"p")),
            target_hash=hex_of(sha256_bytes(b"t")), output_hash=hex_of(sha256_bytes(f"o{i}".encode())),
            extracted_answer=str(i), correct=i % 3 != 0, prompt_tokens=120, decode_tokens=40, library_entry=library,
        )
        for i in range(items)
    ]
    correct = sum(r.correct for r in rows)
    statement = EvaluationStatement(
        subject=[_subject(OUTPUTS_FILE, outputs)],
        predicate=EvaluationPredicate(
            model=_model("smollm2-135m"), profile=_profile(), dataset=DatasetRef(name="gsm8k_test.jsonl", digest=dataset_digest),
            settings={"max_new_tokens": 64}, items=rows,
            aggregates=EvaluationAggregates(items=items, correct=correct, accuracy=correct / items, prompt_tokens=120 * items,
                                            decode_tokens=40 * items),
            outputs_digest=sha256_bytes(outputs), library_artifacts=[library],
        ),
    )
    return statement, outputs


def fill(data: Path, entries: int, depth: int) -> dict[str, Any]:
    """Publish ``entries`` entries into a fresh ``data``; return what the timed pages will open."""
    words = GSM8K.read_text(encoding="utf-8").split()[:5000]
    dataset_digest = sha256_bytes(GSM8K.read_bytes())
    n_eval = max(1, entries // 20)
    n_exact = max(2, entries // 10)
    n_art = entries - n_eval - n_exact
    chosen: dict[str, Any] = {}
    t0 = time.perf_counter()
    with Registry.open(data, RegistrySettings()) as registry:
        f = Filler(registry)
        arts: list[tuple[bytes, KvArtifactStatement]] = []
        parent: tuple[bytes, KvArtifactStatement] | None = None
        for i in range(n_art):
            if i % depth == 0:
                parent = None
            model = ("smollm2-135m", "gemma3-270m")[(i // depth) % 2]
            art = _artifact(i, parent, model, words)
            f.blobs([art[0]])
            f.publish(art[1], PUBLISHERS[(i // depth) % len(PUBLISHERS)])
            arts.append(art)
            parent = art
            if i % 1000 == 0:
                say(f"{f.count} entries published ({time.perf_counter() - t0:.0f} s)")
        # A deep leaf, and the root of its chain (it has a child).
        chosen["deep_artifact"] = sha256_bytes(arts[depth - 1][0])
        chosen["root_artifact"] = sha256_bytes(arts[0][0])
        for n in range(n_exact):
            group = [arts[(n * 8 + k) % len(arts)] for k in range(8)]
            statement, files = _exactness(n // 2, group, shift=0 if n % 2 == 0 else 4)
            f.blobs(files)
            doc = f.publish(statement, "alice")
            chosen.setdefault("exactness", doc["entry"]["digest"])
        for n in range(n_eval):
            statement, outputs = _evaluation(n, 40, dataset_digest, sha256_bytes(arts[n % len(arts)][0]))
            f.blobs([outputs])
            doc = f.publish(statement, "bob")
            chosen.setdefault("evaluation", doc["entry"]["digest"])
        f.flush()
        chosen["entries"] = registry.log.size
        chosen["a_word"] = words[3]
    # Reopen: the service rebuilds the tree from the stored leaves and checks the last checkpoint.
    with Registry.open(data, RegistrySettings()) as registry:
        if registry.log.size != chosen["entries"]:
            raise RuntimeError(f"reopened log has {registry.log.size} entries, expected {chosen['entries']}")
    chosen["fill_seconds"] = round(time.perf_counter() - t0, 1)
    say(f"filled {chosen['entries']} entries in {chosen['fill_seconds']} s")
    return chosen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serve(data: Path) -> Iterator[str]:
    """``kvgraft serve`` over ``data`` on a free 127.0.0.1 port, stopped when the block ends."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgraft", "serve", "--data", str(data), "--init", "--port", str(port), "--log-level", "warning"],
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/log/checkpoint", timeout=2).status_code == 200:
                    break
            if proc.poll() is not None:
                raise RuntimeError(f"kvgraft serve exited with {proc.returncode}")
            time.sleep(0.2)
        else:
            raise RuntimeError("kvgraft serve did not answer within 60 s")
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def pages(chosen: dict[str, Any]) -> dict[str, str]:
    """Page kind -> path."""
    size = chosen["entries"]
    return {
        "overview": "/",
        "artifacts": "/artifacts",
        "artifacts_search": f"/artifacts?q={chosen['a_word']}",
        "artifacts_filtered": "/artifacts?model=gemma3-270m&publisher=bob",
        "artifacts_older_page": f"/artifacts?before={size // 2}",
        "artifact_deep_in_chain": f"/artifacts/{chosen['deep_artifact']}",
        "artifact_root_with_children": f"/artifacts/{chosen['root_artifact']}",
        "records": "/records",
        "exactness_record": f"/records/{chosen['exactness']}",
        "evaluation_record": f"/records/{chosen['evaluation']}",
        "log": "/log",
        "log_consistency": f"/log?old={size // 3}&new={size - 1}",
        "publishers": "/publishers",
    }


def time_pages(url: str, paths: dict[str, str], runs: int) -> dict[str, Any]:
    """Every page once to warm up, then ``runs`` rounds over all pages (interleaved)."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    sizes: dict[str, int] = {}
    with httpx.Client(base_url=url, timeout=30) as client:
        for name, path in paths.items():
            r = client.get(path)
            if r.status_code != 200:
                raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:300]}")
            sizes[name] = len(r.content)
        for _ in range(runs):
            for name, path in paths.items():
                t0 = time.perf_counter()
                r = client.get(path)
                times[name].append((time.perf_counter() - t0) * 1000)
                if r.status_code != 200:
                    raise RuntimeError(f"{path} answered {r.status_code}")
    return {
        name: {"path": paths[name], "median_ms": round(median(ts), 2), "max_ms": round(max(ts), 2),
               "runs_ms": [round(t, 2) for t in ts], "bytes": sizes[name], "met": median(ts) < TARGET_MS}
        for name, ts in times.items()
    }


def plot(results: dict[str, Any]) -> None:
    """Median and max per page against the target, as ``bench/results/web_pages.png``."""
    with figure("web_pages") as fig:
        if fig is None:
            return
        ax = fig.add_subplot(1, 1, 1)
        names = list(results)
        ys = range(len(names))
        ax.barh(list(ys), [results[n]["median_ms"] for n in names], color="#1f5fa8", label="median")
        ax.scatter([results[n]["max_ms"] for n in names], list(ys), color="#c77700", marker="|", s=120, label="max")
        ax.axvline(TARGET_MS, color="#b42318", linestyle="--", linewidth=1, label=f"target {TARGET_MS:.0f} ms")
        ax.set_yticks(list(ys), [n.replace("_", " ") for n in names])
        ax.invert_yaxis()
        ax.set_xlabel("ms per page (GET over HTTP, 127.0.0.1)")
        ax.set_title("Provenance browser pages, 10,000 entries" if not QUICK else "Provenance browser pages (quick run)")
        ax.legend(loc="lower right")


def main() -> None:
    """Fill, serve, time, write ``bench/results/web_pages.json``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, default=1000 if QUICK else 10_000)
    ap.add_argument("--runs", type=int, default=5 if QUICK else 7)
    ap.add_argument("--depth", type=int, default=10, help="artifacts per chain")
    ap.add_argument("--keep", type=Path, help="fill this directory and keep it (default: a temporary one)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvgraft-web-bench-"))
    data = args.keep or tmp / "data"
    try:
        chosen = fill(data, args.entries, args.depth)
        with serve(data) as url:
            results = time_pages(url, pages(chosen), args.runs)
        for name, r in results.items():
            say(f"{name:30s} median {r['median_ms']:7.1f} ms  max {r['max_ms']:7.1f} ms  {r['bytes']:7d} bytes")
        write_result("web_pages", {
            "description": "GET of each provenance-browser page over HTTP from kvgraft serve on 127.0.0.1 "
                           "(server render + transfer), warm, medians of interleaved runs",
            "target": {"median_ms_max": TARGET_MS},
            "registry": {"entries": chosen["entries"], "fill_seconds": chosen["fill_seconds"], "chain_depth": args.depth,
                         "publishers": len(PUBLISHERS)},
            "runs": args.runs,
            "pages": results,
            "met": all(r["met"] for r in results.values()),
        })
        plot(results)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
