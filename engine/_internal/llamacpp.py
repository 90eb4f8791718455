"""The ``llamacpp-cpu`` profile's backend: the model run by llama.cpp (llama-cpp-python) on the
pinned GGUF itself, with its sequence state decoded into kvgraft artifacts.

What runs: llama-cpp-python 0.3.36's ``libllama``, built on this machine from the pinned sdist by
``scripts/setup_llama_cpp.sh`` (``make install``), called through its ctypes bindings. The GGUF is
the pinned file itself (checked by sha256 before it is loaded); nothing is converted.

The context is pinned by ``SETTINGS`` (``LlamaCppSettings``): ``n_ctx``, ``n_batch``,
``n_ubatch``, ``n_seq_max`` (one unified KV cache shared by up to 16 sequences), threads, the
cache types (f16 keys and values), flash attention on, full-size sliding-window caches and the
sampling seed. The profile's fingerprint (``build_fingerprint``) names the llama-cpp-python
version, the sha256 of every library loaded (``libllama``, ``libggml*``: the build, its compile
flags and so its kernels), ggml's report of the CPU features it runs with, and the state format.

**The sequence state, decoded.** ``llama_state_seq_get_data`` writes, in little-endian, a header
(``u32 0xaf143cd8``, ``i32 seq_id``; a slot file saved by ``llama_state_seq_save_file`` has instead
``u32 'ggsq'``, ``u32 version``, ``u32 n_tokens``, the token ids) and then, for each KV cache of
the context (one; Gemma 3's interleaved sliding-window models two, the full cache then the
sliding one)::

    u32 n_stream
    per stream: u32 cell_count
        (cell_count > 0) per cell: i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id
        u32 v_trans, u32 n_layer
        per layer: i32 k_type, u64 k_row_bytes, cell_count x k_row_bytes   (row = [kv_heads, head_dim])
        per layer (v_trans == 0): i32 v_type, u64 v_row_bytes, cell_count x v_row_bytes

``decode_state`` reads exactly that (anything else is refused: another cache type, transposed
values, several sequences in a cell, bytes left over) and ``encode_state`` writes it back byte
for byte. An artifact's ``kv.safetensors`` holds it as named tensors:

- ``caches.{c}.layers.{j}.keys`` / ``.values``: float16 ``[1, kv_heads, cells, head_dim]``, layer
  ``j`` of cache ``c`` in llama.cpp's order, cells in the cache's order;
- ``caches.{c}.positions``: int32 ``[cells]``, each cell's position;
- a sliding cache's layers also ``caches.{c}.layers.{j}.seen``: int64 ``[1]``, the state's end.

A full cache stores the artifact's own positions ``[start, end)`` in order (a child stores only
its own; a graft concatenates the chain's); a sliding cache stores the cells it holds at ``end``
(the last segment's are restored). ``LlamaCppState.restore`` checks every shape against the
running context before it hands llama.cpp one byte, and the restore is atomic: a refused or
failed ``llama_state_seq_set_data`` leaves the sequence empty (``llama_memory_seq_rm``), and a
restore that llama.cpp reports as done is checked by the positions it then holds.

Own-position exactness: a graft (restore, then the continuation) computes the continuation on
the same cells as the fresh computation (the prefix, then the continuation, in two calls), so the
logits are equal bit for bit. Prefix and continuation in one call are not (other ubatch shapes).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import struct
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from kvgraft.schemas import ModelRef, Sha256Digest, canonical_json, sha256_bytes

from .errors import ArtifactError, EngineError, InputTextError, ProfileMismatchError
from .models import ModelSpec, _check_sha256, locate_gguf, spec_for

_log = logging.getLogger("kvgraft.engine.llamacpp")

#: The llama-cpp-python release the profile is built on (scripts/setup_llama_cpp.sh builds it).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
#: What scripts/setup_llama_cpp.sh tags its build with (``lib/kvgraft-build``).
SETUP_HINT = "run 'make install' (it builds llama-cpp-python from the pinned sdist: bash scripts/setup_llama_cpp.sh .venv/bin/python)"
#: The decoded state format this module reads and writes (the layout in the module docstring).
STATE_FORMAT = "llama.cpp-seq-state/unified-kv-f16"
_GGML_TYPE_F16 = 1


class LlamaCppError(EngineError):
    """llama.cpp refused or failed an operation (a decode, a state restore)."""

    default_hint = "check the model and the artifact; if it persists, rebuild llama.cpp: bash scripts/setup_llama_cpp.sh .venv/bin/python"


@dataclass(frozen=True)
class LlamaCppSettings:
    """The llama.cpp context settings the ``llamacpp-cpu`` profile pins (every one can change a bit)."""

    n_ctx: int = 8192
    n_batch: int = 512
    n_ubatch: int = 512
    n_seq_max: int = 16
    threads: int = 2
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = True
    swa_full: bool = True
    kv_unified: bool = True
    seed: int = 0

    def describe(self) -> dict[str, str]:
        """The settings as the profile's ``kernel_versions`` names them."""
        return {f"llama.cpp.{k}": str(v).lower() if isinstance(v, bool) else str(v) for k, v in self.__dict__.items()}


