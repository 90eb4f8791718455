"""The registry's storage wing: the metadata database (``db.py``: DuckDB's file or PostgreSQL behind
one API, a ``Dialect`` for what the engines do differently) and its schema (``ddl.py``: the
registry of migrations that each feature registers its tables into).

Imports run one way: this wing imports no other wing and no feature; features import it.
"""
