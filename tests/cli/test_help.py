"""Both command lines meet people's habits (issue 38): ``--version``; commands grouped in help,
with examples; help on every option; "did you mean" for a mistyped command or option; global
options anywhere; dataset formats in ``--help``; a bad profile named as one; no ``None`` printed
for a missing answer; progress lines, not bars, when stderr is not a terminal."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvgraft
from kvgraft.cli import COMMAND_GROUPS, build_parser, main
from kvgraft.verifier import cli as verify_cli
from kvgraft.verifier.cli import ToolParser, walk

TOOLS = {"kvgraft": build_parser, "kvgraft-verify": verify_cli.build_parser}


def _run(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """The real command in a fresh interpreter (its console script runs the same ``run``)."""
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(("module", "prog"), [("kvgraft", "kvgraft"), ("kvgraft.verifier", "kvgraft-verify")])
def test_version_on_both_tools(module: str, prog: str) -> None:
    done = _run(module, "--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{prog} {kvgraft.__version__}\n"


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_option_of_every_command_has_help(tool: str) -> None:
    missing = [
        (" ".join((tool, *path)), action.dest)
        for path, parser in walk(TOOLS[tool]())
        for action in parser._actions
        # A subcommand's name is the one positional without help of its own: its choices are listed with theirs.
        if not isinstance(action, argparse._SubParsersAction) and (not action.help or not action.help.strip())
    ]
    assert missing == []


def test_every_kvgraft_command_is_in_exactly_one_group() -> None:
    parser = build_parser()
    assert isinstance(parser, ToolParser)
    assert [title for title, _ in COMMAND_GROUPS] == ["start here", "engine", "flywheel", "registry", "admin"]
    assert parser.ungrouped_commands() == []
    assert verify_cli.build_parser().ungrouped_commands() == []


def test_help_lists_the_groups_in_order_then_examples() -> None:
    done = _run("kvgraft", "--help")
    assert done.returncode == 0, done.stderr
    text = done.stdout
    headings = [text.index(f"\n{title}:\n") for title, _ in COMMAND_GROUPS]
    assert headings == sorted(headings)
    assert text.index("\n  ask ") < text.index("\nengine:\n") < text.index("\n  capture ")
    assert "\nexamples:\n  kvgraft library deposit --model smollm2-135m" in text
    # The example block is kept line for line, not reflowed into a paragraph.
    assert "\n  kvgraft pull --registry http://127.0.0.1:8000 --out pulled sha256:1f2e3d4c\n" in text
    assert "Run 'kvgraft COMMAND --help' for a command's options." in text


def test_a_command_help_starts_with_what_it_does() -> None:
    done = _run("kvgraft", "ask", "--help")
    assert done.returncode == 0, done.stderr
    assert "\nanswer a question from a library" in done.stdout


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["aks"], "invalid choice: 'aks' (did you mean 'ask'?)"),
        (["library", "depost"], "invalid choice: 'depost' (did you mean 'deposit'?)"),
        (["pul", "x"], "invalid choice: 'pul' (did you mean 'pull' or 'publish'?)"),
        (["keys", "generate", "--out", "k.pem", "--jsn"], "unrecognized arguments: --jsn (did you mean '--json'?)"),
    ],
)
def test_regression_mistyped_command_gets_a_suggestion(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    _, stderr = capsys.readouterr()
    assert e.value.code == 2
    assert expected in stderr and "--help' for help." in stderr


def test_nothing_close_lists_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["zzzzzz"])
    _, stderr = capsys.readouterr()
    assert "invalid choice: 'zzzzzz' (choose from keys, sign, oms, models," in stderr


def test_verify_mistyped_command_gets_a_suggestion() -> None:
    done = _run("kvgraft.verifier", "audt", "report")
    assert done.returncode == 2
    assert "invalid choice: 'audt' (did you mean 'audit'?)" in done.stderr


@pytest.mark.parametrize("where", ["before", "after", "both"])
def test_regression_verify_json_accepted_anywhere(tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str) -> None:
    """``kvgraft-verify`` took ``--json`` only before the command; now anywhere, as ``kvgraft`` does."""
    argv = ["audit", str(tmp_path / "no-report")]
    argv = {"before": ["--json", *argv], "after": [*argv, "--json"], "both": ["--json", *argv, "--json"]}[where]
    assert verify_cli.main(argv) == 1
    stdout, stderr = capsys.readouterr()
    doc = json.loads(stdout)
    assert doc["ok"] is False and doc["error"] == "MalformedInputError"
    assert "no-report does not exist or is not a directory" in doc["message"]
    assert stderr.startswith("kvgraft-verify: MalformedInputError: ")


def test_verify_json_is_off_unless_given() -> None:
    assert verify_cli.build_parser().parse_args(["audit", "r"]).json is False
    assert verify_cli.build_parser().parse_args(["envelope", "e.json", "--trusted-keys", "t.json"]).json is False


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("kvgraft", ["eval", "--help"]),
        ("kvgraft", ["library", "deposit", "--help"]),
        ("kvgraft", ["prereg", "--help"]),
        ("kvgraft.verifier", ["eval", "--help"]),
    ],
)
def test_dataset_formats_are_in_help(module: str, argv: list[str]) -> None:
    done = _run(module, *argv)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    for shown in ('AIME {"prompt": str, "answer": int}', 'GSM8K {"question": str, "answer": "...#### N"}',
                  'qa {"question": str, "answer": str or int}', "256 MiB"):
        assert shown in text, (argv, shown)


def test_regression_bad_profile_is_unknown_profile_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad ``--profile`` was reported as ``UnknownModelError``."""
    pytest.importorskip("torch")
    (tmp_path / "p.txt").write_text("The sky is blue.")
    (tmp_path / "q.txt").write_text(" Why?")
    code = main(["fresh", "--model", "tiny-llama-test", "--profile", "fast", "--prefix-file", str(tmp_path / "p.txt"),
                 "--text-file", str(tmp_path / "q.txt"), "--json"])
    stdout, stderr = capsys.readouterr()
    assert code == 1
    doc = json.loads(stdout)
    assert doc["error"] == "UnknownProfileError", doc
    assert "no determinism profile named 'fast'; known: cpu-fp32, " in doc["message"]
    assert "cpu-fp32-sdpa" in doc["message"] and "(hint: use --profile cpu-fp32-sdpa (the default))" in doc["message"]
    assert stderr.startswith("kvgraft: UnknownProfileError: ")


