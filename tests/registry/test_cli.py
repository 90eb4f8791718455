"""``kvgraft token`` / ``kvgraft key`` against a data directory with no server running."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvgraft.cli import main

from .conftest import Key


def _run(capsys: pytest.CaptureFixture[str], *argv: str | Path) -> tuple[int, dict[str, Any], str]:
    code = main(["--json", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, json.loads(out), err


def test_keys_and_tokens_without_a_server(tmp_path: Path, keys: dict[str, Key], capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "data"
    code, out, _ = _run(capsys, "key", "add", "--data", data, "--publisher", "bob", "--public-key", keys["bob"].pub_path)
    assert code == 0 and out["created"] is True and out["via"] == "database"
    code, out, _ = _run(capsys, "key", "add", "--data", data, "--publisher", "bob", "--public-key", keys["bob"].pub_path)
    assert code == 0 and out["created"] is False and "was already registered" in out["summary"]

    code, out, _ = _run(capsys, "token", "create", "--data", data, "--publisher", "alice", "--key", keys["alice"].pub_path)
    assert code == 0
    token, token_id = out["token"], out["token_id"]
    assert token.startswith("kvgr_") and token in out["summary"] and "only time the token is shown" in out["summary"]
    assert out["registered_keys"] == out["keyids"]

    code, out, _ = _run(capsys, "token", "list", "--data", data)
    assert [t["token_id"] for t in out["tokens"]] == [token_id]
    assert token not in json.dumps(out)
    code, out, _ = _run(capsys, "key", "list", "--data", data)
    assert sorted(k["publisher"] for k in out["keys"]) == ["alice", "bob"]

    code, out, _ = _run(capsys, "token", "revoke", "--data", data, token_id)
    assert code == 0 and out["changed"] is True and "the server was not running" in out["summary"]
    code, out, _ = _run(capsys, "token", "revoke", "--data", data, token_id)
    assert out["changed"] is False and "already" in out["summary"]
    code, out, _ = _run(capsys, "token", "list", "--data", data)
    assert out["tokens"][0]["revoked"] is True
    # The token is stored hashed: its text is nowhere in the database file.
    assert token.encode() not in (data / "registry.duckdb").read_bytes()


@pytest.mark.parametrize(
    ("argv", "error", "message"),
    [
        (["token", "list", "--data", "{tmp}/missing"], "AdminUnavailableError", "is not a registry data directory"),
        (["token", "revoke", "--data", "{tmp}/data", "tok_123"], "TokenNotFoundError", "is not a token id"),
        (["token", "revoke", "--data", "{tmp}/data", "tok_000000000000"], "TokenNotFoundError", "no token has id tok_000000000000"),
        (["key", "add", "--data", "{tmp}/data", "--publisher", "x", "--public-key", "{tmp}/nope.pub"], "CliError", "does not exist"),
        (["key", "add", "--data", "{tmp}/data", "--publisher", "Not OK", "--public-key", "{alice}"], "InvalidNameError",
         "publisher name 'Not OK'"),
        (["key", "add", "--data", "{tmp}/data", "--publisher", "x", "--public-key", "{alice_private}"], "BadRequestError",
         "not a PEM public key"),
        (["token", "create", "--data", "{tmp}/data", "--publisher", "bob", "--key", "{alice}"], "ConflictError",
         "registered for publisher 'alice'"),
    ],
)
def test_failures_are_one_line(
    tmp_path: Path, keys: dict[str, Key], capsys: pytest.CaptureFixture[str], argv: list[str], error: str, message: str
) -> None:
    main(["key", "add", "--data", str(tmp_path / "data"), "--publisher", "alice", "--public-key", str(keys["alice"].pub_path)])
    capsys.readouterr()
    fill = {"tmp": str(tmp_path), "alice": str(keys["alice"].pub_path), "alice_private": str(keys["alice"].path)}
    code = main([a.format(**fill) for a in argv])
    out, err = capsys.readouterr()
    assert code == 1
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    # The registry's own error class, not a wrapper (a failure of the command's own options is a CliError).
    assert err.startswith(f"kvgraft: {error}: ")
    assert message in err


def test_kvgraft_has_the_registry_commands() -> None:
    """``kvgraft.cli`` must add the registry's commands (``kvgraft/cli/serve.py``) to its parser."""
    from kvgraft.cli import build_parser

    parser = build_parser()
    for argv in (["serve", "--data", "d"], ["token", "list", "--data", "d"], ["key", "list", "--data", "d"]):
        assert callable(parser.parse_args(argv).run)


def test_the_commands_import_neither_litestar_nor_duckdb() -> None:
    """``kvgraft`` loads these commands at start; without the registry extra they must still import."""
    import subprocess
    import sys

    code = (
        "import sys, kvgraft.registry, kvgraft.cli; "
        "heavy = [m for m in ('litestar', 'duckdb', 'uvicorn', 'httpx', 'anyio') if m in sys.modules]; "
        "print(heavy); sys.exit(1 if heavy else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
