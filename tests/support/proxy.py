"""A loopback TCP proxy that injects network faults between ckptfs and the S3 server:
real sockets below boto3, no mocks.

``FaultProxy.mode`` may be switched at any time while a daemon talks through it:

- ``pass``   forward bytes both ways;
- ``refuse`` accept each new connection and close it at once;
- ``hang``   accept, read and drop whatever arrives, never answer;
- ``503``    answer every request with an HTTP 503 S3 error body (then close);
- ``403``    answer every request with 403 ``AccessDenied`` (credentials revoked, an
             expired token);
- ``nobucket`` answer every request with 404 ``NoSuchBucket`` (the bucket deleted);
- ``reset``  forward the request, send half of the first piece of the response, then
             reset the connection (RST);
- ``slow``   forward, throttled to ``slow_bps`` bytes per second each way;
- ``torn``   forward a request's head, then end the connection to the server before any
             of its body (a writer SIGKILLed between the two: SeaweedFS kept an EMPTY
             object for such a PUT without a checksum header) and reset the client's.

Switching mode acts on the connections already open too: to ``hang`` they go silent;
to ``refuse``/``503``/``reset`` they are reset, so the client reconnects into the new
mode; back to ``pass``/``slow`` the hung ones are reset so the client retries at once.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter

MODES = ("pass", "refuse", "hang", "503", "403", "nobucket", "reset", "slow", "torn")
# The error-answer modes: HTTP status line and S3 error code.
_ANSWERS = {"503": (b"503 Service Unavailable", b"ServiceUnavailable"),
            "403": (b"403 Forbidden", b"AccessDenied"),
            "nobucket": (b"404 Not Found", b"NoSuchBucket")}



class _Conn:
    def __init__(self, client: socket.socket, mode: str) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        self.mode = mode        # the mode the connection was accepted in
        self.closed = False


class FaultProxy:
    """Forwards 127.0.0.1:<port> to 127.0.0.1:<target_port> with switchable faults."""

    def __init__(self, target_port: int, mode: str = "pass", slow_bps: int = 64 << 10) -> None:
        self.target_port = target_port
        self.slow_bps = slow_bps
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.port = self.listener.getsockname()[1]
        self.accepted: Counter[str] = Counter()   # connections accepted, per mode
        self.resets_left = 0                      # reset this many new connections first
        self.resets_done = 0
        # Bytes forwarded: from the server to the clients (what the store served) and
        # back.  ``count_reset`` starts a new tally.
        self.bytes_down = 0
        self.bytes_up = 0
        self._mode = "pass"
        self._lock = threading.Lock()
        self._conns: set[_Conn] = set()
        self._stop = False
        self.mode = mode
        self._acceptor = threading.Thread(target=self._accept, daemon=True,
                                          name="proxy-accept")
        self._acceptor.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown proxy mode {mode!r}; one of {MODES}")
        with self._lock:
            self._mode = mode
            conns = list(self._conns)
        for conn in conns:
            if mode == "hang":
                continue            # the pipes see the mode and go silent
            if mode in ("pass", "slow") and conn.mode in ("pass", "slow") \
                    and not self._was_hung(conn):
                continue
            self._close(conn, rst=True)

    def _was_hung(self, conn: _Conn) -> bool:
        return conn.mode == "hang" or getattr(conn, "hung", False)

    def count_reset(self) -> None:
        with self._lock:
            self.bytes_down = self.bytes_up = 0

    def _count(self, n: int, response: bool) -> None:
        with self._lock:
            if response:
                self.bytes_down += n
            else:
                self.bytes_up += n

    def reset_all_and_next(self, n: int) -> None:
        """A blip: reset every open connection and the next ``n`` new ones."""
        with self._lock:
            conns = list(self._conns)
            self.resets_left = n
        for conn in conns:
            self._close(conn, rst=True)

    def close(self) -> None:
        self._stop = True
        try:
            # Wake the accept thread first: a thread left blocked in accept() on a
            # closed listener took connections meant for the next proxy's listener
            # (same descriptor number), so they passed every fault -- the model test's
            # "wait said done during an outage" (seeds 1215064, 1215156, 1215167).
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            self._close(conn, rst=True)

    # ------------------------------------------------------------------ internals

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self._stop:          # never serve a connection after close()
                client.close()
                return
            with self._lock:
                if self.resets_left > 0:
                    self.resets_left -= 1
                    self.resets_done += 1
                    mode = "blip"
                else:
                    mode = self._mode
                self.accepted[mode] += 1
                conn = _Conn(client, mode)
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name=f"proxy-{mode}").start()

    def _serve(self, conn: _Conn) -> None:
        try:
            if conn.mode == "blip":
                self._close(conn, rst=True)
            elif conn.mode == "refuse":
                self._close(conn, rst=False)
            elif conn.mode == "hang":
                self._swallow(conn)
            elif conn.mode in _ANSWERS:
                self._answer_error(conn, *_ANSWERS[conn.mode])
            elif conn.mode == "torn":
                self._tear(conn)
            else:
                self._forward(conn)
        except OSError:
            self._close(conn, rst=True)

    def _swallow(self, conn: _Conn) -> None:
        conn.client.settimeout(None)
        while not conn.closed:
            if not conn.client.recv(1 << 16):
                break
        self._close(conn, rst=False)

    def _answer_error(self, conn: _Conn, status: bytes, code: bytes) -> None:
        sock = conn.client
        sock.settimeout(30)
        while not conn.closed:
            head = self._read_head(conn)
            if head is None:
                return
            header, _, rest = head.partition(b"\r\n\r\n")
            fields = {}
            for line in header.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                fields[name.strip().lower()] = value.strip().lower()
            length = int(fields.get(b"content-length", b"0") or 0)
            if fields.get(b"expect") != b"100-continue":
                length -= len(rest)
                while length > 0:
                    piece = sock.recv(min(length, 1 << 20))
                    if not piece:
                        break
                    length -= len(piece)
            body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>' + code +
                    b"</Code><Message>injected by the test proxy</Message></Error>")
            sock.sendall(b"HTTP/1.1 " + status + b"\r\n"
                         b"Content-Type: application/xml\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n"
                         b"Retry-After: 1\r\nConnection: close\r\n\r\n" + body)
            break
        self._close(conn, rst=False)

    def _read_head(self, conn: _Conn) -> bytes | None:
        """A request's head (and whatever came with it), or None once the client closed
        (the connection is closed then)."""
        head = b""
        while b"\r\n\r\n" not in head:
            piece = conn.client.recv(65536)
            if not piece:
                self._close(conn, rst=False)
                return None
            head += piece
        return head

    def _tear(self, conn: _Conn) -> None:
        conn.client.settimeout(30)
        head = self._read_head(conn)
        if head is None:
            return
        upstream = socket.create_connection(("127.0.0.1", self.target_port))
        upstream.sendall(head.partition(b"\r\n\r\n")[0] + b"\r\n\r\n")
        # The server reads the head (and may say 100 Continue, read here: a close with
        # unread bytes would send RST, not the FIN a killed writer's socket sends).
        upstream.settimeout(0.2)
        try:
            while upstream.recv(65536):
                pass
        except OSError:
            pass
        upstream.close()           # then the writer is gone
        time.sleep(0.3)            # the server sees the end before the client retries
        self._close(conn, rst=True)

    def _forward(self, conn: _Conn) -> None:
        try:
            conn.upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            self._close(conn, rst=True)
            return
        if conn.closed:          # reset while connecting
            conn.upstream.close()
            return
        threading.Thread(target=self._pipe, args=(conn, conn.client, conn.upstream, False),
                         daemon=True).start()
        self._pipe(conn, conn.upstream, conn.client, True)

    def _pipe(self, conn: _Conn, src: socket.socket, dst: socket.socket,
              response: bool) -> None:
        try:
            while not conn.closed:
                mode = self._mode
                size = max(1024, self.slow_bps // 10) if mode == "slow" else 1 << 20
                data = src.recv(size)
                if not data:
                    break
                mode = self._mode
                if mode == "hang":
                    conn.hung = True
                    continue                      # swallowed: the peer waits forever
                if mode == "reset" and response:
                    dst.sendall(data[:max(1, len(data) // 2)])
                    self._close(conn, rst=True)
                    return
                if mode in ("refuse", "reset", "torn", *_ANSWERS) and conn.mode != mode:
                    self._close(conn, rst=True)
                    return
                dst.sendall(data)
                self._count(len(data), response)
                if mode == "slow":
                    time.sleep(len(data) / self.slow_bps)
        except OSError:
            pass
        finally:
            if not conn.closed:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_WR if s is dst else socket.SHUT_RD)
                    except OSError:
                        pass
                if not response:
                    return
                self._close(conn, rst=False)

    def _close(self, conn: _Conn, rst: bool) -> None:
        with self._lock:
            if conn.closed:
                return
            conn.closed = True
            self._conns.discard(conn)
        for sock in (conn.client, conn.upstream):
            if sock is None:
                continue
            try:
                if rst:
                    # Linger 0 makes the last close send RST; SHUT_RD wakes a thread
                    # blocked in recv on it (a plain close would not, and the socket
                    # would live on until that recv returned).
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.shutdown(socket.SHUT_RD)
                else:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                sock.close()
            except OSError:
                pass


# The name the older tests used.
ResettingProxy = FaultProxy
