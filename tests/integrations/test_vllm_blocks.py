"""The connector's block artifacts without vLLM: real files, real signatures, every refusal by name.

The engine itself is driven in test_vllm_connector.py; here each check of ``read_verified_block``
is made to fail once, on a block written by ``write_block``, and the settings' errors are read.
"""

from __future__ import annotations

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
    VllmBinding,
    binding_digest,
    block_dir,
    chain_keys,
    decode_block,
    encode_block,
    read_verified_block,
    write_block,
)
from kvgraft.schemas import DirectoryExistsError, sha256_bytes
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
