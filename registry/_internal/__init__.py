"""The registry's internals; the public surface is ``kvgraft.registry``."""
