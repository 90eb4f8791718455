"""Errors of the schedule-invariant kernels and the graft kernels (subclasses of EngineError)."""

from __future__ import annotations

from .errors import EngineError


class ScheduleError(EngineError):
    """A schedule (chunking, batch, invariant settings) cannot be run as asked."""

    default_hint = "use a chunk size and batch that the invariant profile supports (docs/invariance.md)"


class KernelError(EngineError):
    """A graft kernel got tensors it cannot handle, or its backend is not available."""

    default_hint = "check the tensors' shapes, dtypes and devices"
