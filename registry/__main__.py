"""``python -m kvgraft.registry``: the registry commands (serve, token, key) on their own."""

from .cli import main

raise SystemExit(main())
