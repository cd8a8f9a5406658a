"""Shared by the direct S3 client's tests (test_s3_direct*.py): a store on the SeaweedFS
fixture, optionally behind the loopback fault proxy, and wrong credentials."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from support.mounts import BUCKET
from support.proxy import FaultProxy
from ckptfs.store import S3Store


def direct_store(seaweed, endpoint=None, bucket=BUCKET, prefix=None, direct=True,
                 timeout=30.0) -> S3Store:
    os.environ.update(seaweed.env())
    store = S3Store(bucket, prefix or uuid.uuid4().hex[:12], endpoint or seaweed.endpoint_url,
                    timeout=timeout, direct=direct)
    assert (store.direct is not None) == direct
    return store


@contextmanager
def proxied_store(seaweed, mode: str = "pass", **kwargs) -> Iterator[tuple[S3Store, FaultProxy]]:
    """A direct store reaching SeaweedFS through a ``FaultProxy`` in ``mode``."""
    proxy = FaultProxy(seaweed.s3_port, mode=mode)
    try:
        yield direct_store(seaweed, endpoint=proxy.endpoint_url, **kwargs), proxy
    finally:
        proxy.close()


def sha(data) -> str:
    return hashlib.sha256(data).hexdigest()


class Frozen:
    """Frozen credentials as botocore hands them to a signer."""

    def __init__(self, access_key: str, secret_key: str) -> None:
        self.access_key, self.secret_key, self.token = access_key, secret_key, None


@contextmanager
def scripted_endpoint(monkeypatch, handler) -> Iterator[str]:
    """A real HTTP server on loopback answering with ``handler`` (a
    ``BaseHTTPRequestHandler`` class that plays an S3 endpoint's part), with test
    credentials and no proxy in the environment: its URL."""
    import threading
    from http.server import ThreadingHTTPServer
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
