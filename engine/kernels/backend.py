"""Which implementation a graft kernel runs: Triton (on a GPU, or on the CPU under
``TRITON_INTERPRET=1``) or its plain torch reference."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace
from typing import Literal

import torch

from kvgraft.engine._internal.kernel_errors import KernelError

Backend = Literal["auto", "triton", "torch"]


def triton_available() -> bool:
    """Whether the ``triton`` package is installed."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in {"1", "true", "on", "yes"}


def choose(backend: Backend, *tensors: torch.Tensor) -> Literal["triton", "torch"]:
    """Resolve ``backend`` for ``tensors``: ``auto`` takes Triton where it can run, else torch."""
    if backend not in ("auto", "triton", "torch"):
        raise KernelError(f"unknown kernel backend {backend!r}", hint="use auto, triton or torch")
    if backend == "torch":
        return "torch"
    devices = {t.device.type for t in tensors}
    if len(devices) != 1:
        raise KernelError(f"the tensors are on different devices: {sorted(devices)}", hint="move them to one device")
    runnable = triton_available() and (devices == {"cuda"} or interpreting())
    if backend == "triton" and not runnable:
        why = (
            "triton is not installed" if not triton_available()
            else "the tensors are on the CPU and TRITON_INTERPRET is not 1"
        )
        raise KernelError(f"cannot run the Triton kernel: {why}",
                          hint="pip install triton; on a CPU set TRITON_INTERPRET=1, or use backend='torch'")
    return "triton" if runnable else "torch"


def kernels() -> SimpleNamespace:
    """The jitted Triton kernels (imported only when Triton runs)."""
    from . import _triton_kernels

    return _triton_kernels.build()


def block_for(n: int) -> int:
    """The power-of-two block that covers ``n`` elements."""
    from . import _triton_kernels

    return _triton_kernels.next_power_of_2(n)
