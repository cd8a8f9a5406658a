"""A loopback TCP proxy that can reset connections: real network faults between ckptfs
and the S3 server, below boto3 (no mocks)."""

from __future__ import annotations

import socket
import struct
import threading


class ResettingProxy:
    """Forwards 127.0.0.1:<port> to a target; while ``resets_left`` > 0, each new
    connection is accepted and immediately reset (RST), as a flaky network would."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.resets_left = 0
        self.resets_done = 0
        self._lock = threading.Lock()
        self._stop = False
        self._active: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self._lock:
                reset = self.resets_left > 0
                if reset:
                    self.resets_left -= 1
                    self.resets_done += 1
            if reset:
                self._rst(client)
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._active.add(client)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    @staticmethod
    def _rst(sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        except OSError:
            pass

    def reset_all_and_next(self, n: int) -> None:
        """Reset every open connection (a network blip) and the next ``n`` new ones."""
        with self._lock:
            active, self._active = self._active, set()
            self.resets_left = n
        for sock in active:
            self._rst(sock)

    def close(self) -> None:
        self._stop = True
        self.listener.close()
