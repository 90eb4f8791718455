"""Hostile input, property-based, against every parser a stranger can reach without a server.

Each property feeds generated or mutated inputs to one parser and accepts exactly two outcomes:
the input is refused with the package's own named error, or it is accepted and then means the
same as the original (a mutation that still verifies must not have changed what was signed).
Any other exception fails the property. The number of inputs tried goes into the figures.
"""

from __future__ import annotations

import base64
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgraft.engine import KvFileError
from kvgraft.engine._internal.kvfile import MAX_HEADER, deserialize
from kvgraft.registry import RegistryError
from kvgraft.registry._internal.entries import decode_envelope, index_statement, verify_for_token
from kvgraft.schemas import DocumentError, parse_statement
from kvgraft.verifier import (
    Checkpoint,
    TrustedKeys,
    VerificationError,
    b64decode_any,
    ephemeral_signing_key,
    parse_envelope,
    sign_checkpoint,
    trusted_key,
    verify_checkpoint,
    verify_envelope,
    verify_statement_envelope,
)
from kvgraft.verifier._internal.bundles import CertificateIdentity, verify_bundle
from tests.registry.conftest import Key, artifact
from tests.reliability.conftest import Figures, Scale
from tests.reliability.hostile import JSON_VALUES, mutated_b64_field, mutated_json

VECTORS = Path(__file__).resolve().parents[1] / "vectors"

# Each property reads the scale from the fixture; hypothesis' own example budget is set per test.
_RELAXED = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large]


def _settings(scale: Scale) -> settings:
    return settings(max_examples=scale.parser_examples, deadline=None, suppress_health_check=_RELAXED, database=None)


# --- safetensors -------------------------------------------------------------------------------

_DTYPES = st.one_of(st.sampled_from(["F32", "F16", "BF16", "I64", "I32", "F64", "U8", "f32", ""]), JSON_VALUES)
_DIMS = st.one_of(st.integers(min_value=0, max_value=8), st.sampled_from([-1, 2**40, 2**63, 2**64, 10**30]))
_OFFSETS = st.one_of(
    st.lists(st.integers(min_value=-4, max_value=200), min_size=2, max_size=2),
    st.lists(st.sampled_from([0, 4, 2**63, 2**64, -(2**63)]), min_size=0, max_size=3),
    JSON_VALUES,
)
_TENSOR = st.one_of(
    st.fixed_dictionaries({"dtype": _DTYPES, "shape": st.one_of(st.lists(_DIMS, max_size=4), JSON_VALUES), "data_offsets": _OFFSETS}),
    JSON_VALUES,
)


@st.composite
def safetensors_files(draw: st.DrawFn) -> bytes:
    names = draw(st.lists(st.one_of(st.text(max_size=6), st.just("__metadata__")), max_size=5))
    members = [json.dumps(n) + ":" + json.dumps(draw(_TENSOR)) for n in names]
    if names and draw(st.booleans()):
        members.append(json.dumps(names[0]) + ":" + json.dumps(draw(_TENSOR)))  # a duplicate name
    header = ("{" + ",".join(members) + "}").encode()
    if draw(st.booleans()):
        header = draw(st.sampled_from([b"[" * 5000 + b"]" * 5000, b"[]", b"null", b"\xff\xfe", b'{"a":1e999}', header + b"x"]))
    body = draw(st.binary(max_size=256))
    declared = draw(st.one_of(st.just(len(header)), st.sampled_from([0, 1, 7, len(header) + 1, MAX_HEADER + 1, 2**63, 2**64 - 1])))
    data = struct.pack("<Q", declared) + header + body
    if draw(st.booleans()):
        data = data[: draw(st.integers(min_value=0, max_value=len(data)))]
    return data


def test_safetensors_headers(scale: Scale, figures: Figures) -> None:
    @_settings(scale)
    @given(data=safetensors_files())
    def prop(data: bytes) -> None:
        figures.count("parsers", "safetensors")
        try:
            tensors, _ = deserialize(data, source="hostile kv file")
        except KvFileError as e:
            assert e.message.startswith("hostile kv file") or "hostile kv file" in e.message
            return
        # Accepted: the tensors tile the body exactly.
        (n,) = struct.unpack("<Q", data[:8])
        assert sum(t.numel() * t.element_size() for t in tensors.values()) == len(data) - 8 - n

    prop()


# --- statements --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def signed(rkeys: dict[str, Key]) -> dict[str, Any]:
    """One real signed KV artifact statement: its envelope bytes, document and payload."""
    envelope = rkeys["alice"].sign(artifact("hostile input").statement)
    doc = json.loads(envelope)
    return {"envelope": envelope, "doc": doc, "payload": base64.b64decode(doc["payload"])}


def test_statements(scale: Scale, figures: Figures, signed: dict[str, Any]) -> None:
    original = json.loads(signed["payload"])

    @_settings(scale)
    @given(payload=mutated_json(original))
    def prop(payload: bytes) -> None:
        figures.count("parsers", "statement")
        try:
            parse_statement(payload, what="hostile statement")
        except DocumentError as e:
            assert "hostile statement" in str(e)

    prop()


# --- DSSE envelopes ----------------------------------------------------------------------------


