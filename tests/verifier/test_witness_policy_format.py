"""Witness policies in transparency-dev's format (Tessera's ``NewWitnessGroupFromPolicy``, the
c2sp.org/tlog-policy lines): the policies of Tessera's own tests (``tests/vectors/witness-policy``,
copied unmodified, SOURCE.md) are read; the policy docs/witness.md shows and the line
``kvgraft witness key --url`` writes are ones Tessera's parser takes (a URL on every witness line).

The bug: docs/witness.md wrote ``witness NAME VKEY`` lines without a URL, which Tessera's parser
refuses ("invalid witness definition"); and kvgraft refused Tessera's policies: trailing comments,
and witnesses named by their type-0x01 vkeys.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgraft.cli import main as kvgraft_main
from kvgraft.verifier import (
    Checkpoint,
    WitnessKey,
    WitnessPolicyError,
    cosign,
    ephemeral_signing_key,
    format_vkey,
    parse_signed_note,
    parse_witness_policy,
    save_private_key,
    sign_checkpoint,
    verify_witnessed,
)

REPO = Path(__file__).resolve().parents[2]
VECTORS = REPO / "tests" / "vectors" / "witness-policy"
#: Tessera's rule for a witness line (witness.go): exactly four fields, the last a URL.
TESSERA_WITNESS_FIELDS = 4
TESSERA_KEYWORDS = {"witness", "group", "any", "all", "none", "quorum", "log"}


def _tessera_takes(policy: str) -> None:
    """What Tessera's ``NewWitnessGroupFromPolicy`` checks of each line's shape (its source, witness.go,
    at the commit SOURCE.md names): a comment runs from '#'; a witness line has 4 fields; no name is a keyword."""
    for raw in policy.splitlines():
        fields = raw.partition("#")[0].split()
        if not fields:
            continue
        assert fields[0] in {"log", "witness", "group", "quorum"}, raw
        if fields[0] == "witness":
            assert len(fields) == TESSERA_WITNESS_FIELDS, f"Tessera refuses (invalid witness definition): {raw!r}"
        if fields[0] in ("witness", "group"):
            assert fields[1] not in TESSERA_KEYWORDS, raw


@pytest.mark.parametrize("name", ["tidy.policy", "whitespace-and-comments.policy"])
def test_transparency_dev_format_regression_tesseras_own_policies_are_read(name: str) -> None:
    policy = parse_witness_policy((VECTORS / name).read_bytes(), source=name)
    assert policy.describe() == "group g1 = all of (w1, w2)" and policy.min_cosignatures() == 2
    # Tessera's witnesses are named by type-0x01 vkeys: their cosignatures are checked as type 0x04,
    # under the key ID SHA-256(name || 0x0A || 0x04 || key)[:4] (formats' NewVerifierForCosignatureV1).
    given = re.findall(r"witness\s+\S+\s+(\S+)", (VECTORS / name).read_text())
    want = []
    for vkey in given:
        key_name, _, material = vkey.split("+", 2)
        raw = base64.b64decode(material)
        assert raw[0] == 0x01
        cosigner = bytes([4]) + raw[1:]
        key_id = hashlib.sha256(key_name.encode() + b"\n" + cosigner).digest()[:4].hex()
        want.append(f"{key_name}+{key_id}+{base64.b64encode(cosigner).decode()}")
    assert [k.vkey for k in policy.keys()] == want


def test_one_key_under_two_names_in_tesseras_group_tests_is_refused() -> None:
    # Tessera's GroupN tests list one key as w2 and w3: it would count twice towards a threshold.
    with pytest.raises(WitnessPolicyError, match="^group-all.policy line 4: witness 'w3' has the same key as witness 'w2'"):
        parse_witness_policy((VECTORS / "group-all.policy").read_bytes(), source="group-all.policy")


def test_a_witness_named_by_its_type_1_vkey_counts_its_cosignature() -> None:
    log, witness = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    with ephemeral_signing_key(log) as k:
        note = sign_checkpoint(Checkpoint("example.com/log", 3, b"\x01" * 32), "example.com/log", k)
    with ephemeral_signing_key(witness) as k:
        line = cosign(parse_signed_note(note).text, "witness.example/w", k)
    vkey1 = format_vkey("witness.example/w", witness.public_key())  # type 0x01, as witnesses publish theirs
    policy = parse_witness_policy(f"witness w {vkey1} https://witness.example/w  # its note key\nquorum w\n".encode())
    assert policy.keys() == [WitnessKey("witness.example/w", witness.public_key())]
    assert list(verify_witnessed(note + line, "example.com/log", log.public_key(), policy).cosigners) == ["w"]


def test_the_policy_docs_witness_md_shows_is_one_tesseras_parser_takes() -> None:
    docs = (REPO / "docs" / "witness.md").read_text()
    section = docs[docs.index("## The witness policy"):]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block is not None
    example = block.group(1)
    _tessera_takes(example)
    assert "witness a " in example
    # The docs elide keys ("..."): put real ones in their place, then kvgraft reads it too.
    keys = iter(WitnessKey(f"witness.example/{n}", Ed25519PrivateKey.generate().public_key()).vkey for n in "ab")
    filled = re.sub(r"witness\.example/[ab]\+\S+", lambda m: next(keys), example)
    assert parse_witness_policy(filled.encode()).describe() == "group honest = 1 of (a, b)"


def test_kvgraft_witness_key_url_writes_a_line_both_parsers_take(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pem = tmp_path / "w.pem"
    save_private_key(Ed25519PrivateKey.generate(), pem)
    argv = ["--json", "witness", "key", "--key", str(pem), "--name", "witness.example/a"]
    assert kvgraft_main([*argv, "--url", "http://127.0.0.1:8001"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy_line"] == f"witness witness.example/a {out['vkey']} http://127.0.0.1:8001" == out["summary"]
    _tessera_takes(out["policy_line"])
    assert parse_witness_policy(f"{out['policy_line']}\nquorum witness.example/a\n".encode()).min_cosignatures() == 1
    assert kvgraft_main([*argv, "--url", "witness.example/a"]) == 1
    err = capsys.readouterr().err
    assert "WitnessPolicyError" in err and "URL 'witness.example/a' is not an http:// or https:// URL" in err
