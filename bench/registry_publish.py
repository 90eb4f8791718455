"""Registry publish throughput (issue 18, item 1): publishes per second against a real ``kvgraft serve``.

A real ``kvgraft serve`` (uvicorn, one process) on 127.0.0.1, once over DuckDB (the embedded
default) and once over PostgreSQL (``--database``: a throwaway server of Debian's binaries on a
free loopback port, the one the tests start, ``tests/registry/postgres.py``), started with
``--rate-limit 0`` (the per-token limit, 50/s by default, would cap one client, not the log).
Each client is a Python thread with its own token and one keep-alive ``http.client``
connection; it posts its share of pre-signed KV artifact envelopes (``POST /v1/entries``) one
after another, each answered only once its batch is durable. Everything a publish needs is in
place before the clock starts: keys, tokens, the signed envelopes (distinct statements, so every
one is appended) and the one tensors blob each client's statements name (uploaded once:
``PUT`` is measured by bench/registry_throughput.py).

For 1, 8 and 32 clients, ``--runs`` times each: every client starts at one barrier, and
publishes per second is all the clients' publishes over the wall time from the barrier to the
last answer. The figure is the median of the runs (every run is kept, with the machine's load
average before and after it). Each answer must be 201; after the clock stops, every answer's
inclusion proof is verified against the checkpoint beside it (signed by the registry key), and
the number of distinct checkpoint sizes in the answers is the number of batches the run's
publishes were sequenced in.

Target: at least 300 publishes per second with 32 clients on DuckDB; PostgreSQL is measured.

    .venv/bin/python bench/registry_publish.py [--clients 1 8 32] [--runs 3] [--publishes 1024]
        [--backends duckdb postgres]
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common import QUICK, ROOT, figure, kvgraft_serve, median, say, write_result

from kvgraft.schemas import (
    DeterminismProfile,
    KvArtifactPredicate,
    KvArtifactStatement,
    ModelRef,
    PositionRange,
    SourceText,
    Subject,
    SubjectDigest,
    TokenSpan,
    canonical_json,
    hex_of,
    sha256_bytes,
)
from kvgraft.verifier import (
    envelope_json,
    ephemeral_signing_key,
    generate_private_key,
    hash_leaf,
    parse_public_key,
    public_key_pem,
    sign_statement,
    verify_checkpoint,
    verify_inclusion,
)

TARGET_CLIENTS = 32
TARGET_PUBLISHES_PER_SECOND = 300.0
def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One request on a fresh connection: (status, body)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        c.request(method, path, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


@contextmanager
def kvgraft_server(data: Path, extra: list[str]) -> Iterator[int]:
    """A real ``kvgraft serve`` on 127.0.0.1 without a rate limit (the per-token limit would cap one client)."""
    with kvgraft_serve(data, ["--rate-limit", "0", *extra]) as port:
        yield port


def make_token(port: int, data: Path, publisher: str, public_pem: str) -> str:
    """A publish token bound to ``public_pem``, made through the running server's admin API."""
    secret = json.loads((data / "admin.json").read_text())["secret"]
    body = json.dumps({"publisher": publisher, "public_keys_pem": [public_pem]}).encode()
    status, answer = request(port, "POST", "/v1/admin/tokens", body,
                             {"Authorization": f"Bearer {secret}", "Content-Type": "application/json"})
    if status != 201:
        raise SystemExit(f"token create answered {status}: {answer[:300]!r}")
    return str(json.loads(answer)["token"])


def statement(tensors: bytes, text: str) -> KvArtifactStatement:
    """A root KV artifact statement about ``tensors`` with source ``text`` (distinct text: a distinct entry)."""
    ids = [len(w) for w in text.split()]
    return KvArtifactStatement(
        subject=[Subject(name="kv.safetensors", digest=SubjectDigest(sha256=hex_of(sha256_bytes(tensors))))],
        predicate=KvArtifactPredicate(
            model=ModelRef(name="bench-model", weights_digest=sha256_bytes(b"weights"), config_digest=sha256_bytes(b"config")),
            tokenizer_digest=sha256_bytes(b"tokenizer"),
            profile=DeterminismProfile(
                name="cpu-fp32", exactness="own-position", device_kind="cpu", device_fingerprint="bench-cpu", dtype="float32",
                torch_version="2.13.0", transformers_version="5.24.0", threads=1, attention_implementation="eager",
                matmul_tiling="default", deterministic_algorithms=True,
            ),
            parent=None, chain_key=sha256_bytes(text.encode() + b"chain"),
            tokens=TokenSpan(ids=ids, digest=sha256_bytes(canonical_json(ids))),
            positions=PositionRange(start=0, end=len(ids)),
            source_text=SourceText(digest=sha256_bytes(text.encode()), text=text),
            next_token_logits_digest=sha256_bytes(b"logits"), engine_versions={"kvgraft": "bench"},
            created="2026-11-29T12:00:00Z",
        ),
    )


