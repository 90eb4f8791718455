"""``python -m kvgraft.schemas``: regenerate the JSON Schema files under schemas/json/."""

import sys

from ._internal.documents import write_json_schemas


def main() -> int:
    """Write the schema files and list them on stdout."""
    for path in write_json_schemas():
        sys.stdout.write(f"wrote {path}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
