"""The argument parser both command lines share (``kvgraft`` and ``kvgraft-verify``).

One rule in one place, for both tools:

- global options (``--json``) are accepted before, between or after the subcommand names, as git,
  gh and kubectl accept them: every parser of the tree is a ``ToolParser`` (``add_subparsers``
  makes its children of the parent's class), and adds them; below the top their default is
  ``SUPPRESS`` so that a subcommand never resets what the top level parsed;
- a mistyped command or option gets a "did you mean" (difflib), as git and pip do;
- the top-level help lists the commands in named groups, then examples;
- text in a help paragraph indented by two spaces (examples) is kept as written; the rest is wrapped.

It lives in the verifier because ``kvgraft-verify`` may import only the verifier and the schemas;
``kvgraft``'s CLI reaches it through ``kvgraft.verifier.cli``.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar, NoReturn

#: How many suggestions a "did you mean" offers at most.
_SUGGESTIONS = 3


def suggestions(word: str, known: Sequence[str]) -> list[str]:
    """The known words closest to ``word`` (difflib's ratio over 0.6), best first."""
    return difflib.get_close_matches(word, list(known), n=_SUGGESTIONS, cutoff=0.6)


def did_you_mean(word: str, known: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known words, or ``""`` when none is close."""
    close = suggestions(word, known)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that a paragraph with lines indented by two spaces (an
    example block) is kept line for line instead of being reflowed."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for para in text.split("\n\n"):
            if any(line.startswith("  ") for line in para.splitlines()):
                paragraphs.append("\n".join(indent + line for line in para.splitlines()))
            else:
                paragraphs.append(super()._fill_text(para, width, indent))
        return "\n\n".join(paragraphs)


def examples_text(examples: Sequence[tuple[str, str]]) -> str:
    """An ``examples:`` block: each command line, then what it does, indented (kept as written)."""
    lines = ["examples:"]
    for command, what in examples:
        lines += [f"  {command}", f"      {what}"]
    return "\n".join(lines)


class _SubParsers(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Subcommands whose own ``--help`` starts with the line the parent's list shows for them."""

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        if kwargs.get("help") and "description" not in kwargs:
            kwargs["description"] = kwargs["help"]
        parser: argparse.ArgumentParser = super().add_parser(name, **kwargs)
        return parser


class ToolParser(argparse.ArgumentParser):
    """The parser of a tool and of each of its (sub)commands.

    A tool subclasses it and sets ``GLOBAL_OPTIONS``: ``(flags, help)`` pairs of ``store_true``
    options accepted anywhere on the command line. Only the top-level parser (``top``) defaults
    them to ``False``.
    """

    GLOBAL_OPTIONS: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.register("action", "parsers", _SubParsers)
        self._command_groups: tuple[tuple[str, tuple[str, ...]], ...] = ()
        self._examples: tuple[tuple[str, str], ...] = ()
        for flag, text in self.GLOBAL_OPTIONS:
            self.add_argument(flag, action="store_true", default=argparse.SUPPRESS, help=text)

    @classmethod
    def top(cls, *, prog: str, description: str, version: str) -> ToolParser:
        """The tool's own parser: its global options default to off here, and only here; ``--version``."""
        parser = cls(prog=prog, description=description)
        parser.set_defaults(**{flag.lstrip("-").replace("-", "_"): False for flag, _ in cls.GLOBAL_OPTIONS})
        parser.add_argument("--version", action="version", version=f"{prog} {version}",
                            help="print the version and exit")
        return parser

    # --- grouped help -----------------------------------------------------------------------------

    def set_command_groups(self, groups: Sequence[tuple[str, Sequence[str]]],
                           examples: Sequence[tuple[str, str]] = ()) -> None:
        """List the subcommands under these headings in ``--help`` (every command in exactly one
        group: ``ungrouped_commands`` says which are not), then ``examples``."""
        self._command_groups = tuple((title, tuple(names)) for title, names in groups)
        self._examples = tuple(examples)

    def commands(self) -> dict[str, str]:
        """This parser's subcommands and their one-line help, in the order they were added."""
        return {a.dest: a.help or "" for a in self._subparsers_action()._choices_actions}

    def ungrouped_commands(self) -> list[str]:
        """Subcommands in no group, or in more than one (empty when the groups are right)."""
        grouped = [name for _, names in self._command_groups for name in names]
        return sorted({n for n in self.commands() if grouped.count(n) != 1} | (set(grouped) - set(self.commands())))

    def _subparsers_action(self) -> argparse._SubParsersAction[Any]:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action
        raise LookupError(f"{self.prog} has no subcommands")

    def format_help(self) -> str:
        if not self._command_groups:
            return super().format_help()
        head = self._get_formatter()
        head.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        head.add_text(self.description)
        text = head.format_help()
        helps = self.commands()
        width = max(len(n) for n in helps) + 2
        for title, names in self._command_groups:
            text += f"\n{title}:\n" + "".join(f"  {name:<{width}}{helps.get(name, '')}\n" for name in names)
        options = self._get_formatter()
        for group in self._action_groups:
            actions = [a for a in group._group_actions if not isinstance(a, argparse._SubParsersAction)]
            if actions:
                options.start_section(group.title)
                options.add_arguments(actions)
                options.end_section()
        text += "\n" + options.format_help()
        if self._examples:
            text += "\n" + examples_text(self._examples) + "\n"
        text += f"\nRun '{self.prog} COMMAND --help' for a command's options.\n"
        return text

    # --- did you mean -----------------------------------------------------------------------------

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's own check, with the closest choices named (a mistyped command or value).
        if action.choices is not None and value not in action.choices:
            known = [str(c) for c in action.choices]
            hint = did_you_mean(str(value), known)
            if not hint:
                hint = f" (choose from {', '.join(known)})"
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}{hint}")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            known = sorted(set(_option_strings(self)))
            described = [e + did_you_mean(e, known) if e.startswith("-") else e for e in extras]
            self.error(f"unrecognized arguments: {' '.join(described)}")
        return parsed

    def error(self, message: str) -> NoReturn:
        # argparse's format (usage, then "prog: error: ..."), and where to look next.
        self.print_usage()
        self.exit(2, f"{self.prog}: error: {message}\nRun '{self.prog} --help' for help.\n")


def _option_strings(parser: argparse.ArgumentParser) -> Iterator[str]:
    """Every option string of ``parser`` and of all its subcommands."""
    for action in parser._actions:
        yield from action.option_strings
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _option_strings(child)


def walk(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """``parser`` and every subcommand's parser below it, each with its command path (for the
    CLI reference and the tests)."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from walk(child, (*path, name))