class Publisher:
    """The signing key, and per client a token, its tensors blob (uploaded) and envelopes to post."""

    def __init__(self, port: int, data: Path, clients: int) -> None:
        self.port = port
        self.key = generate_private_key("ed25519")
        pem = public_key_pem(self.key.public_key()).decode("ascii")
        self.tokens = [make_token(port, data, "bench", pem) for _ in range(clients)]
        self.blobs = []
        for i, token in enumerate(self.tokens):
            tensors = b"KVTENSORS:" + hashlib.sha256(f"bench client {i}".encode()).digest() * 256
            status, answer = request(port, "PUT", f"/v1/blobs/{sha256_bytes(tensors)}", tensors, {"Authorization": f"Bearer {token}"})
            if status not in (200, 201):
                raise SystemExit(f"blob upload answered {status}: {answer[:300]!r}")
            self.blobs.append(tensors)

    def envelopes(self, client: int, count: int) -> list[bytes]:
        """``count`` fresh signed envelopes for ``client`` (texts never used before)."""
        out = []
        with ephemeral_signing_key(self.key) as signer:
            for _ in range(count):
                text = f"bench publish {uuid.uuid4().hex} what is the sum of the first few squares"
                out.append(envelope_json(sign_statement(statement(self.blobs[client], text), [signer])))
        return out


