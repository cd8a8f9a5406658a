"""Opening a store from its URL (``file:///path`` or ``s3://bucket/prefix``).

Knows nothing above the store protocol.
"""

from __future__ import annotations

import os
import urllib.parse
from pathlib import Path

from .base import ObjectStore
from .local import LocalStore
from .s3 import S3Store


class BadStoreURL(ValueError):
    pass


def check_store_url(url: str) -> urllib.parse.ParseResult:
    """The parts of a URL that names a store; ``BadStoreURL`` if it names none.  Builds
    nothing: ``ckptfs mount`` checks the URL before it starts a daemon, and an S3
    client (boto3's import and set-up) costs about half a CPU second."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise BadStoreURL(f"bad store URL {url!r}: use file:///absolute/path")
        if not parsed.path.startswith("/"):
            raise BadStoreURL(f"bad store URL {url!r}: the path must be absolute")
        return parsed
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise BadStoreURL(f"bad store URL {url!r}: use s3://bucket/prefix")
        return parsed
    raise BadStoreURL(f"bad store URL {url!r}: expected file:///path or s3://bucket/prefix")


def open_store(url: str, endpoint_url: str | None = None, timeout: float = 60.0,
               s3_client: str = "direct") -> ObjectStore:
    """Build the raw store a URL names (no retries, no counting); ``timeout`` is the
    overall budget of one call (an S3 client scales its socket timeouts to it);
    ``s3_client`` says how object bytes move (``S3Store``)."""
    parsed = check_store_url(url)
    if parsed.scheme == "file":
        return LocalStore(Path(urllib.parse.unquote(parsed.path)))
    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or \
        os.environ.get("AWS_ENDPOINT_URL")
    return S3Store(parsed.netloc, parsed.path, endpoint, timeout=timeout,
                   direct=s3_client == "direct")
