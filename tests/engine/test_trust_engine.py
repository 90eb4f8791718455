"""Issue 14 ("Trust under attack"), the engine's findings, on tiny-llama-test with real files:

- finding 5: verify-before-load is the default for graft, generate, capture --parent, ask, eval,
  replay and the library API; a zeroed signature or an unknown signer is refused; no keys is a
  one-line refusal naming how to give them; ``--insecure-skip-verify`` is loud;
- finding 6: ``ask`` binds an index entry to the problem its artifact is signed for;
- finding 10: NaN/Inf tensors and out-of-vocabulary token ids are refused at graft (and at
  capture); a signed parent cycle is a one-line refusal, not a RecursionError; a child must start
  at its parent's end.

Forged artifacts are re-signed with the trusted key on purpose: the signature holds, so what is
refused is the content, by the check under test.
"""

from __future__ import annotations

import base64
import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgraft.cli import main
from kvgraft.schemas import parse_statement
from kvgraft.verifier import (
    b64decode_any,
    envelope_json,
    load_dataset,
    open_signing_key,
    read_envelope,
    sign_statement,
)

REPO = Path(__file__).resolve().parents[2]
GSM8K_TRAIN = REPO / "data" / "datasets" / "gsm8k_train.jsonl"


# --- helpers ----------------------------------------------------------------------------------------


