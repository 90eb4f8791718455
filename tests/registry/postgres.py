"""A real PostgreSQL server for the registry's tests: Debian's binaries, its own cluster, a free port.

``PostgresServer`` runs ``initdb`` and ``postgres`` from ``/usr/lib/postgresql/<version>/bin``
(Debian's ``postgresql`` package; ``make test`` installs it through
``scripts/system-packages.sh``) over a fresh directory under the system temp dir, listening on
127.0.0.1 at a free port with its unix socket in that directory, and stops it (``pg_ctl stop``)
when closed. PostgreSQL refuses to run as root: as root the cluster belongs to the ``postgres``
user the Debian package creates (or one made here with ``useradd`` when missing), and every
server command runs as that user through ``runuser``. Nothing here skips: a missing binary or
a server that does not start fails the test with what to do.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg

#: Where Debian puts each PostgreSQL version's server binaries.
_DEBIAN_ROOT = Path("/usr/lib/postgresql")
#: The server's user when the tests run as root (Debian's package creates it).
_SERVER_USER = "postgres"
#: The role the registry connects as (initdb's superuser; trust authentication on loopback only).
ROLE = "kvgraft"
#: Seconds a server start or stop may take.
_TIMEOUT = 60


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_binaries() -> Path:
    """The newest installed PostgreSQL's ``bin`` directory; fails (never skips) when there is none."""
    versions = sorted(
        (p for p in _DEBIAN_ROOT.glob("*/bin") if (p / "initdb").is_file() and (p / "pg_ctl").is_file()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
    )
    if not versions:
        raise RuntimeError(
            f"no PostgreSQL server binaries under {_DEBIAN_ROOT}/*/bin: the registry's PostgreSQL tests need them "
            "(run 'make test', which installs Debian's postgresql package via scripts/system-packages.sh, "
            "or apt-get install postgresql)"
        )
    return versions[-1]


def _server_user() -> str | None:
    """The user the server runs as: None when not root (the current user), else ``postgres``, made if missing."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(_SERVER_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", _SERVER_USER],
            check=True, capture_output=True, timeout=_TIMEOUT,
        )
    return _SERVER_USER


class PostgresServer:
    """One PostgreSQL cluster on 127.0.0.1:``port``; ``database(name)`` makes a database and returns its URL."""

    def __init__(self) -> None:
        self.bin = server_binaries()
        self.user = _server_user()
        # Not under pytest's tmp dir: its parents are root's 0700 directories, closed to the server's user.
        self.root = Path(tempfile.mkdtemp(prefix="kvgraft-pg-"))
        self.data = self.root / "data"
        self.socket_dir = self.root / "sock"
        self.socket_dir.mkdir()
        self.log = self.root / "server.log"
        self.port = _free_port()
        self._options = ""
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            for path in (self.root, self.socket_dir):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        self._count = 0

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = [str(self.bin / args[0]), *args[1:]]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        return subprocess.run(command, capture_output=True, text=True, timeout=_TIMEOUT, cwd=self.root)

    def start(self) -> None:
        """``initdb``, then start the server (waiting until it accepts connections)."""
        done = self._run("initdb", "-D", str(self.data), "-U", ROLE, "-A", "trust", "-E", "UTF8", "--no-sync",
                         "--no-instructions")
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed ({done.returncode}): {done.stderr.strip() or done.stdout.strip()}")
        options = (
            f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 -c max_connections=200 "
            # A test cluster: durability is the registry's business in the crash tests, which kill
            # the registry's processes, never this server.
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        )
        self._options = options
        self._pg_ctl("start")

    def restart(self) -> None:
        """Stop the server (``-m fast``: every session is ended) and start it again on the same port."""
        self._pg_ctl("restart", "-m", "fast")

    def _pg_ctl(self, action: str, *args: str) -> None:
        done = self._run("pg_ctl", "-D", str(self.data), "-o", self._options, "-l", str(self.log), "-w", "-t", str(_TIMEOUT),
                         *args, action)
        if done.returncode != 0:
            log = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"pg_ctl {action} failed ({done.returncode}): {done.stderr.strip()}\n{log}")

    def url(self, database: str = "postgres") -> str:
        """The libpq URL of ``database`` on this server."""
        return f"postgresql://{ROLE}@127.0.0.1:{self.port}/{database}"

    def database(self, prefix: str = "registry") -> str:
        """A new, empty database (``<prefix>_<n>``); its URL."""
        self._count += 1
        name = f"{prefix}_{os.getpid()}_{self._count}"
        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        if self.data.exists():
            self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", str(_TIMEOUT), "stop")
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A started server, stopped (and its files removed) when the block ends."""
    server = PostgresServer()
    try:
        server.start()
        yield server
    finally:
        server.stop()
