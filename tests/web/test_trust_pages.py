"""The provenance pages against hostile data: shell-safe commands, visible escapes, bounded work.

A registry is filled with entries a stranger could publish (subject names holding ``$()``,
backticks, ``;``, newlines and quotes; names and texts holding bidi and zero-width characters)
and with old data the publish path now refuses, appended through the registry's own log while
no server runs (a parent cycle, an exactness sample index of 2**1024, an envelope with more
signatures than the limit, payloads that do not decode or nest 5,000 deep). The pages are then
read from a real ``kvgraft serve`` on 127.0.0.1 and in process.
"""

from __future__ import annotations

import base64
import hashlib
import html as htmllib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgraft.registry import RegistrySettings
from kvgraft.registry._internal.accounts import TokenInfo
from kvgraft.registry._internal.entries import IndexedStatement, index_statement
from kvgraft.registry._internal.http import signatures
from kvgraft.registry._internal.http.security import scrub_paths
from kvgraft.registry._internal.service import Registry
from kvgraft.schemas import ExactnessSample
from kvgraft.verifier import envelope_json, ephemeral_signing_key, sign_envelope
from kvgraft.web._internal.render import invisible_pattern
from tests.registry.conftest import (
    Artifact,
    Harness,
    Key,
    Server,
    artifact,
    exactness_record,
    harness,
    running_server,
    subject,
)

from .conftest import World

MARK = "pwned"
#: Subject names a stranger may sign: each is a valid relative path (no '', '.', '..' parts).
HOSTILE_NAMES = [
    f"dollar$(touch {MARK})x",
    f"tick`touch {MARK}`",
    f"semi;touch {MARK};",
    # A newline in a name is refused at publish now (kvgraft.schemas check_subject_name): no page can show one.
    f"quote'\"; touch {MARK} #",
    f"sub dir/$(touch {MARK})/deep file",
    "bidi\u202egpj.exe",
    "zero\u200bwidth\ufeff",
    "-rf",
]
#: A Host header the server accepts (one with shell syntax is refused before any page renders).
HOSTILE_HOST = "evil.example:4444"
BIDI_TEXT = "admin\u202e\u2066txt.exe\u2069 and zero\u200b\u200c\u200dwidth\u200e\u200f and \x1b[31mred"
SHELL_STUBS = ("curl", "mkdir", "kvgraft-verify", "kvgraft", "touch", "rm", "sh", "bash", "cat")


@dataclass(frozen=True)
class TrustWorld:
    """What the hostile fixture stored, to navigate by."""

    hostile: Artifact
    hostile_record: str
    bidi: Artifact
    chain: list[Artifact]
    cycle: tuple[str, str]
    huge_index: str
    odd_values: str
    many_signatures: str
    undecodable: str
    deep: str
    entries: int


# --- building hostile data ---------------------------------------------------------------------


def _sign_bytes(key: Key, payload: bytes) -> bytes:
    with ephemeral_signing_key(key.private) as signer:
        return envelope_json(sign_envelope(payload, [signer]))


def _append_old(registry: Registry, envelope: bytes, indexed: IndexedStatement, publisher: str) -> str:
    """Log ``envelope`` as the registry's own publish path does, without its checks (old data)."""
    digest = "sha256:" + hashlib.sha256(envelope).hexdigest()
    token = TokenInfo(token_id="tok_old_data", publisher=publisher, keyids=())
    with registry.db.lock:
        registry.publisher._append(envelope, digest, "application/vnd.in-toto+json", indexed, token, [])
    return digest


def _cycle(registry: Registry, alice: Key) -> tuple[str, str]:
    # Two artifacts, each the other's parent: impossible to publish now, possible in old data.
    a0, b0 = artifact("cycle member a"), artifact("cycle member b")
    a_pred = a0.statement.predicate.model_copy(update={"parent": b0.digest})
    b_pred = b0.statement.predicate.model_copy(update={"parent": a0.digest})
    a = a0.statement.model_copy(update={"predicate": a_pred})
    b = b0.statement.model_copy(update={"predicate": b_pred})
    for statement in (a, b):
        _append_old(registry, alice.sign(statement), index_statement(statement), "alice")
    return a0.digest, b0.digest


