"""Crash safety: ``kill -9`` during concurrent uploads and publishes, then restart on the same data.

Each round starts (or reuses) a server, fires ``crash_writes`` uploads+publishes at once from as
many threads, and SIGKILLs the server at a random moment while they are in flight (after a
random number of them were acknowledged). Then, before and after restarting on the same data
directory: no blob file holds bytes other than its name's, the DuckDB file opens (the server
starts and passes its log integrity check), the new checkpoint verifies and provably extends
the last checkpoint a client saw before the crash (RFC 9162 consistency proof), and every write
the server acknowledged with a 2xx is there.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvgraft.verifier import Checkpoint, parse_public_key, verify_checkpoint, verify_consistency
from tests.registry.conftest import Key, Server, artifact
from tests.reliability.conftest import Figures, Scale
from tests.reliability.servers import make_token, partial_blobs, post_entry, put_blob


@dataclass
class Acks:
    """What the server acknowledged (2xx) during one round."""

    blobs: dict[str, int] = field(default_factory=dict)
    entries: dict[str, int] = field(default_factory=dict)
    failures: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def _start(data: Path, log: Path, database: str | None) -> Server:
    server = Server(data, log, "--rate-limit", "0", *(("--database", database) if database else ()))
    server.wait_ready()
    return server


def _checkpoint(url: str) -> tuple[bytes, Checkpoint]:
    key = httpx.get(url + "/v1/log/key", timeout=30).json()
    note = httpx.get(url + "/v1/log/checkpoint", timeout=30).content
    public = parse_public_key(key["public_key_pem"].encode("ascii"), source="the registry key")
    return note, verify_checkpoint(note, key["origin"], public)


def test_kill_9_during_concurrent_writes(
    tmp_path: Path, rkeys: dict[str, Key], scale: Scale, figures: Figures, database: str | None
) -> None:
    rng = random.Random(int(time.time()))
    data = tmp_path / "data"
    alice = rkeys["alice"]
    server = _start(data, tmp_path / "server.log", database)
    token, _ = make_token(server, "alice", alice)
    all_blobs: dict[str, int] = {}
    all_entries: dict[str, int] = {}
    totals = {"rounds": 0, "writes_started": 0, "acked_blobs": 0, "acked_entries": 0, "lost": 0, "partial_blobs_visible": 0}
    try:
        for round_no in range(scale.crash_rounds):
            _, seen_before = _checkpoint(server.url)
            acks = Acks()
            last_seen = {"cp": seen_before}
            kill_after = rng.randint(1, int(scale.crash_writes * 0.8))
            stop = threading.Event()
            arts = [artifact(f"crash round {round_no} write {i}", salt=uuid.uuid4().bytes) for i in range(scale.crash_writes)]
            envelopes = [alice.sign(a.statement) for a in arts]

            def write(i: int, client: httpx.Client, acks: Acks = acks, arts: list = arts, envelopes: list[bytes] = envelopes) -> None:
                try:
                    r = put_blob(client, token, arts[i].tensors)
                    if r.status_code in (200, 201):
                        with acks.lock:
                            acks.blobs[arts[i].digest] = len(arts[i].tensors)
                    r = post_entry(client, token, envelopes[i])
                    if r.status_code in (200, 201):
                        with acks.lock:
                            acks.entries[r.json()["entry"]["digest"]] = r.json()["entry"]["log_index"]
                    elif r.status_code < 500:
                        raise AssertionError(f"publish refused before the crash: {r.status_code} {r.text}")
                except httpx.TransportError:
                    with acks.lock:
                        acks.failures += 1

            def watch(url: str = server.url, stop: threading.Event = stop, last_seen: dict = last_seen) -> None:
                # A client keeping the newest checkpoint it has seen, until the server dies.
                while not stop.is_set():
                    try:
                        last_seen["cp"] = _checkpoint(url)[1]
                    except httpx.TransportError:
                        return
                    time.sleep(0.01)

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            limits = httpx.Limits(max_connections=scale.crash_writes + 4)
            with httpx.Client(base_url=server.url, timeout=20, limits=limits) as client, ThreadPoolExecutor(scale.crash_writes) as pool:
                futures = [pool.submit(write, i, client) for i in range(scale.crash_writes)]
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    with acks.lock:
                        if len(acks.entries) >= kill_after:
                            break
                    time.sleep(0.002)
                time.sleep(rng.uniform(0, 0.05))
                server.proc.kill()  # SIGKILL: no lifespan shutdown, no flush, no cleanup
                server.proc.wait(timeout=30)
                for f in futures:
                    f.result()
            stop.set()
            watcher.join(timeout=30)
            server.stop()

            # Before the restart: whatever is under blobs/sha256 is whole.
            bad = partial_blobs(data)
            totals["partial_blobs_visible"] += len(bad)
            assert bad == [], f"round {round_no}: partial blobs visible after kill -9: {bad}"

            server = _start(data, tmp_path / f"server-{round_no}.log", database)
            if database is None:  # on a shared database other servers may be uploading: leftovers wait a day
                assert list((data / "blobs" / "tmp").iterdir()) == []
            note, now = _checkpoint(server.url)
            old = last_seen["cp"]
            proof = httpx.get(f"{server.url}/v1/log/proof/consistency", params={"old": old.size, "new": now.size}, timeout=30).json()
            verify_consistency(old.size, now.size, old.root_hash, now.root_hash, [bytes.fromhex(h) for h in proof["hashes"]])

            all_blobs.update(acks.blobs)
            all_entries.update(acks.entries)
            lost = []
            with httpx.Client(base_url=server.url, timeout=30) as client:
                for hexd, size in all_blobs.items():
                    r = client.head(f"/v1/blobs/{hexd}")
                    if r.status_code != 200 or int(r.headers["content-length"]) != size:
                        lost.append(hexd)
                for digest, index in all_entries.items():
                    r = client.get(f"/v1/entries/{digest}")
                    if r.status_code != 200 or r.json()["entry"]["log_index"] != index:
                        lost.append(digest)
            totals["lost"] += len(lost)
            assert lost == [], f"round {round_no}: acknowledged writes lost after kill -9 and restart: {lost}"
            assert now.size >= len(all_entries)
            totals["rounds"] += 1
            totals["writes_started"] += scale.crash_writes
            totals["acked_blobs"] += len(acks.blobs)
            totals["acked_entries"] += len(acks.entries)
            figures.add("crash" if database is None else "crash-postgres", **totals, tree_size=now.size, consistency_proofs_verified=totals["rounds"])
        # Every round acknowledged at least one entry before its kill: the kills hit live traffic.
        assert totals["acked_entries"] >= scale.crash_rounds
    finally:
        server.stop()
    assert totals["rounds"] == scale.crash_rounds
