"""Verifier throughput (issue 8, item 4).

- **artifacts verified per second**: real KV artifacts (``tiny-llama-test`` captures, each a
  ``kv.safetensors`` and its signed statement), each verified as ``kvgraft-verify envelope
  --artifact-dir`` does it (envelope read, Ed25519 signature, statement parsed, the directory
  holds exactly the subjects, every digest equal), in process; plus the CLI's per-artifact time
  (process start included) for a few of them;
- **GB/s hashed**: the verifier's subject check (``verify_subjects`` over a statement whose
  subject is a 1 GiB file, page cache warm) against ``sha256sum`` of the same file;
- **Ed25519 verifications per second**: ``verify_envelope`` on one envelope (base64, PAE and the
  signature), and the bare ``cryptography`` verify call under it.

Target: hashing at least 0.8x ``sha256sum``.

    .venv/bin/python bench/verifier_throughput.py [--artifacts 100] [--big-mb 1024] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from common import QUICK, ROOT, figure, median, say, write_result

from kvgraft.engine import capture, current_profile, load_model
from kvgraft.schemas import KV_FILE, STATEMENT_FILE, TRUSTED_KEYS_FILE, parse_statement
from kvgraft.verifier import (
    b64decode_any,
    load_trusted_keys,
    pae,
    read_envelope,
    verify_envelope,
    verify_statement_envelope,
    verify_subjects,
)

TARGET_HASH_RATIO = 0.8
BIN = ROOT / ".venv" / "bin"


def make_key(work: Path) -> tuple[Path, Path]:
    """An Ed25519 key and a trusted-keys file naming it, made with the kvgraft CLI."""
    key = work / "bench.pem"
    subprocess.run([str(BIN / "kvgraft"), "keys", "generate", "--out", str(key)], check=True, stdout=subprocess.DEVNULL)
    trusted = work / TRUSTED_KEYS_FILE
    subprocess.run([str(BIN / "kvgraft"), "keys", "trust", "--file", str(trusted), "--name", "bench", "--public-key", f"{key}.pub"],
                   check=True, stdout=subprocess.DEVNULL)
    return key, trusted


def verify_dir(directory: Path, trusted: Any) -> None:
    """What ``kvgraft-verify envelope STATEMENT --artifact-dir DIR`` checks, in process."""
    env_path = directory / STATEMENT_FILE
    _, statement = verify_statement_envelope(read_envelope(env_path), trusted)
    verify_subjects(statement, directory, exclude=[env_path])


def artifacts_per_second(work: Path, key: Path, trusted_path: Path, count: int, runs: int) -> dict[str, Any]:
    """Capture ``count`` tiny artifacts, then verify all of them ``runs`` times."""
    model = load_model("tiny-llama-test")
    profile = current_profile("cpu-fp32")
    dirs = []
    for i in range(count):
        out = work / "arts" / f"a{i:05d}"
        capture(model, profile, f"Fact {i}: the number {i * 7919 % 10007} is written down here for the benchmark.", out, key=key)
        dirs.append(out)
    size = sum((d / KV_FILE).stat().st_size for d in dirs) / count
    trusted = load_trusted_keys(trusted_path)
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for d in dirs:
            verify_dir(d, trusted)
        rates.append(count / (time.perf_counter() - t0))
    cli = []
    for d in dirs[:min(5, count)]:
        t0 = time.perf_counter()
        subprocess.run([str(BIN / "kvgraft-verify"), "envelope", str(d / STATEMENT_FILE), "--trusted-keys", str(trusted_path),
                        "--artifact-dir", str(d)], check=True, stdout=subprocess.DEVNULL)
        cli.append(time.perf_counter() - t0)
    say(f"{count} artifacts of {size / 1e3:.1f} kB: {median(rates):.0f} verified/s in process; CLI {median(cli) * 1e3:.0f} ms each")
    return {"artifacts": count, "kv_bytes_each": size, "runs_per_s": rates, "median_per_s": median(rates),
            "cli_runs_s": cli, "cli_median_s": median(cli)}


def hashing(work: Path, key: Path, trusted_path: Path, big_mb: int, runs: int) -> dict[str, Any]:
    """GB/s of the verifier's subject check vs sha256sum on one big file, page cache warm."""
    d = work / "big"
    d.mkdir()
    f = d / "blob.bin"
    with f.open("wb") as out:
        for _ in range(big_mb):
            out.write(os.urandom(1 << 20))
    size = f.stat().st_size
    predicate = work / "predicate.json"
    predicate.write_text(json.dumps({"purpose": "benchmark"}))
    env = work / "big.dsse.json"
    subprocess.run([str(BIN / "kvgraft"), "sign", "--key", str(key), "--subject", str(f), "--predicate-type",
                    "https://kvgraft.dev/bench/v1", "--predicate", str(predicate), "--out", str(env)], check=True, stdout=subprocess.DEVNULL)
    trusted = load_trusted_keys(trusted_path)
    _, statement = verify_statement_envelope(read_envelope(env), trusted)
    subprocess.run(["cat", str(f)], stdout=subprocess.DEVNULL, check=True)  # page cache warm
    res: dict[str, list[float]] = {"verifier": [], "sha256sum": [], "openssl": []}
    for _ in range(runs):
        t0 = time.perf_counter()
        verify_subjects(statement, d)
        res["verifier"].append(size / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        subprocess.run(["sha256sum", str(f)], stdout=subprocess.DEVNULL, check=True)
        res["sha256sum"].append(size / (time.perf_counter() - t0) / 1e9)
        # coreutils' sha256sum has no SHA-NI path; OpenSSL's is the stronger reference.
        t0 = time.perf_counter()
        subprocess.run(["openssl", "dgst", "-sha256", str(f)], stdout=subprocess.DEVNULL, check=True)
        res["openssl"].append(size / (time.perf_counter() - t0) / 1e9)
    med = {k: median(v) for k, v in res.items()}
    ratio = med["verifier"] / med["sha256sum"]
    say(f"hashing {size / 1e9:.2f} GB: verifier {med['verifier']:.2f} GB/s, sha256sum {med['sha256sum']:.2f} GB/s ({ratio:.2f}x)")
    f.unlink()
    return {"bytes": size, "runs_gb_per_s": res, "median_gb_per_s": med, "ratio_verifier_over_sha256sum": ratio,
            "ratio_verifier_over_openssl": med["verifier"] / med["openssl"]}


def signatures(work: Path, key: Path, trusted_path: Path, runs: int, per_run: int) -> dict[str, Any]:
    """Ed25519 verifications per second: the DSSE path and the bare primitive."""
    trusted = load_trusted_keys(trusted_path)
    env = read_envelope(work / "big.dsse.json")
    payload = b64decode_any(env.payload, what="payload")
    message = pae(env.payload_type, payload)
    sig = b64decode_any(env.signatures[0].sig, what="signature")
    public = trusted.keys[0].public_key
    parse_statement(payload, what="statement")
    res: dict[str, list[float]] = {"verify_envelope": [], "ed25519_verify": []}
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(per_run):
            verify_envelope(env, trusted)
        res["verify_envelope"].append(per_run / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        for _ in range(per_run):
            public.verify(sig, message)
        res["ed25519_verify"].append(per_run / (time.perf_counter() - t0))
    med = {k: median(v) for k, v in res.items()}
    say(f"Ed25519: {med['verify_envelope']:.0f}/s through verify_envelope, {med['ed25519_verify']:.0f}/s bare")
    return {"per_run": per_run, "runs_per_s": res, "median_per_s": med}


def main() -> None:
    """Measure, write ``bench/results/verifier_throughput.json`` and its plot."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifacts", type=int, default=20 if QUICK else 100)
    ap.add_argument("--big-mb", type=int, default=64 if QUICK else 1024)
    ap.add_argument("--runs", type=int, default=2 if QUICK else 3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvgraft-bench-verifier-") as tmp:
        work = Path(tmp)
        key, trusted = make_key(work)
        arts = artifacts_per_second(work, key, trusted, args.artifacts, args.runs)
        hashed = hashing(work, key, trusted, args.big_mb, args.runs)
        sigs = signatures(work, key, trusted, args.runs, 500 if QUICK else 3000)
    write_result("verifier_throughput", {
        "description": "verifier: artifacts verified/s, GB/s hashed vs sha256sum, Ed25519 verifications/s",
        "target": {"hash_ratio_min": TARGET_HASH_RATIO},
        "artifacts": arts,
        "hashing": hashed,
        "signatures": sigs,
        "met": {"hash_ratio": hashed["ratio_verifier_over_sha256sum"] >= TARGET_HASH_RATIO},
    })
    plot(hashed, sigs, arts)


def plot(hashed: dict[str, Any], sigs: dict[str, Any], arts: dict[str, Any]) -> None:
    """Left: GB/s hashed; right: operations per second (log)."""
    with figure("verifier_throughput") as fig:
        if fig is None:
            return
        ax = fig.add_subplot(1, 2, 1)
        keys = ["verifier", "sha256sum", "openssl"]
        ax.bar(keys, [hashed["median_gb_per_s"][k] for k in keys], color=["tab:blue", "tab:gray", "tab:green"])
        ax.set_ylabel("GB/s (median, page cache warm)")
        ax.set_title(f"Hashing {hashed['bytes'] / 2**30:.0f} GiB")
        ax2 = fig.add_subplot(1, 2, 2)
        labels = ["artifacts\nverified", "verify_envelope", "bare Ed25519"]
        vals = [arts["median_per_s"], sigs["median_per_s"]["verify_envelope"], sigs["median_per_s"]["ed25519_verify"]]
        ax2.bar(labels, vals, color=["tab:blue", "tab:orange", "tab:gray"])
        ax2.set_yscale("log")
        ax2.set_ylabel("per second (median)")
        ax2.set_title("Verifications")


if __name__ == "__main__":
    main()
