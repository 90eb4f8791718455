"""Global options go before or after the subcommand (``kvgraft --json ask ...`` and
``kvgraft ask ... --json``), as git, gh and kubectl accept them; failures name their real class."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from kvgraft.cli import build_parser, main

ASK = ["ask", "--library", "lib", "--question", "2 + 2?"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--json", *ASK],
        [*ASK, "--json"],
        ["ask", "--json", "--library", "lib", "--question", "2 + 2?"],
        ["--json", *ASK, "--json"],
    ],
    ids=["before", "after", "between", "both"],
)
def test_json_is_accepted_before_or_after_the_subcommand(argv: list[str]) -> None:
    assert build_parser().parse_args(argv).json is True


def test_json_is_off_unless_given() -> None:
    assert build_parser().parse_args(ASK).json is False
    assert build_parser().parse_args(["keys", "generate", "--out", "k.pem"]).json is False


@pytest.mark.parametrize(
    "argv",
    [
        ["--json", "keys", "generate", "--out", "{out}"],
        ["keys", "--json", "generate", "--out", "{out}"],
        ["keys", "generate", "--out", "{out}", "--json"],
    ],
    ids=["before", "between", "after"],
)
def test_nested_subcommands_take_json_anywhere(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    out = tmp_path / "k.pem"
    code = main([a.format(out=out) for a in argv])
    stdout, _ = capsys.readouterr()
    result = json.loads(stdout)
    assert code == 0 and result["ok"] is True and result["private_key"] == str(out)
    assert out.is_file() and out.with_name("k.pem.pub").is_file()


def test_without_json_the_summary_is_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "generate", "--out", str(tmp_path / "k.pem")]) == 0
    stdout, _ = capsys.readouterr()
    assert stdout.startswith(f"wrote {tmp_path / 'k.pem'} (private, mode 0600)") and stdout.count("\n") == 1


def _failure(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[dict[str, Any], str]:
    assert main(argv) == 1
    stdout, stderr = capsys.readouterr()
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    return json.loads(stdout), stderr


@pytest.mark.parametrize("where", ["before", "after"])
def test_a_failure_is_json_whichever_place_json_is_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    argv = ["keys", "trust", "--file", str(tmp_path / "t.json"), "--name", "x", "--public-key", str(tmp_path / "no.pub")]
    doc, stderr = _failure(capsys, ["--json", *argv] if where == "before" else [*argv, "--json"])
    assert doc["ok"] is False and doc["error"] == "KeyFileError", doc
    assert stderr.startswith("kvgraft: KeyFileError: ")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_client_failure_names_the_client_error_class(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """No ``CliError: RegistryUnavailableError: ...`` wrapper: the client's own class, under --json too."""
    pytest.importorskip("httpx")
    url = f"http://127.0.0.1:{_closed_port()}"
    doc, stderr = _failure(capsys, ["pull", "--registry", url, "--out", str(tmp_path / "p"), "sha256:" + "ab" * 32,
                                    "--timeout", "5", "--json"])
    assert doc["error"] == "RegistryUnavailableError", doc
    assert stderr.startswith("kvgraft: RegistryUnavailableError: ") and "CliError" not in stderr
    assert not doc["message"].startswith("RegistryUnavailableError")
