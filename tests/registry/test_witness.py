"""The witness (``kvgraft witness serve``, c2sp.org/tlog-witness) and the registry's cosignatures.

Every test runs real servers on 127.0.0.1: witnesses as ``kvgraft witness serve`` processes, the
registry as ``kvgraft serve`` (or in process, where only its background collector matters), and
clients through the ``kvgraft`` command itself. Cosignatures are re-verified by hand with
``cryptography`` against the message layout of c2sp.org/tlog-cosignature.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import struct
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgraft.cli import main as kvgraft_main
from kvgraft.verifier import (
    NoteSignature,
    WitnessKey,
    cosign,
    cosignature_message,
    ephemeral_signing_key,
    parse_signed_note,
    parse_witness_policy,
    save_public_key,
    verify_witnessed,
)
from kvgraft.verifier.cli import main as verify_main

from .conftest import Key, artifact, free_port, harness, make_key, running_server
from .witnesses import (
    ORIGIN,
    Answer,
    FakeLog,
    WitnessServer,
    cosigners,
    policy_file,
    registry_data,
    running_witness,
    scripted_witness,
    wait_for,
)


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Remembered checkpoints stay in the test's directory."""
    monkeypatch.setenv("KVGRAFT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KVGRAFT_WITNESS_POLICY", raising=False)
    return tmp_path / "home"


@pytest.fixture
def wkeys(tmp_path: Path) -> dict[str, Key]:
    d = tmp_path / "wkeys"
    d.mkdir()
    return {n: make_key(d, n) for n in ("w1", "w2", "w3")}


