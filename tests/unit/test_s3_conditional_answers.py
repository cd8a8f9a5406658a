"""What S3 endpoints answer a conditional PUT with, as the store's terms.

Endpoints differ on a PUT with ``If-Match`` on a key that does not exist: SeaweedFS and
Apache Ozone answer 412, others **404 NoSuchKey**.  AWS documents **409
ConditionalRequestConflict** ("retry") for a conditional write that met a concurrent
one.  The store's contract (``ObjectStore.put``)
is ``PreconditionFailed`` for the first -- every compare-and-swap in the core catches that
and reads the entry again -- and the second is transient.  Before, the 404 surfaced as
``NotFound`` from a PUT, which no caller expects of a write, and the 409 as a permanent
``StoreError``.  The server is a real HTTP server on loopback; both client paths (the
direct client and boto3) are asked."""

from __future__ import annotations

from http.server import BaseHTTPRequestHandler

import pytest

from support.s3_direct import scripted_endpoint
from ckptfs.store import PreconditionFailed, S3Store, TransientStoreError


def _error(code: str, message: str) -> bytes:
    return (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>' + code.encode()
            + b"</Code><Message>" + message.encode() + b"</Message></Error>")


class ConditionalS3(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_PUT(self) -> None:
        length = int(self.headers.get("Content-Length", 0))
        if self.headers.get("Expect", "").lower() == "100-continue":
            self.send_response_only(100)
            self.end_headers()
        self.rfile.read(length)
        if "taken" in self.path:
            status, body = 412, _error("PreconditionFailed",
                                       "At least one of the pre-conditions you specified "
                                       "did not hold")
        elif "conflict" in self.path:
            status, body = 409, _error("ConditionalRequestConflict",
                                       "A conflicting operation occurred. Retry.")
        else:
            status, body = 404, _error("NoSuchKey", "The specified key does not exist.")
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def endpoint(monkeypatch):
    with scripted_endpoint(monkeypatch, ConditionalS3) as url:
        yield url


@pytest.fixture(params=["direct", "boto3"])
def store(request, endpoint):
    s3 = S3Store("bucket", "prefix", endpoint)
    if request.param == "boto3":
        s3.direct = None
    else:
        assert s3.direct is not None
    return s3


def test_a_conditional_put_on_a_missing_key_is_a_failed_precondition(store):
    with pytest.raises(PreconditionFailed):
        store.put("dirs/root/gone", b"{}", if_match='"abc"')


def test_a_conditional_put_that_met_another_is_transient(store):
    with pytest.raises(TransientStoreError):
        store.put("dirs/root/conflict", b"{}", if_match='"abc"')


def test_a_create_of_a_taken_key_answers_none(store):
    assert store.put_if_absent("dirs/root/taken", b"{}") is None


def test_a_create_that_met_another_is_transient(store):
    with pytest.raises(TransientStoreError):
        store.put_if_absent("dirs/root/conflict", b"{}")
