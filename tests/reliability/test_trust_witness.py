"""A forking registry against two honest witnesses (issue 19: witnessed checkpoints).

The honest registry and its fork are both real ``kvgraft serve`` processes with the same log key
and origin: the fork is a copy of the honest data directory taken after the first entry, which
then takes a different second entry. Both submit to the same two ``kvgraft witness serve``
processes. The witnesses saw the honest tree first, so they refuse the fork (409, then 422), and
a client whose policy needs one of them refuses the fork's entry even with no memory of its own;
without a policy, only a client that remembers the honest tree notices.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgraft.cli import main as kvgraft_main
from kvgraft.registry.client import NO_MEMORY, RegistryClient, publish
from kvgraft.verifier import parse_signed_note, save_public_key
from kvgraft.verifier.cli import main as verify_main
from tests.registry.conftest import Key, artifact, make_key, running_server
from tests.registry.witnesses import ORIGIN, cosigners, policy_file, registry_data, running_witness, wait_for
from tests.reliability.servers import make_token


def _cli(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, dict[str, Any], str]:
    code = kvgraft_main(["--json", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def _artifact_dir(tmp_path: Path, key: Key, text: str) -> tuple[str, Path]:
    art = artifact(text)
    directory = tmp_path / f"art-{len(list(tmp_path.glob('art-*')))}"
    directory.mkdir()
    (directory / "kv.safetensors").write_bytes(art.tensors)
    (directory / "statement.dsse.json").write_bytes(key.sign(art.statement))
    return art.digest, directory


def _publish(tmp_path: Path, url: str, token: str, key: Key, text: str) -> str:
    """An artifact published without a policy and without remembering anything; its digest."""
    digest, directory = _artifact_dir(tmp_path, key, text)
    with RegistryClient(url, token=token, memory=NO_MEMORY) as client:
        publish(client, directory)
    return digest


def _size(note: bytes) -> int:
    return int(parse_signed_note(note).text.split(b"\n")[1])


def test_forking_registry_gets_no_cosignature_and_a_client_needing_one_honest_witness_refuses_it(
    tmp_path: Path, rkeys: dict[str, Key], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    alice = rkeys["alice"]
    wdir = tmp_path / "wkeys"
    wdir.mkdir()
    data, fork_data = tmp_path / "data", tmp_path / "data-fork"
    log = registry_data(data)
    remembering, fresh, bare = tmp_path / "home-remembering", tmp_path / "home-fresh", tmp_path / "home-bare"
    monkeypatch.delenv("KVGRAFT_WITNESS_POLICY", raising=False)
    with (
        running_witness(make_key(wdir, "w1"), "witness.test/w1", tmp_path / "state1", [log.vkey]) as w1,
        running_witness(make_key(wdir, "w2"), "witness.test/w2", tmp_path / "state2", [log.vkey]) as w2,
    ):
        witnesses = [w1, w2]
        policy = policy_file(tmp_path / "policy.txt", witnesses, 1)
        flags = ["--origin", ORIGIN, "--witness", w1.option, "--witness", w2.option]

        def cosigned(url: str, size: int) -> bytes | None:
            note = httpx.get(url + "/v1/log/checkpoint", timeout=10).content
            return note if _size(note) == size and len(cosigners(note, witnesses)) == 2 else None

        with running_server(data, *flags) as honest:
            token = make_token(honest, "alice", alice)[0]
            first = _publish(tmp_path, honest.url, token, alice, "the shared first entry")
            wait_for(lambda: cosigned(honest.url, 1), "the honest checkpoint at size 1 to be cosigned")
        shutil.copytree(data, fork_data)  # the same key, origin, entry and cosignatures: a fork waiting to happen

        with running_server(data, *flags) as honest:
            second = _publish(tmp_path, honest.url, token, alice, "the honest second entry")
            wait_for(lambda: cosigned(honest.url, 2), "the honest checkpoint at size 2 to be cosigned")
            monkeypatch.setenv("KVGRAFT_HOME", str(remembering))
            code, out, err = _cli(capsys, "pull", "--registry", honest.url, "--witness-policy", policy, second,
                                  "--out", tmp_path / "honest-second")
            assert code == 0, err

            with running_server(fork_data, *flags) as fork:
                ftoken = make_token(fork, "alice", alice)[0]
                forked = _publish(tmp_path, fork.url, ftoken, alice, "the forked second entry")
                fork_note = httpx.get(fork.url + "/v1/log/checkpoint", timeout=10).content
                assert _size(fork_note) == 2 and fork_note != cosigned(honest.url, 2)

                # Both witnesses refuse it: the fork's collector learns their size (409) and its tree at
                # that size is not theirs (422). It gets no cosignature, whatever it retries.
                def refused() -> bool:
                    return fork.log().count("inconsistent-checkpoint") >= 2

                wait_for(refused, "both witnesses to refuse the fork (in the fork's log)")
                assert cosigners(httpx.get(fork.url + "/v1/log/checkpoint", timeout=10).content, witnesses) == []
                newest = httpx.get(fork.url + "/v1/log/checkpoint", params={"witnessed": 1}, timeout=10).content
                assert _size(newest) == 1  # the shared prefix, honestly cosigned before the copy
                # The same refusal, asked directly, as c2sp.org/tlog-witness says.
                proof = httpx.get(fork.url + "/v1/log/proof/consistency", params={"old": 1}, timeout=10).json()["hashes"]
                lines = "".join(base64.b64encode(bytes.fromhex(h)).decode() + "\n" for h in proof)
                r = w1.add_checkpoint(f"old 1\n{lines}\n".encode() + fork_note)
                assert (r.status_code, r.content) == (409, b"2\n")
                r = w1.add_checkpoint(b"old 2\n\n" + fork_note)
                assert r.status_code == 422
                assert "two checkpoints of the same size 2 have different roots" in r.json()["detail"]

                # A fresh client (no memory at all) whose policy needs one honest witness refuses the
                # fork's entry: no checkpoint holding it is cosigned.
                monkeypatch.setenv("KVGRAFT_HOME", str(fresh))
                code, out, err = _cli(capsys, "pull", "--registry", fork.url, "--witness-policy", policy,
                                      "--witness-wait", "2", forked, "--out", tmp_path / "forked-with-policy")
                assert code == 1 and out["ok"] is False, out
                assert err.count("\n") == 1 and "Traceback" not in err, err
                assert "UnwitnessedCheckpointError" in err
                assert "serves no checkpoint that meets the witness policy's quorum" in err
                assert "group witnesses = 1 of (w1, w2)" in err and "is at tree size 1" in err
                assert "they refused it because it does not extend the tree they saw" in err
                # The shared first entry is in the tree the witnesses vouch for: accepted from the fork too.
                code, out, err = _cli(capsys, "pull", "--registry", fork.url, "--witness-policy", policy, first,
                                      "--out", tmp_path / "first-from-fork")
                assert code == 0, err
                # Publishing to the fork with the policy is refused the same way: its entry is logged, but
                # no witness vouches for a tree holding it, so the publisher is told so.
                _, third = _artifact_dir(tmp_path, alice, "a third entry sent to the fork")
                code, out, err = _cli(capsys, "publish", "--registry", fork.url, "--token", ftoken,
                                      "--witness-policy", policy, "--witness-wait", "1", third)
                assert code == 1 and "UnwitnessedCheckpointError" in err and "needs one of at least 3" in err, err

                # Without a policy: the client that remembers the honest tree refuses (checkpoint memory)...
                monkeypatch.setenv("KVGRAFT_HOME", str(remembering))
                code, out, err = _cli(capsys, "pull", "--registry", fork.url, forked, "--out", tmp_path / "forked-remembering")
                assert code == 1 and "LogForkError" in err and "possible split view" in err, err
                # ...but a client that never saw it is shown the fork: the gap witnesses close.
                monkeypatch.setenv("KVGRAFT_HOME", str(bare))
                code, out, err = _cli(capsys, "pull", "--registry", fork.url, forked, "--out", tmp_path / "forked-bare")
                assert code == 0, err

                # Offline, the fork's checkpoint fails the policy; the honest one passes.
                pub = tmp_path / "registry.pub"
                save_public_key(log.private.public_key(), pub)
                same = tmp_path / "same.json"
                same.write_text(json.dumps({"old_size": 2, "new_size": 2, "hashes": []}))
                for name, note in (("fork-checkpoint", fork_note), ("honest-checkpoint", cosigned(honest.url, 2))):
                    assert note is not None
                    (tmp_path / name).write_bytes(note)
                argv = ["log", "--registry-key", str(pub), "--witness-policy", str(policy), "--checkpoint"]
                assert verify_main([*argv, str(tmp_path / "fork-checkpoint"), "--consistency", str(same),
                                    str(tmp_path / "fork-checkpoint")]) == 1
                assert "from 0 of the 2 witnesses" in "".join(capsys.readouterr())
                assert verify_main([*argv, str(tmp_path / "honest-checkpoint"), "--consistency", str(same),
                                    str(tmp_path / "honest-checkpoint")]) == 0
                capsys.readouterr()

            # The honest registry keeps growing under the witnesses' eyes.
            _publish(tmp_path, honest.url, token, alice, "the honest third entry")
            wait_for(lambda: cosigned(honest.url, 3), "the honest checkpoint at size 3 to be cosigned")
    for name in ("forked-with-policy", "forked-remembering"):
        assert not (tmp_path / name).exists()
