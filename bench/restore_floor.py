"""Restore vs the I/O floor (issue 8, item 2), ``smollm2-135m``.

The graft's restore (``load_artifact``: statement read and its signature verified, tensors file
read and sha256-checked, model/tokenizer/profile checked, tensors parsed and checked finite; then ``KVState.restore`` building the cache)
against what merely reading and hashing the same bytes costs: ``cat kv.safetensors > /dev/null``
and ``sha256sum kv.safetensors``, with the page cache warm and cold.

Cold: the artifact's pages are evicted with ``posix_fadvise(POSIX_FADV_DONTNEED)`` before each
run (targeted: other users' cached pages stay), checked with ``fincore`` where it exists; the
result records whether eviction was confirmed. Target: restore within 2x of read+hash
(``sha256sum``) of the same bytes.

    .venv/bin/python bench/restore_floor.py [--runs 5] [--tokens 512 2048]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from common import QUICK, corpus_text, figure, median, say, write_result

from kvgraft.engine import (
    KV_FILE,
    KVState,
    applied,
    capture,
    current_profile,
    ensure_local_key,
    load_artifact,
    load_model,
    trust_signer,
)

MODEL = "smollm2-135m"
TARGET_RATIO = 2.0


def evict(path: Path) -> bool | None:
    """Drop ``path``'s pages from the page cache; True when fincore confirms none are resident
    (None when fincore is not there to ask)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=False)
    return out.returncode == 0 and out.stdout.strip() == "0"


def run_cmd(cmd: list[str], stdout: Any = subprocess.DEVNULL) -> float:
    """Wall seconds of one command (process start included, as a user would pay it)."""
    t0 = time.perf_counter()
    subprocess.run(cmd, stdout=stdout, check=True)
    return time.perf_counter() - t0


def main() -> None:
    """Measure, write ``bench/results/restore_floor.json`` and its plot."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2 if QUICK else 5)
    ap.add_argument("--tokens", type=int, nargs="+", default=[256] if QUICK else [512, 2048])
    ap.add_argument("--threads", type=int, default=2,
                    help="threads for capture and restore (2 is the profile's own; 1 is steadier on a machine others load)")
    args = ap.parse_args()
    model = load_model(MODEL)
    profile = current_profile("cpu-fp32")
    if args.threads != profile.threads:
        profile = profile.model_copy(update={"threads": args.threads})
    key, _ = ensure_local_key()
    trusted = trust_signer(key)  # the restore verifies the signature, as every graft does
    ids = model.tokenizer.encode(corpus_text(max(args.tokens) * 6), first=True)
    rows: list[dict[str, Any]] = []
    confirmed: list[bool | None] = []
    with tempfile.TemporaryDirectory(prefix="kvgraft-bench-restore-") as tmp:
        for n in args.tokens:
            out = Path(tmp) / f"art-{n}"
            capture(model, profile, model.tokenizer.decode(ids[:n]), out, key=key)
            kv = out / KV_FILE
            size = kv.stat().st_size

            def restore(directory: Path = out) -> None:
                with applied(profile):
                    art = load_artifact(directory, model, profile, trusted=trusted)
                    KVState.restore(model, art.segments())

            measures = {
                "cat": lambda kv=kv: run_cmd(["cat", str(kv)]),
                "sha256sum": lambda kv=kv: run_cmd(["sha256sum", str(kv)]),
                # coreutils' sha256sum has no SHA-NI path; OpenSSL's is the stronger floor.
                "openssl": lambda kv=kv: run_cmd(["openssl", "dgst", "-sha256", str(kv)]),
                "restore": lambda: run_cmd_py(restore),
            }
            row: dict[str, Any] = {"tokens": n, "kv_bytes": size, "warm": {}, "cold": {}}
            for cache in ("warm", "cold"):
                runs: dict[str, list[float]] = {k: [] for k in measures}
                for fn in measures.values():
                    fn()  # warm-up (and warms the cache for the warm runs)
                for _ in range(args.runs):
                    for k, fn in measures.items():
                        if cache == "cold":
                            confirmed.append(evict(kv))
                        runs[k].append(fn())
                med = {k: median(v) for k, v in runs.items()}
                row[cache] = {
                    "runs_s": runs,
                    "median_s": med,
                    "mb_per_s": {k: size / v / 1e6 for k, v in med.items()},
                    "restore_over_sha256sum": med["restore"] / med["sha256sum"],
                    "restore_over_cat": med["restore"] / med["cat"],
                    "restore_over_openssl": med["restore"] / med["openssl"],
                }
                say(f"{n} tokens ({size / 1e6:.0f} MB) {cache}: cat {med['cat']:.3f} s, sha256sum {med['sha256sum']:.3f} s, "
                    f"openssl {med['openssl']:.3f} s, restore {med['restore']:.3f} s ({row[cache]['restore_over_sha256sum']:.2f}x sha256sum, "
                    f"{row[cache]['restore_over_openssl']:.2f}x openssl)")
            rows.append(row)
            shutil.rmtree(out)
    write_result("restore_floor", {
        "description": "graft restore (verified load + cache rebuild) vs cat and sha256sum of the same bytes, warm and cold",
        "model": MODEL,
        "threads": args.threads,
        "cold_method": "posix_fadvise(POSIX_FADV_DONTNEED) on the artifact's kv file before each cold run",
        "cold_eviction_confirmed_by_fincore": None if all(c is None for c in confirmed) else all(bool(c) for c in confirmed),
        "target": {"restore_over_sha256sum_max": TARGET_RATIO},
        "rows": rows,
        "met": {f"{r['tokens']} {c}": r[c]["restore_over_sha256sum"] <= TARGET_RATIO for r in rows for c in ("warm", "cold")},
    })
    plot(rows)


def run_cmd_py(fn: Any) -> float:
    """Wall seconds of one in-process call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def plot(rows: list[dict[str, Any]]) -> None:
    """Throughput (MB/s) of cat, sha256sum and restore, warm and cold, per artifact size."""
    with figure("restore_floor") as fig:
        if fig is None:
            return
        ax = fig.add_subplot(1, 1, 1)
        groups = [(r, c) for r in rows for c in ("warm", "cold")]
        width = 0.25
        width = 0.2
        for i, k in enumerate(("cat", "sha256sum", "openssl", "restore")):
            ax.bar([g + (i - 1.5) * width for g in range(len(groups))], [r[c]["mb_per_s"][k] for r, c in groups], width=width, label=k)
        ax.set_xticks(range(len(groups)), [f"{r['kv_bytes'] / 1e6:.0f} MB\n{c}" for r, c in groups])
        ax.set_ylabel("MB/s of the artifact's bytes (median)")
        ax.set_title("Restore vs reading and hashing the same bytes")
        ax.legend()


if __name__ == "__main__":
    main()