def _huge_index(registry: Registry, alice: Key, prefix: Artifact, *, odd_floats: bool) -> str:
    # A sample index of 2**1024 (no float holds it) and 400-digit token counts; with
    # ``odd_floats`` also a KL of 2**1100 where a float belongs, which no longer parses.
    statement = exactness_record(prefix, b"huge-logits")
    sample = statement.predicate.samples[0]
    odd = ExactnessSample.model_construct(**{**dict(sample), "index": 2**1024, "prefix_tokens": 10**400})
    statement = statement.model_copy(update={"predicate": statement.predicate.model_copy(update={"samples": [odd]})})
    doc = statement.model_dump(mode="json", by_alias=True)
    if odd_floats:
        doc["predicate"]["summary"]["max_kl_divergence"] = 10**400
        doc["predicate"]["samples"][0]["kl_divergence"] = 2**1100
    return _append_old(registry, _sign_bytes(alice, json.dumps(doc).encode()), index_statement(statement), "alice")


def _many_signatures(registry: Registry, alice: Key, count: int) -> str:
    # One good signature and many garbage ones, as the signature bomb of issue 14 finding 3.
    statement = artifact("signed many times").statement
    doc = json.loads(alice.sign(statement))
    doc["signatures"] += [
        {"keyid": f"{i:064x}", "sig": base64.b64encode(os.urandom(64)).decode()} for i in range(count - 1)
    ]
    return _append_old(registry, json.dumps(doc).encode(), index_statement(statement), "alice")


def _raw_record(registry: Registry, alice: Key, payload: bytes) -> str:
    # A record whose payload no longer reads as a statement (a bug or an older schema).
    indexed = IndexedStatement(kind="exactness", predicate_type="https://kvgraft.dev/exactness/v1", subjects=[])
    return _append_old(registry, _sign_bytes(alice, payload), indexed, "alice")


def publish_trust_world(h: Harness, alice: Key) -> TrustWorld:
    """Publish what a stranger can through ``h``'s API (the old-data fields are left empty)."""
    base = artifact("hostile subject names")
    files = {name: f"file {i}".encode() for i, name in enumerate(HOSTILE_NAMES)}
    hostile = Artifact(
        base.tensors,
        base.statement.model_copy(
            update={"subject": [*base.statement.subject, *(subject(n, d) for n, d in files.items())]}
        ),
    )
    for data in files.values():
        assert h.put_blob(data).status_code in (200, 201)
    h.publish_artifact(hostile, alice)
    record = exactness_record(hostile, b"hostile-logits")
    record = record.model_copy(update={"subject": [subject(n, d) for n, d in files.items()]})
    r = h.publish(alice.sign(record))
    assert r.status_code == 201, r.text
    hostile_record = r.json()["entry"]["digest"]

    bidi0 = artifact(BIDI_TEXT)
    bidi_pred = bidi0.statement.predicate.model_copy(
        update={"model": bidi0.statement.predicate.model.model_copy(update={"name": "model\u202eevil\u200b"})}
    )
    bidi = Artifact(bidi0.tensors, bidi0.statement.model_copy(update={"predicate": bidi_pred}))
    h.publish_artifact(bidi, alice)

    chain = [artifact("chain link 0")]
    for i in range(1, 20):
        chain.append(artifact(f"chain link {i}", parent=chain[-1]))
    for link in chain:
        h.publish_artifact(link, alice)
    return TrustWorld(hostile, hostile_record, bidi, chain, ("", ""), "", "", "", "", "", 0)


