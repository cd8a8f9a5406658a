"""``ChunkHTTP``: whole-object PUT and GET against an S3 endpoint over ``http.client``,
signed with botocore's SigV4 signer, for the two calls that move checkpoint bytes, and
HEAD (a chunk's existence check: one per new chunk, ~3 ms of botocore CPU each, so one
per file of a small-file copy).  Conditional PUTs too (``If-Match``, and ``If-None-Match:
*`` for the create of a new name's entry at every first publish: ~1.5 ms less CPU per
request than boto3's).

botocore spends ~0.6 CPU s per GiB on a PUT and more on a GET (request serialization,
event hooks, parsing, a fresh body object per response): decision 0014 measured it.  Here
a PUT sends the caller's buffer as is (a ``memoryview`` of a reused buffer: no copy), and a
GET receives straight into the caller's buffer (``readinto``: no fresh 8 MiB object per
chunk).  Everything else (LIST, DELETE, the bucket check) stays with boto3 in
``S3Store``.

Errors come back in the store protocol's terms through ``s3.classify`` — the same
mapping the boto3 calls use — so the retry layer sees no difference.  Connections are
kept in a small pool; a kept connection the server closed while idle is retried once on
a fresh one for requests that cannot have taken effect.  Knows nothing above the store
protocol.
"""

from __future__ import annotations

import base64
import http.client
import logging
import select
import ssl
import threading
import urllib.parse
import urllib.request
import xml.etree.ElementTree as ET
import zlib
from collections.abc import Callable

from .base import StoreError, TransientStoreError

log = logging.getLogger(__name__)

EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
UNSIGNED_PAYLOAD = "UNSIGNED-PAYLOAD"

try:                        # hardware CRC32C (SSE4.2): ~0.15 s/GiB against zlib's ~0.8
    import crc32c as _crc32c_module
    _crc32c: Callable[..., int] | None = _crc32c_module.crc32c
except ImportError:         # pragma: no cover - a stale environment: zlib's CRC32
    _crc32c = None


def transfer_checksum(body) -> tuple[str, str]:
    """An S3 additional-checksum header for ``body`` (bytes-like), for a PUT whose caller
    names no sha256: the server refuses the PUT if the bytes it received differ (S3 and
    SeaweedFS both check it).  CRC32C where the ``crc32c`` package is installed,
    CRC32 otherwise.  Integrity in transit only: a chunk's identity is its content
    address, checked again on every read."""
    if _crc32c is not None:
        return "x-amz-checksum-crc32c", \
            base64.b64encode(_crc32c(body).to_bytes(4, "big")).decode()
    return "x-amz-checksum-crc32", \
        base64.b64encode(zlib.crc32(body).to_bytes(4, "big")).decode()


def _signer_class():
    """An S3 SigV4 signer that signs the payload digest the request names (we always know
    it: a chunk's content address, or the empty body's) instead of hashing the body."""
    from botocore.auth import S3SigV4Auth

    class DigestNamedS3SigV4Auth(S3SigV4Auth):
        def payload(self, request):
            return request.context["payload_sha256"]

    return DigestNamedS3SigV4Auth


