"""``python -m kvgraft.verifier`` runs ``kvgraft-verify``."""

from .cli import run

run()
