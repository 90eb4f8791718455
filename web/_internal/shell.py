"""Shell words for the commands the pages tell users to paste: each value is exactly one word.

A command on a page is built from words, never by putting text into a command string: every
interpolated value (a subject name, a directory, a digest, a URL, a path) goes through
``shell_word``, so ``$()``, backticks, ``;``, quotes and newlines in it stay data.
"""

from __future__ import annotations

import shlex

from .render import invisible_pattern

#: Shell parameter a page's commands use for the registry's address when the server knows none.
REGISTRY_VARIABLE = "REGISTRY"


def shell_word(value: str) -> str:
    """``value`` as one POSIX-shell word that bash reads back as exactly ``value``.

    Printable text goes through ``shlex.quote`` (single quotes: nothing inside expands). Text
    holding a newline, tab, control, bidi, zero-width or other invisible character is written in
    ANSI-C quoting, ``$'...'``, with each such character as the ``\\xHH`` escapes of its UTF-8
    bytes: the command stays on one line and shows what it does (a bidi override cannot reorder
    what is displayed, a newline cannot pose as the start of another command).
    """
    if "\n" not in value and "\t" not in value and invisible_pattern().search(value) is None:
        return shlex.quote(value)
    out = []
    for ch in value:
        if ch in "\\'":
            out.append("\\" + ch)
        elif ch in "\n\t" or invisible_pattern().fullmatch(ch):
            out.append("".join(f"\\x{b:02x}" for b in ch.encode("utf-8", "surrogatepass")))
        else:
            out.append(ch)
    return "$'" + "".join(out) + "'"


def url_word(base: str | None, path: str) -> str:
    """The shell word for ``base`` + ``path``: one quoted URL, or ``"$REGISTRY"`` + the quoted path.

    ``base`` is the registry's own address (its configured public URL or bind address); with
    none the command reads the address from the ``REGISTRY`` variable, which the page says to set.
    """
    if base is None:
        return f'"${REGISTRY_VARIABLE}"' + shell_word(path)
    return shell_word(base + path)


def command(*words: str) -> str:
    """One command line from words that are already shell words (see ``shell_word``)."""
    return " ".join(words)
