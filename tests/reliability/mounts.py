"""Real full disks for the tests: a small tmpfs, mounted for the test and unmounted after.

A test that needs one fails when the machine cannot mount it (``make test`` and CI run as root, or
with ``unshare``), as the browser tests fail without Chromium: a silent skip would pass a disk-full
path nobody ran. There is no opt-out: a machine that cannot mount one cannot run these tests.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest


def cannot_mount(reason: str) -> NoReturn:
    """Fail a test that needs a small tmpfs, saying how to run it."""
    pytest.fail(f"{reason}: this test needs a real full disk (a small tmpfs); run it as root or with unshare(1)")


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (created) in this mount namespace; needs root."""
    where.mkdir(parents=True)
    if os.geteuid() != 0:
        cannot_mount("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True, text=True)
    if done.returncode != 0:
        cannot_mount(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False, capture_output=True)


def fill(disk: Path) -> None:
    """Write a filler file until the file system is full; any error but ENOSPC is raised."""
    with (disk / "filler").open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
