"""The connector's block artifacts without vLLM: real files, real signatures, every refusal by name.

The engine itself is driven in test_vllm_connector.py; here each check of ``read_verified_block``
is made to fail once, on a block written by ``write_block``, and the settings' errors are read.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvgraft.integrations.vllm import (
    KV_LAYOUT,
    BindingMismatchError,
    BlockClaim,
    BlockFileError,
    ChainMismatchError,
    ConnectorConfigError,
    ConnectorSettings,
    Handoff,
    PrefixDigests,
    VllmBinding,
    binding_digest,
    block_dir,
    chain_keys,
    decode_block,
    encode_block,
    open_handed,
    read_verified_block,
    write_block,
)
from kvgraft.schemas import DirectoryExistsError, sha256_bytes, token_digest
from kvgraft.verifier import (
    SigningKey,
    TrustedKeys,
    UnknownKeyError,
    generate_private_key,
    trusted_key,
)

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def _binding(**change: object) -> VllmBinding:
    base = VllmBinding(
        model_name="smollm2-135m", weights_digest=sha256_bytes(b"weights"), config_digest=sha256_bytes(b"config"),
        tokenizer_digest=sha256_bytes(b"tokenizer"), vllm_version="0.32.0", torch_version="2.13.0+cpu",
        device="cpu: test", attention_backend="CPU_ATTN", block_size=4, model_dtype="float32",
        kv_cache_dtype="float32", kv_layout=KV_LAYOUT, num_kv_heads=2, head_size=8, layers=LAYERS,
        settings={"enforce_eager": "True"},
    )
    return base.model_copy(update=change)


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(2, 4, 16, generator=g) for name in LAYERS}  # [H, N, 2 * head] as CPU_ATTN lays it out


@pytest.fixture()
def signer() -> Iterator[SigningKey]:
    key = SigningKey(generate_private_key())
    yield key
    key.close()


@pytest.fixture()
def trusted(signer: SigningKey) -> TrustedKeys:
    return TrustedKeys(keys=(trusted_key("connector", signer.public_key),))


PROMPT = list(range(100, 113))  # 13 tokens: 3 full blocks of 4


def _claims(binding: VllmBinding) -> list[BlockClaim]:
    digest = binding_digest(binding)
    claims: list[BlockClaim] = []
    for i in range(3):
        claims.append(BlockClaim.of(binding, digest, PROMPT, i, claims[-1].key if claims else None))
    return claims


def test_block_round_trip_gives_the_bytes_written(tmp_path: Path, signer: SigningKey, trusted: TrustedKeys) -> None:
    claims = _claims(_binding())
    assert [c.key for c in claims] == chain_keys(binding_digest(_binding()), PROMPT, 4, 3)
    tensors = _tensors()
    write_block(tmp_path, claims[1], encode_block(tensors), signer)
    data = read_verified_block(tmp_path, claims[1], trusted)
    assert {k: v.tolist() for k, v in decode_block(data).items()} == {k: v.tolist() for k, v in tensors.items()}
    with pytest.raises(FileNotFoundError):
        read_verified_block(tmp_path, claims[0], trusted)
    with pytest.raises(DirectoryExistsError):
        write_block(tmp_path, claims[1], encode_block(tensors), signer)


def test_changed_byte_is_refused_regression_tampered_block(tmp_path: Path, signer: SigningKey, trusted: TrustedKeys) -> None:
    claim = _claims(_binding())[0]
    path = write_block(tmp_path, claim, encode_block(_tensors()), signer) / "kv.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(BlockFileError, match=r"kv.safetensors has digest sha256:\w+, but the signed statement says sha256:\w+"):
        read_verified_block(tmp_path, claim, trusted)


def test_untrusted_signer_is_refused(tmp_path: Path, trusted: TrustedKeys) -> None:
    claim = _claims(_binding())[0]
    stranger = SigningKey(generate_private_key())
    write_block(tmp_path, claim, encode_block(_tensors()), stranger)
    with pytest.raises(UnknownKeyError, match="verifies with any of the 1 trusted key"):
        read_verified_block(tmp_path, claim, trusted)


def test_block_of_another_binding_is_refused_regression_other_model(tmp_path: Path, signer: SigningKey, trusted: TrustedKeys) -> None:
    mine, theirs = _binding(), _binding(model_name="gemma3-270m", weights_digest=sha256_bytes(b"other"))
    claim, forged = _claims(mine)[0], _claims(theirs)[0]
    # Their block, stored where this engine looks for its own (a mix-up in a shared store).
    write_block(tmp_path, forged, encode_block(_tensors()), signer)
    block_dir(tmp_path, forged.key).rename(block_dir(tmp_path, claim.key))
    with pytest.raises(BindingMismatchError, match="another binding \\(model_name: block has 'gemma3-270m', engine has 'smollm2-135m'\\)"):
        read_verified_block(tmp_path, claim, trusted)


def test_other_backend_is_named_in_the_refusal(tmp_path: Path, signer: SigningKey, trusted: TrustedKeys) -> None:
    claim, other = _claims(_binding())[0], _claims(_binding(attention_backend="FLASH_ATTN"))[0]
    write_block(tmp_path, other, encode_block(_tensors()), signer)
    block_dir(tmp_path, other.key).rename(block_dir(tmp_path, claim.key))
    with pytest.raises(BindingMismatchError, match="attention_backend: block has 'FLASH_ATTN', engine has 'CPU_ATTN'"):
        read_verified_block(tmp_path, claim, trusted)


def test_block_of_another_prefix_is_refused(tmp_path: Path, signer: SigningKey, trusted: TrustedKeys) -> None:
    binding = _binding()
    claims = _claims(binding)
    # Block 1 of another prompt, signed as if its parent were this prompt's block 0: the chain key
    # comes out the same, but the signed prefix digest names the other prompt.
    other = BlockClaim.of(binding, binding_digest(binding), [7, 7, 7, 7, *PROMPT[4:]], 1, claims[0].key)
    assert other.key == claims[1].key
    write_block(tmp_path, other, encode_block(_tensors()), signer)
    with pytest.raises(ChainMismatchError, match="prefix digest is not the request's"):
        read_verified_block(tmp_path, claims[1], trusted)


def test_wrong_layout_and_extra_file_are_refused(tmp_path: Path, signer: SigningKey, trusted: TrustedKeys) -> None:
    claims = _claims(_binding())
    short = {name: t[:, :2] for name, t in _tensors().items()}
    write_block(tmp_path, claims[0], encode_block(short), signer)
    with pytest.raises(BlockFileError, match="the binding needs float32 with 128 elements"):
        read_verified_block(tmp_path, claims[0], trusted)
    directory = write_block(tmp_path, claims[1], encode_block(_tensors()), signer)
    (directory / "notes.txt").write_text("x")
    with pytest.raises(BlockFileError, match="holds notes.txt beside the block's two files"):
        read_verified_block(tmp_path, claims[1], trusted)


def test_non_finite_values_are_refused(tmp_path: Path, signer: SigningKey, trusted: TrustedKeys) -> None:
    claim = _claims(_binding())[0]
    tensors = _tensors()
    tensors[LAYERS[1]][0, 0, 0] = float("nan")
    write_block(tmp_path, claim, encode_block(tensors), signer)
    with pytest.raises(BlockFileError, match="model.layers.1.self_attn.attn holds values that are not finite"):
        read_verified_block(tmp_path, claim, trusted)


def test_settings_refuse_unknown_keys_and_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConnectorConfigError, match="kv_connector_extra_config: trusted_key: Extra inputs are not permitted"):
        ConnectorSettings.from_extra({"store": "/tmp/s", "trusted_key": "t.json"})
    with pytest.raises(ConnectorConfigError, match="has no 'store'") as e:
        ConnectorSettings.from_extra({})
    assert "hint: add \"store\": \"DIR\"" in str(e.value)
    monkeypatch.delenv("KVGRAFT_TRUSTED_KEYS", raising=False)
    with pytest.raises(ConnectorConfigError, match="no trusted keys.*KVGRAFT_TRUSTED_KEYS"):
        ConnectorSettings.from_extra({"store": "/tmp/s"}).trusted_keys_path()
    monkeypatch.setenv("KVGRAFT_TRUSTED_KEYS", "/etc/t.json")
    assert ConnectorSettings.from_extra({"store": "/tmp/s"}).trusted_keys_path() == Path("/etc/t.json")
    with pytest.raises(ConnectorConfigError, match="registry as the connector's store is not supported yet.*one shared store directory"):
        ConnectorSettings.from_extra({"store": "s", "registry": "http://127.0.0.1:1", "registry_key": "r.pem", "token": "t"})


def test_prefix_digests_equal_token_digest_of_each_prefix() -> None:
    prompt = [0, 7, 12345, 2**31, 49151, *range(100, 160)]
    prefix = PrefixDigests()
    got = [prefix.extend(prompt[i:i + 4]) for i in range(0, 64, 4)]
    assert got == [token_digest(prompt[:i + 4]) for i in range(0, 64, 4)]
    binding = _binding()
    # A claim built from the running digests is the claim built from the whole prefix.
    running, parent = PrefixDigests(), None
    for i in range(3):
        claim = BlockClaim.of(binding, binding_digest(binding), PROMPT, i, parent, running)
        assert claim == BlockClaim.of(binding, binding_digest(binding), PROMPT, i, parent)
        parent = claim.key
    with pytest.raises(ValueError, match="the prefix digests hold 12 ids, block 1 starts at 4"):
        BlockClaim.of(binding, binding_digest(binding), PROMPT, 1, parent, running)


def test_handoff_gives_the_worker_the_verified_bytes_and_cleans_up(tmp_path: Path, signer: SigningKey, trusted: TrustedKeys) -> None:
    claims = _claims(_binding())
    tensors = _tensors()
    write_block(tmp_path / "store", claims[0], encode_block(tensors), signer)
    handoff = Handoff(root=tmp_path)
    slot = handoff.slot()
    name = slot.take(read_verified_block(tmp_path / "store", claims[0], trusted, slot.allocate))
    assert Path(name).parent == handoff.directory and oct(Path(name).stat().st_mode & 0o777) == "0o600"
    assert oct(handoff.directory.stat().st_mode & 0o777) == "0o700"
    mapped = open_handed(name)
    assert not Path(name).exists()  # the worker deletes the name as soon as it has mapped the file
    assert {k: v.tolist() for k, v in decode_block(mapped).items()} == {k: v.tolist() for k, v in tensors.items()}
    # A block that does not verify leaves no file behind.
    (block_dir(tmp_path / "store", claims[0].key) / "kv.safetensors").write_bytes(b"\0" * 64)
    slot = handoff.slot()
    with pytest.raises(BlockFileError, match="has digest"):
        read_verified_block(tmp_path / "store", claims[0], trusted, slot.allocate)
    assert [p.name for p in handoff.directory.iterdir()] == [slot.path.name]
    slot.discard()
    assert list(handoff.directory.iterdir()) == []
    handoff.close()
    assert not handoff.directory.exists()


def test_overlapping_tensors_are_refused_regression_own_safetensors_reader(tmp_path: Path) -> None:
    # The checks read the safetensors header themselves (views, no copy): a header whose tensors
    # overlap, leave a gap or claim more bytes than the file holds is refused as safetensors' own reader would.
    good = encode_block(_tensors())
    header_len = int.from_bytes(good[:8], "little")
    header = good[8:8 + header_len]
    second = header.index(b'"data_offsets":[512,1024]')
    overlapping = good[:8 + second] + b'"data_offsets":[256,768] ' + good[8 + second + 25:]
    with pytest.raises(BlockFileError, match="starts at byte 256, not 512: the tensors must tile the data"):
        decode_block(overlapping)
    with pytest.raises(BlockFileError, match="the tensors cover 1024 bytes of a 1028-byte data region"):
        decode_block(good + b"\0" * 4)
    with pytest.raises(BlockFileError, match="a 1000000000-byte header"):
        decode_block((10**9).to_bytes(8, "little") + good[8:])


def test_directory_of_a_gone_engine_is_removed_regression_handoff_leak(tmp_path: Path) -> None:
    # vLLM ends its engine process with a signal, so the connector's handoff directory outlived it.
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"kvgraft-vllm-{dead.pid}-abcd1234"
    stale.mkdir()
    (stale / "000000000001.kv").write_bytes(b"x")
    alive = tmp_path / f"kvgraft-vllm-{os.getpid()}-efgh5678"
    alive.mkdir()
    handoff = Handoff(root=tmp_path)
    assert not stale.exists()
    assert alive.is_dir() and handoff.directory.is_dir()
    handoff.close()
