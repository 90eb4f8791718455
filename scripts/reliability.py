"""``make reliability``: the heavy reliability run, then its figures.

Runs tests/reliability with KVGRAFT_RELIABILITY=heavy (more hypothesis examples, 50 kill -9
crash rounds, 60 s of load with 32 clients), collects the figures the tests recorded, prints
them and writes them to reliability-results.json (gitignored). Exits with pytest's status.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Beside the repository root, gitignored: a run's figures are evidence for a report, not source.
DEFAULT_OUT = REPO / "reliability-results.json"

SECTIONS = {
    "test_hostile_parsers": "hostile inputs, offline parsers",
    "test_hostile_http": "hostile inputs, HTTP against a running server",
    "test_regressions": "regressions",
    "test_tamper": "tamper matrix",
    "test_crash": "crash safety",
    "test_load": "load",
    "test_access": "access",
    "test_ratelimit": "rate limiter",
}


def _outcomes(junit: Path) -> dict[str, dict[str, int]]:
    """Per test module: passed, failed (failures and errors), skipped."""
    out: dict[str, dict[str, int]] = {}
    if not junit.exists():
        return out
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        counts = out.setdefault(module, {"passed": 0, "failed": 0, "skipped": 0})
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return out


def _report(figures: dict[str, Any], outcomes: dict[str, dict[str, int]], seconds: float) -> list[str]:
    def failed(module: str) -> int:
        return outcomes.get(module, {}).get("failed", 0)

    lines = [f"reliability run ({figures.get('scale', {}).get('name', '?')}), {seconds:.0f} s"]
    parsers = figures.get("parsers", {})
    http = figures.get("http", {})
    lines.append(f"hostile inputs: {sum(parsers.values()) + sum(http.values())} tried, "
                 f"{failed('test_hostile_parsers') + failed('test_hostile_http')} crashes (a crash is any answer but a named error or a 4xx)")
    for name, n in sorted(parsers.items()):
        lines.append(f"  parser {name:<22} {n:>7} inputs")
    for name, n in sorted(http.items()):
        lines.append(f"  http   {name:<22} {n:>7} inputs")
    t = figures.get("tamper", {})
    lines.append(f"tamper matrix: {t.get('refused', 0)} refused of {t.get('tried', 0)} tried "
                 f"(pull {t.get('pull_refused', 0)}, kvgraft graft {t.get('graft_refused', 0)}, kvgraft-verify {t.get('verify_refused', 0)})")
    # The crash and load suites run on each metadata backend: DuckDB ("crash", "load") and PostgreSQL.
    for suffix, backend in (("", ""), ("-postgres", " (PostgreSQL)")):
        c = figures.get("crash" + suffix)
        if c is not None:
            lines.append(f"crash safety{backend}: {c.get('rounds', 0)} kill -9 rounds survived, {c.get('writes_started', 0)} concurrent writes started, "
                         f"{c.get('acked_blobs', 0)} blob and {c.get('acked_entries', 0)} entry writes acknowledged, {c.get('lost', '?')} lost, "
                         f"{c.get('partial_blobs_visible', '?')} partial blobs visible, {c.get('consistency_proofs_verified', 0)} consistency proofs verified "
                         f"(log size {c.get('tree_size', '?')})")
        ld = figures.get("load" + suffix)
        if ld is not None:
            lines.append(f"load{backend}: {ld.get('clients', '?')} clients for {ld.get('seconds', '?')} s: {ld.get('requests', 0)} requests, "
                         f"{ld.get('errors', '?')} errors, {ld.get('publishes', 0)} entries published, {ld.get('lost_entries', '?')} lost; "
                         f"{ld.get('throughput_rps', '?')} req/s, {ld.get('publishes_per_s', '?')} publishes/s; "
                         f"latency p50 {ld.get('p50_ms', '?')} ms, p99 {ld.get('p99_ms', '?')} ms (publish p50 {ld.get('publish_p50_ms', '?')} ms, "
                         f"p99 {ld.get('publish_p99_ms', '?')} ms)")
    a = figures.get("access", {})
    lines.append(f"access: key-scoped tokens refused {a.get('scoped_tokens_refused', 0)}/accepted {a.get('scoped_tokens_accepted', 0)}; "
                 f"revocation on the next request: {a.get('revoked_refused_on_next_request', False)}; rate limit {a.get('rate_limit', '?')} -> "
                 f"{a.get('rate_limited_status', '?')} with Retry-After {a.get('retry_after_s', '?')} s; {a.get('secrets_checked', 0)} secrets, "
                 f"{a.get('secrets_in_log', '?')} in {a.get('log_lines_scanned', 0)} log lines; security headers on "
                 f"{a.get('security_headers_checked_responses', 0)} responses (statuses {a.get('security_headers_statuses', [])})")
    for module, title in SECTIONS.items():
        o = outcomes.get(module)
        if o:
            lines.append(f"  tests {title}: {o['passed']} passed, {o['failed']} failed, {o['skipped']} skipped")
    return lines


def main() -> int:
    """Run the heavy tests, print the figures, write the JSON; return pytest's exit status."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where the JSON goes (default {DEFAULT_OUT.relative_to(REPO)})")
    parser.add_argument("--bounded", action="store_true", help="the make-test scale instead of the heavy one")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (e.g. -k crash)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvgraft-reliability-") as tmp:
        figures_file, junit = Path(tmp) / "figures.json", Path(tmp) / "junit.xml"
        env = {**os.environ, "KVGRAFT_RELIABILITY": "bounded" if args.bounded else "heavy", "KVGRAFT_RELIABILITY_OUT": str(figures_file)}
        started = time.monotonic()
        status = subprocess.call(
            [sys.executable, "-m", "pytest", "tests/reliability", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *args.pytest_args],
            cwd=REPO, env=env,
        )
        seconds = time.monotonic() - started
        figures = json.loads(figures_file.read_text()) if figures_file.exists() else {}
        outcomes = _outcomes(junit)
    lines = _report(figures, outcomes, seconds)
    print("\n".join(lines))
    document = {
        "kind": "kvgraft-reliability", "created": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "pytest_exit_status": status, "seconds": round(seconds, 1), "figures": figures, "tests": outcomes, "summary": lines,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n")
    print(f"figures written to {args.out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
