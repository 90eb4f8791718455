"""Progress of the client's long steps (publish, pull, mirror) on stderr: a tqdm bar on a terminal,
one plain line per step elsewhere (a log, CI), nothing when turned off."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Protocol


class Progress(Protocol):
    """The part of a tqdm bar the client uses."""

    def update(self, n: float | None = 1) -> bool | None: ...

    def close(self) -> None: ...


class _NoProgress:
    """Progress nobody sees."""

    def update(self, n: float | None = 1) -> bool | None:
        return None

    def close(self) -> None:
        return None


class _LineProgress:
    """Progress where stderr is not a terminal (a log, CI): one plain line when the step ends,
    never a bar's carriage-return residue such as ``0.00B [00:00, ?B/s]``."""

    def __init__(self, desc: str, unit: str) -> None:
        self.desc, self.unit, self.n = desc, unit, 0

    def update(self, n: float | None = 1) -> bool | None:
        self.n += int(n or 0)
        return None

    def close(self) -> None:
        unit = "byte" if self.unit == "B" else self.unit
        plural = unit if self.n == 1 else unit[:-1] + "ies" if unit.endswith("y") else unit + "s"
        done = f"{self.n} {plural}"
        sys.stderr.write(f"kvgraft: {self.desc}: {done}\n")
        sys.stderr.flush()


def _bar(enabled: bool, total: int | None, desc: str, unit: str = "B") -> Progress:
    """A tqdm bar on stderr when it is a terminal, a plain line per step otherwise; a no-op when
    disabled, pointless (nothing to do) or tqdm is missing."""
    if not enabled or total == 0:
        return _NoProgress()
    if not sys.stderr.isatty():
        return _LineProgress(desc, unit)
    try:
        from tqdm import tqdm
    except ImportError:
        # tqdm comes with the engine's dependencies; the registry extra alone may lack it.
        return _NoProgress()
    bar: Progress = tqdm(
        total=total, desc=desc, unit=unit, unit_scale=unit == "B", unit_divisor=1024, file=sys.stderr, leave=False
    )
    return bar


@contextlib.contextmanager
def progress_bar(enabled: bool, total: int | None, desc: str, unit: str = "B") -> Iterator[Progress]:
    """A progress bar (``_bar``) closed when the block ends."""
    bar = _bar(enabled, total, desc, unit)
    try:
        yield bar
    finally:
        bar.close()
