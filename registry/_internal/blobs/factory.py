"""The blob store factory: which ``BlobStore`` the settings name, opened and closed.

Apart from the stores so that imports run one way: ``s3blobs.py`` builds on ``blobs.py``, and only
this module knows both.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from .store import BlobStore, LocalBlobStore

if TYPE_CHECKING:
    from ..settings import RegistrySettings

logger = logging.getLogger("kvgraft.registry")


@contextlib.contextmanager
def open_blob_store(root: Path, settings: RegistrySettings) -> Iterator[BlobStore]:
    """The blob store ``settings.blob_store`` names (None: the directory ``root``, the data
    directory's ``blobs/``), closed when the block ends. Not prepared: the server calls
    ``prepare`` holding the data directory; ``kvgraft fsck`` only reads and quarantines."""
    store: BlobStore
    if settings.blob_store is None:
        # Several server processes on one database may share the directory (cluster.py).
        store = LocalBlobStore(root, shared=settings.database is not None)
    else:
        from ..blobconfig import MAX_S3_PARTS, parse_blob_store_url
        from .s3 import S3BlobStore

        store = S3BlobStore(parse_blob_store_url(settings.blob_store), settings.s3)
        if settings.max_blob_bytes > settings.s3.largest_blob:
            logger.info(
                "blobs larger than %d bytes (%d parts of --s3-part-size %d) are refused (413), below --max-blob-bytes %d",
                settings.s3.largest_blob, MAX_S3_PARTS, settings.s3.part_size, settings.max_blob_bytes,
            )
    with store:
        yield store