def test_dsse_envelopes(scale: Scale, figures: Figures, signed: dict[str, Any], rkeys: dict[str, Key]) -> None:
    trusted = TrustedKeys((trusted_key("alice", rkeys["alice"].private.public_key()),))

    @_settings(scale)
    @given(data=st.one_of(mutated_json(signed["doc"]), mutated_b64_field(signed["doc"])))
    def prop(data: bytes) -> None:
        figures.count("parsers", "dsse_envelope")
        try:
            verified, _ = verify_statement_envelope(parse_envelope(data, source="hostile envelope"), trusted)
        except VerificationError:
            return
        # Still verifies: then it must carry exactly what alice signed.
        assert verified.payload == signed["payload"]

    prop()


def test_dsse_vectors_mutated(scale: Scale, figures: Figures) -> None:
    spec = json.loads((VECTORS / "dsse" / "vectors.json").read_text())
    keys = {
        name: trusted_key(name, Ed25519PrivateKey.from_private_bytes(bytes.fromhex(k["seed"])).public_key())
        for name, k in spec["keys"].items()
    }
    accepting = [v for v in spec["vectors"] if v["expect"] == "accept"]
    assert accepting, "the DSSE vectors have no accepting case to mutate"

    @_settings(scale)
    @given(st.data())
    def prop(data: st.DataObject) -> None:
        vector = data.draw(st.sampled_from(accepting))
        raw = data.draw(mutated_json(vector["envelope"]))
        trusted = TrustedKeys(
            tuple(keys[k] for k in vector["trustedKeys"]), threshold=vector["threshold"],
            payload_types=tuple(vector["supportedPayloadTypes"]),
        )
        figures.count("parsers", "dsse_vectors")
        try:
            verified = verify_envelope(parse_envelope(raw, source="hostile vector"), trusted)
        except VerificationError:
            return
        assert verified.payload == b64decode_any(vector["envelope"]["payload"], what="the vector's payload")

    prop()


# --- Sigstore bundles --------------------------------------------------------------------------

_BUNDLES = [
    ("bundle.txt", "bundle.txt.sigstore", "a@tny.town", "https://github.com/login/oauth"),
    ("staging-rekor-v2.txt", "staging-rekor-v2.txt.sigstore.json", "jku@goto.fi", "https://github.com/login/oauth"),
]


def test_sigstore_bundles_mutated(scale: Scale, figures: Figures, tmp_path_factory: pytest.TempPathFactory) -> None:
    root = VECTORS / "sigstore"
    staging = root / "trusted_root.sigstage.dev.json"
    work = tmp_path_factory.mktemp("bundles")
    originals = {b: json.loads((root / b).read_text()) for _, b, _, _ in _BUNDLES}
    baseline = {
        b: verify_bundle(root / b, root / a, CertificateIdentity(i, iss), trusted_root=staging) for a, b, i, iss in _BUNDLES
    }

    @_settings(scale)
    @given(st.data())
    def prop(data: st.DataObject) -> None:
        art, name, identity, issuer = data.draw(st.sampled_from(_BUNDLES))
        path = work / "bundle.json"
        path.write_bytes(data.draw(st.one_of(mutated_json(originals[name]), mutated_b64_field(originals[name]))))
        figures.count("parsers", "sigstore_bundle")
        try:
            result = verify_bundle(path, root / art, CertificateIdentity(identity, issuer), trusted_root=staging)
        except VerificationError:
            return
        assert result == baseline[name]

    prop()


# --- the registry's publish pipeline, without HTTP ---------------------------------------------


def test_registry_envelope_pipeline(scale: Scale, figures: Figures, signed: dict[str, Any], rkeys: dict[str, Key]) -> None:
    alice = trusted_key("alice/x", rkeys["alice"].private.public_key())
    bob = trusted_key("bob/x", rkeys["bob"].private.public_key())
    registered = {alice.keyid: (alice, "alice"), bob.keyid: (bob, "bob")}

    @_settings(scale)
    @given(body=st.one_of(mutated_json(signed["doc"]), mutated_b64_field(signed["doc"]), st.binary(max_size=200)))
    def prop(body: bytes) -> None:
        figures.count("parsers", "registry_pipeline")
        try:
            verified, statement = verify_for_token(decode_envelope(body), [alice], registered)
            index_statement(statement)
        except RegistryError as e:
            assert 400 <= e.status_code < 500, e
            return
        assert verified.payload == signed["payload"]

    prop()


# --- signed checkpoints ------------------------------------------------------------------------


def test_checkpoints(scale: Scale, figures: Figures) -> None:
    key = Ed25519PrivateKey.generate()
    checkpoint = Checkpoint("example.com/log", 12, bytes(range(32)))
    with ephemeral_signing_key(key) as signer:
        note = sign_checkpoint(checkpoint, "example.com/log", signer)

    @_settings(scale)
    @given(st.data())
    def prop(data: st.DataObject) -> None:
        i = data.draw(st.integers(min_value=0, max_value=len(note) - 1))
        how = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if how == "flip":
            damaged = note[:i] + bytes([note[i] ^ data.draw(st.integers(1, 255))]) + note[i + 1 :]
        elif how == "cut":
            damaged = note[:i] + note[i + data.draw(st.integers(1, 8)) :]
        else:
            damaged = note[:i] + data.draw(st.binary(min_size=1, max_size=8)) + note[i:]
        figures.count("parsers", "checkpoint")
        try:
            got = verify_checkpoint(damaged, "example.com/log", key.public_key())
        except VerificationError:
            return
        assert got == checkpoint

    prop()
