"""Implementation modules of the data contracts; import from ``kvgraft.schemas`` instead."""
