"""Load: ``load_clients`` concurrent clients publishing and reading on 127.0.0.1 for ``load_seconds``.

Each client has its own token (the default per-token rate limit stays on) and loops: upload a
new blob, publish its signed entry, then read it back (entry, envelope, blob, checkpoint, a
page of artifacts). Zero errors are allowed, and at the end the log holds exactly the entries
that were acknowledged, in full. p50/p99 latency and throughput go into the figures.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from pathlib import Path

import httpx

from kvgraft.schemas import sha256_bytes
from tests.registry.conftest import Key, artifact, running_server
from tests.reliability.conftest import Figures, Scale
from tests.reliability.servers import make_token, tree_size


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def test_concurrent_publish_and_read(
    tmp_path: Path, rkeys: dict[str, Key], scale: Scale, figures: Figures, database: str | None
) -> None:
    alice = rkeys["alice"]
    latencies: dict[str, list[float]] = {}
    errors: list[str] = []
    acked: dict[str, int] = {}
    lock = threading.Lock()
    with running_server(tmp_path / "data", "--log-level", "warning", *(("--database", database) if database else ())) as server:
        tokens = [make_token(server, "alice", alice)[0] for _ in range(scale.load_clients)]
        start_barrier = threading.Barrier(scale.load_clients + 1)
        deadline: list[float] = []

        def client_loop(token: str) -> None:
            auth = {"Authorization": f"Bearer {token}"}
            mine: list[tuple[str, float]] = []

            def timed(op: str, fn: object, *args: object, ok: tuple[int, ...] = (200,), **kwargs: object) -> httpx.Response | None:
                t0 = time.perf_counter()
                try:
                    r: httpx.Response = fn(*args, **kwargs)  # type: ignore[operator]
                except httpx.HTTPError as e:
                    with lock:
                        errors.append(f"{op}: {type(e).__name__}: {e}")
                    return None
                mine.append((op, time.perf_counter() - t0))
                if r.status_code not in ok:
                    with lock:
                        errors.append(f"{op}: {r.status_code} {r.text[:200]}")
                    return None
                return r

            with httpx.Client(base_url=server.url, timeout=60) as c:
                start_barrier.wait()
                while time.monotonic() < deadline[0]:
                    art = artifact(f"load {uuid.uuid4().hex}")
                    envelope = alice.sign(art.statement)
                    if timed("put_blob", c.put, f"/v1/blobs/{art.digest}", content=art.tensors, headers=auth, ok=(201,)) is None:
                        continue
                    r = timed("publish", c.post, "/v1/entries", content=envelope, headers=auth, ok=(201,))
                    if r is None:
                        continue
                    entry = r.json()["entry"]
                    with lock:
                        acked[entry["digest"]] = entry["log_index"]
                    timed("get_entry", c.get, f"/v1/entries/{entry['digest']}")
                    got = timed("get_envelope", c.get, f"/v1/entries/{entry['log_index']}/envelope")
                    if got is not None and got.content != envelope:
                        with lock:
                            errors.append(f"envelope {entry['log_index']} came back different")
                    blob = timed("get_blob", c.get, f"/v1/blobs/{art.digest}")
                    if blob is not None and sha256_bytes(blob.content) != art.digest:
                        with lock:
                            errors.append(f"blob {art.digest} came back different")
                    timed("checkpoint", c.get, "/v1/log/checkpoint")
                    timed("list_artifacts", c.get, "/v1/artifacts", params={"limit": 5, "q": "load"})
            with lock:
                for op, dt in mine:
                    latencies.setdefault(op, []).append(dt)

        threads = [threading.Thread(target=client_loop, args=(t,)) for t in tokens]
        for t in threads:
            t.start()
        deadline.append(time.monotonic() + scale.load_seconds)
        t0 = time.monotonic()
        start_barrier.wait()
        for t in threads:
            t.join(timeout=scale.load_seconds + 120)
        elapsed = time.monotonic() - t0
        assert not any(t.is_alive() for t in threads)

        # Nothing lost: the log holds exactly the acknowledged entries, at their indices.
        listed: dict[str, int] = {}
        cursor: str | None = None
        with httpx.Client(base_url=server.url, timeout=60) as c:
            while True:
                page = c.get("/v1/entries", params={"limit": 500, **({"cursor": cursor} if cursor else {})}).json()
                listed.update({e["digest"]: e["log_index"] for e in page["items"]})
                cursor = page["next_cursor"]
                if not cursor:
                    break
        size = tree_size(server)
    lost = {d: i for d, i in acked.items() if listed.get(d) != i}
    every = [dt for values in latencies.values() for dt in values]
    publish = latencies.get("publish", [])
    figures.add(
        "load" if database is None else "load-postgres",
        clients=scale.load_clients, seconds=round(elapsed, 1), requests=len(every), errors=len(errors), publishes=len(acked),
        lost_entries=len(lost), tree_size=size,
        throughput_rps=round(len(every) / elapsed, 1), publishes_per_s=round(len(acked) / elapsed, 1),
        p50_ms=round(1000 * statistics.median(every), 1) if every else None,
        p99_ms=round(1000 * _percentile(every, 0.99), 1) if every else None,
        publish_p50_ms=round(1000 * statistics.median(publish), 1) if publish else None,
        publish_p99_ms=round(1000 * _percentile(publish, 0.99), 1) if publish else None,
    )
    assert errors == [], errors[:10]
    assert lost == {}
    assert len(listed) == size == len(acked)
    assert acked, "no client published anything"