def one_run(pub: Publisher, clients: int, per_client: int) -> dict[str, Any]:
    """``clients`` threads post ``per_client`` envelopes each; publishes/s, latencies and the answers."""
    work = [pub.envelopes(i, per_client) for i in range(clients)]
    answers: list[list[tuple[bytes, dict[str, Any]]]] = [[] for _ in range(clients)]
    latencies: list[float] = []
    errors: list[str] = []
    start = threading.Barrier(clients + 1)
    lock = threading.Lock()

    def client(i: int) -> None:
        c = http.client.HTTPConnection("127.0.0.1", pub.port, timeout=120)
        headers = {"Authorization": f"Bearer {pub.tokens[i]}", "Content-Type": "application/json"}
        mine = []
        try:
            start.wait()
            for envelope in work[i]:
                t0 = time.perf_counter()
                c.request("POST", "/v1/entries", body=envelope, headers=headers)
                r = c.getresponse()
                body = r.read()
                mine.append(time.perf_counter() - t0)
                if r.status != 201:
                    with lock:
                        errors.append(f"status {r.status}: {body[:300]!r}")
                    return
                answers[i].append((envelope, json.loads(body)))
        except OSError as e:
            with lock:
                errors.append(f"{type(e).__name__}: {e}")
        finally:
            c.close()
            with lock:
                latencies.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    load_before = os.getloadavg()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    load_after = os.getloadavg()
    if errors:
        raise SystemExit(f"publishing failed with {clients} clients: {errors[0]}")
    total = clients * per_client
    latencies.sort()
    return {
        "clients": clients,
        "publishes": total,
        "seconds": round(seconds, 3),
        "publishes_per_second": round(total / seconds, 1),
        "latency_p50_ms": round(latencies[len(latencies) // 2] * 1e3, 1),
        "latency_p99_ms": round(latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3, 1),
        "load_average_1_5_15_before": [round(x, 2) for x in load_before],
        "load_average_1_5_15_after": [round(x, 2) for x in load_after],
        "_answers": [a for xs in answers for a in xs],
    }


def check_answers(port: int, answers: list[tuple[bytes, dict[str, Any]]]) -> int:
    """Verify every answer's checkpoint and inclusion proof; return the number of distinct checkpoint sizes."""
    status, body = request(port, "GET", "/v1/log/key")
    key = json.loads(body)
    public = parse_public_key(key["public_key_pem"].encode("ascii"), source="the registry key")
    checkpoints: dict[bytes, Any] = {}
    indices = set()
    for envelope, answer in answers:
        note = answer["checkpoint"].encode("utf-8")
        if note not in checkpoints:
            checkpoints[note] = verify_checkpoint(note, key["origin"], public)
        cp = checkpoints[note]
        proof = answer["inclusion_proof"]
        index = answer["entry"]["log_index"]
        if proof["tree_size"] != cp.size or proof["log_index"] != index or index in indices:
            raise SystemExit(f"answer for entry {index}: proof {proof['log_index']}@{proof['tree_size']} vs checkpoint {cp.size}")
        indices.add(index)
        verify_inclusion(hash_leaf(envelope), index, cp.size, [bytes.fromhex(h) for h in proof["hashes"]], cp.root_hash)
    return len({cp.size for cp in checkpoints.values()})


def main() -> None:
    """Measure, write ``bench/results/registry_publish.json`` and its plot."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--runs", type=int, default=1 if QUICK else 3)
    ap.add_argument("--publishes", type=int, default=128 if QUICK else 1024,
                    help="publishes per run (split evenly over the clients; at least 16 each)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="an extra argument for kvgraft serve (repeatable), e.g. --serve-arg=--batch-wait-ms=2")
    ap.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS),
                    help="the metadata databases to measure, one after the other (default: both)")
    args = ap.parse_args()
    series: dict[str, list[dict[str, Any]]] = {}
    for backend in args.backends:
        with tempfile.TemporaryDirectory(prefix="kvgraft-bench-publish-") as tmp, database(backend) as extra:
            say(f"{backend}:")
            series[backend] = measure(Path(tmp) / "registry", [*extra, *args.serve_arg], args)
    rates = {b: {str(r["clients"]): r["publishes_per_second"] for r in rows} for b, rows in series.items()}
    at_target = rates.get("duckdb", {}).get(str(TARGET_CLIENTS))
    write_result("registry_publish", {
        "description": "POST /v1/entries per second against kvgraft serve on 127.0.0.1, over DuckDB and over PostgreSQL, "
        "1/8/32 clients, medians of runs",
        "client": "Python threads, one token and one keep-alive http.client connection each, pre-signed envelopes",
        "serve_args": ["--rate-limit", "0", *args.serve_arg],
        "publishes_per_second": rates,
        "rows": series,
        "target": {"backend": "duckdb", "clients": TARGET_CLIENTS, "publishes_per_second_min": TARGET_PUBLISHES_PER_SECOND},
        "met": None if at_target is None else at_target >= TARGET_PUBLISHES_PER_SECOND,
    })
    plot(series)


BACKENDS = ("duckdb", "postgres")


@contextmanager
def database(backend: str) -> Iterator[list[str]]:
    """The ``kvgraft serve`` arguments for ``backend``: none for DuckDB; a new database on a throwaway PostgreSQL."""
    if backend == "duckdb":
        yield []
        return
    sys.path.insert(0, str(ROOT))  # the tests' PostgreSQL helper: Debian's binaries, a free port, its own cluster
    from tests.registry.postgres import postgres_server

    with postgres_server() as server:
        yield ["--database", server.database("bench")]


def measure(data: Path, serve_args: list[str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The runs for each client count against one server over ``data``: one row per count."""
    rows = []
    with kvgraft_server(data, serve_args) as port:
        pub = Publisher(port, data, max(args.clients))
        for clients in args.clients:
            per_client = max(16, args.publishes // clients)
            pub.envelopes(0, 1)  # imports and key set-up outside the clock
            runs = []
            for r in range(args.runs):
                run = one_run(pub, clients, per_client)
                answers = run.pop("_answers")
                run["batches"] = check_answers(port, answers)
                run["mean_batch_size"] = round(len(answers) / run["batches"], 2)
                say(f"{clients} clients, run {r + 1}: {run['publishes_per_second']:.1f} publishes/s "
                    f"({run['publishes']} in {run['seconds']:.2f} s, {run['batches']} batches, p50 {run['latency_p50_ms']} ms)")
                runs.append(run)
            rows.append({
                "clients": clients,
                "publishes_per_second": median([x["publishes_per_second"] for x in runs]),
                "latency_p50_ms": median([x["latency_p50_ms"] for x in runs]),
                "latency_p99_ms": median([x["latency_p99_ms"] for x in runs]),
                "mean_batch_size": median([x["mean_batch_size"] for x in runs]),
                "runs": runs,
            })
    return rows


def plot(series: dict[str, list[dict[str, Any]]]) -> None:
    """Publishes per second and p50 latency per client count, a line per backend."""
    with figure("registry_publish") as fig:
        if fig is None:
            return
        ax = fig.add_subplot(1, 2, 1)
        ax2 = fig.add_subplot(1, 2, 2)
        for backend, rows in series.items():
            xs = [r["clients"] for r in rows]
            ax.plot(xs, [r["publishes_per_second"] for r in rows], marker="o", label=f"kvgraft serve, {backend}")
            ax2.plot(xs, [r["latency_p50_ms"] for r in rows], marker="o", label=f"p50, {backend}")
            ax2.plot(xs, [r["latency_p99_ms"] for r in rows], marker="x", linestyle="--", label=f"p99, {backend}")
        ax.axhline(TARGET_PUBLISHES_PER_SECOND, linestyle="--", color="grey", label=f"target at {TARGET_CLIENTS} clients")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("publishes per second (median)")
        ax.set_title("Publish throughput")
        ax.legend(fontsize=7)
        ax2.set_xscale("log", base=2)
        ax2.set_xlabel("concurrent clients")
        ax2.set_ylabel("publish latency (ms)")
        ax2.set_title("Publish latency")
        ax2.legend(fontsize=7)


if __name__ == "__main__":
    main()
