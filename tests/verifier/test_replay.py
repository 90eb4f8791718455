"""``kvgraft-verify replay``: a pre-registration logged before its replay, both proven in a real
RFC 9162 tree under a signed checkpoint; every reordering, missing proof or altered output is
refused naming what differs.

The builders here are shared with test_audit.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from kvgraft.schemas import (
    DatasetRef,
    PreRegistrationPredicate,
    PreRegistrationRef,
    PreRegistrationStatement,
    ReplayPredicate,
    ReplayStatement,
    sha256_bytes,
)
from kvgraft.verifier import (
    Checkpoint,
    ClaimMismatchError,
    LogProofError,
    MerkleTree,
    SubjectMismatchError,
    ephemeral_signing_key,
    hash_leaf,
    inclusion_proof_document,
    load_checkpoint,
    load_dataset,
    save_public_key,
    sign_checkpoint,
    verify_replay,
)
from kvgraft.verifier._internal.evaluation import OutputLine, output_hash, outputs_file_bytes
from kvgraft.verifier.cli import ExitCode, main

from .test_eval import GSM8K, Publisher, answers, make_publisher, model_ref, profile, sign_to, subject

ORIGIN = "registry.kvgraft.test/log"


@dataclass
class Log:
    """A registry log in miniature: entries appended, proofs written, one signed checkpoint."""

    key: Ed25519PrivateKey = field(default_factory=Ed25519PrivateKey.generate)
    tree: MerkleTree = field(default_factory=MerkleTree)

    def append(self, entry: bytes) -> int:
        """Log ``entry`` (envelope bytes as stored); return its index."""
        return self.tree.append(hash_leaf(entry))

    def filler(self, n: int) -> None:
        """Log ``n`` unrelated entries (other publishers' artifacts)."""
        for i in range(n):
            self.append(f"someone else's entry {self.tree.size} {i}".encode())

    def write_proof(self, index: int, path: Path) -> None:
        """Write the inclusion PROOF of leaf ``index`` at the current size."""
        doc = inclusion_proof_document(index, self.tree.size, self.tree.inclusion_proof(index))
        path.write_text(json.dumps(doc))

    def publish(self, directory: Path) -> tuple[Path, Path]:
        """Write the signed checkpoint and the registry key; return (checkpoint, key) paths."""
        directory.mkdir(parents=True, exist_ok=True)
        with ephemeral_signing_key(self.key) as signer:
            note = sign_checkpoint(Checkpoint(ORIGIN, self.tree.size, self.tree.root()), ORIGIN, signer)
        (directory / "checkpoint.txt").write_bytes(note)
        save_public_key(self.key.public_key(), directory / "registry-key.pub.pem")
        return directory / "checkpoint.txt", directory / "registry-key.pub.pem"


def build_prereg(directory: Path, outputs: list[tuple[int, str]], publisher: Publisher) -> bytes:
    """Write a pre-registration expecting ``outputs``; return its envelope bytes."""
    ds = load_dataset(GSM8K)
    directory.mkdir(parents=True)
    lines = [OutputLine(doc, f"Q: {ds.question(doc)}\nA:", text) for doc, text in outputs]
    data = outputs_file_bytes(lines)
    (directory / "expected-outputs.jsonl").write_bytes(data)
    statement = PreRegistrationStatement(
        subject=[subject("expected-outputs.jsonl", data)],
        predicate=PreRegistrationPredicate(
            model=model_ref(), profile=profile(), dataset=DatasetRef(name=ds.name, digest=ds.digest),
            command=["kvgraft", "replay", "--dataset", ds.name], settings={"max_new_tokens": 16},
            expected_output_hashes={str(line.doc_id): output_hash(line.output) for line in lines},
            expected_outputs_digest=sha256_bytes(data),
        ),
    )
    return sign_to(directory / "record.dsse.json", statement, publisher)


def build_replay(
    directory: Path,
    prereg_envelope: bytes,
    prereg_index: int,
    outputs: list[tuple[int, str]],
    expected: list[tuple[int, str]],
    publisher: Publisher,
    *,
    edit: Callable[[dict[str, Any]], None] | None = None,
) -> bytes:
    """Write a replay record of ``outputs`` answering the pre-registration; return its envelope bytes."""
    ds = load_dataset(GSM8K)
    directory.mkdir(parents=True)
    lines = [OutputLine(doc, f"Q: {ds.question(doc)}\nA:", text) for doc, text in outputs]
    data = outputs_file_bytes(lines)
    (directory / "outputs.jsonl").write_bytes(data)
    hashes = {str(line.doc_id): output_hash(line.output) for line in lines}
    predicate: dict[str, Any] = {
        "pre_registration": PreRegistrationRef(envelope_digest=sha256_bytes(prereg_envelope), log_index=prereg_index),
        "output_hashes": hashes,
        "outputs_digest": sha256_bytes(data),
        "reproduced": hashes == {str(d): output_hash(t) for d, t in expected},
    }
    if edit is not None:
        edit(predicate)
    statement = ReplayStatement(subject=[subject("outputs.jsonl", data)], predicate=ReplayPredicate(**predicate))
    return sign_to(directory / "record.dsse.json", statement, publisher)


@dataclass(frozen=True)
class Scenario:
    """A pre-registration, its replay and the log evidence, all on disk."""

    prereg: Path
    replay: Path
    checkpoint: Path
    registry_key: Path
    publisher: Publisher


def scenario(
    root: Path,
    *,
    publisher: Publisher | None = None,
    replay_outputs: list[tuple[int, str]] | None = None,
    replay_first: bool = False,
    edit: Callable[[dict[str, Any]], None] | None = None,
    prereg_name: str = "prereg",
    replay_name: str = "replay",
    log: Log | None = None,
) -> Scenario:
    """Pre-register, log, replay, log (or the other way round with ``replay_first``)."""
    pub = publisher or make_publisher(root / "keys")
    log = log or Log()
    expected = answers(GSM8K, [0, 5, 17])
    outputs = expected if replay_outputs is None else replay_outputs
    prereg_dir, replay_dir = root / prereg_name, root / replay_name
    log.filler(3)
    prereg_env = build_prereg(prereg_dir, expected, pub)
    if replay_first:
        # A replay logged first cannot know the pre-registration's index; it claims the one it gets.
        replay_env = build_replay(replay_dir, prereg_env, log.tree.size + 2, outputs, expected, pub, edit=edit)
        replay_index = log.append(replay_env)
        log.filler(1)
        prereg_index = log.append(prereg_env)
    else:
        prereg_index = log.append(prereg_env)
        log.filler(2)
        replay_env = build_replay(replay_dir, prereg_env, prereg_index, outputs, expected, pub, edit=edit)
        replay_index = log.append(replay_env)
    log.filler(2)
    log.write_proof(prereg_index, prereg_dir / "log.json")
    log.write_proof(replay_index, replay_dir / "log.json")
    checkpoint, key = log.publish(root)
    return Scenario(prereg_dir, replay_dir, checkpoint, key, pub)


def _verify(s: Scenario) -> Any:
    return verify_replay(s.replay, s.prereg, s.publisher.trusted, load_checkpoint(s.checkpoint, s.registry_key))


# --- tests ---------------------------------------------------------------------------------


def test_an_honest_replay_verifies_and_reproduces(tmp_path: Path) -> None:
    s = scenario(tmp_path)
    got = _verify(s)
    assert got.reproduced is True
    assert got.pre_registration_log_index < got.log_index
    assert got.outputs == 3


def test_an_honest_non_reproduction_verifies_as_not_reproduced(tmp_path: Path) -> None:
    different = answers(GSM8K, [0, 5, 17])
    different[1] = (different[1][0], different[1][1] + " (recomputed)")
    got = _verify(scenario(tmp_path, replay_outputs=different))
    assert got.reproduced is False


def test_claiming_reproduction_with_a_different_output_is_refused(tmp_path: Path) -> None:
    different = answers(GSM8K, [0, 5, 17])
    different[2] = (different[2][0], "something else entirely")

    def claim(p: dict[str, Any]) -> None:
        p["reproduced"] = True

    s = scenario(tmp_path, replay_outputs=different, edit=claim)
    with pytest.raises(ClaimMismatchError, match=r"reproduced claimed true, recomputed false: doc\(s\) 17 differ from the pre-registered output hashes"):
        _verify(s)


def test_a_replay_logged_before_its_pre_registration_is_refused(tmp_path: Path) -> None:
    s = scenario(tmp_path, replay_first=True)
    with pytest.raises(ClaimMismatchError, match=r"replay logged before its pre-registration: the replay is at log index 3, the pre-registration at 5"):
        _verify(s)


@pytest.mark.parametrize("which", ["prereg", "replay"])
def test_a_missing_proof_is_refused(tmp_path: Path, which: str) -> None:
    s = scenario(tmp_path)
    (getattr(s, which) / "log.json").unlink()
    what = "the pre-registration" if which == "prereg" else "the replay record"
    with pytest.raises(LogProofError, match=rf"{what} has no inclusion proof \(.*log\.json is missing\)"):
        _verify(s)


def test_a_proof_of_another_entry_is_refused(tmp_path: Path) -> None:
    s = scenario(tmp_path)
    (s.prereg / "log.json").write_bytes((s.replay / "log.json").read_bytes())
    with pytest.raises(LogProofError, match="the pre-registration: "):
        _verify(s)


def test_a_wrong_pre_registration_index_is_refused(tmp_path: Path) -> None:
    def misstate(p: dict[str, Any]) -> None:
        p["pre_registration"] = PreRegistrationRef(envelope_digest=p["pre_registration"].envelope_digest, log_index=0)

    s = scenario(tmp_path, edit=misstate)
    with pytest.raises(ClaimMismatchError, match=r"pre_registration\.log_index claimed 0, but the pre-registration is proven at log index 3"):
        _verify(s)


def test_another_pre_registration_is_refused(tmp_path: Path) -> None:
    s = scenario(tmp_path)
    env = s.prereg / "record.dsse.json"
    env.write_bytes(env.read_bytes().rstrip(b"\n"))  # same JSON, other bytes: another envelope
    with pytest.raises(ClaimMismatchError, match=r"the replay answers to pre-registration sha256:[0-9a-f]{64}, but the pre-registration given has envelope digest"):
        _verify(s)


def test_an_altered_replay_output_is_refused(tmp_path: Path) -> None:
    s = scenario(tmp_path)
    out = s.replay / "outputs.jsonl"
    out.write_bytes(out.read_bytes().replace(b"Working", b"working", 1))
    with pytest.raises(SubjectMismatchError, match=r"outputs\.jsonl has digest"):
        _verify(s)


def test_an_altered_expected_output_is_refused(tmp_path: Path) -> None:
    s = scenario(tmp_path)
    out = s.prereg / "expected-outputs.jsonl"
    out.write_bytes(out.read_bytes().replace(b"Working", b"working", 1))
    with pytest.raises(SubjectMismatchError, match=r"expected-outputs\.jsonl has digest"):
        _verify(s)


def test_wrong_output_hashes_are_refused(tmp_path: Path) -> None:
    def lie(p: dict[str, Any]) -> None:
        p["output_hashes"] = {**p["output_hashes"], "5": output_hash("not what was generated")}

    s = scenario(tmp_path, edit=lie)
    with pytest.raises(ClaimMismatchError, match=r"doc 5: output_hashes claimed [0-9a-f]{64}, recomputed [0-9a-f]{64} from outputs\.jsonl"):
        _verify(s)


# --- command line --------------------------------------------------------------------------


def _argv(s: Scenario) -> list[str]:
    return ["replay", str(s.replay), "--pre-registration", str(s.prereg), "--trusted-keys", str(s.publisher.trust_file),
            "--checkpoint", str(s.checkpoint), "--registry-key", str(s.registry_key)]


def test_cli_replay_ok_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = scenario(tmp_path)
    assert main(_argv(s)) == ExitCode.OK
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    assert out.startswith("OK: replay reproduced every pre-registered output (3 outputs); pre-registration logged at index 3 before the replay at 6")
    assert main(["--json", *_argv(s)]) == ExitCode.OK
    doc = json.loads(capsys.readouterr().out)
    assert (doc["ok"], doc["reproduced"], doc["pre_registration_log_index"], doc["log_index"]) == (True, True, 3, 6)


def test_cli_replay_swapped_order_is_one_line_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = scenario(tmp_path, replay_first=True)
    assert main(_argv(s)) == ExitCode.FAILED
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith("kvgraft-verify: ClaimMismatchError: replay logged before its pre-registration")


def test_cli_replay_with_a_forged_checkpoint_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    s = scenario(tmp_path)
    save_public_key(Ed25519PrivateKey.generate().public_key(), s.registry_key)
    assert main(_argv(s)) == ExitCode.FAILED
    err = capsys.readouterr().err
    assert err.startswith("kvgraft-verify: LogProofError: checkpoint ") and len(err.splitlines()) == 1