def _cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, dict[str, Any], str]:
    code = kvgraft_main(["--json", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def _check_cosignature_by_hand(note: bytes, witness: WitnessServer) -> int:
    """Find ``witness``'s line on ``note`` and verify it with ``cryptography`` alone; return its time."""
    text = parse_signed_note(note).text
    public = witness.key.private.public_key()
    raw = witness.witness_key.vkey.split("+", 2)[2]
    assert base64.b64decode(raw)[0] == 0x04 and base64.b64decode(raw)[1:] == public.public_bytes_raw()
    key_id = hashlib.sha256(witness.name.encode() + b"\n\x04" + public.public_bytes_raw()).digest()[:4]
    lines = [line for line in note.decode().split("\n") if line.startswith(f"— {witness.name} ")]
    assert len(lines) == 1, note
    blob = base64.b64decode(lines[0].split(" ")[2], validate=True)
    assert blob[:4] == key_id and len(blob) == 76
    (timestamp,) = struct.unpack(">Q", blob[4:12])
    assert 0 < timestamp <= time.time() + 5
    public.verify(blob[12:], b"cosignature/v1\ntime %d\n" % timestamp + text)
    return int(timestamp)


def _vkey(key: Key, name: str = "witness.test/w1") -> str:
    return WitnessKey(name, key.private.public_key()).vkey


def _artifact_dir(tmp_path: Path, key: Key, text: str) -> tuple[str, Path]:
    art = artifact(text)
    directory = tmp_path / f"art-{hashlib.sha256(text.encode()).hexdigest()[:8]}"
    directory.mkdir()
    (directory / "kv.safetensors").write_bytes(art.tensors)
    (directory / "statement.dsse.json").write_bytes(key.sign(art.statement))
    return art.digest, directory


def _token(server: Any, publisher: str, key: Key) -> str:
    from tests.reliability.servers import make_token

    return make_token(server, publisher, key)[0]


# --- the witness protocol -------------------------------------------------------------------------


def test_add_checkpoint_answers_as_the_spec_says_and_keeps_its_state_across_a_restart(
    tmp_path: Path, wkeys: dict[str, Key]
) -> None:
    log = FakeLog(leaves=5)
    state = tmp_path / "state"
    policy = parse_witness_policy(f"witness w {_vkey(wkeys['w1'])}\nquorum w\n".encode())
    with running_witness(wkeys["w1"], "witness.test/w1", state, [log.key.vkey]) as w:
        r = w.add_checkpoint(log.body(0))
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
        assert r.content.count(b"\n") == 1 and r.content.startswith("— witness.test/w1 ".encode())
        _check_cosignature_by_hand(log.note() + r.content, w)
        assert verify_witnessed(log.note() + r.content, log.key.origin, log.key.private.public_key(), policy).cosigners
        # The old size must be the one it cosigned: 409, its size, as text/x.tlog.size.
        r = w.add_checkpoint(log.body(0))
        assert (r.status_code, r.headers["content-type"], r.content) == (409, "text/x.tlog.size", b"5\n")
        log.grow(4)
        assert w.add_checkpoint(log.body(5)).status_code == 200
        # The same size again (the same root) is cosigned again, with a fresh timestamp.
        assert w.add_checkpoint(log.body(9)).status_code == 200
        served = httpx.get(f"{w.url}/{hashlib.sha256(log.key.origin.encode()).hexdigest()}/checkpoint", timeout=10)
        assert served.status_code == 200
        assert verify_witnessed(served.content, log.key.origin, log.key.private.public_key(), policy).checkpoint.size == 9
        # A second witness process on the same state directory refuses to start.
        second = WitnessServer(wkeys["w2"], "witness.test/w2", state, [log.key.vkey], tmp_path / "second.log")
        assert second.proc.wait(timeout=60) != 0
        second.stop()
        assert "is in use by another witness process" in second.log()
    files = sorted(p.name for p in state.iterdir())
    assert files == [".lock", hashlib.sha256(log.key.origin.encode()).hexdigest() + ".json"]
    with running_witness(wkeys["w1"], "witness.test/w1", state, [log.key.vkey]) as w:
        r = w.add_checkpoint(log.body(0))
        assert (r.status_code, r.content) == (409, b"9\n")
        log.grow(1)
        assert w.add_checkpoint(log.body(9)).status_code == 200


def test_malformed_and_refused_bodies_are_answered_and_change_nothing(tmp_path: Path, wkeys: dict[str, Key]) -> None:
    log, fresh, stranger = FakeLog(leaves=4), FakeLog("fresh.example/log"), FakeLog("stranger.example/log", 4)
    impostor = FakeLog(log.key.origin, 6)  # the same origin under another key
    state = tmp_path / "state"
    with running_witness(wkeys["w1"], "witness.test/w1", state, [log.key.vkey, fresh.key.vkey]) as w:
        assert w.add_checkpoint(log.body(0)).status_code == 200
        before = {p.name: p.read_bytes() for p in state.iterdir()}
        log.grow(2)
        note = log.note()
        good_proof = log.tree.consistency_proof(4, 6)
        flipped = bytearray(note)
        flipped[-5] = ord("A") if flipped[-5] != ord("A") else ord("B")
        cases: list[tuple[bytes, int, str]] = [
            (b"", 400, "is not 'old <size>'"),
            (b"old 04\n\n" + note, 400, "is not 'old <size>'"),
            (b"old -1\n\n" + note, 400, "is not 'old <size>'"),
            (b"old 4\nnot base64!\n\n" + note, 400, "proof line 1"),
            (b"old 4\n" + b"".join(base64.b64encode(bytes(32)) + b"\n" for _ in range(64)) + b"\n" + note, 400,
             "more than 63 lines"),
            (b"old 4\n\n", 400, "no checkpoint after its empty line"),
            (b"old 4", 400, "is not 'old <size>'"),
            (b"old 4\n\nnot a note\n", 400, "the checkpoint note is malformed"),
            (b"old 7\n\n" + note, 400, "the old size 7 is larger than the checkpoint's size 6"),
            (stranger.body(0), 404, "does not watch the log 'stranger.example/log'"),
            (impostor.body(0), 403, "carries no signature by a key this witness trusts"),
            (b"old 4\n" + b"".join(base64.b64encode(h) + b"\n" for h in good_proof) + b"\n" + bytes(flipped), 403,
             "does not verify over the note text"),
            (log.body(4, proof=[bytes(32)] * len(good_proof)), 422, "is not proved to extend the one"),
            (log.body(0), 409, ""),
            (fresh.body(0, proof=[bytes(32)]), 422, "too long"),
            (b"old 0\n\n" + fresh.note_with_root(0, bytes(32)), 422, "different roots"),
            (b"old 4\n\n" + b"#" * (70 * 1024), 413, "accepts at most"),
        ]
        for body, status, needle in cases:
            r = w.add_checkpoint(body)
            assert r.status_code == status, (body[:60], r.status_code, r.text)
            if status == 409:
                assert r.content == b"4\n"
                continue
            problem = r.json()
            assert r.headers["content-type"] == "application/problem+json" and needle in problem["detail"], problem
            assert problem.get("hint"), problem
            assert str(state) not in r.text
        assert {p.name: p.read_bytes() for p in state.iterdir()} == before
        # Nothing was cosigned for the fresh log either.
        missing = httpx.get(f"{w.url}/{hashlib.sha256(fresh.key.origin.encode()).hexdigest()}/checkpoint", timeout=10)
        assert missing.status_code == 404 and "has cosigned no checkpoint" in missing.json()["detail"]
        assert httpx.get(f"{w.url}/NOTAHASH/checkpoint", timeout=10).status_code == 404


def test_a_state_file_it_did_not_sign_fails_closed_and_is_never_reset(tmp_path: Path, wkeys: dict[str, Key]) -> None:
    log = FakeLog(leaves=3)
    state = tmp_path / "state"
    path = state / f"{hashlib.sha256(log.key.origin.encode()).hexdigest()}.json"
    with running_witness(wkeys["w1"], "witness.test/w1", state, [log.key.vkey]) as w:
        assert w.add_checkpoint(log.body(0)).status_code == 200
    saved = path.read_bytes()
    log.grow(2)
    # Another key on the same state directory: it cannot vouch for that state, so it cosigns nothing
    # for the log (not even "old 0", which a witness that forgot the log would accept).
    with running_witness(wkeys["w2"], "witness.test/w1", state, [log.key.vkey]) as w:
        for body in (log.body(0), log.body(3)):
            r = w.add_checkpoint(body)
            assert r.status_code == 500 and "is damaged" in r.json()["detail"], r.text
            assert "another --key or --name" in r.json()["detail"] and str(state) not in r.text
    # A state file edited by hand (its size moved back) fails the same way under the right key.
    doc = json.loads(saved)
    doc["tree_size"] = 1
    path.write_text(json.dumps(doc))
    with running_witness(wkeys["w1"], "witness.test/w1", state, [log.key.vkey]) as w:
        r = w.add_checkpoint(log.body(1))
        assert r.status_code == 500 and "its fields do not match its checkpoint" in r.json()["detail"], r.text
        path.write_bytes(saved)  # restored from the backup: it goes on from size 3
        assert w.add_checkpoint(log.body(3)).status_code == 200


def test_concurrent_add_checkpoints_from_one_size_advance_the_witness_once(tmp_path: Path, wkeys: dict[str, Key]) -> None:
    log = FakeLog(leaves=40)
    bodies = [log.body(0, size) for size in range(10, 26)]
    answers: list[httpx.Response] = []
    lock = threading.Lock()
    start = threading.Barrier(len(bodies))

    with running_witness(wkeys["w1"], "witness.test/w1", tmp_path / "state", [log.key.vkey]) as w:

        def submit(body: bytes) -> None:
            start.wait(timeout=30)
            r = w.add_checkpoint(body)
            with lock:
                answers.append(r)

        threads = [threading.Thread(target=submit, args=(b,)) for b in bodies]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        ok = [r for r in answers if r.status_code == 200]
        conflicts = [r for r in answers if r.status_code == 409]
        assert len(answers) == len(bodies) and len(ok) == 1 and len(conflicts) == len(bodies) - 1, [
            r.status_code for r in answers
        ]
        winner = parse_signed_note(log.note(10) + ok[0].content)  # any size: only the line is read here
        assert winner.signatures[-1].name == "witness.test/w1"
        sizes = {r.content for r in conflicts}
        assert len(sizes) == 1, sizes
        won = int(sizes.pop())
        stored = json.loads((tmp_path / "state" / f"{hashlib.sha256(log.key.origin.encode()).hexdigest()}.json").read_text())
        assert stored["tree_size"] == won and 10 <= won <= 25
        # From the winner's size, the next one goes through.
        assert w.add_checkpoint(log.body(won, 40)).status_code == 200


# --- the registry collects cosignatures -----------------------------------------------------------


def test_registry_collects_both_cosignatures_and_a_1_of_2_client_publishes_and_pulls(
    tmp_path: Path, wkeys: dict[str, Key], keys: dict[str, Key], capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data"
    log = registry_data(data)
    alice = keys["alice"]
    with (
        running_witness(wkeys["w1"], "witness.test/w1", tmp_path / "state1", [log.vkey]) as w1,
        running_witness(wkeys["w2"], "witness.test/w2", tmp_path / "state2", [log.vkey]) as w2,
    ):
        policy = policy_file(tmp_path / "policy.txt", [w1, w2], 1)
        with running_server(data, "--origin", ORIGIN, "--witness", w1.option, "--witness", w2.option) as server:
            token = _token(server, "alice", alice)
            digest, directory = _artifact_dir(tmp_path, alice, "witnessed knowledge")
            code, out, err = _cli(capsys, "publish", "--registry", server.url, "--token", token,
                                  "--witness-policy", policy, directory)
            assert code == 0, err
            assert out["registry_key"]["witness_policy"]["min_cosignatures"] == 1 and out["tree_size"] >= 1
            assert "cosigned as witness policy" in out["summary"]

            def both() -> bytes | None:
                note = httpx.get(server.url + "/v1/log/checkpoint", timeout=10).content
                return note if cosigners(note, [w1, w2]) == ["witness.test/w1", "witness.test/w2"] else None

            note = wait_for(both, "both witnesses' cosignatures on the registry's checkpoint")
            assert parse_signed_note(note).text.split(b"\n")[1] == b"1"
            times = [_check_cosignature_by_hand(note, w) for w in (w1, w2)]
            # The witnessed= query finds it; more cosignatures than witnesses is a 404 with a hint.
            assert httpx.get(server.url + "/v1/log/checkpoint", params={"witnessed": 2}, timeout=10).content == note
            missing = httpx.get(server.url + "/v1/log/checkpoint", params={"witnessed": 3}, timeout=10)
            assert missing.status_code == 404 and "cosigned by 3 witness(es)" in missing.json()["detail"]
            at = httpx.get(server.url + "/v1/log/checkpoint", params={"witnessed": 2, "tree_size": 1}, timeout=10)
            assert at.content == note
            unwitnessed = httpx.get(server.url + "/v1/log/checkpoint", params={"witnessed": 3, "tree_size": 1}, timeout=10)
            assert unwitnessed.status_code == 404 and "at tree size 1 is not cosigned by 3" in unwitnessed.json()["detail"]
            # The entry documents carry them too (clients without a policy ignore the lines).
            assert cosigners(httpx.get(server.url + "/v1/entries/0", timeout=10).json()["checkpoint"].encode(), [w1, w2])

            code, out, err = _cli(capsys, "pull", "--registry", server.url, "--witness-policy", policy, digest,
                                  "--out", tmp_path / "pulled")
            assert code == 0, err
            assert (tmp_path / "pulled" / "kv.safetensors").read_bytes() == (directory / "kv.safetensors").read_bytes()
            # A policy naming a witness this registry does not use is refused in one line.
            strict = tmp_path / "strict.txt"
            strict.write_text(f"witness o {_vkey(make_key(tmp_path, 'w-other'), 'witness.test/o')}\nquorum o\n")
            code, out, err = _cli(capsys, "pull", "--registry", server.url, "--witness-policy", strict,
                                  "--witness-wait", "0.5", digest, "--out", tmp_path / "pulled-strict")
            assert code == 1 and "UnwitnessedCheckpointError" in err and err.count("\n") == 1, err
            assert "serves no checkpoint that meets the witness policy's quorum, witness o" in err
            assert not (tmp_path / "pulled-strict").exists()
            # Offline: the saved checkpoint and the inclusion proof, with the policy.
            (tmp_path / "checkpoint").write_bytes(note)
            (tmp_path / "inclusion.json").write_text(httpx.get(
                server.url + "/v1/log/proof/inclusion", params={"index": 0, "tree_size": 1}, timeout=10).text)
            (tmp_path / "entry").write_bytes(httpx.get(server.url + "/v1/entries/0/envelope", timeout=10).content)
            pub = tmp_path / "registry.pub"
            save_public_key(log.private.public_key(), pub)
            assert verify_main(["log", "--checkpoint", str(tmp_path / "checkpoint"), "--registry-key", str(pub),
                                "--witness-policy", str(policy), "--inclusion", str(tmp_path / "inclusion.json"),
                                str(tmp_path / "entry")]) == 0
            assert "witnessed by w1, w2" in capsys.readouterr().out
            # mirror: the policy is the source's; the target (no witnesses) is proved equal to it.
            with running_server(tmp_path / "target") as target:
                code, out, err = _cli(capsys, "mirror", "--from", server.url, "--to", target.url,
                                      "--token", _token(target, "alice", alice), "--witness-policy", policy)
                assert code == 0 and out["copied_size"] == 1, err
                assert out["source_key"]["witness_policy"]["quorum"] == "group witnesses = 1 of (w1, w2)"
                assert out["target_key"]["witness_policy"] is None
        # Stored: a restarted registry serves the same cosignatures at once.
        with running_server(data, "--origin", ORIGIN) as server:
            again = httpx.get(server.url + "/v1/log/checkpoint", params={"tree_size": 1}, timeout=10).content
            assert [_check_cosignature_by_hand(again, w) for w in (w1, w2)] == times


def test_publishing_never_waits_for_an_unreachable_witness(tmp_path: Path, keys: dict[str, Key], wkeys: dict[str, Key]) -> None:
    dead = _vkey(wkeys["w1"])
    started = time.monotonic()
    with harness(tmp_path / "data", keys, witnesses=((dead, f"http://127.0.0.1:{free_port()}"),), witness_timeout=2.0) as h:
        for i in range(3):
            h.publish_artifact(artifact(f"unwitnessed {i}"), keys["alice"])
        note = h.client.get("/v1/log/checkpoint").content
        assert parse_signed_note(note).text.split(b"\n")[1] == b"3" and len(parse_signed_note(note).signatures) == 1
        assert h.client.get("/v1/log/checkpoint", params={"witnessed": 1}).status_code == 404
    # Three publishes and a shutdown, while the collector kept failing and backing off.
    assert time.monotonic() - started < 20


def test_a_witness_answer_that_cosigns_another_text_is_refused_not_stored(
    tmp_path: Path, keys: dict[str, Key], wkeys: dict[str, Key], caplog: pytest.LogCaptureFixture
) -> None:
    """A witness whose answer starts with a blank line: the line after it signs a text of its
    choosing. Stored and served, it would make clients that trust the witness refuse the whole
    note; the registry must verify over its own checkpoint text and refuse it."""
    private = wkeys["w1"].private
    assert isinstance(private, Ed25519PrivateKey)
    liar = WitnessKey("witness.test/liar", private.public_key())
    bodies: list[bytes] = []

    def lie(body: bytes) -> Answer:
        bodies.append(body)
        chosen = body.split(b"\n\n", 1)[1] + b"\nx\n"
        ts = int(time.time())
        signature = private.sign(cosignature_message(chosen, ts))
        return 200, "text/plain", b"\nx\n\n" + NoteSignature(liar.name, liar.key_id, struct.pack(">Q", ts) + signature).line()

    with (
        scripted_witness(lie) as url,
        caplog.at_level(logging.WARNING, logger="kvgraft.registry"),
        harness(tmp_path / "data", keys, witnesses=((liar.vkey, url),), witness_timeout=2.0) as h,
    ):
        h.publish_artifact(artifact("a lie in the answer"), keys["alice"])
        wait_for(lambda: "is not cosignature lines" in caplog.text, "the registry to refuse the liar's answer")
        assert bodies and all(b.startswith((b"old 0\n", b"old 1\n")) for b in bodies)
        note = h.client.get("/v1/log/checkpoint").content
        signatures = parse_signed_note(note).signatures
        assert len(signatures) == 1 and signatures[0].name == note.split(b"\n", 1)[0].decode(), note
        assert h.client.get("/v1/log/checkpoint", params={"witnessed": 1}).status_code == 404


def test_a_witness_that_answers_409_then_fails_is_retried_until_it_cosigns(
    tmp_path: Path, keys: dict[str, Key], wkeys: dict[str, Key]
) -> None:
    """The 409 names the head's own size (the witness cosigned it, but the answer was lost), then the
    resubmission fails once: the registry must keep retrying that witness, even though another
    witness's line for the head is already stored."""
    data = tmp_path / "data"
    log = registry_data(data)
    flaky = WitnessKey("witness.test/flaky", wkeys["w2"].private.public_key())
    answers: list[int] = []

    def flake(body: bytes) -> Answer:
        size = parse_signed_note(body.split(b"\n\n", 1)[1]).text.split(b"\n")[1]
        if not answers:
            answers.append(409)
            return 409, "text/x.tlog.size", size + b"\n"
        if len(answers) == 1:
            answers.append(500)
            return 500, "text/plain", b"down for a moment\n"
        answers.append(200)
        with ephemeral_signing_key(wkeys["w2"].private) as k:
            return 200, "text/plain", cosign(parse_signed_note(body.split(b"\n\n", 1)[1]).text, flaky.name, k)

    with (
        running_witness(wkeys["w1"], "witness.test/w1", tmp_path / "state1", [log.vkey]) as w1,
        scripted_witness(flake) as url,
        harness(data, keys, origin=ORIGIN, witnesses=((w1.witness_key.vkey, w1.url), (flaky.vkey, url)),
                witness_timeout=2.0) as h,
    ):
        def both() -> bytes | None:
            note = h.client.get("/v1/log/checkpoint").content
            return note if cosigners(note, [w1]) and flaky.name in [s.name for s in parse_signed_note(note).signatures] else None

        wait_for(both, "both witnesses' lines on the size-0 checkpoint", timeout=20)
        assert answers == [409, 500, 200]


# --- the commands ---------------------------------------------------------------------------------


def test_witness_key_prints_the_vkey_and_bad_keys_and_options_fail_in_one_line(
    tmp_path: Path, wkeys: dict[str, Key], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvgraft.verifier import generate_private_key, save_private_key

    for path in (wkeys["w1"].path, wkeys["w1"].pub_path):
        code, out, err = _cli(capsys, "witness", "key", "--key", path, "--name", "witness.test/w1")
        assert code == 0 and out["vkey"] == _vkey(wkeys["w1"]) and out["summary"] == out["vkey"], err
    ecdsa = tmp_path / "p256.pem"
    save_private_key(generate_private_key("p256"), ecdsa)
    failures = [
        (["witness", "key", "--key", ecdsa, "--name", "witness.test/w1"], "Ed25519 keys only"),
        (["witness", "key", "--key", wkeys["w1"].path, "--name", "bad name"], "contains ' '"),
        (["witness", "key", "--key", tmp_path / "missing.pem", "--name", "w"], "cannot read key file"),
        (["witness", "serve", "--key", ecdsa, "--name", "witness.test/w1", "--state", tmp_path / "s",
          "--log", FakeLog().key.vkey], "Ed25519 keys only"),
        (["serve", "--data", tmp_path / "data", "--witness", "nonsense"], "is not VKEY=URL"),
        (["serve", "--data", tmp_path / "data", "--witness", f"{FakeLog().key.vkey}=http://127.0.0.1:1"],
         "is a note signing key"),
    ]
    for argv, needle in failures:
        code, out, err = _cli(capsys, *argv)
        assert code == 1 and out["ok"] is False and err.count("\n") == 1 and needle in err, (argv, err)
    assert not (tmp_path / "data").exists() and not (tmp_path / "s").exists()
