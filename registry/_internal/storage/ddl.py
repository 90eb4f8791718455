"""The registry database's schema steps: one registry of migrations that each feature registers into.

The database module (``db.py``) applies migrations but knows no feature: each module that owns
tables registers its own step here when it is imported (``db.py`` the core tables, migration 1;
``search.py`` the search index, 2; ``log/cosignatures.py`` the witness cosignatures, 3). So imports
run one way, from the features down to the database, never back up.

``SCHEMA_VERSION`` is the newest step this kvgraft knows. ``migrations()`` refuses to hand out
an incomplete list (a process that imported ``db`` but not a feature module would otherwise
create a database without that feature's tables and record it as up to date): every version from
1 to ``SCHEMA_VERSION`` must be registered, each once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

# The connection a migration runs on, as both engines' connections provide it (db.py, which
# re-exports it); here, below the database module, so that the schema names it without importing db.py.


class Cursor(Protocol):
    """The rows of one statement."""

    def fetchone(self) -> tuple[Any, ...] | None: ...

    def fetchall(self) -> list[tuple[Any, ...]]: ...

    def fetchmany(self, size: int = ...) -> list[tuple[Any, ...]]: ...


class Connection(Protocol):
    """What a transaction hands out: ``execute`` one statement (``?`` placeholders) and read its rows."""

    def execute(self, query: str, parameters: Any = ..., /) -> Cursor: ...


#: The newest migration this kvgraft knows; raise it with each new ``register`` call.
SCHEMA_VERSION = 3


@dataclass(frozen=True)
class Migration:
    """One schema step: applied once, in order, inside a transaction, on either engine.

    ``statements`` run on both engines as written (the dialect spells BLOB as BYTEA for
    PostgreSQL). ``backfill``, when set, runs after the statements in the same transaction: it
    fills new tables from existing rows with the same code that fills them for new entries.
    ``owner`` is the module that registered it (named when the list is incomplete).
    """

    version: int
    description: str
    statements: tuple[str, ...]
    backfill: Callable[[Connection], None] | None = None
    owner: str = ""


_REGISTERED: dict[int, Migration] = {}


def register(migration: Migration) -> Migration:
    """Add ``migration`` to the schema; return it. Append new migrations, never edit an applied
    one (databases in the field have run it). Registering the same version twice with different
    steps is a programming error."""
    if not 1 <= migration.version <= SCHEMA_VERSION:
        raise RuntimeError(f"migration {migration.version} is outside 1..SCHEMA_VERSION ({SCHEMA_VERSION}) in ddl.py")
    known = _REGISTERED.setdefault(migration.version, migration)
    if known != migration:
        raise RuntimeError(f"migration {migration.version} is registered twice: by {known.owner} and {migration.owner}")
    return migration


def migrations() -> tuple[Migration, ...]:
    """Every registered migration, in version order; refused unless versions 1 to
    ``SCHEMA_VERSION`` are all there (a feature module not imported before the database opened)."""
    missing = [v for v in range(1, SCHEMA_VERSION + 1) if v not in _REGISTERED]
    if missing:
        raise RuntimeError(
            f"schema migrations {missing} are not registered: import the feature modules that own their tables "
            "(search.py, log/cosignatures.py) before opening the database"
        )
    return tuple(_REGISTERED[v] for v in sorted(_REGISTERED))
