"""The registry's HTTP wing: the Litestar app and everything only HTTP needs.

- ``app.py``: the API's routes and the lifespan that opens the registry (``Registry.open``);
- ``problems.py``: RFC 9457 problem answers, the ASGI edge before routing, bounded body reads;
- ``security.py``: security headers and ``scrub_paths``, the one rule that keeps the host's paths
  out of every answer;
- ``openapi.py``: the OpenAPI document from the ``schemas`` wire models;
- ``ui.py`` (with ``record_views.py`` and ``signatures.py``): the provenance browser's handlers.

Nothing below imports this wing: the service, the log, the blobs and the storage know no HTTP.
"""
