"""Verified block bytes handed from vLLM's scheduler to its worker through private shared-memory files.

vLLM's CPU build runs the worker in a process of its own (its multiprocessing executor; so do GPU
engines with several workers), and whatever the scheduler hands the worker is serialized through
vLLM's message queue. Sent as bytes, an 8K-token hit (249 blocks, 370 MB on SmolLM2-135M) was
pickled, sent, received and unpickled: four more passes over the bytes than a load needs, and most
of the time a hit took. So the scheduler reads each block file *into* a file of its own (the
``allocate`` that ``read_verified_block`` reads into), hashing while it reads, and the worker gets
that file's name:

- the files live in a directory ``mkdtemp`` makes for this engine under ``/dev/shm`` (tmpfs:
  memory, not disk), mode 0700; each file is created ``O_EXCL | O_NOFOLLOW``, mode 0600, and its
  space is reserved (``posix_fallocate``) before it is mapped and written, so a full tmpfs is an
  error on that block (a miss), never a SIGBUS;
- the worker maps the file, deletes its name at once, and copies from the mapping into the paged
  cache: one pass over the bytes;
- nothing but this engine's own processes can write those files, so what the worker loads is
  still exactly what the scheduler hashed and checked. The store, shared with other servers, is
  read once, by the scheduler.

Files of hits vLLM did not take are deleted by the scheduler; the directory goes when the
scheduler's connector is shut down or collected, and, since vLLM ends its engine process with a
signal, when the next engine of the same user starts and finds its process gone.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Final

from .errors import ConnectorError

#: The name of each engine's directory: the prefix, its pid, mkdtemp's suffix.
_PREFIX: Final = "kvgraft-vllm-"
#: Where the files go: tmpfs when the machine has one.
_SHM: Final = Path("/dev/shm")


def _remove_stale(root: Path) -> None:
    """Remove the directories of engines of this user that are gone: vLLM ends its engine process
    with a signal, so the directory outlives it (empty, unless it died mid-load)."""
    for directory in root.glob(f"{_PREFIX}*-*"):
        pid = directory.name.removeprefix(_PREFIX).split("-", 1)[0]
        try:
            if not pid.isdigit() or directory.is_symlink() or directory.stat().st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(directory, ignore_errors=True)
        except OSError:
            continue  # alive (another user's, or no permission to ask), or gone already


def _default_root() -> Path:
    return _SHM if _SHM.is_dir() and os.access(_SHM, os.W_OK | os.X_OK) else Path(tempfile.gettempdir())


class Handoff:
    """The scheduler's side: the private directory, and a ``Slot`` per block read into it."""

    def __init__(self, root: Path | None = None) -> None:
        root = root or _default_root()
        _remove_stale(root)
        self.directory = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-", dir=root))
        self._names = itertools.count(1)  # next() is atomic under the GIL: slots may be used from several threads
        self._finalizer = weakref.finalize(self, shutil.rmtree, self.directory, ignore_errors=True)

    def slot(self) -> Slot:
        """A slot for one block: its ``allocate`` is what ``read_verified_block`` reads into."""
        return Slot(self.directory / f"{next(self._names):012d}.kv")

    def discard(self, names: list[str]) -> None:
        """Delete files of verified blocks vLLM did not take."""
        for name in names:
            Path(name).unlink(missing_ok=True)

    def close(self) -> None:
        """Delete the directory and every file left in it."""
        self._finalizer()


class Slot:
    """One block's file: ``allocate`` makes and maps it, then ``take`` (the block verified) hands
    its name on, or ``discard`` (it did not, or was never read) deletes it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._made = False

    def allocate(self, size: int) -> mmap.mmap:
        """The new file of ``size`` bytes, mapped writable."""
        if self._made:
            raise ConnectorError("a handoff slot was allocated twice", hint="report this: one slot holds one block")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        self._made = True
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC here, not SIGBUS when the mapping is written
            return mmap.mmap(fd, size)
        except BaseException:
            self.discard()
            raise
        finally:
            os.close(fd)

    def take(self, mapped: object) -> str:
        """The file's name, for the worker, once ``mapped`` (what ``allocate`` returned, read into and
        verified) is; the scheduler's mapping is closed."""
        if not self._made or not isinstance(mapped, mmap.mmap):
            raise ConnectorError("no handoff file was made for this block", hint="report this: read_verified_block was "
                                 "not given the slot's allocate")
        with contextlib.suppress(BufferError):  # a view still exported: the mapping closes when it is collected
            mapped.close()
        return str(self.path)

    def discard(self) -> None:
        """Delete the file (a block that did not verify)."""
        if self._made:
            self.path.unlink(missing_ok=True)


def open_handed(name: str) -> mmap.mmap:
    """The worker's side: map a file the scheduler handed over and delete its name (the mapping keeps
    the bytes until it is collected). Private and writable, so tensors can view it without a copy."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ConnectorError(f"the verified block {name} handed to the worker is gone: {e.strerror}",
                             hint="report this: only the engine's own processes use that directory") from e
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
