"""The engine: models, determinism profiles, KV capture and graft (extra ``engine``).

Not built yet: see the engine issue. It will import ``kvgraft.schemas`` and ``kvgraft.verifier``.
"""
