"""Regression tests for issue 37's surface findings (subject names, audit trust, trailers, the S3
budget, ``serve --data``, tampered local copies, file modes, messages), each named after its bug."""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgraft.schemas import DocumentError, canonical_json, check_subject_names, parse_statement
from kvgraft.verifier import envelope_json, ephemeral_signing_key, sign_envelope
from tests.registry.conftest import Key, Server, artifact, free_port, harness, registry_cli, running_server

# --- subject names that cannot be files ------------------------------------------------------------

#: (subject names, what the refusal says): each was accepted (201) and then broke `kvgraft report`.
BAD_SUBJECTS = {
    "file-and-folder": (["kv.safetensors", "x", "x/y"], "is a file, and subject 'x/y' needs it to be a folder"),
    "envelope-name": (["kv.safetensors", "statement.dsse.json"], "takes the place of statement.dsse.json"),
    "log-proof-name": (["kv.safetensors", "log.json/a"], "takes the place of log.json"),
    "long-component": (["kv.safetensors", "a" * 300], "has a part of 300 bytes; the limit is 255"),
    "nul": (["kv.safetensors", "a\0b"], "holds a NUL, control character or backslash"),
    "2000-levels": (["kv.safetensors", "/".join(["d"] * 2000)], "bytes long; the limit is 1024"),
    "deep": (["kv.safetensors", "/".join(["d"] * 17)], "is 17 levels deep; the limit is 16"),
    "case-clash": (["kv.safetensors", "Kv.Safetensors"], "are the same file on some file systems"),
}


def _raw_envelope(key: Key, names: list[str]) -> bytes:
    """A signed artifact envelope whose statement names ``names`` (built as raw JSON: the typed
    model refuses them)."""
    statement = json.loads(canonical_json(artifact("names").statement.model_dump(mode="json", by_alias=True)))
    statement["subject"] = [{"name": n, "digest": {"sha256": "ab" * 32}} for n in names]
    with ephemeral_signing_key(key.private) as signer:
        return envelope_json(sign_envelope(json.dumps(statement).encode(), [signer]))


@pytest.mark.parametrize(("names", "message"), BAD_SUBJECTS.values(), ids=BAD_SUBJECTS.keys())
def test_publish_regression_subject_names_that_cannot_be_files_were_201(
    tmp_path: Path, rkeys: dict[str, Key], names: list[str], message: str
) -> None:
    # Was: 201, after which `kvgraft report` over the entry failed (a RecursionError traceback for
    # 2,000 levels). Now the one subject-name rule refuses it at publish: 422 naming the problem.
    with harness(tmp_path / "data", rkeys) as reg:
        r = reg.publish(_raw_envelope(rkeys["alice"], names))
        assert r.status_code == 422, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
        assert message in r.json()["detail"], r.json()
        assert reg.client.get("/v1/entries").json()["items"] == []


