"""Graft kernels: move KV state between artifacts and a paged block cache, and re-rotate cached
keys for shifted grafts. Each has a Triton kernel (a GPU, or the CPU under
``TRITON_INTERPRET=1``) and a plain torch reference that it equals bit for bit.
"""

from .backend import Backend, choose, interpreting, triton_available
from .paged import BLOCK_SIZE, gather_kv, gather_kv_reference, scatter_kv, scatter_kv_reference, slot_mapping
from .rope import rerotate, rerotate_reference

__all__ = [
    "BLOCK_SIZE", "Backend", "choose", "gather_kv", "gather_kv_reference", "interpreting", "rerotate",
    "rerotate_reference",
    "scatter_kv", "scatter_kv_reference", "slot_mapping", "triton_available",
]