def test_regression_ask_never_prints_none_for_a_missing_answer() -> None:
    from kvgraft.cli.flywheel import NO_ANSWER, _ask_summary, shown_answer

    # An unassisted answer whose text holds nothing the grader can extract (Answer.to_json's fields).
    result = {"text": "I am not sure.", "answer": None, "entry": None, "method": "none", "kind": "unassisted",
              "finished": True, "stopped_by": "eos", "score": 0.0, "signature": "none (nothing grafted)",
              "prompt_tokens": 12, "decode_tokens": 3, "context_tokens": 40, "seconds": 0.5, "energy_joules": 1.0,
              "energy_method": "estimated"}
    line = _ask_summary(result)
    assert "None" not in line and NO_ANSWER in line
    assert "12 prompt + 3 decode tokens on 28 grafted" in line
    assert shown_answer(None) == shown_answer("  ") == NO_ANSWER and shown_answer("72") == "72"


def test_regression_progress_is_plain_lines_when_stderr_is_not_a_terminal(tmp_path: Path) -> None:
    """A pull's byte bar left ``0.00B [00:00, ?B/s]`` residue in logs; off a terminal it is one line per step."""
    pytest.importorskip("httpx")
    script = (
        "from kvgraft.registry.client.progress import progress_bar\n"
        "with progress_bar(True, None, 'pull art') as bar:\n"
        "    bar.update(1000); bar.update(24)\n"
        "with progress_bar(True, 3, 'mirror a -> b', unit='entry') as bar:\n"
        "    bar.update(1); bar.update(2)\n"
    )
    log = tmp_path / "stderr.log"
    with log.open("w") as err:
        subprocess.run([sys.executable, "-c", script], stderr=err, check=True, timeout=60)
    text = log.read_text()
    assert "\r" not in text and "B/s" not in text
    assert text == "kvgraft: pull art: 1024 bytes\nkvgraft: mirror a -> b: 3 entries\n"


def test_every_help_example_parses_and_shows_in_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    import shlex

    from kvgraft.cli import COMMAND_EXAMPLES, EXAMPLES

    parser = build_parser()
    helps = {path: p.format_help() for path, p in walk(parser)}
    examples = [((), line) for line, _ in EXAMPLES] + [(path, line) for path, shown in COMMAND_EXAMPLES.items()
                                                      for line, _ in shown]
    assert len(examples) >= 15
    for path, line in examples:
        argv = shlex.split(line)
        assert argv[0] == "kvgraft"
        try:
            args = build_parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"example {line!r} does not parse: {capsys.readouterr().err}")
        assert callable(args.run)
        assert path in helps and f"  {line}\n" in helps[path], (path, line)


def test_every_verify_example_parses_and_shows_in_its_help(capsys: pytest.CaptureFixture[str]) -> None:
    import shlex

    helps = {path: p.format_help() for path, p in walk(verify_cli.build_parser())}
    examples = [((), line) for line, _ in verify_cli.EXAMPLES] + [
        ((name,), line) for name, shown in verify_cli.COMMAND_EXAMPLES.items() for line, _ in shown
    ]
    for path, line in examples:
        argv = shlex.split(line)
        assert argv[0] == "kvgraft-verify"
        try:
            args = verify_cli.build_parser().parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"example {line!r} does not parse: {capsys.readouterr().err}")
        assert callable(args.run)
        assert f"  {line}\n" in helps[path], (path, line)