@pytest.mark.parametrize(("names", "message"), BAD_SUBJECTS.values(), ids=BAD_SUBJECTS.keys())
def test_subject_name_rule_regression_one_rule_for_parse_and_writers(names: list[str], message: str) -> None:
    # The same rule refuses the statement when parsed (every reader) and the names themselves
    # (every writer: the staged-directory writer and the client's paths call it too).
    with pytest.raises(DocumentError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_subject_names(names)
    statement = json.loads(canonical_json(artifact("names").statement.model_dump(mode="json", by_alias=True)))
    statement["subject"] = [{"name": n, "digest": {"sha256": "ab" * 32}} for n in names]
    with pytest.raises(DocumentError, match="subject"):
        parse_statement(json.dumps(statement).encode())


def test_subject_name_rule_regression_real_names_still_pass() -> None:
    check_subject_names(["kv.safetensors", "logits/" + "ab" * 32 + ".f32", "outputs.jsonl", "model.sig"])


# --- chunked-body trailers past the header limits ----------------------------------------------------

MIB = 1 << 20


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def _read_until_closed(sock: socket.socket, deadline: float) -> bytes:
    data = b""
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        data += chunk
    return data


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data = tmp_path_factory.mktemp("trailers") / "data"
    data.mkdir()
    with running_server(data) as server:
        yield server


@pytest.mark.parametrize("trailers", ["one-huge", "many-large"])
def test_http_regression_chunked_trailers_bypassed_the_header_limits(live: Server, trailers: str) -> None:
    # Was: six 64 MiB trailers on a chunked checkpoint read took it from 6 ms to 2.8 s and the
    # server's RSS to 694 MB, 669 MB still held afterwards. Now trailers count against the
    # header limits (32 KiB, 100 fields): refused with a 431 after about the limit.
    before = _rss_bytes(live.pid)
    sent = 0
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/entries HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n0\r\n"
        )
        with contextlib.suppress(BrokenPipeError, ConnectionResetError, TimeoutError):
            for n in range(6):
                sock.sendall(b"X-Trailer-%d: " % n)
                for _ in range(64 if trailers == "one-huge" else 1):
                    sock.sendall(b"a" * MIB)
                    sent += MIB
                sock.sendall(b"\r\n")
            sock.sendall(b"\r\n")
        answer = _read_until_closed(sock, time.monotonic() + 10)
    elapsed = time.monotonic() - start
    assert sent < 32 * MIB, f"the server read {sent} bytes of trailers before refusing them"
    assert elapsed < 15, elapsed
    assert b"HTTP/1.1 431 " in answer, answer[:300]
    detail = json.loads(answer[answer.index(b"HTTP/1.1 431 "):].partition(b"\r\n\r\n")[2])["detail"]
    assert "headers and chunked-body trailers are over 32768 bytes" in detail
    # Memory is not held: the refused connection's trailer was never gathered past the limit.
    assert _rss_bytes(live.pid) - before < 48 * MIB, (before, _rss_bytes(live.pid))
    t = time.monotonic()
    assert httpx.get(live.url + "/v1/log/checkpoint", timeout=10).status_code == 200
    assert time.monotonic() - t < 1.0


def test_http_regression_many_small_trailers_are_counted_as_headers(live: Server) -> None:
    request = (
        b"POST /v1/entries HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n"
        + b"".join(b"X-T%d: v\r\n" % i for i in range(20_000))
        + b"\r\n"
    )
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(request)
        answer = _read_until_closed(sock, time.monotonic() + 10)
    assert b"HTTP/1.1 431 " in answer, answer[:300]
    assert b"more than 100 headers" in answer


