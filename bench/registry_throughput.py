"""Registry throughput (issue 8, item 3): a real ``kvgraft serve`` against nginx on 127.0.0.1.

Both servers serve the same files: nginx (the Debian package, run with its own config in a temp
directory) maps ``/v1/blobs/sha256:<hex>`` onto the registry's blob directory, and accepts
uploads with its WebDAV ``PUT`` (no hashing). The client for transfers is ``curl`` (the same
binary for both); for small reads, client threads on keep-alive connections (the same code for
both), recording every request's latency.

- upload and download MB/s of 1 MB, 100 MB and 1 GB random blobs (the registry verifies the
  digest while streaming to disk, fsyncs and renames; before each upload run the stored copy
  is removed so every run writes);
- the hashing ceiling: Python's ``hashlib.sha256`` MB/s over the same bytes in memory, since an
  upload can go no faster than its digest;
- p50 / p99 latency of 4 KiB blob reads at 1, 8 and 32 concurrent clients.

Targets: download at least 0.5x nginx's; upload limited by hashing (near the hashing ceiling).

    .venv/bin/python bench/registry_throughput.py [--sizes-mb 1 100 1024] [--runs 3]
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common import KVGRAFT, QUICK, figure, free_port, kvgraft_serve, median, percentile, say, wait_http, write_result

TARGET_DOWNLOAD_RATIO = 0.5
@contextmanager
def kvgraft_server(data: Path) -> Iterator[tuple[int, str]]:
    """A real ``kvgraft serve`` on 127.0.0.1 and a publish token; stopped with SIGTERM on exit."""
    key = data.parent / "bench.pem"
    subprocess.run([*KVGRAFT, "keys", "generate", "--out", str(key)], check=True, stdout=subprocess.DEVNULL)
    out = subprocess.run([*KVGRAFT, "--json", "token", "create", "--data", str(data), "--publisher", "bench", "--key", f"{key}.pub"],
                         check=True, capture_output=True, text=True)
    token = json.loads(out.stdout)["token"]
    with kvgraft_serve(data, []) as port:
        yield port, token


NGINX_CONF = """
worker_processes 1;
user root;
error_log {tmp}/error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_requests 100000;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    types {{ }}
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{port};
        location ~ "^/v1/blobs/sha256:(?<hex>[0-9a-f]{{64}})$" {{
            alias {blobs}/$hex;
        }}
        location /upload/ {{
            root {tmp};
            dav_methods PUT;
            create_full_put_path on;
            client_max_body_size 4g;
        }}
    }}
}}
"""


@contextmanager
def nginx_server(blobs: Path, tmp: Path) -> Iterator[tuple[int, str]]:
    """nginx (one worker, like the registry's one process) with its own config under ``tmp``."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise SystemExit("nginx is not installed: run `make bench` (it installs the Debian package) or apt-get install -y nginx")
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "upload").mkdir(exist_ok=True)
    conf = tmp / "nginx.conf"
    conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, blobs=blobs))
    version = subprocess.run([nginx, "-v"], capture_output=True, text=True, check=False).stderr.strip()
    proc = subprocess.Popen([nginx, "-c", str(conf), "-p", str(tmp), "-g", "daemon off;"])
    try:
        wait_http(port, "/")
        yield port, version
    finally:
        proc.send_signal(signal.SIGQUIT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def curl(args: list[str]) -> dict[str, float]:
    """Run curl; its status, total seconds and bytes/s (download or upload)."""
    fmt = "%{http_code} %{time_total} %{speed_download} %{speed_upload}"
    out = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", fmt, *args], capture_output=True, text=True, check=True).stdout.split()
    return {"status": int(out[0]), "seconds": float(out[1]), "down_bps": float(out[2]), "up_bps": float(out[3])}


def make_blob(directory: Path, size: int) -> tuple[Path, str]:
    """A file of ``size`` random bytes and its sha256 hex."""
    path = directory / f"blob-{size}"
    h = hashlib.sha256()
    with path.open("wb") as f:
        left = size
        while left:
            chunk = os.urandom(min(left, 1 << 24))
            h.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    return path, h.hexdigest()


def hash_rate(path: Path) -> float:
    """MB/s of hashlib.sha256 over the file's bytes, in memory (the upload's hashing ceiling)."""
    size = path.stat().st_size
    h = hashlib.sha256()
    t0 = time.perf_counter()
    with path.open("rb") as f:
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        read = 0
        while n := f.readinto(buf):
            h.update(view[:n])
            read += n
    return size / (time.perf_counter() - t0) / 1e6


def transfers(sizes: list[int], runs: int, work: Path, reg: tuple[int, str], ngx: int, blob_dir: Path) -> list[dict[str, Any]]:
    """Upload and download each size to and from both servers, ``runs`` times each."""
    port, token = reg
    rows = []
    for size in sizes:
        path, hexd = make_blob(work, size)
        reps = runs if size < (1 << 30) else max(1, runs - 1)
        res: dict[str, list[float]] = {k: [] for k in ("kvgraft_upload", "nginx_upload", "kvgraft_download", "nginx_download", "hashlib")}
        url = f"http://127.0.0.1:{port}/v1/blobs/sha256:{hexd}"
        for _ in range(reps):
            stored = blob_dir / hexd
            stored.unlink(missing_ok=True)  # every run writes the blob anew
            r = curl(["-T", str(path), "-X", "PUT", "-H", f"Authorization: Bearer {token}", "-H", "Content-Type: application/octet-stream", url])
            if r["status"] != 201:
                raise SystemExit(f"the registry answered {r['status']} to an upload of {size} bytes")
            res["kvgraft_upload"].append(size / r["seconds"] / 1e6)
            r = curl(["-T", str(path), "-X", "PUT", f"http://127.0.0.1:{ngx}/upload/{hexd}"])
            if r["status"] not in (201, 204):
                raise SystemExit(f"nginx answered {r['status']} to an upload")
            res["nginx_upload"].append(size / r["seconds"] / 1e6)
            (work / "nginx" / "upload" / hexd).unlink(missing_ok=True)
            res["hashlib"].append(hash_rate(path))
        for _ in range(reps + 1):
            # The first download of each warms the page cache; both servers read the same file.
            for name, u in (("kvgraft_download", url), ("nginx_download", f"http://127.0.0.1:{ngx}/v1/blobs/sha256:{hexd}")):
                r = curl([u])
                if r["status"] != 200:
                    raise SystemExit(f"{name} answered {r['status']}")
                res[name].append(size / r["seconds"] / 1e6)
        res["kvgraft_download"] = res["kvgraft_download"][1:]
        res["nginx_download"] = res["nginx_download"][1:]
        med = {k: median(v) for k, v in res.items()}
        row = {"bytes": size, "runs_mb_per_s": res, "median_mb_per_s": med,
               "download_ratio_kvgraft_over_nginx": med["kvgraft_download"] / med["nginx_download"],
               "upload_over_hashlib": med["kvgraft_upload"] / med["hashlib"],
               "upload_ratio_kvgraft_over_nginx": med["kvgraft_upload"] / med["nginx_upload"]}
        say(f"{size / 1e6:.0f} MB: upload kvgraft {med['kvgraft_upload']:.0f} MB/s (nginx {med['nginx_upload']:.0f}, hashlib "
            f"{med['hashlib']:.0f}); download kvgraft {med['kvgraft_download']:.0f} MB/s, nginx {med['nginx_download']:.0f}")
        rows.append(row)
        path.unlink()
    return rows


def small_reads(port: int, path: str, clients: int, per_client: int) -> list[float]:
    """Latencies (s) of ``clients`` threads each making ``per_client`` GETs on its own keep-alive
    connection; all threads start together."""
    lat: list[list[float]] = [[] for _ in range(clients)]
    start = threading.Barrier(clients)
    errors: list[str] = []

    def client(i: int) -> None:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            start.wait()
            for _ in range(per_client):
                t0 = time.perf_counter()
                c.request("GET", path)
                resp = c.getresponse()
                resp.read()
                lat[i].append(time.perf_counter() - t0)
                if resp.status != 200:
                    errors.append(f"status {resp.status}")
                    return
        finally:
            c.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise SystemExit(f"small reads failed: {errors[0]}")
    return [x for xs in lat for x in xs]


def latency(reg_port: int, ngx: int, token: str, work: Path, levels: list[int], requests: int) -> list[dict[str, Any]]:
    """p50/p99 of 4 KiB reads at each concurrency level, both servers, interleaved."""
    path, hexd = make_blob(work, 4096)
    r = curl(["-T", str(path), "-X", "PUT", "-H", f"Authorization: Bearer {token}", f"http://127.0.0.1:{reg_port}/v1/blobs/sha256:{hexd}"])
    if r["status"] not in (200, 201):
        raise SystemExit(f"the registry answered {r['status']} to the small blob")
    rows = []
    for clients in levels:
        per_client = max(20, requests // clients)
        row: dict[str, Any] = {"clients": clients, "requests": per_client * clients}
        for name, port in (("kvgraft", reg_port), ("nginx", ngx)):
            small_reads(port, f"/v1/blobs/sha256:{hexd}", clients, 5)  # connections and caches warm
            lat = small_reads(port, f"/v1/blobs/sha256:{hexd}", clients, per_client)
            row[name] = {"p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3,
                         "requests_per_s": len(lat) / sum(lat) * clients}
        say(f"{clients} clients: kvgraft p50 {row['kvgraft']['p50_ms']:.2f} ms p99 {row['kvgraft']['p99_ms']:.2f} ms; "
            f"nginx p50 {row['nginx']['p50_ms']:.2f} ms p99 {row['nginx']['p99_ms']:.2f} ms")
        rows.append(row)
    return rows


def main() -> None:
    """Measure, write ``bench/results/registry_throughput.json`` and its plot."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 10] if QUICK else [1, 100, 1024])
    ap.add_argument("--runs", type=int, default=2 if QUICK else 3)
    ap.add_argument("--requests", type=int, default=200 if QUICK else 1600, help="small reads per concurrency level")
    args = ap.parse_args()
    sizes = [mb * (1 << 20) for mb in args.sizes_mb]
    with tempfile.TemporaryDirectory(prefix="kvgraft-bench-registry-") as tmp:
        work = Path(tmp)
        data = work / "registry"
        with kvgraft_server(data) as (port, token), nginx_server(data / "blobs" / "sha256", work / "nginx") as (ngx, nginx_version):
            rows = transfers(sizes, args.runs, work, (port, token), ngx, data / "blobs" / "sha256")
            lat = latency(port, ngx, token, work, [1, 8, 32], args.requests)
    big = rows[-1]
    write_result("registry_throughput", {
        "description": "kvgraft serve vs nginx on 127.0.0.1: blob upload/download MB/s (curl), small-read latency",
        "nginx": nginx_version,
        "client": "curl for transfers; Python threads with keep-alive http.client connections for small reads",
        "target": {"download_ratio_min": TARGET_DOWNLOAD_RATIO, "upload": "limited by hashing (near hashlib's MB/s)"},
        "transfers": rows,
        "small_reads": lat,
        "met": {"download_ratio": all(r["download_ratio_kvgraft_over_nginx"] >= TARGET_DOWNLOAD_RATIO for r in rows),
                "largest_upload_over_hashlib": big["upload_over_hashlib"]},
    })
    plot(rows, lat)


def plot(rows: list[dict[str, Any]], lat: list[dict[str, Any]]) -> None:
    """Left: MB/s per blob size; right: small-read latency per concurrency."""
    with figure("registry_throughput") as fig:
        if fig is None:
            return
        ax = fig.add_subplot(1, 2, 1)
        labels = [f"{r['bytes'] / 2**20:.0f} MiB" for r in rows]
        keys = ("kvgraft_download", "nginx_download", "kvgraft_upload", "nginx_upload", "hashlib")
        width = 0.16
        for i, k in enumerate(keys):
            ax.bar([x + (i - 2) * width for x in range(len(rows))], [r["median_mb_per_s"][k] for r in rows], width=width, label=k)
        ax.set_xticks(range(len(rows)), labels)
        ax.set_ylabel("MB/s (median)")
        ax.set_title("Blob transfers")
        ax.legend(fontsize=7)
        ax2 = fig.add_subplot(1, 2, 2)
        xs = [r["clients"] for r in lat]
        for name in ("kvgraft", "nginx"):
            ax2.plot(xs, [r[name]["p50_ms"] for r in lat], marker="o", label=f"{name} p50")
            ax2.plot(xs, [r[name]["p99_ms"] for r in lat], marker="x", linestyle="--", label=f"{name} p99")
        ax2.set_xscale("log", base=2)
        ax2.set_yscale("log")
        ax2.set_xlabel("concurrent clients")
        ax2.set_ylabel("latency of a 4 KiB read (ms)")
        ax2.set_title("Small reads")
        ax2.legend(fontsize=7)


if __name__ == "__main__":
    main()
