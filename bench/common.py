"""Helpers every benchmark script shares: the machine description, versions, medians, timing
and writing one JSON result per benchmark (atomically) under ``bench/results/``.

The benchmarks are scripts, not library code: they report progress on stderr and write their
figures as JSON; every run's figure is kept next to the median so a reader can judge the spread.
"""

from __future__ import annotations

import contextlib
import datetime
import http.client
import importlib.metadata
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
#: Where the engine caches converted models; the Makefile sets it, the default suits a checkout.
os.environ.setdefault("KVGRAFT_HOME", str(ROOT / ".kvgraft-home"))

#: Set by the runner (``bench/run.py --quick``): fewer repetitions and smaller sizes, to check that
#: a script runs end to end; its figures are not the ones to quote.
QUICK = os.environ.get("KVGRAFT_BENCH_QUICK") == "1"


def say(message: str) -> None:
    """Progress on stderr (the JSON file is the result)."""
    sys.stderr.write(f"[bench {time.strftime('%H:%M:%S')}] {message}\n")
    sys.stderr.flush()


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="utf-8") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _tool_version(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = (done.stdout or done.stderr).strip().splitlines()
    return text[0] if text else None


def machine() -> dict[str, Any]:
    """What the figures were measured on: CPU, cores, memory, load, OS, library versions."""
    load = os.getloadavg()
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _mem_total_gib(),
        "load_average_1_5_15": [round(x, 2) for x in load],
        "os": platform.platform(),
        "python": platform.python_version(),
        "versions": {
            name: _version(name)
            for name in ("kvgraft", "torch", "transformers", "numpy", "cryptography", "litestar", "duckdb", "uvicorn", "httpx",
                         "llama_cpp_python", "matplotlib")
        },
        "tools": {
            "nginx": _tool_version(["nginx", "-v"]),
            "sha256sum": _tool_version(["sha256sum", "--version"]),
        },
        "quick": QUICK,
    }


def median(xs: list[float]) -> float:
    """The median of a non-empty list."""
    return float(statistics.median(xs))


def percentile(xs: list[float], p: float) -> float:
    """The ``p``-th percentile (0-100) by linear interpolation between closest ranks."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds one call of ``fn`` took, and what it returned."""
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def write_result(name: str, payload: dict[str, Any]) -> Path:
    """Write ``bench/results/<name>.json`` (with the machine description) atomically."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {
        "benchmark": name,
        "measured_at": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": f".venv/bin/python bench/{name}.py",
        "machine": machine(),
        **payload,
    }
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(path)
    say(f"wrote {path.relative_to(ROOT)}")
    return path


@contextlib.contextmanager
def figure(name: str) -> Iterator[Any]:
    """A matplotlib figure saved to ``bench/results/<name>.png`` on exit; skipped (with a note)
    when matplotlib is not installed, since the JSON is the result and the plot a view of it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say(f"matplotlib is not installed: no {name}.png (make bench installs it)")
        yield None
        return
    fig = plt.figure(figsize=(7.5, 4.5), dpi=110)
    try:
        yield fig
        fig.tight_layout()
        RESULTS.mkdir(parents=True, exist_ok=True)
        fig.savefig(RESULTS / f"{name}.png")
        say(f"wrote bench/results/{name}.png")
    finally:
        plt.close(fig)


def corpus_text(n_chars: int) -> str:
    """Deterministic English text of at least ``n_chars`` characters: GSM8K questions and worked
    answers from the shipped dataset, in file order."""
    parts: list[str] = []
    total = 0
    with open(ROOT / "data" / "datasets" / "gsm8k_test.jsonl", encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            piece = f"Question: {row['question']}\nAnswer: {row['answer']}\n\n"
            parts.append(piece)
            total += len(piece)
            if total >= n_chars:
                break
    return "".join(parts)


def post_json(conn: http.client.HTTPConnection, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """POST ``body`` as JSON on a keep-alive connection: (seconds until the whole answer was read, the answer)."""
    data = json.dumps(body).encode("utf-8")
    t0 = time.perf_counter()
    conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    raw = r.read()
    seconds = time.perf_counter() - t0
    if r.status != 200:
        raise SystemExit(f"POST {path} answered {r.status}: {raw[:300]!r}")
    return seconds, dict(json.loads(raw))


# --- a real kvgraft serve on 127.0.0.1 (the registry benchmarks) ---------------------------------

#: The project's own ``kvgraft`` command, in the venv ``make bench`` set up.
KVGRAFT = [str(ROOT / ".venv" / "bin" / "kvgraft")]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(port: int, path: str, seconds: float = 60.0, *, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until ``GET path`` answers on 127.0.0.1:port (stop early, naming it, if ``proc`` exits)."""
    import http.client

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before answering on 127.0.0.1:{port}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", path)
            c.getresponse().read()
            c.close()
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"nothing answered on 127.0.0.1:{port}{path} within {seconds:.0f} s")


@contextlib.contextmanager
def server_process(argv: list[str], log_path: Path, port: int, ready_path: str, *, seconds: float = 60.0) -> Iterator[int]:
    """Run ``argv`` (its output in ``log_path``) until ``GET ready_path`` answers on 127.0.0.1:``port``
    (at most ``seconds``), yield the port, and stop it with SIGTERM (then SIGKILL after 30 s) on exit."""
    import signal

    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                wait_http(port, ready_path, seconds, proc=proc)
            except SystemExit as e:
                raise SystemExit(f"{Path(argv[0]).name}: {e} (see {log_path})") from e
            yield port
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def kvgraft_serve(data: Path, extra: list[str]) -> Iterator[int]:
    """``kvgraft serve --data DATA EXTRA`` on 127.0.0.1 at a free port (its log in ``DATA/../serve.log``),
    answering before this yields the port; stopped with SIGTERM (then SIGKILL after 30 s) on exit."""
    port = free_port()
    argv = [*KVGRAFT, "serve", "--data", str(data), "--init", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra]
    with server_process(argv, data.parent / "serve.log", port, "/v1/log/checkpoint") as ready:
        yield ready