@pytest.fixture(scope="module")
def trust_data(tmp_path_factory: pytest.TempPathFactory, web_keys: dict[str, Key]) -> tuple[Path, TrustWorld]:
    """A data directory with the hostile world: published for real, then old data appended offline."""
    data = tmp_path_factory.mktemp("trust") / "data"
    alice = web_keys["alice"]
    with harness(data, web_keys) as h:
        world = publish_trust_world(h, alice)
    with Registry.open(data, RegistrySettings()) as registry:
        cycle = _cycle(registry, alice)
        huge = _huge_index(registry, alice, world.chain[0], odd_floats=False)
        odd = _huge_index(registry, alice, world.chain[1], odd_floats=True)
        many = _many_signatures(registry, alice, 40)
        undecodable = _raw_record(registry, alice, b"\xff\xfe not json at all")
        deep = _raw_record(registry, alice, b'{"predicate": ' + b"[" * 5000 + b"]" * 5000 + b"}")
        size = registry.head.size
    world = TrustWorld(
        world.hostile, world.hostile_record, world.bidi, world.chain, cycle, huge, odd, many, undecodable, deep, size
    )
    return data, world


@pytest.fixture
def trust_ui(trust_data: tuple[Path, TrustWorld], web_keys: dict[str, Key]) -> Iterator[tuple[Harness, TrustWorld]]:
    """The hostile world in process, with a configured public URL (one test at a time: it holds the database)."""
    data, world = trust_data
    with harness(data, web_keys, public_url="https://registry.example/kv") as h:
        yield h, world


@pytest.fixture(scope="module")
def trust_live(
    trust_data: tuple[Path, TrustWorld], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, TrustWorld]]:
    """``kvgraft serve`` over a copy of the hostile world (so in-process tests can open the original)."""
    data, world = trust_data
    copy = tmp_path_factory.mktemp("trust-live") / "data"
    shutil.copytree(data, copy)
    with running_server(copy) as server:
        yield server, world


# --- running pasted commands safely --------------------------------------------------------------


def _command_block(page: str, block: str) -> str:
    found = re.search(rf'<pre class="cmd" id="cmd-{block}"><code>(.*?)</code></pre>', page, re.S)
    assert found, f"no command block {block!r} on the page"
    return htmllib.unescape(found.group(1))