def _run(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, dict[str, Any], str]:
    code = main(["--json", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, json.loads(out.strip().splitlines()[-1]), err


def _refused(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[dict[str, Any], str]:
    """Run a command that must be refused: exit 1, ok false, one stderr line (no traceback)."""
    code, result, err = _run(capsys, *argv)
    assert code == 1 and result["ok"] is False, (code, result, err)
    assert err.startswith("kvgraft: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return result, err


@pytest.fixture()
def trust_file(tmp_path: Path, key: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    path = tmp_path / "trusted-keys.json"
    assert main(["keys", "trust", "--file", str(path), "--name", "alice", "--public-key", str(key.with_name("k.pem.pub"))]) == 0
    capsys.readouterr()
    return path


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty $KVGRAFT_HOME of this test's own (no local key, no trusted-keys.json)."""
    path = tmp_path / "home"
    path.mkdir()
    monkeypatch.setenv("KVGRAFT_HOME", str(path))
    monkeypatch.delenv("KVGRAFT_TRUSTED_KEYS", raising=False)
    return path


@pytest.fixture()
def texts(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "p.txt").write_text("Verified knowledge: 48 clips in April.\n")
    (tmp_path / "c.txt").write_text(" How many in May?")
    return tmp_path / "p.txt", tmp_path / "c.txt"


def _statement(directory: Path) -> Any:
    envelope = read_envelope(directory / "statement.dsse.json")
    return parse_statement(b64decode_any(envelope.payload, what="payload"), what="statement")


def _resign(directory: Path, key: Path, *, kv: bytes | None = None, **predicate: Any) -> None:
    """Rewrite an artifact's tensors and/or predicate fields and sign it again with ``key``."""
    statement = _statement(directory)
    subject = statement.subject
    if kv is not None:
        (directory / "kv.safetensors").write_bytes(kv)
        import hashlib

        digest = hashlib.sha256(kv).hexdigest()
        subject = [s.model_copy(update={"digest": s.digest.model_copy(update={"sha256": digest})}) for s in subject]
    forged = statement.model_copy(update={"subject": subject, "predicate": statement.predicate.model_copy(update=predicate)})
    with open_signing_key(key) as signer:
        (directory / "statement.dsse.json").write_bytes(envelope_json(sign_statement(forged, [signer])))


def _zero_signature(directory: Path, name: str = "statement.dsse.json") -> None:
    path = directory / name
    env = json.loads(path.read_text())
    env["signatures"][0]["sig"] = base64.b64encode(bytes(64)).decode()
    path.write_text(json.dumps(env))


def _kv_digest(directory: Path) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256((directory / "kv.safetensors").read_bytes()).hexdigest()


# --- finding 5: verify before load, by default ------------------------------------------------------


def test_graft_and_generate_refuse_a_signature_of_64_zero_bytes(
    tmp_path: Path, key: Path, trust_file: Path, texts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prefix, question = texts
    assert _run(capsys, "capture", "--model", "tiny-llama-test", "--text-file", prefix, "--out", tmp_path / "a", "--key", key)[0] == 0
    _zero_signature(tmp_path / "a")
    for command in (["graft"], ["generate", "--max-new-tokens", "2"]):
        result, err = _refused(capsys, *command, "--artifact", tmp_path / "a", "--text-file", question, "--trusted-keys", trust_file)
        assert result["error"] == "ArtifactSignatureError" and "its signature is refused" in result["message"], result
        # The zeroed signature still names alice's keyid: a trusted key's signature that does not verify.
        assert "the signature by trusted key" in result["message"] and "does not verify over this payload" in result["message"]


def test_graft_refuses_an_artifact_signed_by_an_unknown_key(
    tmp_path: Path, trust_file: Path, texts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prefix, question = texts
    assert main(["keys", "generate", "--out", str(tmp_path / "mallory.pem")]) == 0
    assert _run(capsys, "capture", "--model", "tiny-llama-test", "--text-file", prefix, "--out", tmp_path / "a",
                "--key", tmp_path / "mallory.pem")[0] == 0
    result, _ = _refused(capsys, "graft", "--artifact", tmp_path / "a", "--text-file", question, "--trusted-keys", trust_file)
    assert result["error"] == "ArtifactSignatureError"


def test_graft_without_trusted_keys_is_refused_naming_how_to_give_them(
    tmp_path: Path, home: Path, key: Path, texts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prefix, question = texts
    assert _run(capsys, "capture", "--model", "tiny-llama-test", "--text-file", prefix, "--out", tmp_path / "a", "--key", key)[0] == 0
    for command in (["graft"], ["generate"]):
        result, err = _refused(capsys, *command, "--artifact", tmp_path / "a", "--text-file", question)
        assert result["error"] == "NoTrustedKeysError"
        for way in ("--trusted-keys FILE", "KVGRAFT_TRUSTED_KEYS", "trusted-keys.json", "--trust-local-key", "--insecure-skip-verify"):
            assert way in err, way
    # capture --parent loads the parent: verified too.
    result, _ = _refused(capsys, "capture", "--model", "tiny-llama-test", "--text-file", question, "--out", tmp_path / "b",
                         "--parent", tmp_path / "a", "--key", key)
    assert result["error"] == "NoTrustedKeysError" and not (tmp_path / "b").exists()


def test_insecure_skip_verify_warns_on_stderr_and_json_says_skipped(
    tmp_path: Path, home: Path, key: Path, texts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prefix, question = texts
    assert _run(capsys, "capture", "--model", "tiny-llama-test", "--text-file", prefix, "--out", tmp_path / "a", "--key", key)[0] == 0
    for command in (["graft"], ["generate", "--max-new-tokens", "2"]):
        code, result, err = _run(capsys, *command, "--artifact", tmp_path / "a", "--text-file", question, "--insecure-skip-verify")
        assert code == 0 and result["signature"] == "skipped (--insecure-skip-verify)"
        assert "WARNING: --insecure-skip-verify: artifact signatures are NOT checked" in err
    result, err = _refused(capsys, "graft", "--artifact", tmp_path / "a", "--text-file", question, "--insecure-skip-verify",
                           "--trust-local-key")
    assert result["error"] == "TrustOptionsError" and "cannot be combined" in err


def test_trusted_keys_come_from_the_option_then_the_environment_then_kvgraft_home(
    tmp_path: Path, home: Path, key: Path, trust_file: Path, texts: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    prefix, question = texts
    assert _run(capsys, "capture", "--model", "tiny-llama-test", "--text-file", prefix, "--out", tmp_path / "a", "--key", key)[0] == 0
    graft = ["graft", "--artifact", tmp_path / "a", "--text-file", question]
    # $KVGRAFT_HOME/trusted-keys.json, when present.
    shutil.copyfile(trust_file, home / "trusted-keys.json")
    code, result, err = _run(capsys, *graft)
    assert code == 0 and result["signature"] == "verified: alice", err
    # KVGRAFT_TRUSTED_KEYS wins over the home file: here it names a file trusting someone else.
    assert main(["keys", "generate", "--out", str(tmp_path / "bob.pem")]) == 0
    assert main(["keys", "trust", "--file", str(tmp_path / "bob.json"), "--name", "bob", "--public-key", str(tmp_path / "bob.pem.pub")]) == 0
    capsys.readouterr()
    monkeypatch.setenv("KVGRAFT_TRUSTED_KEYS", str(tmp_path / "bob.json"))
    assert _refused(capsys, *graft)[0]["error"] == "ArtifactSignatureError"
    # --trusted-keys wins over both.
    code, result, err = _run(capsys, *graft, "--trusted-keys", trust_file)
    assert code == 0 and result["signature"] == "verified: alice", err


def test_the_local_key_is_trusted_only_when_the_user_says_so(
    tmp_path: Path, home: Path, trust_file: Path, texts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    prefix, question = texts
    code, cap, err = _run(capsys, "capture", "--model", "tiny-llama-test", "--text-file", prefix, "--out", tmp_path / "a")
    assert code == 0 and "local.pem" in cap["key"], err
    graft = ["graft", "--artifact", tmp_path / "a", "--text-file", question]
    assert _refused(capsys, *graft)[0]["error"] == "NoTrustedKeysError"
    assert _refused(capsys, *graft, "--trusted-keys", trust_file)[0]["error"] == "ArtifactSignatureError"
    code, result, err = _run(capsys, *graft, "--trust-local-key")
    assert code == 0 and result["signature"] == "verified: local", err
    code, result, err = _run(capsys, *graft, "--trust-local-key", "--trusted-keys", trust_file)
    assert code == 0 and result["signature"] == "verified: local", err
    # Or by adding it to a trusted-keys file with 'kvgraft keys trust'.
    assert main(["keys", "trust", "--file", str(home / "trusted-keys.json"), "--name", "mine",
                 "--public-key", str(home / "keys" / "local.pem.pub")]) == 0
    capsys.readouterr()
    code, result, err = _run(capsys, *graft)
    assert code == 0 and result["signature"] == "verified: mine", err


def test_load_artifact_and_library_open_verify_by_default_and_skipping_is_a_keyword(
    tmp_path: Path, tiny: Any, profile: Any, key: Path
) -> None:
    from kvgraft.engine import ArtifactSignatureError, NoTrustedKeysError, capture, load_artifact, trust_signer
    from kvgraft.engine._internal.library import Library

    capture(tiny, profile, "Some text.", tmp_path / "a", key=key)
    with pytest.raises(NoTrustedKeysError, match="no trusted keys to check its signature against"):
        load_artifact(tmp_path / "a", tiny, profile)
    assert load_artifact(tmp_path / "a", tiny, profile, insecure_skip_verify=True).signature == "skipped (--insecure-skip-verify)"
    assert load_artifact(tmp_path / "a", tiny, profile, trusted=trust_signer(key)).signature == "verified: signer"
    _zero_signature(tmp_path / "a")
    with pytest.raises(ArtifactSignatureError):
        load_artifact(tmp_path / "a", tiny, profile, trusted=trust_signer(key))

    lib = Library.create(tmp_path / "lib", tiny, profile, kind="gsm8k", key=key)
    assert lib.trusted is not None and lib.prefix().signature == "verified: library creator"
    with pytest.raises(NoTrustedKeysError, match="no trusted keys to check its artifacts' signatures"):
        Library.open(tmp_path / "lib", tiny, profile)
    assert Library.open(tmp_path / "lib", tiny, profile, insecure_skip_verify=True).prefix().signature.startswith("skipped")


# --- a small library, built once ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory, tiny: Any, profile: Any, key: Path) -> tuple[Path, Path]:
    """Three GSM8K train problems deposited once; tests get a copy."""
    from kvgraft.engine._internal.library import Library, clean_solution

    base = tmp_path_factory.mktemp("trust-library")
    data = base / "train.jsonl"
    data.write_text("".join(GSM8K_TRAIN.read_text().splitlines(keepends=True)[:3]))
    dataset = load_dataset(data)
    lib = Library.create(base / "lib", tiny, profile, kind=dataset.kind, key=key)
    for i in range(3):
        solution = clean_solution(dataset.solution(i) or "") + f"\nThe answer is {dataset.reference(i)}."
        assert lib.deposit(dataset, i, solution, key=key) is not None
    return base / "lib", data


@pytest.fixture()
def library(tmp_path: Path, built: tuple[Path, Path]) -> tuple[Path, Any]:
    shutil.copytree(built[0], tmp_path / "lib")
    return tmp_path / "lib", load_dataset(built[1])


def _index(lib: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (lib / "index.jsonl").read_text().splitlines()]


def _write_index(lib: Path, entries: list[dict[str, Any]]) -> None:
    (lib / "index.jsonl").write_text("".join(json.dumps(e, sort_keys=True, separators=(",", ":")) + "\n" for e in entries))


def test_ask_and_eval_refuse_a_library_entry_with_a_zeroed_signature(
    tmp_path: Path, library: tuple[Path, Any], key: Path, trust_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lib, dataset = library
    code, ans, err = _run(capsys, "ask", "--library", lib, "--question", dataset.question(1), "--trusted-keys", trust_file)
    assert code == 0 and ans["method"] == "exact" and ans["signature"] == "verified: alice", err
    _zero_signature(lib / _index(lib)[1]["directory"])
    result, _ = _refused(capsys, "ask", "--library", lib, "--question", dataset.question(1), "--trusted-keys", trust_file)
    assert result["error"] == "ArtifactSignatureError"
    train = tmp_path / "train.jsonl"
    train.write_text("".join(GSM8K_TRAIN.read_text().splitlines(keepends=True)[:3]))
    result, _ = _refused(capsys, "eval", "--model", "tiny-llama-test", "--dataset", train, "--library", lib, "--out", tmp_path / "ev",
                         "--key", key, "--max-new-tokens", "4", "--trusted-keys", trust_file)
    assert result["error"] == "ArtifactSignatureError" and not (tmp_path / "ev").exists()
    # Without keys: refused before any model is loaded, naming the ways to give keys.
    result, err = _refused(capsys, "ask", "--library", lib, "--question", "2+2?")
    assert result["error"] == "NoTrustedKeysError" and "--trusted-keys FILE" in err


# --- finding 6: the index is bound to what it points at -------------------------------------------------


def test_ask_refuses_an_index_entry_pointed_at_another_problems_signed_artifact(
    library: tuple[Path, Any], trust_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lib, dataset = library
    entries = _index(lib)
    x, y = entries[0], entries[1]
    # The attacker puts Y's (validly signed) artifact where X's entry points, and X's entry names it.
    shutil.rmtree(lib / x["directory"])
    shutil.copytree(lib / y["directory"], lib / x["directory"])
    entries[0] = {**x, "artifact": y["artifact"], "answer": y["answer"]}
    _write_index(lib, entries)
    result, err = _refused(capsys, "ask", "--library", lib, "--question", dataset.question(0), "--trusted-keys", trust_file)
    assert result["error"] == "LibraryError", result
    assert f"names problem {x['problem_hash'][:16]}, but its artifact {y['artifact']} is signed for problem {y['problem_hash'][:16]}" in err
    # A similar question reaches the same entry: refused the same way.
    result, err = _refused(capsys, "ask", "--library", lib, "--question", dataset.question(0) + " Please hurry.",
                           "--trusted-keys", trust_file)
    assert "is signed for problem" in err
    # Simply pointing X's entry at Y's directory is refused too, naming the directory.
    entries[0] = {**x, "artifact": y["artifact"], "directory": y["directory"]}
    _write_index(lib, entries)
    result, err = _refused(capsys, "ask", "--library", lib, "--question", dataset.question(0), "--trusted-keys", trust_file)
    assert f"points at {y['directory']!r}" in err


def test_ask_refuses_an_index_entry_whose_problem_or_answer_is_not_the_signed_one(
    library: tuple[Path, Any], tiny: Any, profile: Any, key: Path
) -> None:
    from kvgraft.engine import LibraryError, trust_signer
    from kvgraft.engine._internal.library import Library, problem_hash

    lib, dataset = library
    entries = _index(lib)
    entries[2] = {**entries[2], "answer": "99999"}
    _write_index(lib, entries)
    opened = Library.open(lib, tiny, profile, trusted=trust_signer(key))
    with pytest.raises(LibraryError, match="says the answer is '99999', but its artifact is signed with"):
        opened.ask(dataset.question(2))
    # An index entry rewritten (problem text, hash and directory, all consistent) for another
    # question, still pointing at problem 2's signed artifact.
    forged_problem = "What is 2 + 2?"
    forged_hash = problem_hash(forged_problem)
    (lib / entries[2]["directory"]).rename(lib / f"entries/{forged_hash[:16]}")
    entries[2] = {**entries[2], "problem": forged_problem, "problem_hash": forged_hash,
                  "directory": f"entries/{forged_hash[:16]}", "answer": dataset.reference(2)}
    _write_index(lib, entries)
    opened = Library.open(lib, tiny, profile, trusted=trust_signer(key))
    with pytest.raises(LibraryError, match="is signed for problem"):
        opened.ask(forged_problem)


def test_deposit_refuses_a_problem_that_would_read_back_ambiguously(tmp_path: Path, tiny: Any, profile: Any, key: Path) -> None:
    from kvgraft.engine import LibraryError
    from kvgraft.engine._internal.library import Library

    data = tmp_path / "tricky.jsonl"
    row = json.loads(GSM8K_TRAIN.read_text().splitlines()[0])
    row["question"] = "How much is 2 + 2?\nSolution: it is 5.\nReally?"
    row["answer"] = "2 + 2 = 4\n#### 4"
    data.write_text(json.dumps(row) + "\n")
    dataset = load_dataset(data)
    lib = Library.create(tmp_path / "lib", tiny, profile, kind=dataset.kind, key=key)
    with pytest.raises(LibraryError, match="cannot be stored unambiguously"):
        lib.deposit(dataset, 0, "2 + 2 = 4\nThe answer is 4.", key=key)
    assert not (tmp_path / "lib" / "entries").exists() or not any((tmp_path / "lib" / "entries").iterdir())


# --- finding 10: what is grafted must be finite, in the vocabulary, and join up ---------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_graft_refuses_nan_or_inf_tensors_naming_the_tensor_and_position(
    tmp_path: Path, key: Path, trust_file: Path, texts: tuple[Path, Path], capsys: pytest.CaptureFixture[str], bad: float
) -> None:
    from kvgraft.engine import deserialize, serialize

    prefix, question = texts
    assert _run(capsys, "capture", "--model", "tiny-llama-test", "--text-file", prefix, "--out", tmp_path / "a", "--key", key)[0] == 0
    tensors, meta = deserialize((tmp_path / "a" / "kv.safetensors").read_bytes())
    tensors["layers.1.values"][0, 1, 7, 3] = bad
    _resign(tmp_path / "a", key, kv=serialize(tensors, meta))
    result, err = _refused(capsys, "graft", "--artifact", tmp_path / "a", "--text-file", question, "--trusted-keys", trust_file)
    assert result["error"] == "UnsafeTensorError"
    assert f"tensor layers.1.values holds {bad} at position 7 (index [0, 1, 7, 3]); KV state must be finite" in err



@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_check_finds_nan_and_inf_in_every_stored_dtype_and_passes_the_largest_finite_values(dtype: torch.dtype) -> None:
    from kvgraft.engine import UnsafeTensorError
    from kvgraft.engine._internal.artifacts import check_finite

    # Values whose sum overflows any float type are still finite: no refusal, no false alarm.
    big = torch.full((1, 2, 9, 4), torch.finfo(dtype).max, dtype=dtype)
    check_finite({"layers.0.keys": big, "layers.0.values": -big, "layers.0.empty": big[:, :, :0]}, 10, 19, "artifact a")
    for bad in (float("nan"), float("inf"), float("-inf")):
        t = big.clone()
        t[0, 1, 7, 3] = bad
        with pytest.raises(UnsafeTensorError) as e:
            check_finite({"layers.0.keys": big, "layers.0.values": t}, 10, 19, "artifact a")
        assert f"artifact a: tensor layers.0.values holds {bad} at position 17 (index [0, 1, 7, 3])" in e.value.message

def _scanned(path: Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], Any, memoryview]:
    """``tensors`` written to ``path``, read back through ``read_hashed`` with a ``FiniteScan``:
    the tensors (views of the buffer read), the scan, the buffer."""
    from kvgraft.engine import deserialize, serialize
    from kvgraft.engine._internal.artifacts import FiniteScan
    from kvgraft.engine._internal.kvfile import read_hashed

    path.write_bytes(serialize(tensors, {"format": "kvgraft-kv-state/v1"}))
    scan = FiniteScan(dtype)
    data, _ = read_hashed(path, each_chunk=scan)
    return deserialize(data)[0], scan, data


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_finite_scan_covers_only_finite_views_of_the_scanned_bytes(tmp_path: Path, dtype: torch.dtype) -> None:
    from kvgraft.engine._internal.artifacts import check_finite

    g = torch.Generator().manual_seed(3)
    # Big enough that most tensors lie past the blocks the header shares (a float16 header
    # reads as infinities: "}" is 0x7D).
    tensors = {f"layers.{i}.{kind}": torch.randn(1, 2, 600, 8, generator=g).to(dtype) for i in range(3) for kind in ("keys", "values")}
    loaded, scan, data = _scanned(tmp_path / "kv.safetensors", tensors, dtype)
    covered = [name for name, t in loaded.items() if scan.covers(t)]
    assert len(covered) >= len(tensors) - 1, covered  # all but at most the one beside the header
    check_finite(loaded, 0, 600, "artifact a", scanned=scan)
    t = loaded["layers.2.values"]
    assert scan.covers(t)
    # Not covered: a copy (other memory), another dtype, a view off the element grid.
    assert not scan.covers(t.clone())
    assert not scan.covers(t.float() if dtype != torch.float32 else t.double())
    offset = t.data_ptr() - torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    assert scan.covers(torch.frombuffer(data, dtype=dtype, count=8, offset=offset))  # the same bytes, on the grid
    assert not scan.covers(torch.frombuffer(data, dtype=dtype, count=8, offset=offset + 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk", [4096, 1 << 20])
def test_finite_scan_marks_the_nan_in_any_chunk_and_check_finite_still_names_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, chunk: int
) -> None:
    # Many chunks (hashed while a thread reads the next) or one: a value that is not finite is
    # found wherever it is, and the tensor holding it is never covered.
    from kvgraft.engine import UnsafeTensorError
    from kvgraft.engine._internal import kvfile
    from kvgraft.engine._internal.artifacts import check_finite

    monkeypatch.setattr(kvfile, "READ_CHUNK", chunk)
    for bad in (float("nan"), float("inf"), float("-inf")):
        tensors = {f"layers.{i}.keys": torch.ones(1, 2, 700, 8, dtype=dtype) for i in range(4)}
        tensors["layers.3.keys"][0, 1, 699, 7] = bad  # the file's last value
        loaded, scan, _ = _scanned(tmp_path / "kv.safetensors", tensors, dtype)
        assert not scan.covers(loaded["layers.3.keys"])
        assert scan.covers(loaded["layers.1.keys"])  # far from the header and from the bad value
        with pytest.raises(UnsafeTensorError) as e:
            check_finite(loaded, 0, 700, "artifact a", scanned=scan)
        assert f"artifact a: tensor layers.3.keys holds {bad} at position 699 (index [0, 1, 699, 7])" in e.value.message


def test_a_scan_that_marks_too_many_blocks_covers_nothing_and_check_finite_still_names_the_first(tmp_path: Path) -> None:
    from kvgraft.engine import UnsafeTensorError
    from kvgraft.engine._internal.artifacts import FiniteScan, check_finite

    tensors = {f"layers.{i}.keys": torch.ones(1, 1, 1024, 8) for i in range(16)}  # 32 KiB each
    for i in range(16):
        tensors[f"layers.{i}.keys"][0, 0, :700:128] = float("nan")  # 6 NaNs, 4 KiB apart
    tensors["z.clean"] = torch.ones(1, 1, 1024, 8)  # last, 2 KiB past the last NaN's block
    loaded, scan, _ = _scanned(tmp_path / "kv.safetensors", tensors, torch.float32)
    assert 16 * 6 > FiniteScan.MAX_MARKED
    assert not any(scan.covers(t) for t in loaded.values())  # z.clean too: the scan gave up
    with pytest.raises(UnsafeTensorError) as e:
        check_finite(loaded, 0, 1024, "artifact a", scanned=scan)
    assert "artifact a: tensor layers.0.keys holds nan at position 0 (index [0, 0, 0, 0])" in e.value.message


def test_a_scan_that_sees_its_chunks_out_of_order_covers_nothing() -> None:
    from kvgraft.engine._internal.artifacts import FiniteScan

    data = memoryview(bytearray(torch.ones(4096).numpy().tobytes()))  # 16 KiB of finite float32
    scan = FiniteScan(torch.float32)
    scan(data[:4096])
    scan(data[8192:])  # a chunk skipped
    whole = torch.frombuffer(data, dtype=torch.float32)
    assert not scan.covers(whole[:1024]) and not scan.covers(whole)


def test_graft_refuses_token_ids_outside_the_vocabulary_naming_the_position(
    tmp_path: Path, key: Path, trust_file: Path, texts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvgraft.engine import chain_key, token_digest

    prefix, question = texts
    assert _run(capsys, "capture", "--model", "tiny-llama-test", "--text-file", prefix, "--out", tmp_path / "a", "--key", key)[0] == 0
    p = _statement(tmp_path / "a").predicate
    ids = list(p.tokens.ids)
    ids[5] = 1_000_000
    _resign(tmp_path / "a", key, tokens=p.tokens.model_copy(update={"ids": ids, "digest": token_digest(ids)}),
            chain_key=chain_key(None, p.model, p.tokenizer_digest, p.profile, ids))
    result, err = _refused(capsys, "graft", "--artifact", tmp_path / "a", "--text-file", question, "--trusted-keys", trust_file)
    assert result["error"] == "UnsafeTensorError"
    assert "token id 1000000 at position 5 is outside the model's vocabulary of 259 ids" in err


def _broken(tiny: Any, change: Callable[[Any], None]) -> Any:
    from kvgraft.engine import LoadedModel

    module = copy.deepcopy(tiny.module)
    change(module)
    return LoadedModel(tiny.spec, module, tiny.tokenizer, tiny.ref, tiny.tokenizer_digest)


def test_capture_refuses_a_nan_state_and_token_ids_outside_the_vocabulary_and_writes_nothing(
    tmp_path: Path, tiny: Any, profile: Any, key: Path
) -> None:
    from kvgraft.engine import UnsafeTensorError, capture

    def poison(module: Any) -> None:
        with torch.no_grad():
            module.model.layers[0].self_attn.k_proj.weight[0, 0] = float("nan")

    with pytest.raises(UnsafeTensorError, match=r"tensor layers\.\d\.(keys|values) holds nan at position 0"):
        capture(_broken(tiny, poison), profile, "Some text.", tmp_path / "nan", key=key)
    assert not (tmp_path / "nan").exists()

    def shrink(module: Any) -> None:
        module.config.vocab_size = 50  # the tokenizer's byte ids (b + 3) reach past it

    with pytest.raises(UnsafeTensorError, match="token id .* at position 1 is outside the model's vocabulary of 50 ids"):
        capture(_broken(tiny, shrink), profile, "zzz", tmp_path / "vocab", key=key)
    assert not (tmp_path / "vocab").exists()


def test_graft_on_a_signed_parent_cycle_is_a_one_line_refusal_not_a_recursion_error(
    tmp_path: Path, tiny: Any, profile: Any, key: Path, trust_file: Path, texts: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvgraft.engine import capture, load_artifact, trust_signer

    _, question = texts
    chain = tmp_path / "chain"
    capture(tiny, profile, "Root text.", chain / "root", key=key)
    capture(tiny, profile, " Child text.", chain / "child", key=key,
            parent=load_artifact(chain / "root", tiny, profile, trusted=trust_signer(key)))
    # Re-signed: the root names the child as its parent; the child names the root.
    _resign(chain / "root", key, parent=_kv_digest(chain / "child"))
    result, err = _refused(capsys, "graft", "--artifact", chain / "child", "--text-file", question, "--trusted-keys", trust_file)
    assert result["error"] == "LineageError" and "its parent chain is a cycle" in err and "already in the chain" in err
    # An artifact that is its own parent.
    capture(tiny, profile, "Alone.", tmp_path / "self" / "a", key=key)
    _resign(tmp_path / "self" / "a", key, parent=_kv_digest(tmp_path / "self" / "a"))
    result, err = _refused(capsys, "graft", "--artifact", tmp_path / "self" / "a", "--text-file", question, "--trusted-keys", trust_file)
    assert result["error"] == "LineageError" and "cycle" in err


def test_a_parent_chain_deeper_than_the_limit_is_refused(tmp_path: Path, tiny: Any, profile: Any, key: Path) -> None:
    from kvgraft.engine import DEFAULT_MAX_CHAIN_DEPTH, LineageError, capture, load_artifact, trust_signer

    trusted = trust_signer(key)
    parent = None
    for i in range(3):
        capture(tiny, profile, f" part {i}.", tmp_path / "c" / f"a{i}", key=key, parent=parent)
        parent = load_artifact(tmp_path / "c" / f"a{i}", tiny, profile, trusted=trusted)
    assert len(parent.chain) == 3 and DEFAULT_MAX_CHAIN_DEPTH == 256
    with pytest.raises(LineageError, match="its parent chain is longer than 2 artifacts"):
        load_artifact(tmp_path / "c" / "a2", tiny, profile, trusted=trusted, max_depth=2)


def test_graft_refuses_a_child_that_does_not_start_at_its_parents_end(
    tmp_path: Path, tiny: Any, profile: Any, key: Path
) -> None:
    from kvgraft.engine import LineageError, capture, load_artifact, trust_signer

    trusted = trust_signer(key)
    chain = tmp_path / "chain"
    capture(tiny, profile, "Root text.", chain / "root", key=key)
    root = load_artifact(chain / "root", tiny, profile, trusted=trusted)
    capture(tiny, profile, " Child text.", chain / "child", key=key, parent=root)
    p = _statement(chain / "child").predicate
    gap = p.positions.model_copy(update={"start": p.positions.start + 2, "end": p.positions.end + 2})
    _resign(chain / "child", key, positions=gap)
    end = root.statement.predicate.positions.end
    with pytest.raises(LineageError, match=f"starts at position {end + 2}, but its parent sha256:[0-9a-f]+ ends at {end}"):
        load_artifact(chain / "child", tiny, profile, trusted=trusted)


def test_deposit_into_an_existing_library_verifies_its_prefix_first(
    tmp_path: Path, library: tuple[Path, Any], key: Path, trust_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lib, _ = library
    five = tmp_path / "five.jsonl"
    five.write_text("".join(GSM8K_TRAIN.read_text().splitlines(keepends=True)[:5]))
    deposit = ["library", "deposit", "--model", "tiny-llama-test", "--dataset", five, "--library", lib, "--key", key, "--limit", "4"]
    result, err = _refused(capsys, *deposit)
    assert result["error"] == "NoTrustedKeysError" and "--trusted-keys FILE" in err
    _zero_signature(lib / "prefix")
    result, _ = _refused(capsys, *deposit, "--trusted-keys", trust_file)
    assert result["error"] == "ArtifactSignatureError" and len(_index(lib)) == 3  # nothing chained onto a forged prefix