def test_http_regression_small_trailers_are_still_served(live: Server) -> None:
    request = (
        b"GET /v1/log/checkpoint HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        b"0\r\nX-Checksum: abc\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        sock.sendall(request)
        answer = _read_until_closed(sock, time.monotonic() + 10)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


# --- kvgraft serve --data DIR: a missing DIR, an empty one, a failed start ---------------------------


def test_serve_regression_a_mistyped_data_dir_started_a_new_registry(tmp_path: Path) -> None:
    # Was: a missing DIR was created with a new registry key and log, even when the start then failed.
    typo = tmp_path / "regsitry"
    done = registry_cli("serve", "--data", typo, "--port", str(free_port()), timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [
        f"kvgraft: ConfigError: the data directory {typo} does not exist (hint: check the path for an existing "
        f"registry; to start a new one there, create it (mkdir {typo}) or pass --init)"
    ]
    assert not typo.exists()


@pytest.mark.parametrize("existing", [False, True], ids=["init", "empty-dir"])
def test_serve_regression_a_failed_start_left_a_new_registry_behind(tmp_path: Path, existing: bool) -> None:
    # Was: the data directory was initialised (key, database) before the port was bound.
    data = tmp_path / "new"
    if existing:
        data.mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = registry_cli("serve", "--data", data, "--init", "--port", str(port), timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"kvgraft: ConfigError: cannot listen on 127.0.0.1:{port}: " in done.stderr
    assert "nothing was started or created" in done.stderr and "pass another --port" in done.stderr
    assert len(done.stderr.splitlines()) == 1
    assert (list(data.iterdir()) == []) if existing else not data.exists()


def test_serve_regression_an_empty_data_dir_is_initialised_and_says_so(tmp_path: Path) -> None:
    data = tmp_path / "empty"
    data.mkdir()
    with running_server(data) as server:
        assert httpx.get(server.url + "/v1/log/checkpoint", timeout=10).status_code == 200
        log = server.log()
    assert f"initialised a new registry in {data} (the directory was empty): a new registry key" in log
    assert (data / "registry-key.pem").exists()
    # A second start over the same directory initialises nothing and says nothing of it.
    with running_server(data) as server:
        log = server.log()
    assert "initialised a new registry" not in log


# --- publishing a corrupt local copy --------------------------------------------------------------------


def test_publish_regression_a_tampered_copy_whose_blob_the_registry_has_exited_0(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    # Was: the blob was skipped (the registry has it), the envelope answered 200 (already logged),
    # and the user was never told that their copy no longer matches what they signed.
    from tests.reliability.servers import make_token

    art = artifact("a copy that rots")
    good = tmp_path / "good"
    good.mkdir()
    (good / "kv.safetensors").write_bytes(art.tensors)
    (good / "statement.dsse.json").write_bytes(rkeys["alice"].sign(art.statement))
    data = tmp_path / "data"
    with running_server(data) as server:
        token, _ = make_token(server, "alice", rkeys["alice"])
        common = ["--registry", server.url, "--token", token, "--registry-key", data / "registry-key.pub.pem"]
        first = registry_cli("publish", *common, good, timeout=120)
        assert first.returncode == 0, first.stderr
        bad = tmp_path / "bad"
        bad.mkdir()
        (bad / "statement.dsse.json").write_bytes((good / "statement.dsse.json").read_bytes())
        tensors = bytearray(art.tensors)
        tensors[100] ^= 0x01
        (bad / "kv.safetensors").write_bytes(bytes(tensors))
        done = registry_cli("publish", *common, bad, timeout=120)
        entries = httpx.get(server.url + "/v1/entries", timeout=10).json()["items"]
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    got = "sha256:" + hashlib.sha256(bytes(tensors)).hexdigest()
    assert f"your local copy is corrupt: kv.safetensors in {bad} hashes to {got}, but the signed statement names {art.digest}" in done.stderr
    assert "nothing was published" in done.stderr and "kvgraft pull" in done.stderr
    assert len(entries) == 1


# --- file modes of what a registry keeps secret ---------------------------------------------------------


def test_registry_regression_database_was_created_world_readable(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    # Was: registry.duckdb (token hashes, every publisher's metadata) was created 0644, and a data
    # directory made with mkdir stayed 0755, so any user of the host could read it.
    import stat

    from tests.reliability.servers import make_token

    def private(path: Path) -> bool:
        return stat.S_IMODE(path.stat().st_mode) & 0o077 == 0

    data = tmp_path / "data"
    data.mkdir()
    data.chmod(0o755)
    with running_server(data) as server:
        make_token(server, "alice", rkeys["alice"])  # a write: the token's hash goes to the database (and its WAL)
        # Everything but the public key (meant to be handed out) is the owner's alone.
        files = sorted(p for p in data.iterdir() if p.is_file() and p.name != "registry-key.pub.pem")
        assert data / "registry.duckdb" in files
        for path in files:
            assert private(path), f"{path.name} has mode {stat.S_IMODE(path.stat().st_mode):04o}"
    assert stat.S_IMODE(data.stat().st_mode) == 0o700
    assert private(data / "registry.duckdb")

    # An admin command that creates the database (no server running) makes it 0600 too.
    admin = tmp_path / "admin"
    done = registry_cli("key", "add", "--data", admin, "--publisher", "alice", "--public-key", rkeys["alice"].pub_path)
    assert done.returncode == 0, done.stderr
    assert private(admin / "registry.duckdb") and stat.S_IMODE(admin.stat().st_mode) == 0o700


# --- report clashes blamed the disk -------------------------------------------------------------------


def test_report_regression_the_same_entry_twice_blamed_the_disk(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    # Was: "--entry 0 --entry <its digest>" made the same folder twice and failed with
    # "cannot write OUT: File exists (hint: check that the directory is writable)".
    from tests.reliability.servers import make_token, post_entry, put_blob

    art = artifact("reported twice")
    data = tmp_path / "data"
    with running_server(data) as server:
        token, _ = make_token(server, "alice", rkeys["alice"])
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert put_blob(client, token, art.tensors).status_code == 201
            posted = post_entry(client, token, rkeys["alice"].sign(art.statement))
            assert posted.status_code == 201, posted.text
        digest = posted.json()["entry"]["digest"]
        out = tmp_path / "report"
        done = registry_cli("report", "--registry", server.url, "--registry-key", data / "registry-key.pub.pem",
                            "--out", out, "--entry", "0", "--entry", digest, "--entry", "0", timeout=120)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in (out / "artifacts").iterdir()] == [digest.removeprefix("sha256:")[:16]]


def test_local_write_regression_a_name_clash_was_blamed_on_the_disk(tmp_path: Path) -> None:
    from kvgraft.registry.client import local_write_error

    (tmp_path / "x").write_bytes(b"a file where a folder is wanted")
    with pytest.raises(OSError) as info:
        (tmp_path / "x" / "y").mkdir(parents=True)
    error = local_write_error(info.value, tmp_path / "x" / "y" / "z")
    assert f"{tmp_path / 'x' / 'y'} clashes with a file or folder already there" in error.message
    assert "writable" not in str(error) and "two files want the same path" in str(error)


# --- signature refusals name the signer; the trusted-keys hint ------------------------------------------


def test_signature_regression_refusals_did_not_name_the_signer(rkeys: dict[str, Key]) -> None:
    # Was: "none of the envelope's 1 signature(s) verifies with any of the 1 trusted key(s)": no
    # name, no keyid, so a user could not tell whose key was missing from their file.
    from kvgraft.verifier import (
        BadSignatureError,
        TrustedKeys,
        UnknownKeyError,
        keyid_of,
        parse_envelope,
        trusted_key,
        verify_envelope,
    )

    alice = trusted_key("alice", rkeys["alice"].private.public_key())
    eve_id = keyid_of(rkeys["eve"].private.public_key())
    by_eve = parse_envelope(rkeys["eve"].sign(artifact("signed by eve").statement), source="test")
    with pytest.raises(UnknownKeyError) as info:
        verify_envelope(by_eve, TrustedKeys((alice,)))
    assert f"trusted key(s) (alice keyid {alice.keyid[:16]}...)" in info.value.message
    assert f"its signatures claim keyid(s) {eve_id[:16]}..." in info.value.message
    # A signature that claims alice's key but does not verify with it names alice.
    doc = json.loads(rkeys["alice"].sign(artifact("altered").statement))
    doc["payload"] = doc["payload"][:-4] + ("AAAA" if doc["payload"][-4:] != "AAAA" else "BBBB")
    altered = parse_envelope(json.dumps(doc).encode(), source="test")
    with pytest.raises(BadSignatureError, match=rf"the signature by trusted key alice keyid {alice.keyid[:16]}\.\.\. does not verify"):
        verify_envelope(altered, TrustedKeys((alice,)))


def test_trusted_keys_regression_missing_file_hint_spoke_of_a_private_key(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    # Was: "(hint: pass a PEM key written by 'kvgraft keys generate' ... and its passphrase)".
    from kvgraft.verifier import KeyFileError, load_trusted_keys

    with pytest.raises(KeyFileError) as info:
        load_trusted_keys(tmp_path / "trusted-keys.json")
    assert info.value.message == f"trusted-keys file {tmp_path / 'trusted-keys.json'} does not exist"
    assert "passphrase" not in str(info.value) and "private" not in str(info.value)
    assert "kvgraft keys trust --file FILE --name NAME --public-key KEY.pub" in (info.value.hint or "")


def test_publish_regression_signature_refusal_did_not_name_the_signer(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    # Was: "the envelope's signature by a registered key does not verify over its payload": which key, whose?
    from kvgraft.verifier import keyid_of
    from tests.registry.conftest import tampered

    alice_id = keyid_of(rkeys["alice"].private.public_key())
    with harness(tmp_path / "data", rkeys) as reg:
        r = reg.publish(tampered(rkeys["alice"].sign(artifact("altered after signing").statement)))
        assert r.status_code == 422, r.text
        assert r.json()["type"].endswith("/invalid-signature")
        assert f"signature claiming key {alice_id[:16]}... of publisher 'alice' does not verify" in r.json()["detail"]


def test_sign_regression_a_subject_name_the_rule_refuses_is_one_line(tmp_path: Path, rkeys: dict[str, Key]) -> None:
    # The one subject-name rule applies to 'kvgraft sign' too, before anything is signed: one line, no traceback.
    (tmp_path / "log.json").write_text("a file named like the log proof\n")
    (tmp_path / "predicate.json").write_text("{}")
    out = tmp_path / "out.dsse.json"
    done = registry_cli("sign", "--key", rkeys["alice"].path, "--subject", tmp_path / "log.json", "--predicate-type",
                        "https://example.com/p", "--predicate", tmp_path / "predicate.json", "--out", out)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("kvgraft: CliError: cannot sign these subjects: subject name 'log.json' takes the place of log.json")
    assert not out.exists()
