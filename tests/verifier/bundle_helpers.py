"""What the Sigstore bundle tests share (test_bundles_*.py, test_cli_bundles.py): where the vectors
are, the EXPECTATIONS.md rows that accept, and small JSON, base64 and mutation helpers."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def sigstore_vectors() -> Path:
    """tests/vectors/sigstore, in the repository (tests/vectors/README.md: source and licence)."""
    path = Path(__file__).resolve().parents[1] / "vectors" / "sigstore"
    if not path.is_dir():
        # A missing fixture is a broken checkout, not a reason to pass quietly.
        raise RuntimeError(f"the Sigstore vectors are not at {path}: they are part of the repository")
    return path


GITHUB_OAUTH = "https://github.com/login/oauth"
GOOGLE = "https://accounts.google.com"
ACTIONS = "https://token.actions.githubusercontent.com"
BEACON = (
    "https://github.com/sigstore-conformance/extremely-dangerous-public-oidc-beacon/"
    ".github/workflows/extremely-dangerous-oidc-beacon.yml@refs/heads/main"
)
# sha256 of sigstore-conformance's a.txt, the subject of the DSSE vector's statement.
A_TXT = "sha256:a0cfc71271d6e278e57cd332ff957c3f7043fdda354c4cbb190a30d56efa01bf"


@dataclass(frozen=True)
class Vector:
    artifact: str  # a file under the vectors, or a sha256: digest
    bundle: str
    staging: bool
    identity: str
    issuer: str

    @property
    def id(self) -> str:
        return self.bundle


# Every "accept" row of tests/vectors/sigstore/EXPECTATIONS.md.
ACCEPT = [
    Vector("bundle.txt", "bundle.txt.sigstore", True, "a@tny.town", GITHUB_OAUTH),
    Vector("bundle_v3.txt", "bundle_v3.txt.sigstore", True, "william@yossarian.net", GITHUB_OAUTH),
    Vector("bundle_v3_alt.txt", "bundle_v3_alt.txt.sigstore", True, "william@yossarian.net", GITHUB_OAUTH),
    Vector(
        "bundle_v3_github.whl",
        "bundle_v3_github.whl.sigstore",
        False,
        "https://github.com/trailofbits/rfc8785.py/.github/workflows/release.yml@refs/tags/v0.1.2",
        ACTIONS,
    ),
    Vector("staging-rekor-v2.txt", "staging-rekor-v2.txt.sigstore.json", True, "jku@goto.fi", GITHUB_OAUTH),
    Vector("tsa/bundle.txt", "tsa/bundle.txt.sigstore", True, "alexis.challande@trailofbits.com", GOOGLE),
    Vector(A_TXT, "a.dsse.staging-rekor-v2.txt.sigstore.json", True, BEACON, ACTIONS),
]


def artifact_of(vectors: Path, vector: Vector) -> Path | str:
    return vector.artifact if vector.artifact.startswith("sha256:") else vectors / vector.artifact


def root_of(vectors: Path, staging: bool) -> Path:
    return vectors / ("trusted_root.sigstage.dev.json" if staging else "trusted_root.sigstore.dev.json")


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def write(path: Path, document: dict[str, Any]) -> Path:
    path.write_text(json.dumps(document))
    return path


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def flip_bit(data: bytes, index: int | None = None) -> bytes:
    i = len(data) // 2 if index is None else index
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]


def flip_b64(value: str) -> str:
    return b64(flip_bit(base64.b64decode(value)))



MutateFn = Callable[[dict[str, Any]], None]


def set_at(path: list[str | int], value: object) -> MutateFn:
    def mutate(document: dict[str, Any]) -> None:
        target: Any = document
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def delete_at(path: list[str | int]) -> MutateFn:
    def mutate(document: dict[str, Any]) -> None:
        target: Any = document
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


ENTRY: list[str | int] = ["verificationMaterial", "tlogEntries", 0]

