"""ECDSA P-256 and P-384 publisher keys: registered with ``kvgraft key add``, bound to a token,
accepted when they sign, named on the signature status; other curves refused; the log key stays Ed25519."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from kvgraft.cli import main
from kvgraft.registry._internal.http import signatures
from kvgraft.schemas import sha256_bytes
from kvgraft.verifier import KeyType, key_type_of, keyid_of, parse_public_key, save_private_key
from kvgraft.verifier._internal.tlog import hash_leaf, verify_checkpoint, verify_inclusion

from .conftest import Key, artifact, free_port, harness, make_key, registry_cli


@pytest.mark.parametrize(("key_type", "label"), [("p256", "ECDSA P-256"), ("p384", "ECDSA P-384")])
def test_an_ecdsa_publisher_key_registers_and_publishes(
    tmp_path: Path, keys: dict[str, Key], capsys: pytest.CaptureFixture[str], key_type: KeyType, label: str
) -> None:
    carol = make_key(tmp_path, "carol", key_type)
    data = tmp_path / "data"
    # Registered the operator's way, with the server stopped: `kvgraft key add`.
    assert main(["--json", "key", "add", "--data", str(data), "--publisher", "carol", "--public-key", str(carol.pub_path)]) == 0
    added: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert added["created"] is True and added["keyid"] == keyid_of(carol.private.public_key())

    with harness(data, keys) as reg:
        reg.tokens["carol"] = reg.make_token("carol", carol)[0]
        art = artifact(f"signed with {key_type}")
        assert reg.put_blob(art.tensors, "carol").status_code == 201
        envelope = carol.sign(art.statement)
        r = reg.publish(envelope, "carol")
        assert r.status_code == 201, r.text
        doc = r.json()
        assert doc["entry"]["publisher"] == "carol"
        assert doc["entry"]["keyids"] == [added["keyid"]]
        assert doc["entry"]["digest"] == sha256_bytes(envelope)

        # The log that records it is still signed with the registry's Ed25519 key.
        log_key = reg.client.get("/v1/log/key").json()
        public = parse_public_key(log_key["public_key_pem"].encode())
        assert key_type_of(public) == "ed25519"
        head = verify_checkpoint(doc["checkpoint"].encode(), log_key["origin"], public, origin=log_key["origin"])  # type: ignore[arg-type]
        proof = doc["inclusion_proof"]
        verify_inclusion(hash_leaf(envelope), proof["log_index"], head.size, [bytes.fromhex(h) for h in proof["hashes"]], head.root_hash)

        # The provenance pages' status names the key and its type.
        status = signatures.signature_status(reg.client.app.state.registry, envelope, "carol")
        assert status.verified and status.signers == [{"name": "carol", "keyid": added["keyid"]}]
        assert f"carol's registered key {added['keyid'][:16]}" in status.message and f"({label})" in status.message

        # The publishers listing serves the key's PEM as registered.
        listed = {p["name"]: p for p in reg.client.get("/v1/publishers").json()["publishers"]}
        assert [k["keyid"] for k in listed["carol"]["keys"]] == [added["keyid"]]
        assert keyid_of(parse_public_key(listed["carol"]["keys"][0]["public_key_pem"].encode())) == added["keyid"]


@pytest.mark.parametrize("curve", [ec.SECP521R1(), ec.SECP256K1()], ids=["secp521r1", "secp256k1"])
def test_other_curves_are_refused_as_publisher_keys(tmp_path: Path, keys: dict[str, Key], curve: ec.EllipticCurve) -> None:
    pem = ec.generate_private_key(curve).public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()
    with harness(tmp_path / "data", keys) as reg:
        r = reg.admin("POST", "/v1/admin/keys", {"publisher": "carol", "public_key_pem": pem})
        assert r.status_code == 400, r.text
        problem = r.json()
        assert f"an ECDSA key on curve {curve.name}" in problem["detail"]
        assert "Ed25519, ECDSA P-256 (secp256r1) or ECDSA P-384 (secp384r1)" in problem["detail"]


def test_an_ecdsa_registry_key_is_refused_at_start(tmp_path: Path) -> None:
    """Checkpoints are C2SP signed notes: ``kvgraft serve`` refuses a registry key that is not Ed25519."""
    data = tmp_path / "data"
    data.mkdir()
    save_private_key(ec.generate_private_key(ec.SECP256R1()), data / "registry-key.pem")
    done = registry_cli("serve", "--data", data, "--port", free_port(), "--log-level", "warning")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"kvgraft: DataDirError: the registry key {data / 'registry-key.pem'} cannot be loaded: ")
    assert "it is an ECDSA P-256 key; C2SP signed notes (a registry's checkpoints) are signed with Ed25519 keys only" in done.stderr
    assert "--type ed25519" in done.stderr