def _run_with_stubs(block: str, tmp_path: Path, **env: str) -> tuple[list[list[str]], subprocess.CompletedProcess[str]]:
    """Run ``block`` under bash with a PATH of recording stubs only; return every command's argv.

    Each stub appends its argv as one JSON line and does nothing else, so an injected command
    (``touch``, or any name bash cannot find) shows up in the record instead of running.
    """
    stubs = tmp_path / "stubs"
    stubs.mkdir(parents=True)
    log = tmp_path / "calls.jsonl"
    for name in SHELL_STUBS:
        stub = stubs / name
        stub.write_text(
            f"#!{sys.executable}\nimport json, os, sys\n"
            "with open(os.environ['CALLS'], 'a') as f:\n"
            "    f.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + '\\n')\n"
        )
        stub.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    prelude = 'command_not_found_handle() { printf "%s\\n" "UNKNOWN $1" >> "$CALLS"; return 127; }\n'
    syntax = subprocess.run(["/bin/bash", "-n", "-c", block], capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr
    done = subprocess.run(
        ["/bin/bash", "-c", prelude + block],
        cwd=work,
        env={"PATH": str(stubs), "CALLS": str(log), "HOME": str(work), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = log.read_text().splitlines() if log.exists() else []
    assert not [line for line in lines if line.startswith("UNKNOWN")], lines
    calls = [json.loads(line) for line in lines]
    assert not (work / MARK).exists() and not list(work.rglob(MARK)), "an injected command ran"
    assert [c for c in calls if c[0] not in ("curl", "mkdir", "kvgraft-verify", "kvgraft")] == [], calls
    # One command per line: no value broke a line, none added a command.
    assert len(calls) == len(block.splitlines()), (calls, block)
    return calls, done


def _expected_fetches(base: str, directory: str, names: dict[str, str]) -> list[list[str]]:
    return [["curl", "-fsS", "-o", f"{directory}/{n}", f"{base}/v1/blobs/{d}"] for n, d in names.items()]


def _subjects(h_or_server: Any, digest: str) -> dict[str, str]:
    doc = h_or_server.get(f"/v1/entries/{digest}").json()
    return {s["name"]: s["digest"] for s in doc["entry"]["subjects"]}


def test_subject_names_with_shell_syntax_and_a_hostile_host_header_cannot_inject_a_command(
    trust_live: tuple[Server, TrustWorld], tmp_path: Path
) -> None:
    server, world = trust_live
    with httpx.Client(base_url=server.url, timeout=30) as client:
        page = client.get(f"/artifacts/{world.hostile.digest}", headers={"Host": HOSTILE_HOST})
        assert page.status_code == 200, page.text
        entry_digest = client.get(f"/v1/artifacts/{world.hostile.digest}").json()["entry"]["digest"]
        names = _subjects(client, entry_digest)
    assert "evil.example" not in page.text
    block = _command_block(page.text, "verify")
    assert "\u202e" not in block and "\u200b" not in block  # bidi and zero-width written as \xHH escapes
    calls, _ = _run_with_stubs(block, tmp_path)
    # The server's own bind address, never the Host header; each value exactly one argument.
    for expected in _expected_fetches(server.url, "art", names):
        assert expected in calls, (expected, calls)
    mkdir = next(c for c in calls if c[0] == "mkdir")
    assert mkdir == ["mkdir", "-p", f"art/sub dir/$(touch {MARK})"]
    assert [
        "curl",
        "-fsS",
        "-o",
        "art/statement.dsse.json",
        f"{server.url}/v1/entries/{entry_digest}/envelope",
    ] in calls
    assert [
        "kvgraft-verify",
        "envelope",
        "art/statement.dsse.json",
        "--trusted-keys",
        "trusted-keys.json",
        "--artifact-dir",
        "art",
    ] in calls
    pull_calls, _ = _run_with_stubs(_command_block(page.text, "pull"), tmp_path / "pull")
    assert pull_calls == [
        [
            "kvgraft",
            "pull",
            "--registry",
            server.url,
            world.hostile.digest,
            "--out",
            "art",
            "--trusted-keys",
            "trusted-keys.json",
        ]
    ]


def test_record_and_log_commands_quote_every_value_and_ignore_the_host_header(
    trust_live: tuple[Server, TrustWorld], tmp_path: Path
) -> None:
    server, world = trust_live
    with httpx.Client(base_url=server.url, timeout=30) as client:
        page = client.get(f"/records/{world.hostile_record}", headers={"Host": HOSTILE_HOST})
        log_page = client.get("/log?old=2&new=5", headers={"Host": HOSTILE_HOST})
        names = _subjects(client, world.hostile_record)
        index = client.get(f"/v1/entries/{world.hostile_record}").json()["entry"]["log_index"]
    assert page.status_code == 200 and log_page.status_code == 200
    assert "evil.example" not in page.text + log_page.text
    calls, _ = _run_with_stubs(_command_block(page.text, "verify"), tmp_path / "record")
    for expected in _expected_fetches(server.url, "rec", names):
        assert expected in calls, (expected, calls)
    assert ["curl", "-fsS", f"{server.url}/v1/log/proof/inclusion?index={index}&tree_size={world.entries}"] in calls
    assert ["kvgraft-verify", "exactness", "rec", "--trusted-keys", "trusted-keys.json"] in calls
    log_calls, _ = _run_with_stubs(_command_block(log_page.text, "consistency"), tmp_path / "log")
    assert ["curl", "-fsS", f"{server.url}/v1/log/proof/consistency?old=2&new=5"] in log_calls


def test_commands_use_the_configured_public_url_not_the_host_header(
    trust_ui: tuple[Harness, TrustWorld], tmp_path: Path
) -> None:
    h, world = trust_ui
    page = h.client.get(f"/artifacts/{world.hostile.digest}", headers={"Host": "evil.example"}).text
    assert "evil.example" not in page and "testserver" not in _command_block(page, "verify")
    calls, _ = _run_with_stubs(_command_block(page, "verify"), tmp_path)
    assert ["curl", "-fsS", "-o", "registry.pub", "https://registry.example/kv/log/registry-key.pem"] in calls
    assert "public address, https://registry.example/kv." in page


def test_without_a_known_address_the_commands_read_REGISTRY(
    world_data: tuple[Path, World], web_keys: dict[str, Key], tmp_path: Path
) -> None:
    data, world = world_data
    with harness(data, web_keys) as h:  # in process: no bind address, no public_url
        page = h.client.get(f"/artifacts/{world.middle.digest}", headers={"Host": "evil.example"}).text
    block = _command_block(page, "verify")
    assert "evil.example" not in page and '"$REGISTRY"/v1/blobs/' in block
    assert "set REGISTRY to it before pasting" in page
    calls, _ = _run_with_stubs(block, tmp_path, REGISTRY="https://r.example")
    assert ["curl", "-fsS", "-o", "registry.pub", "https://r.example/log/registry-key.pem"] in calls


# --- control, bidi and zero-width characters ---------------------------------------------------------


def test_bidi_zero_width_and_control_characters_in_names_are_shown_escaped(
    trust_ui: tuple[Harness, TrustWorld],
) -> None:
    h, world = trust_ui
    pages = [
        "/",
        "/artifacts",
        f"/artifacts/{world.bidi.digest}",
        f"/artifacts/{world.hostile.digest}",
        f"/records/{world.hostile_record}",
        "/records",
        "/artifacts?model=model%E2%80%AEevil%E2%80%8B",
    ]
    for path in pages:
        r = h.client.get(path)
        assert r.status_code == 200, path
        found = invisible_pattern().search(r.text)
        assert found is None, (path, hex(ord(found.group())) if found else None)
    page = h.client.get(f"/artifacts/{world.bidi.digest}").text
    assert "admin\\u202e\\u2066txt.exe\\u2069 and zero\\u200b\\u200c\\u200dwidth\\u200e\\u200f and \\x1b[31mred" in page
    assert "model\\u202eevil\\u200b" in page
    hostile = h.client.get(f"/artifacts/{world.hostile.digest}").text
    assert "bidi\\u202egpj.exe" in hostile and "zero\\u200bwidth\\ufeff" in hostile  # in the statement's subject list


# --- signatures: outside the lock, cached, bounded -----------------------------------------------------


def test_signature_is_verified_outside_the_database_lock_and_cached_per_envelope_digest(
    trust_data: tuple[Path, TrustWorld], web_keys: dict[str, Key], monkeypatch: pytest.MonkeyPatch
) -> None:
    data, world = trust_data
    with harness(data, web_keys) as h:
        registry = h.client.app.state.registry
        real = signatures.verify_envelope
        held: list[bool] = []

        def spy(*args: Any, **kwargs: Any) -> Any:
            held.append(registry.db.lock._is_owned())
            return real(*args, **kwargs)

        monkeypatch.setattr(signatures, "verify_envelope", spy)
        path = f"/artifacts/{world.chain[3].digest}"
        assert "signature verified" in h.client.get(path).text
        assert held == [False]
        for _ in range(3):
            assert "signature verified" in h.client.get(path).text
        assert held == [False]  # served from the cache
        # A new key for the publisher changes the cache key: verified again, once.
        h.make_token("alice", web_keys["alice"], web_keys["eve"])
        assert "signature verified" in h.client.get(path).text
        assert held == [False, False]


def test_signature_cache_holds_at_most_verify_cache_entries(
    trust_data: tuple[Path, TrustWorld], web_keys: dict[str, Key]
) -> None:
    data, world = trust_data
    with harness(data, web_keys, verify_cache_entries=2) as h:
        for link in world.chain[:5]:
            assert h.client.get(f"/artifacts/{link.digest}").status_code == 200
        assert len(signatures.verify_cache(h.client.app.state.registry)) == 2


def test_an_envelope_stored_with_more_than_max_signatures_is_shown_unverified_without_verifying(
    trust_ui: tuple[Harness, TrustWorld], monkeypatch: pytest.MonkeyPatch
) -> None:
    h, world = trust_ui
    calls: list[int] = []
    real = signatures.verify_envelope
    monkeypatch.setattr(signatures, "verify_envelope", lambda *a, **k: calls.append(1) or real(*a, **k))
    page = h.client.get(f"/entries/{world.many_signatures}", follow_redirects=True)
    assert page.status_code == 200, page.text
    assert "not verified: too many signatures (40; this registry checks at most 16 per envelope)" in page.text
    assert "signature NOT verified" in page.text
    assert calls == []


# --- lineage: bounded, cycle-safe, said on the page ---------------------------------------------------


def test_a_parent_cycle_is_walked_once_and_said_on_the_page(trust_ui: tuple[Harness, TrustWorld]) -> None:
    h, world = trust_ui
    a, b = world.cycle
    started = time.monotonic()
    r = h.client.get(f"/artifacts/{a}")
    elapsed = time.monotonic() - started
    assert r.status_code == 200, r.text
    assert "The parent chain loops back on itself after 1 ancestor" in r.text
    assert re.findall(r'<a class="lineage-parent" href="/artifacts/(sha256:[0-9a-f]{64})">', r.text) == [b]
    assert elapsed < 5, elapsed


def test_lineage_walk_stops_at_max_lineage_depth_and_says_so(
    trust_data: tuple[Path, TrustWorld], web_keys: dict[str, Key]
) -> None:
    data, world = trust_data
    with harness(data, web_keys, max_lineage_depth=8) as h:
        page = h.client.get(f"/artifacts/{world.chain[-1].digest}").text
        root_page = h.client.get(f"/artifacts/{world.chain[0].digest}").text
    parents = re.findall(r'<a class="lineage-parent" href="/artifacts/(sha256:[0-9a-f]{64})">', page)
    assert parents == [link.digest for link in reversed(world.chain[-9:-1])]
    assert "The parent chain goes on past the 8 nearest ancestors; this registry walks no further" in page
    assert "none: this is a root artifact" in root_page and "lineage-cut" not in root_page


# --- odd stored payloads render; errors are plain pages ----------------------------------------------


def test_record_page_renders_an_exactness_sample_index_of_2_pow_1024(trust_ui: tuple[Harness, TrustWorld]) -> None:
    h, world = trust_ui
    r = h.client.get(f"/records/{world.huge_index}")
    assert r.status_code == 200, r.text
    assert "Statement not readable" not in r.text and "KL divergence per sample" in r.text
    assert f'<td class="num">{2**1024}</td>' in r.text  # the sample's index, as signed
    assert "(1 point with an index beyond the axis not drawn)" in r.text  # no float holds it: said, not drawn
    assert "1e+400 / 1" in r.text  # prefix tokens in scientific notation


def test_record_page_renders_numbers_no_float_holds_where_floats_belong(trust_ui: tuple[Harness, TrustWorld]) -> None:
    h, world = trust_ui
    r = h.client.get(f"/records/{world.odd_values}")
    assert r.status_code == 200, r.text
    assert "Statement not readable" in r.text and "kl_divergence: Input should be a valid number" in r.text
    assert "Traceback" not in r.text


@pytest.mark.parametrize("which", ["undecodable", "deep"])
def test_record_page_renders_a_payload_that_does_not_decode_or_nests_5000_deep(
    trust_ui: tuple[Harness, TrustWorld], which: str
) -> None:
    h, world = trust_ui
    r = h.client.get(f"/records/{getattr(world, which)}")
    assert r.status_code == 200, r.text
    assert "Statement not readable" in r.text
    assert "a stored envelope cannot be decoded" in r.text or "nested too deeply" in r.text
    for listing in ("/records", "/", "/artifacts"):
        assert h.client.get(listing).status_code == 200, listing


def test_error_pages_are_html_without_traceback_or_absolute_path(trust_ui: tuple[Harness, TrustWorld]) -> None:
    h, _ = trust_ui
    for path, status in (
        ("/artifacts/sha256:" + "0" * 64, 404),
        ("/artifacts/not-a-digest", 400),
        ("/log?old=5&new=2", 400),
        ("/records/sha256:" + "1" * 64, 404),
        ("/log?before=-1", 400),
    ):
        r = h.client.get(path)
        assert r.status_code == status, (path, r.status_code)
        assert r.headers["content-type"].startswith("text/html"), path
        assert "Traceback" not in r.text and str(h.data) not in r.text and "/tmp/" not in r.text, path
        assert "What to do:" in r.text, path
    shown = scrub_paths(f"cannot write {h.data}/blobs/tmp/x: disk full (errno 28)", server_side=True)
    assert shown == "cannot write <path>: disk full (errno 28)"
