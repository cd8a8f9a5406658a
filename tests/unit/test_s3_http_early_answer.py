"""``ChunkHTTP`` (store/s3_http.py) against a server that answers a large PUT with an
error before reading its body and closes the connection, as S3 front ends do for a
request they refuse from its headers (no ``Expect: 100-continue`` is sent).  The error
the server gave must reach the caller, not the broken pipe that sending the rest of the
body ran into.  The server is a real socket peer on loopback; nothing is mocked."""

from __future__ import annotations

import hashlib
import socket
import threading

import pytest

from ckptfs.store import S3Store, StoreError, is_permanent

_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
           b"<Message>Access Denied</Message></Error>")


class EarlyAnswerServer:
    """Reads a request's headers, answers 403 AccessDenied at once and closes without
    reading the body (the kernel resets the connection: unread bytes were pending)."""

    def __init__(self, close_header: bool = True) -> None:
        self.close_header = close_header
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(8)
        self.port = self.listener.getsockname()[1]
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                head = b""
                while b"\r\n\r\n" not in head:
                    piece = conn.recv(65536)
                    if not piece:
                        break
                    head += piece
                self.requests += 1
                close = b"Connection: close\r\n" if self.close_header else b""
                conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/xml\r\n"
                             b"Content-Length: %d\r\n%s\r\n%s" % (len(_DENIED), close, _DENIED))

    def close(self) -> None:
        self.listener.close()


def _env(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDTEST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def test_an_error_answered_before_the_body_was_read_is_the_error_reported(monkeypatch):
    _env(monkeypatch)
    server = EarlyAnswerServer()
    try:
        store = S3Store("bucket", "p", f"http://127.0.0.1:{server.port}", timeout=10.0)
        assert store.direct is not None
        data = bytes(32 << 20)            # far more than the socket buffers take
        with pytest.raises(StoreError) as info:
            store.put("chunks/aa/big", memoryview(data),
                      sha256=hashlib.sha256(data).hexdigest())
        assert is_permanent(info.value), info.value
        assert "access denied" in str(info.value), info.value
    finally:
        server.close()


def test_the_connection_an_early_answer_came_on_is_not_kept(monkeypatch):
    """The server did not say ``Connection: close`` but stopped reading: the connection
    is dead.  Kept, it would fail the next request, and a conditional PUT (never retried
    on a fresh connection) would report a network error instead of the server's."""
    _env(monkeypatch)
    server = EarlyAnswerServer(close_header=False)
    try:
        store = S3Store("bucket", "p", f"http://127.0.0.1:{server.port}", timeout=10.0)
        data = bytes(32 << 20)
        with pytest.raises(StoreError):
            store.put("chunks/aa/big", memoryview(data),
                      sha256=hashlib.sha256(data).hexdigest())
        with pytest.raises(StoreError) as info:
            store.put("dirs/root/x", b"entry", if_match='"abc"')
        assert is_permanent(info.value) and "access denied" in str(info.value), info.value
    finally:
        server.close()
