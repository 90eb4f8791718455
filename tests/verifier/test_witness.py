"""Witness cosignatures (c2sp.org/tlog-cosignature), witness policies (c2sp.org/tlog-policy), and
``kvgraft-verify log --witness-policy``.

The cosignature layout is checked byte by byte against the spec with ``cryptography`` alone, and
against the spec's own example line; Go's ``golang.org/x/mod/sumdb/note`` (Debian's
golang-golang-x-mod-dev, when ``go`` is installed) opens a witnessed note with only the log's
key, and verifies the cosignature with a cosignature/v1 verifier written in Go from the spec.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import struct
import subprocess
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from kvgraft.verifier import (
    Checkpoint,
    CosignatureError,
    MalformedInputError,
    WitnessKey,
    WitnessPolicyError,
    WitnessQuorumError,
    cosign,
    ephemeral_signing_key,
    format_vkey,
    format_witness_vkey,
    load_witness_policy,
    open_cosignatures,
    parse_signed_note,
    parse_witness_policy,
    parse_witness_vkey,
    save_public_key,
    sign_checkpoint,
    verify_checkpoint,
    verify_witnessed,
)
from kvgraft.verifier.cli import main as verify_main

ORIGIN = "example.com/log"
ROOT = hashlib.sha256(b"a root").digest()


def _raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


class Log:
    """A log key, three witness keys, and a signed checkpoint of size 7."""

    def __init__(self) -> None:
        self.key = Ed25519PrivateKey.generate()
        self.witnesses = {name: Ed25519PrivateKey.generate() for name in ("w1", "w2", "w3")}
        self.checkpoint = Checkpoint(ORIGIN, 7, ROOT)
        with ephemeral_signing_key(self.key) as k:
            self.note = sign_checkpoint(self.checkpoint, ORIGIN, k)

    def wkey(self, name: str) -> WitnessKey:
        return WitnessKey(f"witness.example/{name}", self.witnesses[name].public_key())

    def cosign(self, name: str, *, timestamp: int | None = None, note: bytes | None = None) -> bytes:
        text = parse_signed_note(note or self.note).text
        with ephemeral_signing_key(self.witnesses[name]) as k:
            return cosign(text, f"witness.example/{name}", k, timestamp=timestamp)

    def policy(self, quorum: str = "group honest 1 a b\nquorum honest") -> bytes:
        return (
            f"# two witnesses, one needed\nwitness a {self.wkey('w1').vkey}\n\twitness   b {self.wkey('w2').vkey}  \n"
            f"{quorum}\n"
        ).encode()


@pytest.fixture
def log() -> Log:
    return Log()


# --- the cosignature, byte by byte ---------------------------------------------------------------


def test_cosignature_bytes_are_the_spec_layout_checked_by_hand_with_cryptography(log: Log) -> None:
    line = log.cosign("w1", timestamp=1679315147)
    assert line.startswith("— witness.example/w1 ".encode()) and line.endswith(b"\n") and line.count(b"\n") == 1
    blob = base64.b64decode(line.decode().split(" ")[2].strip(), validate=True)
    public = log.witnesses["w1"].public_key()
    # key ID = SHA-256(name || 0x0A || 0x04 || 32-byte public key)[:4]
    assert blob[:4] == hashlib.sha256(b"witness.example/w1\n\x04" + _raw(public)).digest()[:4]
    assert len(blob) == 4 + 8 + 64
    assert struct.unpack(">Q", blob[4:12]) == (1679315147,)
    message = b"cosignature/v1\ntime 1679315147\n" + b"example.com/log\n7\n" + base64.b64encode(ROOT) + b"\n"
    public.verify(blob[12:], message)  # raises InvalidSignature if the layout were otherwise
    # The vkey: name + hex key ID + base64(0x04 || key).
    vkey = format_witness_vkey("witness.example/w1", public)
    material = base64.b64encode(b"\x04" + _raw(public)).decode()
    assert vkey == f"witness.example/w1+{blob[:4].hex()}+{material}"
    assert parse_witness_vkey(vkey) == WitnessKey("witness.example/w1", public)


def test_the_spec_example_cosignature_line_carries_the_spec_example_time() -> None:
    # c2sp.org/tlog-cosignature's example note and its example signed message ("time 1679315147"):
    # without the example's public key only the layout can be checked.
    example = (
        "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n\n"
        "— example.com/behind-the-sofa Az3grlgtzPICa5OS8npVmf1Myq/5IZniMp+ZJurmRDeOoRDe4URYN7u5/Zhcyv2q1gGzGku9nTo+zyWE+xeMcTOAYQ8=\n"
        "— witness.example.com/w1 jWbPPwAAAABkGFDLEZMHwSRaJNiIDoe9DYn/zXcrtPHeolMI5OWXEhZCB9dlrDJsX3b2oyin1nPZqhf5nNo0xUe+mbIUBkBIfZ+qnA==\n"
    ).encode()
    signature = parse_signed_note(example).signatures[1]
    assert signature.name == "witness.example.com/w1" and len(signature.signature) == 72
    assert struct.unpack(">Q", signature.signature[:8]) == (1679315147,)
    # No key of ours matches: the lines are ignored, not an error.
    other = WitnessKey("witness.example.com/w1", Ed25519PrivateKey.generate().public_key())
    assert open_cosignatures(example, [other]).valid == ()


def test_witness_vkeys_of_the_wrong_kind_are_refused_with_the_fix() -> None:
    public = Ed25519PrivateKey.generate().public_key()
    with pytest.raises(MalformedInputError, match=r"is a note signing key \(type 0x01, a log's key\)") as info:
        parse_witness_vkey(format_vkey("witness.example/w1", public))
    assert "kvgraft witness key" in str(info.value)
    good = format_witness_vkey("witness.example/w1", public)
    name, key_id, material = good.split("+", 2)
    with pytest.raises(MalformedInputError, match="does not match its name and key"):
        parse_witness_vkey(f"witness.example/w2+{key_id}+{material}")
    with pytest.raises(MalformedInputError, match="not 8 lowercase hex digits"):
        parse_witness_vkey(f"{name}+{key_id.upper()}+{material}")
    with pytest.raises(MalformedInputError, match="is not <name>"):
        parse_witness_vkey("just-a-name")


# --- verify_witnessed -----------------------------------------------------------------------------


def test_one_of_two_is_met_by_either_witness_and_unknown_lines_are_ignored(log: Log) -> None:
    policy = parse_witness_policy(log.policy())
    stranger = Ed25519PrivateKey.generate()
    with ephemeral_signing_key(stranger) as k:
        # Same name as w2 but another key (so another key ID), and a wholly unknown witness.
        impostor = cosign(parse_signed_note(log.note).text, "witness.example/w2", k)
        unknown = cosign(parse_signed_note(log.note).text, "witness.example/w9", k)
    note = log.note + unknown + impostor + log.cosign("w1")
    witnessed = verify_witnessed(note, ORIGIN, log.key.public_key(), policy)
    assert witnessed.checkpoint == log.checkpoint and set(witnessed.cosigners) == {"a"}
    assert witnessed.describe() == "witnessed by a"
    note2 = log.note + log.cosign("w2") + log.cosign("w3")
    assert set(verify_witnessed(note2, ORIGIN, log.key.public_key(), policy).cosigners) == {"b"}
    # The same note, with its extra lines, still verifies as a checkpoint everywhere it did.
    assert verify_checkpoint(note, ORIGIN, log.key.public_key()) == log.checkpoint


def test_quorum_not_met_names_who_cosigned_who_did_not_and_what_is_needed(log: Log) -> None:
    policy = parse_witness_policy(log.policy("group both all a b\nquorum both"))
    note = log.note + log.cosign("w1")
    with pytest.raises(WitnessQuorumError) as info:
        verify_witnessed(note, ORIGIN, log.key.public_key(), policy)
    message = info.value.message
    assert "at tree size 7 has valid cosignatures from 1 of the 2 witnesses of the witness policy (a)" in message
    assert "group both = all of (a, b), needs at least 2" in message and "b: no cosignature" in message
    with pytest.raises(WitnessQuorumError, match=r"from 0 of the 2 witnesses .* \(none\)"):
        verify_witnessed(log.note, ORIGIN, log.key.public_key(), policy)


def test_a_bad_cosignature_by_a_known_witness_refuses_the_whole_note(log: Log) -> None:
    policy = parse_witness_policy(log.policy())
    good = log.cosign("w1")
    blob = bytearray(base64.b64decode(good.decode().split(" ")[2]))
    blob[-1] ^= 1
    bad = f"— witness.example/w1 {base64.b64encode(bytes(blob)).decode()}\n".encode()
    # signed-note: a signature by a known key that fails rejects the note, even with a good one beside it.
    with pytest.raises(CosignatureError, match=r"witness.example/w1\+[0-9a-f]{8} \(time \d+\) does not verify"):
        verify_witnessed(log.note + log.cosign("w2") + bad, ORIGIN, log.key.public_key(), policy)
    short = f"— witness.example/w1 {base64.b64encode(bytes(blob[:40])).decode()}\n".encode()
    with pytest.raises(CosignatureError, match="is 36 bytes after its key ID, not 72"):
        verify_witnessed(log.note + short, ORIGIN, log.key.public_key(), policy)
    # A cosignature over another checkpoint (another size) does not verify over this one.
    other = log.cosign("w1", note=log.note.replace(b"\n7\n", b"\n8\n"))
    with pytest.raises(CosignatureError, match="the note was altered after it was cosigned"):
        verify_witnessed(log.note + other, ORIGIN, log.key.public_key(), policy)


def test_cosignatures_dated_in_the_future_or_zero_do_not_count(log: Log) -> None:
    policy = parse_witness_policy(log.policy())
    future = log.cosign("w1", timestamp=int(time.time()) + 3600)
    with pytest.raises(WitnessQuorumError, match=r"a: it is dated 3\d\d\d s in the future \(more than the 300 s allowed\)"):
        verify_witnessed(log.note + future, ORIGIN, log.key.public_key(), policy)
    assert verify_witnessed(log.note + future, ORIGIN, log.key.public_key(), policy, max_skew=7200).cosigners
    # The spec: the timestamp MUST NOT be zero. cosign refuses to make one...
    with pytest.raises(ValueError, match="timestamp must be an int from 1"):
        log.cosign("w1", timestamp=0)
    # ...and one made by hand is not counted.
    text = parse_signed_note(log.note).text
    key_id = log.wkey("w1").key_id
    signature = log.witnesses["w1"].sign(b"cosignature/v1\ntime 0\n" + text)
    zero = f"— witness.example/w1 {base64.b64encode(key_id + bytes(8) + signature).decode()}\n".encode()
    with pytest.raises(WitnessQuorumError, match=r"a: its timestamp 0 is not a time"):
        verify_witnessed(log.note + zero, ORIGIN, log.key.public_key(), policy)


def test_the_log_signature_is_checked_first_and_against_the_policy_logs(log: Log) -> None:
    policy = parse_witness_policy(log.policy())
    note = log.note + log.cosign("w1")
    other = Ed25519PrivateKey.generate().public_key()
    with pytest.raises(Exception, match="has no signature by example.com/log"):
        verify_witnessed(note, ORIGIN, other, policy)
    pinned = parse_witness_policy(f"log {format_vkey(ORIGIN, other)}\n".encode() + log.policy())
    with pytest.raises(Exception, match=r"log key example.com/log\+[0-9a-f]{8} is not one of the logs"):
        verify_witnessed(note, ORIGIN, log.key.public_key(), pinned)
    right = parse_witness_policy(f"log {format_vkey(ORIGIN, log.key.public_key())}\n".encode() + log.policy())
    assert verify_witnessed(note, ORIGIN, log.key.public_key(), right).cosigners


# --- policies -------------------------------------------------------------------------------------


def test_the_tlog_policy_example_with_nested_groups_is_evaluated_as_the_spec_says(log: Log) -> None:
    keys = {n: WitnessKey(f"w.example/{n}", Ed25519PrivateKey.generate().public_key()) for n in
            ("X1", "X2", "X3", "Y1", "Y2", "Y3")}
    lines = [f"log {format_vkey(ORIGIN, log.key.public_key())}", ""]
    lines += [f"witness {n} {k.vkey}" for n, k in keys.items() if n.startswith("X")]
    lines += ["group X-witnesses 2 X1 X2 X3", ""]
    lines += [f"witness {n} {k.vkey} https://w.example/{n}" for n, k in keys.items() if n.startswith("Y")]
    lines += ["group Y-witnesses any Y1 Y2 Y3", "", "group X-and-Y all X-witnesses Y-witnesses", "quorum X-and-Y"]
    policy = parse_witness_policy("\n".join(lines).encode())
    assert policy.min_cosignatures() == 3
    assert policy.satisfied({"X1", "X3", "Y2"}) and not policy.satisfied({"X1", "Y1", "Y2", "Y3"})
    assert policy.describe() == (
        "group X-and-Y = all of ([group X-witnesses = 2 of (X1, X2, X3)], [group Y-witnesses = 1 of (Y1, Y2, Y3)])"
    )
    assert parse_witness_policy(b"quorum none\n").min_cosignatures() == 0
    assert parse_witness_policy(b"quorum none\n").satisfied(set())


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("witness a {w1}\nwitness a {w2}\nquorum a", r"line 2: the name 'a' is already defined above"),
        ("witness a {w1}\nwitness b {w1}\nquorum a", r"line 2: witness 'b' has the same key as witness 'a'"),
        ("group g 1 a\nwitness a {w1}\nquorum g", r"line 1: group 'g' names 'a', which no earlier line defines"),
        ("witness a {w1}\ngroup g 2 a\nquorum g", r"line 2: group 'g' threshold '2' is not 'any', 'all' or a number from 1 to 1"),
        ("witness a {w1}\ngroup g any a a\nquorum g", r"line 2: group 'g' lists 'a' twice"),
        ("witness a {w1}\ngroup g any none\nquorum g", r"line 2: 'none' cannot be a group member"),
        ("witness a {w1}\nwitness b {w2}\ngroup g any a\ngroup h any a b\ngroup q all g h\nquorum q",
         r"line 4: 'a' is already a member of group 'g'"),
        ("witness a {w1}\nquorum a\nquorum a", r"line 3: a second quorum line \(the first is line 2\)"),
        ("witness a {w1}", r"has no quorum line"),
        ("log {log}\nwitness a {w1}\nquorum a", r"line 2: witness 'a' has the key of a log listed above"),
        ("witness a {w1}\nlog {log}\nquorum a", r"line 2: log 'witness.example/w1' has the key of a witness listed above"),
        ("witness log {w1}\nquorum log", r"line 1: 'log' is a keyword of the policy format"),
        ("witness a {w1} witness.example/a\nquorum a", r"line 1: witness 'a' URL 'witness.example/a' is not an http"),
        ("witness a {w1} https://w.example/\nwitness b {w2} https://w.example/\nquorum a",
         r"line 2: witness 'b' has the URL of witness key 'witness.example/w1', another key name"),
        ("log {w1}\nquorum none", r"line 1: verifier key 'witness.example/w1' is not an Ed25519 key"),
        ("witnes a {w1}\nquorum a", r"line 1: unknown keyword 'witnes'"),
        ("witness a\nquorum a", r"line 1: 'witness' takes a name, a vkey and an optional URL, got 1"),
        ("witness a {w1}\r\nquorum a", r"line 1: the control character U\+000D"),
    ],
)
def test_policy_errors_name_the_line_the_problem_and_the_fix(log: Log, text: str, problem: str) -> None:
    filled = text.format(
        w1=log.wkey("w1").vkey, w2=log.wkey("w2").vkey, log=format_vkey("witness.example/w1", log.witnesses["w1"].public_key())
    )
    with pytest.raises(WitnessPolicyError, match=problem) as info:
        parse_witness_policy(filled.encode(), source="policy.txt")
    assert str(info.value).startswith("policy.txt ") and "(hint: " in str(info.value)


def test_policy_files_are_bounded(tmp_path: Path, log: Log) -> None:
    big = tmp_path / "big.txt"
    big.write_bytes(b"# " + b"x" * (64 * 1024))
    with pytest.raises(WitnessPolicyError, match=r"witness policy .*big.txt is \d+ bytes, more than the 65536"):
        load_witness_policy(big)
    many = "".join(f"witness w{i} {WitnessKey(f'w.example/{i}', Ed25519PrivateKey.generate().public_key()).vkey}\n"
                   for i in range(65))
    with pytest.raises(WitnessPolicyError, match="line 65: more than 64 witnesses"):
        parse_witness_policy(many.encode())
    with pytest.raises(WitnessPolicyError, match="line 1: the line is 5000 characters long"):
        parse_witness_policy(b"#" + b"y" * 4999 + b"\nquorum none\n")
    with pytest.raises(WitnessPolicyError, match="is not UTF-8"):
        parse_witness_policy(b"quorum \xff\n")
    with pytest.raises(WitnessPolicyError, match="does not exist"):
        load_witness_policy(tmp_path / "missing.txt")


# --- kvgraft-verify log --witness-policy ---------------------------------------------------------


def test_kvgraft_verify_log_checks_the_witnesses_offline(
    tmp_path: Path, log: Log, capsys: pytest.CaptureFixture[str]
) -> None:
    key = tmp_path / "registry.pub"
    save_public_key(log.key.public_key(), key)
    policy = tmp_path / "policy.txt"
    policy.write_bytes(log.policy())
    witnessed, bare = tmp_path / "witnessed", tmp_path / "bare"
    witnessed.write_bytes(log.note + log.cosign("w2"))
    bare.write_bytes(log.note)
    same = tmp_path / "same.json"
    same.write_text(json.dumps({"old_size": 7, "new_size": 7, "hashes": []}))
    base = ["--json", "log", "--registry-key", str(key), "--witness-policy", str(policy), "--consistency", str(same)]
    assert verify_main([*base, str(bare), "--checkpoint", str(witnessed)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checks"] == ["checkpoint", "witnesses", "consistency"]
    assert out["witnesses"]["cosigners"]["b"]["key_name"] == "witness.example/w2"
    assert "witnessed by b, as witness policy" in out["summary"]
    assert verify_main([*base, str(bare), "--checkpoint", str(bare)]) == 1
    captured = capsys.readouterr()
    assert "WitnessQuorumError" in captured.out + captured.err
    assert "from 0 of the 2 witnesses" in captured.out + captured.err


# --- Go's sumdb/note ------------------------------------------------------------------------------

_GO_PROGRAM = r"""
package main

