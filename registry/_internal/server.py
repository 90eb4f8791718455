"""``kvgraft serve``: the registry app under uvicorn."""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
import sys
from pathlib import Path

from .errors import ConfigError
from .service import Registry
from .settings import RegistrySettings


def local_url(host: str, port: int) -> str:
    """The URL admin commands on this machine use to reach a server bound to ``host:port``."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a host name
    return f"http://{host}:{port}"


def serve(data_dir: Path, *, host: str, port: int, settings: RegistrySettings, log_level: str = "info") -> bool:
    """Serve ``data_dir`` on ``host:port`` until interrupted (SIGINT/SIGTERM); False if it never started.

    The data directory is opened once before the server starts, so that a bad setting, a
    locked database or a damaged log is reported plainly instead of from inside uvicorn.
    """
    import uvicorn

    from .app import create_app

    if not 1 <= port <= 65535:
        raise ConfigError(f"port {port} is not between 1 and 65535", hint="pass --port 8000, or another free port")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    registry_logger = logging.getLogger("kvgraft.registry")
    registry_logger.addHandler(handler)
    registry_logger.setLevel(log_level.upper())
    registry_logger.propagate = False
    try:
        with Registry.open(data_dir, settings):
            pass
        app = create_app(data_dir, dataclasses.replace(settings, admin_url=local_url(host, port)))
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            lifespan="on",
            server_header=False,
            # A client stuck mid-download must not keep a stopping server up for long.
            timeout_graceful_shutdown=10,
        )
        server = uvicorn.Server(config)
        server.run()
        return bool(server.started)
    finally:
        registry_logger.removeHandler(handler)
        registry_logger.propagate = True
