"""The registry's blob wing: content-addressed stores behind one ``BlobStore`` interface.

- ``store.py``: the interface, its checks (verify, scrub, quarantine) and the data directory's store;
- ``s3.py``: an S3-compatible object store;
- ``factory.py``: which store the settings name; the only module that knows both stores, so
  that ``s3.py`` builds on ``store.py`` and never the other way.

What ``--blob-store`` and the S3 settings say is ``blobconfig.py``, beside ``settings.py`` (which
holds them) rather than here: the settings sit below every wing.
"""