class _Connections:
    """Idle keep-alive connections to one endpoint, reused last-in first-out."""

    def __init__(self, scheme: str, netloc: str, timeout: float, keep: int,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.scheme = scheme
        self.netloc = netloc
        self.timeout = timeout
        self.keep = keep
        self.ssl_context = ssl_context
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def take(self) -> tuple[http.client.HTTPConnection, bool]:
        """A connection, and whether it was kept from an earlier request."""
        while True:
            with self._lock:
                if not self._idle:
                    break
                conn = self._idle.pop()
            if not _dropped(conn):
                return conn, True
            conn.close()      # closed by the server while idle: never sent a request on
        if self.scheme == "https":
            conn = http.client.HTTPSConnection(self.netloc, timeout=self.timeout,
                                               context=self.ssl_context)
        else:
            conn = http.client.HTTPConnection(self.netloc, timeout=self.timeout)
        return conn, False

    def give(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            if len(self._idle) < self.keep:
                self._idle.append(conn)
                return
        conn.close()


def _dropped(conn: http.client.HTTPConnection) -> bool:
    """Whether an idle kept connection is no longer usable: the server closed or reset it
    (its idle timeout), or sent something unasked.  An idle connection has nothing to
    read; finding it dead here costs nothing, finding it dead by sending a request fails
    that request (a conditional one for good: it is not resent on a fresh connection)."""
    sock = conn.sock
    if sock is None:
        return True
    poller = select.poll()
    try:
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return True


# The bucket lives in another region than the one requests are signed for: boto3 follows
# these (its region redirector); this client does not, and hands the call back.
REDIRECT_CODES = ("PermanentRedirect", "TemporaryRedirect", "AuthorizationHeaderMalformed",
                  "IllegalLocationConstraintException")


class EndpointMismatch(StoreError):
    """The endpoint redirects the request (another region): ``S3Store`` stops using the
    direct client and goes through boto3, which follows redirects."""


class _Response:
    """Status, headers and what is left to read of one response, and the connection it
    came on (given back to the pool once the body was read whole, closed otherwise)."""

    def __init__(self, conn: http.client.HTTPConnection,
                 raw: http.client.HTTPResponse) -> None:
        self.conn = conn
        self.raw = raw
        self.status = raw.status
        self.etag = raw.getheader("ETag", "") or ""
        length = raw.getheader("Content-Length")
        self.length = int(length) if length is not None and length.isdigit() else None


class ChunkHTTP:
    """PUT, GET and HEAD of whole objects of one bucket, path-style, over plain ``http.client``.

    ``classify(code, status, message, key)`` turns an S3 error into the store's error;
    ``credentials()`` returns botocore frozen credentials (refreshed by botocore)."""

    def __init__(self, endpoint_url: str, bucket: str, region: str,
                 credentials: Callable[[], object],
                 classify: Callable[[str, int, str, str], StoreError],
                 timeout: float, keep: int = 32,
                 ca_bundle: str | None = None) -> None:
        """``ca_bundle``: the CA certificates file boto3 verifies the endpoint with (its
        ``verify`` setting resolved: ``AWS_CA_BUNDLE``, ``ca_bundle``, ...); None: the
        system's."""
        parts = urllib.parse.urlsplit(endpoint_url)
        self.base_path = parts.path.rstrip("/") + "/" + urllib.parse.quote(bucket, safe="")
        self.origin = f"{parts.scheme}://{parts.netloc}"
        self.region = region
        self.credentials = credentials
        self.classify = classify
        self._signer = _signer_class()
        context = ssl.create_default_context(cafile=ca_bundle) \
            if parts.scheme == "https" else None
        self._pool = _Connections(parts.scheme, parts.netloc, timeout, keep, context)

    @staticmethod
    def usable_for(endpoint_url: str | None) -> bool:
        """Whether requests to this endpoint can go direct: plain http(s), and no proxy
        configured for it in the environment (boto3 honours those; this client does not)."""
        if not endpoint_url:
            return False
        parts = urllib.parse.urlsplit(endpoint_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False
        proxies = urllib.request.getproxies()
        if parts.scheme in proxies and not urllib.request.proxy_bypass(parts.hostname):
            return False
        return True

    # ---------------------------------------------------------------- requests

    def put(self, key: str, body, sha256: str | None, if_match: str | None = None,
            if_none_match: bool = False) -> str:
        """Store ``body`` (bytes-like) under ``key``; ``sha256`` is its hex digest (sent
        for the server to verify, and signed).  Without one (a chunk named by another
        hash) the body is not hashed again: the payload is sent unsigned and a CRC
        (``transfer_checksum``) lets the server check it.  Returns the new ETag."""
        if sha256 is not None:
            headers = {"x-amz-checksum-sha256": b64_digest(sha256)}
            payload = sha256
        else:
            name, value = transfer_checksum(body)
            headers, payload = {name: value}, UNSIGNED_PAYLOAD
        if if_match is not None:
            headers["If-Match"] = if_match
        if if_none_match:
            headers["If-None-Match"] = "*"      # a create: PreconditionFailed if it exists

        def consume(response: _Response) -> str:
            response.raw.read()
            return response.etag
        # A retry on a fresh connection is safe unless the write was conditional: an
        # unconditional PUT of the same bytes is idempotent.
        return self._exchange("PUT", key, headers, body, payload,
                              if_match is None and not if_none_match, consume)

    def get_into(self, key: str, buffer) -> tuple[int, str]:
        """Receive the object ``key`` into ``buffer`` (a writable bytes-like object):
        (its length, its ETag).  A body longer than the buffer is not read: its length is
        returned and the buffer holds nothing meaningful."""
        def consume(response: _Response) -> tuple[int, str]:
            if response.length is None:             # no length given: a chunked reply
                data = response.raw.read()
                if len(data) <= len(buffer):
                    memoryview(buffer)[:len(data)] = data
                return len(data), response.etag
            if response.length > len(buffer):
                return response.length, response.etag      # not read: connection closed
            with memoryview(buffer) as view:
                got = 0
                while got < response.length:
                    n = response.raw.readinto(view[got:response.length])
                    if not n:
                        raise http.client.IncompleteRead(b"", response.length - got)
                    got += n
            return got, response.etag
        return self._exchange("GET", key, {}, None, EMPTY_SHA256, True, consume)

    def head(self, key: str) -> str:
        """The ETag of the object ``key``; ``NotFound`` (from ``classify``) when there
        is none.  A HEAD answer has no body: the connection goes back to the pool."""
        def consume(response: _Response) -> str:
            response.raw.read()
            return response.etag
        return self._exchange("HEAD", key, {}, None, EMPTY_SHA256, True, consume)

    def get(self, key: str) -> tuple[bytes, str]:
        def consume(response: _Response) -> tuple[bytes, str]:
            body = response.raw.read()
            if response.length is not None and len(body) != response.length:
                raise http.client.IncompleteRead(body, response.length - len(body))
            return body, response.etag
        return self._exchange("GET", key, {}, None, EMPTY_SHA256, True, consume)

    def _exchange(self, method: str, key: str, headers: dict[str, str], body,
                  payload_sha256: str, retry_stale: bool, consume):
        """Send one request, check its status, let ``consume`` read the body; network
        failures at any point become ``TransientStoreError``."""
        response = self._request(method, key, headers, body, payload_sha256, retry_stale)
        try:
            self._check(response, key)
            return consume(response)
        except (OSError, http.client.HTTPException) as exc:
            raise _transient(exc, method, key) from None
        finally:
            self._finish(response)

    # ---------------------------------------------------------------- plumbing

    def _signed_headers(self, method: str, path: str, headers: dict[str, str],
                        payload_sha256: str) -> dict[str, str]:
        from botocore.awsrequest import AWSRequest

        request = AWSRequest(method=method, url=self.origin + path, headers=headers)
        request.context["payload_sha256"] = payload_sha256
        self._signer(self.credentials(), "s3", self.region).add_auth(request)
        return dict(request.headers.items())

    def _request(self, method: str, key: str, headers: dict[str, str], body,
                 payload_sha256: str, retry_stale: bool) -> _Response:
        path = self.base_path + "/" + urllib.parse.quote(key, safe="/~")
        while True:
            signed = self._signed_headers(method, path, headers, payload_sha256)
            signed["Content-Length"] = str(len(body) if body is not None else 0)
            conn, kept = self._pool.take()
            try:
                conn.putrequest(method, path, skip_accept_encoding=True)
                for name, value in signed.items():
                    conn.putheader(name, value)
                conn.endheaders()
                if body is not None and len(body):
                    try:
                        conn.sock.sendall(body)
                    except (BrokenPipeError, ConnectionResetError):
                        # The server may have refused the request from its headers and
                        # closed without reading the body: its answer says why.
                        early = _early_answer(conn)
                        if early is None:
                            raise
                        return _Response(conn, early)
                return _Response(conn, conn.getresponse())
            except (http.client.RemoteDisconnected, BrokenPipeError,
                    ConnectionResetError) as exc:
                conn.close()
                if kept and retry_stale:
                    log.debug("kept connection closed by the server (%s): new one", exc)
                    continue
                raise _transient(exc, method, key) from None
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                raise _transient(exc, method, key) from None

    def _check(self, response: _Response, key: str) -> None:
        if 200 <= response.status < 300:
            return
        text = response.raw.read()
        code, message = _error_fields(text)
        if response.status in (301, 307) or code in REDIRECT_CODES:
            raise EndpointMismatch(f"{code or response.status} on {key}: {message}")
        raise self.classify(code, response.status, message, key)

    def _finish(self, response: _Response) -> None:
        """Give the connection back if its response was read to the end and the server
        keeps it open; close it otherwise."""
        if response.raw.isclosed() and not response.raw.will_close:
            self._pool.give(response.conn)
        else:
            response.raw.close()
            response.conn.close()


def _early_answer(conn: http.client.HTTPConnection) -> http.client.HTTPResponse | None:
    """The error response a server sent before it stopped reading our body, if it did
    (a success cannot come before the whole body): None otherwise."""
    try:
        response = conn.getresponse()
    except (OSError, http.client.HTTPException):
        return None
    if 200 <= response.status < 300:
        response.close()
        return None
    response.will_close = True      # half our body is still unsent: never reused
    return response


def _transient(exc: BaseException, method: str, key: str) -> TransientStoreError:
    kind = "timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
    return TransientStoreError(f"{kind} on {method} {key}: {exc}")


def b64_digest(hex_digest: str) -> str:
    """A hex sha256 as S3's checksum headers carry it (base64 of the raw digest)."""
    return base64.b64encode(bytes.fromhex(hex_digest)).decode()


def _error_fields(text: bytes) -> tuple[str, str]:
    """(Code, Message) of an S3 XML error body; empty strings if there is none (a HEAD,
    or a proxy's own error page)."""
    if not text:
        return "", ""
    try:
        root = ET.fromstring(text)
    except ET.ParseError:
        return "", text[:200].decode("utf-8", "replace")
    return (root.findtext("Code") or "").strip(), (root.findtext("Message") or "").strip()
