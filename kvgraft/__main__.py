"""``python -m kvgraft`` runs the ``kvgraft`` command."""

from .cli import run

run()