SETTINGS = LlamaCppSettings()


# --- the library -----------------------------------------------------------------------------


@functools.cache
def lib() -> ModuleType:
    """``llama_cpp`` (its ctypes bindings), imported and initialised once, its log routed to
    this module's logger at debug level; ``ProfileMismatchError`` naming the set-up when absent."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise ProfileMismatchError("profile llamacpp-cpu needs llama-cpp-python, which is not installed here",
                                   hint=SETUP_HINT)
    import llama_cpp

    if llama_cpp.__version__ != LLAMA_CPP_PYTHON_VERSION:
        raise ProfileMismatchError(
            f"profile llamacpp-cpu is built on llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}; {llama_cpp.__version__} is installed",
            hint=SETUP_HINT)

    @llama_cpp.llama_log_callback
    def _to_logger(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        _log.debug("%s", text.decode("utf-8", errors="replace").rstrip())

    llama_cpp.llama_log_set(_to_logger, ctypes.c_void_p(0))
    _KEEP.append(_to_logger)  # the C side holds only a pointer: keep the callback alive
    llama_cpp.llama_backend_init()
    return llama_cpp


_KEEP: list[Any] = []


def installed() -> bool:
    """Whether the pinned llama-cpp-python is installed here (not imported: only its metadata is read)."""
    try:
        return importlib.metadata.version("llama_cpp_python") == LLAMA_CPP_PYTHON_VERSION
    except importlib.metadata.PackageNotFoundError:
        return False


@functools.cache
def build_fingerprint() -> str:
    """The llama.cpp build as its kernels run here: the bindings' version, the sha256 of each
    library the bindings load (sorted by name), the build tag, and ggml's system info."""
    llama_cpp = lib()
    folder = Path(str(llama_cpp.__file__)).parent / "lib"
    # The libraries the bindings load (libllama and ggml's); the server's own beside them are not.
    libs = sorted(p for p in folder.iterdir() if p.name.startswith(("libllama.so", "libggml")) and p.is_file() and not p.is_symlink())
    digest = hashlib.sha256()
    for p in libs:
        digest.update(p.name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    tag = (folder / "kvgraft-build").read_text().strip() if (folder / "kvgraft-build").is_file() else "unknown"
    # llama.cpp's version and commit as its build recorded them (setup_llama_cpp.sh writes llama-server --version's line).
    version = (folder / "kvgraft-llama-version").read_text().strip() if (folder / "kvgraft-llama-version").is_file() else "unknown"
    info = " ".join(llama_cpp.llama_print_system_info().decode().split())
    return (f"llama-cpp-python={llama_cpp.__version__}; llama.cpp={version}; build={tag}; libs-sha256={digest.hexdigest()}; "
            f"state={STATE_FORMAT}; {info}")


def server_binary() -> Path:
    """llama.cpp's own ``llama-server``, built beside the bindings' libraries by setup_llama_cpp.sh."""
    path = Path(str(lib().__file__)).parent / "lib" / "llama-server"
    if not path.is_file():
        raise ProfileMismatchError(f"llama.cpp's llama-server is not installed ({path} is missing)", hint=SETUP_HINT)
    return path


# --- the model -------------------------------------------------------------------------------


class LlamaCppTokenizer:
    """The GGUF's own vocabulary as llama.cpp tokenizes it.

    Its digest binds what decides every token id: the GGUF's sha256 (the vocabulary, merges and
    pre-tokenizer live in the file) and the llama.cpp build (``build_fingerprint``)."""

    def __init__(self, vocab: Any, gguf_sha256: str) -> None:
        llama_cpp = lib()
        self._vocab = vocab
        self.eos_token_id: int | None = int(llama_cpp.llama_vocab_eos(vocab))
        self.vocab_size = int(llama_cpp.llama_vocab_n_tokens(vocab))
        self.digest: Sha256Digest = sha256_bytes(canonical_json({
            "tokenizer": "llama.cpp", "gguf_sha256": gguf_sha256, "build": build_fingerprint(), "n_tokens": self.vocab_size,
        }))

    def encode(self, text: str, *, first: bool) -> list[int]:
        """Token ids of ``text``; ``first`` adds the model's start tokens (BOS) as the GGUF says."""
        llama_cpp = lib()
        data = text.encode("utf-8")
        capacity = len(data) + 8
        buf = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(self._vocab, data, len(data), buf, capacity, first, False)
        if n < 0:
            raise InputTextError(f"llama.cpp could not tokenize the text ({len(data)} bytes)")
        return list(buf[:n])

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens dropped."""
        if not ids:
            return ""
        llama_cpp = lib()
        arr = (llama_cpp.llama_token * len(ids))(*ids)
        size = 16 * len(ids) + 16
        for _ in range(2):
            out = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_detokenize(self._vocab, arr, len(ids), out, size, True, False)
            if n >= 0:
                return out.raw[:n].decode("utf-8", errors="replace")
            size = -n + 16
        raise InputTextError(f"llama.cpp could not detokenize {len(ids)} tokens")


@dataclass
class _Cache:
    """One KV cache of a decoded sequence state (the module docstring's layout)."""

    positions: np.ndarray  # int32 [cells]
    keys: list[np.ndarray] = field(default_factory=list)  # per layer: float16 [cells, kv_heads * head_dim] (or [cells, kv_heads, head_dim])
    values: list[np.ndarray] = field(default_factory=list)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = memoryview(data), 0

    def take(self, fmt: str) -> int:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise ArtifactError(f"llama.cpp state ends early at byte {self.at} (wanted {size} more)")
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += size
        return int(value)

    def rows(self, cells: int, row_bytes: int) -> np.ndarray:
        size = cells * row_bytes
        if self.at + size > len(self.data):
            raise ArtifactError(f"llama.cpp state ends early at byte {self.at} (wanted {size} more)")
        out = np.frombuffer(self.data[self.at:self.at + size], dtype=np.float16).reshape(cells, row_bytes // 2).copy()
        self.at += size
        return out  # [cells, kv_heads * head_dim]


#: The first word of ``llama_state_seq_get_data``'s bytes (llama-context.cpp's ``io_magic``).
IO_MAGIC = 0xAF143CD8


def decode_state(data: bytes, n_caches: int, *, header: bool = True) -> list[_Cache]:
    """A sequence's state (``llama_state_seq_get_data``; with ``header=False`` the caches alone,
    as a slot file holds them after its tokens) as ``n_caches`` caches; refused
    (``ArtifactError``) unless it is exactly the layout of the module docstring."""
    r = _Reader(data)
    if header:
        if r.take("<I") != IO_MAGIC:
            raise ArtifactError("not a llama.cpp sequence state (its first word is not llama.cpp's state magic)")
        r.take("<i")
    caches: list[_Cache] = []
    for c in range(n_caches):
        streams = r.take("<I")
        found: _Cache | None = None
        for _ in range(streams):
            cells = r.take("<I")
            if cells == 0:
                continue
            if found is not None:
                raise ArtifactError(f"cache {c} holds the sequence in two streams; the profile pins one unified cache")
            positions = np.empty(cells, dtype=np.int32)
            for i in range(cells):
                positions[i] = r.take("<i")
                if r.take("<I") != 1:
                    raise ArtifactError(f"cache {c}: cell {i} belongs to several sequences; only one sequence's state is stored")
                r.take("<i")
            found = _Cache(positions)
            if r.take("<I") != 0:
                raise ArtifactError(f"cache {c} stores values transposed; the profile pins flash attention (untransposed)")
            layers = r.take("<I")
            for part in (found.keys, found.values):
                for _ in range(layers):
                    if r.take("<i") != _GGML_TYPE_F16:
                        raise ArtifactError(f"cache {c} is not f16; the profile pins f16 keys and values")
                    part.append(r.rows(cells, r.take("<Q")))
        caches.append(found if found is not None else _Cache(np.empty(0, dtype=np.int32)))
    if r.at != len(data):
        raise ArtifactError(f"llama.cpp state has {len(data) - r.at} bytes past its last cache")
    return caches


def encode_state(caches: list[_Cache], seq_id: int) -> bytearray:
    """The bytes ``llama_state_seq_set_data`` reads for ``caches`` (``decode_state``'s inverse).

    A layer's rows may be ``[cells, row]`` or ``[cells, kv_heads, head_dim]`` with any strides (a
    permuted view of an artifact's tensor): each is copied once, straight into the one buffer
    the size of the whole state, which llama.cpp then reads in place (no copy per step).
    """
    def row_bytes(rows: np.ndarray) -> int:
        return int(np.prod(rows.shape[1:])) * 2

    size = 8 + sum(8 + (0 if not len(c.positions) else 12 * len(c.positions) + 8
                        + sum(12 + rows.shape[0] * row_bytes(rows) for rows in (*c.keys, *c.values))) for c in caches)
    out = bytearray(size)
    view = np.frombuffer(out, dtype=np.uint8)
    struct.pack_into("<Ii", out, 0, IO_MAGIC, seq_id)
    at = 8
    for cache in caches:
        cells = int(cache.positions.shape[0])
        struct.pack_into("<II", out, at, 1, cells)
        at += 8
        if cells == 0:
            continue
        meta = view[at:at + 12 * cells].view("<i4").reshape(cells, 3)
        meta[:, 0] = cache.positions
        meta[:, 1] = 1
        meta[:, 2] = seq_id
        at += 12 * cells
        struct.pack_into("<II", out, at, 0, len(cache.keys))
        at += 8
        for part in (cache.keys, cache.values):
            for rows in part:
                n = row_bytes(rows)
                struct.pack_into("<iQ", out, at, _GGML_TYPE_F16, n)
                at += 12
                np.copyto(view[at:at + cells * n].view("<f2").reshape(rows.shape), rows, casting="no")
                at += cells * n
    if at != size:
        raise LlamaCppError(f"encoded {at} of {size} state bytes", hint="a bug: report it")
    return out


@dataclass(frozen=True)
class _Shape:
    """What one cache of the running context holds per cell: its layers' kv heads and head size."""

    layers: int
    kv_heads: int
    key_dim: int
    value_dim: int


class LlamaCppModel:
    """A GGUF loaded by llama.cpp under ``SETTINGS``: one context whose unified cache holds up to
    ``n_seq_max`` sequences (``LlamaCppState``), all driven from one thread at a time.

    It offers what the engine's operations read of a model: ``spec`` (its ``window`` capped at
    ``n_ctx``), ``tokenizer``, ``ref``, ``tokenizer_digest`` and ``vocab_size``.
    """

    def __init__(self, spec: ModelSpec, gguf: Path, settings: LlamaCppSettings = SETTINGS) -> None:
        llama_cpp = lib()
        self.settings = settings
        self.spec = replace(spec, window=min(spec.window, settings.n_ctx))
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        self._model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), params)
        if not self._model:
            raise LlamaCppError(f"llama.cpp could not load {gguf}", hint=f"reinstall the model: kvgraft models install --reinstall {spec.name}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = settings.n_ctx
        cparams.n_batch = settings.n_batch
        cparams.n_ubatch = settings.n_ubatch
        cparams.n_seq_max = settings.n_seq_max
        cparams.n_threads = settings.threads
        cparams.n_threads_batch = settings.threads
        cparams.type_k = cparams.type_v = _GGML_TYPE_F16
        cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.swa_full = settings.swa_full
        cparams.kv_unified = settings.kv_unified
        cparams.no_perf = True
        self._ctx = llama_cpp.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            llama_cpp.llama_model_free(self._model)
            raise LlamaCppError(f"llama.cpp could not make a context for {spec.name} (n_ctx {settings.n_ctx})",
                                hint="free memory, or use a machine with more")
        self._memory = llama_cpp.llama_get_memory(self._ctx)
        vocab = llama_cpp.llama_model_get_vocab(self._model)
        self.tokenizer = LlamaCppTokenizer(vocab, str(spec.gguf_sha256))
        self.tokenizer_digest = self.tokenizer.digest
        self.vocab_size = self.tokenizer.vocab_size
        swa = int(llama_cpp.llama_model_n_swa(self._model))
        #: The sliding window of the model's local layers, if it has any (Gemma 3's).
        self.sliding_window: int | None = swa if swa > 0 else None
        self.n_caches = 2 if swa > 0 else 1
        self.ref = ModelRef(name=spec.name, weights_digest=Sha256Digest("sha256:" + str(spec.gguf_sha256)),
                            config_digest=sha256_bytes(canonical_json(self._metadata())))
        self._free = list(range(settings.n_seq_max))
        # One batch of n_batch rows, filled anew by every decode (llama_batch_init allocates).
        self._batch = llama_cpp.llama_batch_init(settings.n_batch, 0, 1)
        self.lock = threading.RLock()
        self._shapes = self._probe()
        weakref.finalize(self, _free_native, llama_cpp, self._ctx, self._model, self._batch)

    @property
    def parameter_count(self) -> int:
        """How many weights the GGUF holds (what the energy meter counts per token)."""
        return int(lib().llama_model_n_params(self._model))

    def _metadata(self) -> dict[str, str]:
        """The GGUF's metadata as llama.cpp reads it, less the tokenizer's arrays (the GGUF's
        sha256 binds those): the model's configuration."""
        llama_cpp = lib()
        out: dict[str, str] = {}
        buf = ctypes.create_string_buffer(4096)
        for i in range(llama_cpp.llama_model_meta_count(self._model)):
            llama_cpp.llama_model_meta_key_by_index(self._model, i, buf, len(buf))
            key = buf.value.decode("utf-8", errors="replace")
            if key.startswith("tokenizer.ggml."):
                continue
            llama_cpp.llama_model_meta_val_str_by_index(self._model, i, buf, len(buf))
            out[key] = buf.value.decode("utf-8", errors="replace")
        return out

    def _probe(self) -> list[_Shape]:
        """Each cache's per-layer shape, read off a one-token state of this context."""
        state = LlamaCppState(self)
        try:
            state.extend([self.tokenizer.encode("a", first=True)[0]], keep_last=1)
            caches = decode_state(state.raw_state(), self.n_caches)
        finally:
            state.close()
        heads = self._kv_heads()
        shapes = []
        for cache in caches:
            if not cache.keys:
                raise LlamaCppError("llama.cpp's state of a one-token sequence holds no layers")
            k, v = cache.keys[0].shape[1], cache.values[0].shape[1]
            if any(x.shape[1] != k for x in cache.keys) or any(x.shape[1] != v for x in cache.values) or k % heads or v % heads:
                raise LlamaCppError(f"{self.spec.name}: its layers' key/value sizes differ; kvgraft stores one shape per cache")
            shapes.append(_Shape(len(cache.keys), heads, k // heads, v // heads))
        return shapes

    def _kv_heads(self) -> int:
        llama_cpp = lib()
        buf = ctypes.create_string_buffer(256)
        llama_cpp.llama_model_meta_val_str(self._model, b"general.architecture", buf, len(buf))
        arch = buf.value
        if llama_cpp.llama_model_meta_val_str(self._model, arch + b".attention.head_count_kv", buf, len(buf)) < 0:
            raise LlamaCppError(f"{self.spec.name}: its GGUF names no {arch.decode()}.attention.head_count_kv")
        return int(buf.value)

    def acquire(self) -> int:
        """A free sequence id of the context (its cells empty), or ``LlamaCppError``."""
        with self.lock:
            if not self._free:
                raise LlamaCppError(f"all {self.settings.n_seq_max} sequences of the llama.cpp context are in use",
                                    hint="finish or close a state first")
            return self._free.pop(0)

    def release(self, seq: int) -> None:
        """Empty sequence ``seq`` and give it back."""
        with self.lock:
            lib().llama_memory_seq_rm(self._memory, seq, -1, -1)
            if seq not in self._free:
                self._free.append(seq)
                self._free.sort()

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> torch.Tensor:
        """Run one llama.cpp batch of ``(token, position, seq, wants_logits)`` rows (at most
        ``n_batch``); the logits of the rows that want them, in order: float32 ``[wanted, vocab]``
        (copied once out of llama.cpp's buffer, which the next batch overwrites)."""
        llama_cpp = lib()
        if len(rows) > self.settings.n_batch:
            raise LlamaCppError(f"{len(rows)} rows in one batch; the context takes {self.settings.n_batch}")
        batch = self._batch
        for i, (token, pos, seq, wants) in enumerate(rows):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = wants
        batch.n_tokens = len(rows)
        rc = llama_cpp.llama_decode(self._ctx, batch)
        if rc != 0:
            raise LlamaCppError(f"llama_decode failed (code {rc}) on {len(rows)} tokens",
                                hint="the context may be full: run fewer or shorter sequences at once")
        views = [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx, i), shape=(self.vocab_size,))
                 for i, (_, _, _, wants) in enumerate(rows) if wants]
        return torch.from_numpy(np.stack(views)) if views else torch.empty(0, self.vocab_size)  # [wanted, vocab]

    def seq_state(self, seq: int) -> bytes:
        """``llama_state_seq_get_data`` of sequence ``seq``."""
        llama_cpp = lib()
        size = llama_cpp.llama_state_seq_get_size(self._ctx, seq)
        buf = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self._ctx, buf, size, seq)
        if written != size:
            raise LlamaCppError(f"llama.cpp wrote {written} of {size} state bytes for sequence {seq}")
        return bytes(buf)

    def set_seq_state(self, seq: int, data: bytes | bytearray, expect: tuple[int, int]) -> None:
        """Restore ``data`` into empty sequence ``seq``, atomically: refused or failed, the
        sequence is emptied and ``LlamaCppError`` raised; done, it must hold positions
        ``expect`` = ``(min, max)`` (some restores silently do nothing: ggml-org/llama.cpp#26676)."""
        llama_cpp = lib()
        # A bytearray is read in place (encode_state's); bytes are immutable, so copied.
        array_type = ctypes.c_uint8 * len(data)
        buf = array_type.from_buffer(data) if isinstance(data, bytearray) else array_type.from_buffer_copy(data)
        read = llama_cpp.llama_state_seq_set_data(self._ctx, buf, len(data), seq)
        held = (int(llama_cpp.llama_memory_seq_pos_min(self._memory, seq)), int(llama_cpp.llama_memory_seq_pos_max(self._memory, seq)))
        if read != len(data) or held != expect:
            llama_cpp.llama_memory_seq_rm(self._memory, seq, -1, -1)
            raise LlamaCppError(f"llama.cpp did not restore the state (read {read} of {len(data)} bytes; holds positions "
                                f"{held[0]}..{held[1]}, expected {expect[0]}..{expect[1]}); the sequence was left empty",
                                hint="the context may be full, or the artifact was made by another build")

    @property
    def shapes(self) -> list[_Shape]:
        """Each cache's per-layer shape in this context."""
        return self._shapes


def _free_native(llama_cpp: ModuleType, ctx: Any, model: Any, batch: Any) -> None:
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


@functools.cache
def _loaded(name: str) -> LlamaCppModel:
    spec = spec_for(name)
    if spec.gguf_sha256 is None:
        raise ProfileMismatchError(f"profile llamacpp-cpu runs GGUF models; {name} is built in code",
                                   hint="choose a GGUF model (kvgraft models list)")
    path = locate_gguf(spec)
    _check_sha256(spec, path)
    return LlamaCppModel(spec, path)


def load_llamacpp_model(name: str) -> LlamaCppModel:
    """Model ``name``'s pinned GGUF loaded by llama.cpp under ``SETTINGS`` (checked against its
    sha256 first; one per process and name)."""
    return _loaded(name)


# --- the state -------------------------------------------------------------------------------


class LlamaCppState:
    """One sequence of a ``LlamaCppModel``'s context after ``len(token_ids)`` tokens: the
    llama.cpp counterpart of ``KVState`` (the same ``extend``, ``export`` and ``restore``).

    It holds a sequence id of the context until ``close`` (or until it is collected).
    """

    def __init__(self, model: LlamaCppModel) -> None:
        self.model = model
        self.seq = model.acquire()
        self.token_ids: list[int] = []
        self._finalizer = weakref.finalize(self, model.release, self.seq)

    @property
    def end(self) -> int:
        """The position the next token runs at."""
        return len(self.token_ids)

    def close(self) -> None:
        """Empty the sequence and give its id back."""
        self._finalizer()

    def extend(self, ids: list[int], *, chunk: int | None = None, keep_last: int | None = None) -> torch.Tensor:
        """Run ``ids`` at positions ``end..`` in batches of ``n_batch``; the logits of the last
        ``keep_last`` (None: every) of them, float32 ``[rows, vocab]``."""
        if chunk is not None:
            raise InputTextError("profile llamacpp-cpu runs the pinned n_batch; it takes no --chunk")
        if not ids:
            raise InputTextError("no tokens to run")
        if self.end + len(ids) > self.model.spec.window:
            raise InputTextError(f"{self.end + len(ids)} positions pass the llama.cpp context of {self.model.spec.window}")
        first_kept = 0 if keep_last is None else max(0, len(ids) - keep_last)
        rows: list[torch.Tensor] = []
        step = self.model.settings.n_batch
        with self.model.lock:
            for at in range(0, len(ids), step):
                part = ids[at:at + step]
                rows.append(self.model.decode([(t, self.end + at + i, self.seq, at + i >= first_kept) for i, t in enumerate(part)]))
        self.token_ids.extend(ids)
        return rows[0] if len(rows) == 1 else torch.cat(rows)  # [rows, vocab]

    def raw_state(self) -> bytes:
        """llama.cpp's own bytes for this sequence."""
        with self.model.lock:
            return self.model.seq_state(self.seq)

    def export(self, since: int) -> dict[str, torch.Tensor]:
        """The tensors an artifact covering ``[since, end)`` stores (module docstring)."""
        caches = decode_state(self.raw_state(), self.model.n_caches)
        tensors: dict[str, torch.Tensor] = {}
        for c, (cache, shape) in enumerate(zip(caches, self.model.shapes, strict=True)):
            sliding = c == 1
            if sliding:
                keep = np.ones(cache.positions.shape[0], dtype=bool)
            else:
                if not np.array_equal(cache.positions, np.arange(self.end, dtype=np.int32)):
                    raise ArtifactError(f"llama.cpp's full cache does not hold positions 0..{self.end - 1} in order")
                keep = cache.positions >= since
            tensors[f"caches.{c}.positions"] = torch.from_numpy(cache.positions[keep].copy())
            for j in range(shape.layers):
                for part, rows, dim in (("keys", cache.keys[j], shape.key_dim), ("values", cache.values[j], shape.value_dim)):
                    cells = torch.from_numpy(rows[keep])  # [cells, kv_heads * dim]
                    # [cells, h * d] -> [cells, h, d] -> [1, h, cells, d]
                    tensors[f"caches.{c}.layers.{j}.{part}"] = cells.view(-1, shape.kv_heads, dim).permute(1, 0, 2).unsqueeze(0).contiguous()
                if sliding:
                    tensors[f"caches.{c}.layers.{j}.seen"] = torch.tensor([self.end], dtype=torch.int64)
        return tensors

    @classmethod
    def restore(cls, model: LlamaCppModel, chain: list[Any], *, shift: int = 0) -> LlamaCppState:
        """The state at ``chain[-1].end`` from a root-first chain of segments (``Segment``), every
        shape checked against the running context before llama.cpp reads a byte; atomic."""
        if shift:
            raise InputTextError("profile llamacpp-cpu grafts at the artifact's own positions only", hint="leave --shift out")
        caches: list[_Cache] = []
        last = chain[-1]
        for c, shape in enumerate(model.shapes):
            sliding = c == 1
            segments = [last] if sliding else chain
            positions = [_tensor(s.tensors, f"caches.{c}.positions", torch.int32) for s in segments]
            cache = _Cache(torch.cat(positions).numpy())
            if sliding:
                if len(set(cache.positions.tolist())) != len(cache.positions) or (
                        len(cache.positions) and not (0 <= cache.positions.min() and cache.positions.max() < last.end)):
                    raise ArtifactError(f"cache {c}'s positions are not distinct positions before {last.end}")
            elif not np.array_equal(cache.positions, np.arange(last.end, dtype=np.int32)):
                raise ArtifactError(f"cache {c}'s positions are not 0..{last.end - 1} in order (a chain's own positions, joined)")
            cells = len(cache.positions)
            for j in range(shape.layers):
                for part, dim, into in (("keys", shape.key_dim, cache.keys), ("values", shape.value_dim, cache.values)):
                    pieces = []
                    for s in segments:
                        t = _tensor(s.tensors, f"caches.{c}.layers.{j}.{part}", torch.float16)
                        n = int(s.tensors[f"caches.{c}.positions"].shape[0])
                        if tuple(t.shape) != (1, shape.kv_heads, n, dim):
                            raise ArtifactError(f"tensor caches.{c}.layers.{j}.{part} has shape {list(t.shape)}; this model's "
                                                f"context needs [1, {shape.kv_heads}, {n}, {dim}]")
                        pieces.append(t[0].permute(1, 0, 2))  # [1, h, n, d] -> [n, h, d], a view
                    # One segment: the view itself (encode_state copies it once, into place).
                    into.append((pieces[0] if len(pieces) == 1 else torch.cat(pieces)).numpy())
            extra = {k for s in segments for k in s.tensors if k.startswith(f"caches.{c}.layers.")} - {
                f"caches.{c}.layers.{j}.{p}" for j in range(shape.layers) for p in ("keys", "values", "seen")}
            if extra:
                raise ArtifactError(f"cache {c} holds tensors this model's context has no layer for: {sorted(extra)[:3]}")
            if cells == 0 and not sliding:
                raise ArtifactError("the artifact holds no positions")
            caches.append(cache)
        unknown = {k for s in chain for k in s.tensors if not k.startswith("caches.")} | {
            k for s in chain for k in s.tensors if k.startswith("caches.") and int(k.split(".")[1]) >= len(model.shapes)}
        if unknown:
            raise ArtifactError(f"the artifact holds tensors a llama.cpp state of {model.spec.name} has not: {sorted(unknown)[:3]}",
                                hint="it was captured under another profile or model; capture it again under --profile llamacpp-cpu")
        state = cls(model)
        try:
            with model.lock:
                # What llama.cpp reports a sequence holds: the latest first position and the
                # earliest last one over its caches (a sliding cache starts late).
                held = [c.positions for c in caches if len(c.positions)]
                expect = (max(int(h.min()) for h in held), min(int(h.max()) for h in held))
                model.set_seq_state(state.seq, encode_state(caches, state.seq), expect)
        except BaseException:
            state.close()
            raise
        state.token_ids = [t for s in chain for t in s.token_ids]
        return state


def _tensor(tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise ArtifactError(f"the artifact has no tensor {name}",
                            hint="it was captured under another profile or model; capture it again under --profile llamacpp-cpu")
    if t.dtype != dtype:
        raise ArtifactError(f"tensor {name} is {str(t.dtype).removeprefix('torch.')}; a llama.cpp state needs {str(dtype).removeprefix('torch.')}")
    return t


class LlamaCppBatch:
    """Sequences of one ``LlamaCppModel`` decoded together, one token per row per llama.cpp
    batch: the llama.cpp counterpart of ``KVBatch`` (``add``, ``remove``, ``step``)."""

    def __init__(self, model: LlamaCppModel) -> None:
        self.model = model
        self.rows: list[LlamaCppState] = []

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, state: LlamaCppState) -> None:
        """Add a state as the last row."""
        self.rows.append(state)

    def remove(self, rows: list[int]) -> None:
        """Close and drop the rows at ``rows``."""
        gone = set(rows)
        for r in rows:
            self.rows[r].close()
        self.rows = [s for r, s in enumerate(self.rows) if r not in gone]

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Run ``tokens[r]`` on row ``r``'s sequence at its end, all in one batch; float32 ``[rows, vocab]``."""
        with self.model.lock:
            logits = self.model.decode([(t, s.end, s.seq, True) for t, s in zip(tokens, self.rows, strict=True)])
        for t, s in zip(tokens, self.rows, strict=True):
            s.token_ids.append(t)
        return logits  # [rows, vocab]


@contextlib.contextmanager
def opened(model: LlamaCppModel) -> Iterator[None]:
    """Nothing to pin per call: the context's settings were fixed when it was made."""
    yield
