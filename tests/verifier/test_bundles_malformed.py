"""Sigstore bundle verification, offline: malformed bundles, inputs and trusted roots are refused
with one MalformedInputError or UntrustedRootError line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvgraft.verifier._internal.bundles import (
    CertificateIdentity,
    VerifiedBundle,
    verify_bundle,
)
from kvgraft.verifier._internal.errors import (
    MalformedInputError,
    UntrustedRootError,
)

from .bundle_helpers import (
    ENTRY,
    GITHUB_OAUTH,
    MutateFn,
    b64,
    delete_at,
    load,
    root_of,
    set_at,
    sigstore_vectors,
    write,
)


@pytest.fixture(scope="module")
def vectors() -> Path:
    """tests/vectors/sigstore (the root conftest's ``vectors`` is the whole tests/vectors)."""
    return sigstore_vectors()


# --------------------------------------------------------------------------------------------
# Malformed inputs
# --------------------------------------------------------------------------------------------


@pytest.fixture()
def good_bundle(vectors: Path) -> dict[str, Any]:
    return load(vectors / "bundle_v3.txt.sigstore")


def _verify_v3(vectors: Path, bundle: Path, artifact: Path | str | None = None) -> VerifiedBundle:
    return verify_bundle(
        bundle,
        artifact if artifact is not None else vectors / "bundle_v3.txt",  # type: ignore[arg-type]
        CertificateIdentity("william@yossarian.net", GITHUB_OAUTH),
        staging=True,
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"this is not json", "is not valid JSON"),
        (b"[1, 2, 3]", "must be a JSON object, got list"),
        (b"\xff\xfe\x00", "not UTF-8|not valid JSON"),
        (b"", "is not valid JSON"),
    ],
)
def test_malformed_bundle_bytes(vectors: Path, tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "bundle.json"
    path.write_bytes(content)
    with pytest.raises(MalformedInputError, match=message):
        _verify_v3(vectors, path)


def test_truncated_bundle(vectors: Path, tmp_path: Path) -> None:
    raw = (vectors / "bundle_v3.txt.sigstore").read_bytes()
    path = tmp_path / "bundle.json"
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(MalformedInputError, match="is not valid JSON"):
        _verify_v3(vectors, path)


def test_bundle_json_regression_duplicate_keys_were_accepted(vectors: Path, tmp_path: Path) -> None:
    """Was: the bundle reader had its own JSON parser, which took the last of two equal keys, so a
    bundle could read one way here and another way to a first-key reader. Now it is the one strict
    parser (``kvgraft.schemas.parse_json``), which refuses duplicate keys, for bundles and roots."""
    raw = (vectors / "bundle_v3.txt.sigstore").read_bytes()
    assert raw.startswith(b"{")
    # The bundle's own mediaType comes second and would win under the old last-key-wins reading.
    doubled = tmp_path / "bundle.json"
    doubled.write_bytes(b'{"mediaType": "application/x-not-a-bundle", ' + raw[1:])
    with pytest.raises(MalformedInputError, match=r"^bundle .*bundle\.json: duplicate key 'mediaType' in JSON object"):
        _verify_v3(vectors, doubled)

    root = root_of(vectors, True).read_bytes()
    doubled_root = tmp_path / "root.json"
    doubled_root.write_bytes(b'{"tlogs": [], ' + root.lstrip()[1:])
    with pytest.raises(MalformedInputError, match=r"^trusted root .*root\.json: duplicate key 'tlogs' in JSON object"):
        verify_bundle(
            vectors / "bundle_v3.txt.sigstore",
            vectors / "bundle_v3.txt",
            CertificateIdentity("william@yossarian.net", GITHUB_OAUTH),
            trusted_root=doubled_root,
        )



@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (set_at(["mediaType"], 3), "mediaType must be a string"),
        (delete_at(["verificationMaterial"]), "verificationMaterial is missing"),
        (set_at(["verificationMaterial"], []), "verificationMaterial must be an object"),
        (set_at(["messageSignature", "signature"], "not*base64!"), "signature is not valid base64"),
        (set_at(["messageSignature", "signature"], 12), "signature must be a string"),
        (set_at(["messageSignature", "signature"], "QUJDR"), "signature is not valid base64"),
        (set_at([*ENTRY, "logIndex"], "-5"), "logIndex is out of range"),
        (set_at([*ENTRY, "logIndex"], "twelve"), "logIndex must be an integer"),
        (set_at([*ENTRY, "logIndex"], True), "logIndex must be an integer"),
        (set_at([*ENTRY, "canonicalizedBody"], "%%%"), "canonicalizedBody is not valid base64"),
        (set_at([*ENTRY, "inclusionProof", "hashes"], "abc"), "hashes must be a list"),
        (set_at(["verificationMaterial", "tlogEntries"], {}), "tlogEntries must be a list"),
        (set_at(["verificationMaterial", "certificate", "rawBytes"], b64(b"not a certificate")), "not a DER X.509"),
        (set_at(["dsseEnvelope"], {"payload": "", "payloadType": "x", "signatures": []}), "exactly one of"),
        (delete_at(["messageSignature"]), "exactly one of messageSignature or dsseEnvelope"),
        (set_at(["verificationMaterial", "publicKey"], {"hint": "abc"}), "exactly one of certificate"),
    ],
)
def test_malformed_bundle_fields(
    vectors: Path, tmp_path: Path, good_bundle: dict[str, Any], mutate: MutateFn, message: str
) -> None:
    mutate(good_bundle)
    with pytest.raises(MalformedInputError, match=message):
        _verify_v3(vectors, write(tmp_path / "bundle.json", good_bundle))


