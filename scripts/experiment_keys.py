"""What the experiment scripts share about their signed records, in one place: the commands
that make and check them, their signing keys (each records directory trusts, in its own
``trusted-keys.json``, every key that signed a record in it, so an auditor checks them offline)
and reading a record's predicate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

#: The command line of this interpreter's kvgraft and kvgraft-verify.
KVGRAFT = [sys.executable, "-m", "kvgraft"]
VERIFY = [str(Path(sys.executable).parent / "kvgraft-verify")]


def record_predicate(record: Path) -> dict[str, Any]:
    """The predicate of the signed record in directory ``record``, read only: ``kvgraft-verify``
    is what checks its signature, so nothing read here is trusted until it has."""
    from kvgraft.schemas import RECORD_FILE, payload_unverified

    return json.loads(payload_unverified((record / RECORD_FILE).read_bytes()))["predicate"]


def trust_beside(trusted_file: Path, public_key: Path, name: str) -> None:
    """Add ``public_key`` (a PEM file) to ``trusted_file`` unless it is there already.

    A key made on another machine (a later session's) is added under a name of its own
    (``NAME-2``, ``NAME-3``...), so that the records the earlier keys signed keep verifying.
    """
    public = public_key.read_text().strip()
    entries = json.loads(trusted_file.read_text())["keys"] if trusted_file.exists() else []
    if any(e["public_key_pem"].strip() == public for e in entries):
        return
    named = name if not entries else f"{name}-{len(entries) + 1}"
    subprocess.run([*KVGRAFT, "keys", "trust", "--file", str(trusted_file), "--name", named, "--public-key", str(public_key)],
                   check=True)
