"""Registry reads (issue 18, item 2): small-read latency and 1 MiB downloads, kvgraft beside nginx.

One run starts a real ``kvgraft serve`` and nginx (bench/registry_throughput.py's servers: nginx
maps ``/v1/blobs/sha256:<hex>`` onto the registry's blob directory, with ``sendfile on``), stores a
4 KiB and a 1 MiB random blob, and then, ``--runs`` times, interleaving the two servers:

- p50 / p99 latency of 4 KiB blob GETs from 1 client on a keep-alive connection (``http.client``,
  the same code for both); the registry re-hashes such a blob on every read (verify-on-read);
- p50 of a conditional GET (``If-None-Match`` with the blob's ETag: 304) and of an entry's
  envelope, registry only (nginx has no log);
- MB/s of 1 MiB downloads with ``curl`` (the same binary for both, a fresh connection each), the
  median of ``--downloads`` per run.

Each figure is the median over the runs, with every run's value kept. Targets: 4 KiB p50 <= 1 ms,
1 MiB download >= 0.5x nginx's rate.

    .venv/bin/python bench/registry_reads.py [--runs 5] [--requests 2000] [--downloads 30]
"""

from __future__ import annotations

import argparse
import http.client
import os
import tempfile
import time
from pathlib import Path

from common import QUICK, median, percentile, say, write_result
from registry_throughput import curl, kvgraft_server, make_blob, nginx_server, small_reads

TARGET_P50_MS = 1.0
TARGET_DOWNLOAD_RATIO = 0.5


def upload(port: int, token: str, path: Path, hexd: str) -> None:
    """Store ``path`` as blob ``hexd`` on the registry."""
    r = curl(["-T", str(path), "-X", "PUT", "-H", f"Authorization: Bearer {token}",
              f"http://127.0.0.1:{port}/v1/blobs/sha256:{hexd}"])
    if r["status"] not in (200, 201):
        raise SystemExit(f"the registry answered {r['status']} to an upload of {path.stat().st_size} bytes")


def publish_one(port: int, data: Path) -> None:
    """One signed entry in the log (registry_publish's publisher: its own key and token), for the envelope read."""
    from registry_publish import Publisher

    pub = Publisher(port, data, 1)
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        c.request("POST", "/v1/entries", body=pub.envelopes(0, 1)[0],
                  headers={"Authorization": f"Bearer {pub.tokens[0]}", "Content-Type": "application/json"})
        resp = c.getresponse()
        resp.read()
    finally:
        c.close()
    if resp.status not in (200, 201):
        raise RuntimeError(f"publish answered {resp.status}")


