"""``kvgraft slot``: slots saved by a real llama-server (llama.cpp's own binary, built from the
pinned sdist by scripts/setup_llama_cpp.sh), signed, verified, restored and continued."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from kvgraft.engine import SlotError, locate_gguf, read_slot, server_binary, server_identity, spec_for, verify_slot
from kvgraft.verifier import load_trusted_keys
from tests.processes import KvgraftProcess, free_port

pytest.importorskip("llama_cpp", reason="make install builds llama.cpp (scripts/setup_llama_cpp.sh)")


class LlamaServer:
    """llama-server on 127.0.0.1 with a slot save path, stopped at the end."""

    def __init__(self, model: str, slots: Path) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.slots = slots
        slots.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [str(server_binary()), "-m", str(locate_gguf(spec_for(model))), "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
             "-c", "2048", "-np", "1", "-t", "2", "--slot-save-path", str(slots)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"llama-server for {model} did not start in 180 s")

    def post(self, path: str, body: dict[str, object]) -> dict[str, object]:
        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            return dict(json.loads(r.read()))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = LlamaServer("smollm2-135m", tmp_path_factory.mktemp("slots-smollm2"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gemma3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = LlamaServer("gemma3-270m", tmp_path_factory.mktemp("slots-gemma3"))
    yield server
    server.stop()


def kvgraft(*args: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-m", "kvgraft", "--json", *args], capture_output=True, text=True, timeout=300)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _trusted(key: Path, tmp_path: Path) -> Path:
    path = tmp_path / "trusted.json"
    subprocess.run([sys.executable, "-m", "kvgraft", "keys", "trust", "--file", str(path), "--name", "alice",
                    "--public-key", str(key.with_name("k.pem.pub"))], check=True, capture_output=True, timeout=60)
    return path


def _saved(server: LlamaServer, prompt: str, name: str) -> Path:
    server.post("/completion", {"prompt": prompt, "n_predict": 4, "cache_prompt": True, "id_slot": 0})
    saved = server.post("/slots/0?action=save", {"filename": name})
    assert int(str(saved["n_saved"])) > 0
    return server.slots / name


def test_a_signed_slot_verifies_restores_and_continues(smollm2_server: LlamaServer, key: Path, tmp_path: Path) -> None:
    prompt = "The three primary colours of light are red,"
    slot = _saved(smollm2_server, prompt, "colours.bin")
    signed = kvgraft("slot", "sign", str(slot), "--server", smollm2_server.url, "--key", str(key))
    assert signed["ok"] is True and signed["build_info"] and str(signed["gguf_sha256"]).startswith("sha256:")
    parsed = read_slot(slot)
    smollm2_server.post("/slots/0?action=erase", {})
    checked = kvgraft("slot", "verify", str(slot), "--server", smollm2_server.url, "--trusted-keys", str(_trusted(key, tmp_path)),
                      "--restore", "0")
    assert checked["ok"] is True, checked
    assert checked["cells"] == [parsed.caches[0].cells] and "signed by alice" in str(checked["summary"])
    # The restored cells are reused (the prompt's tokens, not recomputed), and the greedy
    # continuation is the one the server computes from nothing.
    body = {"prompt": prompt + " green", "n_predict": 6, "cache_prompt": True, "id_slot": 0, "temperature": 0}
    warm = smollm2_server.post("/completion", body)
    reused = int(dict(warm["timings"])["cache_n"])  # type: ignore[arg-type]
    assert 5 <= reused <= parsed.caches[0].cells
    smollm2_server.post("/slots/0?action=erase", {})
    cold = smollm2_server.post("/completion", body)
    assert int(dict(cold["timings"])["cache_n"]) == 0  # type: ignore[arg-type]
    assert warm["content"] == cold["content"]


def test_a_slot_from_another_model_is_refused_with_the_reason(smollm2_server: LlamaServer, gemma3_server: LlamaServer, key: Path,
                                                               tmp_path: Path) -> None:
    slot = _saved(smollm2_server, "Slots belong to one model.", "other-model.bin")
    assert kvgraft("slot", "sign", str(slot), "--server", smollm2_server.url, "--key", str(key))["ok"] is True
    moved = gemma3_server.slots / slot.name
    shutil.copy(slot, moved)
    shutil.copy(slot.with_name(slot.name + ".dsse.json"), moved.with_name(moved.name + ".dsse.json"))
    refused = kvgraft("slot", "verify", str(moved), "--server", gemma3_server.url, "--trusted-keys", str(_trusted(key, tmp_path)),
                      "--restore", "0")
    assert refused["ok"] is False and refused["error"] == "SlotError"
    assert "was saved by another server than this one: GGUF: slot SmolLM2" in str(refused["message"])


def test_a_tampered_slot_and_an_unsigned_one_are_refused(smollm2_server: LlamaServer, key: Path, tmp_path: Path) -> None:
    slot = _saved(smollm2_server, "Every byte is checked.", "tampered.bin")
    assert kvgraft("slot", "sign", str(slot), "--server", smollm2_server.url, "--key", str(key))["ok"] is True
    data = bytearray(slot.read_bytes())
    data[-10] ^= 0x40
    slot.write_bytes(bytes(data))
    trusted = load_trusted_keys(_trusted(key, tmp_path))
    identity = server_identity(smollm2_server.url)
    with pytest.raises(SlotError, match="altered after it was signed"):
        verify_slot(slot, trusted, identity)
    unsigned = _saved(smollm2_server, "Nobody signed this.", "unsigned.bin")
    with pytest.raises(SlotError, match="has no signature"):
        verify_slot(unsigned, trusted, identity)


def test_a_slot_for_another_build_is_refused(smollm2_server: LlamaServer, key: Path, tmp_path: Path) -> None:
    slot = _saved(smollm2_server, "Builds differ in their kernels.", "build.bin")
    assert kvgraft("slot", "sign", str(slot), "--server", smollm2_server.url, "--key", str(key))["ok"] is True
    other_build = replace(server_identity(smollm2_server.url), build_info="b9999-deadbee")
    with pytest.raises(SlotError, match="llama.cpp build: slot b1-.*, server b9999-deadbee"):
        verify_slot(slot, load_trusted_keys(_trusted(key, tmp_path)), other_build)


def test_a_file_that_is_not_a_slot_is_refused(tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(SlotError, match="not a llama.cpp slot file"):
        read_slot(tmp_path / "x.bin")
    with pytest.raises(SlotError, match="does not exist"):
        read_slot(tmp_path / "missing.bin")


class RegistryServer(KvgraftProcess):
    """``kvgraft serve`` on 127.0.0.1 over a new data directory; always stopped by ``stop``."""

    what = "registry"

    def __init__(self, data: Path) -> None:
        port = free_port()
        super().__init__(["serve", "--data", str(data), "--init", "--port", str(port), "--log-level", "warning"],
                         data.with_name("registry.log"), port)

    def ready(self) -> bool:
        return httpx.get(self.url + "/v1/log/checkpoint", timeout=2).status_code == 200


def test_a_slot_published_to_a_registry_is_pulled_into_a_server_verified_and_restored(
        smollm2_server: LlamaServer, key: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = "A registry keeps slots for other servers:"
    slot = _saved(smollm2_server, prompt, "shared.bin")
    assert kvgraft("slot", "sign", str(slot), "--server", smollm2_server.url, "--key", str(key))["ok"] is True
    original = slot.read_bytes(), slot.with_name("shared.bin.dsse.json").read_bytes()
    trusted = _trusted(key, tmp_path)
    registry = RegistryServer(tmp_path / "registry")
    try:
        registry.wait_ready()
        made = kvgraft("token", "create", "--data", str(tmp_path / "registry"), "--publisher", "alice",
                       "--key", str(key.with_name("k.pem.pub")))
        monkeypatch.setenv("KVGRAFT_TOKEN", str(made["token"]))
        reg = ["--registry", registry.url, "--registry-key", str(tmp_path / "registry" / "registry-key.pub.pem")]
        published = kvgraft("slot", "publish", str(slot), *reg)
        assert published["ok"] is True, published
        assert published["predicate_type"] == "https://kvgraft.dev/llama-slot/v1" and published["created"] is True
        # Gone from the server's slot directory; pulled back into it, checked on the way.
        slot.unlink()
        slot.with_name("shared.bin.dsse.json").unlink()
        pulled = kvgraft("slot", "pull", str(published["entry_digest"]), *reg, "--out", str(smollm2_server.slots),
                         "--trusted-keys", str(trusted))
        assert pulled["ok"] is True, pulled
        assert "signature verified: signed by alice" in str(pulled["summary"])
        assert (slot.read_bytes(), slot.with_name("shared.bin.dsse.json").read_bytes()) == original
        smollm2_server.post("/slots/0?action=erase", {})
        checked = kvgraft("slot", "verify", str(slot), "--server", smollm2_server.url, "--trusted-keys", str(trusted), "--restore", "0")
        assert checked["ok"] is True, checked
        body = {"prompt": prompt + " one", "n_predict": 6, "cache_prompt": True, "id_slot": 0, "temperature": 0}
        warm = smollm2_server.post("/completion", body)
        assert int(dict(warm["timings"])["cache_n"]) >= 5  # type: ignore[arg-type]
        smollm2_server.post("/slots/0?action=erase", {})
        assert smollm2_server.post("/completion", body)["content"] == warm["content"]
        # Pulled again by log index into the same directory: refused, nothing overwritten or left behind.
        again = kvgraft("slot", "pull", str(published["log_index"]), *reg, "--out", str(smollm2_server.slots))
        assert again["ok"] is False and "already exists" in str(again["message"])
        assert slot.read_bytes() == original[0]
        assert not [p for p in smollm2_server.slots.iterdir() if p.name.startswith(".kvgraft-slot-pull")]
        # Against keys that do not name alice: refused with the reason, nothing written.
        subprocess.run([sys.executable, "-m", "kvgraft", "keys", "generate", "--out", str(tmp_path / "bob.pem")], check=True,
                       capture_output=True, timeout=60)
        bob = tmp_path / "bob.json"
        subprocess.run([sys.executable, "-m", "kvgraft", "keys", "trust", "--file", str(bob), "--name", "bob",
                        "--public-key", str(tmp_path / "bob.pem.pub")], check=True, capture_output=True, timeout=60)
        refused = kvgraft("slot", "pull", "0", *reg, "--out", str(tmp_path / "elsewhere"), "--trusted-keys", str(bob))
        assert refused["ok"] is False and refused["error"] == "EnvelopeSignatureError", refused
        assert not list((tmp_path / "elsewhere").iterdir())
    finally:
        registry.stop()
