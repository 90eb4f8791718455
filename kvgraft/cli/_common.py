"""What every ``kvgraft`` command shares: its error, the global options, the guard, the output.

A command is ``run(args) -> dict`` (``Command``): the dict is the ``--json`` object (without
``ok``) and holds a ``summary``, the text printed without ``--json``. A failure is any
``kvgraft.KvgraftError``; ``main`` prints it as one line on stderr (``kvgraft: <Class>: <str>``)
and, under ``--json``, as ``{"ok": false, "error": <Class>, "message": ...}`` on stdout, with the
real class name. Nothing here imports the engine or the registry: the commands load them when
they run, so ``kvgraft keys`` and ``kvgraft --help`` work without those extras.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from kvgraft import __version__
from kvgraft.schemas import KvgraftError
from kvgraft.verifier.cli import ToolParser, examples_text

#: One command: parsed options in, the result document out (see the module docstring).
Command = Callable[[argparse.Namespace], dict[str, Any]]

#: Where a registry token is read from when ``--token`` is not given (keeps it out of ``ps`` and history).
TOKEN_ENV = "KVGRAFT_TOKEN"

#: The most a command reads of a PEM key file before refusing it: a key is a few hundred bytes.
MAX_KEY_FILE_BYTES = 64 * 1024


class CliError(KvgraftError):
    """A user-facing failure of a ``kvgraft`` command (bad options, local files): one line, with a hint.

    ``result`` is what the command found out before it failed (``kvgraft fsck``'s report);
    ``--json`` prints it with the failure.
    """

    def __init__(self, message: str, *, hint: str, result: dict[str, Any] | None = None) -> None:
        super().__init__(message, hint=hint)
        self.result = result


# --- the parser ----------------------------------------------------------------------------------


class CommandParser(ToolParser):
    """The parser of ``kvgraft`` and of each (sub)command: all of them accept the global options
    anywhere (before or after the command's name, as git, gh and kubectl do); a mistyped command
    or option gets a "did you mean" (the rules are ``kvgraft.verifier.cli.ToolParser``'s, shared
    with ``kvgraft-verify``)."""

    GLOBAL_OPTIONS = (("--json", "print one JSON object instead of a line (anywhere on the command line)"),)


def top_parser(prog: str, description: str) -> ToolParser:
    """``kvgraft``'s own parser: the global options default to off here, and only here; ``--version``."""
    return CommandParser.top(prog=prog, description=description, version=__version__)


# --- optional extras -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Extra:
    """An optional part of kvgraft a command needs, and how to install it."""

    what: str
    install: str


ENGINE = Extra("the engine", "pip install 'kvgraft[engine]' (torch==2.13.0 first)")
REGISTRY = Extra("the registry", "pip install 'kvgraft[registry]'")
REGISTRY_CLIENT = Extra("the registry client", "pip install 'kvgraft[registry]'")
#: ``kvgraft engine serve`` runs the engine under the registry's web stack (litestar, uvicorn).
ENGINE_SERVER = Extra("the engine server", "pip install 'kvgraft[engine,registry]' (torch==2.13.0 first)")
#: ``kvgraft ask --engine`` needs only httpx (and the wire models in kvgraft.schemas).
ENGINE_CLIENT = Extra("the engine client", "pip install 'kvgraft[registry]' (for httpx)")


@contextmanager
def needs(extra: Extra) -> Iterator[None]:
    """Report a dependency missing inside the block as one line naming the extra to install."""
    try:
        yield
    except ImportError as e:
        raise CliError(f"{extra.what} is not installed ({e.name} is missing)", hint=extra.install) from e


def guarded(command: Command, extra: Extra, *, out_of_memory_hint: str | None = None) -> Command:
    """``command`` with a missing ``extra`` (and, given a hint, exhausted memory) reported as one line."""

    def run(args: argparse.Namespace) -> dict[str, Any]:
        with needs(extra):
            try:
                return command(args)
            except (MemoryError, RecursionError) as e:
                if out_of_memory_hint is None:
                    raise
                # The client bounds what it reads, but the machine may still have less memory
                # than a limit allows: one line, like every other failure.
                ran_out = "memory" if isinstance(e, MemoryError) else "stack"
                raise CliError(f"{type(e).__name__}: the command ran out of {ran_out}", hint=out_of_memory_hint) from e

    return run


def add_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, command: Command, *, help: str,
    extra: Extra | None = None, out_of_memory_hint: str | None = None, examples: Sequence[tuple[str, str]] = (),
) -> argparse.ArgumentParser:
    """Add subcommand ``name`` running ``command`` (guarded when it needs an ``extra``); return its
    parser. ``examples``: (command line, what it does) pairs shown at the end of its ``--help``."""
    parser = sub.add_parser(name, help=help, epilog=examples_text(examples) if examples else None)
    parser.set_defaults(run=command if extra is None else guarded(command, extra, out_of_memory_hint=out_of_memory_hint))
    return parser


# --- shared inputs -------------------------------------------------------------------------------


def passphrase(env_var: str | None) -> bytes | None:
    """The passphrase held in environment variable ``env_var`` (none when no variable is named)."""
    if env_var is None:
        return None
    value = os.environ.get(env_var)
    if not value:
        raise CliError(f"environment variable {env_var} is empty or unset", hint=f"export {env_var}=... first")
    return value.encode("utf-8")


def token(given: str | None, *, required: bool, what: str = "this command") -> str | None:
    """A registry token: ``--token``, else ``$KVGRAFT_TOKEN``; refused when ``required`` and neither is set."""
    value = given or os.environ.get(TOKEN_ENV) or None
    if required and not value:
        raise CliError(f"{what} needs a registry token", hint=f"pass --token T, or export {TOKEN_ENV}=T")
    return value


def progress(enabled: bool, line: str) -> None:
    """A progress line on stderr (stdout holds only the result)."""
    if enabled:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


# --- output --------------------------------------------------------------------------------------


def print_result(result: dict[str, Any], *, as_json: bool) -> None:
    """A command's result: one JSON object with ``"ok": true``, or its summary."""
    if as_json:
        sys.stdout.write(json.dumps({"ok": True, **result}, sort_keys=True) + "\n")
    else:
        sys.stdout.write(result["summary"] + "\n")


def print_failure(error: KvgraftError, *, as_json: bool) -> int:
    """A failure: one line on stderr naming the error's own class; under ``as_json`` also on stdout. Returns 1."""
    line = " ".join(str(error).split())
    name = type(error).__name__
    if as_json:
        found = error.result if isinstance(error, CliError) and error.result else {}
        sys.stdout.write(json.dumps({**found, "ok": False, "error": name, "message": line}, sort_keys=True) + "\n")
    sys.stderr.write(f"kvgraft: {name}: {line}\n")
    return 1
