"""The witness wing: a c2sp.org/tlog-witness cosigner (``kvgraft witness serve``), ``cosigner.py``.

It reuses the HTTP wing's edge and problem answers, and no part of the registry imports it.
"""
