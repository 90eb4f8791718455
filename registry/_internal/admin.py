"""Admin commands' backend: the database directly, or the running server's admin API.

DuckDB lets one process open the file, and the server holds it for its whole life. So an admin
command first tries to open the database itself (the server is not running: changes apply at
its next start); when the file is locked it reads ``DATA/admin.json``, which the running
server writes (mode 0600) with its URL and a fresh admin secret, and asks the server to make
the change (it applies to the very next request). Both paths run the same ``Accounts`` code.

A PostgreSQL database (``--database``) is shared by every server process, so an admin command
always changes it directly; each running server sees the change before its next batch of
publishes, and within milliseconds for every other request (accounts.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

# Imported for their tables: each registers its migration (storage/ddl.py) before a database opens here.
from . import search  # noqa: F401
from .accounts import Accounts
from .datadir import DataDir, prepare, read_admin_handle
from .errors import AdminUnavailableError, DatabaseLockedError, RegistryError
from .log import cosignatures  # noqa: F401
from .storage.db import Database

#: Seconds an admin call to the server may take.
_TIMEOUT = 30.0


class AdminBackend(Protocol):
    """What admin commands can do, wherever the database is."""

    def add_key(self, publisher: str, public_key: str) -> dict[str, Any]: ...

    def list_keys(self) -> list[dict[str, Any]]: ...

    def create_token(self, publisher: str, public_keys: list[str]) -> dict[str, Any]: ...

    def list_tokens(self) -> list[dict[str, Any]]: ...

    def revoke_token(self, token_id: str) -> dict[str, Any]: ...


class RemoteAdminError(RegistryError):
    """The running server refused an admin request; its problem document's detail and hint."""

    slug = "remote-admin"
    title = "Admin request refused"


class ServerAdmin:
    """The admin API of the server that holds the database."""

    def __init__(self, url: str, secret: str) -> None:
        import httpx

        self.url = url
        self._client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=_TIMEOUT)

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        try:
            response = self._client.request(method, path, json=body)
        except httpx.HTTPError as e:
            raise AdminUnavailableError(
                f"the registry database is locked by a running server, but its admin API at {self.url} did not answer: {e}",
                hint="check that the server is up; if it died, its lock is gone and the command will use the database directly",
            ) from e
        if response.status_code >= 400:
            try:
                doc = response.json()
            except ValueError:
                doc = {}
            detail = doc.get("detail") if isinstance(doc, dict) else None
            error = RemoteAdminError(
                f"the server refused: {detail or response.reason_phrase} (HTTP {response.status_code})",
                hint=doc.get("hint") if isinstance(doc, dict) and isinstance(doc.get("hint"), str) else None,
            )
            error.status_code = response.status_code
            raise error
        return response.json()

    def add_key(self, publisher: str, public_key: str) -> dict[str, Any]:
        """POST /v1/admin/keys."""
        result: dict[str, Any] = self._call("POST", "/v1/admin/keys", {"publisher": publisher, "public_key_pem": public_key})
        return result

    def list_keys(self) -> list[dict[str, Any]]:
        """GET /v1/admin/keys."""
        keys: list[dict[str, Any]] = self._call("GET", "/v1/admin/keys")["keys"]
        return keys

    def create_token(self, publisher: str, public_keys: list[str]) -> dict[str, Any]:
        """POST /v1/admin/tokens."""
        result: dict[str, Any] = self._call("POST", "/v1/admin/tokens", {"publisher": publisher, "public_keys_pem": public_keys})
        return result

    def list_tokens(self) -> list[dict[str, Any]]:
        """GET /v1/admin/tokens."""
        tokens: list[dict[str, Any]] = self._call("GET", "/v1/admin/tokens")["tokens"]
        return tokens

    def revoke_token(self, token_id: str) -> dict[str, Any]:
        """POST /v1/admin/tokens/{id}/revoke."""
        result: dict[str, Any] = self._call("POST", f"/v1/admin/tokens/{token_id}/revoke")
        return result


@contextlib.contextmanager
def admin_session(root: Path, *, create: bool, database: str | None = None) -> Iterator[tuple[AdminBackend, str]]:
    """An admin backend for the data directory ``root`` and how it was reached ("database" or "server").

    With ``create`` a missing data directory is initialised (its database only: the registry
    key and the log's origin are made by the first ``kvgraft serve``). ``database``: a
    PostgreSQL URL instead of the data directory's DuckDB file.
    """
    if create:
        prepare(root)
    elif not root.is_dir():
        raise AdminUnavailableError(f"{root} is not a registry data directory (it does not exist)", hint="check --data")
    try:
        db = Database.open(root, create=create, database=database)
        db.release_log()  # an admin change appends nothing to the log
    except DatabaseLockedError as e:
        handle = read_admin_handle(DataDir(root))
        if handle is None or handle.url is None:
            raise AdminUnavailableError(
                f"{e.message}, and no running server left an admin handle ({root / 'admin.json'})",
                hint="wait for the other admin command to finish, or start the server with 'kvgraft serve'",
            ) from e
        server = ServerAdmin(handle.url, handle.secret)
        try:
            yield server, "server"
        finally:
            server.close()
        return
    try:
        yield Accounts(db), "database"
    finally:
        db.close()
