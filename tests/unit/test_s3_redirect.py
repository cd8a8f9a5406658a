"""A bucket in another region than the one configured: the endpoint answers the direct
client's requests with a redirect (boto3 follows those itself).  ``S3Store`` must not fail
the call: it hands object bytes to boto3 from then on, said once in the log.  The server
is a real HTTP server on loopback that redirects every request not made by botocore."""

from __future__ import annotations

import hashlib
from http.server import BaseHTTPRequestHandler

import pytest

from support.s3_direct import scripted_endpoint
from ckptfs.store import S3Store

_REDIRECT = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>PermanentRedirect</Code>'
             b"<Message>The bucket you are attempting to access must be addressed using "
             b"the specified endpoint.</Message></Error>")


class RedirectingS3(BaseHTTPRequestHandler):
    objects: dict[str, bytes] = {}
    direct_requests = 0

    def log_message(self, *args) -> None:
        pass

    def _from_botocore(self) -> bool:
        return "Botocore" in self.headers.get("User-Agent", "")

    def _redirect(self) -> None:
        type(self).direct_requests += 1
        self.send_response(301)
        self.send_header("Content-Length", str(len(_REDIRECT)))
        self.end_headers()
        self.wfile.write(_REDIRECT)

    def do_PUT(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if not self._from_botocore():
            return self._redirect()
        self.objects[self.path] = body
        self.send_response(200)
        self.send_header("ETag", '"%s"' % hashlib.md5(body).hexdigest())
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:
        if not self._from_botocore():
            return self._redirect()
        body = self.objects[self.path]
        self.send_response(200)
        self.send_header("ETag", '"%s"' % hashlib.md5(body).hexdigest())
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def redirecting_endpoint(monkeypatch):
    RedirectingS3.objects = {}
    RedirectingS3.direct_requests = 0
    with scripted_endpoint(monkeypatch, RedirectingS3) as url:
        yield url


def test_a_redirecting_endpoint_moves_object_bytes_to_boto3(redirecting_endpoint, caplog):
    store = S3Store("bucket", "prefix", redirecting_endpoint)
    assert store.direct is not None
    data = b"chunk bytes" * 1000
    etag = store.put("chunks/ab/x", memoryview(data), sha256=hashlib.sha256(data).hexdigest())
    assert etag == '"%s"' % hashlib.md5(data).hexdigest()
    assert store.direct is None            # said once, then boto3 for good
    assert "redirects object requests" in caplog.text
    assert store.get("chunks/ab/x") == (data, etag)
    buffer = bytearray(len(data))
    assert store.get_into("chunks/ab/x", buffer) == (len(data), etag)
    assert bytes(buffer) == data
    assert RedirectingS3.direct_requests == 1