import (
	"crypto/ed25519"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"fmt"
	"os"
	"strings"

	"golang.org/x/mod/sumdb/note"
)

// cosigV1 verifies c2sp.org/tlog-cosignature Ed25519 (type 0x04) cosignatures, from the spec text.
type cosigV1 struct {
	name string
	key  ed25519.PublicKey
	hash uint32
}

func (v cosigV1) Name() string    { return v.name }
func (v cosigV1) KeyHash() uint32 { return v.hash }
func (v cosigV1) Verify(msg, sig []byte) bool {
	if len(sig) != 72 {
		return false
	}
	t := binary.BigEndian.Uint64(sig[:8])
	m := append([]byte(fmt.Sprintf("cosignature/v1\ntime %d\n", t)), msg...)
	return ed25519.Verify(v.key, m, sig[8:])
}

func main() {
	msg, _ := os.ReadFile(os.Args[1])
	logV, err := note.NewVerifier(os.Args[2])
	if err != nil {
		panic(err)
	}
	// The log's key alone: the cosignature is from an unknown key, so it is ignored.
	n, err := note.Open(msg, note.VerifierList(logV))
	if err != nil {
		panic(err)
	}
	fmt.Printf("log-only verified=%d unverified=%d\n", len(n.Sigs), len(n.UnverifiedSigs))
	parts := strings.SplitN(os.Args[3], "+", 3)
	raw, _ := base64.StdEncoding.DecodeString(parts[2])
	h := sha256.Sum256(append([]byte(parts[0]+"\n"), raw...))
	w := cosigV1{parts[0], ed25519.PublicKey(raw[1:]), binary.BigEndian.Uint32(h[:4])}
	n, err = note.Open(msg, note.VerifierList(logV, w))
	if err != nil {
		panic(err)
	}
	fmt.Printf("with-witness verified=%d unverified=%d\n", len(n.Sigs), len(n.UnverifiedSigs))
}
"""


def test_go_sumdb_note_opens_a_witnessed_note_and_verifies_the_cosignature(tmp_path: Path, log: Log) -> None:
    go = shutil.which("go")
    gopath = Path("/usr/share/gocode")
    if go is None or not (gopath / "src/golang.org/x/mod/sumdb/note").is_dir():
        # `make test` installs both (scripts/system-packages.sh), so their absence is a broken set-up.
        pytest.fail("go and golang.org/x/mod are not installed: run scripts/system-packages.sh test "
                    "(Debian: apt-get install golang-go golang-golang-x-mod-dev)")
    program = tmp_path / "main.go"
    program.write_text(_GO_PROGRAM)
    noted = tmp_path / "note"
    stranger = Ed25519PrivateKey.generate()
    with ephemeral_signing_key(stranger) as k:
        unknown = cosign(parse_signed_note(log.note).text, "witness.example/w9", k)
    noted.write_bytes(log.note + unknown + log.cosign("w1"))
    env = {**os.environ, "GOPATH": str(gopath), "GO111MODULE": "off", "GOCACHE": str(tmp_path / "gocache")}
    r = subprocess.run(
        [go, "run", str(program), str(noted), format_vkey(ORIGIN, log.key.public_key()), log.wkey("w1").vkey],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines() == ["log-only verified=1 unverified=2", "with-witness verified=2 unverified=1"]
