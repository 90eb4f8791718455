"""Implementation modules of the engine; import from ``kvgraft.engine`` instead."""
