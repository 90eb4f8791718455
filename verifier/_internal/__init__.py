"""Implementation modules of the verifier; import from ``kvgraft.verifier`` instead."""
