"""A kvgraft server in a subprocess, for the tests of every package that runs one (the registry,
the witness, the engine server): started with ``python -m kvgraft``, waited for within a bound,
and stopped SIGTERM first, SIGKILL after 20 s."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class KvgraftProcess:
    """``python -m kvgraft ARGS`` serving on 127.0.0.1:``port``; always stopped by ``stop``.

    Subclasses say what they are (``what``, for messages) and when they answer (``ready``).
    """

    what = "process"

    def __init__(self, args: Sequence[str], log: Path, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_path = log
        self._log = log.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvgraft", *args], stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO
        )

    def ready(self) -> bool:
        """Whether the process answers its probe request now."""
        raise NotImplementedError

    def log(self) -> str:
        return self._log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the {self.what} exited with {self.proc.returncode}:\n{self.log()}")
            with contextlib.suppress(httpx.HTTPError):
                if self.ready():
                    return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the {self.what} did not answer within {timeout} s:\n{self.log()}")

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after 20 s; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        return self.proc.returncode