def test_directory_and_missing_inputs(vectors: Path, tmp_path: Path) -> None:
    with pytest.raises(MalformedInputError, match="is a directory, not a file"):
        _verify_v3(vectors, tmp_path)
    with pytest.raises(MalformedInputError, match="bundle .*missing.json does not exist"):
        _verify_v3(vectors, tmp_path / "missing.json")
    with pytest.raises(MalformedInputError, match="artifact .* is a directory"):
        _verify_v3(vectors, vectors / "bundle_v3.txt.sigstore", tmp_path)
    with pytest.raises(MalformedInputError, match="cannot read the artifact"):
        _verify_v3(vectors, vectors / "bundle_v3.txt.sigstore", tmp_path / "missing.txt")
    with pytest.raises(MalformedInputError, match="is not a sha256 digest"):
        _verify_v3(vectors, vectors / "bundle_v3.txt.sigstore", "sha256:abc")


def test_malformed_trusted_root(vectors: Path, tmp_path: Path) -> None:
    bad = tmp_path / "root.json"
    bad.write_text("{")
    with pytest.raises(MalformedInputError, match="trusted root .* is not valid JSON"):
        verify_bundle(
            vectors / "bundle_v3.txt.sigstore",
            vectors / "bundle_v3.txt",
            CertificateIdentity("william@yossarian.net", GITHUB_OAUTH),
            trusted_root=bad,
        )
    root = load(root_of(vectors, True))
    del root["tlogs"][0]["publicKey"]["validFor"]["start"]
    with pytest.raises(UntrustedRootError, match="validFor without a start"):
        verify_bundle(
            vectors / "bundle_v3.txt.sigstore",
            vectors / "bundle_v3.txt",
            CertificateIdentity("william@yossarian.net", GITHUB_OAUTH),
            trusted_root=write(bad, root),
        )
    with pytest.raises(UntrustedRootError, match="not a Sigstore trusted root"):
        verify_bundle(
            vectors / "bundle_v3.txt.sigstore",
            vectors / "bundle_v3.txt",
            CertificateIdentity("william@yossarian.net", GITHUB_OAUTH),
            trusted_root=write(bad, {"mediaType": "something else"}),
        )


