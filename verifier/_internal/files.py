"""Reading the verifier's input files, with one-line errors for every way it can go wrong."""

from __future__ import annotations

from pathlib import Path

from .errors import MalformedInputError


def read_input(path: Path, what: str, *, limit: int | None = None, error: type[MalformedInputError] = MalformedInputError) -> bytes:
    """Read a whole input file, refusing directories, missing files and files over ``limit``.

    ``what`` names the file in messages ("trusted-keys file"); ``error`` is the class raised.
    """
    try:
        if path.is_dir():
            raise error(f"{what} {path} is a directory, not a file")
        if limit is not None:
            size = path.stat().st_size
            if size > limit:
                raise error(f"{what} {path} is {size} bytes, more than the {limit} a {what} can be")
        return path.read_bytes()
    except FileNotFoundError as e:
        raise error(f"{what} {path} does not exist") from e
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror or e}") from e