def timed_gets(port: int, path: str, n: int, headers: dict[str, str] | None = None, status: int = 200) -> list[float]:
    """Latencies (s) of ``n`` GETs of ``path`` on one keep-alive connection, after 20 to warm up."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    lat: list[float] = []
    try:
        for i in range(n + 20):
            t0 = time.perf_counter()
            c.request("GET", path, headers=headers or {})
            resp = c.getresponse()
            resp.read()
            if resp.status != status:
                raise SystemExit(f"GET {path} answered {resp.status}, not {status}")
            if i >= 20:
                lat.append(time.perf_counter() - t0)
    finally:
        c.close()
    return lat


def downloads(url: str, n: int) -> float:
    """Median MB/s of ``n`` curl downloads of ``url`` (one warm-up first)."""
    rates = []
    for i in range(n + 1):
        r = curl([url])
        if r["status"] != 200:
            raise SystemExit(f"{url} answered {r['status']}")
        if i:
            rates.append(r["down_bps"] / 1e6)
    return median(rates)


def main() -> None:
    """Measure and write ``bench/results/registry_reads.json``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2 if QUICK else 5)
    ap.add_argument("--requests", type=int, default=300 if QUICK else 2000, help="4 KiB GETs per server per run")
    ap.add_argument("--downloads", type=int, default=5 if QUICK else 30, help="1 MiB downloads per server per run")
    args = ap.parse_args()
    runs: dict[str, list[float]] = {k: [] for k in (
        "kvgraft_4k_p50_ms", "kvgraft_4k_p99_ms", "nginx_4k_p50_ms", "nginx_4k_p99_ms",
        "kvgraft_304_p50_ms", "kvgraft_envelope_p50_ms", "kvgraft_1m_mb_per_s", "nginx_1m_mb_per_s")}
    with tempfile.TemporaryDirectory(prefix="kvgraft-bench-reads-") as tmp:
        work = Path(tmp)
        data = work / "registry"
        with kvgraft_server(data) as (port, token), nginx_server(data / "blobs" / "sha256", work / "nginx") as (ngx, nginx_version):
            small, small_hex = make_blob(work, 4096)
            big, big_hex = make_blob(work, 1 << 20)
            upload(port, token, small, small_hex)
            upload(port, token, big, big_hex)
            small_path = f"/v1/blobs/sha256:{small_hex}"
            try:
                publish_one(port, data)
                envelope: str | None = "/v1/entries/0/envelope"
            except (RuntimeError, OSError, ImportError) as e:
                say(f"no entry published ({e}); the envelope read is skipped")
                envelope = None
            for run in range(args.runs):
                for name, p in (("kvgraft", port), ("nginx", ngx)):
                    lat = timed_gets(p, small_path, args.requests)
                    runs[f"{name}_4k_p50_ms"].append(percentile(lat, 50) * 1e3)
                    runs[f"{name}_4k_p99_ms"].append(percentile(lat, 99) * 1e3)
                    runs[f"{name}_1m_mb_per_s"].append(downloads(f"http://127.0.0.1:{p}/v1/blobs/sha256:{big_hex}", args.downloads))
                lat = timed_gets(port, small_path, args.requests, {"If-None-Match": f'"sha256:{small_hex}"'}, status=304)
                runs["kvgraft_304_p50_ms"].append(percentile(lat, 50) * 1e3)
                if envelope is not None:
                    runs["kvgraft_envelope_p50_ms"].append(percentile(timed_gets(port, envelope, args.requests), 50) * 1e3)
                say(f"run {run + 1}: 4 KiB p50 kvgraft {runs['kvgraft_4k_p50_ms'][-1]:.2f} ms, nginx {runs['nginx_4k_p50_ms'][-1]:.2f} ms; "
                    f"1 MiB kvgraft {runs['kvgraft_1m_mb_per_s'][-1]:.0f} MB/s, nginx {runs['nginx_1m_mb_per_s'][-1]:.0f} MB/s")
            # Still answered as before the runs: a sanity check that nothing was cut short.
            small_reads(port, small_path, 1, 3)
    med = {k: (median(v) if v else None) for k, v in runs.items()}
    ratio = med["kvgraft_1m_mb_per_s"] / med["nginx_1m_mb_per_s"]  # type: ignore[operator]
    write_result("registry_reads", {
        "description": "kvgraft serve vs nginx on 127.0.0.1: 4 KiB read latency (1 client, keep-alive) and 1 MiB download MB/s (curl)",
        "nginx": nginx_version,
        "load_average_at_end": os.getloadavg(),
        "runs": runs,
        "median": med,
        "download_ratio_kvgraft_over_nginx_1m": ratio,
        "target": {"p50_ms_max": TARGET_P50_MS, "download_ratio_min": TARGET_DOWNLOAD_RATIO},
        "met": {"p50": med["kvgraft_4k_p50_ms"] <= TARGET_P50_MS,  # type: ignore[operator]
                "download_ratio": ratio >= TARGET_DOWNLOAD_RATIO},
    })
    say(f"median: 4 KiB p50 {med['kvgraft_4k_p50_ms']:.2f} ms (nginx {med['nginx_4k_p50_ms']:.2f}); 1 MiB {ratio:.2f}x nginx")


if __name__ == "__main__":
    main()
