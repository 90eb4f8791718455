"""The registry service: Litestar + DuckDB, blob store, transparency log (extra ``registry``).

Not built yet: see the registry issue.
"""
