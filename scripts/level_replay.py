"""Pre-registered replay of an instruction-set-level exactness record on another machine (issue 16, item 5).

    .venv/bin/python scripts/level_replay.py register [--model smollm2-135m] [--level x86-64-v3]
        [--samples 50] [--key KEY]
    .venv/bin/python scripts/level_replay.py replay [--model smollm2-135m] [--level x86-64-v3]

A level profile (``cpu-fp32-x86-64-v3``) claims that an artifact captured under it grafts
bit-exactly on *any* machine at that level, not only on the CPU model that captured it. One
machine cannot show that alone, so the claim is registered first and checked later:

``register`` runs ``kvgraft exactness`` under the level (the process started with the level's
environment, ``IsaLevel.command_prefix``) into ``results/exactness/MODEL-cpu-fp32-LEVEL/``,
checks it with ``kvgraft-verify exactness`` and leaves the signed record (every sample's prefix
artifact digest and fresh / graft logits SHA-256) without its logits files. Committing it is the
registration: its digests are fixed before any other machine runs.

``replay``, on another machine at the level, reruns the same command (same model, samples, seed,
prefix lengths) into a scratch directory, then

1. copies this machine's logits files beside the *registered* record and runs
   ``kvgraft-verify exactness`` on it: the registered record verifies only if every logits file it
   names is, byte for byte, one this machine computed;
2. compares sample by sample the prefix artifact, fresh logits and graft logits digests of the
   two records;

and writes ``results/exactness/MODEL-cpu-fp32-LEVEL/replays/<UTC time>.json`` with both CPUs, the
counts of equal digests and the verifier's verdict. It exits 1 when any digest differs (the
file says which), so a failed replay is a result, not a crash. Nothing here is the engine: the
verdict is the standalone verifier's.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiment_keys import KVGRAFT, VERIFY, record_predicate, trust_beside

from kvgraft.schemas import LOGITS_DIR, RECORD_FILE

ROOT = Path(__file__).resolve().parent.parent
TRUSTED = ROOT / "results" / "exactness" / "trusted-keys.json"


def log(message: str) -> None:
    sys.stderr.write(f"[level_replay] {message}\n")
    sys.stderr.flush()


def level_environment(level: str) -> dict[str, str]:
    """The environment the level's processes must start with: the engine's own table."""
    from kvgraft.engine import ISA_LEVELS

    if level not in ISA_LEVELS:
        raise SystemExit(f"no instruction-set level {level!r}; known: {', '.join(ISA_LEVELS)}")
    return ISA_LEVELS[level].environment()


def cpu() -> dict[str, Any]:
    """This machine's CPU as the engine reads it (the model name is what the level does not pin)."""
    from kvgraft.engine import cpu_description

    return {"machine": platform.machine(), "host": platform.node(), **cpu_description()}


def exactness(model: str, level: str, samples: int, out: Path, key: Path | None) -> None:
    command = [*KVGRAFT, "exactness", "--model", model, "--samples", str(samples),
               "--profile", f"cpu-fp32-{level}", "--out", str(out)]
    if key is not None:
        command += ["--key", str(key)]
    env = {**os.environ, **level_environment(level)}
    log(" ".join(f"{k}={shlex.quote(v)}" for k, v in level_environment(level).items()) + " " + shlex.join(command))
    subprocess.run(command, env=env, check=True)


def verify(record: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*VERIFY, "exactness", str(record), "--trusted-keys", str(TRUSTED)],
                          capture_output=True, text=True, check=False)


def samples_of(record: Path) -> list[dict[str, Any]]:
    """The record's samples (read only; ``kvgraft-verify`` is what checks the signature)."""
    samples: list[dict[str, Any]] = record_predicate(record)["samples"]
    return samples


def register(args: argparse.Namespace) -> None:
    if args.record.exists():
        raise SystemExit(f"{args.record} exists: a registration is made once (remove it to register again)")
    from kvgraft.engine import ensure_local_key, local_public_key_path

    if args.key is None:
        ensure_local_key()
    # The registering key is trusted beside the records, so an auditor (and the replay) checks it.
    trust_beside(TRUSTED, Path(f"{args.key}.pub") if args.key is not None else local_public_key_path(), "kvgraft-exactness")
    exactness(args.model, args.level, args.samples, args.record, args.key)
    proc = verify(args.record)
    if proc.returncode != 0:
        raise SystemExit(f"the new record does not verify: {proc.stdout}{proc.stderr}")
    # Only the signed record is the registration; the logits files are what a replay recomputes.
    shutil.rmtree(args.record / LOGITS_DIR, ignore_errors=True)
    (args.record / "registered-on.json").write_text(json.dumps(cpu(), indent=2) + "\n")
    log(f"registered {args.record} ({len(samples_of(args.record))} samples); commit it, then replay on another machine")


def replay(args: argparse.Namespace) -> None:
    if not (args.record / RECORD_FILE).exists():
        raise SystemExit(f"no registered record at {args.record}: run `register` on the first machine and commit it")
    registered = samples_of(args.record)
    with tempfile.TemporaryDirectory(prefix="kvgraft-replay-") as tmp:
        rerun = Path(tmp) / "rerun"
        exactness(args.model, args.level, len(registered), rerun, args.key)
        # The registered record, with this machine's logits files beside it.
        check = Path(tmp) / "registered"
        check.mkdir()
        shutil.copy2(args.record / RECORD_FILE, check / RECORD_FILE)
        shutil.copytree(rerun / LOGITS_DIR, check / LOGITS_DIR)
        proc = verify(check)
        fresh = samples_of(rerun)
    fields = ("prefix_artifact", "fresh_logits_sha256", "graft_logits_sha256")
    equal = {f: sum(a[f] == b[f] for a, b in zip(registered, fresh, strict=True)) for f in fields}
    differing = [a["index"] for a, b in zip(registered, fresh, strict=True) if any(a[f] != b[f] for f in fields)]
    result = {
        "record": str(args.record.relative_to(ROOT)),
        "registered_on": json.loads((args.record / "registered-on.json").read_text()),
        "replayed_on": cpu(),
        "samples": len(registered),
        "equal": equal,
        "differing_samples": differing,
        "kvgraft_verify_exactness": {"exit": proc.returncode, "output": (proc.stdout + proc.stderr).strip()[-2000:]},
    }
    # Named by the time: every VM here calls itself "vm"; the CPUs are in the file.
    out = args.record / "replays" / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"{out}: {equal} of {len(registered)} equal; kvgraft-verify exactness exit {proc.returncode}")
    if differing or proc.returncode != 0:
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("register", "replay"))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--level", default="x86-64-v3")
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--key", type=Path, help="signing key (default: the local key under $KVGRAFT_HOME)")
    args = ap.parse_args()
    args.record = ROOT / "results" / "exactness" / f"{args.model}-cpu-fp32-{args.level}"
    register(args) if args.action == "register" else replay(args)


if __name__ == "__main__":
    main()
